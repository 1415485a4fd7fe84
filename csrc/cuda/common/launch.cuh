// Launch helpers shared by the CUDA kernels.
//
// Every kernel launch in torchops goes through a device guard (so cuda:1
// inputs run on cuda:1), uses the caller's current stream (so CUDA graphs and
// user streams see the work) and is followed by C10_CUDA_KERNEL_LAUNCH_CHECK.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

namespace torchops::cuda {

inline cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Blocks for a grid-stride loop over n items: enough to fill the device,
// never more than the grid's x limit.
inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(n, threads));
  return static_cast<unsigned int>(std::min<int64_t>(blocks, 65535LL * 32));
}

}  // namespace torchops::cuda
