// Dispatcher glue of torchops.nms_rotated, batched_nms_rotated and soft_nms:
// their AutocastCPU/AutocastCUDA kernels, nms's policy -- boxes and scores
// upcast to float32 (so a half-precision head's boxes and float32 scores
// meet in one dtype); indices are left alone and soft_nms's scores come
// back in the boxes' dtype (the first input's, as for the other detection
// ops).  No Autograd kernels: indices have
// no gradient, and soft_nms's selection is not differentiable.
#include <torch/library.h>

#include <tuple>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

namespace ops {

at::Tensor nms_rotated(const at::Tensor& boxes, const at::Tensor& scores,
                       double iou_threshold) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double)>("torchops::nms_rotated");
  return op.call(boxes, scores, iou_threshold);
}

at::Tensor batched_nms_rotated(const at::Tensor& boxes, const at::Tensor& scores,
                               const at::Tensor& idxs, double iou_threshold) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "torchops::batched_nms_rotated");
  return op.call(boxes, scores, idxs, iou_threshold);
}

std::tuple<at::Tensor, at::Tensor> soft_nms(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double sigma, double min_score, c10::string_view method) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double, double, double,
      c10::string_view)>("torchops::soft_nms");
  return op.call(boxes, scores, iou_threshold, sigma, min_score, method);
}

}  // namespace ops

template <c10::DeviceType D>
at::Tensor nms_rotated_autocast(const at::Tensor& boxes,
                                const at::Tensor& scores,
                                double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::nms_rotated(guard.up(boxes), guard.up(scores), iou_threshold);
}

template <c10::DeviceType D>
at::Tensor batched_nms_rotated_autocast(const at::Tensor& boxes,
                                        const at::Tensor& scores,
                                        const at::Tensor& idxs,
                                        double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::batched_nms_rotated(guard.up(boxes), guard.up(scores), idxs,
                                  iou_threshold);
}

template <c10::DeviceType D>
std::tuple<at::Tensor, at::Tensor> soft_nms_autocast(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double sigma, double min_score, c10::string_view method) {
  const AutocastFloat32<D> guard;
  auto [keep, new_scores] =
      ops::soft_nms(guard.up(boxes), guard.up(scores), iou_threshold, sigma,
                    min_score, method);
  return {keep, guard.back(new_scores, boxes)};
}

}  // namespace
}  // namespace torchops::dispatch

TORCHOPS_REGISTER_AUTOCAST("nms_rotated", torchops::dispatch::nms_rotated_autocast)
TORCHOPS_REGISTER_AUTOCAST("batched_nms_rotated",
                           torchops::dispatch::batched_nms_rotated_autocast)
TORCHOPS_REGISTER_AUTOCAST("soft_nms", torchops::dispatch::soft_nms_autocast)
