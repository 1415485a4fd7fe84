// The geometry and argument checks of torchops.masked_conv2d, written once
// for the CPU and CUDA kernels.
//
// Both kernels compute only the masked output positions, as one GEMM per
// group over their im2col columns:
//
//   positions  the flat indices n * H_out * W_out + oh * W_out + ow with
//              mask > 0, ascending (P of them);
//   index map  for every (n, oh, ow) its rank among the positions, or -1;
//   cols       (G, P, K) with K = C_in / G * kh * kw, row k of a position
//              = input[n, g * C_in / G + c, ih(oh, i), iw(ow, j)] for
//              k = (c * kh + i) * kw + j (the order of the weight's
//              (C_in / G, kh, kw) dims), zero in the padding;
//   GEMM       out_cols (G, C_out / G, P) = weight (G, C_out / G, K) @ cols^T;
//   output     out[n, co, oh, ow] = out_cols[co, rank] + bias[co] where the
//              rank is >= 0, else 0: one pass writes every output element.
//
// The backward reuses the same positions: grad_cols = weight^T @ grad at the
// positions, folded back onto the input without atomics (CUDA: each input
// pixel gathers its kh * kw taps through the index map; CPU: each input plane
// belongs to one task), so it is deterministic on every device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/checks.h"

namespace torchops {

struct MaskedConvGeometry {
  int64_t batch, in_channels, height, width;
  int64_t out_channels, groups, kernel_h, kernel_w;
  int64_t pad_h, pad_w, stride_h, stride_w, dil_h, dil_w;
  int64_t out_h, out_w;
  bool mask_broadcast;  // mask is (1, H_out, W_out), shared by the batch

  C10_HOST_DEVICE int64_t in_per_group() const { return in_channels / groups; }
  C10_HOST_DEVICE int64_t out_per_group() const { return out_channels / groups; }
  // Rows of one group's columns: K.
  C10_HOST_DEVICE int64_t col_rows() const { return in_per_group() * kernel_h * kernel_w; }
  // Every output position of the batch: the most the mask can select.
  C10_HOST_DEVICE int64_t all_positions() const { return batch * out_h * out_w; }
};

// A position's (n, oh, ow) from its flat index n * H_out * W_out + oh * W_out + ow.
template <typename index_t>
struct MaskedConvPosition {
  index_t n, oh, ow;
  C10_HOST_DEVICE MaskedConvPosition(index_t flat, index_t out_h, index_t out_w) {
    const index_t plane = out_h * out_w;
    n = flat / plane;
    const index_t r = flat - n * plane;
    oh = r / out_w;
    ow = r - oh * out_w;
  }
};

// The input coordinate that output coordinate o reads through tap k.
C10_HOST_DEVICE inline int64_t masked_conv_in_coord(int64_t o, int64_t k, int64_t stride,
                                                    int64_t pad, int64_t dil) {
  return o * stride - pad + k * dil;
}

// The output coordinate that reads input coordinate i through tap k, or -1
// when none does (the inverse of masked_conv_in_coord).
// I: int64_t, or int32_t where every term fits (the CUDA backward's hot
// loop, where 64-bit division costs several times more).
template <typename I>
C10_HOST_DEVICE inline I masked_conv_out_coord(I i, I k, I stride, I pad, I dil, I out_size) {
  const I t = i + pad - k * dil;
  if (t < 0 || t % stride != 0) {
    return -1;
  }
  const I o = t / stride;
  return o < out_size ? o : -1;
}

// Whether a mask value selects its position: > 0 (NaN does not).
template <typename mask_t>
C10_HOST_DEVICE inline bool masked_conv_selects(mask_t v) {
  if constexpr (std::is_same_v<mask_t, bool>) {
    return v;
  } else if constexpr (std::is_same_v<mask_t, double>) {
    return v > 0.0;
  } else {
    return static_cast<float>(v) > 0.0f;
  }
}

namespace masked_conv_detail {

inline void check_pair(const char* op, const char* name, c10::IntArrayRef v, int64_t min) {
  TORCH_CHECK(v.size() == 2, "torchops.", op, ": expected '", name,
              "' to have 2 values (height, width), but got ", v);
  TORCH_CHECK(v[0] >= min && v[1] >= min, "torchops.", op, ": expected '", name,
              "' to be ", min == 0 ? "non-negative" : "positive", ", but got ", v);
}

}  // namespace masked_conv_detail

// Checks every argument of the op (and of its backward, which takes the same
// ones without the bias) and returns the geometry.
inline MaskedConvGeometry check_masked_conv2d(
    const char* op, const at::Tensor& input, const at::Tensor& mask, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::IntArrayRef padding, c10::IntArrayRef stride,
    c10::IntArrayRef dilation, int64_t groups, c10::DeviceType device) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_devices(op, device, {{input, "input"}, {mask, "mask"}, {weight, "weight"},
                               {*bias, "bias"}});
  } else {
    check_devices(op, device, {{input, "input"}, {mask, "mask"}, {weight, "weight"}});
  }
  check_floating(op, {input, "input"});
  check_same_dtype(op, {input, "input"}, {weight, "weight"});
  if (has_bias) {
    check_same_dtype(op, {input, "input"}, {*bias, "bias"});
  }
  TORCH_CHECK(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
              "torchops.", op, ": expected 'mask' to be a bool or floating-point tensor, but got ",
              mask.scalar_type());
  check_dim(op, {input, "input"}, 4);
  check_dim(op, {weight, "weight"}, 4);
  check_dim(op, {mask, "mask"}, 3);
  masked_conv_detail::check_pair(op, "padding", padding, 0);
  masked_conv_detail::check_pair(op, "stride", stride, 1);
  masked_conv_detail::check_pair(op, "dilation", dilation, 1);
  TORCH_CHECK(groups > 0, "torchops.", op, ": expected 'groups' to be positive, but got ", groups);

  MaskedConvGeometry g{};
  g.batch = input.size(0);
  g.in_channels = input.size(1);
  g.height = input.size(2);
  g.width = input.size(3);
  g.out_channels = weight.size(0);
  g.groups = groups;
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.pad_h = padding[0];
  g.pad_w = padding[1];
  g.stride_h = stride[0];
  g.stride_w = stride[1];
  g.dil_h = dilation[0];
  g.dil_w = dilation[1];
  TORCH_CHECK(g.in_channels % groups == 0 && weight.size(1) * groups == g.in_channels,
              "torchops.", op, ": expected 'weight' to have input channels / groups = ",
              g.in_channels, " / ", groups, " in dim 1 (and 'groups' to divide the ",
              "channels of 'input'), but got 'weight' of shape ", weight.sizes());
  TORCH_CHECK(g.out_channels % groups == 0, "torchops.", op,
              ": expected 'groups' (", groups, ") to divide the output channels of 'weight' (",
              g.out_channels, ")");
  TORCH_CHECK(g.kernel_h > 0 && g.kernel_w > 0, "torchops.", op,
              ": expected 'weight' to have a non-empty kernel, but got shape ", weight.sizes());
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.out_channels, "torchops.", op,
                ": expected 'bias' to have shape (", g.out_channels, ",), but got ",
                bias->sizes());
  }
  check_conv_arguments(op, {{"padding", std::max(g.pad_h, g.pad_w)},
                            {"stride", std::max(g.stride_h, g.stride_w)},
                            {"dilation", std::max(g.dil_h, g.dil_w)}});
  int64_t span_h = 0, span_w = 0;
  const bool overflow = c10::mul_overflows(g.dil_h, g.kernel_h - 1, &span_h) ||
                        c10::mul_overflows(g.dil_w, g.kernel_w - 1, &span_w);
  span_h += 1;
  span_w += 1;
  TORCH_CHECK(!overflow && g.height + 2 * g.pad_h >= span_h && g.width + 2 * g.pad_w >= span_w,
              "torchops.", op, ": the dilated kernel of 'weight' (", span_h, " x ", span_w,
              ") is larger than the padded 'input' (", g.height + 2 * g.pad_h, " x ",
              g.width + 2 * g.pad_w, ")");
  g.out_h = (g.height + 2 * g.pad_h - span_h) / g.stride_h + 1;
  g.out_w = (g.width + 2 * g.pad_w - span_w) / g.stride_w + 1;
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == g.batch) && mask.size(1) == g.out_h &&
                  mask.size(2) == g.out_w,
              "torchops.", op, ": expected 'mask' to have shape (", g.batch, " or 1, ", g.out_h,
              ", ", g.out_w, ") (batch, output height, output width), but got ", mask.sizes());
  g.mask_broadcast = mask.size(0) == 1;
  return g;
}

// The backward's extra check: 'grad' is the output's gradient.
inline void check_masked_conv2d_grad(const char* op, const at::Tensor& grad,
                                     const at::Tensor& input, const MaskedConvGeometry& g) {
  check_same_device(op, {input, "input"}, {grad, "grad"});
  check_same_dtype(op, {input, "input"}, {grad, "grad"});
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == g.batch && grad.size(1) == g.out_channels &&
                  grad.size(2) == g.out_h && grad.size(3) == g.out_w,
              "torchops.", op, ": expected 'grad' to have the output's shape (", g.batch, ", ",
              g.out_channels, ", ", g.out_h, ", ", g.out_w, "), but got ", grad.sizes());
}

}  // namespace torchops
