// The host steps of the norm ops, written once for both devices: checks,
// contiguous operands, outputs, empty cases and the dtype dispatch.  Each
// device supplies a `Kernels` type with its loops:
//
//   Kernels::device                                   c10::DeviceType
//   Kernels::guard(t)                                 kept alive for the call
//   Kernels::forward<kind, scalar_t, weight_t, acc_t>(NormForwardArgs)
//   Kernels::backward<kind, scalar_t, weight_t, acc_t>(NormBackwardArgs)
//
// (common/norms.h describes the arguments.)  weight_t is the weights' dtype:
// scalar_t, or float beside a half input.  TORCHOPS_REGISTER_NORMS(key,
// Kernels) registers every norm operator for a dispatch key.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common/norms.h"

namespace torchops {
namespace norms_detail {

inline bool present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined();
}

inline at::Tensor contiguous_or_empty(const std::optional<at::Tensor>& t) {
  return present(t) ? t->contiguous() : at::Tensor();
}

template <typename T>
struct Type {
  using type = T;
};

// Calls fn(Type<scalar_t>{}, Type<weight_t>{}) for the input's dtype and the
// weights' (float beside a half input with float32 weights).  The checks
// have already rejected every other dtype.
template <typename Fn>
void dispatch_norm_types(at::ScalarType input, at::ScalarType params, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input, "torchops.norms", [&] {
    if constexpr (std::is_same_v<scalar_t, at::Half> ||
                  std::is_same_v<scalar_t, at::BFloat16>) {
      if (params == at::kFloat) {
        fn(Type<scalar_t>{}, Type<float>{});
        return;
      }
    }
    fn(Type<scalar_t>{}, Type<scalar_t>{});
  });
}

// The weights' dtype: weight's, else bias's, else the input's.
inline at::ScalarType param_type(const at::Tensor& input, const at::Tensor& w,
                                 const at::Tensor& b) {
  return w.defined() ? w.scalar_type() : b.defined() ? b.scalar_type() : input.scalar_type();
}

// The outputs of one forward call.
struct ForwardOutputs {
  at::Tensor y, sum, mean, rstd;
};

template <typename Kernels, NormKind kind>
ForwardOutputs run_forward(const char* op, const at::Tensor& input_in,
                           const at::Tensor* residual_in, at::IntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight_in,
                           const std::optional<at::Tensor>& bias_in, double eps,
                           bool want_stats) {
  const NormShape s = check_norm_forward(op, Kernels::device, input_in, residual_in,
                                         normalized_shape, weight_in, bias_in);
  [[maybe_unused]] const auto guard = Kernels::guard(input_in);
  const at::Tensor x = input_in.contiguous();
  const at::Tensor r = residual_in != nullptr ? residual_in->contiguous() : at::Tensor();
  const at::Tensor w = contiguous_or_empty(weight_in);
  const at::Tensor b = contiguous_or_empty(bias_in);
  ForwardOutputs o;
  o.y = new_output(op, x.sizes(), x.options());
  if (residual_in != nullptr) {
    o.sum = new_output(op, x.sizes(), x.options());
  }
  const auto stat_options = x.options().dtype(norm_acc_type(x.scalar_type()));
  if (want_stats) {
    o.rstd = at::empty(s.stat_sizes, stat_options);
    if (kind == NormKind::kLayerNorm) {
      o.mean = at::empty(s.stat_sizes, stat_options);
    }
  }
  if (s.rows == 0) {
    return o;
  }
  dispatch_norm_types(x.scalar_type(), param_type(x, w, b), [&](auto s_type, auto w_type) {
    using scalar_t = typename decltype(s_type)::type;
    using weight_t = typename decltype(w_type)::type;
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    NormForwardArgs<scalar_t, weight_t, acc_t> a;
    a.x = x.const_data_ptr<scalar_t>();
    a.residual = r.defined() ? r.const_data_ptr<scalar_t>() : nullptr;
    a.weight = w.defined() ? w.const_data_ptr<weight_t>() : nullptr;
    a.bias = b.defined() ? b.const_data_ptr<weight_t>() : nullptr;
    a.y = o.y.mutable_data_ptr<scalar_t>();
    a.sum = o.sum.defined() ? o.sum.mutable_data_ptr<scalar_t>() : nullptr;
    a.mean = o.mean.defined() ? o.mean.mutable_data_ptr<acc_t>() : nullptr;
    a.rstd = o.rstd.defined() ? o.rstd.mutable_data_ptr<acc_t>() : nullptr;
    a.rows = s.rows;
    a.cols = s.cols;
    a.eps = static_cast<acc_t>(eps);
    Kernels::template forward<kind, scalar_t, weight_t, acc_t>(a);
  });
  return o;
}

// A gradient that output_mask does not ask for: a (0,)-shaped placeholder.
inline at::Tensor placeholder(const at::Tensor& like) {
  return at::empty({0}, like.options());
}

template <typename Kernels, NormKind kind>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const char* op, const at::Tensor& grad_in, const at::Tensor& input_in,
    const at::Tensor* mean_in, const at::Tensor& rstd_in, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight_in, const std::optional<at::Tensor>& bias_in,
    std::array<bool, 3> mask) {
  const NormShape s = check_norm_backward(op, Kernels::device, grad_in, input_in, mean_in,
                                          rstd_in, normalized_shape, weight_in, bias_in);
  [[maybe_unused]] const auto guard = Kernels::guard(input_in);
  const at::Tensor x = input_in.contiguous();
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor mean = mean_in != nullptr ? mean_in->contiguous() : at::Tensor();
  const at::Tensor w = contiguous_or_empty(weight_in);
  const at::Tensor b = contiguous_or_empty(bias_in);
  const bool want_dw = mask[1] && w.defined();
  const bool want_db = mask[2] && b.defined();
  const auto acc_options = x.options().dtype(norm_acc_type(x.scalar_type()));
  at::Tensor dx = mask[0] ? new_output(op, x.sizes(), x.options()) : placeholder(x);
  // Parameter gradients are summed in the accumulation type, then take the
  // parameter's dtype.
  at::Tensor dw = want_dw ? at::empty(w.sizes(), acc_options) : at::Tensor();
  at::Tensor db = want_db ? at::empty(b.sizes(), acc_options) : at::Tensor();
  if (s.rows == 0 || s.cols == 0) {
    if (dw.defined()) dw.zero_();
    if (db.defined()) db.zero_();
  } else if (mask[0] || want_dw || want_db) {
    dispatch_norm_types(x.scalar_type(), param_type(x, w, b), [&](auto s_type, auto w_type) {
      using scalar_t = typename decltype(s_type)::type;
      using weight_t = typename decltype(w_type)::type;
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      NormBackwardArgs<scalar_t, weight_t, acc_t> a;
      a.grad = g.const_data_ptr<scalar_t>();
      a.x = x.const_data_ptr<scalar_t>();
      a.mean = mean.defined() ? mean.const_data_ptr<acc_t>() : nullptr;
      a.rstd = rstd.const_data_ptr<acc_t>();
      a.weight = w.defined() ? w.const_data_ptr<weight_t>() : nullptr;
      a.dx = mask[0] ? dx.mutable_data_ptr<scalar_t>() : nullptr;
      a.dweight = want_dw ? dw.mutable_data_ptr<acc_t>() : nullptr;
      a.dbias = want_db ? db.mutable_data_ptr<acc_t>() : nullptr;
      a.rows = s.rows;
      a.cols = s.cols;
      Kernels::template backward<kind, scalar_t, weight_t, acc_t>(a);
    });
  }
  at::Tensor dw_out = want_dw ? dw.to(w.scalar_type())
                              : placeholder(w.defined() ? w : x);
  at::Tensor db_out = want_db ? db.to(b.scalar_type())
                              : placeholder(b.defined() ? b : x);
  return {dx, dw_out, db_out};
}

}  // namespace norms_detail

// --- the operators ------------------------------------------------------------------------

template <typename Kernels>
at::Tensor rms_norm_forward(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight,
                            std::optional<double> eps) {
  return norms_detail::run_forward<Kernels, NormKind::kRms>(
             "rms_norm", input, nullptr, normalized_shape, weight, std::nullopt,
             resolve_rms_eps(eps, input.scalar_type()), false)
      .y;
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_stats(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  auto o = norms_detail::run_forward<Kernels, NormKind::kRms>(
      "_rms_norm_forward", input, nullptr, normalized_shape, weight, std::nullopt,
      resolve_rms_eps(eps, input.scalar_type()), true);
  return {o.y, o.rstd};
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& rstd,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    std::array<bool, 2> mask) {
  auto [dx, dw, db] = norms_detail::run_backward<Kernels, NormKind::kRms>(
      "_rms_norm_backward", grad, input, nullptr, rstd, normalized_shape, weight,
      std::nullopt, {mask[0], mask[1], false});
  return {dx, dw};
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_forward(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  auto o = norms_detail::run_forward<Kernels, NormKind::kRms>(
      "fused_add_rms_norm", input, &residual, normalized_shape, weight, std::nullopt,
      resolve_rms_eps(eps, input.scalar_type()), false);
  return {o.y, o.sum};
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_stats(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  auto o = norms_detail::run_forward<Kernels, NormKind::kRms>(
      "_fused_add_rms_norm_forward", input, &residual, normalized_shape, weight,
      std::nullopt, resolve_rms_eps(eps, input.scalar_type()), true);
  return {o.y, o.sum, o.rstd};
}

// vLLM's in-place variant: the norm over the last dim into `input`, the sum
// into `residual`.  The loops write fresh outputs that copy_ moves into
// place, so inputs of any layout work; an inference-only op, so the extra
// pass is accepted for the simplicity.
template <typename Kernels>
void fused_add_rms_norm_inplace(at::Tensor& input, at::Tensor& residual,
                                const at::Tensor& weight, double eps) {
  constexpr const char* op = "fused_add_rms_norm_";
  check_devices(op, Kernels::device,
                {{input, "input"}, {residual, "residual"}, {weight, "weight"}});
  TORCH_CHECK(input.dim() >= 1, "torchops.", op,
              ": expected 'input' to have at least one dimension");
  for (const auto* t : {&input, &residual}) {
    TORCH_CHECK(at::has_internal_overlap(*t) != at::MemOverlap::Yes, "torchops.", op,
                ": expected '", t == &input ? "input" : "residual",
                "' to be writable element by element, but it has overlapping memory "
                "(an expanded tensor?)");
  }
  // Strided views of one storage whose overlap is too hard to decide are
  // refused too.
  TORCH_CHECK(!input.storage().is_alias_of(residual.storage()) ||
                  at::get_overlap_status(input, residual) == at::MemOverlapStatus::No,
              "torchops.", op, ": expected 'input' and 'residual' not to share memory");
  const int64_t d = input.size(-1);
  auto o = norms_detail::run_forward<Kernels, NormKind::kRms>(
      op, input, &residual, at::IntArrayRef(&d, 1), weight, std::nullopt, eps, false);
  input.copy_(o.y);
  residual.copy_(o.sum);
}

template <typename Kernels>
at::Tensor layer_norm_forward(const at::Tensor& input, at::IntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps) {
  return norms_detail::run_forward<Kernels, NormKind::kLayerNorm>(
             "layer_norm", input, nullptr, normalized_shape, weight, bias, eps, false)
      .y;
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_stats(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps) {
  auto o = norms_detail::run_forward<Kernels, NormKind::kLayerNorm>(
      "_layer_norm_forward", input, nullptr, normalized_shape, weight, bias, eps, true);
  return {o.y, o.mean, o.rstd};
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> mask) {
  return norms_detail::run_backward<Kernels, NormKind::kLayerNorm>(
      "_layer_norm_backward", grad, input, &mean, rstd, normalized_shape, weight, bias,
      mask);
}

}  // namespace torchops

#define TORCHOPS_REGISTER_NORMS(key, Kernels)                                        \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                                             \
    m.impl("rms_norm", &::torchops::rms_norm_forward<Kernels>);                      \
    m.impl("_rms_norm_forward", &::torchops::rms_norm_forward_stats<Kernels>);       \
    m.impl("_rms_norm_backward", &::torchops::rms_norm_backward<Kernels>);           \
    m.impl("fused_add_rms_norm", &::torchops::fused_add_rms_norm_forward<Kernels>);  \
    m.impl("_fused_add_rms_norm_forward",                                            \
           &::torchops::fused_add_rms_norm_forward_stats<Kernels>);                  \
    m.impl("fused_add_rms_norm_", &::torchops::fused_add_rms_norm_inplace<Kernels>); \
    m.impl("layer_norm", &::torchops::layer_norm_forward<Kernels>);                  \
    m.impl("_layer_norm_forward", &::torchops::layer_norm_forward_stats<Kernels>);   \
    m.impl("_layer_norm_backward", &::torchops::layer_norm_backward<Kernels>);       \
  }
