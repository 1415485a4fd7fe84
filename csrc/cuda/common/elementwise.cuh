// Element-wise loops over contiguous buffers.
//
// launch_elementwise: f(i) for every index, for kernels that compute their
// own addresses.
//
// launch_map: out[i] = f(in_0[i], ..., in_k[i]).
// Each thread moves 16 bytes per input per step (one vector instruction)
// when every pointer is 16-byte aligned, and falls back to one element per
// step otherwise (a view with an odd storage offset).  The function is
// called on scalar_t values, one element at a time, so kernels written as
// plain per-element math get vectorised memory traffic for free.
#pragma once

#include <array>

#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {

template <int P, int K, typename scalar_t, typename F>
__global__ void map_kernel(int64_t n, scalar_t* __restrict__ out,
                           std::array<const scalar_t*, K> ins, F f) {
  using PackT = Pack<scalar_t, P>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = n / P;
  for (int64_t p = first; p < packs; p += stride) {
    PackT in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      in[k] = reinterpret_cast<const PackT*>(ins[k])[p];
    }
    PackT o;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      scalar_t v[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        v[k] = in[k].v[j];
      }
      o.v[j] = f(v);
    }
    reinterpret_cast<PackT*>(out)[p] = o;
  }
  // The last n % P elements, one per thread.
  for (int64_t i = packs * P + first; i < n; i += stride) {
    scalar_t v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = ins[k][i];
    }
    out[i] = f(v);
  }
}

// out[i] = f(v) for i in [0, n), where v[k] = ins[k][i] (a scalar_t[K]),
// on the current stream.  The caller holds the device guard.
template <typename scalar_t, size_t K, typename F>
void launch_map(int64_t n, scalar_t* out, std::array<const scalar_t*, K> ins, F f) {
  if (n == 0) {
    return;
  }
  constexpr int kThreads = 256;
  constexpr int P = pack_size<scalar_t>();
  bool aligned = aligned_for_packs({out});
  for (const scalar_t* p : ins) {
    aligned = aligned && aligned_for_packs({p});
  }
  if (aligned) {
    map_kernel<P, static_cast<int>(K)>
        <<<grid_for(ceil_div(n, P), kThreads), kThreads, 0, current_stream()>>>(n, out, ins, f);
  } else {
    map_kernel<1, static_cast<int>(K)>
        <<<grid_for(n, kThreads), kThreads, 0, current_stream()>>>(n, out, ins, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F>
__global__ void elementwise_kernel(int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    f(i);
  }
}

// Calls f(i) for every i in [0, n) on the current stream.  The caller holds
// the device guard.
template <typename F>
void launch_elementwise(int64_t n, F f) {
  if (n == 0) {
    return;
  }
  constexpr int kThreads = 256;
  elementwise_kernel<<<grid_for(n, kThreads), kThreads, 0, current_stream()>>>(n, f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace torchops::cuda
