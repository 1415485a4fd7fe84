// The math and the argument checks of the gated activations
// torchops.silu_and_mul and torchops.gelu_and_mul, written once for the CPU
// and CUDA kernels and for both ops.
//
// With x = [a, b] split in halves along the last dimension (d = size / 2):
//   out = act(a) * b
//   da  = grad * b * act'(a)          db = grad * act(a)
// The activations are structs with two members, templated on the element
// type T and on a math policy M that supplies exp, erf and tanh:
//   Act::value<M>(x)                   act(x)
//   Act::value_and_slope<M>(x, v, dv)  act(x) and act'(x), sharing their terms
// ScalarMath (below) serves float and double on both devices; the CPU
// kernels pass a policy over at::vec::Vectorized, so the same formulas run
// on whole vectors there.  Every function here is always inlined: the CPU
// kernels call them from code compiled for AVX2 (cpu/common/vectorized.h),
// and an out-of-line copy would be compiled for the baseline target, which
// passes vectors by another ABI.  Half types are computed in float (opmath) and
// rounded once at the end.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "common/checks.h"

namespace torchops {

struct ScalarMath {
  template <typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T exp(const T& x) { return std::exp(x); }
  template <typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T erf(const T& x) { return std::erf(x); }
  // erf(z) and exp(-z^2) together (a policy may share their terms).
  template <typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static void erf_and_gaussian(const T& z, T& e, T& g) {
    e = std::erf(z);
    g = std::exp(-z * z);
  }
  template <typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T tanh(const T& x) { return std::tanh(x); }
};

// 1 / x through the policy's `recip` where it has one (the CUDA kernels' fast
// policy for half types), else a division.
template <typename M, typename T, typename = void>
struct HasRecip : std::false_type {};
template <typename M, typename T>
struct HasRecip<M, T, std::void_t<decltype(M::recip(std::declval<const T&>()))>>
    : std::true_type {};

template <typename M, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T recip(const T& x) {
  if constexpr (HasRecip<M, T>::value) {
    return M::recip(x);
  } else {
    return T(1) / x;
  }
}

// silu(x) = x s with s = sigmoid(x);  silu'(x) = s (1 + x (1 - s)).
// exp(-x) overflows to inf for very negative x, where s is then 0: no nan.
struct Silu {
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T value(const T& x) {
    // A reciprocal, then a product: the policy may have a cheaper
    // reciprocal than a division (on CUDA a float division is a subroutine
    // whose registers cost a streaming kernel bandwidth).
    return x * recip<M>(T(1) + M::exp(T(0) - x));
  }
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static void value_and_slope(const T& x, T& v, T& dv) {
    const T s = recip<M>(T(1) + M::exp(T(0) - x));
    v = x * s;
    dv = s * (T(1) + x * (T(1) - s));
  }
};

// gelu(x) = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2;
// gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
struct GeluErf {
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T value(const T& x) {
    return T(0.5) * x * (T(1) + M::erf(x * T(0.70710678118654752440)));
  }
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static void value_and_slope(const T& x, T& v, T& dv) {
    // exp(-x^2 / 2) = exp(-z^2) for z = x / sqrt 2.
    T e, g;
    M::erf_and_gaussian(x * T(0.70710678118654752440), e, g);
    const T cdf = T(0.5) * (T(1) + e);
    v = x * cdf;
    dv = cdf + x * g * T(0.39894228040143267794);
  }
};

// F.gelu(approximate="tanh"): gelu(x) = x (1 + t) / 2 with
// t = tanh(k (x + c x^3)), k = sqrt(2 / pi), c = 0.044715;
// gelu'(x) = (1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2.
struct GeluTanh {
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static T value(const T& x) {
    const T t = M::tanh(T(0.79788456080286535588) * (x + T(0.044715) * x * x * x));
    return T(0.5) * x * (T(1) + t);
  }
  template <typename M, typename T>
  C10_HOST_DEVICE C10_ALWAYS_INLINE static void value_and_slope(const T& x, T& v, T& dv) {
    const T x2 = x * x;
    const T k = T(0.79788456080286535588);
    const T t = M::tanh(k * (x + T(0.044715) * x2 * x));
    v = T(0.5) * x * (T(1) + t);
    dv = T(0.5) * (T(1) + t) +
         T(0.5) * x * (T(1) - t * t) * k * (T(1) + T(3 * 0.044715) * x2);
  }
};

// act(a) * b.
template <typename Act, typename M, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T act_and_mul_value(const T& a, const T& b) {
  return Act::template value<M>(a) * b;
}

// The gradients of both halves for the output gradient g.
template <typename Act, typename M, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE void act_and_mul_grad(const T& g, const T& a, const T& b, T& da,
                                                         T& db) {
  T v, dv;
  Act::template value_and_slope<M>(a, v, dv);
  da = g * b * dv;
  db = g * v;
}

// --- the ops' activations and argument checks -----------------------------------

enum class GatedActivation { Silu, GeluErf, GeluTanh };

// f(Act{}) for the activation `kind`.
template <typename F>
decltype(auto) with_activation(GatedActivation kind, F&& f) {
  switch (kind) {
    case GatedActivation::Silu:
      return f(Silu{});
    case GatedActivation::GeluErf:
      return f(GeluErf{});
    default:
      return f(GeluTanh{});
  }
}

// gelu_and_mul's `approximate`, as F.gelu's: "none" or "tanh".
inline GatedActivation parse_gelu_approximate(const char* op,
                                              c10::string_view approximate) {
  if (approximate == "none") {
    return GatedActivation::GeluErf;
  }
  TORCH_CHECK(approximate == "tanh", "torchops.", op,
              ": expected 'approximate' to be 'none' or 'tanh', but got '",
              std::string(approximate), "'");
  return GatedActivation::GeluTanh;
}

// x holds the activation's input and the gate side by side in its last
// dimension, which must therefore be even.
inline void check_act_and_mul_input(const char* op, const at::Tensor& x) {
  check_floating(op, {x, "x"});
  TORCH_CHECK(x.dim() >= 1, "torchops.", op,
              ": expected 'x' to have at least 1 dimension, but got a 0-dim "
              "tensor");
  TORCH_CHECK(x.size(-1) % 2 == 0, "torchops.", op,
              ": expected the last dimension of 'x' to be even (the "
              "activation's input and the gate, side by side), but got shape ",
              x.sizes());
}

inline void check_act_and_mul(const char* op, const at::Tensor& x,
                              c10::DeviceType device) {
  check_devices(op, device, {{x, "x"}});
  check_act_and_mul_input(op, x);
}

inline void check_act_and_mul_backward(const char* op, const at::Tensor& grad,
                                       const at::Tensor& x,
                                       c10::DeviceType device) {
  check_devices(op, device, {{x, "x"}, {grad, "grad"}});
  check_act_and_mul_input(op, x);
  check_same_dtype(op, {x, "x"}, {grad, "grad"});
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() /= 2;
  TORCH_CHECK(grad.sizes() == c10::IntArrayRef(out_sizes), "torchops.", op,
              ": expected 'grad' to have the output's shape ",
              c10::IntArrayRef(out_sizes), ", but got ", grad.sizes());
}

}  // namespace torchops
