// CUDA kernels of torchops.scaled_masked_softmax,
// torchops.scaled_upper_triang_masked_softmax and their backward ops.
//
// Two kernels each way:
//  * warp per row, for rows of up to 32 * kMaxPackElements keys whose
//    operands allow 16-byte packs (Sk a multiple of the pack, aligned
//    pointers): the row lives in registers, so each element is read once and
//    written once; a causal row loads only the packs up to its diagonal and
//    stores zero packs beyond it;
//  * block per row, for every other row (any length, any alignment): an
//    online max and sum in one pass over the row, then a second pass that
//    writes it (the backward: a dot product, then the write).
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

// Every thread of the block gets the merged (m, sum), in the same order.
template <typename acc_t>
__device__ __forceinline__ void block_online(acc_t& m, acc_t& sum, acc_t* sh_m, acc_t* sh_s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    online_merge(m, sum, __shfl_xor_sync(0xffffffffu, m, offset),
                 __shfl_xor_sync(0xffffffffu, sum, offset));
  }
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
    const bool warp = packs_ok &&
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
    const bool warp = packs_ok &&
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
