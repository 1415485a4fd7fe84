// The steps of torchops.masked_conv2d and its backward, written once for
// both devices: each device supplies the data-parallel kernels and its GEMM
// (a `Kernels` type with the static functions below).  The op is a
// convolution, so its float32 precision is the convolution's, not the
// matmul's: on CUDA, TF32 exactly where PyTorch lets conv2d use it
// (cuda/common/conv_precision.cuh), in the sparse GEMMs and the dense
// hand-off alike, so the precision never depends on the mask; on CPU,
// exact whatever the flags.
//
//   Kernels::positions(mask, g, meanwhile)       -> MaskedPositions; calls
//                                                  meanwhile(pending) once,
//                                                  while the count is in
//                                                  flight
//   Kernels::gather_cols_ahead(input, g, pending) -> the columns gathered
//                                                  before the count is known
//                                                  (or none), into a buffer
//                                                  of their own capacity
//   Kernels::clear_output(out)                     with write_output, writes
//                                                  every element of out
//   Kernels::expects_dense(input, g)              whether the device
//                                                  expects the hand-off
//                                                  below: its convolution is
//                                                  then queued while the
//                                                  count is in flight
//   Kernels::dense_conv(input, weight, ...)       that convolution
//   Kernels::dense_forward(input, ..., g, pos, early_conv, out) -> whether
//                                                  it wrote out itself,
//                                                  densely (a device may hand
//                                                  dense masks off), from
//                                                  early_conv where queued
//   Kernels::gather_cols(input, pos, g) -> cols     (G, P, K), in the memory
//                                                  order the device's GEMM
//                                                  reads best
//   Kernels::forward_gemm(weight3, cols)            weight (G, C_out / G, K) @
//                                                  the columns, in the
//                                                  orientation the device's
//                                                  write_output reads
//   Kernels::write_output(product, bias, pos, g, out)
//   Kernels::gemm(a, b) -> a @ b                  2-D or batched 3-D, in
//                                                  the op's precision
//   Kernels::gather_grad(grad, pos, g, grad_cols)  grad_cols (C_out, P)
//   Kernels::col2im(grad_cols, pos, g, grad_input) grad_cols (G, K, P)
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>

#include <array>
#include <functional>
#include <optional>
#include <tuple>

#include "common/accumulate.h"
#include "common/masked_conv2d.h"
#include "common/library_matmul.h"
#include "common/env.h"

namespace torchops {

// The masked positions of one call.  `positions` has P entries, the flat
// indices n * H_out * W_out + oh * W_out + ow of the selected positions in
// ascending order; where P had to be fixed before the mask was read (CUDA
// graph capture), P is every position of the batch and the entries past
// the selected ones are -1.  `index_map` (N * H_out * W_out) holds each
// position's rank in `positions`, or -1.  Both are int64.
struct MaskedPositions {
  at::Tensor positions;
  at::Tensor index_map;
  bool padded = false;  // P fixed before the mask was read

  int64_t count() const { return positions.size(0); }
  // Whether the mask selects every position of the batch.
  bool all_selected(const MaskedConvGeometry& g) const {
    return !padded && count() == g.all_positions();
  }
};

// The positions while their count is still on its way to the host: the
// whole-length list (its first `count` entries will be the positions) and
// the count in device memory (null where the device has none to give).
struct PendingPositions {
  at::Tensor positions;
  const int64_t* device_count = nullptr;
};

// TORCHOPS_TESTING_MASKED_CONV_PATH=auto|sparse|dense (read at each call)
// forces the forward's path, so that tests reach both on any mask.
enum class MaskedForwardPath { kAuto, kSparse, kDense };

static_assert(env::value_at(env::kTestingMaskedConvPath, 1, "sparse") &&
              env::value_at(env::kTestingMaskedConvPath, 2, "dense"));

inline MaskedForwardPath masked_forward_path() {
  return static_cast<MaskedForwardPath>(
      env::choice("masked_conv2d", env::kTestingMaskedConvPath));
}

// Whether the forward may hand the call off to the library's convolution
// at all: not where the testing switch says sparse, and by default only
// where the device finds it `worth` it for this call.  An input without
// elements (no channels, or a zero height or width that only the padding
// makes room for) always stays sparse, whose columns are then all zeros:
// ATen's convolution returns no output channels for the former and rejects
// the latter, where the op's output is the bias (or zero) at the selected
// positions.
inline bool masked_conv2d_can_go_dense(bool worth, const MaskedConvGeometry& g,
                                       MaskedForwardPath path) {
  if (g.in_channels == 0 || g.height == 0 || g.width == 0) {
    return false;
  }
  return path == MaskedForwardPath::kDense || (path == MaskedForwardPath::kAuto && worth);
}

// Whether the forward hands the call off: where it can and the testing
// switch says dense, or at least `share` of the positions are selected.
inline bool masked_conv2d_goes_dense(bool worth, double share, const MaskedPositions& pos,
                                     const MaskedConvGeometry& g) {
  const MaskedForwardPath path = masked_forward_path();
  if (!masked_conv2d_can_go_dense(worth, g, path)) {
    return false;
  }
  return path == MaskedForwardPath::kDense ||
         static_cast<double>(pos.count()) >= share * static_cast<double>(g.all_positions());
}

// The dense hand-off of a device whose library convolution beats the
// sparse path on dense masks, in two steps.  First that convolution of
// every position (cuDNN, oneDNN), with `allow_tf32` as the sparse path's
// GEMM would have it so the precision never depends on the mask.
inline at::Tensor masked_conv2d_dense_conv(const at::Tensor& input, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias,
                                           c10::IntArrayRef padding, c10::IntArrayRef stride,
                                           c10::IntArrayRef dilation, int64_t groups,
                                           bool allow_tf32) {
  const c10::OptionalDeviceGuard guard(input.device());
  const auto& ctx = at::globalContext();
  const std::array<int64_t, 2> no_output_padding{0, 0};
  return at::_convolution(
      input, weight, bias, stride, padding, dilation, /*transposed=*/false, no_output_padding,
      groups, ctx.benchmarkCuDNN(), ctx.deterministicCuDNN() || ctx.deterministicAlgorithms(),
      ctx.userEnabledCuDNN(), allow_tf32);
}

// Then exactly 0 -- where(), not a product, so unread NaNs stay out --
// where the mask does not select.  Where every position is selected the
// convolution is the output itself (when contiguous, as `out` is), saving
// the where's pass over it.
inline void masked_conv2d_dense_select(const at::Tensor& conv, const at::Tensor& mask,
                                       const MaskedPositions& pos, const MaskedConvGeometry& g,
                                       at::Tensor& out) {
  if (pos.all_selected(g) && conv.is_contiguous() && conv.sizes() == out.sizes()) {
    out = conv;
    return;
  }
  const c10::OptionalDeviceGuard guard(conv.device());
  const at::Tensor selected = mask.scalar_type() == at::kBool ? mask : at::gt(mask, 0);
  // A zero on the device: a CPU scalar would be a host-to-device copy, which
  // CUDA graph capture forbids.
  at::where_out(out, selected.unsqueeze(1), conv, at::zeros({}, conv.options()));
}

template <typename Kernels>
at::Tensor masked_conv2d_forward(const at::Tensor& input, const at::Tensor& mask,
                                 const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 c10::IntArrayRef padding, c10::IntArrayRef stride,
                                 c10::IntArrayRef dilation, int64_t groups,
                                 c10::DeviceType device) {
  const char* op = "masked_conv2d";
  const MaskedConvGeometry g = check_masked_conv2d(op, input, mask, weight, bias, padding,
                                                   stride, dilation, groups, device);
  at::Tensor out = new_output(op, {g.batch, g.out_channels, g.out_h, g.out_w}, input.options());
  if (out.numel() == 0) {
    return out;
  }
  // The device reads the positions' count back to the host: the output's
  // zeros are queued behind the count, so they are written while the host
  // waits, and so are the columns, where the device can (a buffer of some
  // capacity, filled only if the count fits in it).
  // Where the device expects the dense hand-off, its convolution is queued
  // there instead, and the zeros only once the count has said otherwise.
  std::optional<at::Tensor> ahead, early_conv;
  // Views made before the wait, off the path from the count to the GEMM.
  const at::Tensor weight3 = weight.reshape({g.groups, g.out_per_group(), g.col_rows()});
  const bool expect_dense = Kernels::expects_dense(input, g);
  const MaskedPositions pos = Kernels::positions(mask, g, [&](const PendingPositions& pending) {
    if (expect_dense) {
      early_conv = Kernels::dense_conv(input, weight, bias, padding, stride, dilation, groups);
      return;
    }
    Kernels::clear_output(out);
    ahead = Kernels::gather_cols_ahead(input, g, pending);
  });
  if (Kernels::dense_forward(input, mask, weight, bias, padding, stride, dilation, groups, g, pos,
                             early_conv, out)) {
    return out;
  }
  if (expect_dense) {
    Kernels::clear_output(out);
  }
  const at::Tensor cols = ahead.has_value() && ahead->size(1) >= pos.count()
                              ? ahead->narrow(1, 0, pos.count())
                              : Kernels::gather_cols(input, pos, g);
  const at::Tensor product = Kernels::forward_gemm(weight3, cols);
  Kernels::write_output(product, bias, pos, g, out);
  return out;
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mask,
    const at::Tensor& weight, c10::IntArrayRef padding, c10::IntArrayRef stride,
    c10::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask,
    c10::DeviceType device) {
  const char* op = "_masked_conv2d_backward";
  const MaskedConvGeometry g = check_masked_conv2d(op, input, mask, weight, std::nullopt,
                                                   padding, stride, dilation, groups, device);
  check_masked_conv2d_grad(op, grad, input, g);
  // Gradients not asked for are (0,)-shaped placeholders.
  const at::Tensor none = at::empty({0}, input.options());
  at::Tensor grad_input = none, grad_weight = none, grad_bias = none;
  if (g.all_positions() == 0 || g.out_channels == 0) {
    // No output position: zero gradients.
    if (output_mask[0]) {
      grad_input = new_output(op, input.sizes(), input.options(), /*zero=*/true);
    }
    if (output_mask[1]) {
      grad_weight = new_output(op, weight.sizes(), weight.options(), /*zero=*/true);
    }
    if (output_mask[2]) {
      grad_bias = new_output(op, {g.out_channels}, weight.options(), /*zero=*/true);
    }
    return {grad_input, grad_weight, grad_bias};
  }
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) {
    return {grad_input, grad_weight, grad_bias};
  }
  if (output_mask[0]) {
    grad_input = new_output(op, input.sizes(), input.options());
  }
  const MaskedPositions pos = Kernels::positions(mask, g, [](const PendingPositions&) {});
  const int64_t p = pos.count();
  at::Tensor grad_cols = new_output(op, {g.out_channels, p}, grad.options());
  Kernels::gather_grad(grad, pos, g, grad_cols);
  const at::Tensor grad_groups = grad_cols.view({g.groups, g.out_per_group(), p});
  if (output_mask[2]) {
    const at::ScalarType acc = accumulate_type(grad.scalar_type());
    grad_bias = at::sum(grad_cols, {1}, /*keepdim=*/false, acc).to(grad.scalar_type());
  }
  if (output_mask[1]) {
    // (G, C_out / G, P) @ (G, P, K)
    grad_weight = Kernels::gemm(grad_groups, Kernels::gather_cols(input, pos, g))
                      .view(weight.sizes());
  }
  if (output_mask[0]) {
    // (G, K, C_out / G) @ (G, C_out / G, P): the columns' gradients, then
    // each input pixel gathers its taps.
    const at::Tensor w = weight.reshape({g.groups, g.out_per_group(), g.col_rows()});
    const at::Tensor input_cols = Kernels::gemm(w.transpose(1, 2), grad_groups);
    Kernels::col2im(input_cols, pos, g, grad_input);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace torchops
