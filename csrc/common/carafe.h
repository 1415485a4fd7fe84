// The geometry and argument checks of carafe (CARAFE, Wang et al., ICCV
// 2019), written once for the CPU and CUDA kernels, with mmcv's semantics:
//
//   out[n, c, oh, ow] = sum over ky, kx < k of
//       features[n, c, oh / s + ky - r, ow / s + kx - r]      (0 outside)
//     * masks[n, (group(c) * k + ky) * k + kx, oh, ow]
//
// (a tap outside the map is skipped, not multiplied by 0)
// with r = (k - 1) / 2, group(c) = c / (C / g), features (N, C, H, W), masks
// (N, g k^2, H s, W s) and out (N, C, H s, W s).  Every output pixel of the
// s x s block of a source pixel reads the same k x k neighbourhood; only its
// mask weights differ.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/safe_numerics.h>

#include <cstdint>
#include <limits>

#include "common/checks.h"

namespace torchops {

struct CarafeShape {
  int64_t n, c, h, w;   // features
  int64_t k, g, s;      // kernel size, groups, scale factor
  int64_t ho, wo;       // output (and mask) height and width: h s, w s

  int64_t radius() const { return (k - 1) / 2; }
  int64_t taps() const { return k * k; }
  int64_t group_channels() const { return g > 0 ? c / g : 0; }
};

// Mask channel of tap (ky, kx) for channels of `group`.
C10_HOST_DEVICE inline int64_t carafe_mask_channel(int64_t group, int64_t ky,
                                                   int64_t kx, int64_t k) {
  return (group * k + ky) * k + kx;
}

// Source coordinate read by output coordinate `o` at tap offset `t` (< k),
// or -1 when it falls in the zero padding.
C10_HOST_DEVICE inline int64_t carafe_source(int64_t o, int64_t t, int64_t s,
                                             int64_t radius, int64_t size) {
  const int64_t v = o / s + t - radius;
  return (v >= 0 && v < size) ? v : -1;
}

// Whether tap (ky, kx) of source pixel (y, x) reads inside the feature map.
// A tap outside reads the zero padding and is skipped whole, its mask
// weight included (mmcv's rule): an inf or NaN weight there does not reach
// the output.
C10_HOST_DEVICE inline bool carafe_tap_inside(int64_t y, int64_t x, int64_t ky,
                                              int64_t kx, int64_t radius,
                                              int64_t h, int64_t w) {
  const int64_t sy = y + ky - radius, sx = x + kx - radius;
  return sy >= 0 && sy < h && sx >= 0 && sx < w;
}

// The arguments of carafe and its backward: every message names the op and
// the argument.  Returns the sizes the kernels use.
inline CarafeShape check_carafe(const char* op, const at::Tensor& features,
                                const at::Tensor& masks, int64_t kernel_size,
                                int64_t group_size, int64_t scale_factor,
                                c10::DeviceType device) {
  check_devices(op, device, {{features, "features"}, {masks, "masks"}});
  check_floating(op, {features, "features"});
  check_dim(op, {features, "features"}, 4);
  check_dim(op, {masks, "masks"}, 4);
  check_same_dtype(op, {features, "features"}, {masks, "masks"});
  TORCH_CHECK(kernel_size >= 1 && kernel_size % 2 == 1, "torchops.", op,
              ": expected 'kernel_size' to be a positive odd number, but got ",
              kernel_size);
  TORCH_CHECK(group_size >= 1, "torchops.", op,
              ": expected 'group_size' to be positive, but got ", group_size);
  TORCH_CHECK(scale_factor >= 1, "torchops.", op,
              ": expected 'scale_factor' to be positive, but got ",
              scale_factor);
  CarafeShape p{features.size(0), features.size(1), features.size(2),
                features.size(3), kernel_size, group_size, scale_factor, 0, 0};
  TORCH_CHECK(p.c % group_size == 0, "torchops.", op,
              ": expected 'group_size' (", group_size,
              ") to divide the channels of 'features' (", p.c, ")");
  // k^2 g, H s and W s, without overflow: absurd arguments must fail the
  // shape check, not wrap around and pass it.
  uint64_t mask_channels = 0, ho = 0, wo = 0;
  const bool overflow =
      c10::mul_overflows(static_cast<uint64_t>(kernel_size),
                         static_cast<uint64_t>(kernel_size), &mask_channels) ||
      c10::mul_overflows(mask_channels, static_cast<uint64_t>(group_size),
                         &mask_channels) ||
      c10::mul_overflows(static_cast<uint64_t>(p.h),
                         static_cast<uint64_t>(scale_factor), &ho) ||
      c10::mul_overflows(static_cast<uint64_t>(p.w),
                         static_cast<uint64_t>(scale_factor), &wo);
  const uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  TORCH_CHECK(!overflow && mask_channels <= kMax && ho <= kMax && wo <= kMax,
              "torchops.", op, ": 'kernel_size' (", kernel_size,
              "), 'group_size' (", group_size, ") or 'scale_factor' (",
              scale_factor, ") is too large for 'features' of shape ",
              features.sizes());
  p.ho = static_cast<int64_t>(ho);
  p.wo = static_cast<int64_t>(wo);
  TORCH_CHECK(masks.size(0) == p.n, "torchops.", op,
              ": expected 'masks' to have the batch size of 'features' (",
              p.n, "), but got shape ", masks.sizes());
  TORCH_CHECK(masks.size(1) == static_cast<int64_t>(mask_channels), "torchops.",
              op, ": expected 'masks' to have kernel_size^2 * group_size = ",
              mask_channels, " channels, but got shape ", masks.sizes());
  TORCH_CHECK(masks.size(2) == p.ho && masks.size(3) == p.wo, "torchops.", op,
              ": expected 'masks' to have the spatial size of 'features' "
              "times 'scale_factor' (", p.ho, ", ", p.wo, "), but got shape ",
              masks.sizes());
  return p;
}

// The backward op: carafe's checks, and grad of the output's shape.
inline CarafeShape check_carafe_backward(
    const char* op, const at::Tensor& grad, const at::Tensor& features,
    const at::Tensor& masks, int64_t kernel_size, int64_t group_size,
    int64_t scale_factor, c10::DeviceType device) {
  check_devices(op, device, {{grad, "grad"}, {features, "features"},
                             {masks, "masks"}});
  const CarafeShape p = check_carafe(op, features, masks, kernel_size,
                                     group_size, scale_factor, device);
  check_same_dtype(op, {features, "features"}, {grad, "grad"});
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == p.n && grad.size(1) == p.c &&
                  grad.size(2) == p.ho && grad.size(3) == p.wo,
              "torchops.", op, ": expected 'grad' to have the output's shape (",
              p.n, ", ", p.c, ", ", p.ho, ", ", p.wo, "), but got ",
              grad.sizes());
  return p;
}

// The backward's gradients, allocated; `done` when the kernels have nothing
// to compute: empty gradients, or no channels or pixels (no output, so every
// mask gets a zero gradient).
struct CarafeGrads {
  at::Tensor features, masks;
  bool done;
};

inline CarafeGrads carafe_backward_outputs(const char* op, const CarafeShape& p,
                                           const at::Tensor& features,
                                           const at::Tensor& masks) {
  CarafeGrads r{new_output(op, {p.n, p.c, p.h, p.w}, features.options()),
                new_output(op, {p.n, p.g * p.taps(), p.ho, p.wo}, masks.options()),
                true};
  if (r.features.numel() == 0 && r.masks.numel() == 0) {
    return r;
  }
  if (p.c == 0 || p.h == 0 || p.w == 0) {
    r.masks.zero_();
    return r;
  }
  r.done = false;
  return r;
}

}  // namespace torchops
