// CPU kernels of the norm ops (common/norms_steps.h has the host steps).
//
// Rows are split into at most kMaxBlocks blocks, a number fixed by the sizes
// alone, and the blocks run on at::parallel_for's threads.  Each row is
// converted to the accumulation type in a per-thread buffer (half types
// through at::vec's conversions), its statistics are summed with
// at::vec::Vectorized lanes, and the output is converted back.  The weight
// and bias gradients are summed per block, then over the blocks in order:
// the same bits at any thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/norms_steps.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>;

constexpr int64_t kMaxBlocks = 256;
// Bounds the partial sums of the parameter gradients (kMaxBlocks x D).
constexpr int64_t kMaxPartialElements = int64_t{1} << 22;

// The row blocks: a function of the sizes only, never of the thread count.
inline int64_t num_blocks(int64_t rows, int64_t cols) {
  const int64_t by_memory = std::max<int64_t>(1, kMaxPartialElements / std::max<int64_t>(cols, 1));
  return std::max<int64_t>(1, std::min({rows, kMaxBlocks, by_memory}));
}

// dst[0, n) = src converted to acc_t.
template <typename scalar_t, typename acc_t>
void to_acc(const scalar_t* src, acc_t* dst, int64_t n) {
  if constexpr (kReduced<scalar_t>) {
    using V = at::vec::Vectorized<scalar_t>;
    using F = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + V::size() <= n; i += V::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(V::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + F::size());
    }
    for (; i < n; ++i) {
      dst[i] = static_cast<acc_t>(src[i]);
    }
  } else {
    std::copy(src, src + n, dst);
  }
}

// dst[0, n) = src rounded to scalar_t.
template <typename scalar_t, typename acc_t>
void from_acc(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (kReduced<scalar_t>) {
    using V = at::vec::Vectorized<scalar_t>;
    using F = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + V::size() <= n; i += V::size()) {
      at::vec::convert_from_float<scalar_t>(F::loadu(src + i), F::loadu(src + i + F::size()))
          .store(dst + i);
    }
    for (; i < n; ++i) {
      dst[i] = static_cast<scalar_t>(src[i]);
    }
  } else {
    std::copy(src, src + n, dst);
  }
}

// sum of a[i] * b[i] (b null: of a[i]) in Vectorized lanes, then the lanes in order.
template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using V = at::vec::Vectorized<acc_t>;
  V acc0(acc_t(0)), acc1(acc_t(0));
  int64_t i = 0;
  for (; i + 2 * V::size() <= n; i += 2 * V::size()) {
    const V a0 = V::loadu(a + i), a1 = V::loadu(a + i + V::size());
    if (b != nullptr) {
      acc0 = at::vec::fmadd(a0, V::loadu(b + i), acc0);
      acc1 = at::vec::fmadd(a1, V::loadu(b + i + V::size()), acc1);
    } else {
      acc0 = acc0 + a0;
      acc1 = acc1 + a1;
    }
  }
  acc0 = acc0 + acc1;
  acc_t lanes[V::size()];
  acc0.store(lanes);
  acc_t total = 0;
  for (int k = 0; k < V::size(); ++k) {
    total += lanes[k];
  }
  for (; i < n; ++i) {
    total += b != nullptr ? a[i] * b[i] : a[i];
  }
  return total;
}

// The weights in acc_t (empty when absent).
template <typename weight_t, typename acc_t>
std::vector<acc_t> params_in_acc(const weight_t* p, int64_t n) {
  std::vector<acc_t> out;
  if (p != nullptr) {
    out.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<acc_t>(p[i]);
    }
  }
  return out;
}

// Runs body(row, buffers) over the rows of each block, blocks in parallel;
// `buffers` is a per-block scratch of `scratch_rows` rows of D acc_t values.
template <typename acc_t, typename Body>
void for_blocks(int64_t rows, int64_t cols, int64_t blocks, int scratch_rows, Body&& body) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<acc_t> scratch(static_cast<size_t>(scratch_rows) * cols);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = rows * blk / blocks;
      const int64_t r1 = rows * (blk + 1) / blocks;
      body(blk, r0, r1, scratch.data());
    }
  });
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*t*/) { return {}; }

  template <NormKind kind, typename scalar_t, typename weight_t, typename acc_t>
  static void forward(const NormForwardArgs<scalar_t, weight_t, acc_t>& a) {
    const int64_t D = a.cols;
    const std::vector<acc_t> w = params_in_acc<weight_t, acc_t>(a.weight, D);
    const std::vector<acc_t> bias = params_in_acc<weight_t, acc_t>(a.bias, D);
    const int64_t blocks = num_blocks(a.rows, D);
    for_blocks<acc_t>(a.rows, D, blocks, 2, [&](int64_t, int64_t r0, int64_t r1, acc_t* buf) {
      acc_t* xs = buf;
      acc_t* tmp = buf + D;
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t off = row * D;
        to_acc(a.x + off, xs, D);
        if (a.residual != nullptr) {
          to_acc(a.residual + off, tmp, D);
          for (int64_t i = 0; i < D; ++i) {
            xs[i] += tmp[i];
          }
          // The sum is rounded to the input dtype, and normalised as rounded.
          from_acc(xs, a.sum + off, D);
          to_acc(a.sum + off, xs, D);
        }
        acc_t mean = 0;
        acc_t var;
        if constexpr (kind == NormKind::kLayerNorm) {
          mean = dot<acc_t>(xs, nullptr, D) / static_cast<acc_t>(D);
          for (int64_t i = 0; i < D; ++i) {
            tmp[i] = xs[i] - mean;
          }
          var = dot<acc_t>(tmp, tmp, D) / static_cast<acc_t>(D);
        } else {
          var = dot<acc_t>(xs, xs, D) / static_cast<acc_t>(D);
        }
        const acc_t rstd = acc_t(1) / std::sqrt(var + a.eps);
        if (a.mean != nullptr) a.mean[row] = mean;
        if (a.rstd != nullptr) a.rstd[row] = rstd;
        const acc_t* wp = w.empty() ? nullptr : w.data();
        const acc_t* bp = bias.empty() ? nullptr : bias.data();
        for (int64_t i = 0; i < D; ++i) {
          acc_t v = (xs[i] - mean) * rstd;
          if (wp != nullptr) v *= wp[i];
          if (bp != nullptr) v += bp[i];
          tmp[i] = v;
        }
        from_acc(tmp, a.y + off, D);
      }
    });
  }

  template <NormKind kind, typename scalar_t, typename weight_t, typename acc_t>
  static void backward(const NormBackwardArgs<scalar_t, weight_t, acc_t>& a) {
    const int64_t D = a.cols;
    const std::vector<acc_t> w = params_in_acc<weight_t, acc_t>(a.weight, D);
    const int64_t blocks = num_blocks(a.rows, D);
    const bool params = a.dweight != nullptr || a.dbias != nullptr;
    // Per-block partial sums of the parameter gradients: [blocks, D] each.
    std::vector<acc_t> part_w(a.dweight != nullptr ? blocks * D : 0, acc_t(0));
    std::vector<acc_t> part_b(a.dbias != nullptr ? blocks * D : 0, acc_t(0));
    const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
    for_blocks<acc_t>(a.rows, D, blocks, 3, [&](int64_t blk, int64_t r0, int64_t r1,
                                                acc_t* buf) {
      acc_t* xhat = buf;
      acc_t* g = buf + D;
      acc_t* gw = buf + 2 * D;
      acc_t* pw = part_w.empty() ? nullptr : part_w.data() + blk * D;
      acc_t* pb = part_b.empty() ? nullptr : part_b.data() + blk * D;
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t off = row * D;
        const acc_t mean = a.mean != nullptr ? a.mean[row] : acc_t(0);
        const acc_t rstd = a.rstd[row];
        to_acc(a.x + off, xhat, D);
        to_acc(a.grad + off, g, D);
        for (int64_t i = 0; i < D; ++i) {
          xhat[i] = (xhat[i] - mean) * rstd;
        }
        if (pw != nullptr) {
          for (int64_t i = 0; i < D; ++i) pw[i] += g[i] * xhat[i];
        }
        if (pb != nullptr) {
          for (int64_t i = 0; i < D; ++i) pb[i] += g[i];
        }
        if (a.dx == nullptr) {
          continue;
        }
        const acc_t* gwp = g;
        if (!w.empty()) {
          for (int64_t i = 0; i < D; ++i) gw[i] = g[i] * w[i];
          gwp = gw;
        }
        const acc_t c1 = dot<acc_t>(gwp, xhat, D) * inv_d;
        const acc_t c2 = kind == NormKind::kLayerNorm ? dot<acc_t>(gwp, nullptr, D) * inv_d
                                                      : acc_t(0);
        for (int64_t i = 0; i < D; ++i) {
          g[i] = rstd * (gwp[i] - c2 - xhat[i] * c1);
        }
        from_acc(g, a.dx + off, D);
      }
    });
    if (!params) {
      return;
    }
    // The blocks' partial sums, in block order, column ranges in parallel.
    parallel_range(D, [&](int64_t c0, int64_t c1) {
      for (int64_t i = c0; i < c1; ++i) {
        acc_t sw = 0, sb = 0;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          if (a.dweight != nullptr) sw += part_w[blk * D + i];
          if (a.dbias != nullptr) sb += part_b[blk * D + i];
        }
        if (a.dweight != nullptr) a.dweight[i] = sw;
        if (a.dbias != nullptr) a.dbias[i] = sb;
      }
    }, 4096);
  }
};

}  // namespace

TORCHOPS_REGISTER_NORMS(CPU, CpuKernels)

}  // namespace torchops::cpu
