// Dispatcher glue of torchops.roi_align: registers its Autograd kernel and
// its AutocastCPU/AutocastCUDA kernels.
//
// The gradient flows to the input only (the sampling positions depend on the
// RoIs, but like torchvision we treat the boxes as constants).  The backward
// is the registered operator torchops::_roi_align_backward, called through
// the dispatcher, so compiled training steps trace through it.  Autocast, as
// torchvision does it: computed in float32, returned in the input's dtype.
#include <torch/autograd.h>
#include <torch/library.h>

#include <utility>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor roi_align(const at::Tensor& input, const at::Tensor& rois,
                     double spatial_scale, c10::SymInt pooled_height,
                     c10::SymInt pooled_width, int64_t sampling_ratio,
                     bool aligned) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt,
      int64_t, bool)>("torchops::roi_align");
  return op.call(input, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), sampling_ratio, aligned);
}

at::Tensor roi_align_backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width,
    c10::SymInt batch_size, c10::SymInt channels, c10::SymInt height,
    c10::SymInt width, int64_t sampling_ratio, bool aligned) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt,
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, int64_t, bool)>(
      "torchops::_roi_align_backward");
  return op.call(grad, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), std::move(batch_size),
                 std::move(channels), std::move(height), std::move(width),
                 sampling_ratio, aligned);
}

}  // namespace ops

class RoiAlign : public torch::autograd::Function<RoiAlign> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& rois, double spatial_scale,
                            c10::SymInt pooled_height, c10::SymInt pooled_width,
                            int64_t sampling_ratio, bool aligned) {
    ctx->save_for_backward({rois});
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["sampling_ratio"] = sampling_ratio;
    ctx->saved_data["aligned"] = aligned;
    const auto sizes = input.sym_sizes();
    ctx->saved_data["input_sizes"] = c10::IValue(sizes);
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::roi_align(input, rois, spatial_scale, std::move(pooled_height),
                          std::move(pooled_width), sampling_ratio, aligned);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor rois = ctx->get_saved_variables()[0];
    const auto& d = ctx->saved_data;
    const auto sizes = d.at("input_sizes").toSymIntVector();
    at::Tensor grad_input = ops::roi_align_backward(
        grads[0], rois, d.at("spatial_scale").toDouble(),
        d.at("pooled_height").toSymInt(), d.at("pooled_width").toSymInt(),
        sizes[0], sizes[1], sizes[2], sizes[3],
        d.at("sampling_ratio").toInt(), d.at("aligned").toBool());
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor roi_align_autograd(const at::Tensor& input, const at::Tensor& rois,
                              double spatial_scale, c10::SymInt pooled_height,
                              c10::SymInt pooled_width, int64_t sampling_ratio,
                              bool aligned) {
  return RoiAlign::apply(input, rois, spatial_scale, std::move(pooled_height),
                         std::move(pooled_width), sampling_ratio, aligned);
}

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
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("roi_align", &torchops::dispatch::roi_align_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("roi_align", torchops::dispatch::roi_align_autocast)
