// Argument checks and dtype dispatch shared by the multi-tensor ops (the
// fused optimizer steps, multi_tensor_l2norm, multi_tensor_scale_).
//
// These ops take lists whose i-th entries belong together (a parameter, its
// gradient, its states): every message names the op, the list and the index.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <math.h>

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>

namespace torchops::multi_tensor {

// fma and sqrt in acc_t itself, for the optimizers' per-element updates (a
// plain ::sqrt of a float may be the double one; an fma rounds once, as
// torch's addcmul / add(alpha=) do on the CPU).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t step_fma(acc_t a, acc_t b, acc_t c) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return fmaf(a, b, c);
  } else {
    return fma(a, b, c);
  }
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t step_sqrt(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return sqrtf(x);
  } else {
    return sqrt(x);
  }
}

inline std::string at_index(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// `list` has `want` tensors; `why` explains the count in the message.
inline void check_length(const char* op, at::TensorList list, const char* name, size_t want,
                         const char* why = "one per parameter") {
  TORCH_CHECK(list.size() == want, "torchops.", op, ": expected '", name, "' to have ", want,
              " tensors (", why, "), but got ", list.size());
}

// list[i] goes with `p` (named `ref` in messages): defined, dense, on p's
// device, of `dtype` when given, with p's shape and strides.
inline void check_like(const char* op, c10::DeviceType type, const at::Tensor& p,
                       const std::string& ref, size_t i, const at::Tensor& t, const char* list,
                       std::optional<at::ScalarType> dtype) {
  const std::string name = at_index(list, i);
  TORCH_CHECK(t.defined(), "torchops.", op, ": '", name, "' is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "torchops.", op, ": '", name,
              "' must be a dense (strided) tensor, but got layout ", t.layout(),
              " (sparse gradients are not supported)");
  TORCH_CHECK(t.device().type() == type && t.device() == p.device(), "torchops.", op, ": '",
              name, "' is on ", t.device(), " but '", ref, "' is on ", p.device());
  if (dtype.has_value()) {
    TORCH_CHECK(t.scalar_type() == *dtype, "torchops.", op, ": expected '", name,
                "' to have dtype ", *dtype, ", but got ", t.scalar_type());
  }
  TORCH_CHECK(t.sizes() == p.sizes(), "torchops.", op, ": '", name, "' has shape ", t.sizes(),
              " but '", ref, "' has shape ", p.sizes());
  TORCH_CHECK(t.is_non_overlapping_and_dense() && t.strides() == p.strides(), "torchops.", op,
              ": '", name, "' must be dense with the strides of '", ref, "' (", p.strides(),
              "), but got strides ", t.strides());
}

// A float32 tensor of one element on p0's device (a step count, a tensor
// lr, GradScaler's scale or inf flag).
inline void check_scalar(const char* op, c10::DeviceType type, const at::Tensor& p0,
                         const at::Tensor& t, const std::string& name) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.numel() == 1 &&
                  t.scalar_type() == at::kFloat,
              "torchops.", op, ": expected '", name,
              "' to be a float32 tensor of one element, but got ",
              (t.defined() ? c10::toString(t.scalar_type()) : "an undefined tensor"),
              (t.defined() ? " of shape " + c10::str(t.sizes()) : std::string()));
  TORCH_CHECK(t.device().type() == type && t.device() == p0.device(), "torchops.", op, ": '",
              name, "' is on ", t.device(), " but '", at_index("params", 0), "' is on ",
              p0.device());
}

// The dtypes of one optimizer call.
struct StepDtypes {
  at::ScalarType param;
  at::ScalarType grad;
  at::ScalarType state;  // moments and masters
};

// The parameter list of an optimizer step: every tensor defined, dense, of
// one floating dtype, on params[0]'s device of `type`, none twice (nor two
// sharing memory).  Without masters the gradients and states have the
// parameters' dtype; with them the parameters are float16 or bfloat16, the
// states float32, and the gradients the parameters' dtype or float32.
// Call with a non-empty list.
inline StepDtypes check_params(const char* op, c10::DeviceType type, at::TensorList params,
                               at::TensorList grads, bool master) {
  const at::Tensor& p0 = params[0];
  TORCH_CHECK(p0.defined(), "torchops.", op, ": 'params[0]' is undefined");
  TORCH_CHECK(p0.device().type() == type, "torchops.", op, ": expected 'params[0]' to be a ",
              c10::DeviceTypeName(type, /*lower_case=*/true), " tensor, but got one on ",
              p0.device());
  const at::ScalarType pt = p0.scalar_type();
  TORCH_CHECK(at::isFloatingType(pt), "torchops.", op,
              ": expected 'params[0]' to be a floating-point tensor, but got ", pt);
  if (master) {
    TORCH_CHECK(pt == at::kHalf || pt == at::kBFloat16, "torchops.", op,
                ": with 'master_params', expected 'params' to be float16 or bfloat16, but got ",
                pt);
  }
  const at::ScalarType gt = grads[0].defined() ? grads[0].scalar_type() : pt;
  TORCH_CHECK(gt == pt || (master && gt == at::kFloat), "torchops.", op,
              ": expected 'grads[0]' to have dtype ", pt, (master ? " or float32" : ""),
              ", but got ", gt);
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const std::string ref = at_index("params", i);
    TORCH_CHECK(p.defined(), "torchops.", op, ": '", ref, "' is undefined");
    TORCH_CHECK(p.device() == p0.device(), "torchops.", op, ": '", ref, "' is on ", p.device(),
                " but 'params[0]' is on ", p0.device());
    TORCH_CHECK(p.scalar_type() == pt, "torchops.", op, ": expected '", ref, "' to have dtype ",
                pt, " (that of 'params[0]'), but got ", p.scalar_type());
    TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(), "torchops.", op,
                ": '", ref, "' must be a dense tensor");
    TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second &&
                    (p.numel() == 0 || seen.insert(p.data_ptr()).second),
                "torchops.", op, ": '", ref,
                "' appears twice (or shares memory with another parameter)");
    check_like(op, type, p, ref, i, grads[i], "grads", gt);
  }
  return StepDtypes{pt, gt, master ? at::kFloat : pt};
}

// The optional single-element tensors of a step: a tensor lr, grad_scale,
// found_inf.
inline void check_step_scalars(const char* op, c10::DeviceType type, const at::Tensor& p0,
                               const std::optional<at::Tensor>& lr,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf) {
  if (lr.has_value()) {
    check_scalar(op, type, p0, *lr, "lr");
  }
  if (grad_scale.has_value()) {
    check_scalar(op, type, p0, *grad_scale, "grad_scale");
  }
  if (found_inf.has_value()) {
    check_scalar(op, type, p0, *found_inf, "found_inf");
  }
}

// Calls f(param_t{}, grad_t{}, state_t{}) for the dtypes check_params
// accepted: with masters (bf16|f16, bf16|f16|float, float), else one dtype
// for all three.
template <typename F>
void dispatch_step_types(const StepDtypes& d, bool master, F&& f) {
  if (master) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(d.param, "multi_tensor_step", [&] {
      if (d.grad == at::kFloat) {
        f(scalar_t{}, float{}, float{});
      } else {
        f(scalar_t{}, scalar_t{}, float{});
      }
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, d.param, "multi_tensor_step",
                                    [&] { f(scalar_t{}, scalar_t{}, scalar_t{}); });
  }
}

}  // namespace torchops::multi_tensor
