// Dispatcher glue of torchops.silu_and_mul and torchops.gelu_and_mul:
// registers their Autograd kernels.  Each backward is one registered
// operator (torchops::_silu_and_mul_backward, _gelu_and_mul_backward) that
// writes both halves of x's gradient in one pass, called through the
// dispatcher, so compiled training steps stay in one graph.  No autocast
// kernels: F.silu and F.gelu have no autocast policy either, so the ops run
// in their input's dtype inside an autocast region.
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor silu_and_mul(const at::Tensor& x) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&)>("torchops::silu_and_mul");
  return op.call(x);
}

at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::_silu_and_mul_backward");
  return op.call(grad, x);
}

at::Tensor gelu_and_mul(const at::Tensor& x, c10::string_view approximate) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, c10::string_view)>(
          "torchops::gelu_and_mul");
  return op.call(x, approximate);
}

at::Tensor gelu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x,
                                 c10::string_view approximate) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, c10::string_view)>(
      "torchops::_gelu_and_mul_backward");
  return op.call(grad, x, approximate);
}

}  // namespace ops

class SiluAndMul : public torch::autograd::Function<SiluAndMul> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::silu_and_mul(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    return {ops::silu_and_mul_backward(grads[0], x)};
  }
};

class GeluAndMul : public torch::autograd::Function<GeluAndMul> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            c10::string_view approximate) {
    ctx->save_for_backward({x});
    ctx->saved_data["approximate"] = std::string(approximate);
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::gelu_and_mul(x, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    return {ops::gelu_and_mul_backward(
                grads[0], x, ctx->saved_data["approximate"].toStringRef()),
            at::Tensor()};
  }
};

at::Tensor silu_and_mul_autograd(const at::Tensor& x) {
  return SiluAndMul::apply(x);
}

at::Tensor gelu_and_mul_autograd(const at::Tensor& x,
                                 c10::string_view approximate) {
  return GeluAndMul::apply(x, approximate);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("silu_and_mul", &torchops::dispatch::silu_and_mul_autograd);
  m.impl("gelu_and_mul", &torchops::dispatch::gelu_and_mul_autograd);
}
