// Shared argument checks and the kernel-facing descriptions of the norm ops
// (torchops.rms_norm, fused_add_rms_norm, fused_add_rms_norm_, layer_norm and
// their _forward/_backward operators).
//
// Every op normalises each "row": the input viewed as (rows, D) with D the
// product of normalized_shape (its trailing dims).  Statistics (mean, rstd)
// are kept in the accumulation type, float32 for float32/half inputs and
// float64 for float64, with the input's leading (row) dims as their shape.
// weight and bias have normalized_shape; they share the input's dtype, or
// are float32 beside a float16/bfloat16 input (mixed precision: the weights
// of a model kept in float32 while activations are half).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <optional>
#include <vector>

#include "common/checks.h"

namespace torchops {

// The row layout of a norm op's input: rows x D.
struct NormShape {
  int64_t rows = 0;
  int64_t cols = 0;                  // D, the normalised size
  std::vector<int64_t> stat_sizes;   // the input's leading (row) dims
};

inline NormShape check_normalized_shape(const char* op, const at::Tensor& input,
                                        at::IntArrayRef normalized_shape) {
  const int64_t nd = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(nd >= 1, "torchops.", op,
              ": expected 'normalized_shape' to have at least one dimension");
  const int64_t axis = input.dim() - nd;
  bool match = axis >= 0;
  for (int64_t i = 0; match && i < nd; ++i) {
    match = input.size(axis + i) == normalized_shape[i];
  }
  TORCH_CHECK(match, "torchops.", op, ": expected the trailing dims of 'input' (shape ",
              input.sizes(), ") to equal 'normalized_shape' ", normalized_shape);
  NormShape s;
  s.rows = 1;
  s.cols = 1;
  for (const auto i : c10::irange(axis)) {
    s.stat_sizes.push_back(input.size(i));
    s.rows *= input.size(i);
  }
  for (const int64_t d : normalized_shape) {
    s.cols *= d;
  }
  return s;
}

// weight or bias (named `name`): normalized_shape, on the input's device, of
// the input's dtype or float32 beside a half input.
inline void check_norm_param(const char* op, const at::Tensor& input,
                             const std::optional<at::Tensor>& param, const char* name,
                             at::IntArrayRef normalized_shape) {
  if (!param.has_value() || !param->defined()) {
    return;
  }
  const at::Tensor& p = *param;
  check_same_device(op, {input, "input"}, {p, name});
  check_floating(op, {p, name});
  const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  TORCH_CHECK(p.scalar_type() == input.scalar_type() ||
                  (half && p.scalar_type() == at::kFloat),
              "torchops.", op, ": expected '", name, "' to have the dtype of 'input' (",
              input.scalar_type(), ")", half ? " or float32" : "", ", but got ",
              p.scalar_type());
  TORCH_CHECK(p.sizes() == normalized_shape, "torchops.", op, ": expected '", name,
              "' to have shape 'normalized_shape' ", normalized_shape, ", but got ",
              p.sizes());
}

// The forward ops' checks: input floating, normalized_shape its trailing
// dims, weight/bias as check_norm_param says, residual like input.
inline NormShape check_norm_forward(const char* op, c10::DeviceType device,
                                    const at::Tensor& input,
                                    const at::Tensor* residual,
                                    at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias) {
  check_device_type(op, {input, "input"}, device);
  if (residual != nullptr) {
    check_devices(op, device, {{input, "input"}, {*residual, "residual"}});
  }
  for (const auto* p : {&weight, &bias}) {
    if (p->has_value() && (*p)->defined()) {
      check_devices(op, device, {{input, "input"}, {**p, p == &weight ? "weight" : "bias"}});
    }
  }
  check_floating(op, {input, "input"});
  if (residual != nullptr) {
    check_same_dtype(op, {input, "input"}, {*residual, "residual"});
    TORCH_CHECK(residual->sizes() == input.sizes(), "torchops.", op,
                ": expected 'residual' to have the shape of 'input' (", input.sizes(),
                "), but got ", residual->sizes());
  }
  NormShape s = check_normalized_shape(op, input, normalized_shape);
  check_norm_param(op, input, weight, "weight", normalized_shape);
  check_norm_param(op, input, bias, "bias", normalized_shape);
  if (weight.has_value() && weight->defined() && bias.has_value() && bias->defined()) {
    check_same_dtype(op, {*weight, "weight"}, {*bias, "bias"});
  }
  return s;
}

// The accumulation (statistics) dtype of an input dtype.
inline at::ScalarType norm_acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// eps=None means the input dtype's machine epsilon, as torch.nn.functional.rms_norm.
inline double resolve_rms_eps(std::optional<double> eps, at::ScalarType t) {
  if (eps.has_value()) {
    return *eps;
  }
  switch (t) {
    case at::kDouble: return std::numeric_limits<double>::epsilon();
    case at::kHalf: return 0.0009765625;          // 2^-10
    case at::kBFloat16: return 0.0078125;         // 2^-7
    default: return std::numeric_limits<float>::epsilon();
  }
}

// A saved statistic (mean or rstd) handed to a backward op: the row dims and
// the accumulation dtype.
inline void check_norm_stat(const char* op, const at::Tensor& input, const at::Tensor& stat,
                            const char* name, const NormShape& s) {
  check_same_device(op, {input, "input"}, {stat, name});
  TORCH_CHECK(stat.scalar_type() == norm_acc_type(input.scalar_type()), "torchops.", op,
              ": expected '", name, "' to be ", norm_acc_type(input.scalar_type()),
              " (the statistics dtype of a ", input.scalar_type(), " input), but got ",
              stat.scalar_type());
  TORCH_CHECK(stat.sizes() == at::IntArrayRef(s.stat_sizes), "torchops.", op, ": expected '",
              name, "' to have the row dims of 'input' ", at::IntArrayRef(s.stat_sizes),
              ", but got ", stat.sizes());
}

// The backward ops' checks: grad like input, the saved statistics, weight
// (and bias, whose dtype the bias gradient takes) as in the forward.
inline NormShape check_norm_backward(const char* op, c10::DeviceType device,
                                     const at::Tensor& grad, const at::Tensor& input,
                                     const at::Tensor* mean, const at::Tensor& rstd,
                                     at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias) {
  check_devices(op, device, {{input, "input"}, {grad, "grad"}});
  NormShape s = check_norm_forward(op, device, input, nullptr, normalized_shape, weight, bias);
  check_same_dtype(op, {input, "input"}, {grad, "grad"});
  TORCH_CHECK(grad.sizes() == input.sizes(), "torchops.", op,
              ": expected 'grad' to have the shape of 'input' (", input.sizes(), "), but got ",
              grad.sizes());
  if (mean != nullptr) {
    check_norm_stat(op, input, *mean, "mean", s);
  }
  check_norm_stat(op, input, rstd, "rstd", s);
  return s;
}

// What a device's forward loop is told; pointers it does not need are null.
//   kind kRms:       y = x * rstd * w                      rstd = 1/sqrt(mean(x^2) + eps)
//   kind kLayerNorm: y = (x - mean) * rstd * w + b         rstd = 1/sqrt(var(x) + eps)
// With `residual`, x is first replaced by round(x + residual) (in the input
// dtype), which is also written to `sum`.
enum class NormKind { kRms, kLayerNorm };

template <typename scalar_t, typename weight_t, typename acc_t>
struct NormForwardArgs {
  const scalar_t* x = nullptr;
  const scalar_t* residual = nullptr;
  const weight_t* weight = nullptr;
  const weight_t* bias = nullptr;
  scalar_t* y = nullptr;
  scalar_t* sum = nullptr;
  acc_t* mean = nullptr;  // written when not null (layer norm)
  acc_t* rstd = nullptr;  // written when not null
  int64_t rows = 0;
  int64_t cols = 0;
  acc_t eps = 0;
};

// What a device's backward loop is told.  xhat = (x - mean) * rstd (mean 0
// for kRms), gw = grad * w:
//   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))   (kRms: no mean(gw))
//   dweight = sum over rows of grad * xhat, dbias = sum over rows of grad,
// each written (in acc_t) only when its pointer is not null.
template <typename scalar_t, typename weight_t, typename acc_t>
struct NormBackwardArgs {
  const scalar_t* grad = nullptr;
  const scalar_t* x = nullptr;
  const acc_t* mean = nullptr;
  const acc_t* rstd = nullptr;
  const weight_t* weight = nullptr;
  scalar_t* dx = nullptr;
  acc_t* dweight = nullptr;
  acc_t* dbias = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

}  // namespace torchops
