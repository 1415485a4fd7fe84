// torchops.fused_sgd_: the argument checks and the per-element update that
// the CPU and CUDA kernels share.
//
// The update follows torch.optim.SGD's for-loop form step for step (torch's
// fused CPU step does too), so that momentum buffers move between the two
// and results agree bit for bit where both compute in the tensors' dtype:
//   g = grad / grad_scale             (stored back into grad: GradScaler's unscale)
//   g = -g                            (maximize)
//   g = g + weight_decay * p          (one fma, as Tensor.add(alpha=) rounds it)
//   buf = g                           (is_first_step)
//   buf = (buf * momentum) + (1 - dampening) * g   (otherwise: a product, then an fma)
//   g = g + momentum * buf  (nesterov)  |  g = buf
//   p = p + (-lr) * g                 (one fma)
// Without momentum there is no buffer and g updates p directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <math.h>
#include <optional>
#include <string>
#include <type_traits>

#include "common/multi_tensor.h"

namespace torchops {

constexpr const char* kFusedSgdOp = "fused_sgd_";

// The scalar hyper-parameters, as the schema passes them.
struct SgdHyper {
  double lr;
  double weight_decay;
  double momentum;
  double dampening;
  bool nesterov;
  bool maximize;
  bool is_first_step;
};

// The constants of one step, in the type the update computes in.
template <typename acc_t>
struct SgdCoeffs {
  acc_t grad_scale;  // 1 when there is no grad_scale
  acc_t weight_decay;
  acc_t momentum;
  acc_t one_minus_dampening;
  acc_t neg_lr;
  bool has_scale;
  bool decayed;    // weight_decay != 0: torch skips the add (0 * an infinite p is NaN)
  bool first;      // the buffer starts as g
  bool nesterov;
  bool maximize;
};

// Each constant is formed in double and rounded once, as torch.optim's
// Python-float scalars are rounded into the tensor's dtype.
template <typename acc_t>
C10_HOST_DEVICE inline SgdCoeffs<acc_t> sgd_coeffs(const SgdHyper& h, double lr,
                                                   const float* grad_scale) {
  SgdCoeffs<acc_t> c;
  c.has_scale = grad_scale != nullptr;
  c.grad_scale = c.has_scale ? static_cast<acc_t>(*grad_scale) : acc_t(1);
  c.weight_decay = static_cast<acc_t>(h.weight_decay);
  c.momentum = static_cast<acc_t>(h.momentum);
  c.one_minus_dampening = static_cast<acc_t>(1.0 - h.dampening);
  c.neg_lr = static_cast<acc_t>(-lr);
  c.decayed = h.weight_decay != 0.0;
  c.first = h.is_first_step;
  c.nesterov = h.nesterov;
  c.maximize = h.maximize;
  return c;
}

// One element's update (scalar form; the CPU's vector loop spells the same
// steps in at::vec).  `g` returns the unscaled gradient; `buf` is null
// without momentum.
template <typename acc_t>
C10_HOST_DEVICE inline void sgd_update(acc_t& p, acc_t& g, acc_t* buf, const SgdCoeffs<acc_t>& c) {
  if (c.has_scale) {
    g = g / c.grad_scale;
  }
  acc_t d = c.maximize ? -g : g;
  if (c.decayed) {
    d = multi_tensor::step_fma(p, c.weight_decay, d);
  }
  if (buf != nullptr) {
    const acc_t b =
        c.first ? d : multi_tensor::step_fma(d, c.one_minus_dampening, *buf * c.momentum);
    *buf = b;
    d = c.nesterov ? multi_tensor::step_fma(b, c.momentum, d) : b;
  }
  p = multi_tensor::step_fma(d, c.neg_lr, p);
}

// Every argument of one call: equal list lengths (momentum_buffer_list
// empty without momentum, as torch._fused_sgd_ takes it), the parameter
// rules of multi_tensor::check_params, the buffers (and masters) laid out as
// their parameters in the state dtype, lr (as a tensor), grad_scale and
// found_inf float32 single elements.
inline void check_fused_sgd(c10::DeviceType type, at::TensorList params, at::TensorList grads,
                            at::TensorList momentum_buffer_list, const SgdHyper& h,
                            const std::optional<at::TensorList>& master,
                            const std::optional<at::Tensor>& lr,
                            const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf) {
  namespace mt = multi_tensor;
  const char* op = kFusedSgdOp;
  const size_t n = params.size();
  const bool has_momentum = h.momentum != 0.0;
  mt::check_length(op, grads, "grads", n);
  mt::check_length(op, momentum_buffer_list, "momentum_buffer_list", has_momentum ? n : 0,
                   has_momentum ? "one per parameter" : "none without momentum");
  if (master.has_value()) {
    mt::check_length(op, *master, "master_params", n);
  }
  if (n == 0) {
    return;
  }
  const mt::StepDtypes d = mt::check_params(op, type, params, grads, master.has_value());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const std::string ref = mt::at_index("params", i);
    if (has_momentum) {
      mt::check_like(op, type, p, ref, i, momentum_buffer_list[i], "momentum_buffer_list",
                     d.state);
    }
    if (master.has_value()) {
      mt::check_like(op, type, p, ref, i, (*master)[i], "master_params", at::kFloat);
    }
  }
  mt::check_step_scalars(op, type, params[0], lr, grad_scale, found_inf);
}

// The schema's two overloads (a float lr, a tensor lr) over one device's
// `void Impl(params, grads, momentum_buffer_list, const SgdHyper&,
// master_params, lr_tensor, grad_scale, found_inf)`.
template <auto Impl>
void fused_sgd_float_lr(at::TensorList params, at::TensorList grads,
                        at::TensorList momentum_buffer_list, double weight_decay,
                        double momentum, double lr, double dampening, bool nesterov,
                        bool maximize, bool is_first_step,
                        std::optional<at::TensorList> master_params,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  Impl(params, grads, momentum_buffer_list,
       SgdHyper{lr, weight_decay, momentum, dampening, nesterov, maximize, is_first_step},
       master_params, std::nullopt, grad_scale, found_inf);
}

template <auto Impl>
void fused_sgd_tensor_lr(at::TensorList params, at::TensorList grads,
                         at::TensorList momentum_buffer_list, double weight_decay,
                         double momentum, const at::Tensor& lr, double dampening, bool nesterov,
                         bool maximize, bool is_first_step,
                         std::optional<at::TensorList> master_params,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  Impl(params, grads, momentum_buffer_list,
       SgdHyper{0.0, weight_decay, momentum, dampening, nesterov, maximize, is_first_step},
       master_params, lr, grad_scale, found_inf);
}

}  // namespace torchops
