// CPU kernel of torchops.matmul: a cache-blocked GEMM, parallel over output
// tiles.
//
// Inputs are first made contiguous in the accumulation type (float for
// float/half/bfloat16, double for double), so one micro-kernel per
// accumulation type serves every input dtype and stride pattern; the output
// is rounded to the input dtype once, at the end.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "common/matmul.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Tile sizes: an (kRows x kCols) block of C stays in L1/L2 while a
// (kDepth x kCols) panel of B streams through it.
constexpr int64_t kRows = 64;
constexpr int64_t kCols = 256;
constexpr int64_t kDepth = 256;

// C[i0:i1, j0:j1] += A[i0:i1, :] @ B[:, j0:j1]  (row-major, leading dims k, n)
//
// Four rows of C are updated per pass over a row of B, so each loaded B
// vector is used four times; the j loop is unit-stride and vectorises.
template <typename T>
inline __attribute__((always_inline)) void gemm_tile(
    const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
    int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t k, int64_t n) {
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t k1 = std::min(k, k0 + kDepth);
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4) {
      T* __restrict__ c0 = c + i * n;
      T* __restrict__ c1 = c0 + n;
      T* __restrict__ c2 = c1 + n;
      T* __restrict__ c3 = c2 + n;
      for (int64_t p = k0; p < k1; ++p) {
        const T a0 = a[i * k + p];
        const T a1 = a[(i + 1) * k + p];
        const T a2 = a[(i + 2) * k + p];
        const T a3 = a[(i + 3) * k + p];
        const T* __restrict__ brow = b + p * n;
        for (int64_t j = j0; j < j1; ++j) {
          const T bv = brow[j];
          c0[j] += a0 * bv;
          c1[j] += a1 * bv;
          c2[j] += a2 * bv;
          c3[j] += a3 * bv;
        }
      }
    }
    for (; i < i1; ++i) {
      T* __restrict__ crow = c + i * n;
      for (int64_t p = k0; p < k1; ++p) {
        const T av = a[i * k + p];
        const T* __restrict__ brow = b + p * n;
        for (int64_t j = j0; j < j1; ++j) {
          crow[j] += av * brow[j];
        }
      }
    }
  }
}

TORCHOPS_CPU_MULTIVERSION void gemm_tile_f32(
    const float* a, const float* b, float* c, int64_t i0, int64_t i1,
    int64_t j0, int64_t j1, int64_t k, int64_t n) {
  gemm_tile(a, b, c, i0, i1, j0, j1, k, n);
}

TORCHOPS_CPU_MULTIVERSION void gemm_tile_f64(
    const double* a, const double* b, double* c, int64_t i0, int64_t i1,
    int64_t j0, int64_t j1, int64_t k, int64_t n) {
  gemm_tile(a, b, c, i0, i1, j0, j1, k, n);
}

inline void gemm_tile_acc(const float* a, const float* b, float* c, int64_t i0,
                          int64_t i1, int64_t j0, int64_t j1, int64_t k,
                          int64_t n) {
  gemm_tile_f32(a, b, c, i0, i1, j0, j1, k, n);
}

inline void gemm_tile_acc(const double* a, const double* b, double* c,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                          int64_t k, int64_t n) {
  gemm_tile_f64(a, b, c, i0, i1, j0, j1, k, n);
}

template <typename acc_t>
void batched_gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& c,
                  const MatmulShape& s) {
  const acc_t* ap = a.const_data_ptr<acc_t>();
  const acc_t* bp = b.const_data_ptr<acc_t>();
  acc_t* cp = c.mutable_data_ptr<acc_t>();
  const int64_t row_tiles = (s.m + kRows - 1) / kRows;
  const int64_t col_tiles = (s.n + kCols - 1) / kCols;
  const int64_t tiles = s.batch * row_tiles * col_tiles;
  // One task per output tile: tiles never overlap, so no synchronisation.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bi = t / (row_tiles * col_tiles);
      const int64_t rem = t % (row_tiles * col_tiles);
      const int64_t i0 = (rem / col_tiles) * kRows;
      const int64_t j0 = (rem % col_tiles) * kCols;
      gemm_tile_acc(ap + bi * s.m * s.k, bp + bi * s.k * s.n,
                    cp + bi * s.m * s.n, i0, std::min(s.m, i0 + kRows), j0,
                    std::min(s.n, j0 + kCols), s.k, s.n);
    }
  });
}

at::Tensor matmul(const at::Tensor& a_in, const at::Tensor& b_in) {
  const MatmulShape s = check_matmul(a_in, b_in, c10::DeviceType::CPU);
  const at::ScalarType dtype = a_in.scalar_type();
  const at::ScalarType acc =
      dtype == at::kDouble ? at::kDouble : at::kFloat;
  // Zero-initialised: the micro-kernel accumulates, and K == 0 must give 0.
  at::Tensor c = new_output("matmul", s.out_sizes(), a_in.options().dtype(acc),
                            /*zero=*/true);
  if (c.numel() == 0 || s.k == 0) {
    return c.to(dtype);
  }
  const at::Tensor a = a_in.to(acc).contiguous();
  const at::Tensor b = b_in.to(acc).contiguous();
  if (acc == at::kDouble) {
    batched_gemm<double>(a, b, c, s);
  } else {
    batched_gemm<float>(a, b, c, s);
  }
  return c.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("matmul", &matmul);
}

}  // namespace torchops::cpu
