// The geometry of roi_align, written once for the CPU and CUDA kernels, with
// torchvision's semantics and arithmetic (same expressions, same order, in
// T = at::opmath_type of the input: float for float/half/bfloat16).
//
// A RoI (scaled by spatial_scale, shifted by -0.5 when aligned) is cut into
// pooled_height x pooled_width bins; each bin averages grid_h x grid_w
// bilinear samples at the centres of a regular sub-grid.  Bilinear
// interpolation is separable, and so are torchvision's boundary rules (a
// sample outside [-1, size] along either axis is zero; inside, coordinates
// clamp to the edge pixels), so each axis is handled on its own.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "common/roi.h"

namespace torchops {

template <typename T>
struct RoiAlignBox {
  int64_t batch;             // image index (not range-checked here)
  T start_h, start_w;        // top-left corner, in feature-map pixels
  T bin_h, bin_w;            // bin size (negative for a reversed aligned box)
  int64_t grid_h, grid_w;    // samples per bin along each axis; <= 0: none
  T inv_count;               // 1 / samples per bin
};

template <typename T, typename R>
C10_HOST_DEVICE inline RoiAlignBox<T> roi_align_box(
    const R* roi, T spatial_scale, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, bool aligned, int64_t height, int64_t width) {
  RoiAlignBox<T> b;
  b.batch = roi_batch_index(static_cast<T>(roi[0]));
  const T offset = aligned ? T(0.5) : T(0);
  b.start_w = static_cast<T>(roi[1]) * spatial_scale - offset;
  b.start_h = static_cast<T>(roi[2]) * spatial_scale - offset;
  const T end_w = static_cast<T>(roi[3]) * spatial_scale - offset;
  const T end_h = static_cast<T>(roi[4]) * spatial_scale - offset;
  T roi_w = end_w - b.start_w;
  T roi_h = end_h - b.start_h;
  if (!aligned) {
    // torchvision forces malformed boxes to 1x1 (NaN stays NaN).
    roi_w = roi_w < T(1) ? T(1) : roi_w;
    roi_h = roi_h < T(1) ? T(1) : roi_h;
  }
  b.bin_h = roi_h / static_cast<T>(pooled_height);
  b.bin_w = roi_w / static_cast<T>(pooled_width);
  // Adaptive: about one sample per pixel, ceil(roi size / pooled size),
  // bounded by the feature map (common/roi.h).
  b.grid_h = sampling_ratio > 0 ? sampling_ratio
                                : adaptive_grid(b.bin_h, height, pooled_height);
  b.grid_w = sampling_ratio > 0 ? sampling_ratio
                                : adaptive_grid(b.bin_w, width, pooled_width);
  const int64_t count =
      (b.grid_h > 0 && b.grid_w > 0) ? b.grid_h * b.grid_w : int64_t(1);
  b.inv_count = T(1) / static_cast<T>(count);
  return b;
}

// Coordinate of sample i (of `grid`) in bin p along one axis.
template <typename T, typename I>
C10_HOST_DEVICE inline T roi_align_sample(T start, T bin, I p, I i, I grid) {
  return start + static_cast<T>(p) * bin +
         (static_cast<T>(i) + T(0.5)) * bin / static_cast<T>(grid);
}

// The two pixels a sample at coordinate v reads along an axis of `size`
// pixels, and their linear weights.  False when the sample lies outside
// [-1, size] (or is NaN): it then contributes nothing.
// I: the index type (int32 where the caller knows the plane's offsets fit,
// as the CUDA forward does: 64-bit conversions and products cost several
// instructions each on a GPU).
template <typename T, typename I>
C10_HOST_DEVICE inline bool roi_align_axis(T v, I size, I& lo, I& hi, T& w_lo,
                                           T& w_hi) {
  if (!(v >= T(-1) && v <= static_cast<T>(size)) || size <= 0) {
    return false;
  }
  if (v <= T(0)) {
    v = T(0);
  }
  lo = static_cast<I>(v);
  if (lo >= size - 1) {
    lo = hi = size - 1;
    v = static_cast<T>(lo);
  } else {
    hi = lo + 1;
  }
  w_hi = v - static_cast<T>(lo);
  w_lo = T(1) - w_hi;
  return true;
}

// w * v for a tap of weight w, or 0 where w is 0: bilinear interpolation
// does not read a pixel it gives no weight (a sample on a pixel, or clamped
// to the last one), so an inf or NaN there must not make the sum NaN
// (0 * inf).  torchvision multiplies such taps; for finite values the sums
// agree.
template <typename T>
C10_HOST_DEVICE inline T roi_align_weighted(T w, T v) {
  return w != T(0) ? w * v : T(0);
}

// d w_hi / d v of a sample at v along an axis of `size` pixels (d w_lo / d v
// is its negative): 1 where roi_align_axis interpolates, 0 where it clamps
// (v <= 0, or v at or past the last pixel: the value does not move with v).
// For ops whose sampling positions are differentiable (deform_roi_pool).
template <typename T>
C10_HOST_DEVICE inline T roi_align_slope(T v, int64_t size) {
  return (v > T(0) && v < static_cast<T>(size - 1)) ? T(1) : T(0);
}

// The two pixels, and their weights, that one sample reads along an axis.
template <typename T, typename I = int64_t>
struct AxisTap {
  I lo = 0, hi = 0;
  T w_lo = T(0), w_hi = T(0);
};

// Sample i of bin p along one axis: where it lies (roi_align_sample) and
// what it reads (roi_align_axis).  False when it contributes nothing.
template <typename T, typename I>
C10_HOST_DEVICE inline bool roi_align_tap(T start, T bin, I p, I i, I grid,
                                          I size, AxisTap<T, I>& tap) {
  return roi_align_axis(roi_align_sample(start, bin, p, i, grid), size, tap.lo,
                        tap.hi, tap.w_lo, tap.w_hi);
}

}  // namespace torchops
