// CUDA kernels of torchops.masked_conv2d and its backward: the data-parallel
// steps of common/masked_conv2d_steps.h, and its GEMM (CudaKernels::gemm),
// whose float32 precision is the convolution rule's.
//
// Positions: one pass counts the selected (n, oh, ow) per tile, a second
// ranks them and writes the position list and the index map.  The number
// of positions sizes the columns and the GEMM, so it is read back to the
// host: one sync per call.  The rank kernel writes the count straight into
// mapped pinned memory, so no copy sits in the stream, and the host waits
// on an event for the count alone; meanwhile the device writes the output's
// zeros, and the columns too when the positions are few (gather_cols_ahead:
// into a buffer for an eighth of them, the kernel reading the count on the
// device).  That queued work covers the host's time from the count to the
// GEMM's launch, most of which is cuBLAS's own host path.
// Where tensor cores are used and enough positions are selected, the
// forward hands off to cuDNN instead (kDenseShare).
// Under CUDA graph capture, where a sync is an error, the count is taken to
// be every position of the batch instead (the list is padded with -1, whose
// columns are zero and are never read back): the graph then holds a dense
// convolution's work and stays right for whatever mask it is replayed with.
//
// Columns are written along k (coalesced), each thread keeping one tap so
// that the index math is per row, not per element.  The forward GEMM makes
// (positions, channels), which the output's writer turns around in shared
// memory tiles.
// Gathering the gradient and col2im give each thread one or more channels
// of one position or pixel, sharing its decode and index-map lookups.  No
// kernel adds with atomics: col2im gathers the taps of each input pixel
// through the index map, in a fixed order, so the backward is bitwise
// deterministic with no extra memory.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/masked_conv2d.h"
#include "common/masked_conv2d_steps.h"
#include "cuda/common/conv_precision.cuh"
#include "cuda/common/roi.cuh"
#include "cuda/matmul/api.h"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

// Positions in two passes over tiles of kScanTile positions (kScanItems
// consecutive ones per thread): count_kernel counts each tile's selected
// positions, rank_kernel adds up the tiles before its own, scans within it
// and writes the index map, the position list and (last tile) the total.
// Two launches and no temporary beyond the tile counts: the host's cost
// before the sync is what a sparse call waits on.  Each rank block re-adds
// the counts before it (tiles^2 / 2 loads in all: half a million at a
// million positions, microseconds), which a third launch would trade for
// more host time at every size.
constexpr int kScanThreads = 256;
constexpr int kScanItems = 4;
constexpr int64_t kScanTile = int64_t(kScanThreads) * kScanItems;

// This thread's kScanItems flags (bit u: position first + u is selected).
template <typename mask_t>
__device__ unsigned int tile_flags(const mask_t* __restrict__ mask, int64_t sn, int64_t sh,
                                   int64_t sw, const MaskedConvGeometry& g, int64_t first) {
  const int64_t all = g.all_positions();
  unsigned int bits = 0;
  if (first >= all) {
    return bits;
  }
  MaskedConvPosition<int64_t> q(first, g.out_h, g.out_w);
  for (int u = 0; u < kScanItems && first + u < all; ++u) {
    if (masked_conv_selects(mask[q.n * sn + q.oh * sh + q.ow * sw])) {
      bits |= 1u << u;
    }
    if (++q.ow == g.out_w) {
      q.ow = 0;
      if (++q.oh == g.out_h) {
        q.oh = 0;
        ++q.n;
      }
    }
  }
  return bits;
}

template <typename mask_t>
__global__ void __launch_bounds__(kScanThreads)
    count_kernel(const mask_t* __restrict__ mask, int64_t sn, int64_t sh, int64_t sw,
                 MaskedConvGeometry g, int64_t* __restrict__ tile_counts) {
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t first = blockIdx.x * kScanTile + int64_t(threadIdx.x) * kScanItems;
  const int count = __popc(tile_flags(mask, sn, sh, sw, g, first));
  const int total = Reduce(temp).Sum(count);
  if (threadIdx.x == 0) {
    tile_counts[blockIdx.x] = total;
  }
}

// tile_counts: one per tile, then one slot for the total, which also goes
// to host_total (mapped pinned memory) unless that is null.
template <typename mask_t>
__global__ void __launch_bounds__(kScanThreads)
    rank_kernel(const mask_t* __restrict__ mask, int64_t sn, int64_t sh, int64_t sw,
                MaskedConvGeometry g, int64_t* __restrict__ tile_counts,
                int64_t* __restrict__ index_map, int64_t* __restrict__ positions,
                int64_t* __restrict__ host_total) {
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int64_t tile_offset;
  int64_t before = 0;
  for (int64_t t = threadIdx.x; t < blockIdx.x; t += kScanThreads) {
    before += tile_counts[t];
  }
  before = Reduce(temp.reduce).Sum(before);
  if (threadIdx.x == 0) {
    tile_offset = before;
  }
  __syncthreads();
  const int64_t first = blockIdx.x * kScanTile + int64_t(threadIdx.x) * kScanItems;
  const unsigned int bits = tile_flags(mask, sn, sh, sw, g, first);
  int rank = 0, tile_total = 0;
  Scan(temp.scan).ExclusiveSum(__popc(bits), rank, tile_total);
  const int64_t all = g.all_positions();
  int64_t r = tile_offset + rank;
  for (int u = 0; u < kScanItems && first + u < all; ++u) {
    const bool selected = (bits >> u) & 1u;
    index_map[first + u] = selected ? r : -1;
    if (selected) {
      positions[r++] = first + u;
    }
  }
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
    tile_counts[gridDim.x] = tile_offset + tile_total;
    if (host_total != nullptr) {
      *host_total = tile_offset + tile_total;
    }
  }
}

// Columns (G, P, K), row = group * P + rank.  A block fills rows_per_block
// rows at a time, thread v taking column w = v % per_row of row v / per_row:
// tap w % taps of channels w / taps, w / taps + cstep, ...  A thread's tap,
// and so its decode, stays fixed, and consecutive threads write consecutive
// k (coalesced); the index math happens once per row, not per element
// (an int64 division per element would dominate the kernel).
// Each block walks a contiguous run of rows, so on a dense mask the
// neighbouring positions' overlapping windows come from L1.
constexpr int kGatherUnroll = 4;

struct ColsLayout {
  int taps, cstep, per_row, rows_per_block;
};

// With device_count (gathering ahead of the count, one group): p is the
// buffer's capacity, the rows are the first *device_count positions, none
// if they do not fit, and each block works out its run of rows from the
// count.
template <typename scalar_t, typename index_t>
__global__ void gather_cols_kernel(const scalar_t* __restrict__ input, Strides4 s,
                                   const int64_t* __restrict__ positions, index_t p,
                                   const int64_t* __restrict__ device_count,
                                   MaskedConvGeometry g, ColsLayout lay, index_t batches_per_block,
                                   scalar_t* __restrict__ cols) {
  const index_t cpg = g.in_per_group(), out_h = g.out_h, out_w = g.out_w;
  const int64_t k_total = g.col_rows();
  if (device_count != nullptr) {
    const int64_t count = *device_count;
    if (count > p) {
      return;
    }
    p = static_cast<index_t>(count);
    const index_t batches = (p + lay.rows_per_block - 1) / lay.rows_per_block;
    batches_per_block = (batches + static_cast<index_t>(gridDim.x) - 1) /
                        static_cast<index_t>(gridDim.x);
  }
  const index_t rows = static_cast<index_t>(g.groups) * p;
  const int64_t k_step = int64_t(lay.cstep) * lay.taps, c_step = lay.cstep * s.c;
  const index_t first = static_cast<index_t>(blockIdx.x) * batches_per_block * lay.rows_per_block;
  const index_t last = first + batches_per_block * lay.rows_per_block;
  for (int v = threadIdx.x; v < lay.per_row * lay.rows_per_block; v += blockDim.x) {
    const int sub = v / lay.per_row, w = v - sub * lay.per_row;
    const int c0 = w / lay.taps, tap = w - c0 * lay.taps;
    const int i = tap / static_cast<int>(g.kernel_w), j = tap - i * static_cast<int>(g.kernel_w);
    const int64_t di = i * g.dil_h - g.pad_h, dj = j * g.dil_w - g.pad_w;
    for (index_t row = first + sub; row < rows && row < last; row += lay.rows_per_block) {
      const index_t grp = row / p, r = row - grp * p;
      const int64_t flat = positions[r];
      int64_t off = -1;
      if (flat >= 0) {
        const MaskedConvPosition<index_t> q(static_cast<index_t>(flat), out_h, out_w);
        const int64_t ih = q.oh * g.stride_h + di, iw = q.ow * g.stride_w + dj;
        if (ih >= 0 && ih < g.height && iw >= 0 && iw < g.width) {
          off = q.n * s.n + (static_cast<int64_t>(grp) * cpg + c0) * s.c + ih * s.h + iw * s.w;
        }
      }
      scalar_t* dst = cols + static_cast<int64_t>(row) * k_total + w;
      const int64_t stride = off >= 0 ? c_step : 0;
      // kGatherUnroll loads in flight per thread: a row has few channels
      // per thread, and one load at a time left this kernel latency-bound.
      index_t c = c0;
      for (; c + (kGatherUnroll - 1) * lay.cstep < cpg; c += kGatherUnroll * lay.cstep) {
        scalar_t v[kGatherUnroll];
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) {
          v[u] = off >= 0 ? input[off + u * stride] : scalar_t(0);
        }
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) {
          dst[u * k_step] = v[u];
        }
        dst += kGatherUnroll * k_step;
        off += kGatherUnroll * stride;
      }
      for (; c < cpg; c += lay.cstep) {
        *dst = off >= 0 ? input[off] : scalar_t(0);
        dst += k_step;
        off += stride;
      }
    }
  }
}

// gather_grad and col2im: a thread serves kChannels channels
// of one pixel or position, so its index-map lookups and coordinate math
// are shared by them.  Grid: x over the pixels or positions, y over the
// (image,) channel chunks (grid-strided: N * C / kChannels can pass 65535).
constexpr int kChannels = 8;
// gather_grad touches one element per (position, channel):
// fewer channels per thread, so that a few thousand positions still fill
// the device.
constexpr int kScatterChannels = 2;

// The channels of the chunk that starts at c0: `per`, or fewer at the end.
__device__ __forceinline__ int chunk_channels(int64_t channels, int64_t c0, int per) {
  return static_cast<int>(channels - c0 < per ? channels - c0 : per);
}

// f(co0, count, j) for every chunk of kScatterChannels channels (the first
// co0, `count` of them) and every position j < p, over a 2-D grid: x over
// the positions, y over the chunks.
template <typename F>
__device__ __forceinline__ void for_position_chunks(int64_t p, int64_t channels, F&& f) {
  const int64_t chunks = ceil_div(channels, kScatterChannels);
  for (int64_t y = blockIdx.y; y < chunks; y += gridDim.y) {
    const int64_t co0 = y * kScatterChannels;
    const int count = chunk_channels(channels, co0, kScatterChannels);
    for (int64_t j = grid_start<int64_t>(); j < p; j += grid_stride<int64_t>()) {
      f(co0, count, j);
    }
  }
}

// out[n, co, oh, ow] = product[group, rank, co in group] + bias[co] at the
// selected positions (clear_output zeroed the rest while the count was read
// back).  A block moves a tile of kTile positions x kTile channels through
// shared memory: it reads the product channels fastest (coalesced) and
// writes the output positions fastest, the order whose writes -- a plane
// apart across channels -- the memory system takes best (positions-fastest
// writes fill whole lines of each output plane).
constexpr int kTile = 32;
constexpr int kTileRows = kThreads / kTile;

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads) write_output_kernel(
    const scalar_t* __restrict__ product, const int64_t* __restrict__ positions, index_t p,
    const scalar_t* __restrict__ bias, int64_t bias_stride, index_t plane, index_t channels,
    index_t per_group, scalar_t* __restrict__ out) {
  __shared__ scalar_t tile[kTile][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x) % kTile;
  const int ty = static_cast<int>(threadIdx.x) / kTile;
  const index_t j0 = static_cast<index_t>(blockIdx.x) * kTile;
  const index_t j = j0 + tx;
  const int64_t flat = j < p ? positions[j] : -1;
  for (index_t c0 = static_cast<index_t>(blockIdx.y) * kTile; c0 < channels;
       c0 += static_cast<index_t>(gridDim.y) * kTile) {
    const index_t co = c0 + tx;
    if (co < channels) {
      const index_t grp = co / per_group;
      const scalar_t b = bias != nullptr ? bias[co * bias_stride] : scalar_t(0);
      for (int r = ty; r < kTile; r += kTileRows) {
        const index_t jr = j0 + r;
        if (jr < p) {
          using T = at::opmath_type<scalar_t>;
          tile[r][tx] = static_cast<scalar_t>(
              static_cast<T>(product[(grp * p + jr) * per_group + (co - grp * per_group)]) +
              static_cast<T>(b));
        }
      }
    }
    __syncthreads();
    if (flat >= 0) {
      const index_t n = static_cast<index_t>(flat) / plane;
      const index_t pixel = static_cast<index_t>(flat) - n * plane;
      for (int r = ty; r < kTile && c0 + r < channels; r += kTileRows) {
        out[(static_cast<int64_t>(n) * channels + c0 + r) * plane + pixel] = tile[tx][r];
      }
    }
    __syncthreads();
  }
}

// grad_cols (C_out, P): the gradient at each position, channel by channel.
template <typename scalar_t, typename index_t>
__global__ void gather_grad_kernel(const scalar_t* __restrict__ grad, Strides4 s,
                                   const int64_t* __restrict__ positions, int64_t p,
                                   index_t out_h, index_t out_w, int64_t channels,
                                   scalar_t* __restrict__ grad_cols) {
  for_position_chunks(p, channels, [&](int64_t co0, int count, int64_t j) {
    const int64_t flat = positions[j];
    int64_t off = -1;
    if (flat >= 0) {
      const MaskedConvPosition<index_t> q(static_cast<index_t>(flat), out_h, out_w);
      off = q.n * s.n + co0 * s.c + q.oh * s.h + q.ow * s.w;
    }
#pragma unroll
    for (int u = 0; u < kScatterChannels; ++u) {
      if (u < count) {
        grad_cols[(co0 + u) * p + j] = off >= 0 ? grad[off + u * s.c] : scalar_t(0);
      }
    }
  });
}

// grad_input[n, c, ih, iw] = sum over the taps (i, j) whose output position
// (oh, ow) is selected of input_cols[g, (c', i, j), rank(oh, ow)], taps in
// order: each pixel gathers, nothing is added twice, no atomics.
// index_t: the pixel and the geometry (geometry_fits_int32 decides); the
// column offsets stay int64.  kUnitStride: stride 1 in both dims, where the
// output coordinate needs no division (most layers; ncu counted 1.6k
// instructions per thread on the general path).
template <bool kUnitStride, typename index_t>
__device__ __forceinline__ index_t col2im_out_coord(index_t i, index_t k, index_t stride,
                                                     index_t pad, index_t dil, index_t out_size) {
  if constexpr (kUnitStride) {
    const index_t o = i + pad - k * dil;
    return o >= 0 && o < out_size ? o : -1;
  } else {
    return masked_conv_out_coord<index_t>(i, k, stride, pad, dil, out_size);
  }
}

// KH, KW: the kernel size when known at compile time (3 x 3), else 0: a
// fixed size unrolls the taps, so a pixel's index-map loads are all in
// flight at once instead of one after another.
template <typename scalar_t, typename index_t, bool kUnitStride, int KH, int KW>
__global__ void col2im_kernel(const scalar_t* __restrict__ input_cols, int64_t p,
                              const int64_t* __restrict__ index_map, MaskedConvGeometry g,
                              scalar_t* __restrict__ grad_input) {
  using T = at::opmath_type<scalar_t>;
  const index_t width = g.width, plane = g.height * g.width;
  const index_t kh = KH > 0 ? KH : g.kernel_h, kw = KW > 0 ? KW : g.kernel_w;
  const index_t out_h = g.out_h, out_w = g.out_w;
  const index_t sh = g.stride_h, sw = g.stride_w, ph = g.pad_h, pw = g.pad_w;
  const index_t dh = g.dil_h, dw = g.dil_w;
  const int64_t channels = g.in_channels, cpg = g.in_per_group(), taps = g.kernel_h * g.kernel_w;
  const int64_t k_total = g.col_rows();
  const int64_t per_image = ceil_div(channels, kChannels);
  const int64_t chunks = g.batch * per_image;
  for (int64_t y = blockIdx.y; y < chunks; y += gridDim.y) {
    const int64_t n = y / per_image, c0 = (y - n * per_image) * kChannels;
    const int count = chunk_channels(channels, c0, kChannels);
    // Each channel's first column row: (group, channel in group, tap 0).
    int64_t rows[kChannels];
    int64_t grp = c0 / cpg, cl = c0 - grp * cpg;
#pragma unroll
    for (int u = 0; u < kChannels; ++u) {
      rows[u] = (grp * k_total + cl * taps) * p;
      if (u + 1 < count && ++cl == cpg) {
        cl = 0;
        ++grp;
      }
    }
    const int64_t* map = index_map + n * g.out_h * g.out_w;
    for (index_t e = grid_start<index_t>(); e < plane; e += grid_stride<index_t>()) {
      const index_t ih = e / width, iw = e - ih * width;
      T acc[kChannels];
#pragma unroll
      for (int u = 0; u < kChannels; ++u) {
        acc[u] = T(0);
      }
#pragma unroll
      for (index_t i = 0; i < kh; ++i) {
        const index_t oh = col2im_out_coord<kUnitStride>(ih, i, sh, ph, dh, out_h);
        if (oh < 0) {
          continue;
        }
#pragma unroll
        for (index_t j = 0; j < kw; ++j) {
          const index_t ow = col2im_out_coord<kUnitStride>(iw, j, sw, pw, dw, out_w);
          const int64_t r = ow < 0 ? -1 : map[oh * out_w + ow];
          if (r < 0) {
            continue;
          }
          const int64_t t = static_cast<int64_t>(i * kw + j) * p + r;
#pragma unroll
          for (int u = 0; u < kChannels; ++u) {
            if (u < count) {
              acc[u] += static_cast<T>(input_cols[rows[u] + t]);
            }
          }
        }
      }
      scalar_t* dst = grad_input + (n * channels + c0) * plane + e;
#pragma unroll
      for (int u = 0; u < kChannels; ++u) {
        if (u < count) {
          dst[u * plane] = static_cast<scalar_t>(acc[u]);
        }
      }
    }
  }
}

// Whether col2im_kernel's geometry terms (sizes, strides, padding, dilation
// and the intermediate i + pad - k * dil) fit in int32.
inline bool geometry_fits_int32(const MaskedConvGeometry& g) {
  constexpr int64_t kLimit = int64_t(1) << 29;
  for (const int64_t v : {g.height, g.width, g.height * g.width, g.in_channels,
                          g.out_h * g.out_w, g.kernel_h, g.kernel_w, g.kernel_h * g.kernel_w,
                          g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dil_h * g.kernel_h,
                          g.dil_w * g.kernel_w}) {
    if (v > kLimit) {
      return false;
    }
  }
  return true;
}

// A 2-D grid: x over `items` (threads kThreads), y over `chunks`.
dim3 grid_2d(int64_t items, int64_t chunks) {
  return dim3(grid_for(items, kThreads),
              static_cast<unsigned int>(std::min<int64_t>(chunks, 65535)));
}

// An event recorded on a stream, for the host to wait on what is queued
// before it and not after.  The events are kept for reuse (per device, one
// call at a time each): creating and destroying one per call is host time
// on the path that the call's next launch waits on.  The pool is never
// freed; its events go with the process's CUDA contexts.
class CountEvent {
 public:
  CountEvent(int device, cudaStream_t stream) : device_(device) {
    {
      const std::lock_guard<std::mutex> lock(mutex());
      std::vector<cudaEvent_t>& free = pool()[device];
      if (!free.empty()) {
        event_ = free.back();
        free.pop_back();
      }
    }
    if (event_ == nullptr) {
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
    const cudaError_t recorded = cudaEventRecord(event_, stream);
    if (recorded != cudaSuccess) {
      give_back();
      C10_CUDA_CHECK(recorded);
    }
  }
  ~CountEvent() { give_back(); }
  CountEvent(const CountEvent&) = delete;
  CountEvent& operator=(const CountEvent&) = delete;
  void wait() const { C10_CUDA_CHECK(cudaEventSynchronize(event_)); }

 private:
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::unordered_map<int, std::vector<cudaEvent_t>>& pool() {
    static auto* p = new std::unordered_map<int, std::vector<cudaEvent_t>>;
    return *p;
  }
  void give_back() {
    if (event_ != nullptr) {
      const std::lock_guard<std::mutex> lock(mutex());
      pool()[device_].push_back(event_);
      event_ = nullptr;
    }
  }

  int device_;
  cudaEvent_t event_ = nullptr;
};

// The share of selected positions from which the forward hands off to
// cuDNN, where the convolution runs on tensor cores (half types, or float32
// under TF32): the sparse path's column traffic grows with the positions
// while cuDNN's implicit GEMM reads the input once, so past this share
// cuDNN's convolution of every position, masked, is the faster.  Measured
// on the benchmark's 256-channel 3x3 layer, the two cross at about 40% in
// float32 (TF32) and bfloat16 alike (docs/design.md).  Exact float32 and
// float64 stay sparse: cuDNN's exact convolution was slower than the sparse
// path even with every position selected.
constexpr double kDenseShare = 0.4;

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The dense calls in a row of each layer (device, dtype and geometry).
// From kDenseStreak of them on, the next call of that layer queues cuDNN's
// convolution before the host waits for the count, expecting the hand-off
// again: the device then runs it during the wait instead of idling while
// the host launches it afterwards.  The count still decides the path, so
// results never depend on this history; a wrong guess (a layer whose masks
// turn sparse) costs one unused convolution and resets the streak, and
// layers whose masks alternate never build one.
constexpr int kDenseStreak = 2;

class DenseStreaks {
 public:
  static int get(const at::Tensor& input, const MaskedConvGeometry& g) {
    const std::lock_guard<std::mutex> lock(mutex());
    const auto it = streaks().find(key(input, g));
    return it == streaks().end() ? 0 : it->second;
  }

  static void record(const at::Tensor& input, const MaskedConvGeometry& g, bool dense) {
    const std::lock_guard<std::mutex> lock(mutex());
    auto& all = streaks();
    if (!dense) {
      all.erase(key(input, g));
      return;
    }
    // Bounded: a process that sees ever new layers forgets the old ones.
    if (all.size() >= kMaxLayers) {
      all.clear();
    }
    int& n = all[key(input, g)];
    n = std::min(n + 1, kDenseStreak);
  }

 private:
  static constexpr size_t kMaxLayers = 1024;

  // A hash of the layer (FNV-1a over its sizes); a collision only mixes two
  // layers' streaks.
  static uint64_t key(const at::Tensor& input, const MaskedConvGeometry& g) {
    uint64_t h = 14695981039346656037ull;
    for (const int64_t v :
         {int64_t(input.get_device()), int64_t(input.scalar_type()), g.batch, g.in_channels,
          g.height, g.width, g.out_channels, g.groups, g.kernel_h, g.kernel_w, g.pad_h, g.pad_w,
          g.stride_h, g.stride_w, g.dil_h, g.dil_w, int64_t(g.mask_broadcast)}) {
      h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    }
    return h;
  }
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::unordered_map<uint64_t, int>& streaks() {
    static auto* s = new std::unordered_map<uint64_t, int>;
    return *s;
  }
};

struct CudaKernels {
  static MaskedPositions positions(
      const at::Tensor& mask, const MaskedConvGeometry& g,
      const std::function<void(const PendingPositions&)>& meanwhile) {
    const c10::cuda::CUDAGuard guard(mask.device());
    const cudaStream_t stream = current_stream();
    const int64_t all = g.all_positions();
    at::Tensor index_map = at::empty({all}, mask.options().dtype(at::kLong));
    const int64_t tiles = ceil_div(all, kScanTile);
    TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "torchops.masked_conv2d: ", all,
                " output positions are more than it can index");
    at::Tensor tile_counts = at::empty({tiles + 1}, index_map.options());
    const bool padded = capturing(stream);
    at::Tensor positions = padded ? at::full({all}, -1, index_map.options())
                                  : at::empty({all}, index_map.options());
    // The count's way to the host: rank_kernel writes it into pinned memory
    // itself, which the device can address (always, with unified
    // addressing), so no copy sits in the stream between the kernel and the
    // work queued behind it; else a copy follows the kernel.
    at::Tensor count;
    int64_t* host_total = nullptr;
    if (!padded) {
      count = at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
      void* mapped = nullptr;
      if (cudaHostGetDevicePointer(&mapped, count.mutable_data_ptr(), 0) == cudaSuccess) {
        host_total = static_cast<int64_t*>(mapped);
      } else {
        (void)cudaGetLastError();  // clears the error the query left
      }
    }
    const int64_t sn = g.mask_broadcast ? 0 : mask.stride(0);
    AT_DISPATCH_FLOATING_TYPES_AND3(
        at::kHalf, at::kBFloat16, at::kBool, mask.scalar_type(), "torchops.masked_conv2d", [&] {
          const auto grid = static_cast<unsigned int>(tiles);
          count_kernel<scalar_t><<<grid, kScanThreads, 0, stream>>>(
              mask.const_data_ptr<scalar_t>(), sn, mask.stride(1), mask.stride(2), g,
              tile_counts.mutable_data_ptr<int64_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          rank_kernel<scalar_t><<<grid, kScanThreads, 0, stream>>>(
              mask.const_data_ptr<scalar_t>(), sn, mask.stride(1), mask.stride(2), g,
              tile_counts.mutable_data_ptr<int64_t>(), index_map.mutable_data_ptr<int64_t>(),
              positions.mutable_data_ptr<int64_t>(), host_total);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    if (padded) {
      meanwhile(PendingPositions{positions, nullptr});
      return {positions, index_map, /*padded=*/true};
    }
    // The one sync of the call (see the top of the file): `meanwhile`
    // queues its work behind the count, and only then does the host wait,
    // for the count alone.
    if (host_total == nullptr) {
      C10_CUDA_CHECK(cudaMemcpyAsync(count.mutable_data_ptr<int64_t>(),
                                     tile_counts.const_data_ptr<int64_t>() + tiles,
                                     sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    }
    const CountEvent counted(mask.get_device(), stream);
    try {
      meanwhile(PendingPositions{positions, tile_counts.const_data_ptr<int64_t>() + tiles});
    } catch (...) {
      // The device still writes into `count`: let that land before the
      // pinned block goes back to PyTorch's allocator for others to use.
      counted.wait();
      throw;
    }
    counted.wait();
    return {positions.narrow(0, 0, *count.const_data_ptr<int64_t>()), index_map};
  }

  // A memset: the cheapest zeros on both the host and the device.
  static void clear_output(at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(out.device());
    C10_CUDA_CHECK(cudaMemsetAsync(out.mutable_data_ptr(), 0, out.nbytes(), current_stream()));
  }

  // Whether a float32 call runs on TF32 tensor cores (the convolution
  // rule, conv_precision.cuh).
  static bool uses_tf32(const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && conv_uses_tf32();
  }

  // Whether cuDNN's convolution runs on tensor cores, as the hand-off needs.
  static bool tensor_cores(const at::Tensor& input) {
    const at::ScalarType dtype = input.scalar_type();
    return dtype == at::kHalf || dtype == at::kBFloat16 || uses_tf32(input);
  }

  // The hand-off is expected where the testing switch forces it, under
  // graph capture (every position counted), or after kDenseStreak dense
  // calls in a row of the same layer (DenseStreaks).
  static bool expects_dense(const at::Tensor& input, const MaskedConvGeometry& g) {
    const MaskedForwardPath path = masked_forward_path();
    if (!masked_conv2d_can_go_dense(tensor_cores(input), g, path)) {
      return false;
    }
    return path == MaskedForwardPath::kDense ||
           capturing(c10::cuda::getCurrentCUDAStream(input.get_device()).stream()) ||
           DenseStreaks::get(input, g) >= kDenseStreak;
  }

  static at::Tensor dense_conv(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::IntArrayRef padding,
                               c10::IntArrayRef stride, c10::IntArrayRef dilation,
                               int64_t groups) {
    return masked_conv2d_dense_conv(input, weight, bias, padding, stride, dilation, groups,
                                    conv_allows_tf32());
  }

  // The dense hand-off (see kDenseShare): cuDNN's convolution of every
  // position, with TF32 as the convolution rule, and so the sparse path's
  // GEMM, has it.
  static bool dense_forward(const at::Tensor& input, const at::Tensor& mask,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::IntArrayRef padding, c10::IntArrayRef stride,
                            c10::IntArrayRef dilation, int64_t groups,
                            const MaskedConvGeometry& g, const MaskedPositions& pos,
                            const std::optional<at::Tensor>& early_conv, at::Tensor& out) {
    const bool dense = masked_conv2d_goes_dense(tensor_cores(input), kDenseShare, pos, g);
    if (!pos.padded) {
      DenseStreaks::record(input, g, dense);
    }
    if (!dense) {
      return false;
    }
    masked_conv2d_dense_select(
        early_conv.has_value()
            ? *early_conv
            : dense_conv(input, weight, bias, padding, stride, dilation, groups),
        mask, pos, g, out);
    return true;
  }

  // a @ b in the op's precision.  float32 under TF32: cuBLAS where its own
  // flag (torch.backends.cuda.matmul.allow_tf32) gives TF32 too and
  // deterministic algorithms are off, else torchops.matmul's TF32 kernels
  // (deterministic, and free of the matmul flag).  Exact float32: the
  // thread-local NoTF32Guard holds cuBLAS and torchops.matmul to it
  // whatever the matmul flag says.  Half types and float64 as op_matmul.
  static at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() != at::kFloat) {
      return op_matmul(a, b);
    }
    if (uses_tf32(a)) {
      return cublas_tf32(a) ? at::matmul(a, b) : torchops::matmul::gemm_tf32(a, b);
    }
    const at::NoTF32Guard exact;
    return op_matmul(a, b);
  }

  // Whether cuBLAS multiplies float32 in TF32 by its own flag, outside
  // deterministic algorithms.
  static bool cublas_tf32(const at::Tensor& a) {
    return at::globalContext().allowTF32CuBLAS() && !deterministic_cuda_gemm(a);
  }

  // Stored (G, P, K): read transposed as the forward GEMM's (K, P) operand
  // it is K-contiguous, the layout GEMMs load without a copy.
  static at::Tensor gather_cols(const at::Tensor& input, const MaskedPositions& pos,
                                const MaskedConvGeometry& g) {
    return launch_gather_cols(input, pos.positions, pos.count(), nullptr, g);
  }

  // The share of the positions whose columns the forward gathers before the
  // host has their count, and the most bytes it allocates for them: the
  // gather then runs while the count travels to the host, which it would
  // otherwise wait for.  Above the share the buffer goes unused (the kernel
  // exits at once) and the columns are gathered after the count.
  static constexpr int64_t kAheadDivisor = 8;
  static constexpr int64_t kAheadBytes = int64_t(64) << 20;

  static std::optional<at::Tensor> gather_cols_ahead(const at::Tensor& input,
                                                     const MaskedConvGeometry& g,
                                                     const PendingPositions& pending) {
    if (pending.device_count == nullptr || g.groups != 1 || g.col_rows() == 0) {
      return std::nullopt;
    }
    const int64_t row_bytes = g.col_rows() * static_cast<int64_t>(input.element_size());
    const int64_t cap = std::min(ceil_div(g.all_positions(), kAheadDivisor),
                                 kAheadBytes / row_bytes);
    if (cap <= 0) {
      return std::nullopt;
    }
    return launch_gather_cols(input, pending.positions, cap, pending.device_count, g);
  }

  // Columns (G, p, K) of the first p positions; with device_count, a buffer
  // of capacity p holding the first *device_count (gather_cols_kernel).
  static at::Tensor launch_gather_cols(const at::Tensor& input, const at::Tensor& positions,
                                       int64_t p, const int64_t* device_count,
                                       const MaskedConvGeometry& g) {
    at::Tensor cols = new_output("masked_conv2d", {g.groups, p, g.col_rows()}, input.options());
    if (cols.numel() == 0) {
      return cols;
    }
    const c10::cuda::CUDAGuard guard(input.device());
    // A kernel's taps fit in int: the weight holds C_out * C_in / G of them.
    const int64_t taps = g.kernel_h * g.kernel_w;
    ColsLayout lay{};
    lay.taps = static_cast<int>(taps);
    lay.cstep = static_cast<int>(std::clamp<int64_t>(kThreads / taps, 1, g.in_per_group()));
    lay.per_row = lay.cstep * lay.taps;
    lay.rows_per_block = std::max(1, kThreads / lay.per_row);
    const int64_t rows = g.groups * p;
    const int64_t batches = ceil_div(rows, lay.rows_per_block);
    // About 16 blocks per SM, each walking a contiguous run of rows.
    const int64_t sms = sm_count(input);
    const int64_t per_block = ceil_div(batches, std::min(batches, sms * 16));
    const auto blocks = static_cast<unsigned int>(ceil_div(batches, per_block));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.masked_conv2d", [&] {
          const bool narrow = fits_int32(rows + per_block * lay.rows_per_block) &&
                              fits_int32(g.all_positions());
          with_index_type_if(narrow, [&](auto index) {
            using index_t = decltype(index);
            gather_cols_kernel<scalar_t, index_t><<<blocks, kThreads, 0, current_stream()>>>(
                input.const_data_ptr<scalar_t>(), strides4(input),
                positions.const_data_ptr<int64_t>(), static_cast<index_t>(p), device_count, g,
                lay, static_cast<index_t>(per_block), cols.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
    return cols;
  }

  // (G, P, K) @ (G, K, C_out / G) -> (G, P, C_out / G).  cuBLAS runs this
  // orientation faster than (C_out, K) @ (K, P), whose few output rows and
  // long K it splits and reduces in a second kernel.  Under TF32 the
  // product is torchops.matmul's TF32 kernels' (gemm), not cuDNN's 1x1
  // convolution of the columns: cuDNN builds an execution plan for every new
  // shape, and the positions' count changes from call to call.
  static at::Tensor forward_gemm(const at::Tensor& weight3, const at::Tensor& cols) {
    if (weight3.size(0) == 1) {
      return gemm(cols[0], weight3[0].t()).unsqueeze(0);
    }
    return gemm(cols, weight3.transpose(1, 2));
  }

  // product: forward_gemm's (G, P, C_out / G).
  static void write_output(const at::Tensor& product, const std::optional<at::Tensor>& bias,
                           const MaskedPositions& pos, const MaskedConvGeometry& g,
                           at::Tensor& out) {
    const int64_t p = pos.count();
    if (p == 0) {
      return;
    }
    const c10::cuda::CUDAGuard guard(out.device());
    const at::Tensor prod = product.contiguous();
    const bool has_bias = bias.has_value() && bias->defined();
    const int64_t plane = g.out_h * g.out_w;
    const dim3 grid(static_cast<unsigned int>(ceil_div(p, kTile)),
                    static_cast<unsigned int>(std::min<int64_t>(ceil_div(g.out_channels, kTile),
                                                                65535)));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, out.scalar_type(), "torchops.masked_conv2d", [&] {
          // In int32 where the product's offsets and every flat index fit.
          with_index_type_if(fits_int32(prod.numel() + kTile) && fits_int32(g.all_positions()),
                             [&](auto index) {
            using index_t = decltype(index);
            write_output_kernel<scalar_t, index_t><<<grid, kThreads, 0, current_stream()>>>(
                prod.const_data_ptr<scalar_t>(), pos.positions.const_data_ptr<int64_t>(),
                static_cast<index_t>(p), has_bias ? bias->const_data_ptr<scalar_t>() : nullptr,
                has_bias ? bias->stride(0) : 0, static_cast<index_t>(plane),
                static_cast<index_t>(g.out_channels), static_cast<index_t>(g.out_per_group()),
                out.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }

  static void gather_grad(const at::Tensor& grad, const MaskedPositions& pos,
                          const MaskedConvGeometry& g, at::Tensor& grad_cols) {
    if (grad_cols.numel() == 0) {
      return;
    }
    const c10::cuda::CUDAGuard guard(grad.device());
    const int64_t p = pos.count();
    const dim3 grid = grid_2d(p, ceil_div(g.out_channels, kScatterChannels));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad.scalar_type(), "torchops._masked_conv2d_backward", [&] {
          // The positions' decode, in int32 where every flat index fits.
          with_index_type_if(fits_int32(g.all_positions()), [&](auto index) {
            using index_t = decltype(index);
            gather_grad_kernel<scalar_t, index_t><<<grid, kThreads, 0, current_stream()>>>(
                grad.const_data_ptr<scalar_t>(), strides4(grad),
                pos.positions.const_data_ptr<int64_t>(), p, static_cast<index_t>(g.out_h),
                static_cast<index_t>(g.out_w), g.out_channels,
                grad_cols.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }

  static void col2im(const at::Tensor& input_cols, const MaskedPositions& pos,
                     const MaskedConvGeometry& g, at::Tensor& grad_input) {
    if (grad_input.numel() == 0) {
      return;
    }
    const c10::cuda::CUDAGuard guard(grad_input.device());
    const dim3 grid = grid_2d(g.height * g.width, g.batch * ceil_div(g.in_channels, kChannels));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad_input.scalar_type(), "torchops._masked_conv2d_backward",
        [&] {
          with_index_type_if(geometry_fits_int32(g), [&](auto index) {
            using index_t = decltype(index);
            const bool unit = g.stride_h == 1 && g.stride_w == 1;
            const bool k3 = g.kernel_h == 3 && g.kernel_w == 3;
            const auto kernel = unit ? (k3 ? col2im_kernel<scalar_t, index_t, true, 3, 3>
                                           : col2im_kernel<scalar_t, index_t, true, 0, 0>)
                                     : (k3 ? col2im_kernel<scalar_t, index_t, false, 3, 3>
                                           : col2im_kernel<scalar_t, index_t, false, 0, 0>);
            kernel<<<grid, kThreads, 0, current_stream()>>>(
                input_cols.const_data_ptr<scalar_t>(), pos.count(),
                pos.index_map.const_data_ptr<int64_t>(), g,
                grad_input.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }
};

at::Tensor masked_conv2d(const at::Tensor& input, const at::Tensor& mask,
                         const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef padding, at::IntArrayRef stride,
                         at::IntArrayRef dilation, int64_t groups) {
  return masked_conv2d_forward<CudaKernels>(input, mask, weight, bias, padding, stride,
                                            dilation, groups, c10::DeviceType::CUDA);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mask,
    const at::Tensor& weight, at::IntArrayRef padding, at::IntArrayRef stride,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  return torchops::masked_conv2d_backward<CudaKernels>(grad, input, mask, weight, padding,
                                                       stride, dilation, groups, output_mask,
                                                       c10::DeviceType::CUDA);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("masked_conv2d", &masked_conv2d);
  m.impl("_masked_conv2d_backward", &masked_conv2d_backward);
}

}  // namespace torchops::cuda
