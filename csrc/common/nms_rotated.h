// What nms_rotated and batched_nms_rotated share between their CPU and CUDA
// kernels: the checks (nms's, with rotated rows) and the suppression test.
//
// Semantics as nms's (common/nms.h): boxes are visited by decreasing score,
// equal scores in input order (stable sort); a box is kept unless a kept box
// of higher score (of the same category, for the batched op) overlaps it with
// IoU > iou_threshold.  The IoU is rotated_iou's, in double for every dtype,
// and compared with the threshold in double.  Categories are compared in the
// kernel, as batched_nms does, instead of detectron2's trick of shifting
// each category's boxes apart: a shift by (category * extent) would cost a
// float32 box its low-order bits, and with them the overlaps of small boxes.
#pragma once

#include <ATen/core/Tensor.h>

#include "common/nms.h"
#include "common/rotated_boxes.h"

namespace torchops {

inline void check_nms_rotated(const char* op, const at::Tensor& boxes,
                              const at::Tensor& scores, const at::Tensor* idxs,
                              double iou_threshold, c10::DeviceType device) {
  check_nms(op, boxes, scores, idxs, iou_threshold, device,
            check_rotated_boxes);
}

// Does box `a` (higher score) suppress box `b`?  rotated_iou is symmetric
// up to rounding; the higher-scored box goes first on every device, so both
// evaluate the same expression.
// Boxes whose circles do not meet have IoU 0, which no threshold >= 0 is
// below: that test comes first, inline, as in nms_suppresses.
C10_HOST_DEVICE inline bool rotated_suppresses(const RotatedBox& a,
                                               const RotatedBox& b,
                                               double threshold) {
  if (threshold >= 0.0 && !rotated_circles_meet(a, b)) {
    return false;
  }
  return rotated_iou(a, b) > threshold;
}

template <NmsImpl Impl>
at::Tensor nms_rotated_entry(const at::Tensor& boxes, const at::Tensor& scores,
                             double iou_threshold) {
  return Impl("nms_rotated", boxes, scores, nullptr, iou_threshold);
}

template <NmsImpl Impl>
at::Tensor batched_nms_rotated_entry(const at::Tensor& boxes,
                                     const at::Tensor& scores,
                                     const at::Tensor& idxs,
                                     double iou_threshold) {
  return Impl("batched_nms_rotated", boxes, scores, &idxs, iou_threshold);
}

}  // namespace torchops
