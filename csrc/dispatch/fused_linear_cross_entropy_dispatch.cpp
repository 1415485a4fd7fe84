// Dispatcher glue of fused_linear_cross_entropy: its Autograd and Autocast
// kernels.
//
// Autograd.  For a scalar loss ("mean", "sum") the forward computes the
// gradients in the same pass as the loss (_forward with output_mask), as
// the loss is almost always the end of the graph: the backward then only
// multiplies them by the upstream gradient, in place, and hands them over,
// so a training step runs three GEMMs over the vocabulary instead of four
// and holds no second copy of grad_weight.  The gradients are taken out of
// the graph by the first backward; a second one (retain_graph=True)
// recomputes them with _backward from the saved lse, as does the backward
// of reduction "none", whose per-token upstream gradients are not known in
// the forward.
//
// Autocast follows F.linear's policy (the op is a linear layer with a loss
// on top): input, weight and bias are cast to the autocast dtype; the loss
// is float32 either way.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch::lce {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

namespace ops {

at::Tensor loss(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                const OptTensor& bias, int64_t ignore_index, double smoothing,
                c10::string_view reduction, double z_scale, std::optional<double> softcap) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
      double, c10::string_view, double, std::optional<double>)>(
      "torchops::fused_linear_cross_entropy");
  return op.call(input, weight, target, bias, ignore_index, smoothing, reduction, z_scale,
                 softcap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const OptTensor& bias, int64_t ignore_index, double smoothing, c10::string_view reduction,
    double z_scale, std::optional<double> softcap, std::array<bool, 3> mask) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor,
                                                 at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
      double, c10::string_view, double, std::optional<double>, std::array<bool, 3>)>(
      "torchops::_fused_linear_cross_entropy_forward");
  return op.call(input, weight, target, bias, ignore_index, smoothing, reduction, z_scale,
                 softcap, mask);
}

Grads backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
               const at::Tensor& target, const OptTensor& bias, const at::Tensor& lse,
               int64_t ignore_index, double smoothing, c10::string_view reduction,
               double z_scale, std::optional<double> softcap, std::array<bool, 3> mask) {
  static const auto op = typed_handle<Grads(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const OptTensor&, const at::Tensor&, int64_t, double, c10::string_view, double,
      std::optional<double>, int64_t, int64_t, std::array<bool, 3>)>(
      "torchops::_fused_linear_cross_entropy_backward");
  return op.call(grad, input, weight, target, bias, lse, ignore_index, smoothing, reduction,
                 z_scale, softcap, 0, weight.size(0), mask);
}

void scale_(at::TensorList grads, const at::Tensor& scale) {
  static const auto op = typed_handle<void(at::TensorList, const at::Tensor&)>(
      "torchops::_fused_linear_cross_entropy_scale_");
  op.call(grads, scale);
}

}  // namespace ops

bool wants_grad(const at::Tensor& t) {
  return t.defined() && t.requires_grad();
}

class LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& target,
                            const OptTensor& bias, int64_t ignore_index, double smoothing,
                            c10::string_view reduction, double z_scale,
                            std::optional<double> softcap) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
    const bool scalar = reduction != "none";
    // In the forward only for a scalar loss: see the file comment.
    const std::array<bool, 3> mask = {scalar && wants_grad(input), scalar && wants_grad(weight),
                                      scalar && wants_grad(b)};
    auto [loss, lse, gi, gw, gb] = ops::forward(input, weight, target, bias, ignore_index,
                                                smoothing, reduction, z_scale, softcap, mask);
    ctx->save_for_backward({input, weight, target, b, lse});
    if (scalar) {
      ctx->saved_data["grads"] = c10::List<at::Tensor>({gi, gw, gb});
    }
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["z_scale"] = z_scale;
    ctx->saved_data["softcap"] = softcap.has_value() ? c10::IValue(*softcap) : c10::IValue();
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& g = grad_outputs[0];
    const auto saved = ctx->get_saved_variables();
    // needs_input_grad counts the tensor arguments: input, weight, target, bias.
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      saved[3].defined() && ctx->needs_input_grad(3)};
    Grads out;
    auto kept = ctx->saved_data.find("grads");
    if (kept != ctx->saved_data.end()) {
      // Computed by the forward for an upstream gradient of 1: scaled in
      // place (on the device, skipped there when the upstream gradient is
      // 1) and handed over, the only reference, so autograd takes the
      // tensors as they are instead of copying them.
      auto list = kept->second.toTensorList();
      ctx->saved_data.erase(kept);
      at::Tensor gi = list.get(0), gw = list.get(1), gb = list.get(2);
      list = c10::List<at::Tensor>();
      ops::scale_({gi, gw, gb}, g.to(gi.scalar_type() == at::kDouble ? at::kDouble
                                                                        : at::kFloat));
      out = {std::move(gi), std::move(gw), std::move(gb)};
    } else {
      const c10::IValue& cap = ctx->saved_data["softcap"];
      out = ops::backward(g, saved[0], saved[1], saved[2],
                          saved[3].defined() ? OptTensor(saved[3]) : std::nullopt, saved[4],
                          ctx->saved_data["ignore_index"].toInt(),
                          ctx->saved_data["smoothing"].toDouble(),
                          ctx->saved_data["reduction"].toStringRef(),
                          ctx->saved_data["z_scale"].toDouble(),
                          cap.isNone() ? std::nullopt : std::optional<double>(cap.toDouble()),
                          mask);
    }
    auto& [gi, gw, gb] = out;
    return {mask[0] ? gi : at::Tensor(), mask[1] ? gw : at::Tensor(), at::Tensor(),
            mask[2] ? gb : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor autograd_kernel(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& target, const OptTensor& bias,
                           int64_t ignore_index, double smoothing, c10::string_view reduction,
                           double z_scale, std::optional<double> softcap) {
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  if (!at::GradMode::is_enabled() ||
      !(wants_grad(input) || wants_grad(weight) || wants_grad(b))) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::loss(input, weight, target, bias, ignore_index, smoothing, reduction, z_scale,
                     softcap);
  }
  return LinearCrossEntropy::apply(input, weight, target, bias, ignore_index, smoothing,
                                   reduction, z_scale, softcap);
}

template <c10::DeviceType D>
at::Tensor autocast_kernel(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& target, const OptTensor& bias,
                           int64_t ignore_index, double smoothing, c10::string_view reduction,
                           double z_scale, std::optional<double> softcap) {
  const AutocastLowerPrecision<D> guard;
  const OptTensor b = bias.has_value() ? OptTensor(guard.down(*bias)) : std::nullopt;
  return ops::loss(guard.down(input), guard.down(weight), target, b, ignore_index, smoothing,
                   reduction, z_scale, softcap);
}

}  // namespace
}  // namespace torchops::dispatch::lce

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("fused_linear_cross_entropy", &torchops::dispatch::lce::autograd_kernel);
}

TORCHOPS_REGISTER_AUTOCAST("fused_linear_cross_entropy",
                           torchops::dispatch::lce::autocast_kernel)
