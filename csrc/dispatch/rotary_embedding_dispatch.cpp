// Dispatcher glue of torchops.rotary_embedding: registers its Autograd
// kernel.  The backward is the registered operator
// torchops::_rotary_embedding_backward, called through the dispatcher, so
// compiled training steps trace straight through it.  The in-place
// rotary_embedding_ is an inference op: it has no Autograd kernel.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

std::tuple<at::Tensor, at::Tensor> rotary_embedding(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, int64_t, bool)>("torchops::rotary_embedding");
  return op.call(q, k, cos, sin, unsqueeze_dim, interleaved);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
rotary_embedding_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                          const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& cos, const at::Tensor& sin,
                          int64_t unsqueeze_dim, bool interleaved,
                          bool cos_sin_grad) {
  static const auto op = typed_handle<
      std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
          bool, bool)>("torchops::_rotary_embedding_backward");
  return op.call(grad_q, grad_k, q, k, cos, sin, unsqueeze_dim, interleaved,
                 cos_sin_grad);
}

}  // namespace ops

class RotaryEmbedding : public torch::autograd::Function<RotaryEmbedding> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t unsqueeze_dim,
                               bool interleaved) {
    // q and k are saved only when cos or sin needs its gradient: the
    // gradients of q and k need cos and sin alone.
    const bool cos_sin_grad = cos.requires_grad() || sin.requires_grad();
    ctx->saved_data["unsqueeze_dim"] = unsqueeze_dim;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["cos_sin_grad"] = cos_sin_grad;
    if (cos_sin_grad) {
      ctx->save_for_backward({cos, sin, q, k});
    } else {
      ctx->save_for_backward({cos, sin});
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [q_out, k_out] =
        ops::rotary_embedding(q, k, cos, sin, unsqueeze_dim, interleaved);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool cos_sin_grad = ctx->saved_data["cos_sin_grad"].toBool();
    const at::Tensor& cos = saved[0];
    const at::Tensor& sin = saved[1];
    // Without cos's gradient q and k are not read: the output gradients,
    // of their shapes, stand in for them.
    const at::Tensor q = cos_sin_grad ? saved[2] : grads[0];
    const at::Tensor k = cos_sin_grad ? saved[3] : grads[1];
    auto [dq, dk, dcos, dsin] = ops::rotary_embedding_backward(
        grads[0], grads[1], q, k, cos, sin,
        ctx->saved_data["unsqueeze_dim"].toInt(),
        ctx->saved_data["interleaved"].toBool(), cos_sin_grad);
    return {ctx->needs_input_grad(0) ? dq : at::Tensor(),
            ctx->needs_input_grad(1) ? dk : at::Tensor(),
            cos_sin_grad && ctx->needs_input_grad(2) ? dcos : at::Tensor(),
            cos_sin_grad && ctx->needs_input_grad(3) ? dsin : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rotary_embedding_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  auto outs = RotaryEmbedding::apply(q, k, cos, sin, unsqueeze_dim, interleaved);
  return {outs[0], outs[1]};
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("rotary_embedding", &torchops::dispatch::rotary_embedding_autograd);
}
