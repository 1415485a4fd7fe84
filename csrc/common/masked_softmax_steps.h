// The host steps of torchops.scaled_masked_softmax,
// torchops.scaled_upper_triang_masked_softmax and their backward ops,
// written once for both devices: the checks, the contiguous operands, the
// output, the empty cases and the dtype dispatch are the same; each device
// supplies its row loops (a `Kernels` type with the static members below).
//
//   Kernels::device                       c10::DeviceType
//   Kernels::guard(t)                     kept alive for the call
//                                         (CUDA: the device guard)
//   Kernels::forward<scalar_t>(call)      SoftmaxForward: y from x (and mask)
//   Kernels::backward<scalar_t>(call)     SoftmaxBackward: dx from dy and y
//
// Every row of the output is written, its masked keys with zeros; a causal
// row reads only its first q + 1 keys.  Header-only, like the rest of
// csrc/common: the CPU and CUDA libraries each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "common/masked_softmax.h"

namespace torchops {

template <typename scalar_t>
struct SoftmaxForward {
  const scalar_t* x;
  const bool* mask;  // contiguous (mask_batch, 1, Sq, Sk), or nullptr
  scalar_t* y;
  SoftmaxRows shape;
  at::opmath_type<scalar_t> scale;
};

template <typename scalar_t>
struct SoftmaxBackward {
  const scalar_t* dy;
  const scalar_t* y;
  scalar_t* dx;
  SoftmaxRows shape;
  at::opmath_type<scalar_t> scale;
};

template <typename Kernels>
at::Tensor masked_softmax_forward_steps(const at::Tensor& input_in,
                                        const std::optional<at::Tensor>& mask_in,
                                        const SoftmaxRows& shape, double scale) {
  [[maybe_unused]] const auto guard = Kernels::guard(input_in);
  const at::Tensor x = input_in.contiguous();
  const at::Tensor mask = mask_in.has_value() ? mask_in->contiguous() : at::Tensor();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) {
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "torchops.masked_softmax", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Kernels::template forward<scalar_t>(SoftmaxForward<scalar_t>{
        x.const_data_ptr<scalar_t>(),
        mask.defined() ? mask.const_data_ptr<bool>() : nullptr,
        y.mutable_data_ptr<scalar_t>(), shape, static_cast<acc_t>(scale)});
  });
  return y;
}

template <typename Kernels>
at::Tensor masked_softmax_backward_steps(const at::Tensor& grad_in,
                                         const at::Tensor& output_in,
                                         const SoftmaxRows& shape, double scale) {
  [[maybe_unused]] const auto guard = Kernels::guard(output_in);
  const at::Tensor y = output_in.contiguous();
  const at::Tensor dy = grad_in.contiguous();
  at::Tensor dx = at::empty(y.sizes(), y.options());
  if (dx.numel() == 0) {
    return dx;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, y.scalar_type(), "torchops.masked_softmax_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Kernels::template backward<scalar_t>(SoftmaxBackward<scalar_t>{
        dy.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
        dx.mutable_data_ptr<scalar_t>(), shape, static_cast<acc_t>(scale)});
  });
  return dx;
}

template <typename Kernels>
at::Tensor scaled_masked_softmax_forward(const at::Tensor& input, const at::Tensor& mask,
                                         double scale) {
  const SoftmaxRows shape = check_scaled_masked_softmax(input, mask, Kernels::device);
  return masked_softmax_forward_steps<Kernels>(input, mask, shape, scale);
}

template <typename Kernels>
at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad, const at::Tensor& output,
                                          double scale) {
  const SoftmaxRows shape = check_softmax_backward(
      "_scaled_masked_softmax_backward", grad, output, /*causal=*/false, Kernels::device);
  return masked_softmax_backward_steps<Kernels>(grad, output, shape, scale);
}

template <typename Kernels>
at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input, double scale) {
  const SoftmaxRows shape =
      check_scaled_upper_triang_masked_softmax(input, Kernels::device);
  return masked_softmax_forward_steps<Kernels>(input, std::nullopt, shape, scale);
}

template <typename Kernels>
at::Tensor scaled_upper_triang_masked_softmax_backward(const at::Tensor& grad,
                                                       const at::Tensor& output,
                                                       double scale) {
  const SoftmaxRows shape =
      check_softmax_backward("_scaled_upper_triang_masked_softmax_backward", grad, output,
                             /*causal=*/true, Kernels::device);
  return masked_softmax_backward_steps<Kernels>(grad, output, shape, scale);
}

}  // namespace torchops
