// Dispatcher glue of torchops.nms: registers its AutocastCPU/AutocastCUDA
// kernels, as torchvision registers them: under torch.autocast the boxes and
// scores are upcast to float32 (IoU tests in float32); the result is int64
// indices, so nothing is cast back.  No Autograd kernel: indices have no
// gradient.
#include <torch/library.h>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

namespace ops {

at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores,
               double iou_threshold) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double)>("torchops::nms");
  return op.call(boxes, scores, iou_threshold);
}

}  // namespace ops

template <c10::DeviceType D>
at::Tensor nms_autocast(const at::Tensor& boxes, const at::Tensor& scores,
                        double iou_threshold) {
  const AutocastFloat32<D> guard;
  return ops::nms(guard.up(boxes), guard.up(scores), iou_threshold);
}

}  // namespace
}  // namespace torchops::dispatch

TORCHOPS_REGISTER_AUTOCAST("nms", torchops::dispatch::nms_autocast)
