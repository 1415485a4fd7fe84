// Dispatcher glue of torchops.masked_conv2d: its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// Gradients flow to input, weight and bias (the mask selects positions; it
// has none).  The backward is the registered operator
// torchops::_masked_conv2d_backward, told which gradients are wanted, so a
// frozen weight costs no GEMM.  Autocast treats the op as a convolution,
// the way ATen's autocast treats conv2d: floating arguments are cast to the
// autocast dtype (float16 or bfloat16) and the result has that dtype; the
// mask is used as it is.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor masked_conv2d(const at::Tensor& input, const at::Tensor& mask,
                         const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef padding, at::IntArrayRef stride,
                         at::IntArrayRef dilation, int64_t groups) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t)>("torchops::masked_conv2d");
  return op.call(input, mask, weight, bias, padding, stride, dilation, groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mask,
    const at::Tensor& weight, at::IntArrayRef padding, at::IntArrayRef stride,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, std::array<bool, 3>)>(
      "torchops::_masked_conv2d_backward");
  return op.call(grad, input, mask, weight, padding, stride, dilation, groups, output_mask);
}

}  // namespace ops

class MaskedConv2d : public torch::autograd::Function<MaskedConv2d> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& mask, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef padding,
                            at::IntArrayRef stride, at::IntArrayRef dilation, int64_t groups) {
    ctx->save_for_backward({input, mask, weight});
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::masked_conv2d(input, mask, weight, bias, padding, stride, dilation, groups);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    // The graph's inputs: input, mask, weight and, when given, bias (an
    // absent optional is no input at all).
    const std::array<bool, 3> wanted = {
        ctx->needs_input_grad(0), ctx->needs_input_grad(2),
        d.at("has_bias").toBool() && ctx->needs_input_grad(3)};
    auto [grad_input, grad_weight, grad_bias] = ops::masked_conv2d_backward(
        grads[0], saved[0], saved[1], saved[2], d.at("padding").toIntVector(),
        d.at("stride").toIntVector(), d.at("dilation").toIntVector(), d.at("groups").toInt(),
        wanted);
    return {wanted[0] ? grad_input : at::Tensor(), at::Tensor(),
            wanted[1] ? grad_weight : at::Tensor(), wanted[2] ? grad_bias : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor masked_conv2d_autograd(const at::Tensor& input, const at::Tensor& mask,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef padding,
                                  at::IntArrayRef stride, at::IntArrayRef dilation,
                                  int64_t groups) {
  return MaskedConv2d::apply(input, mask, weight, bias, padding, stride, dilation, groups);
}

template <c10::DeviceType D>
at::Tensor masked_conv2d_autocast(const at::Tensor& input, const at::Tensor& mask,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef padding,
                                  at::IntArrayRef stride, at::IntArrayRef dilation,
                                  int64_t groups) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(D));
  const at::ScalarType to = at::autocast::get_lower_precision_fp_from_device_type(D);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(to, t, D); };
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    b = cast(*bias);
  }
  return ops::masked_conv2d(cast(input), mask, cast(weight), b, padding, stride, dilation,
                            groups);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("masked_conv2d", &torchops::dispatch::masked_conv2d_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("masked_conv2d", torchops::dispatch::masked_conv2d_autocast)
