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
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "common/checks.h"
#include "common/env.h"

namespace torchops {

// The four corners a sample reads, (y0, x0), (y0, x0 + 1), (y0 + 1, x0) and
// (y0 + 1, x0 + 1): their bilinear weights and the weights' derivatives
// along y and x, flat indices into an H x W plane, and which corners lie
// inside the image.  A corner outside is never read (its index is 0):
// skipping it, rather than reading pixel 0 times a zero weight, keeps a NaN
// or Inf elsewhere in the plane out of samples that do not touch it.  Its
// weights are set all the same, for kernels that read from a plane padded
// with a border of zeros instead (corner at padded index
// (y0 + 1) * (W + 2) + x0 + 1 + {0, 1, W + 2, W + 3}).
template <typename T>
struct DeformTaps {
  int64_t idx[4];
  T w[4];
  T dy[4];
  T dx[4];
  int64_t y0, x0;
  unsigned valid;  // bit c: corner c is inside the image
};

// False (all weights zero, no valid corner) when the sample contributes
// nothing, NaN coordinates included.
template <typename T>
C10_HOST_DEVICE inline bool deform_taps(T y, T x, int64_t height, int64_t width,
                                        DeformTaps<T>& t) {
  t.valid = 0;
  t.y0 = t.x0 = -1;
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
  t.y0 = y0;
  t.x0 = x0;
  const T ly = y - fy, lx = x - fx;
  const T hy = T(1) - ly, hx = T(1) - lx;
  const bool vy[2] = {y0 >= 0, y0 + 1 <= height - 1};
  const bool vx[2] = {x0 >= 0, x0 + 1 <= width - 1};
  const T wy[2] = {hy, ly}, wx[2] = {hx, lx};
  const T sy[2] = {T(-1), T(1)}, sx[2] = {T(-1), T(1)};
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      const int c = a * 2 + b;
      t.w[c] = wy[a] * wx[b];
      t.dy[c] = sy[a] * wx[b];
      t.dx[c] = wy[a] * sx[b];
      if (vy[a] && vx[b]) {
        t.valid |= 1u << c;
        t.idx[c] = (y0 + a) * width + (x0 + b);
      }
    }
  }
  return true;
}

// The corner values of one plane; zero for corners outside the image, which
// are not read.
template <typename T, typename V>
C10_HOST_DEVICE inline void deform_corners(const V* plane,
                                           const DeformTaps<T>& t, T v[4]) {
  for (int c = 0; c < 4; ++c) {
    v[c] = ((t.valid >> c) & 1u) ? static_cast<T>(plane[t.idx[c]]) : T(0);
  }
}

template <typename T>
C10_HOST_DEVICE inline T deform_dot(const T a[4], const T v[4]) {
  return a[0] * v[0] + a[1] * v[1] + a[2] * v[2] + a[3] * v[3];
}

// Everything the kernels need to place the samples of a call.
struct DeformGeometry {
  int64_t channels, height, width, out_h, out_w, kernel_h, kernel_w;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t groups, offset_groups;
  bool use_mask;
  C10_HOST_DEVICE int64_t taps() const { return kernel_h * kernel_w; }
  C10_HOST_DEVICE int64_t pixels() const { return out_h * out_w; }
  C10_HOST_DEVICE int64_t group_channels() const {
    return channels / offset_groups;
  }
};

// The taps and mask value of sample (offset group og, kernel tap k, output
// pixel p) of one image, whose offsets are `offset_n` (2 * OG * K, P) and
// mask `mask_n` (OG * K, P), both contiguous.  False when it reads nothing.
template <typename T, typename V>
C10_HOST_DEVICE inline bool deform_sample(const DeformGeometry& g,
                                          const V* offset_n, const V* mask_n,
                                          int64_t og, int64_t k, int64_t p,
                                          DeformTaps<T>& t, T& m) {
  const int64_t K = g.taps(), P = g.pixels();
  const int64_t i = k / g.kernel_w, j = k - i * g.kernel_w;
  const int64_t oy = p / g.out_w, ox = p - oy * g.out_w;
  const V* o = offset_n + (og * K + k) * 2 * P + p;
  const T y = static_cast<T>(oy * g.stride_h - g.pad_h + i * g.dilation_h) +
              static_cast<T>(o[0]);
  const T x = static_cast<T>(ox * g.stride_w - g.pad_w + j * g.dilation_w) +
              static_cast<T>(o[P]);
  m = g.use_mask ? static_cast<T>(mask_n[(og * K + k) * P + p]) : T(1);
  return deform_taps(y, x, g.height, g.width, t);
}

// Sizes of a deform_conv2d call, after its checks.
struct DeformConvSizes {
  int64_t batch, channels, height, width;
  int64_t out_channels, kernel_h, kernel_w, out_h, out_w;
};

// The output size along one axis (may be <= 0 for a too-small input).  With
// pad and dilation bounded by kConvArgumentMax only sizes near int64's limit
// (expanded tensors) can overflow here: a dilated kernel past int64 fits no
// input (0), and a padded input past it saturates.
inline int64_t deform_out_size(int64_t in, int64_t pad, int64_t dilation,
                               int64_t kernel, int64_t stride) {
  int64_t span = 0, room = 0;
  if (c10::mul_overflows(dilation, kernel - 1, &span)) {
    return 0;
  }
  if (c10::add_overflows(in - span - 1, 2 * pad, &room)) {
    room = std::numeric_limits<int64_t>::max();
  }
  // A kernel wider than the padded input has no output (C++ division
  // truncates towards zero: -1 / 2 + 1 would count one).
  return room < 0 ? 0 : room / stride + 1;
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
  check_conv_arguments(op, {{"stride_h", stride_h}, {"stride_w", stride_w},
                            {"pad_h", pad_h}, {"pad_w", pad_w},
                            {"dilation_h", dilation_h}, {"dilation_w", dilation_w}});
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

inline DeformGeometry deform_geometry(const DeformConvSizes& s,
                                      int64_t stride_h, int64_t stride_w,
                                      int64_t pad_h, int64_t pad_w,
                                      int64_t dilation_h, int64_t dilation_w,
                                      int64_t groups, int64_t offset_groups,
                                      bool use_mask) {
  return DeformGeometry{s.channels,  s.height,   s.width,      s.out_h,
                        s.out_w,     s.kernel_h, s.kernel_w,   stride_h,
                        stride_w,    pad_h,      pad_w,        dilation_h,
                        dilation_w,  groups,     offset_groups, use_mask};
}

// A call's checked sizes and the geometry its kernels place samples by:
// the prologue of every deform_conv2d kernel, CPU and CUDA.
struct DeformCall {
  DeformConvSizes s;
  DeformGeometry g;
};

inline DeformCall check_deform_call(
    const char* op, c10::DeviceType device, const at::Tensor& input,
    const at::Tensor& weight, const at::Tensor& offset, const at::Tensor& mask,
    const at::Tensor& bias, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
    int64_t offset_groups, bool use_mask) {
  const DeformConvSizes s = check_deform_conv2d(
      op, device, input, weight, offset, mask, bias, stride_h, stride_w, pad_h,
      pad_w, dilation_h, dilation_w, groups, offset_groups, use_mask);
  return {s, deform_geometry(s, stride_h, stride_w, pad_h, pad_w, dilation_h,
                             dilation_w, groups, offset_groups, use_mask)};
}

// Checks of the backward operator's incoming gradient.
inline void check_deform_grad(const char* op, c10::DeviceType device,
                              const at::Tensor& grad, const at::Tensor& input,
                              const DeformConvSizes& s) {
  check_devices(op, device, {{input, "input"}, {grad, "grad"}});
  check_same_dtype(op, {input, "input"}, {grad, "grad"});
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == s.batch &&
                  grad.size(1) == s.out_channels && grad.size(2) == s.out_h &&
                  grad.size(3) == s.out_w,
              "torchops.", op, ": expected 'grad' to have shape (", s.batch,
              ", ", s.out_channels, ", ", s.out_h, ", ", s.out_w,
              ") = (batch, out_channels, out_h, out_w), but got ",
              grad.sizes());
}

// Images per chunk of the im2col + GEMM kernels: as many as keep one
// (C * kh * kw, images * P) column buffer within kColumnBytes, spread evenly
// over the chunks (8 images at 6 per chunk run as 4 + 4, not 6 + 2).
// TORCHOPS_TESTING_DEFORM_COLUMN_BYTES (read at each call) lowers the bound
// so that tests run the multi-chunk paths on small problems.
constexpr int64_t kColumnBytes = int64_t(256) << 20;

inline int64_t deform_column_bytes() {
  return env::integer("deform_conv2d", env::kTestingDeformColumnBytes).value_or(kColumnBytes);
}

inline int64_t deform_chunk(int64_t batch, int64_t column_rows, int64_t pixels,
                            int64_t element_size) {
  if (batch <= 0) {
    return 1;
  }
  const int64_t per_image =
      std::max<int64_t>(1, column_rows * pixels * element_size);
  const int64_t most = std::max<int64_t>(1, deform_column_bytes() / per_image);
  const int64_t chunks = (batch + most - 1) / most;
  return (batch + chunks - 1) / chunks;
}

}  // namespace torchops
