// The host steps of torchops.d_sigmoid and its backward, written once for
// both devices: the checks, the contiguous operands, the output and the
// dtype dispatch are the same; each device supplies its loops over
// contiguous arrays (a `Kernels` type with the static members below).
//
//   Kernels::device                          c10::DeviceType
//   Kernels::guard(z)                        kept alive for the call
//                                            (CUDA: the device guard)
//   Kernels::value<scalar_t>(z, out, n)      out[i] = d_sigmoid(z[i])
//   Kernels::grad<scalar_t>(g, z, out, n)    out[i] = its gradient times g[i]
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "common/d_sigmoid.h"

namespace torchops {

template <typename Kernels>
at::Tensor d_sigmoid_forward(const at::Tensor& z_in) {
  check_d_sigmoid(z_in, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(z_in);
  const at::Tensor z = z_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(), "torchops.d_sigmoid", [&] {
        Kernels::template value<scalar_t>(z.const_data_ptr<scalar_t>(),
                                          out.mutable_data_ptr<scalar_t>(),
                                          z.numel());
      });
  return out;
}

template <typename Kernels>
at::Tensor d_sigmoid_backward(const at::Tensor& grad_in, const at::Tensor& z_in) {
  check_d_sigmoid_backward(grad_in, z_in, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(z_in);
  const at::Tensor z = z_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(),
      "torchops._d_sigmoid_backward", [&] {
        Kernels::template grad<scalar_t>(grad.const_data_ptr<scalar_t>(),
                                         z.const_data_ptr<scalar_t>(),
                                         out.mutable_data_ptr<scalar_t>(),
                                         z.numel());
      });
  return out;
}

}  // namespace torchops
