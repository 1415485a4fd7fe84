// What the matmul paths that split K share (sm90, decode, simt): the SM
// count their split rules read, the conversion of an accumulator to the
// output type, and the second kernel that adds the splits' partials.
//
// A split-K launch stores each split's partial, laid out like C, at
// ws + split * total; sum_splits then adds them in split order 0..S-1 from
// zero, so the result's bits do not depend on how the blocks were scheduled.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace torchops::cuda::gemm {

// At most this many splits: the workspace holds splits x C in float
// (double for double).
constexpr int64_t kMaxSplits = 16;

// SMs of the current device; 1 where the runtime cannot say (the split and
// tile rules divide by it; a failing runtime then fails the launch itself).
inline int device_sms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 1;
  return sms > 0 ? sms : 1;
}

// Accumulator (float, or double for double) -> element of C, rounded to nearest.
template <typename T, typename Acc>
__device__ __forceinline__ T to_out(Acc x);
template <> __device__ __forceinline__ float to_out<float, float>(float x) { return x; }
template <> __device__ __forceinline__ double to_out<double, double>(double x) { return x; }
template <> __device__ __forceinline__ __half to_out<__half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16, float>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(256) sum_splits(const Acc* __restrict__ ws, T* __restrict__ c,
                                                  int splits, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    Acc s = 0;
    for (int j = 0; j < splits; ++j) s += ws[j * total + i];
    c[i] = to_out<T, Acc>(s);
  }
}

// C (total elements of T) = the sum of `splits` partials at ws.
template <typename T, typename Acc>
inline cudaError_t launch_sum_splits(const Acc* ws, void* c, int splits, int64_t total,
                                     cudaStream_t stream) {
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = (total + 255) / 256;
  sum_splits<T, Acc><<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(
      ws, static_cast<T*>(c), splits, total);
  return cudaGetLastError();
}

}  // namespace torchops::cuda::gemm
