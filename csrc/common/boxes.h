// Box geometry and argument checks shared by the box ops (nms, batched_nms,
// box_iou) on CPU and CUDA.
//
// Boxes are (x1, y1, x2, y2) rows.  All geometry is evaluated in the op math
// type (float for float/half/bfloat16, double for double) from values that
// were converted once, so every kernel sees the same numbers.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "common/checks.h"

namespace torchops {

// One box in the op math type.  16-byte (float) / 32-byte (double) aligned so
// a CUDA thread loads a box with a single vector load.
template <typename T>
struct alignas(4 * sizeof(T)) Box {
  T x1, y1, x2, y2;
};

template <typename T>
C10_HOST_DEVICE inline T max_of(T a, T b) {
  return a > b ? a : b;
}

template <typename T>
C10_HOST_DEVICE inline T min_of(T a, T b) {
  return a < b ? a : b;
}

template <typename T>
C10_HOST_DEVICE inline T box_area(T x1, T y1, T x2, T y2) {
  return (x2 - x1) * (y2 - y1);
}

// Intersection area of two boxes (0 when they do not overlap).
template <typename T>
C10_HOST_DEVICE inline T box_intersection(
    T ax1, T ay1, T ax2, T ay2, T bx1, T by1, T bx2, T by2) {
  const T w = max_of(min_of(ax2, bx2) - max_of(ax1, bx1), T(0));
  const T h = max_of(min_of(ay2, by2) - max_of(ay1, by1), T(0));
  return w * h;
}

// IoU with the evaluation order of torchvision's kernels:
// inter / (area_a + area_b - inter).  Same order, same rounding: results agree
// bit for bit wherever the compilers contract the same way.
template <typename T>
C10_HOST_DEVICE inline T iou_of(T inter, T area_a, T area_b) {
  return inter / (area_a + area_b - inter);
}

// --- argument checks --------------------------------------------------------

// `x` is a floating (K, 4) tensor of boxes.
inline void check_boxes(const char* op, Arg x) {
  check_floating(op, x);
  TORCH_CHECK(
      x.t.dim() == 2 && x.t.size(1) == 4, "torchops.", op, ": expected '",
      x.name, "' to have shape (N, 4) (one box (x1, y1, x2, y2) per row), but "
      "got shape ", x.t.sizes());
}

// `x` is a 1-D tensor of n values, one per box of `boxes`.
inline void check_per_box(const char* op, Arg x, Arg boxes) {
  TORCH_CHECK(
      x.t.dim() == 1 && x.t.size(0) == boxes.t.size(0), "torchops.", op,
      ": expected '", x.name, "' to have shape (N,) with N = ",
      boxes.t.size(0), " (the number of rows of '", boxes.name, "'), but got "
      "shape ", x.t.sizes());
}

}  // namespace torchops
