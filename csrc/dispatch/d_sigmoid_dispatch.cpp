// Dispatcher glue of torchops.d_sigmoid: registers its Autograd kernel.  The
// backward is the registered operator torchops::_d_sigmoid_backward, called
// through the dispatcher, so compiled training steps stay in one graph.
#include <torch/autograd.h>
#include <torch/library.h>

#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor d_sigmoid(const at::Tensor& z) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&)>("torchops::d_sigmoid");
  return op.call(z);
}

at::Tensor d_sigmoid_backward(const at::Tensor& grad, const at::Tensor& z) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::_d_sigmoid_backward");
  return op.call(grad, z);
}

}  // namespace ops

class DSigmoid : public torch::autograd::Function<DSigmoid> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& z) {
    ctx->save_for_backward({z});
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::d_sigmoid(z);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor z = ctx->get_saved_variables()[0];
    return {ops::d_sigmoid_backward(grads[0], z)};
  }
};

at::Tensor d_sigmoid_autograd(const at::Tensor& z) {
  return DSigmoid::apply(z);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("d_sigmoid", &torchops::dispatch::d_sigmoid_autograd);
}
