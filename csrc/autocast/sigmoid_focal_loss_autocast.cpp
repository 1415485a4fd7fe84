// Autocast of torchops.sigmoid_focal_loss: computed in float32 under
// torch.autocast, returned in the dtype of 'inputs' (torchvision's autocast
// convention for its ops).
#include "common/autocast.h"
#include "ops.h"

namespace torchops {
namespace {

template <c10::DeviceType D>
at::Tensor sigmoid_focal_loss_autocast(
    const at::Tensor& inputs, const at::Tensor& targets, double alpha,
    double gamma, c10::string_view reduction) {
  const AutocastFloat32<D> guard;
  return guard.back(
      ops::sigmoid_focal_loss(
          guard.up(inputs), guard.up(targets), alpha, gamma, reduction),
      inputs);
}

}  // namespace
}  // namespace torchops

TORCHOPS_REGISTER_AUTOCAST("sigmoid_focal_loss", torchops::sigmoid_focal_loss_autocast)
