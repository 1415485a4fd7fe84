// The geometry and argument checks of deform_conv2d, written once for the
// CPU and CUDA kernels, with torchvision's semantics.
//
// Output pixel (oy, ox), kernel tap (i, j) of offset group g reads the input
// at
//   y = oy * stride_h - pad_h + i * dilation_h + offset[g, 2 k,     oy, ox]
//   x = ox * stride_w - pad_w + j * dilation_w + offset[g, 2 k + 1, oy, ox]
// (k = i * kw + j) by bilinear interpolation, times mask[g, k, oy, ox] when
// use_mask.  Like torchvision: a sample with y <= -1, y >= H, x <= -1 or
// x >= W is zero, and inside that range each of the four corners that lies
// outside the image reads zero (no clamping, unlike roi_align).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "common/checks.h"

namespace torchops {

// The four corners a sample reads: flat indices into an H x W plane (0 for a
// corner outside the image, whose weights are then 0), the bilinear weights
// and their derivatives along y and x.
template <typename T>
struct DeformTaps {
  int64_t idx[4];
  T w[4];
  T dy[4];
  T dx[4];
};

// False (and all weights zero) when the sample contributes nothing, NaN
// coordinates included.
template <typename T>
C10_HOST_DEVICE inline bool deform_taps(T y, T x, int64_t height, int64_t width,
                                        DeformTaps<T>& t) {
  for (int c = 0; c < 4; ++c) {
    t.idx[c] = 0;
    t.w[c] = t.dy[c] = t.dx[c] = T(0);
  }
  if (!(y > T(-1) && y < static_cast<T>(height) && x > T(-1) &&
        x < static_cast<T>(width))) {
    return false;
  }
  const T fy = std::floor(y), fx = std::floor(x);
  const int64_t y0 = static_cast<int64_t>(fy), x0 = static_cast<int64_t>(fx);
  const int64_t y1 = y0 + 1, x1 = x0 + 1;
  const T ly = y - fy, lx = x - fx;
  const T hy = T(1) - ly, hx = T(1) - lx;
  const bool vy[2] = {y0 >= 0, y1 <= height - 1};
  const bool vx[2] = {x0 >= 0, x1 <= width - 1};
  const int64_t ys[2] = {y0, y1}, xs[2] = {x0, x1};
  const T wy[2] = {hy, ly}, wx[2] = {hx, lx};
  const T sy[2] = {T(-1), T(1)}, sx[2] = {T(-1), T(1)};
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      const int c = a * 2 + b;
      if (vy[a] && vx[b]) {
        t.idx[c] = ys[a] * width + xs[b];
        t.w[c] = wy[a] * wx[b];
        t.dy[c] = sy[a] * wx[b];
        t.dx[c] = wy[a] * sx[b];
      }
    }
  }
  return true;
}

// Sizes of a deform_conv2d call, after its checks.
struct DeformConvSizes {
  int64_t batch, channels, height, width;
  int64_t out_channels, kernel_h, kernel_w, out_h, out_w;
};

// The output size along one axis (may be <= 0 for a too-small input).
inline int64_t deform_out_size(int64_t in, int64_t pad, int64_t dilation,
                               int64_t kernel, int64_t stride) {
  return (in + 2 * pad - (dilation * (kernel - 1) + 1)) / stride + 1;
}

inline DeformConvSizes check_deform_conv2d(
    const char* op, c10::DeviceType device, const at::Tensor& input,
    const at::Tensor& weight, const at::Tensor& offset, const at::Tensor& mask,
    const at::Tensor& bias, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
    int64_t offset_groups, bool use_mask) {
  check_devices(op, device,
                {{input, "input"}, {weight, "weight"}, {offset, "offset"},
                 {mask, "mask"}, {bias, "bias"}});
  check_floating(op, {input, "input"});
  check_same_dtype(op, {input, "input"}, {weight, "weight"});
  check_same_dtype(op, {input, "input"}, {offset, "offset"});
  check_same_dtype(op, {input, "input"}, {mask, "mask"});
  check_same_dtype(op, {input, "input"}, {bias, "bias"});
  check_dim(op, {input, "input"}, 4);
  check_dim(op, {weight, "weight"}, 4);
  check_dim(op, {offset, "offset"}, 4);
  check_dim(op, {bias, "bias"}, 1);
  TORCH_CHECK(stride_h > 0 && stride_w > 0, "torchops.", op,
              ": expected 'stride_h' and 'stride_w' to be positive, but got ",
              stride_h, " and ", stride_w);
  TORCH_CHECK(pad_h >= 0 && pad_w >= 0, "torchops.", op,
              ": expected 'pad_h' and 'pad_w' to be non-negative, but got ",
              pad_h, " and ", pad_w);
  TORCH_CHECK(dilation_h > 0 && dilation_w > 0, "torchops.", op,
              ": expected 'dilation_h' and 'dilation_w' to be positive, but "
              "got ", dilation_h, " and ", dilation_w);
  TORCH_CHECK(groups > 0, "torchops.", op,
              ": expected 'groups' to be positive, but got ", groups);
  TORCH_CHECK(offset_groups > 0, "torchops.", op,
              ": expected 'offset_groups' to be positive, but got ",
              offset_groups);
  DeformConvSizes s;
  s.batch = input.size(0);
  s.channels = input.size(1);
  s.height = input.size(2);
  s.width = input.size(3);
  s.out_channels = weight.size(0);
  s.kernel_h = weight.size(2);
  s.kernel_w = weight.size(3);
  TORCH_CHECK(s.kernel_h > 0 && s.kernel_w > 0, "torchops.", op,
              ": expected 'weight' to have a non-empty kernel, but got shape ",
              weight.sizes());
  TORCH_CHECK(s.channels % groups == 0, "torchops.", op, ": 'groups' (",
              groups, ") does not divide the input channels (", s.channels,
              ")");
  TORCH_CHECK(s.out_channels % groups == 0, "torchops.", op, ": 'groups' (",
              groups, ") does not divide the output channels (",
              s.out_channels, ")");
  TORCH_CHECK(weight.size(1) * groups == s.channels, "torchops.", op,
              ": expected 'weight' to have input channels / groups = ",
              s.channels / groups, " in dimension 1, but got shape ",
              weight.sizes());
  TORCH_CHECK(s.channels % offset_groups == 0, "torchops.", op,
              ": 'offset_groups' (", offset_groups,
              ") does not divide the input channels (", s.channels, ")");
  s.out_h = deform_out_size(s.height, pad_h, dilation_h, s.kernel_h, stride_h);
  s.out_w = deform_out_size(s.width, pad_w, dilation_w, s.kernel_w, stride_w);
  TORCH_CHECK(s.out_h > 0 && s.out_w > 0, "torchops.", op,
              ": 'input' of shape ", input.sizes(),
              " is too small for the dilated kernel: output size ", s.out_h,
              " x ", s.out_w);
  const int64_t taps = offset_groups * s.kernel_h * s.kernel_w;
  TORCH_CHECK(offset.size(0) == s.batch && offset.size(1) == 2 * taps &&
                  offset.size(2) == s.out_h && offset.size(3) == s.out_w,
              "torchops.", op, ": expected 'offset' to have shape (", s.batch,
              ", ", 2 * taps, ", ", s.out_h, ", ", s.out_w,
              ") = (batch, 2 * offset_groups * kh * kw, out_h, out_w), but "
              "got ", offset.sizes());
  if (use_mask) {
    check_dim(op, {mask, "mask"}, 4);
    TORCH_CHECK(mask.size(0) == s.batch && mask.size(1) == taps &&
                    mask.size(2) == s.out_h && mask.size(3) == s.out_w,
                "torchops.", op, ": expected 'mask' to have shape (", s.batch,
                ", ", taps, ", ", s.out_h, ", ", s.out_w,
                ") = (batch, offset_groups * kh * kw, out_h, out_w), but got ",
                mask.sizes());
  }
  TORCH_CHECK(bias.size(0) == s.out_channels, "torchops.", op,
              ": expected 'bias' to have shape (", s.out_channels,
              ",), but got ", bias.sizes());
  return s;
}

}  // namespace torchops
