// The math and argument checks of torchops.sigmoid_focal_loss, written once
// for the CPU and CUDA kernels.
//
// With p = sigmoid(x), target t in [0, 1] and
//   ce  = BCE-with-logits(x, t) = max(x, 0) - x t + log1p(exp(-|x|))
//   q   = 1 - p_t = p (1 - t) + (1 - p) t
//   a_t = alpha t + (1 - alpha)(1 - t)       (1 when alpha < 0)
// the loss is  a_t * ce * q^gamma  and its derivative with respect to x is
//   a_t * [ (p - t) q^gamma + gamma q^(gamma-1) * ce * p (1 - p)(1 - 2t) ]
// since d ce/dx = p - t and dq/dx = p (1 - p)(1 - 2t).
//
// p and 1 - p are both formed from e = exp(-|x|) (one is 1/(1+e), the other
// e/(1+e)), so neither suffers the cancellation of computing 1 - p, and
// p - t and q are written as p(1-t) -/+ (1-p)t for the same reason: for hard
// targets one term vanishes and nothing cancels, so a confident right answer
// keeps its tiny loss and gradient instead of rounding them to 0.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "common/checks.h"
#include "common/reduction.h"

namespace torchops {

// gamma's common values get exact, cheap powers; anything else uses pow.
// gamma == 0 must give q^0 = 1 even at q == 0 (torch.pow's pow(0, 0) = 1)
// and no gamma q^(gamma-1) term at all (torch's pow backward masks it).
enum class FocalGamma { Zero, One, Two, General };

template <typename T>
struct FocalParams {
  T a0, a1;  // a_t = a0 + a1 * t
  T gamma;
};

// sigmoid(x), 1 - sigmoid(x) and BCE-with-logits(x, t) of one element.
template <typename T>
struct SigmoidBce {
  T p, pm, ce;
};

inline FocalGamma focal_gamma_kind(double gamma) {
  if (gamma == 0.0) {
    return FocalGamma::Zero;
  }
  if (gamma == 1.0) {
    return FocalGamma::One;
  }
  if (gamma == 2.0) {
    return FocalGamma::Two;
  }
  return FocalGamma::General;
}

template <typename T>
FocalParams<T> focal_params(double alpha, double gamma) {
  // alpha < 0 switches the class weighting off (torchvision's convention).
  const double a0 = alpha >= 0 ? 1.0 - alpha : 1.0;
  const double a1 = alpha >= 0 ? 2.0 * alpha - 1.0 : 0.0;
  return {static_cast<T>(a0), static_cast<T>(a1), static_cast<T>(gamma)};
}

// Portable version (CUDA, and CPU float64).  The CPU float path has its own
// vectorisable one with the same results up to rounding.
template <typename T>
C10_HOST_DEVICE inline SigmoidBce<T> sigmoid_bce(T x, T t) {
  const bool pos = x >= T(0);
  const T e = std::exp(pos ? -x : x);
  const T inv = T(1) / (T(1) + e);
  const T big = inv;      // sigmoid(|x|)
  const T small = e * inv;  // sigmoid(-|x|)
  return {pos ? big : small, pos ? small : big,
          (pos ? x : T(0)) - x * t + std::log1p(e)};
}

// q^gamma and d/dq q^gamma for the General kind.  Kernels may pass their
// own (the CPU float path has a vectorisable one).
struct StdPow {
  template <typename T>
  C10_HOST_DEVICE static T pow(T q, T gamma) {
    return std::pow(q, gamma);
  }
  template <typename T>
  C10_HOST_DEVICE static T dpow(T q, T gamma) {
    return gamma * std::pow(q, gamma - T(1));
  }
};

template <FocalGamma K, typename Pow, typename T>
C10_HOST_DEVICE inline T focal_pow(T q, T gamma) {
  if constexpr (K == FocalGamma::Zero) {
    return T(1);
  } else if constexpr (K == FocalGamma::One) {
    return q;
  } else if constexpr (K == FocalGamma::Two) {
    return q * q;
  } else {
    return Pow::pow(q, gamma);
  }
}

// d/dq q^gamma.  For 0 < gamma < 1 it is inf at q == 0 (as in the reference),
// which only happens where p has saturated to 0 or 1.
template <FocalGamma K, typename Pow, typename T>
C10_HOST_DEVICE inline T focal_dpow(T q, T gamma) {
  if constexpr (K == FocalGamma::Zero) {
    return T(0);
  } else if constexpr (K == FocalGamma::One) {
    return T(1);
  } else if constexpr (K == FocalGamma::Two) {
    return T(2) * q;
  } else {
    return Pow::dpow(q, gamma);
  }
}

template <FocalGamma K, typename Pow = StdPow, typename T>
C10_HOST_DEVICE inline T focal_loss_value(
    const SigmoidBce<T>& s, T t, const FocalParams<T>& prm) {
  const T q = s.p * (T(1) - t) + s.pm * t;
  return (prm.a0 + prm.a1 * t) * s.ce * focal_pow<K, Pow>(q, prm.gamma);
}

// g * d loss / dx.
template <FocalGamma K, typename Pow = StdPow, typename T>
C10_HOST_DEVICE inline T focal_loss_grad(
    const SigmoidBce<T>& s, T t, T g, const FocalParams<T>& prm) {
  const T q = s.p * (T(1) - t) + s.pm * t;
  const T dce = s.p * (T(1) - t) - s.pm * t;  // p - t
  T d = dce * focal_pow<K, Pow>(q, prm.gamma);
  if constexpr (K != FocalGamma::Zero) {
    const T dq = s.p * s.pm * (T(1) - T(2) * t);
    d += focal_dpow<K, Pow>(q, prm.gamma) * dq * s.ce;
  }
  return g * (prm.a0 + prm.a1 * t) * d;
}

// Calls f(std::integral_constant<FocalGamma, K>{}) for gamma's kind, so
// kernels are instantiated per kind and the power is resolved at compile
// time.
template <typename F>
decltype(auto) dispatch_focal_gamma(FocalGamma kind, F&& f) {
  switch (kind) {
    case FocalGamma::Zero:
      return f(std::integral_constant<FocalGamma, FocalGamma::Zero>{});
    case FocalGamma::One:
      return f(std::integral_constant<FocalGamma, FocalGamma::One>{});
    case FocalGamma::Two:
      return f(std::integral_constant<FocalGamma, FocalGamma::Two>{});
    default:
      return f(std::integral_constant<FocalGamma, FocalGamma::General>{});
  }
}

// --- argument checks -----------------------------------------------------------------

inline void check_focal_inputs(const char* op, const at::Tensor& inputs,
                               const at::Tensor& targets, double gamma) {
  check_floating(op, {inputs, "inputs"});
  // (1 - p_t)^gamma with gamma < 0 is infinite for every confident right
  // answer: not a focal loss.  NaN fails this too.
  TORCH_CHECK(gamma >= 0.0, "torchops.", op,
              ": expected 'gamma' to be >= 0, but got ", gamma);
  check_same_dtype(op, {inputs, "inputs"}, {targets, "targets"});
  // No broadcasting: a targets tensor of another shape is almost always a
  // bug (e.g. class indices instead of one-hot), not an intent.
  TORCH_CHECK(
      targets.sizes() == inputs.sizes(), "torchops.", op, ": expected "
      "'targets' to have the shape of 'inputs' (", inputs.sizes(),
      "), but got ", targets.sizes());
}

inline Reduction check_sigmoid_focal_loss(
    const at::Tensor& inputs, const at::Tensor& targets, double gamma,
    c10::string_view reduction, c10::DeviceType device) {
  const char* op = "sigmoid_focal_loss";
  check_devices(op, device, {{inputs, "inputs"}, {targets, "targets"}});
  check_focal_inputs(op, inputs, targets, gamma);
  return parse_reduction(op, reduction);
}

inline Reduction check_sigmoid_focal_loss_backward(
    const at::Tensor& grad, const at::Tensor& inputs,
    const at::Tensor& targets, double gamma, c10::string_view reduction,
    c10::DeviceType device) {
  const char* op = "_sigmoid_focal_loss_backward";
  check_devices(
      op, device, {{inputs, "inputs"}, {targets, "targets"}, {grad, "grad"}});
  check_focal_inputs(op, inputs, targets, gamma);
  check_same_dtype(op, {inputs, "inputs"}, {grad, "grad"});
  const Reduction red = parse_reduction(op, reduction);
  if (red == Reduction::None) {
    TORCH_CHECK(
        grad.sizes() == inputs.sizes(), "torchops.", op, ": expected 'grad' "
        "to have the shape of 'inputs' (", inputs.sizes(), ") for reduction "
        "'none', but got ", grad.sizes());
  } else {
    TORCH_CHECK(
        grad.dim() == 0, "torchops.", op, ": expected 'grad' to be a 0-dim "
        "tensor for reduction '", std::string(reduction), "', but got shape ",
        grad.sizes());
  }
  return red;
}

}  // namespace torchops
