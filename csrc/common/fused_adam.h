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

#include "common/multi_tensor.h"

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
  m = multi_tensor::step_fma(c.lerp_w, diff, c.from_end ? d : m);
  v = v * c.beta2 + c.one_minus_beta2 * d * d;
  acc_t s = v;
  if (vmax != nullptr) {
    const acc_t old = *vmax;
    s = (old != old || old > v) ? old : v;
    *vmax = s;
  }
  const acc_t denom = multi_tensor::step_sqrt(s) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * m / denom;
}

// Every argument of one call: equal list lengths (max_exp_avg_sqs empty
// without amsgrad), the parameter rules of multi_tensor::check_params, the
// moments (and masters) laid out as their parameters in the state dtype,
// state_steps, lr (as a tensor), grad_scale and found_inf float32 single
// elements.
inline void check_fused_adam(c10::DeviceType type, at::TensorList params, at::TensorList grads,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                             at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                             const AdamHyper& h, const std::optional<at::TensorList>& master,
                             const std::optional<at::Tensor>& lr,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf) {
  namespace mt = multi_tensor;
  const char* op = kFusedAdamOp;
  const size_t n = params.size();
  mt::check_length(op, grads, "grads", n);
  mt::check_length(op, exp_avgs, "exp_avgs", n);
  mt::check_length(op, exp_avg_sqs, "exp_avg_sqs", n);
  mt::check_length(op, max_exp_avg_sqs, "max_exp_avg_sqs", h.amsgrad ? n : 0,
                   h.amsgrad ? "one per parameter" : "none without amsgrad");
  mt::check_length(op, state_steps, "state_steps", n);
  if (master.has_value()) {
    mt::check_length(op, *master, "master_params", n);
  }
  TORCH_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0 && h.beta2 >= 0.0 && h.beta2 < 1.0,
              "torchops.fused_adam_: expected 'beta1' and 'beta2' in [0, 1), but got ", h.beta1,
              " and ", h.beta2);
  if (n == 0) {
    return;
  }
  const mt::StepDtypes d = mt::check_params(op, type, params, grads, master.has_value());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const std::string ref = mt::at_index("params", i);
    mt::check_like(op, type, p, ref, i, exp_avgs[i], "exp_avgs", d.state);
    mt::check_like(op, type, p, ref, i, exp_avg_sqs[i], "exp_avg_sqs", d.state);
    if (h.amsgrad) {
      mt::check_like(op, type, p, ref, i, max_exp_avg_sqs[i], "max_exp_avg_sqs", d.state);
    }
    if (master.has_value()) {
      mt::check_like(op, type, p, ref, i, (*master)[i], "master_params", at::kFloat);
    }
    mt::check_scalar(op, type, params[0], state_steps[i], mt::at_index("state_steps", i));
  }
  mt::check_step_scalars(op, type, params[0], lr, grad_scale, found_inf);
}

// The schema's two overloads (a float lr, a tensor lr) over one device's
// `void Impl(params, ..., state_steps, const AdamHyper&, master_params,
// lr_tensor, grad_scale, found_inf)`.
template <auto Impl>
void fused_adam_float_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         at::TensorList state_steps, double lr, double beta1, double beta2,
                         double eps, double weight_decay, bool amsgrad, bool maximize, bool adamw,
                         std::optional<at::TensorList> master_params,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  Impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
       AdamHyper{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, adamw}, master_params,
       std::nullopt, grad_scale, found_inf);
}

template <auto Impl>
void fused_adam_tensor_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                          at::TensorList state_steps, const at::Tensor& lr, double beta1,
                          double beta2, double eps, double weight_decay, bool amsgrad,
                          bool maximize, bool adamw, std::optional<at::TensorList> master_params,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  Impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
       AdamHyper{0.0, beta1, beta2, eps, weight_decay, amsgrad, maximize, adamw}, master_params,
       lr, grad_scale, found_inf);
}

}  // namespace torchops
