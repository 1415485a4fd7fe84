// Dispatcher glue of torchops.sigmoid_focal_loss: registers its Autograd
// kernel and its AutocastCPU/AutocastCUDA kernels.
//
// Only 'inputs' (the logits) is differentiable.  Detection losses never need
// the gradient with respect to the targets, so it is not implemented: as with
// PyTorch's own not-implemented derivatives, a backward that needs it raises,
// while a backward that only asks for the logits' gradient works even when
// 'targets' requires grad.  The backward is the registered operator
// torchops::_sigmoid_focal_loss_backward, one fused pass, called through the
// dispatcher.  Autocast computes in float32 and returns the dtype of 'inputs'
// (torchvision's autocast convention for its ops).
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor sigmoid_focal_loss(const at::Tensor& inputs,
                              const at::Tensor& targets, double alpha,
                              double gamma, c10::string_view reduction) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, double, c10::string_view)>(
      "torchops::sigmoid_focal_loss");
  return op.call(inputs, targets, alpha, gamma, reduction);
}

at::Tensor sigmoid_focal_loss_backward(
    const at::Tensor& grad, const at::Tensor& inputs,
    const at::Tensor& targets, double alpha, double gamma,
    c10::string_view reduction) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
      c10::string_view)>("torchops::_sigmoid_focal_loss_backward");
  return op.call(grad, inputs, targets, alpha, gamma, reduction);
}

}  // namespace ops

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

template <c10::DeviceType D>
at::Tensor sigmoid_focal_loss_autocast(
    const at::Tensor& inputs, const at::Tensor& targets, double alpha,
    double gamma, c10::string_view reduction) {
  const AutocastFloat32<D> guard;
  return guard.back(
      ops::sigmoid_focal_loss(
          guard.up(inputs), guard.up(targets), alpha, gamma, reduction),
      inputs);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("sigmoid_focal_loss", &torchops::dispatch::sigmoid_focal_loss_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("sigmoid_focal_loss",
                           torchops::dispatch::sigmoid_focal_loss_autocast)
