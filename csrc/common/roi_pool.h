// The geometry of roi_pool, written once for the CPU and CUDA kernels, with
// torchvision's semantics and arithmetic (in T = at::opmath_type of the
// input).
//
// The RoI's corners are rounded to pixels (half away from zero), malformed
// boxes become 1x1, and bin (ph, pw) is the max over the pixels
// [floor(ph * bin_h), ceil((ph + 1) * bin_h)) x [...) of the box, clipped to
// the image.  An empty bin gives 0 and argmax -1.  argmax is the index h * W
// + w of the maximum in its (H, W) plane; the first maximum in row-major
// order wins ties, NaNs are never chosen.
#pragma once

#include <c10/macros/Macros.h>

#include <cfloat>
#include <cmath>

#include "common/roi.h"

namespace torchops {

template <typename T>
struct RoiPoolBox {
  int64_t batch;            // image index (not range-checked here)
  int64_t start_h, start_w; // rounded top-left corner
  T bin_h, bin_w;
};

template <typename T, typename R>
C10_HOST_DEVICE inline RoiPoolBox<T> roi_pool_box(
    const R* roi, T spatial_scale, int64_t pooled_height, int64_t pooled_width) {
  RoiPoolBox<T> b;
  b.batch = roi_batch_index(static_cast<T>(roi[0]));
  b.start_w = saturating_trunc(std::round(static_cast<T>(roi[1]) * spatial_scale));
  b.start_h = saturating_trunc(std::round(static_cast<T>(roi[2]) * spatial_scale));
  const int64_t end_w =
      saturating_trunc(std::round(static_cast<T>(roi[3]) * spatial_scale));
  const int64_t end_h =
      saturating_trunc(std::round(static_cast<T>(roi[4]) * spatial_scale));
  const int64_t roi_w = end_w - b.start_w + 1;
  const int64_t roi_h = end_h - b.start_h + 1;
  b.bin_w = static_cast<T>(roi_w < 1 ? 1 : roi_w) / static_cast<T>(pooled_width);
  b.bin_h = static_cast<T>(roi_h < 1 ? 1 : roi_h) / static_cast<T>(pooled_height);
  return b;
}

// Pixel range [lo, hi) of bin p along an axis of `size` pixels.
template <typename T>
C10_HOST_DEVICE inline void roi_pool_bin(T bin, int64_t p, int64_t start,
                                         int64_t size, int64_t& lo,
                                         int64_t& hi) {
  lo = saturating_trunc(std::floor(static_cast<T>(p) * bin)) + start;
  hi = saturating_trunc(std::ceil(static_cast<T>(p + 1) * bin)) + start;
  lo = lo < 0 ? 0 : (lo > size ? size : lo);
  hi = hi < 0 ? 0 : (hi > size ? size : hi);
}

// torchvision starts every non-empty bin's running maximum here.
template <typename T>
C10_HOST_DEVICE inline T roi_pool_initial_max() {
  return static_cast<T>(-FLT_MAX);
}

// The backward's argmax: the forward's, one int64 per element of grad.
inline void check_roi_pool_argmax(const char* op, const at::Tensor& grad,
                                  const at::Tensor& argmax) {
  TORCH_CHECK(argmax.scalar_type() == at::kLong && argmax.sizes() == grad.sizes(),
              "torchops.", op, ": expected 'argmax' to be an int64 tensor of "
              "the shape of 'grad' (", grad.sizes(), "), but got ",
              argmax.scalar_type(), " of shape ", argmax.sizes());
}

}  // namespace torchops
