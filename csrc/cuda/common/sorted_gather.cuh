// Deterministic scatter-add on the GPU, shared by the backwards whose
// atomicAdd scatter would make results vary from run to run (roi_align,
// deform_roi_pool, deform_conv2d): the scatter is rewritten as a gather.
//
// A kernel of the op lists the scatter's contributions -- a destination key
// and a (source index, weight) entry each -- in a fixed generation order.
// ContributionList::sort sorts the entries by key with cub's radix sort,
// which is stable (contributions to one destination keep their generation
// order) and only looks at the bits a key can use, then finds each key's
// range.  A gather kernel then gives every output element, or group of
// elements sharing a destination, one thread that sums the destination's
// contributions in that order: no atomics, bitwise reproducible.  Memory is
// proportional to the number of contributions (about 24 bytes each with
// 32-bit keys and float weights, 48 with 64-bit keys and double weights,
// sort buffers included), not to the output.
//
// cub directly, in one allocation, rather than at::sort + searchsorted +
// index_select: a few launches instead of about twenty.  Small cases are
// bound by host time, and at::sort's host path alone took longer than the
// GPU's whole work there.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common/launch.cuh"

namespace torchops::cuda {

// One contribution's payload: read `src` of the values, times `weight`.
template <typename T, typename src_t>
struct Contribution {
  src_t src;
  T weight;
};

// Contributions in destination order: those of key d are
// [bounds[d], bounds[d + 1]) of entries.
template <typename T, typename src_t>
struct SortedContributions {
  at::Tensor storage;     // keeps the pointers below alive
  const int64_t* bounds;  // (destinations + 1,)
  const Contribution<T, src_t>* entries;
};

// bounds[d] = the first position whose sorted key is >= d (a lower bound,
// at most log2(n) + 1 steps), a thread per destination: no thread's work
// depends on how the keys are spread (a thread per key, writing the bounds
// of the gap before it, would write a long run of pixels with no
// contributions alone).
template <typename key_t>
__global__ void __launch_bounds__(256) key_bounds_kernel(
    const key_t* __restrict__ keys, int64_t n, int64_t destinations,
    int64_t* __restrict__ bounds) {
  for (int64_t d = grid_start<int64_t>(); d <= destinations; d += grid_stride<int64_t>()) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(keys[mid]) < d) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[d] = lo;
  }
}

// The scratch of one deterministic scatter, in one allocation (each
// at::empty costs host time): the op's kernel writes `count` keys (key_t,
// in [0, destinations]; the key `destinations` marks a contribution that
// goes nowhere and sorts after every real one) and `count` entries through
// key_data() and entry_data(); sort() then orders them.  The sort's
// alternate buffers, its temporary storage and the bounds share the
// allocation.
template <typename T, typename key_t>
class ContributionList {
 public:
  using Entry = Contribution<T, key_t>;
  using ukey_t = std::make_unsigned_t<key_t>;  // keys are >= 0
  static_assert(std::is_same_v<key_t, int32_t> || std::is_same_v<key_t, int64_t>);

  ContributionList(int64_t count, int64_t destinations, const at::TensorOptions& opts)
      : count_(count), destinations_(destinations) {
    // Only the bits a key can use are sorted: 13, two radix passes, for
    // 5000 pixels.
    while (end_bit_ < static_cast<int>(sizeof(key_t) * 8) &&
           (static_cast<uint64_t>(destinations) >> end_bit_) != 0) {
      ++end_bit_;
    }
    if (count > 0) {  // a size query: nothing is read or launched
      cub::DoubleBuffer<ukey_t> keys(nullptr, nullptr);
      cub::DoubleBuffer<Entry> entries(nullptr, nullptr);
      C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes_, keys, entries,
                                                     count, 0, end_bit_, current_stream()));
    }
    const int64_t key_bytes = aligned(count * static_cast<int64_t>(sizeof(key_t)));
    const int64_t entry_bytes = aligned(count * static_cast<int64_t>(sizeof(Entry)));
    offsets_[kKeysAlt] = key_bytes;
    offsets_[kEntries] = 2 * key_bytes;
    offsets_[kEntriesAlt] = offsets_[kEntries] + entry_bytes;
    offsets_[kBounds] = offsets_[kEntriesAlt] + entry_bytes;
    offsets_[kTemp] = offsets_[kBounds] + aligned((destinations + 1) * 8);
    storage_ = at::empty({offsets_[kTemp] + static_cast<int64_t>(temp_bytes_)},
                         opts.dtype(at::kByte));
  }

  key_t* key_data() const { return reinterpret_cast<key_t*>(part(kKeys)); }
  Entry* entry_data() const { return reinterpret_cast<Entry*>(part(kEntries)); }

  // Sorts by key (stable) and finds each destination's range.
  SortedContributions<T, key_t> sort() {
    int64_t* bounds = reinterpret_cast<int64_t*>(part(kBounds));
    const cudaStream_t stream = current_stream();
    if (count_ == 0) {
      C10_CUDA_CHECK(cudaMemsetAsync(bounds, 0, (destinations_ + 1) * 8, stream));
      return {storage_, bounds, entry_data()};
    }
    cub::DoubleBuffer<ukey_t> keys(reinterpret_cast<ukey_t*>(part(kKeys)),
                                   reinterpret_cast<ukey_t*>(part(kKeysAlt)));
    cub::DoubleBuffer<Entry> entries(entry_data(),
                                     reinterpret_cast<Entry*>(part(kEntriesAlt)));
    size_t temp_bytes = temp_bytes_;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(part(kTemp), temp_bytes, keys, entries,
                                                   count_, 0, end_bit_, stream));
    key_bounds_kernel<key_t><<<grid_for(destinations_ + 1, 256), 256, 0, stream>>>(
        reinterpret_cast<const key_t*>(keys.Current()), count_, destinations_, bounds);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {storage_, bounds, entries.Current()};
  }

 private:
  enum Part { kKeys, kKeysAlt, kEntries, kEntriesAlt, kBounds, kTemp, kParts };
  static int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }
  uint8_t* part(Part p) const {
    return static_cast<uint8_t*>(storage_.data_ptr()) + offsets_[p];
  }

  int64_t count_, destinations_;
  int end_bit_ = 1;
  size_t temp_bytes_ = 0;
  int64_t offsets_[kParts] = {};
  at::Tensor storage_;
};

// What one thread gathers: the contributions of destination `key`, for
// `count` <= kGroup output elements that share it (say, kGroup channels of
// one pixel).  Element e reads values[base + entry.src * scale + e * vstride]
// and writes out[out + e * ostride].  A group reads its contribution list
// once for all its elements (kGroup independent loads per entry).
struct GatherGroup {
  int64_t key, base, scale, vstride, out, ostride;
  int count;
};

// Each element of group map(i) = the sum of entry.weight * its value of
// each entry over the contributions of the group's key, in order.
// map: a device functor index_t -> GatherGroup.
template <int kGroup, typename scalar_t, typename T, typename src_t,
          typename index_t, typename Map>
__global__ void __launch_bounds__(256) sorted_gather_kernel(
    const scalar_t* __restrict__ values, const int64_t* __restrict__ bounds,
    const Contribution<T, src_t>* __restrict__ entries, Map map, index_t groups,
    scalar_t* __restrict__ out) {
  for (index_t i = grid_start<index_t>(); i < groups; i += grid_stride<index_t>()) {
    const GatherGroup s = map(i);
    const int64_t j1 = bounds[s.key + 1];
    T acc[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      acc[e] = T(0);
    }
    for (int64_t j = bounds[s.key]; j < j1; ++j) {
      const Contribution<T, src_t> c = entries[j];
      const T w = c.weight;
      const scalar_t* v = values + s.base + static_cast<int64_t>(c.src) * s.scale;
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
void sorted_gather(const scalar_t* values, const SortedContributions<T, src_t>& sorted, Map map,
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
            values, sorted.bounds, sorted.entries, map,
            static_cast<index_t>(groups), out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The gather of an output stored NCHW -- destination d = image * plane +
// pixel, channel c at (image * C + c) * plane + pixel -- from values stored
// as (sources, C) (roi_align's grad, bins by channels).  A block takes 32
// destinations by 32 channels.  A warp sums one destination at a time with
// a lane per channel: one contribution list per warp (broadcast loads, no
// divergence), value reads of 32 contiguous elements.  The tile then goes
// out through shared memory a channel row at a time, so the NCHW writes are
// contiguous too, with no channels-last result to copy afterwards.
constexpr int kPlaneTile = 32;

template <typename scalar_t, typename T, typename src_t>
__global__ void __launch_bounds__(256) sorted_gather_planes_kernel(
    const scalar_t* __restrict__ values, const int64_t* __restrict__ bounds,
    const Contribution<T, src_t>* __restrict__ entries, int64_t channels,
    int64_t plane, int64_t destinations, scalar_t* __restrict__ out) {
  __shared__ T tile[kPlaneTile][kPlaneTile + 1];  // [channel][destination]
  constexpr int kRowsPerPass = 256 / kPlaneTile;
  const int lane = static_cast<int>(threadIdx.x) % kPlaneTile;
  const int row = static_cast<int>(threadIdx.x) / kPlaneTile;
  const int64_t d0 = static_cast<int64_t>(blockIdx.x) * kPlaneTile;
  const int64_t channel_tiles = ceil_div(channels, kPlaneTile);
  for (int64_t ct = blockIdx.y; ct < channel_tiles; ct += gridDim.y) {
    const int64_t c = ct * kPlaneTile + lane;
    for (int r = row; r < kPlaneTile; r += kRowsPerPass) {
      const int64_t d = d0 + r;
      T acc = T(0);
      if (d < destinations && c < channels) {
        const int64_t j1 = bounds[d + 1];
        for (int64_t j = bounds[d]; j < j1; ++j) {
          const Contribution<T, src_t> e = entries[j];
          acc += e.weight *
                 static_cast<T>(values[static_cast<int64_t>(e.src) * channels + c]);
        }
      }
      tile[lane][r] = acc;
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < kPlaneTile * kPlaneTile;
         i += static_cast<int>(blockDim.x)) {
      const int tc = i / kPlaneTile, r = i % kPlaneTile;
      const int64_t d = d0 + r, ch = ct * kPlaneTile + tc;
      if (d < destinations && ch < channels) {
        const int64_t n = d / plane;
        out[(n * channels + ch) * plane + (d - n * plane)] =
            static_cast<scalar_t>(tile[tc][r]);
      }
    }
    __syncthreads();  // the tile is rewritten by the next channel tile
  }
}

template <typename scalar_t, typename T, typename src_t>
void sorted_gather_planes(const scalar_t* values, const SortedContributions<T, src_t>& sorted,
                          int64_t channels, int64_t plane, int64_t destinations,
                          scalar_t* out) {
  if (destinations == 0 || channels == 0) {
    return;
  }
  TORCH_CHECK(fits_int32(ceil_div(destinations, kPlaneTile)),
              "torchops: too many destinations for one gather launch");
  const dim3 grid(static_cast<unsigned int>(ceil_div(destinations, kPlaneTile)),
                  static_cast<unsigned int>(std::min<int64_t>(ceil_div(channels, kPlaneTile),
                                                              65535)));
  sorted_gather_planes_kernel<scalar_t, T, src_t><<<grid, 256, 0, current_stream()>>>(
      values, sorted.bounds, sorted.entries, channels, plane, destinations, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace torchops::cuda
