// What soft_nms's CPU and CUDA kernels share: the checks, the IoU and the
// score decay.
//
// Semantics (Bodla et al. 2017, mmcv's soft_nms): repeatedly select the
// remaining box of highest score (equal scores: the lower index), output it
// with its current score, and multiply every other remaining box's score by
//   linear:   1 - iou   where iou > iou_threshold (else 1),
//   gaussian: exp(-iou^2 / sigma);
// a box whose score is below min_score is dropped, before the first selection
// as well as after each decay (mmcv keeps its first box even below
// min_score).  At most N selections: every loop is bounded by the input size.
// IoU and scores are in the op math type (float for the half types), the
// output scores in the input dtype.  Boxes with no overlap -- empty boxes
// included -- have IoU 0 (not 0/0).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cmath>

#include "common/boxes.h"

namespace torchops {

inline bool soft_nms_is_gaussian(c10::string_view method) {
  TORCH_CHECK(method == "linear" || method == "gaussian",
              "torchops.soft_nms: expected 'method' to be \"linear\" or "
              "\"gaussian\", but got \"", std::string(method), "\"");
  return method == "gaussian";
}

inline void check_soft_nms(const at::Tensor& boxes, const at::Tensor& scores,
                           double iou_threshold, double sigma,
                           double min_score, c10::DeviceType device) {
  const char* op = "soft_nms";
  check_devices(op, device, {{boxes, "boxes"}, {scores, "scores"}});
  check_boxes(op, {boxes, "boxes"});
  check_floating(op, {scores, "scores"});
  check_same_dtype(op, {boxes, "boxes"}, {scores, "scores"});
  check_per_box(op, {scores, "scores"}, {boxes, "boxes"});
  TORCH_CHECK(!std::isnan(iou_threshold),
              "torchops.soft_nms: expected 'iou_threshold' to be a number, "
              "but got nan");
  TORCH_CHECK(sigma > 0.0 && std::isfinite(sigma),
              "torchops.soft_nms: expected 'sigma' to be positive and finite, "
              "but got ", sigma);
  TORCH_CHECK(!std::isnan(min_score),
              "torchops.soft_nms: expected 'min_score' to be a number, but "
              "got nan");
}

template <typename T>
C10_HOST_DEVICE inline T soft_nms_iou(const Box<T>& a, const Box<T>& b) {
  const T inter =
      box_intersection(a.x1, a.y1, a.x2, a.y2, b.x1, b.y1, b.x2, b.y2);
  if (!(inter > T(0))) {
    return T(0);
  }
  return iou_of(inter, box_area(a.x1, a.y1, a.x2, a.y2),
                box_area(b.x1, b.y1, b.x2, b.y2));
}

// The factor a remaining box's score is multiplied by when a box it
// overlaps with IoU `iou` is selected.
template <typename T>
C10_HOST_DEVICE inline T soft_nms_weight(T iou, bool gaussian, T threshold,
                                         T sigma) {
  // Most pairs of a scene do not overlap; both decays are then exactly 1
  // (exp(-0) = 1; 1 - 0 = 1 where 0 > threshold), so skip the exp.
  if (!(iou > T(0))) {
    return T(1);
  }
  if (gaussian) {
    return std::exp(-(iou * iou) / sigma);
  }
  return iou > threshold ? T(1) - iou : T(1);
}

// Selection order: higher score first, equal scores by lower index.
template <typename T>
C10_HOST_DEVICE inline bool soft_nms_before(T score_a, int64_t index_a,
                                            T score_b, int64_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

}  // namespace torchops
