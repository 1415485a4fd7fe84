// Autograd of torchops.sigmoid_focal_loss.
//
// Only 'inputs' (the logits) is differentiable.  Detection losses never need
// the gradient with respect to the targets, so it is not implemented: as with
// PyTorch's own not-implemented derivatives, a backward that needs it raises,
// while a backward that only asks for the logits' gradient works even when
// 'targets' requires grad.  The backward is the registered operator
// torchops::_sigmoid_focal_loss_backward, one fused pass.
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

#include "ops.h"

namespace torchops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class SigmoidFocalLoss : public torch::autograd::Function<SigmoidFocalLoss> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& inputs,
      const at::Tensor& targets, double alpha, double gamma,
      c10::string_view reduction) {
    ctx->save_for_backward({inputs, targets});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["gamma"] = gamma;
    ctx->saved_data["reduction"] = std::string(reduction);
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::sigmoid_focal_loss(inputs, targets, alpha, gamma, reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(
        !ctx->needs_input_grad(1), "torchops.sigmoid_focal_loss: the "
        "gradient with respect to 'targets' is not implemented; pass "
        "targets.detach() (or do not ask for its gradient)");
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_inputs;
    if (ctx->needs_input_grad(0)) {
      grad_inputs = ops::sigmoid_focal_loss_backward(
          grads[0], saved[0], saved[1], ctx->saved_data["alpha"].toDouble(),
          ctx->saved_data["gamma"].toDouble(),
          ctx->saved_data["reduction"].toStringRef());
    }
    return {grad_inputs, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor sigmoid_focal_loss_autograd(
    const at::Tensor& inputs, const at::Tensor& targets, double alpha,
    double gamma, c10::string_view reduction) {
  return SigmoidFocalLoss::apply(inputs, targets, alpha, gamma, reduction);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("sigmoid_focal_loss", &sigmoid_focal_loss_autograd);
}

}  // namespace torchops::autograd
