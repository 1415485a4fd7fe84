// CPU kernels of torchops.fused_linear_cross_entropy: the passes over one
// chunk of logits (the host steps and the GEMMs are
// common/fused_linear_cross_entropy_steps.h).
//
// Rows run in parallel.  Each pass loads a row once into a buffer of capped
// logits z (float, float64 for float64), then runs vectorising loops over
// it: its max, sum of exp(z - max) and sum of z (stats), or its gradient,
// stored over the logits (grad).  A row of 128k classes is 512 KB of floats,
// which stays in L2 between the loops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/fused_linear_cross_entropy_steps.h"
#include "cpu/common/parallel.h"
#include "cpu/common/row_math.h"
#include "cpu/common/vec_math.h"

namespace torchops::cpu {
namespace {

// exp for the row loops: vec_math's for float (vectorises), libm's for double.
struct RowExp {
  float operator()(float x) const { return vm::exp_vec(x); }
  double operator()(double x) const { return std::exp(x); }
};

// z[j] = cap(y[j] + b[j]) over a row.
template <bool kCap, typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION void load_z(const T* __restrict__ y, const T* __restrict__ b,
                                      acc_t* __restrict__ z, int64_t n, acc_t cap,
                                      acc_t inv_cap) {
  if (b == nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      z[j] = lce_capped<kCap>(to_acc<acc_t>(y[j]), cap, inv_cap, RowExp{});
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      z[j] = lce_capped<kCap>(to_acc<acc_t>(y[j]) + to_acc<acc_t>(b[j]), cap, inv_cap,
                              RowExp{});
    }
  }
}

// sum of exp(z[j] - m), in kLanes independent accumulators.
template <typename acc_t>
TORCHOPS_CPU_MULTIVERSION acc_t sum_exp(const acc_t* __restrict__ z, int64_t n, acc_t m) {
  acc_t acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      acc[k] += RowExp{}(z[j + k] - m);
    }
  }
  for (; j < n; ++j) {
    acc[0] += RowExp{}(z[j] - m);
  }
  return lanes_total(acc);
}

template <typename acc_t>
TORCHOPS_CPU_MULTIVERSION acc_t row_sum(const acc_t* __restrict__ z, int64_t n) {
  acc_t acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      acc[k] += z[j + k];
    }
  }
  for (; j < n; ++j) {
    acc[0] += z[j];
  }
  return lanes_total(acc);
}

// y[j] = the gradient at z[j], the target's term left out (it is added to
// its one element afterwards, from z in full precision).
template <bool kCap, typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION void store_grad(const acc_t* __restrict__ z, T* __restrict__ y,
                                          int64_t n, LceGradRow<acc_t> r, acc_t inv_cap) {
  for (int64_t j = 0; j < n; ++j) {
    y[j] = from_acc<T>(lce_grad<kCap>(z[j], acc_t(0), r, inv_cap, RowExp{}));
  }
}

// The column of row `target` in this chunk's slice of the vocabulary, or -1.
inline int64_t local_column(int64_t target, const LceParams& p, int64_t cols) {
  const int64_t c = target - p.vocab_start;
  return target != p.ignore_index && c >= 0 && c < cols ? c : -1;
}

inline bool out_of_range(int64_t target, const LceParams& p) {
  return target != p.ignore_index && (target < 0 || target >= p.vocab_total);
}

// Calls f(row, z) for each row of the chunk, in parallel, with z a buffer of
// the row's capped logits.
template <typename scalar_t, typename F>
void for_each_row(const LceChunk<scalar_t>& c, const F& f) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t cap = static_cast<acc_t>(c.p.cap);
  const acc_t inv_cap = c.p.has_cap ? acc_t(1) / cap : acc_t(0);
  at::parallel_for(0, c.rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> buf(static_cast<size_t>(c.cols));
    for (int64_t r = r0; r < r1; ++r) {
      dispatch_lce_cap(c.p.has_cap, [&](auto has_cap) {
        load_z<decltype(has_cap)::value>(c.logits + r * c.ld, c.bias, buf.data(), c.cols, cap,
                                         inv_cap);
      });
      f(r, buf.data());
    }
  });
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*input*/) { return {}; }

  static uint64_t free_bytes(const at::Tensor& /*input*/) {
    return std::numeric_limits<uint64_t>::max();
  }

  static void check_targets(const at::Tensor& t, const LceParams& p) {
    const int64_t* tp = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      TORCH_CHECK(!out_of_range(tp[i], p),
                  "torchops.fused_linear_cross_entropy: expected every 'target' to be a "
                  "class in [0, ", p.vocab_total, ") or ignore_index (", p.ignore_index,
                  "), but target[", i, "] is ", tp[i]);
    }
  }

  static void scale(const at::Tensor& t, const at::Tensor& s) {
    if (s.item<double>() != 1.0) {
      t.mul_(s);
    }
  }

  template <typename scalar_t>
  static void stats(const LceChunk<scalar_t>& c, at::opmath_type<scalar_t>* out) {
    using acc_t = at::opmath_type<scalar_t>;
    const bool want_sum = c.p.want_sum;
    for_each_row(c, [&](int64_t r, const acc_t* z) {
      const acc_t m = row_max(z, c.cols);
      // All -inf, +inf or NaN: the lse is that (torch.logsumexp's -inf, inf,
      // nan); exp(z - m) would be nan.
      const acc_t lse = std::isfinite(m) ? m + std::log(sum_exp(z, c.cols, m)) : m;
      const int64_t t = c.target[r];
      const int64_t col = local_column(t, c.p, c.cols);
      acc_t* o = out + r * kLceStats;
      o[kLceLse] = lse;
      o[kLceTarget] = out_of_range(t, c.p) ? std::numeric_limits<acc_t>::quiet_NaN()
                      : col >= 0          ? z[col]
                                          : acc_t(0);
      o[kLceSum] = want_sum ? row_sum(z, c.cols) : acc_t(0);
    });
  }

  template <typename scalar_t>
  static void grad(const LceChunk<scalar_t>& c, const at::opmath_type<scalar_t>* lse,
                   int64_t lse_stride, const at::opmath_type<scalar_t>* scale) {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t inv_cap = c.p.has_cap ? acc_t(1) / static_cast<acc_t>(c.p.cap) : acc_t(0);
    for_each_row(c, [&](int64_t r, const acc_t* z) {
      scalar_t* y = c.logits + r * c.ld;
      // (check_targets has raised for a target no class has; NaN kept for
      // the same rule as CUDA's.)
      const acc_t s = out_of_range(c.target[r], c.p) ? std::numeric_limits<acc_t>::quiet_NaN()
                                                     : scale[r];
      if (s == acc_t(0)) {  // an ignored row (or a zero upstream gradient)
        std::fill(y, y + c.cols, scalar_t(0));
        return;
      }
      const LceGradRow<acc_t> row = lce_grad_row<acc_t>(
          lse[r * lse_stride], s, static_cast<acc_t>(c.p.smoothing),
          static_cast<acc_t>(c.p.z_scale), static_cast<acc_t>(c.p.vocab_total));
      const int64_t col = local_column(c.target[r], c.p, c.cols);
      dispatch_lce_cap(c.p.has_cap, [&](auto has_cap) {
        constexpr bool kCap = decltype(has_cap)::value;
        store_grad<kCap>(z, y, c.cols, row, inv_cap);
        if (col >= 0) {
          y[col] = from_acc<scalar_t>(lce_grad<kCap>(z[col], acc_t(1), row, inv_cap, RowExp{}));
        }
      });
    });
  }
};

}  // namespace

TORCHOPS_REGISTER_LCE(CPU, CpuKernels)

}  // namespace torchops::cpu
