// The host steps of torchops.ms_deform_attn and its backward, written once
// for both devices: the checks, the contiguous operands, the outputs, the
// empty cases and the dtype dispatch.  Each device supplies its loops (a
// `Kernels` type with these static members):
//
//   Kernels::device                       c10::DeviceType
//   Kernels::guard(value)                 kept alive for the call
//   Kernels::check_levels(op, shapes, starts, spatial)
//                                         the values of spatial_shapes and
//                                         level_start_index (CPU: checked;
//                                         CUDA: nothing, no host sync)
//   Kernels::forward<scalar_t>(value, shapes, starts, loc, attn, dims, out)
//   Kernels::backward<scalar_t>(grad, value, shapes, starts, loc, attn, dims,
//                               grad_value, grad_loc, grad_attn)
//
// Every tensor handed to the loops is contiguous; out and the gradients are
// allocated here (grad_value zero-filled, the others written whole).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <tuple>

#include "common/ms_deform_attn.h"

namespace torchops {

template <typename Kernels>
at::Tensor ms_deform_attn_forward(const at::Tensor& value_in, const at::Tensor& shapes_in,
                                  const at::Tensor& starts_in, const at::Tensor& loc_in,
                                  const at::Tensor& attn_in) {
  const char* op = "ms_deform_attn";
  const MsdaDims d = check_ms_deform_attn(op, value_in, shapes_in, starts_in, loc_in, attn_in,
                                          Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(value_in);
  const at::Tensor shapes = shapes_in.contiguous(), starts = starts_in.contiguous();
  Kernels::check_levels(op, shapes, starts, d.spatial);
  // Every element is written (zero where no sample lands).
  at::Tensor out = new_output(op, {d.batch, d.queries, d.heads * d.channels},
                              value_in.options());
  if (out.numel() == 0) {
    return out;
  }
  const at::Tensor value = value_in.contiguous(), loc = loc_in.contiguous(),
                   attn = attn_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "torchops.ms_deform_attn", [&] {
        Kernels::template forward<scalar_t>(value, shapes, starts, loc, attn, d, out);
      });
  return out;
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const at::Tensor& grad_in, const at::Tensor& value_in, const at::Tensor& shapes_in,
    const at::Tensor& starts_in, const at::Tensor& loc_in, const at::Tensor& attn_in) {
  const char* op = "_ms_deform_attn_backward";
  const MsdaDims d = check_ms_deform_attn(op, value_in, shapes_in, starts_in, loc_in, attn_in,
                                          Kernels::device);
  check_ms_deform_attn_backward(op, grad_in, value_in, d);
  [[maybe_unused]] const auto guard = Kernels::guard(value_in);
  const at::Tensor shapes = shapes_in.contiguous(), starts = starts_in.contiguous();
  Kernels::check_levels(op, shapes, starts, d.spatial);
  at::Tensor grad_value = new_output(op, value_in.sizes(), value_in.options(), /*zero=*/true);
  at::Tensor grad_loc = new_output(op, loc_in.sizes(), loc_in.options(), /*zero=*/true);
  at::Tensor grad_attn = new_output(op, attn_in.sizes(), attn_in.options(), /*zero=*/true);
  if (grad_loc.numel() == 0 || d.channels == 0 || d.spatial == 0) {
    // No sample reads anything: every gradient is zero.
    return {grad_value, grad_loc, grad_attn};
  }
  const at::Tensor grad = grad_in.contiguous(), value = value_in.contiguous(),
                   loc = loc_in.contiguous(), attn = attn_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "torchops._ms_deform_attn_backward", [&] {
        Kernels::template backward<scalar_t>(grad, value, shapes, starts, loc, attn, d,
                                             grad_value, grad_loc, grad_attn);
      });
  return {grad_value, grad_loc, grad_attn};
}

}  // namespace torchops
