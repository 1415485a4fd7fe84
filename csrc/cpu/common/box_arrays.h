// Boxes in structure-of-arrays form for the CPU box kernels (nms, box_iou):
// x1, y1, x2, y2 and area in contiguous arrays of the op math type, so the
// hot loops read unit-stride vectors.
#pragma once

#include <cstdint>

#include "common/boxes.h"

namespace torchops::cpu {

// Copies row `src` of a contiguous (N, 4) box array into slot `dst` of
// `out` (any type with x1, y1, x2, y2, area arrays of T), with its area.
template <typename T, typename scalar_t, typename Arrays>
inline void load_box(const scalar_t* boxes, int64_t src, Arrays& out, int64_t dst) {
  const T x1 = static_cast<T>(boxes[4 * src + 0]);
  const T y1 = static_cast<T>(boxes[4 * src + 1]);
  const T x2 = static_cast<T>(boxes[4 * src + 2]);
  const T y2 = static_cast<T>(boxes[4 * src + 3]);
  out.x1[dst] = x1;
  out.y1[dst] = y1;
  out.x2[dst] = x2;
  out.y2[dst] = y2;
  out.area[dst] = box_area(x1, y1, x2, y2);
}

}  // namespace torchops::cpu
