// Deterministic sums within a warp and a block: a fixed tree of shuffles, so
// the same inputs in the same threads always give the same bits (no atomics).
#pragma once

namespace torchops::cuda {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum of v over the block, valid in thread 0.  blockDim.x must be a multiple
// of 32 (at most 1024), every thread of the block must call it, and a kernel
// calling it twice needs a __syncthreads() in between.
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_sums[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) {
    warp_sums[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : T(0);
    v = warp_sum(v);
  }
  return v;
}

}  // namespace torchops::cuda
