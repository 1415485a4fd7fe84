// CUDA kernels of torchops.scaled_masked_softmax,
// torchops.scaled_upper_triang_masked_softmax and their backward ops.
//
// Two kernels each way:
//  * warp per row, for rows of up to 32 * kMaxPackElements keys whose
//    operands allow 16-byte packs (Sk a multiple of the pack, aligned
//    pointers): the row lives in registers, so each element is read once and
//    written once; a causal row loads only the packs up to its diagonal and
//    stores zero packs beyond it;
//  * chunked, a warp per row of any length whose operands allow 16-byte
//    packs: the block kernel's two passes (an online max and sum, then the
//    write; the backward: a dot product, then the write) over packs, a few
//    in flight per lane; the second pass re-reads the row from L1/L2.  Few
//    registers per row, so many rows are in flight;
//  * block per row, for every other row (any length, any alignment): an
//    online max and sum in one pass over the row, then a second pass that
//    writes it (the backward: a dot product, then the write).
// TORCHOPS_TESTING_SOFTMAX_PATH forces one of them (a forced warp or chunked
// kernel that cannot run the call falls back to the block kernel).
// Both compute in at::opmath_type (float32 for half types, float64 for
// float64) and reduce in a fixed order, so results are deterministic.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "common/env.h"
#include "common/masked_softmax_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kWarpKernelThreads = 128;  // 4 rows per block
constexpr int kRowsPerBlock = kWarpKernelThreads / 32;
constexpr int kMaxBlockThreads = 512;
// Register budget of the warp kernel: keys per lane, as packs of 16 bytes.
constexpr int kMaxPackElements = 64;
constexpr int kChunkThreads = 256;  // 8 rows per block
constexpr int kChunkRowsPerBlock = kChunkThreads / 32;
// Packs per lane in flight in each pass of the chunked kernels.
constexpr int kChunkUnroll = 2;
// Register cap of the chunked kernels: 65536 / (256 * 4) = 64 per thread,
// a full SM of warps.
constexpr int kChunkMinBlocks = 3;

// What TORCHOPS_TESTING_SOFTMAX_PATH=auto runs for rows that both the warp
// and the chunked kernels can run: the chunked kernels for float16 and
// bfloat16 / for float32 when true, else the warp kernel.
constexpr bool kAutoChunkedHalf = false;
constexpr bool kAutoChunkedFloat = false;

template <typename acc_t>
__device__ __forceinline__ acc_t neg_inf() {
  return -std::numeric_limits<acc_t>::infinity();
}

// exp of a difference with the row's max, so its argument is <= 0: the
// fast float exp is accurate to a few ulp there, and -inf gives 0.
__device__ __forceinline__ float row_exp(float v) { return __expf(v); }
__device__ __forceinline__ double row_exp(double v) { return ::exp(v); }

__device__ __forceinline__ bool is_negative_zero(float v) {
  return __float_as_uint(v) == 0x80000000u;
}
__device__ __forceinline__ bool is_negative_zero(double v) {
  return static_cast<unsigned long long>(__double_as_longlong(v)) == 0x8000000000000000ULL;
}

// max(a, b) that keeps a NaN of either argument.
template <typename acc_t>
__device__ __forceinline__ acc_t max_nan(acc_t a, acc_t b) {
  return (a > b || a != a) ? a : b;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_all_max(acc_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// The butterfly gives every lane the same bits (a + b == b + a).
template <typename acc_t>
__device__ __forceinline__ acc_t warp_all_sum(acc_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// ---------------------------------------------------------------------------
// Warp per row.  Lane l holds packs k * 32 + l (k < KV) of VEC elements.

template <typename T, int VEC, int KV>
__global__ void __launch_bounds__(kWarpKernelThreads)
    softmax_forward_warp(const T* __restrict__ x, const bool* __restrict__ mask,
                         T* __restrict__ y, const SoftmaxRows s,
                         const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  using M = Pack<bool, VEC>;
  const int lane = threadIdx.x % 32;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t row = first; row < s.rows; row += stride) {
    const int64_t len = softmax_row_length(s, row);
    const T* xr = x + row * s.sk;
    const bool* mr = mask != nullptr ? mask + softmax_mask_offset(s, row) : nullptr;
    T* yr = y + row * s.sk;
    acc_t v[KV][VEC];
    acc_t m = neg_inf<acc_t>();
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * 32 + lane) * VEC;
      if (base < len) {
        // base + VEC <= Sk: Sk is a multiple of VEC.
        const P p = *reinterpret_cast<const P*>(xr + base);
        M mp{};
        if (mr != nullptr) {
          mp = *reinterpret_cast<const M*>(mr + base);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const bool off = base + e >= len || mp.v[e];
          v[k][e] = off ? neg_inf<acc_t>() : static_cast<acc_t>(p.v[e]) * scale;
          m = max_nan(v[k][e], m);
        }
      }
    }
    m = warp_all_max(m);
    // m == -inf: every key masked, and the row is zeros.
    const bool any = m != neg_inf<acc_t>();
    acc_t sum = 0;
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * 32 + lane) * VEC;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        // Masked keys (-inf, or past a causal row's diagonal) become -0.0,
        // which exp never gives: the store writes them as exactly 0, also
        // in a row that a NaN or +inf makes NaN.
        if (any && base < len && v[k][e] != neg_inf<acc_t>()) {
          v[k][e] = row_exp(v[k][e] - m);
          sum += v[k][e];
        } else {
          v[k][e] = -acc_t(0);
        }
      }
    }
    sum = warp_all_sum(sum);
    const acc_t inv = any ? acc_t(1) / sum : acc_t(0);
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * 32 + lane) * VEC;
      if (base < s.sk) {
        P out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          out.v[e] = static_cast<T>(is_negative_zero(v[k][e]) ? acc_t(0) : v[k][e] * inv);
        }
        *reinterpret_cast<P*>(yr + base) = out;
      }
    }
  }
}

template <typename T, int VEC, int KV>
__global__ void __launch_bounds__(kWarpKernelThreads)
    softmax_backward_warp(const T* __restrict__ dy, const T* __restrict__ y,
                          T* __restrict__ dx, const SoftmaxRows s,
                          const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  const int lane = threadIdx.x % 32;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t row = first; row < s.rows; row += stride) {
    const int64_t len = softmax_row_length(s, row);
    const int64_t off = row * s.sk;
    // Kept as loaded (half types: half the registers of float).
    P yv[KV];
    P gv[KV];
    acc_t dot = 0;
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * 32 + lane) * VEC;
      if (base < len) {
        yv[k] = *reinterpret_cast<const P*>(y + off + base);
        gv[k] = *reinterpret_cast<const P*>(dy + off + base);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          if (base + e < len) {
            dot += static_cast<acc_t>(yv[k].v[e]) * static_cast<acc_t>(gv[k].v[e]);
          }
        }
      }
    }
    dot = warp_all_sum(dot);
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * 32 + lane) * VEC;
      if (base < s.sk) {
        P out;
        if (base < len) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const acc_t yy = static_cast<acc_t>(yv[k].v[e]);
            const acc_t g = static_cast<acc_t>(gv[k].v[e]);
            out.v[e] = base + e < len ? static_cast<T>(scale * yy * (g - dot)) : T(0);
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            out.v[e] = T(0);
          }
        }
        *reinterpret_cast<P*>(dx + off + base) = out;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Block per row, any length.

// (m, sum) absorbs the score v: sum is the sum of exp(score - m) so far.
template <typename acc_t>
__device__ __forceinline__ void online_add(acc_t& m, acc_t& sum, acc_t v) {
  if (v == neg_inf<acc_t>()) {
    return;  // exp(-inf) adds nothing
  }
  if (v != v || v == -neg_inf<acc_t>()) {
    // A NaN or +inf score makes the row NaN, as in torch.softmax.
    m = v;
    sum = std::numeric_limits<acc_t>::quiet_NaN();
    return;
  }
  if (v > m) {
    sum = sum * row_exp(m - v) + acc_t(1);
    m = v;
  } else {
    // Also after a NaN m: the sum stays NaN.
    sum += row_exp(v - m);
  }
}

template <typename acc_t>
__device__ __forceinline__ void online_merge(acc_t& m, acc_t& sum, acc_t m2, acc_t sum2) {
  if (m2 == neg_inf<acc_t>()) {
    return;
  }
  if (m == neg_inf<acc_t>()) {
    m = m2;
    sum = sum2;
    return;
  }
  const acc_t mx = max_nan(m, m2);
  sum = sum * row_exp(m - mx) + sum2 * row_exp(m2 - mx);
  m = mx;
}

// Every lane of the warp gets the merged (m, sum), in the same order.
template <typename acc_t>
__device__ __forceinline__ void warp_online(acc_t& m, acc_t& sum) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    online_merge(m, sum, __shfl_xor_sync(0xffffffffu, m, offset),
                 __shfl_xor_sync(0xffffffffu, sum, offset));
  }
}

// Every thread of the block gets the merged (m, sum), in the same order.
template <typename acc_t>
__device__ __forceinline__ void block_online(acc_t& m, acc_t& sum, acc_t* sh_m, acc_t* sh_s) {
  warp_online(m, sum);
  const int warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    sh_m[threadIdx.x / 32] = m;
    sh_s[threadIdx.x / 32] = sum;
  }
  __syncthreads();
  m = sh_m[0];
  sum = sh_s[0];
  for (int w = 1; w < warps; ++w) {
    online_merge(m, sum, sh_m[w], sh_s[w]);
  }
  __syncthreads();  // the shared slots are free again
}

template <typename acc_t>
__device__ __forceinline__ acc_t block_all_sum(acc_t v, acc_t* sh) {
  v = warp_all_sum(v);
  const int warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    sh[threadIdx.x / 32] = v;
  }
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < warps; ++w) {
    v += sh[w];
  }
  __syncthreads();
  return v;
}

template <typename T>
__global__ void softmax_forward_block(const T* __restrict__ x, const bool* __restrict__ mask,
                                      T* __restrict__ y, const SoftmaxRows s,
                                      const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t sh_m[32];
  __shared__ acc_t sh_s[32];
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const int64_t len = softmax_row_length(s, row);
    const T* xr = x + row * s.sk;
    const bool* mr = mask != nullptr ? mask + softmax_mask_offset(s, row) : nullptr;
    T* yr = y + row * s.sk;
    acc_t m = neg_inf<acc_t>();
    acc_t sum = 0;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      if (mr == nullptr || !mr[j]) {
        online_add(m, sum, static_cast<acc_t>(xr[j]) * scale);
      }
    }
    block_online(m, sum, sh_m, sh_s);
    const bool any = m != neg_inf<acc_t>();
    const acc_t inv = any ? acc_t(1) / sum : acc_t(0);
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) {
      acc_t out = 0;
      if (any && j < len && (mr == nullptr || !mr[j])) {
        const acc_t v = static_cast<acc_t>(xr[j]) * scale;
        out = v == neg_inf<acc_t>() ? acc_t(0) : row_exp(v - m) * inv;
      }
      yr[j] = static_cast<T>(out);
    }
  }
}

template <typename T>
__global__ void softmax_backward_block(const T* __restrict__ dy, const T* __restrict__ y,
                                       T* __restrict__ dx, const SoftmaxRows s,
                                       const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t sh[32];
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const int64_t len = softmax_row_length(s, row);
    const int64_t off = row * s.sk;
    acc_t dot = 0;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      dot += static_cast<acc_t>(y[off + j]) * static_cast<acc_t>(dy[off + j]);
    }
    dot = block_all_sum(dot, sh);
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) {
      acc_t out = 0;
      if (j < len) {
        out = scale * static_cast<acc_t>(y[off + j]) *
            (static_cast<acc_t>(dy[off + j]) - dot);
      }
      dx[off + j] = static_cast<T>(out);
    }
  }
}

// ---------------------------------------------------------------------------
// Chunked: a warp per row, any length, the row in 16-byte packs.  Lane l
// takes packs l, l + 32, ...; kChunkUnroll of them are loaded before any is
// used.  Needs Sk a multiple of VEC and aligned operands.

// A 16-byte pack through the read-only (non-coherent) path: the operands
// are never written by the kernel.
template <typename P>
__device__ __forceinline__ P load_pack(const P* p) {
  static_assert(sizeof(P) == 16, "16-byte packs only");
  union {
    uint4 u;
    P p;
  } t;
  t.u = __ldg(reinterpret_cast<const uint4*>(p));
  return t.p;
}

// A streaming (evict-first) store: the output is not read again, and the
// rows still to be re-read keep the cache.
template <typename P>
__device__ __forceinline__ void store_pack(P* p, const P& v) {
  static_assert(sizeof(P) == 16, "16-byte packs only");
  union {
    uint4 u;
    P p;
  } t;
  t.p = v;
  __stcs(reinterpret_cast<uint4*>(p), t.u);
}

// (m, sum) absorbs the scores v[0..N) (-inf for masked keys): one exp per
// key, and one more when the pack raises the max.  The same rule as
// online_add: a NaN or +inf score makes the row NaN.
template <typename acc_t, int N>
__device__ __forceinline__ void online_add_pack(acc_t& m, acc_t& sum, const acc_t (&v)[N]) {
  acc_t pm = v[0];
#pragma unroll
  for (int e = 1; e < N; ++e) {
    pm = max_nan(pm, v[e]);
  }
  if (pm == neg_inf<acc_t>()) {
    return;
  }
  if (!(pm < -neg_inf<acc_t>())) {  // NaN or +inf
    m = pm;
    sum = std::numeric_limits<acc_t>::quiet_NaN();
    return;
  }
  if (pm > m) {  // also from m == -inf (sum 0 stays 0); never after a NaN m
    sum *= row_exp(m - pm);
    m = pm;
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    sum += row_exp(v[e] - m);  // 0 for -inf; NaN after a NaN or +inf m
  }
}

// Row indices are int: the chunked kernels take rows of < 2^30 keys (row
// offsets stay int64).
template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads, kChunkMinBlocks)
    softmax_forward_chunked(const T* __restrict__ x, const bool* __restrict__ mask,
                            T* __restrict__ y, const SoftmaxRows s,
                            const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  using M = Pack<bool, VEC>;
  constexpr int U = kChunkUnroll;
  const int lane = threadIdx.x % 32;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * kChunkRowsPerBlock + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kChunkRowsPerBlock;
  const int packs = static_cast<int>(s.sk / VEC);
  for (int64_t row = first; row < s.rows; row += stride) {
    const int len = static_cast<int>(softmax_row_length(s, row));
    // The packs that hold keys below len; a causal row's later packs are
    // never read, only written with zeros.
    const int live = (len + VEC - 1) / VEC;
    const P* xr = reinterpret_cast<const P*>(x + row * s.sk);
    const M* mr =
        mask != nullptr ? reinterpret_cast<const M*>(mask + softmax_mask_offset(s, row)) : nullptr;
    P* yr = reinterpret_cast<P*>(y + row * s.sk);
    acc_t m = neg_inf<acc_t>();
    acc_t sum = 0;
    // One batch of packs at a time: unrolling this loop would hold more.
#pragma unroll 1
    for (int p0 = lane; p0 < live; p0 += 32 * U) {
      P xp[U];
      M mp[U]{};
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < live) {
          xp[u] = load_pack(xr + p);
          if (mr != nullptr) {
            mp[u] = mr[p];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < live) {
          const int keys = len - p * VEC;  // >= 1; < VEC only in the last live pack
          acc_t v[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            v[e] = e < keys && !mp[u].v[e] ? static_cast<acc_t>(xp[u].v[e]) * scale
                                           : neg_inf<acc_t>();
          }
          online_add_pack(m, sum, v);
        }
      }
    }
    warp_online(m, sum);
    // m == -inf: every key masked, and the row is zeros.
    const bool any = m != neg_inf<acc_t>();
    const acc_t inv = any ? acc_t(1) / sum : acc_t(0);
    const int read = any ? live : 0;
    // One batch of packs at a time: unrolling this loop would hold more.
#pragma unroll 1
    for (int p0 = lane; p0 < packs; p0 += 32 * U) {
      P xp[U];
      M mp[U]{};
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < read) {
          xp[u] = load_pack(xr + p);
          if (mr != nullptr) {
            mp[u] = mr[p];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < packs) {
          const int keys = p < read ? len - p * VEC : 0;
          P out;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            acc_t o = 0;
            if (e < keys && !mp[u].v[e]) {
              const acc_t v = static_cast<acc_t>(xp[u].v[e]) * scale;
              o = v == neg_inf<acc_t>() ? acc_t(0) : row_exp(v - m) * inv;
            }
            out.v[e] = static_cast<T>(o);
          }
          store_pack(yr + p, out);
        }
      }
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads, kChunkMinBlocks)
    softmax_backward_chunked(const T* __restrict__ dy, const T* __restrict__ y,
                             T* __restrict__ dx, const SoftmaxRows s,
                             const at::opmath_type<T> scale) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  constexpr int U = kChunkUnroll;
  const int lane = threadIdx.x % 32;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * kChunkRowsPerBlock + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kChunkRowsPerBlock;
  const int packs = static_cast<int>(s.sk / VEC);
  for (int64_t row = first; row < s.rows; row += stride) {
    const int len = static_cast<int>(softmax_row_length(s, row));
    const int live = (len + VEC - 1) / VEC;
    const P* yr = reinterpret_cast<const P*>(y + row * s.sk);
    const P* gr = reinterpret_cast<const P*>(dy + row * s.sk);
    P* dr = reinterpret_cast<P*>(dx + row * s.sk);
    acc_t dot = 0;
    // One batch of packs at a time: unrolling this loop would hold more.
#pragma unroll 1
    for (int p0 = lane; p0 < live; p0 += 32 * U) {
      P yp[U];
      P gp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < live) {
          yp[u] = load_pack(yr + p);
          gp[u] = load_pack(gr + p);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < live) {
          const int keys = len - p * VEC;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if (e < keys) {
              dot += static_cast<acc_t>(yp[u].v[e]) * static_cast<acc_t>(gp[u].v[e]);
            }
          }
        }
      }
    }
    dot = warp_all_sum(dot);
    // One batch of packs at a time: unrolling this loop would hold more.
#pragma unroll 1
    for (int p0 = lane; p0 < packs; p0 += 32 * U) {
      P yp[U];
      P gp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < live) {
          yp[u] = load_pack(yr + p);
          gp[u] = load_pack(gr + p);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * 32;
        if (p < packs) {
          const int keys = p < live ? len - p * VEC : 0;
          P out;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            acc_t o = 0;
            if (e < keys) {
              o = scale * static_cast<acc_t>(yp[u].v[e]) *
                  (static_cast<acc_t>(gp[u].v[e]) - dot);
            }
            out.v[e] = static_cast<T>(o);
          }
          store_pack(dr + p, out);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Launches.

// Calls f(std::integral_constant<int, KV>{}) with the smallest KV in
// {1, 2, 4, 8, 16} of at least `packs` that fits kMaxPackElements; false
// when none does.
template <int VEC, typename F>
bool with_packs_per_lane(int64_t packs, F&& f) {
  constexpr int kMaxKV = kMaxPackElements / VEC < 16 ? kMaxPackElements / VEC : 16;
  bool done = false;
  auto try_kv = [&](auto kv) {
    constexpr int KV = decltype(kv)::value;
    if constexpr (KV <= kMaxKV) {
      if (!done && packs <= KV) {
        f(kv);
        done = true;
      }
    }
  };
  try_kv(std::integral_constant<int, 1>{});
  try_kv(std::integral_constant<int, 2>{});
  try_kv(std::integral_constant<int, 4>{});
  try_kv(std::integral_constant<int, 8>{});
  try_kv(std::integral_constant<int, 16>{});
  return done;
}

int block_threads(int64_t sk) {
  return static_cast<int>(std::min<int64_t>(kMaxBlockThreads, ceil_div(sk, 32) * 32));
}

unsigned int block_grid(int64_t rows) {
  return static_cast<unsigned int>(std::min<int64_t>(rows, 65535LL * 32));
}

enum class SoftmaxPath { kAuto, kWarp, kChunked, kBlock };

static_assert(env::value_at(env::kTestingSoftmaxPath, 1, "warp") &&
              env::value_at(env::kTestingSoftmaxPath, 2, "chunked") &&
              env::value_at(env::kTestingSoftmaxPath, 3, "block"));

// The kernels a call runs, given whether its operands allow 16-byte packs:
// the testing switch's choice where it can run, else the block kernel.
template <typename scalar_t>
SoftmaxPath softmax_path(const SoftmaxRows& s, bool packs_ok) {
  const char* op = s.causal ? "scaled_upper_triang_masked_softmax" : "scaled_masked_softmax";
  const auto forced = static_cast<SoftmaxPath>(env::choice(op, env::kTestingSoftmaxPath));
  if (!packs_ok || forced == SoftmaxPath::kBlock) {
    return SoftmaxPath::kBlock;
  }
  SoftmaxPath path = forced;  // a warp kernel too short for the row falls back later
  if (path == SoftmaxPath::kAuto) {
    constexpr bool half = std::is_same_v<scalar_t, at::Half> ||
        std::is_same_v<scalar_t, at::BFloat16>;
    constexpr bool chunked = half ? kAutoChunkedHalf
                                  : (std::is_same_v<scalar_t, float> && kAutoChunkedFloat);
    path = chunked ? SoftmaxPath::kChunked : SoftmaxPath::kWarp;
  }
  // The chunked kernels index a row with int (with room for a batch of
  // packs past its end).
  if (path == SoftmaxPath::kChunked && s.sk > std::numeric_limits<int>::max() / 2) {
    return SoftmaxPath::kBlock;
  }
  return path;
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& t) {
    return c10::cuda::CUDAGuard(t.device());
  }

  template <typename scalar_t>
  static void forward(const SoftmaxForward<scalar_t>& c) {
    constexpr int VEC = pack_size<scalar_t>();
    const SoftmaxRows& s = c.shape;
    const cudaStream_t stream = current_stream();
    const bool packs_ok = s.sk % VEC == 0 && aligned_for_packs({c.x, c.y}) &&
        reinterpret_cast<std::uintptr_t>(c.mask) % VEC == 0;
    const SoftmaxPath path = softmax_path<scalar_t>(s, packs_ok);
    if (path == SoftmaxPath::kChunked) {
      softmax_forward_chunked<scalar_t, VEC>
          <<<grid_for(s.rows, kChunkRowsPerBlock), kChunkThreads, 0, stream>>>(
              c.x, c.mask, c.y, s, c.scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const bool warp = path == SoftmaxPath::kWarp &&
        with_packs_per_lane<VEC>(ceil_div(s.sk, 32 * VEC), [&](auto kv) {
          constexpr int KV = decltype(kv)::value;
          softmax_forward_warp<scalar_t, VEC, KV>
              <<<grid_for(s.rows, kRowsPerBlock), kWarpKernelThreads, 0, stream>>>(
                  c.x, c.mask, c.y, s, c.scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    if (!warp) {
      softmax_forward_block<scalar_t><<<block_grid(s.rows), block_threads(s.sk), 0, stream>>>(
          c.x, c.mask, c.y, s, c.scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  template <typename scalar_t>
  static void backward(const SoftmaxBackward<scalar_t>& c) {
    constexpr int VEC = pack_size<scalar_t>();
    const SoftmaxRows& s = c.shape;
    const cudaStream_t stream = current_stream();
    const bool packs_ok = s.sk % VEC == 0 && aligned_for_packs({c.dy, c.y, c.dx});
    const SoftmaxPath path = softmax_path<scalar_t>(s, packs_ok);
    if (path == SoftmaxPath::kChunked) {
      softmax_backward_chunked<scalar_t, VEC>
          <<<grid_for(s.rows, kChunkRowsPerBlock), kChunkThreads, 0, stream>>>(
              c.dy, c.y, c.dx, s, c.scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const bool warp = path == SoftmaxPath::kWarp &&
        with_packs_per_lane<VEC>(ceil_div(s.sk, 32 * VEC), [&](auto kv) {
          constexpr int KV = decltype(kv)::value;
          softmax_backward_warp<scalar_t, VEC, KV>
              <<<grid_for(s.rows, kRowsPerBlock), kWarpKernelThreads, 0, stream>>>(
                  c.dy, c.y, c.dx, s, c.scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    if (!warp) {
      softmax_backward_block<scalar_t><<<block_grid(s.rows), block_threads(s.sk), 0, stream>>>(
          c.dy, c.y, c.dx, s, c.scale);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CUDA, scaled_masked_softmax, CudaKernels)
TORCHOPS_REGISTER_STEPS(CUDA, scaled_upper_triang_masked_softmax, CudaKernels)

}  // namespace torchops::cuda
