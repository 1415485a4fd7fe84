// Dispatcher glue of torchops.batched_nms: registers its
// AutocastCPU/AutocastCUDA kernels.  Like nms, boxes and scores are upcast to
// float32; idxs and the int64 result are left alone.  No Autograd kernel:
// indices have no gradient.
#include <torch/library.h>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

namespace ops {

at::Tensor batched_nms(const at::Tensor& boxes, const at::Tensor& scores,
                       const at::Tensor& idxs, double iou_threshold) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "torchops::batched_nms");
  return op.call(boxes, scores, idxs, iou_threshold);
}

}  // namespace ops

template <c10::DeviceType D>
at::Tensor batched_nms_autocast(const at::Tensor& boxes,
                                const at::Tensor& scores,
                                const at::Tensor& idxs, double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::batched_nms(guard.up(boxes), guard.up(scores), idxs,
                          iou_threshold);
}

}  // namespace
}  // namespace torchops::dispatch

TORCHOPS_REGISTER_AUTOCAST("batched_nms", torchops::dispatch::batched_nms_autocast)
