// Autograd of torchops.d_sigmoid.  The backward is the registered operator
// torchops::_d_sigmoid_backward, so compiled training steps stay in one graph.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace torchops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("d_sigmoid", &d_sigmoid_autograd);
}

}  // namespace torchops::autograd
