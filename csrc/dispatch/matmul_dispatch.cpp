// Dispatcher glue of torchops.matmul: registers its Autograd and
// AutocastCPU/AutocastCUDA kernels.
//
// Autocast follows torch.matmul's policy, not the detection ops': a model
// moved from torch.matmul to torchops.matmul inside torch.autocast keeps its
// tensor-core dtype (float32 activations and weights are cast to the
// region's bf16/fp16, and so are mixed bf16 x float32 pairs, which the op
// itself rejects), instead of falling back to exact float32.
//
// Both gradients are matmuls themselves, of transposed views: the kernels
// accept any strides, so no copies are made, and because the backward calls
// torchops::matmul through the dispatcher it is differentiable again (double
// backward) and traceable by torch.compile.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::matmul");
  return op.call(a, b);
}

}  // namespace ops

class Matmul : public torch::autograd::Function<Matmul> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::matmul(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& grad = grads[0];
    at::Tensor grad_a, grad_b;
    if (ctx->needs_input_grad(0)) {
      grad_a = ops::matmul(grad, b.transpose(-2, -1));
    }
    if (ctx->needs_input_grad(1)) {
      grad_b = ops::matmul(a.transpose(-2, -1), grad);
    }
    return {grad_a, grad_b};
  }
};

at::Tensor matmul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return Matmul::apply(a, b);
}

template <c10::DeviceType D>
at::Tensor matmul_autocast(const at::Tensor& a, const at::Tensor& b) {
  const AutocastLowerPrecision<D> guard;
  return ops::matmul(guard.down(a), guard.down(b));
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("matmul", &torchops::dispatch::matmul_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("matmul", torchops::dispatch::matmul_autocast)
