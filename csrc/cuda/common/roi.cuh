// Helpers shared by the CUDA kernels of the RoI pooling ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "cuda/common/launch.cuh"

namespace torchops::cuda {

// Element strides of a 4-D tensor, so kernels read inputs in place
// (channels_last, sliced, expanded) instead of copying them.
struct Strides4 {
  int64_t n, c, h, w;
};

inline Strides4 strides4(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// Position of one element of a (K, C, PH, PW) result.
struct RoiBin {
  int64_t k, c, ph, pw;
};

// Flat thread index -> bin.  kChannelsInner makes adjacent threads take
// adjacent channels of one bin (coalesced reads of a channels_last input);
// otherwise adjacent threads take adjacent pw (the layout of the result and
// of NCHW inputs).  index_t is int32_t whenever the count fits: 64-bit
// division is several times slower on the GPU.
template <bool kChannelsInner, typename index_t>
__device__ __forceinline__ RoiBin roi_bin_of(index_t i, index_t channels,
                                             index_t pooled_height,
                                             index_t pooled_width) {
  RoiBin b;
  if (kChannelsInner) {
    b.c = i % channels;
    i /= channels;
    b.pw = i % pooled_width;
    i /= pooled_width;
    b.ph = i % pooled_height;
    b.k = i / pooled_height;
  } else {
    b.pw = i % pooled_width;
    i /= pooled_width;
    b.ph = i % pooled_height;
    i /= pooled_height;
    b.c = i % channels;
    b.k = i / channels;
  }
  return b;
}

inline bool fits_int32(int64_t n) {
  return n <= std::numeric_limits<int32_t>::max();
}

// Read channel-inner when the input is channels_last-like: channels are its
// densest dimension.
inline bool channels_inner(const at::Tensor& input) {
  return input.size(1) > 1 && input.stride(1) == 1 && input.stride(3) != 1;
}

}  // namespace torchops::cuda

namespace torchops::cuda {

// Calls f(index_t{}) with int32_t when a grid-stride loop over `total`
// items with `blocks` x `threads` threads cannot overflow it, else int64_t.
template <typename F>
void with_index_type(int64_t total, unsigned int blocks, int threads, F&& f) {
  if (fits_int32(total + int64_t(blocks) * threads)) {
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
