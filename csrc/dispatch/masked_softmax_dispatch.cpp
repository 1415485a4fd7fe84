// Dispatcher glue of torchops.scaled_masked_softmax and
// torchops.scaled_upper_triang_masked_softmax: their Autograd kernels.
//
// Only 'input' is differentiable (the mask is bool, the scale a number).  The
// forward saves its output, which is all the backward needs:
// dx = scale * y * (dy - sum(dy * y)), through the registered backward ops,
// called through the dispatcher so compiled training steps stay in one graph.
//
// No autocast kernels: under torch.autocast the ops take the caller's dtype
// and return it.  They already compute in float32 for float16 and bfloat16,
// which is what autocast's float32 policy for torch.softmax (CUDA) buys,
// without its float32 output of twice the bytes.
#include <torch/autograd.h>
#include <torch/library.h>

#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor scaled_masked_softmax(const at::Tensor& input, const at::Tensor& mask,
                                 double scale) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
          "torchops::scaled_masked_softmax");
  return op.call(input, mask, scale);
}

at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad, const at::Tensor& output,
                                          double scale) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
          "torchops::_scaled_masked_softmax_backward");
  return op.call(grad, output, scale);
}

at::Tensor scaled_upper_triang_masked_softmax(const at::Tensor& input, double scale) {
  static const auto op = typed_handle<at::Tensor(const at::Tensor&, double)>(
      "torchops::scaled_upper_triang_masked_softmax");
  return op.call(input, scale);
}

at::Tensor scaled_upper_triang_masked_softmax_backward(const at::Tensor& grad,
                                                       const at::Tensor& output,
                                                       double scale) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
          "torchops::_scaled_upper_triang_masked_softmax_backward");
  return op.call(grad, output, scale);
}

}  // namespace ops

class ScaledMaskedSoftmax : public torch::autograd::Function<ScaledMaskedSoftmax> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& mask, double scale) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = ops::scaled_masked_softmax(input, mask, scale);
    }
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({out});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor out = ctx->get_saved_variables()[0];
    return {ops::scaled_masked_softmax_backward(grads[0], out,
                                                ctx->saved_data["scale"].toDouble()),
            at::Tensor(), at::Tensor()};
  }
};

class ScaledUpperTriangMaskedSoftmax
    : public torch::autograd::Function<ScaledUpperTriangMaskedSoftmax> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, double scale) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = ops::scaled_upper_triang_masked_softmax(input, scale);
    }
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({out});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor out = ctx->get_saved_variables()[0];
    return {ops::scaled_upper_triang_masked_softmax_backward(
                grads[0], out, ctx->saved_data["scale"].toDouble()),
            at::Tensor()};
  }
};

at::Tensor scaled_masked_softmax_autograd(const at::Tensor& input, const at::Tensor& mask,
                                          double scale) {
  return ScaledMaskedSoftmax::apply(input, mask, scale);
}

at::Tensor scaled_upper_triang_masked_softmax_autograd(const at::Tensor& input,
                                                       double scale) {
  return ScaledUpperTriangMaskedSoftmax::apply(input, scale);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("scaled_masked_softmax", &torchops::dispatch::scaled_masked_softmax_autograd);
  m.impl("scaled_upper_triang_masked_softmax",
         &torchops::dispatch::scaled_upper_triang_masked_softmax_autograd);
}
