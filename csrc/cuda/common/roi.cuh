// Helpers shared by the CUDA kernels of the RoI pooling ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

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

// Position of one element of a (K, C, PH, PW) result, in the loop's index
// type (a kernel that keeps it in int32 saves registers and instructions).
template <typename I>
struct RoiBinT {
  I k, c, ph, pw;
  template <typename J>
  __device__ __forceinline__ operator RoiBinT<J>() const {
    return {k, c, ph, pw};
  }
};
using RoiBin = RoiBinT<int64_t>;

// The order in which a grid-stride loop visits the elements of a (K, C, PH,
// PW) result; pw (or c) varies fastest.
enum class RoiOrder {
  // (k, c, ph, pw): memory order of the contiguous result.
  kMemory,
  // (c, k, ph, pw): all RoIs of a channel before the next channel, so the
  // threads in flight share a few input planes, which stay in L2, instead of
  // reading every RoI's region of every channel plane from memory (the
  // reason torchvision's order is bound by memory traffic).  Writes stay
  // contiguous over (ph, pw).
  kChannelsOuter,
  // (k, ph, pw, c): adjacent threads take adjacent channels of one bin, for
  // coalesced reads of a channels_last input.
  kChannelsInner,
};

// Flat loop index -> bin (index_t: see with_index_type in launch.cuh).
template <RoiOrder kOrder, typename index_t>
__device__ __forceinline__ RoiBinT<index_t> roi_bin_of(index_t i, index_t channels,
                                             index_t pooled_height,
                                             index_t pooled_width,
                                             index_t rois) {
  RoiBinT<index_t> b;
  if (kOrder == RoiOrder::kChannelsInner) {
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
    if (kOrder == RoiOrder::kMemory) {
      b.c = i % channels;
      b.k = i / channels;
    } else {
      b.k = i % rois;
      b.c = i / rois;
    }
  }
  return b;
}

// Index of a bin in the contiguous (K, C, PH, PW) result.
template <typename I>
__device__ __forceinline__ I roi_bin_offset(const RoiBinT<I>& b, I channels,
                                            I pooled_height, I pooled_width) {
  return ((b.k * channels + b.c) * pooled_height + b.ph) * pooled_width + b.pw;
}

// Whether every element offset inside one (H, W) plane of `input`, and every
// flat pixel index h * W + w, fits in int32: the kernels then index inside
// a plane in 32 bits.
inline bool plane_fits_int32(const at::Tensor& input) {
  const int64_t h = input.size(2), w = input.size(3);
  const int64_t last = (h - 1) * input.stride(2) + (w - 1) * input.stride(3);
  return fits_int32(h * w) && fits_int32(last + 1);
}

// RoiOrder::kChannelsInner suits inputs whose channels are their densest
// dimension (channels_last).
inline bool channels_inner(const at::Tensor& input) {
  return input.size(1) > 1 && input.stride(1) == 1 && input.stride(3) != 1;
}

}  // namespace torchops::cuda

