// Dispatcher glue of torchops.roi_pool: registers its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// Each output's gradient goes to the input pixel its argmax names (the boxes
// are constants and argmax is not differentiable).  The backward is the
// registered operator torchops::_roi_pool_backward, called through the
// dispatcher.  Autocast, as torchvision does it: computed in float32; the
// pooled values come back in the input's dtype, argmax as is.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

std::tuple<at::Tensor, at::Tensor> roi_pool(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt)>(
      "torchops::roi_pool");
  return op.call(input, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width));
}

at::Tensor roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, c10::SymInt pooled_height, c10::SymInt pooled_width,
    c10::SymInt batch_size, c10::SymInt channels, c10::SymInt height,
    c10::SymInt width) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
      c10::SymInt)>("torchops::_roi_pool_backward");
  return op.call(grad, rois, argmax, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), std::move(batch_size),
                 std::move(channels), std::move(height), std::move(width));
}

}  // namespace ops

class RoiPool : public torch::autograd::Function<RoiPool> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& rois, double spatial_scale,
                               c10::SymInt pooled_height,
                               c10::SymInt pooled_width) {
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["input_sizes"] = c10::IValue(input.sym_sizes());
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, argmax] =
        ops::roi_pool(input, rois, spatial_scale, std::move(pooled_height),
                      std::move(pooled_width));
    ctx->save_for_backward({rois, argmax});
    ctx->mark_non_differentiable({argmax});
    return {out, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const auto sizes = d.at("input_sizes").toSymIntVector();
    at::Tensor grad_input = ops::roi_pool_backward(
        grads[0], saved[0], saved[1], d.at("spatial_scale").toDouble(),
        d.at("pooled_height").toSymInt(), d.at("pooled_width").toSymInt(),
        sizes[0], sizes[1], sizes[2], sizes[3]);
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> roi_pool_autograd(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width) {
  const variable_list out =
      RoiPool::apply(input, rois, spatial_scale, std::move(pooled_height),
                     std::move(pooled_width));
  return {out[0], out[1]};
}

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
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("roi_pool", &torchops::dispatch::roi_pool_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("roi_pool", torchops::dispatch::roi_pool_autocast)
