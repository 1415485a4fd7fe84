// The host steps of torchops.sigmoid_focal_loss and its backward, written
// once for both devices: the checks, the contiguous operands, the outputs,
// the empty cases and the dtype dispatch are the same; each device supplies
// its kernels (a `Kernels` type with the static members below).
//
//   Kernels::device                  c10::DeviceType
//   Kernels::guard(inputs)           kept alive for the call
//                                    (CUDA: the device guard)
//   Kernels::loss<scalar_t>(c)       fills c.out: n values for "none", one
//                                    for "mean" and "sum" (n > 0)
//   Kernels::grad<scalar_t>(c)       fills c.out with the gradient (n > 0)
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <limits>

#include "common/sigmoid_focal_loss.h"

namespace torchops {

// One call as the kernels see it: contiguous operands of n elements.
template <typename scalar_t>
struct FocalCall {
  const scalar_t* x;
  const scalar_t* t;
  // The backward's incoming gradient: n values for "none", else one.
  const scalar_t* grad;
  scalar_t* out;
  int64_t n;
  FocalParams<at::opmath_type<scalar_t>> prm;
  FocalGamma kind;
  Reduction red;
  at::TensorOptions options;  // the inputs': for scratch buffers
};

template <typename scalar_t>
FocalCall<scalar_t> focal_call(const at::Tensor& x, const at::Tensor& t,
                               const scalar_t* grad, at::Tensor& out,
                               double alpha, double gamma, Reduction red) {
  return {x.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(), grad,
          out.mutable_data_ptr<scalar_t>(), x.numel(),
          focal_params<at::opmath_type<scalar_t>>(alpha, gamma),
          focal_gamma_kind(gamma), red, x.options()};
}

template <typename Kernels>
at::Tensor sigmoid_focal_loss_forward(const at::Tensor& inputs_in,
                                      const at::Tensor& targets_in,
                                      double alpha, double gamma,
                                      c10::string_view reduction) {
  const Reduction red = check_sigmoid_focal_loss(
      inputs_in, targets_in, gamma, reduction, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(inputs_in);
  const at::Tensor x = inputs_in.contiguous();
  const at::Tensor t = targets_in.contiguous();
  const int64_t n = x.numel();
  if (red != Reduction::None && n == 0) {
    // The mean of nothing is nan, as in torch.mean.
    return at::empty({}, x.options()).fill_(
        red == Reduction::Mean ? std::numeric_limits<double>::quiet_NaN() : 0.0);
  }
  at::Tensor out = red == Reduction::None
      ? at::empty(x.sizes(), x.options())
      : at::empty({}, x.options());
  if (n == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "torchops.sigmoid_focal_loss",
      [&] {
        Kernels::template loss<scalar_t>(focal_call<scalar_t>(
            x, t, nullptr, out, alpha, gamma, red));
      });
  return out;
}

template <typename Kernels>
at::Tensor sigmoid_focal_loss_backward(
    const at::Tensor& grad_in, const at::Tensor& inputs_in,
    const at::Tensor& targets_in, double alpha, double gamma,
    c10::string_view reduction) {
  const Reduction red = check_sigmoid_focal_loss_backward(
      grad_in, inputs_in, targets_in, gamma, reduction, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(inputs_in);
  const at::Tensor x = inputs_in.contiguous();
  const at::Tensor t = targets_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(),
      "torchops._sigmoid_focal_loss_backward", [&] {
        Kernels::template grad<scalar_t>(focal_call<scalar_t>(
            x, t, grad.const_data_ptr<scalar_t>(), out, alpha, gamma, red));
      });
  return out;
}

}  // namespace torchops
