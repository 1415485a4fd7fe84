// What nms and batched_nms share between their CPU and CUDA kernels: the
// argument checks and the suppression test.
//
// Semantics (torchvision's): boxes are visited in order of decreasing score;
// a box is kept unless a kept box of higher score (of the same category, for
// batched_nms) overlaps it with IoU > iou_threshold.  Equal scores keep their
// input order (stable sort), so results are deterministic on both devices.
//
// The threshold is converted once to the op math type with round-to-nearest
// and compared there, as torchvision's CUDA kernel does for float32.  So an
// IoU that equals the threshold exactly never suppresses, in any precision
// (torchvision's CPU kernel compares in double instead: a float32 IoU of
// exactly 0.3 is above 0.3 there, because float(0.3) > 0.3).  The IoU is
// evaluated in torchvision's order -- inter / (area_a + area_b - inter) --
// with precomputed areas on the CPU and inline ones on CUDA, like
// torchvision's kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <ATen/ops/full.h>
#include <ATen/ops/scalar_tensor.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "common/boxes.h"

namespace torchops {

// Checks of nms (idxs == nullptr) and batched_nms (op names the caller);
// the rotated variants pass their own check of the boxes' shape.
inline void check_nms(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores,
    const at::Tensor* idxs, double iou_threshold, c10::DeviceType device,
    void (*check_box_rows)(const char*, Arg) = check_boxes) {
  if (idxs != nullptr) {
    check_devices(op, device,
                  {{boxes, "boxes"}, {scores, "scores"}, {*idxs, "idxs"}});
  } else {
    check_devices(op, device, {{boxes, "boxes"}, {scores, "scores"}});
  }
  check_box_rows(op, {boxes, "boxes"});
  check_floating(op, {scores, "scores"});
  check_same_dtype(op, {boxes, "boxes"}, {scores, "scores"});
  check_per_box(op, {scores, "scores"}, {boxes, "boxes"});
  if (idxs != nullptr) {
    TORCH_CHECK(
        idxs->scalar_type() == at::kLong, "torchops.", op,
        ": expected 'idxs' (the category of each box) to be an int64 tensor, "
        "but got ", idxs->scalar_type());
    check_per_box(op, {*idxs, "idxs"}, {boxes, "boxes"});
  }
  TORCH_CHECK(
      !std::isnan(iou_threshold), "torchops.", op,
      ": expected 'iou_threshold' to be a number, but got nan");
}

// The suppression test of the CUDA kernel: does box `a` (higher score)
// suppress box `b`?  Areas are computed inline, exactly like torchvision's
// CUDA kernel, so nvcc sees (and contracts) the same expression tree.
// Not symmetric in a and b once contracted into FMAs: always pass the
// higher-scored box as `a`.
template <typename T>
C10_HOST_DEVICE inline bool nms_suppresses(
    const Box<T>& a, const Box<T>& b, T threshold) {
  const T inter =
      box_intersection(a.x1, a.y1, a.x2, a.y2, b.x1, b.y1, b.x2, b.y2);
  // Boxes that do not overlap have IoU 0 (NaN for empty boxes), which no
  // threshold >= 0 is below: skip the division, as for most pairs of a
  // sparse scene.  Exact -- the full test would return false too.
  if (threshold >= T(0) && !(inter > T(0))) {
    return false;
  }
  const T area_a = (a.x2 - a.x1) * (a.y2 - a.y1);
  const T area_b = (b.x2 - b.x1) * (b.y2 - b.y1);
  return iou_of(inter, area_a, area_b) > threshold;
}

// nms and batched_nms are one kernel per device, with or without categories:
// `Impl(op, boxes, scores, idxs or nullptr, iou_threshold)`.  These are the
// two ops' entry points over it, registered by each device's file.
using NmsImpl = at::Tensor (*)(const char*, const at::Tensor&,
                               const at::Tensor&, const at::Tensor*, double);

template <NmsImpl Impl>
at::Tensor nms_entry(const at::Tensor& boxes, const at::Tensor& scores,
                     double iou_threshold) {
  return Impl("nms", boxes, scores, nullptr, iou_threshold);
}

template <NmsImpl Impl>
at::Tensor batched_nms_entry(const at::Tensor& boxes, const at::Tensor& scores,
                             const at::Tensor& idxs, double iou_threshold) {
  return Impl("batched_nms", boxes, scores, &idxs, iou_threshold);
}

// nms_padded from a device's nms: the kept rows, then -1 up to N, and their
// number as a 0-dim tensor.  For devices whose nms result is on the host
// already; CUDA writes the padded form directly, without a host sync.
template <NmsImpl Impl>
std::tuple<at::Tensor, at::Tensor> nms_padded_entry(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    const std::optional<at::Tensor>& idxs) {
  const at::Tensor kept = Impl("nms_padded", boxes, scores,
                               idxs.has_value() ? &*idxs : nullptr, iou_threshold);
  at::Tensor keep = at::full({boxes.size(0)}, -1, kept.options());
  keep.narrow(0, 0, kept.size(0)).copy_(kept);
  return {keep, at::scalar_tensor(kept.size(0), kept.options())};
}

}  // namespace torchops
