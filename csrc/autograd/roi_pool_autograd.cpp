// Autograd of torchops.roi_pool: each output's gradient goes to the input
// pixel its argmax names (the boxes are constants and argmax is not
// differentiable).  The backward is the registered operator
// torchops::_roi_pool_backward.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace torchops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

}  // namespace

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("roi_pool", &roi_pool_autograd);
}

}  // namespace torchops::autograd
