// torchops.fused_adam_: the argument checks and the per-element update that
// the CPU and CUDA kernels share.
//
// The update follows torch.optim.Adam / AdamW (the for-loop form) step for
// step, so that states move between the two and results agree to float32
// rounding:
//   g = grad / grad_scale            (stored back into grad: GradScaler's unscale)
//   g = -g                           (maximize)
//   g = g + weight_decay * p         (Adam)   |  p = p * (1 - lr * weight_decay)  (AdamW)
//   m = lerp(m, g, 1 - beta1)
//   v = v * beta2 + (1 - beta2) * g * g
//   vmax = max(vmax, v)              (amsgrad; the denominator then uses vmax)
//   p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step from the tensor's step
// (already incremented by the caller, as torch.optim does).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <math.h>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>

namespace torchops {

constexpr const char* kFusedAdamOp = "fused_adam_";

// The scalar hyper-parameters, as the schema passes them.
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool amsgrad;
  bool maximize;
  bool adamw;
};

// The per-tensor constants of one step, in the type the update computes in.
template <typename acc_t>
struct AdamCoeffs {
  acc_t grad_scale;    // 1 when there is no grad_scale
  acc_t l2;            // Adam's weight decay added to the gradient (0 for AdamW)
  acc_t decay;         // AdamW's factor on the parameter (1 for Adam)
  acc_t lerp_w;        // lerp weight: 1 - beta1, or (1 - beta1) - 1 when from_end
  acc_t beta2;
  acc_t one_minus_beta2;
  acc_t bc2_sqrt;
  acc_t eps;
  acc_t neg_step_size;  // -lr / bc1
  bool has_scale;
  bool maximize;
  // torch's lerp: start + w (end - start) for |w| < 0.5, else
  // end - (1 - w)(end - start).
  bool from_end;
};

// Rounded as torch.optim rounds its Python-float scalars into the tensor's
// dtype: every constant is formed in double, then converted once.
template <typename acc_t>
C10_HOST_DEVICE inline AdamCoeffs<acc_t> adam_coeffs(const AdamHyper& h, double lr, double step,
                                                     const float* grad_scale) {
  AdamCoeffs<acc_t> c;
  const double bc1 = 1.0 - ::pow(h.beta1, step);
  const double bc2 = 1.0 - ::pow(h.beta2, step);
  c.has_scale = grad_scale != nullptr;
  c.grad_scale = c.has_scale ? static_cast<acc_t>(*grad_scale) : acc_t(1);
  const bool decayed = h.weight_decay != 0.0;
  c.l2 = (decayed && !h.adamw) ? static_cast<acc_t>(h.weight_decay) : acc_t(0);
  c.decay = (decayed && h.adamw) ? static_cast<acc_t>(1.0 - lr * h.weight_decay) : acc_t(1);
  const acc_t w = static_cast<acc_t>(1.0 - h.beta1);
  c.from_end = !(w < acc_t(0.5) && w > acc_t(-0.5));
  c.lerp_w = c.from_end ? w - acc_t(1) : w;
  c.beta2 = static_cast<acc_t>(h.beta2);
  c.one_minus_beta2 = static_cast<acc_t>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<acc_t>(::sqrt(bc2));
  c.eps = static_cast<acc_t>(h.eps);
  c.neg_step_size = static_cast<acc_t>(-(lr / bc1));
  c.maximize = h.maximize;
  return c;
}

// fma and sqrt in acc_t itself (a plain ::sqrt of a float may be the double one).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t adam_fma(acc_t a, acc_t b, acc_t c) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return fmaf(a, b, c);
  } else {
    return fma(a, b, c);
  }
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t adam_sqrt(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return sqrtf(x);
  } else {
    return sqrt(x);
  }
}

// One element's update (scalar form; the CPU's vector loop spells the same
// steps in at::vec).  `g` returns the unscaled gradient; `vmax` is null
// without amsgrad.  NaNs propagate as in torch.maximum.
template <typename acc_t>
C10_HOST_DEVICE inline void adam_update(acc_t& p, acc_t& g, acc_t& m, acc_t& v, acc_t* vmax,
                                        const AdamCoeffs<acc_t>& c) {
  if (c.has_scale) {
    g = g / c.grad_scale;
  }
  acc_t d = c.maximize ? -g : g;
  d = d + p * c.l2;
  p = p * c.decay;
  const acc_t diff = d - m;
  m = c.from_end ? adam_fma(c.lerp_w, diff, d) : adam_fma(c.lerp_w, diff, m);
  v = v * c.beta2 + c.one_minus_beta2 * d * d;
  acc_t s = v;
  if (vmax != nullptr) {
    const acc_t old = *vmax;
    s = (old != old || old > v) ? old : v;
    *vmax = s;
  }
  const acc_t denom = adam_sqrt(s) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * m / denom;
}

namespace fused_adam_detail {

inline std::string at_index(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// `t` (list[i]) against `p`, named `ref` in messages.
inline void check_like(c10::DeviceType type, const at::Tensor& p, const std::string& ref, size_t i,
                       const at::Tensor& t, const char* list, std::optional<at::ScalarType> dtype) {
  const std::string name = at_index(list, i);
  TORCH_CHECK(t.defined(), "torchops.fused_adam_: '", name, "' is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "torchops.fused_adam_: '", name,
              "' must be a dense (strided) tensor, but got layout ", t.layout(),
              " (sparse gradients are not supported)");
  TORCH_CHECK(t.device().type() == type && t.device() == p.device(), "torchops.fused_adam_: '",
              name, "' is on ", t.device(), " but '", ref, "' is on ", p.device());
  if (dtype.has_value()) {
    TORCH_CHECK(t.scalar_type() == *dtype, "torchops.fused_adam_: expected '", name,
                "' to have dtype ", *dtype, ", but got ", t.scalar_type());
  }
  TORCH_CHECK(t.sizes() == p.sizes(), "torchops.fused_adam_: '", name, "' has shape ",
              t.sizes(), " but '", ref, "' has shape ", p.sizes());
  TORCH_CHECK(t.is_non_overlapping_and_dense() && t.strides() == p.strides(),
              "torchops.fused_adam_: '", name, "' must be dense with the strides of '", ref,
              "' (", p.strides(), "), but got strides ", t.strides());
}

inline void check_scalar(c10::DeviceType type, const at::Tensor& p0, const at::Tensor& t,
                         const std::string& name) {
  TORCH_CHECK(t.layout() == at::kStrided && t.numel() == 1 && t.scalar_type() == at::kFloat,
              "torchops.fused_adam_: expected '", name,
              "' to be a float32 tensor of one element, but got ", t.scalar_type(), " of shape ",
              t.sizes());
  TORCH_CHECK(t.device().type() == type && t.device() == p0.device(), "torchops.fused_adam_: '",
              name, "' is on ", t.device(), " but 'params[0]' is on ", p0.device());
}

}  // namespace fused_adam_detail

// Every argument of one call: equal list lengths (max_exp_avg_sqs empty
// without amsgrad), every tensor on params[0]'s device, dense and laid out as
// its parameter, one dtype per list, no parameter twice.  Without
// master_params the gradient and the states have the parameter's dtype; with
// them the parameters are float16 or bfloat16, the masters and the states
// float32, the gradients the parameter's dtype or float32.  state_steps,
// lr (as a tensor), grad_scale and found_inf are float32 single elements.
inline void check_fused_adam(c10::DeviceType type, at::TensorList params, at::TensorList grads,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                             at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                             const AdamHyper& h, const std::optional<at::TensorList>& master,
                             const std::optional<at::Tensor>& lr,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf) {
  using namespace fused_adam_detail;
  const size_t n = params.size();
  auto same_length = [&](at::TensorList l, const char* name, size_t want) {
    TORCH_CHECK(l.size() == want, "torchops.fused_adam_: expected '", name, "' to have ", want,
                " tensors (one per parameter", (want == 0 ? ", none without amsgrad" : ""),
                "), but got ", l.size());
  };
  same_length(grads, "grads", n);
  same_length(exp_avgs, "exp_avgs", n);
  same_length(exp_avg_sqs, "exp_avg_sqs", n);
  same_length(max_exp_avg_sqs, "max_exp_avg_sqs", h.amsgrad ? n : 0);
  same_length(state_steps, "state_steps", n);
  if (master.has_value()) {
    same_length(*master, "master_params", n);
  }
  TORCH_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0 && h.beta2 >= 0.0 && h.beta2 < 1.0,
              "torchops.fused_adam_: expected 'beta1' and 'beta2' in [0, 1), but got ", h.beta1,
              " and ", h.beta2);
  if (n == 0) {
    return;
  }
  const at::Tensor& p0 = params[0];
  TORCH_CHECK(p0.device().type() == type, "torchops.fused_adam_: expected 'params[0]' to be a ",
              c10::DeviceTypeName(type, /*lower_case=*/true), " tensor, but got one on ",
              p0.device());
  TORCH_CHECK(at::isFloatingType(p0.scalar_type()),
              "torchops.fused_adam_: expected 'params[0]' to be a floating-point tensor, but got ",
              p0.scalar_type());
  const at::ScalarType pt = p0.scalar_type();
  if (master.has_value()) {
    TORCH_CHECK(pt == at::kHalf || pt == at::kBFloat16, "torchops.fused_adam_: with "
                "'master_params', expected 'params' to be float16 or bfloat16, but got ", pt);
  }
  const at::ScalarType st = master.has_value() ? at::kFloat : pt;
  const at::ScalarType gt = grads[0].defined() ? grads[0].scalar_type() : pt;
  TORCH_CHECK(gt == pt || (master.has_value() && gt == at::kFloat),
              "torchops.fused_adam_: expected 'grads[0]' to have dtype ", pt,
              (master.has_value() ? " or float32" : ""), ", but got ", gt);
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const std::string ref = at_index("params", i);
    TORCH_CHECK(p.defined(), "torchops.fused_adam_: '", ref, "' is undefined");
    TORCH_CHECK(p.device() == p0.device(), "torchops.fused_adam_: '", ref, "' is on ",
                p.device(), " but 'params[0]' is on ", p0.device());
    TORCH_CHECK(p.scalar_type() == pt, "torchops.fused_adam_: expected '", ref,
                "' to have dtype ", pt, " (that of 'params[0]'), but got ", p.scalar_type());
    TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(),
                "torchops.fused_adam_: '", ref, "' must be a dense tensor");
    TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second &&
                    (p.numel() == 0 || seen.insert(p.data_ptr()).second),
                "torchops.fused_adam_: 'params[", i, "]' appears twice (or shares memory with "
                "another parameter)");
    check_like(type, p, ref, i, grads[i], "grads", gt);
    check_like(type, p, ref, i, exp_avgs[i], "exp_avgs", st);
    check_like(type, p, ref, i, exp_avg_sqs[i], "exp_avg_sqs", st);
    if (h.amsgrad) {
      check_like(type, p, ref, i, max_exp_avg_sqs[i], "max_exp_avg_sqs", st);
    }
    if (master.has_value()) {
      check_like(type, p, ref, i, (*master)[i], "master_params", at::kFloat);
    }
    check_scalar(type, p0, state_steps[i], at_index("state_steps", i));
  }
  if (lr.has_value()) {
    check_scalar(type, p0, *lr, "lr");
  }
  if (grad_scale.has_value()) {
    check_scalar(type, p0, *grad_scale, "grad_scale");
  }
  if (found_inf.has_value()) {
    check_scalar(type, p0, *found_inf, "found_inf");
  }
}

}  // namespace torchops
