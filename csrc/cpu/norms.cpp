// CPU kernels of the norm ops (common/norms_steps.h has the host steps).
//
// Rows are split into at most kMaxBlocks blocks, a number fixed by the sizes
// alone, and the blocks run on at::parallel_for's threads.  Each row is
// brought to the accumulation type in a per-thread buffer (float32 rows are
// read in place) and normalised there; a half forward rounds each output as
// its affine loop writes it (and the residual sum as it adds it), so its
// row makes no extra float pass.  The loops over a row
// are compiled for AVX2 and for the baseline (TORCHOPS_CPU_MULTIVERSION) and
// written so the compiler vectorises them: sums keep kLanes independent
// partial sums, added in a fixed order at the end; bfloat16 converts by bit
// shifts (rounding to nearest even), float16 through _Float16 (F16C).  The
// weight and bias gradients are summed per block, then over the blocks in
// order (each block's row added whole, so the sum vectorises): the same
// bits at any thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/norms_steps.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kMaxBlocks = 256;
// Bounds the partial sums of the parameter gradients (blocks x D).
constexpr int64_t kMaxPartialElements = int64_t{1} << 22;
// Independent partial sums of a row reduction (two AVX2 registers).
constexpr int kLanes = 16;

// The row blocks: a function of the sizes only, never of the thread count.
inline int64_t num_blocks(int64_t rows, int64_t cols) {
  const int64_t by_memory = std::max<int64_t>(1, kMaxPartialElements / std::max<int64_t>(cols, 1));
  return std::max<int64_t>(1, std::min({rows, kMaxBlocks, by_memory}));
}

// --- row loops, float ------------------------------------------------------------------

TORCHOPS_CPU_MULTIVERSION void bf16_to_float(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &u, sizeof(float));
  }
}

TORCHOPS_CPU_MULTIVERSION void float_to_bf16(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + i, sizeof(float));
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}

TORCHOPS_CPU_MULTIVERSION void half_to_float(const _Float16* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    d[i] = static_cast<float>(s[i]);
  }
}

TORCHOPS_CPU_MULTIVERSION void float_to_half(const float* s, _Float16* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    d[i] = static_cast<_Float16>(s[i]);
  }
}

// The kLanes partial sums of a row reduction, added in order.
template <typename T>
inline T lane_total(const T (&acc)[kLanes]) {
  T total = 0;
  for (int j = 0; j < kLanes; ++j) {
    total += acc[j];
  }
  return total;
}

TORCHOPS_CPU_MULTIVERSION float row_sum(const float* a, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j];
  }
  for (; i < n; ++i) acc[i % kLanes] += a[i];
  return lane_total(acc);
}

TORCHOPS_CPU_MULTIVERSION float row_sq_sum(const float* a, float shift, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float d = a[i + j] - shift;
      acc[j] += d * d;
    }
  }
  for (; i < n; ++i) {
    const float d = a[i] - shift;
    acc[i % kLanes] += d * d;
  }
  return lane_total(acc);
}

// y = (x - mean) * rstd [* w] [+ b]
TORCHOPS_CPU_MULTIVERSION void row_affine(const float* __restrict__ x, float mean, float rstd,
                                          const float* __restrict__ w,
                                          const float* __restrict__ b, float* __restrict__ y,
                                          int64_t n) {
  if (w != nullptr && b != nullptr) {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
  } else if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i];
  } else if (b != nullptr) {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd + b[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd;
  }
}

TORCHOPS_CPU_MULTIVERSION void row_add(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

// The backward's first pass over a row, in one loop: xhat = (x - mean) *
// rstd and gw = g * w (kept for the second), pw += g * xhat, pb += g (when
// the bias gradient is wanted: kBias), and the sums of gw * xhat and gw
// (kLanes partial sums each).  Absent weights are ones and an unwanted
// weight gradient a scratch row, so the loop has no branch.
template <bool kBias>
inline __attribute__((always_inline)) void row_backward_sums_impl(
    const float* __restrict__ x, const float* __restrict__ g, const float* __restrict__ w,
    float mean, float rstd, float* __restrict__ xhat, float* __restrict__ gw,
    float* __restrict__ pw, float* __restrict__ pb, int64_t n, float* s1, float* s2) {
  float a1[kLanes] = {};
  float a2[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float xh = (x[i + j] - mean) * rstd;
      const float gwv = g[i + j] * w[i + j];
      xhat[i + j] = xh;
      gw[i + j] = gwv;
      pw[i + j] += g[i + j] * xh;
      if constexpr (kBias) pb[i + j] += g[i + j];
      a1[j] += gwv * xh;
      a2[j] += gwv;
    }
  }
  for (; i < n; ++i) {
    const float xh = (x[i] - mean) * rstd;
    const float gwv = g[i] * w[i];
    xhat[i] = xh;
    gw[i] = gwv;
    pw[i] += g[i] * xh;
    if constexpr (kBias) pb[i] += g[i];
    a1[i % kLanes] += gwv * xh;
    a2[i % kLanes] += gwv;
  }
  *s1 = lane_total(a1);
  *s2 = lane_total(a2);
}

TORCHOPS_CPU_MULTIVERSION void row_backward_sums(
    const float* __restrict__ x, const float* __restrict__ g, const float* __restrict__ w,
    float mean, float rstd, float* __restrict__ xhat, float* __restrict__ gw,
    float* __restrict__ pw, float* __restrict__ pb, int64_t n, float* s1, float* s2) {
  if (pb != nullptr) {
    row_backward_sums_impl<true>(x, g, w, mean, rstd, xhat, gw, pw, pb, n, s1, s2);
  } else {
    row_backward_sums_impl<false>(x, g, w, mean, rstd, xhat, gw, pw, pb, n, s1, s2);
  }
}

// dx = rstd * (gw - c2 - xhat * c1); dx is a buffer of its own.
TORCHOPS_CPU_MULTIVERSION void row_dx(const float* __restrict__ gw,
                                      const float* __restrict__ xhat, float rstd, float c1,
                                      float c2, float* __restrict__ dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = rstd * (gw[i] - c2 - xhat[i] * c1);
}

// out[i] = sum over blocks of part[blk * D + i], for i in [c0, c1), in block
// order (so the bits do not depend on how the columns are split).
TORCHOPS_CPU_MULTIVERSION void add_row(const float* __restrict__ src, float* __restrict__ dst,
                                       int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void add_row(const double* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

template <typename acc_t>
void sum_block_rows(const acc_t* part, int64_t blocks, int64_t D, int64_t c0, int64_t c1,
                    acc_t* out) {
  std::fill(out + c0, out + c1, acc_t(0));
  for (int64_t blk = 0; blk < blocks; ++blk) {
    add_row(part + blk * D + c0, out + c0, c1 - c0);
  }
}

// --- half rows: fused conversions ----------------------------------------------------------
//
// A bfloat16 (stored as uint16_t) or float16 (_Float16) row is brought to
// float once (the reductions above then run on floats), and the loops that
// produce half values round them as they go instead of through another
// float buffer: the same arithmetic in the same order (the same bits) with
// two passes over the row fewer.

inline float half_value(const uint16_t* s, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_value(const _Float16* s, int64_t i) { return static_cast<float>(s[i]); }

// f rounded to the half type (bfloat16: to nearest even, NaN kept, as
// float_to_bf16), and back to float.
inline float store_half(float f, uint16_t* d, int64_t i) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t h = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (rounded & 0xffffu);
  d[i] = static_cast<uint16_t>(h);
  const uint32_t back = h << 16;
  float r;
  std::memcpy(&r, &back, sizeof r);
  return r;
}

inline float store_half(float f, _Float16* d, int64_t i) {
  const _Float16 h = static_cast<_Float16>(f);
  d[i] = h;
  return static_cast<float>(h);
}

// y = (x - mean) * rstd [* w] [+ b] rounded to the half type (row_affine,
// then the rounding).
template <typename H>
TORCHOPS_CPU_MULTIVERSION void half_row_affine(const float* __restrict__ x, float mean,
                                               float rstd, const float* __restrict__ w,
                                               const float* __restrict__ b, H* __restrict__ y,
                                               int64_t n) {
  if (w != nullptr && b != nullptr) {
    for (int64_t i = 0; i < n; ++i) store_half((x[i] - mean) * rstd * w[i] + b[i], y, i);
  } else if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) store_half((x[i] - mean) * rstd * w[i], y, i);
  } else if (b != nullptr) {
    for (int64_t i = 0; i < n; ++i) store_half((x[i] - mean) * rstd + b[i], y, i);
  } else {
    for (int64_t i = 0; i < n; ++i) store_half((x[i] - mean) * rstd, y, i);
  }
}

// sum = x + r rounded to the half type, and sumf = that sum as float.
template <typename H>
TORCHOPS_CPU_MULTIVERSION void half_row_add(const H* __restrict__ x, const H* __restrict__ r,
                                            H* __restrict__ sum, float* __restrict__ sumf,
                                            int64_t n) {
  for (int64_t i = 0; i < n; ++i) sumf[i] = store_half(half_value(x, i) + half_value(r, i), sum, i);
}

// The storage type of the half loops: uint16_t for bfloat16, _Float16 for
// float16.
template <typename scalar_t>
using half_bits_t = std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, uint16_t, _Float16>;

// --- the same, double (float64 inputs: exactness over speed) ------------------------------

double row_sum(const double* a, int64_t n) {
  double acc[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % kLanes] += a[i];
  return lane_total(acc);
}

double row_sq_sum(const double* a, double shift, int64_t n) {
  double acc[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % kLanes] += (a[i] - shift) * (a[i] - shift);
  return lane_total(acc);
}

void row_affine(const double* x, double mean, double rstd, const double* w, const double* b,
                double* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    double v = (x[i] - mean) * rstd;
    if (w != nullptr) v *= w[i];
    if (b != nullptr) v += b[i];
    y[i] = v;
  }
}

void row_add(const double* a, const double* b, double* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void row_backward_sums(const double* x, const double* g, const double* w, double mean,
                       double rstd, double* xhat, double* gw, double* pw, double* pb, int64_t n,
                       double* s1, double* s2) {
  double a1[kLanes] = {};
  double a2[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    xhat[i] = (x[i] - mean) * rstd;
    gw[i] = g[i] * w[i];
    pw[i] += g[i] * xhat[i];
    if (pb != nullptr) pb[i] += g[i];
    a1[i % kLanes] += gw[i] * xhat[i];
    a2[i % kLanes] += gw[i];
  }
  *s1 = lane_total(a1);
  *s2 = lane_total(a2);
}

void row_dx(const double* gw, const double* xhat, double rstd, double c1, double c2, double* dx,
            int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = rstd * (gw[i] - c2 - xhat[i] * c1);
}

// --- conversions ------------------------------------------------------------------------

// A row as acc_t: float32/float64 rows in place, half rows converted into `buf`.
template <typename scalar_t, typename acc_t>
const acc_t* as_acc(const scalar_t* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    bf16_to_float(reinterpret_cast<const uint16_t*>(src), buf, n);
    return buf;
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    half_to_float(reinterpret_cast<const _Float16*>(src), buf, n);
    return buf;
  } else {
    static_assert(std::is_same_v<scalar_t, acc_t>);
    return src;
  }
}

// dst = src rounded to scalar_t.
template <typename scalar_t, typename acc_t>
void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    float_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    float_to_half(src, reinterpret_cast<_Float16*>(dst), n);
  } else {
    std::copy(src, src + n, dst);
  }
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

// Runs body(block, first row, end row, scratch) for each block, blocks in
// parallel; scratch is `scratch_rows` rows of D acc_t values per thread.
template <typename acc_t, typename Body>
void for_blocks(int64_t rows, int64_t cols, int64_t blocks, int scratch_rows, Body&& body) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<acc_t> scratch(static_cast<size_t>(scratch_rows) * cols);
    for (int64_t blk = b0; blk < b1; ++blk) {
      body(blk, rows * blk / blocks, rows * (blk + 1) / blocks, scratch.data());
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
    const acc_t* wp = w.empty() ? nullptr : w.data();
    const acc_t* bp = bias.empty() ? nullptr : bias.data();
    const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
    for_blocks<acc_t>(a.rows, D, num_blocks(a.rows, D), 3,
                      [&](int64_t, int64_t r0, int64_t r1, acc_t* buf) {
      acc_t* xbuf = buf;
      acc_t* rbuf = buf + D;
      acc_t* ybuf = buf + 2 * D;
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t off = row * D;
        if constexpr (std::is_same_v<scalar_t, at::BFloat16> ||
                      std::is_same_v<scalar_t, at::Half>) {
          using H = half_bits_t<scalar_t>;
          const float* xs = xbuf;
          if (a.residual != nullptr) {
            // The sum is rounded to the input dtype, and normalised as rounded.
            half_row_add(reinterpret_cast<const H*>(a.x + off),
                         reinterpret_cast<const H*>(a.residual + off),
                         reinterpret_cast<H*>(a.sum + off), xbuf, D);
          } else {
            xs = as_acc(a.x + off, xbuf, D);
          }
          float mean = 0;
          if constexpr (kind == NormKind::kLayerNorm) {
            mean = row_sum(xs, D) * inv_d;
          }
          const float var = row_sq_sum(xs, mean, D) * inv_d;
          const float rstd = 1.0f / std::sqrt(var + a.eps);
          if (a.mean != nullptr) a.mean[row] = mean;
          if (a.rstd != nullptr) a.rstd[row] = rstd;
          half_row_affine(xs, mean, rstd, wp, bp, reinterpret_cast<H*>(a.y + off), D);
          continue;
        }
        const acc_t* xs = as_acc(a.x + off, xbuf, D);
        if (a.residual != nullptr) {
          row_add(xs, as_acc(a.residual + off, rbuf, D), xbuf, D);
          // The sum is rounded to the input dtype, and normalised as rounded.
          store_row(xbuf, a.sum + off, D);
          xs = as_acc(a.sum + off, xbuf, D);
        }
        acc_t mean = 0;
        if constexpr (kind == NormKind::kLayerNorm) {
          mean = row_sum(xs, D) * inv_d;
        }
        const acc_t var = row_sq_sum(xs, mean, D) * inv_d;
        const acc_t rstd = acc_t(1) / std::sqrt(var + a.eps);
        if (a.mean != nullptr) a.mean[row] = mean;
        if (a.rstd != nullptr) a.rstd[row] = rstd;
        if constexpr (std::is_same_v<scalar_t, acc_t>) {
          row_affine(xs, mean, rstd, wp, bp, a.y + off, D);
        } else {
          row_affine(xs, mean, rstd, wp, bp, ybuf, D);
          store_row(ybuf, a.y + off, D);
        }
      }
    });
  }

  template <NormKind kind, typename scalar_t, typename weight_t, typename acc_t>
  static void backward(const NormBackwardArgs<scalar_t, weight_t, acc_t>& a) {
    const int64_t D = a.cols;
    std::vector<acc_t> w = params_in_acc<weight_t, acc_t>(a.weight, D);
    if (w.empty()) {
      w.assign(D, acc_t(1));
    }
    const int64_t blocks = num_blocks(a.rows, D);
    // Per-block partial sums of the parameter gradients: [blocks, D] each.
    std::vector<acc_t> part_w(a.dweight != nullptr ? blocks * D : 0, acc_t(0));
    std::vector<acc_t> part_b(a.dbias != nullptr ? blocks * D : 0, acc_t(0));
    const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
    for_blocks<acc_t>(a.rows, D, blocks, 5, [&](int64_t blk, int64_t r0, int64_t r1,
                                                acc_t* buf) {
      acc_t* xbuf = buf;
      acc_t* gbuf = buf + D;
      acc_t* xhat = buf + 2 * D;
      acc_t* gw = buf + 3 * D;
      // An unwanted weight gradient accumulates into scratch; an unwanted
      // bias gradient (always, for rms_norm) is skipped.
      acc_t* pw = part_w.empty() ? buf + 4 * D : part_w.data() + blk * D;
      acc_t* pb = part_b.empty() ? nullptr : part_b.data() + blk * D;
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t off = row * D;
        const acc_t mean = a.mean != nullptr ? a.mean[row] : acc_t(0);
        const acc_t rstd = a.rstd[row];
        acc_t s1, s2;
        row_backward_sums(as_acc(a.x + off, xbuf, D), as_acc(a.grad + off, gbuf, D), w.data(),
                          mean, rstd, xhat, gw, pw, pb, D, &s1, &s2);
        if (a.dx == nullptr) {
          continue;
        }
        const acc_t c1 = s1 * inv_d;
        const acc_t c2 = kind == NormKind::kLayerNorm ? s2 * inv_d : acc_t(0);
        if constexpr (std::is_same_v<scalar_t, acc_t>) {
          row_dx(gw, xhat, rstd, c1, c2, a.dx + off, D);
        } else {
          row_dx(gw, xhat, rstd, c1, c2, xbuf, D);
          store_row(xbuf, a.dx + off, D);
        }
      }
    });
    if (a.dweight == nullptr && a.dbias == nullptr) {
      return;
    }
    // The blocks' partial sums, in block order, column ranges in parallel.
    // Each block's row is added whole (a vector loop over contiguous
    // columns): walking one column down the blocks would stride by D, which
    // keeps the sum scalar and maps every block onto the same L1 set.
    parallel_range(D, [&](int64_t c0, int64_t c1) {
      if (a.dweight != nullptr) sum_block_rows(part_w.data(), blocks, D, c0, c1, a.dweight);
      if (a.dbias != nullptr) sum_block_rows(part_b.data(), blocks, D, c0, c1, a.dbias);
    }, 4096);
  }
};

}  // namespace

TORCHOPS_REGISTER_NORMS(CPU, CpuKernels)

}  // namespace torchops::cpu
