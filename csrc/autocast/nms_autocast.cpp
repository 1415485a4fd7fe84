// Autocast of torchops.nms, as torchvision registers it: under torch.autocast
// the boxes and scores are upcast to float32 (IoU tests in float32); the
// result is int64 indices, so nothing is cast back.
#include "common/autocast.h"
#include "ops.h"

namespace torchops {
namespace {

template <c10::DeviceType D>
at::Tensor nms_autocast(const at::Tensor& boxes, const at::Tensor& scores,
                        double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::nms(guard.up(boxes), guard.up(scores), iou_threshold);
}

}  // namespace

TORCHOPS_REGISTER_AUTOCAST("nms", nms_autocast)

}  // namespace torchops
