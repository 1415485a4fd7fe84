// What roi_align and roi_pool share, on CPU and CUDA: the argument checks of
// their forward and backward ops, and turning a RoI row's floats into
// integers without undefined behaviour.
//
// RoIs are rows (batch_index, x1, y1, x2, y2) of a (K, 5) tensor of the
// input's dtype, as in torchvision.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "common/checks.h"

namespace torchops {

// C's (int) cast of a coordinate, as torchvision does it, but defined for
// every value: NaN gives `nan_value`, and magnitudes beyond 2^31 saturate
// (no feature map is that large, and the bare cast is undefined there).
template <typename T>
C10_HOST_DEVICE inline int64_t saturating_trunc(T v, int64_t nan_value = 0) {
  constexpr T kLimit = T(2147483648.0);  // 2^31
  if (!(v == v)) {
    return nan_value;
  }
  if (v >= kLimit) {
    return int64_t(2147483648LL);
  }
  if (v <= -kLimit) {
    return -int64_t(2147483648LL);
  }
  return static_cast<int64_t>(v);
}

// Batch index of a RoI row (truncated like torchvision's (int) cast); NaN
// maps to -1 so range checks reject it.
template <typename T>
C10_HOST_DEVICE inline int64_t roi_batch_index(T v) {
  return saturating_trunc(v, /*nan_value=*/-1);
}

// Work bounds of the RoI ops that sample a grid per bin (roi_align, and any
// later op with such a loop).  Their trip counts come from data, and native
// code cannot be interrupted: one absurd RoI must not freeze a training step.
//
// An explicit sampling_ratio is the per-axis sample count the caller asks
// for; beyond this it is rejected (64 x 64 samples per bin is far past any
// published setting, which use 0 to 4).
constexpr int64_t kMaxSamplingRatio = 64;

inline void check_sampling_ratio(const char* op, int64_t sampling_ratio) {
  TORCH_CHECK(sampling_ratio <= kMaxSamplingRatio, "torchops.", op,
              ": expected 'sampling_ratio' to be at most ", kMaxSamplingRatio,
              " samples per bin and axis (<= 0: adaptive), but got ",
              sampling_ratio);
}

// Adaptive sampling takes ceil(bin size) samples per axis.  A RoI up to
// twice the feature map's size along an axis needs at most
// ceil(2 size / pooled) <= 2 (size / pooled + 1) of them, so capping there
// changes no result for any RoI that fits the map (or overhangs it by up to
// its own size), while a RoI of 1e12 pixels costs what one twice the size of
// the map costs instead of running for minutes.  NaN or a negative bin
// (reversed aligned box) gives <= 0: no samples.
template <typename T>
C10_HOST_DEVICE inline int64_t adaptive_grid(T bin, int64_t size,
                                             int64_t pooled) {
  const int64_t grid = saturating_trunc(std::ceil(bin));
  const int64_t cap = 2 * (size / pooled + 1);
  return grid < cap ? grid : cap;
}

inline void check_pooled_size(const char* op, int64_t pooled_height,
                              int64_t pooled_width) {
  TORCH_CHECK(pooled_height > 0, "torchops.", op,
              ": expected 'pooled_height' to be positive, but got ",
              pooled_height);
  TORCH_CHECK(pooled_width > 0, "torchops.", op,
              ": expected 'pooled_width' to be positive, but got ",
              pooled_width);
}

inline void check_rois_shape(const char* op, const at::Tensor& rois) {
  TORCH_CHECK(
      rois.dim() == 2 && rois.size(1) == 5, "torchops.", op,
      ": expected 'rois' to have shape (K, 5), rows (batch_index, x1, y1, "
      "x2, y2), but got shape ", rois.sizes());
}

// Forward ops: input (N, C, H, W), rois (K, 5) of the same dtype and device.
inline void check_roi_forward(const char* op, const at::Tensor& input,
                              const at::Tensor& rois, int64_t pooled_height,
                              int64_t pooled_width, c10::DeviceType device) {
  check_devices(op, device, {{input, "input"}, {rois, "rois"}});
  check_floating(op, {input, "input"});
  check_dim(op, {input, "input"}, 4);
  check_rois_shape(op, rois);
  check_same_dtype(op, {input, "input"}, {rois, "rois"});
  check_pooled_size(op, pooled_height, pooled_width);
}

// Backward ops: grad (K, C, PH, PW) and the input's sizes.
inline void check_roi_backward(const char* op, const at::Tensor& grad,
                               const at::Tensor& rois, int64_t pooled_height,
                               int64_t pooled_width, int64_t batch_size,
                               int64_t channels, int64_t height, int64_t width,
                               c10::DeviceType device) {
  check_devices(op, device, {{grad, "grad"}, {rois, "rois"}});
  check_floating(op, {grad, "grad"});
  check_rois_shape(op, rois);
  check_same_dtype(op, {grad, "grad"}, {rois, "rois"});
  check_pooled_size(op, pooled_height, pooled_width);
  TORCH_CHECK(batch_size >= 0 && channels >= 0 && height >= 0 && width >= 0,
              "torchops.", op, ": expected 'batch_size', 'channels', "
              "'height' and 'width' to be non-negative, but got ", batch_size,
              ", ", channels, ", ", height, ", ", width);
  TORCH_CHECK(
      grad.dim() == 4 && grad.size(0) == rois.size(0) &&
          grad.size(1) == channels && grad.size(2) == pooled_height &&
          grad.size(3) == pooled_width,
      "torchops.", op, ": expected 'grad' to have shape (K, channels, "
      "pooled_height, pooled_width) = (", rois.size(0), ", ", channels, ", ",
      pooled_height, ", ", pooled_width, "), but got ", grad.sizes());
}

// CPU kernels reject a RoI whose batch index is not an image of the input
// (CUDA kernels cannot without a device sync: they treat such a RoI as
// empty instead).
template <typename scalar_t, typename T>
void check_roi_batch_indices(const char* op, const scalar_t* rois, int64_t k,
                             int64_t batch_size) {
  for (int64_t i = 0; i < k; ++i) {
    const T v = static_cast<T>(rois[i * 5]);
    const int64_t b = roi_batch_index(v);
    TORCH_CHECK(b >= 0 && b < batch_size, "torchops.", op, ": 'rois' row ",
                i, " has batch index ", v, ", but 'input' holds ", batch_size,
                " images (valid: 0 to ", batch_size - 1, ")");
  }
}

}  // namespace torchops
