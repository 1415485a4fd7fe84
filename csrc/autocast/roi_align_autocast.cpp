// Autocast of torchops.roi_align, as torchvision does it: computed in
// float32, returned in the input's dtype.
#include "common/autocast.h"
#include "ops.h"

namespace torchops {
namespace {

template <c10::DeviceType D>
at::Tensor roi_align_autocast(const at::Tensor& input, const at::Tensor& rois,
                              double spatial_scale, c10::SymInt pooled_height,
                              c10::SymInt pooled_width, int64_t sampling_ratio,
                              bool aligned) {
  const AutocastFloat32<D> guard;
  return guard.back(
      ops::roi_align(guard.up(input), guard.up(rois), spatial_scale,
                     std::move(pooled_height), std::move(pooled_width),
                     sampling_ratio, aligned),
      input);
}

}  // namespace
}  // namespace torchops

TORCHOPS_REGISTER_AUTOCAST("roi_align", torchops::roi_align_autocast)
