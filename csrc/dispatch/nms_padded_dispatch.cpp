// Dispatcher glue of torchops.nms_padded: registers its
// AutocastCPU/AutocastCUDA kernels.  Like nms, boxes and scores are upcast to
// float32; idxs and the int64 results are left alone.  No Autograd kernel:
// indices and counts have no gradient.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

namespace ops {

std::tuple<at::Tensor, at::Tensor> nms_padded(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    const std::optional<at::Tensor>& idxs) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double,
      const std::optional<at::Tensor>&)>("torchops::nms_padded");
  return op.call(boxes, scores, iou_threshold, idxs);
}

}  // namespace ops

template <c10::DeviceType D>
std::tuple<at::Tensor, at::Tensor> nms_padded_autocast(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    const std::optional<at::Tensor>& idxs) {
  const AutocastFloat32<D> guard;
  return ops::nms_padded(guard.up(boxes), guard.up(scores), iou_threshold,
                         idxs);
}

}  // namespace
}  // namespace torchops::dispatch

TORCHOPS_REGISTER_AUTOCAST("nms_padded", torchops::dispatch::nms_padded_autocast)
