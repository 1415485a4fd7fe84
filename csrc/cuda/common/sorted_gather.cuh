// Deterministic scatter-add on the GPU, shared by the backwards whose
// atomicAdd scatter would make results vary from run to run (roi_align,
// deform_conv2d): the scatter is rewritten as a gather.
//
// A kernel of the op lists the scatter's contributions -- (destination key,
// source index, weight) -- in a fixed generation order.  sort_contributions
// sorts them by key with a stable sort, so contributions to one destination
// keep their generation order, and finds each key's range.  Then
// sorted_gather_kernel gives every output element, or group of elements
// sharing a destination, one thread that sums the destination's
// contributions in that order: no atomics, bitwise
// reproducible.  Memory is proportional to the number of contributions
// (about 60 bytes each with int64 keys, sort included), not to the output.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>

#include <cstdint>
#include <tuple>

#include "cuda/common/launch.cuh"

namespace torchops::cuda {

// Contributions in destination order: those of key d are
// [bounds[d], bounds[d + 1]).
struct SortedContributions {
  at::Tensor bounds;  // int64, (destinations + 1,)
  at::Tensor src;
  at::Tensor weight;
};

// keys (int32 or int64) in [0, destinations]; the key `destinations` marks
// a contribution that goes nowhere (it sorts after every real one).
inline SortedContributions sort_contributions(const at::Tensor& keys,
                                              const at::Tensor& src,
                                              const at::Tensor& weight,
                                              int64_t destinations) {
  const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0,
                               /*descending=*/false);
  const at::Tensor& order = std::get<1>(sorted);
  return {at::searchsorted(std::get<0>(sorted),
                           at::arange(destinations + 1, keys.options())),
          src.index_select(0, order), weight.index_select(0, order)};
}

// What one thread gathers: the contributions of destination `key`, for
// `count` <= kGroup output elements that share it (say, kGroup channels of
// one pixel).  Element e reads values[base + src[j] * scale + e * vstride]
// and writes out[out + e * ostride].  A group reads its contribution list
// once for all its elements (kGroup independent loads per entry).
struct GatherGroup {
  int64_t key, base, scale, vstride, out, ostride;
  int count;
};

// Single elements of an output stored as (destinations, C) memory (say,
// grad_input channels-last: destination = pixel) from values stored as
// (sources, C): element i is channel i % C of destination i / C and reads
// values[src * C + c].  Adjacent threads take adjacent channels, so a warp
// shares one destination's contribution list (broadcast loads, no
// divergence) and its value and output accesses are contiguous.
struct ChannelsInnerSites {
  int64_t channels;
  template <typename index_t>
  __device__ __forceinline__ GatherGroup operator()(index_t i) const {
    const index_t c = i % static_cast<index_t>(channels);
    return {static_cast<int64_t>(i / static_cast<index_t>(channels)),
            static_cast<int64_t>(c), channels, 0, static_cast<int64_t>(i), 0, 1};
  }
};

// Each element of group map(i) = the sum of weight[j] * its value of
// contribution j over the contributions of the group's key, in order.
// map: a device functor index_t -> GatherGroup.
template <int kGroup, typename scalar_t, typename T, typename src_t,
          typename index_t, typename Map>
__global__ void __launch_bounds__(256) sorted_gather_kernel(
    const scalar_t* __restrict__ values, const int64_t* __restrict__ bounds,
    const src_t* __restrict__ src, const T* __restrict__ weight, Map map,
    index_t groups, scalar_t* __restrict__ out) {
  for (index_t i = grid_start<index_t>(); i < groups; i += grid_stride<index_t>()) {
    const GatherGroup s = map(i);
    const int64_t j1 = bounds[s.key + 1];
    T acc[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      acc[e] = T(0);
    }
    for (int64_t j = bounds[s.key]; j < j1; ++j) {
      const T w = weight[j];
      const scalar_t* v = values + s.base + static_cast<int64_t>(src[j]) * s.scale;
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        if (e < s.count) {
          acc[e] += w * static_cast<T>(v[e * s.vstride]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      if (e < s.count) {
        out[s.out + e * s.ostride] = static_cast<scalar_t>(acc[e]);
      }
    }
  }
}

// Launches sorted_gather_kernel over `groups` groups of at most kGroup
// elements.
template <int kGroup, typename scalar_t, typename T, typename src_t, typename Map>
void sorted_gather(const scalar_t* values, const SortedContributions& sorted, Map map,
                   int64_t groups, scalar_t* out) {
  if (groups == 0) {
    return;
  }
  constexpr int kThreads = 256;
  const unsigned int blocks = grid_for(groups, kThreads);
  with_index_type(groups, blocks, kThreads, [&](auto index) {
    using index_t = decltype(index);
    sorted_gather_kernel<kGroup, scalar_t, T, src_t, index_t, Map>
        <<<blocks, kThreads, 0, current_stream()>>>(
            values, sorted.bounds.const_data_ptr<int64_t>(),
            sorted.src.const_data_ptr<src_t>(),
            sorted.weight.const_data_ptr<T>(), map,
            static_cast<index_t>(groups), out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torchops::cuda
