// Dispatcher glue of torchops.carafe: registers its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// The op is bilinear in (features, masks); its backward is the registered
// operator torchops::_carafe_backward, which returns both gradients, called
// through the dispatcher so compiled training steps trace through it.
// Autocast, as for the detection ops: computed in float32, returned in the
// features' dtype.
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

at::Tensor carafe(const at::Tensor& features, const at::Tensor& masks,
                  int64_t kernel_size, int64_t group_size,
                  int64_t scale_factor) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>(
      "torchops::carafe");
  return op.call(features, masks, kernel_size, group_size, scale_factor);
}

std::tuple<at::Tensor, at::Tensor> carafe_backward(
    const at::Tensor& grad, const at::Tensor& features, const at::Tensor& masks,
    int64_t kernel_size, int64_t group_size, int64_t scale_factor) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
      int64_t)>("torchops::_carafe_backward");
  return op.call(grad, features, masks, kernel_size, group_size, scale_factor);
}

}  // namespace ops

class Carafe : public torch::autograd::Function<Carafe> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& features,
                            const at::Tensor& masks, int64_t kernel_size,
                            int64_t group_size, int64_t scale_factor) {
    ctx->save_for_backward({features, masks});
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["scale_factor"] = scale_factor;
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::carafe(features, masks, kernel_size, group_size, scale_factor);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    auto [grad_features, grad_masks] = ops::carafe_backward(
        grads[0], saved[0], saved[1], d.at("kernel_size").toInt(),
        d.at("group_size").toInt(), d.at("scale_factor").toInt());
    return {grad_features, grad_masks, at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor carafe_autograd(const at::Tensor& features, const at::Tensor& masks,
                           int64_t kernel_size, int64_t group_size,
                           int64_t scale_factor) {
  return Carafe::apply(features, masks, kernel_size, group_size, scale_factor);
}

template <c10::DeviceType D>
at::Tensor carafe_autocast(const at::Tensor& features, const at::Tensor& masks,
                           int64_t kernel_size, int64_t group_size,
                           int64_t scale_factor) {
  const AutocastFloat32<D> guard;
  return guard.back(ops::carafe(guard.up(features), guard.up(masks),
                                kernel_size, group_size, scale_factor),
                    features);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("carafe", &torchops::dispatch::carafe_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("carafe", torchops::dispatch::carafe_autocast)
