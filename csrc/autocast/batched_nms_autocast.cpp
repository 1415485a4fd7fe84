// Autocast of torchops.batched_nms: like nms, boxes and scores are upcast to
// float32; idxs and the int64 result are left alone.
#include "common/autocast.h"
#include "ops.h"

namespace torchops {
namespace {

template <c10::DeviceType D>
at::Tensor batched_nms_autocast(const at::Tensor& boxes,
                                const at::Tensor& scores,
                                const at::Tensor& idxs, double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::batched_nms(guard.up(boxes), guard.up(scores), idxs,
                          iou_threshold);
}

}  // namespace

TORCHOPS_REGISTER_AUTOCAST("batched_nms", batched_nms_autocast)

}  // namespace torchops
