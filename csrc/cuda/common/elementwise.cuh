// A grid-stride element-wise loop over contiguous buffers, for ops whose
// kernel is one value in, one value out.
#pragma once

#include "cuda/common/launch.cuh"

namespace torchops::cuda {

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
  elementwise_kernel<<<grid_for(n, kThreads), kThreads, 0, current_stream()>>>(
      n, f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace torchops::cuda
