// Dispatcher glue of torchops.ms_deform_attn: its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// Gradients flow to value, sampling_locations and attention_weights through
// the registered operator torchops::_ms_deform_attn_backward, called through
// the dispatcher so compiled training steps trace through it (no double
// backward).  spatial_shapes and level_start_index are integer constants.
// Autocast as for the detection ops: computed in float32, returned in
// value's dtype, so mixed calls (half value, float32 locations and weights,
// as a projection under autocast makes them) work.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor ms_deform_attn(const at::Tensor& value, const at::Tensor& shapes,
                          const at::Tensor& starts, const at::Tensor& loc,
                          const at::Tensor& attn) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&)>("torchops::ms_deform_attn");
  return op.call(value, shapes, starts, loc, attn);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const at::Tensor& grad, const at::Tensor& value, const at::Tensor& shapes,
    const at::Tensor& starts, const at::Tensor& loc, const at::Tensor& attn) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&)>("torchops::_ms_deform_attn_backward");
  return op.call(grad, value, shapes, starts, loc, attn);
}

}  // namespace ops

class MsDeformAttn : public torch::autograd::Function<MsDeformAttn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& shapes, const at::Tensor& starts,
                            const at::Tensor& loc, const at::Tensor& attn) {
    ctx->save_for_backward({value, shapes, starts, loc, attn});
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::ms_deform_attn(value, shapes, starts, loc, attn);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_value, grad_loc, grad_attn] =
        ops::ms_deform_attn_backward(grads[0], s[0], s[1], s[2], s[3], s[4]);
    return {grad_value, at::Tensor(), at::Tensor(), grad_loc, grad_attn};
  }
};

at::Tensor ms_deform_attn_autograd(const at::Tensor& value, const at::Tensor& shapes,
                                   const at::Tensor& starts, const at::Tensor& loc,
                                   const at::Tensor& attn) {
  return MsDeformAttn::apply(value, shapes, starts, loc, attn);
}

template <c10::DeviceType D>
at::Tensor ms_deform_attn_autocast(const at::Tensor& value, const at::Tensor& shapes,
                                   const at::Tensor& starts, const at::Tensor& loc,
                                   const at::Tensor& attn) {
  const AutocastFloat32<D> guard;
  return guard.back(
      ops::ms_deform_attn(guard.up(value), shapes, starts, guard.up(loc), guard.up(attn)),
      value);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("ms_deform_attn", &torchops::dispatch::ms_deform_attn_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("ms_deform_attn", torchops::dispatch::ms_deform_attn_autocast)
