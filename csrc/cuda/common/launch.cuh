// Launch helpers shared by the CUDA kernels.
//
// Every kernel launch in torchops goes through a device guard (so cuda:1
// inputs run on cuda:1), uses the caller's current stream (so CUDA graphs and
// user streams see the work) and is followed by C10_CUDA_KERNEL_LAUNCH_CHECK.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

namespace torchops::cuda {

inline cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Blocks for a grid-stride loop over n items: enough to fill the device,
// never more than the grid's x limit.
inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(n, threads));
  return static_cast<unsigned int>(std::min<int64_t>(blocks, 65535LL * 32));
}

// The SMs of the device `t` is on, for grids sized to fill it.
inline int sm_count(const at::Tensor& t) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, t.get_device()));
  return std::max(sms, 1);
}

// Blocks of `threads` threads of `kernel` resident on one SM of the current
// device (at least 1).  The occupancy query costs microseconds of host time,
// which a small launch notices, so each answer is kept.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, size_t shared_bytes = 0) {
  using Key = std::tuple<const void*, int, size_t, int>;
  static std::mutex mutex;
  static std::map<Key, int> known;
  const Key key{reinterpret_cast<const void*>(kernel), threads, shared_bytes,
                static_cast<int>(c10::cuda::current_device())};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) {
    return it->second;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads,
                                                               shared_bytes));
  blocks = std::max(blocks, 1);
  known.emplace(key, blocks);
  return blocks;
}

// The most dynamic shared memory a launch of `kernel` may ask for on the
// current device (its opt-in limit less its static shared memory), after
// opting the kernel in to it.  Kept per kernel and device, as
// resident_blocks keeps its answers.
template <typename Kernel>
size_t dynamic_shared_limit(Kernel kernel) {
  using Key = std::tuple<const void*, int>;
  static std::mutex mutex;
  static std::map<Key, size_t> known;
  const int device = static_cast<int>(c10::cuda::current_device());
  const Key key{reinterpret_cast<const void*>(kernel), device};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) {
    return it->second;
  }
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attrs{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kernel));
  const size_t limit = optin > static_cast<int>(attrs.sharedSizeBytes)
                           ? static_cast<size_t>(optin) - attrs.sharedSizeBytes
                           : 0;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(limit)));
  known.emplace(key, limit);
  return limit;
}

inline bool fits_int32(int64_t n) {
  return n <= std::numeric_limits<int32_t>::max();
}

// Calls f(index_t{}) with int32_t when a grid-stride loop over `total`
// items with `blocks` x `threads` threads cannot overflow it, else int64_t:
// index arithmetic (division above all) is several times faster in 32 bits.
template <typename F>
void with_index_type(int64_t total, unsigned int blocks, int threads, F&& f) {
  if (fits_int32(total + int64_t(blocks) * threads)) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

// Calls f(int32_t{}) when `narrow` (the caller has checked that its index
// math fits), else f(int64_t{}).
template <typename F>
void with_index_type_if(bool narrow, F&& f) {
  if (narrow) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

// The first index of a grid-stride loop and its stride, in index_t.
template <typename index_t>
__device__ __forceinline__ index_t grid_start() {
  return static_cast<index_t>(blockIdx.x) * static_cast<index_t>(blockDim.x) +
         static_cast<index_t>(threadIdx.x);
}

template <typename index_t>
__device__ __forceinline__ index_t grid_stride() {
  return static_cast<index_t>(gridDim.x) * static_cast<index_t>(blockDim.x);
}

}  // namespace torchops::cuda
