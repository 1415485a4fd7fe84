// Dispatcher glue of torchops.deform_roi_pool: its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// Gradients flow to the input and the offset (not to the RoIs, which, as in
// mmcv and roi_align, are constants) through the registered operator
// torchops::_deform_roi_pool_backward, called through the dispatcher so
// compiled training steps trace through it (no double backward).  When the
// offset needs a gradient, the forward is torchops::_deform_roi_pool_forward,
// which also returns the slopes the offset's gradient sums, so the backward
// does not read the input's samples again.  Autocast
// as for roi_align: computed in float32, returned in the input's dtype.
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using c10::SymInt;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

namespace ops {

at::Tensor deform_roi_pool(const at::Tensor& input, const at::Tensor& rois,
                           const OptTensor& offset, double spatial_scale,
                           SymInt pooled_height, SymInt pooled_width,
                           int64_t sampling_ratio, double gamma) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const OptTensor&, double, SymInt,
      SymInt, int64_t, double)>("torchops::deform_roi_pool");
  return op.call(input, rois, offset, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), sampling_ratio, gamma);
}

std::tuple<at::Tensor, at::Tensor> deform_roi_pool_with_slopes(
    const at::Tensor& input, const at::Tensor& rois, const at::Tensor& offset,
    double spatial_scale, SymInt pooled_height, SymInt pooled_width,
    int64_t sampling_ratio, double gamma) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, SymInt,
      SymInt, int64_t, double)>("torchops::_deform_roi_pool_forward");
  return op.call(input, rois, offset, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), sampling_ratio, gamma);
}

std::tuple<at::Tensor, at::Tensor> deform_roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& rois,
    const OptTensor& offset, const OptTensor& slopes, double spatial_scale,
    SymInt pooled_height, SymInt pooled_width, int64_t sampling_ratio,
    double gamma) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const OptTensor&, const OptTensor&, double, SymInt, SymInt, int64_t,
      double)>("torchops::_deform_roi_pool_backward");
  return op.call(grad, input, rois, offset, slopes, spatial_scale,
                 std::move(pooled_height), std::move(pooled_width),
                 sampling_ratio, gamma);
}

}  // namespace ops

class DeformRoiPool : public torch::autograd::Function<DeformRoiPool> {
 public:
  // offset_grad: whether the offset needs a gradient (decided by the caller,
  // since forward runs with grad mode off).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& rois, const OptTensor& offset,
                            double spatial_scale, SymInt pooled_height,
                            SymInt pooled_width, int64_t sampling_ratio,
                            double gamma, bool offset_grad) {
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["sampling_ratio"] = sampling_ratio;
    ctx->saved_data["gamma"] = gamma;
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out, slopes;
    if (offset_grad) {
      std::tie(out, slopes) = ops::deform_roi_pool_with_slopes(
          input, rois, *offset, spatial_scale, std::move(pooled_height),
          std::move(pooled_width), sampling_ratio, gamma);
    } else {
      out = ops::deform_roi_pool(input, rois, offset, spatial_scale,
                                 std::move(pooled_height),
                                 std::move(pooled_width), sampling_ratio, gamma);
    }
    // An absent offset, or absent slopes, are saved as undefined tensors.
    ctx->save_for_backward({input, rois, offset.value_or(at::Tensor()), slopes});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const auto opt = [](const at::Tensor& t) {
      return t.defined() ? OptTensor(t) : OptTensor();
    };
    const OptTensor offset = opt(saved[2]), slopes = opt(saved[3]);
    auto [grad_input, grad_offset] = ops::deform_roi_pool_backward(
        grads[0], saved[0], saved[1], offset, slopes,
        d.at("spatial_scale").toDouble(), d.at("pooled_height").toSymInt(),
        d.at("pooled_width").toSymInt(), d.at("sampling_ratio").toInt(),
        d.at("gamma").toDouble());
    return {grad_input,  at::Tensor(),
            slopes.has_value() ? grad_offset : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor deform_roi_pool_autograd(const at::Tensor& input,
                                    const at::Tensor& rois,
                                    const OptTensor& offset,
                                    double spatial_scale, SymInt pooled_height,
                                    SymInt pooled_width, int64_t sampling_ratio,
                                    double gamma) {
  const bool offset_grad = at::GradMode::is_enabled() && offset.has_value() &&
                           offset->requires_grad();
  return DeformRoiPool::apply(input, rois, offset, spatial_scale,
                              std::move(pooled_height), std::move(pooled_width),
                              sampling_ratio, gamma, offset_grad);
}

template <c10::DeviceType D>
at::Tensor deform_roi_pool_autocast(const at::Tensor& input,
                                    const at::Tensor& rois,
                                    const OptTensor& offset,
                                    double spatial_scale, SymInt pooled_height,
                                    SymInt pooled_width, int64_t sampling_ratio,
                                    double gamma) {
  const AutocastFloat32<D> guard;
  const OptTensor offset32 =
      offset.has_value() ? OptTensor(guard.up(*offset)) : OptTensor();
  return guard.back(
      ops::deform_roi_pool(guard.up(input), guard.up(rois), offset32,
                           spatial_scale, std::move(pooled_height),
                           std::move(pooled_width), sampling_ratio, gamma),
      input);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("deform_roi_pool", &torchops::dispatch::deform_roi_pool_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("deform_roi_pool",
                           torchops::dispatch::deform_roi_pool_autocast)
