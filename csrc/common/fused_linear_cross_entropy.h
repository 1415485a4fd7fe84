// The math and argument checks of torchops.fused_linear_cross_entropy,
// written once for the CPU and CUDA kernels.
//
// Logits y = input @ weight^T + bias, one row of V classes per token; capped
// logits z = c tanh(y / c) with a softcap c, else z = y; lse = logsumexp(z).
// With target t, label smoothing e and z-loss scale s, a token's loss is
//   (1 - e)(lse - z_t) + e (lse - sum(z) / V) + s lse^2
//     = lse - (1 - e) z_t - e sum(z) / V + s lse^2
// (PyTorch's cross_entropy with label_smoothing, plus PaLM's z-loss), 0 for
// an ignored token.  Its derivative with respect to y_v is
//   [ p_v (1 + 2 s lse) - e / V - (1 - e) [v == t] ] * dz/dy,
//   p_v = exp(z_v - lse),   dz/dy = 1 - (z / c)^2 with a softcap, else 1.
//
// The kernels never see more than a chunk of rows of the logits.  A "stats"
// pass gives each row (lse, z_t, sum(z)) over the columns it holds, so rows
// split over the vocabulary (tensor parallelism) combine exactly: lse by a
// logsumexp, the others by a sum.  A "grad" pass overwrites the logits with
// scale * dloss/dy, given the row's lse and a per-row scale (the upstream
// gradient, 1 / (tokens counted) for "mean", 0 for ignored rows).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <optional>

#include "common/checks.h"
#include "common/reduction.h"

namespace torchops {

// Everything but the tensors, as the kernels see it.  Columns of the chunk
// are classes vocab_start ... vocab_start + V_local - 1 of vocab_total.
struct LceParams {
  int64_t ignore_index = -100;
  double smoothing = 0.0;
  double z_scale = 0.0;
  bool has_cap = false;
  double cap = 0.0;
  int64_t vocab_start = 0;
  int64_t vocab_total = 0;
  Reduction red = Reduction::Mean;
  // Whether the stats pass sums z (only label smoothing reads the sum).
  bool want_sum = false;
};

// Row statistics, one float per field (double for double inputs).
enum LceStat : int64_t { kLceLse = 0, kLceTarget = 1, kLceSum = 2, kLceStats = 3 };

// tanh written through exp, so it is the same expression on every device and
// vectorises on the CPU; exact at the limits (exp -> inf gives 1, -> 0
// gives -1).  Near 0 its absolute error is a few ulp of 1, which a softcap
// (c of tens) turns into an absolute error of the capped logit far below
// the float32 logits' own rounding.
template <typename T, typename Exp>
C10_HOST_DEVICE inline T lce_tanh(T x, Exp exp_fn) {
  return T(1) - T(2) / (exp_fn(T(2) * x) + T(1));
}

// z of a logit y: c tanh(y / c) with a softcap (inv_cap = 1 / c), else y.
template <bool kCap, typename T, typename Exp>
C10_HOST_DEVICE inline T lce_capped(T y, T cap, T inv_cap, Exp exp_fn) {
  if constexpr (kCap) {
    return cap * lce_tanh(y * inv_cap, exp_fn);
  } else {
    return y;
  }
}

// The per-row coefficients of the gradient, scale folded in:
//   d = (exp(z - lse) * a - b - [v == t] c) * dz/dy.
template <typename T>
struct LceGradRow {
  T lse, a, b, c;
};

template <typename T>
C10_HOST_DEVICE inline LceGradRow<T> lce_grad_row(T lse, T scale, T smoothing,
                                                  T z_scale, T vocab_total) {
  return {lse, scale * (T(1) + T(2) * z_scale * lse), scale * smoothing / vocab_total,
          scale * (T(1) - smoothing)};
}

// The gradient of one element; `hit` is v == t as 0 or 1.
template <bool kCap, typename T, typename Exp>
C10_HOST_DEVICE inline T lce_grad(T z, T hit, const LceGradRow<T>& r, T inv_cap,
                                  Exp exp_fn) {
  T d = exp_fn(z - r.lse) * r.a - r.b - hit * r.c;
  if constexpr (kCap) {
    const T q = z * inv_cap;
    d *= T(1) - q * q;
  }
  return d;
}

// Calls f(std::bool_constant<has_cap>{}).
template <typename F>
decltype(auto) dispatch_lce_cap(bool has_cap, const F& f) {
  if (has_cap) {
    return f(std::true_type{});
  }
  return f(std::false_type{});
}

// --- argument checks -----------------------------------------------------------------

struct LceShape {
  int64_t n, h, v;
};

// The checks every op of the family makes on (input, weight, target, bias):
// input (..., H) flattening to N rows, weight (V, H), target int64 with N
// elements, bias (V) or none, all on `device`, input/weight/bias of one
// floating dtype.
inline LceShape check_lce_operands(const char* op, const at::Tensor& input,
                                   const at::Tensor& weight, const at::Tensor& target,
                                   const std::optional<at::Tensor>& bias,
                                   c10::DeviceType device) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_devices(op, device, {{input, "input"}, {weight, "weight"}, {target, "target"},
                               {*bias, "bias"}});
  } else {
    check_devices(op, device, {{input, "input"}, {weight, "weight"}, {target, "target"}});
  }
  check_floating(op, {input, "input"});
  check_same_dtype(op, {input, "input"}, {weight, "weight"});
  TORCH_CHECK(input.dim() >= 1, "torchops.", op,
              ": expected 'input' to have at least 1 dimension (..., H), but got a 0-dim "
              "tensor");
  TORCH_CHECK(weight.dim() == 2, "torchops.", op,
              ": expected 'weight' to be 2-D (V, H), but got shape ", weight.sizes());
  const int64_t h = input.size(-1);
  TORCH_CHECK(weight.size(1) == h, "torchops.", op, ": expected 'weight' to have ", h,
              " columns like the last dimension of 'input' (shape ", input.sizes(),
              "), but got shape ", weight.sizes());
  const int64_t v = weight.size(0);
  TORCH_CHECK(v > 0, "torchops.", op, ": expected 'weight' to have at least one row "
              "(class), but got shape ", weight.sizes());
  const int64_t rows = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));
  TORCH_CHECK(target.scalar_type() == at::kLong, "torchops.", op,
              ": expected 'target' to be int64 class indices, but got ", target.scalar_type());
  TORCH_CHECK(target.numel() == rows, "torchops.", op, ": expected 'target' to have one "
              "class index per row of 'input' (", rows, " rows of shape ", input.sizes(),
              "), but got shape ", target.sizes());
  if (has_bias) {
    check_same_dtype(op, {input, "input"}, {*bias, "bias"});
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == v, "torchops.", op,
                ": expected 'bias' to have shape (", v, "), but got ", bias->sizes());
  }
  return {rows, h, v};
}

inline LceParams check_lce_options(const char* op, int64_t ignore_index,
                                   double label_smoothing, c10::string_view reduction,
                                   double lse_square_scale, std::optional<double> softcap) {
  LceParams p;
  p.ignore_index = ignore_index;
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "torchops.", op,
              ": expected 'label_smoothing' to be in [0, 1], but got ", label_smoothing);
  p.smoothing = label_smoothing;
  p.want_sum = label_smoothing != 0.0;
  TORCH_CHECK(std::isfinite(lse_square_scale) && lse_square_scale >= 0.0, "torchops.", op,
              ": expected 'lse_square_scale' to be a finite number >= 0, but got ",
              lse_square_scale);
  p.z_scale = lse_square_scale;
  if (softcap.has_value()) {
    TORCH_CHECK(std::isfinite(*softcap) && *softcap > 0.0, "torchops.", op,
                ": expected 'softcap' to be None or a finite number > 0, but got ", *softcap);
    p.has_cap = true;
    p.cap = *softcap;
  }
  p.red = parse_reduction(op, reduction);
  return p;
}

// The vocabulary slice a weight shard holds: classes [start, start + V) of
// `total`.
inline void check_lce_vocab(const char* op, int64_t start, int64_t total, int64_t v) {
  TORCH_CHECK(start >= 0 && total >= v && start <= total - v, "torchops.", op,
              ": expected the weight's ", v, " rows to be classes [vocab_start, vocab_start "
              "+ ", v, ") of vocab_size, but got vocab_start ", start, " and vocab_size ",
              total);
}

// float64 for float64 inputs, else float32: the type of the loss, the row
// statistics and every per-row quantity.
inline at::ScalarType lce_acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace torchops
