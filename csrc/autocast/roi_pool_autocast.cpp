// Autocast of torchops.roi_pool, as torchvision does it: computed in
// float32; the pooled values come back in the input's dtype, argmax as is.
#include "common/autocast.h"
#include "ops.h"

namespace torchops {
namespace {

template <c10::DeviceType D>
std::tuple<at::Tensor, at::Tensor> roi_pool_autocast(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width) {
  const AutocastFloat32<D> guard;
  auto [out, argmax] =
      ops::roi_pool(guard.up(input), guard.up(rois), spatial_scale,
                    std::move(pooled_height), std::move(pooled_width));
  return {guard.back(out, input), argmax};
}

}  // namespace
}  // namespace torchops

TORCHOPS_REGISTER_AUTOCAST("roi_pool", torchops::roi_pool_autocast)
