// Dispatcher glue of the norm ops: Autograd kernels for rms_norm,
// fused_add_rms_norm and layer_norm, and their autocast kernels.
//
// The Autograd kernels call the _forward operators, which also return the row
// statistics, so the backward operators never recompute them; an op whose
// inputs need no gradient runs the plain forward.  fused_add_rms_norm_ (in
// place, inference only) has neither.
//
// Autocast: PyTorch puts layer_norm on its float32 list; these kernels already
// compute in float32 for half inputs, so under autocast only the weights (and
// fused_add_rms_norm's residual) are cast, to what the input can take: the
// result keeps the input's dtype, as ATen's CPU autocast of F.layer_norm and
// F.rms_norm does.
#include <ATen/ops/add.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

namespace ops {

at::Tensor rms_norm(const at::Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                    std::optional<double> eps) {
  static const auto op = typed_handle<at::Tensor(const at::Tensor&, c10::SymIntArrayRef,
                                                 const OptTensor&, std::optional<double>)>(
      "torchops::rms_norm");
  return op.call(input, shape, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input,
                                                    c10::SymIntArrayRef shape,
                                                    const OptTensor& weight,
                                                    std::optional<double> eps) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, std::optional<double>)>(
      "torchops::_rms_norm_forward");
  return op.call(input, shape, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad,
                                                     const at::Tensor& input,
                                                     const at::Tensor& rstd,
                                                     c10::SymIntArrayRef shape,
                                                     const OptTensor& weight,
                                                     std::array<bool, 2> mask) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
      const OptTensor&, std::array<bool, 2>)>("torchops::_rms_norm_backward");
  return op.call(grad, input, rstd, shape, weight, mask);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& input,
                                                      const at::Tensor& residual,
                                                      c10::SymIntArrayRef shape,
                                                      const OptTensor& weight,
                                                      std::optional<double> eps) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
      std::optional<double>)>("torchops::fused_add_rms_norm");
  return op.call(input, residual, shape, weight, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef shape,
    const OptTensor& weight, std::optional<double> eps) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
      std::optional<double>)>("torchops::_fused_add_rms_norm_forward");
  return op.call(input, residual, shape, weight, eps);
}

at::Tensor layer_norm(const at::Tensor& input, c10::SymIntArrayRef shape,
                      const OptTensor& weight, const OptTensor& bias, double eps) {
  static const auto op = typed_handle<at::Tensor(const at::Tensor&, c10::SymIntArrayRef,
                                                 const OptTensor&, const OptTensor&, double)>(
      "torchops::layer_norm");
  return op.call(input, shape, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
    const OptTensor& bias, double eps) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&, double)>(
      "torchops::_layer_norm_forward");
  return op.call(input, shape, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, c10::SymIntArrayRef shape, const OptTensor& weight,
    const OptTensor& bias, std::array<bool, 3> mask) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      c10::SymIntArrayRef, const OptTensor&, const OptTensor&, std::array<bool, 3>)>(
      "torchops::_layer_norm_backward");
  return op.call(grad, input, mean, rstd, shape, weight, bias, mask);
}

}  // namespace ops

bool defined(const OptTensor& t) {
  return t.has_value() && t->defined();
}

OptTensor optional_of(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

// Whether autograd will want a gradient of any of these.
bool any_requires_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) {
    return false;
  }
  for (const at::Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) {
      return true;
    }
  }
  return false;
}

// normalized_shape, read back from the saved input: its trailing `nd` dims.
c10::SymIntArrayRef trailing(const at::Tensor& input, int64_t nd) {
  const auto sizes = input.sym_sizes();
  return sizes.slice(sizes.size() - nd);
}

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            c10::SymIntArrayRef shape, const OptTensor& weight,
                            std::optional<double> eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = ops::rms_norm_forward(input, shape, weight, eps);
    ctx->save_for_backward({input, rstd, defined(weight) ? *weight : at::Tensor()});
    ctx->saved_data["nd"] = static_cast<int64_t>(shape.size());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    // needs_input_grad counts the tensor arguments present: input, weight.
    const std::array<bool, 2> mask = {ctx->needs_input_grad(0),
                                      saved[2].defined() && ctx->needs_input_grad(1)};
    auto [dx, dw] = ops::rms_norm_backward(grads[0], input, saved[1],
                                           trailing(input, ctx->saved_data["nd"].toInt()),
                                           optional_of(saved[2]), mask);
    return {mask[0] ? dx : at::Tensor(), at::Tensor(), mask[1] ? dw : at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef shape,
                             const OptTensor& weight, std::optional<double> eps) {
  const at::Tensor w = defined(weight) ? *weight : at::Tensor();
  if (!any_requires_grad({&input, &w})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::rms_norm(input, shape, weight, eps);
  }
  return RmsNorm::apply(input, shape, weight, eps);
}

// The gradient of the sum flows to input and residual alike: the norm's
// input gradient plus the sum output's own.
class FusedAddRmsNorm : public torch::autograd::Function<FusedAddRmsNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& residual, c10::SymIntArrayRef shape,
                               const OptTensor& weight, std::optional<double> eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, sum, rstd] = ops::fused_add_rms_norm_forward(input, residual, shape, weight, eps);
    ctx->save_for_backward({sum, rstd, defined(weight) ? *weight : at::Tensor()});
    ctx->saved_data["nd"] = static_cast<int64_t>(shape.size());
    return {y, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& sum = saved[0];
    const bool want_sum = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    // needs_input_grad counts the tensor arguments present: input,
    // residual, weight.
    const std::array<bool, 2> mask = {want_sum,
                                      saved[2].defined() && ctx->needs_input_grad(2)};
    auto [dsum, dw] = ops::rms_norm_backward(grads[0], sum, saved[1],
                                             trailing(sum, ctx->saved_data["nd"].toInt()),
                                             optional_of(saved[2]), mask);
    at::Tensor d = want_sum ? at::add(dsum, grads[1]) : at::Tensor();
    return {ctx->needs_input_grad(0) ? d : at::Tensor(),
            ctx->needs_input_grad(1) ? d : at::Tensor(), at::Tensor(),
            mask[1] ? dw : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_autograd(const at::Tensor& input,
                                                               const at::Tensor& residual,
                                                               c10::SymIntArrayRef shape,
                                                               const OptTensor& weight,
                                                               std::optional<double> eps) {
  const at::Tensor w = defined(weight) ? *weight : at::Tensor();
  if (!any_requires_grad({&input, &residual, &w})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::fused_add_rms_norm(input, residual, shape, weight, eps);
  }
  auto out = FusedAddRmsNorm::apply(input, residual, shape, weight, eps);
  return {out[0], out[1]};
}

class LayerNorm : public torch::autograd::Function<LayerNorm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            c10::SymIntArrayRef shape, const OptTensor& weight,
                            const OptTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, rstd] = ops::layer_norm_forward(input, shape, weight, bias, eps);
    ctx->save_for_backward({input, mean, rstd, defined(weight) ? *weight : at::Tensor(),
                            defined(bias) ? *bias : at::Tensor()});
    ctx->saved_data["nd"] = static_cast<int64_t>(shape.size());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    // needs_input_grad counts the tensor arguments present: input, then
    // weight and bias where given.
    const bool has_w = saved[3].defined();
    const std::array<bool, 3> mask = {
        ctx->needs_input_grad(0), has_w && ctx->needs_input_grad(1),
        saved[4].defined() && ctx->needs_input_grad(has_w ? 2 : 1)};
    auto [dx, dw, db] = ops::layer_norm_backward(
        grads[0], input, saved[1], saved[2], trailing(input, ctx->saved_data["nd"].toInt()),
        optional_of(saved[3]), optional_of(saved[4]), mask);
    return {mask[0] ? dx : at::Tensor(), at::Tensor(), mask[1] ? dw : at::Tensor(),
            mask[2] ? db : at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef shape,
                               const OptTensor& weight, const OptTensor& bias, double eps) {
  const at::Tensor w = defined(weight) ? *weight : at::Tensor();
  const at::Tensor b = defined(bias) ? *bias : at::Tensor();
  if (!any_requires_grad({&input, &w, &b})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::layer_norm(input, shape, weight, bias, eps);
  }
  return LayerNorm::apply(input, shape, weight, bias, eps);
}

// A weight or bias under autocast: as it is when it has the input's dtype,
// else float32 (which every input dtype but float64 takes).
template <c10::DeviceType D>
OptTensor autocast_param(const AutocastFloat32<D>& guard, const at::Tensor& input,
                         const OptTensor& p) {
  if (!defined(p) || p->scalar_type() == input.scalar_type()) {
    return p;
  }
  return guard.up(*p);
}

template <c10::DeviceType D>
at::Tensor rms_norm_autocast(const at::Tensor& input, c10::SymIntArrayRef shape,
                             const OptTensor& weight, std::optional<double> eps) {
  const AutocastFloat32<D> guard;
  return ops::rms_norm(input, shape, autocast_param(guard, input, weight), eps);
}

template <c10::DeviceType D>
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_autocast(const at::Tensor& input,
                                                               const at::Tensor& residual,
                                                               c10::SymIntArrayRef shape,
                                                               const OptTensor& weight,
                                                               std::optional<double> eps) {
  const AutocastFloat32<D> guard;
  // The sum is returned in the input's dtype: the residual joins it there.
  const at::Tensor r = residual.is_floating_point() ? residual.to(input.scalar_type())
                                                    : residual;
  return ops::fused_add_rms_norm(input, r, shape, autocast_param(guard, input, weight), eps);
}

template <c10::DeviceType D>
at::Tensor layer_norm_autocast(const at::Tensor& input, c10::SymIntArrayRef shape,
                               const OptTensor& weight, const OptTensor& bias, double eps) {
  const AutocastFloat32<D> guard;
  return ops::layer_norm(input, shape, autocast_param(guard, input, weight),
                         autocast_param(guard, input, bias), eps);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("rms_norm", &torchops::dispatch::rms_norm_autograd);
  m.impl("fused_add_rms_norm", &torchops::dispatch::fused_add_rms_norm_autograd);
  m.impl("layer_norm", &torchops::dispatch::layer_norm_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("rms_norm", torchops::dispatch::rms_norm_autocast)
TORCHOPS_REGISTER_AUTOCAST("fused_add_rms_norm", torchops::dispatch::fused_add_rms_norm_autocast)
TORCHOPS_REGISTER_AUTOCAST("layer_norm", torchops::dispatch::layer_norm_autocast)
