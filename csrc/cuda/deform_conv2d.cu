// CUDA kernels of torchops.deform_conv2d and its backward.
//
// Forward, per chunk of images (at most ~256 MB of columns, see
// deform_chunk): a deformable im2col kernel fills the (C * kh * kw,
// images * P) column matrix, then one cuBLAS GEMM per weight group, over the
// whole chunk, multiplies it by the weight (csrc/common/deform_gemm.h); for
// large float32 layers while convolutions may use TF32, the im2col writes
// the columns split into TF32 high and low parts and the GEMMs run as
// 3xTF32 on torchops.matmul's kernels (split_forward_gemm below); for
// thinner float32 layers the bias rides in the GEMM as an extra column row
// of ones (folded_forward_gemm below).  An im2col thread owns one sample
// position (offset group, tap, image, output pixel): it computes the
// bilinear geometry once and walks a slice of the offset group's channels,
// so adjacent threads (adjacent pixels) write adjacent columns.  The
// channels are split into slices as far as it takes to fill the GPU, and
// for float32 into slices of at most 16 channels.
//
// Backward, per chunk: grad_columns = weight^T @ grad and grad_weight +=
// grad @ columns^T (GEMMs, after recomputing the columns); grad_offset and
// grad_mask by one thread per sample position that reduces over the
// channels of its offset group (no atomics, deterministic); grad_bias by a
// sum.  grad_input, a scatter of grad_columns into the input planes:
//  * atomic (the default below 128 channels per offset group,
//    input_grad_path): threads laid out like the im2col's add their four
//    bilinear corners with atomicAdd (into a float32 buffer for half types);
//  * gather (the default from 128 channels per offset group, and always
//    under torch.use_deterministic_algorithms(True)): the scatter pattern
//    depends on the sample position, not on the channel, so it is listed
//    once per chunk as (destination pixel of its offset group, column
//    position, weight) contributions, sorted by destination, and every
//    grad_input element gathers its own in a fixed order, 8 channels of a
//    pixel per thread (csrc/cuda/common/sorted_gather.cuh).  Scratch: 24
//    to 48 bytes per contribution, 4 per sample position (OG * kh * kw *
//    images * P of them), independent of the channel count.  Under
//    determinism the GEMMs are torchops.matmul's (deterministic; cuBLAS
//    would demand CUBLAS_WORKSPACE_CONFIG in this mode).
//
// Half types: columns and the GEMMs in the input's dtype (cuBLAS accumulates
// in float32), every bilinear sum and reduction in float32.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#include "common/accumulate.h"
#include "common/deform_conv2d.h"
#include "common/deform_conv2d_steps.h"
#include "common/deform_gemm.h"
#include "common/env.h"
#include "cuda/common/conv_precision.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/sorted_gather.cuh"
#include "cuda/common/split_tf32.cuh"
#include "cuda/matmul/api.h"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;
// Channels whose loads a thread issues together (im2col, atomic col2im).
constexpr int kIm2colBatch = 4;

// A chunk of B images, pointers at its first image, contiguous tensors.
template <typename scalar_t>
struct Chunk {
  DeformGeometry g;
  int64_t images;
  const scalar_t* input;   // (B, C, H, W)
  const scalar_t* offset;  // (B, 2 * OG * K, P)
  const scalar_t* mask;    // (B, OG * K, P), or nullptr

  __device__ __forceinline__ int64_t plane() const { return g.height * g.width; }
  // Start of column row (c, k) of image b in the (C * K, B * P) matrix.
  __device__ __forceinline__ int64_t column(int64_t c, int64_t k,
                                            int64_t b) const {
    return ((c * g.taps() + k) * images + b) * g.pixels();
  }
  template <typename T>
  __device__ __forceinline__ bool sample(int64_t og, int64_t k, int64_t b,
                                         int64_t p, DeformTaps<T>& t,
                                         T& m) const {
    const int64_t per = g.offset_groups * g.taps() * g.pixels();
    return deform_sample(g, offset + b * 2 * per,
                         mask != nullptr ? mask + b * per : mask, og, k, p, t,
                         m);
  }
};

// A sample position, and the slice of its offset group's channels a thread
// takes: thread index = (((og * slices + s) * K + k) * B + b) * P + p.
struct Position {
  int64_t og, s, k, b, p;
};

template <typename index_t, typename scalar_t>
__device__ __forceinline__ Position position_of(index_t i,
                                                const Chunk<scalar_t>& ch,
                                                index_t slices) {
  Position q;
  const index_t P = static_cast<index_t>(ch.g.pixels());
  const index_t B = static_cast<index_t>(ch.images);
  const index_t K = static_cast<index_t>(ch.g.taps());
  q.p = i % P;
  i /= P;
  q.b = i % B;
  i /= B;
  q.k = i % K;
  i /= K;
  q.s = i % slices;
  q.og = i / slices;
  return q;
}

// Channels [c0, c1) of slice s of offset group og.
struct Slice {
  int64_t c0, c1;
};

__device__ __forceinline__ Slice slice_of(const Position& q, int64_t cpg,
                                          int64_t per_slice) {
  const int64_t c0 = q.og * cpg + q.s * per_slice;
  const int64_t end = q.og * cpg + cpg;
  return {c0, c0 + per_slice < end ? c0 + per_slice : end};
}

// A column value, or with kSplit (float32 only) its TF32 high part at dst
// and its low part `low` elements further (split_tf32.cuh).
template <bool kSplit, typename scalar_t, typename T>
__device__ __forceinline__ void store_column(scalar_t* dst, int64_t low, T v) {
  if constexpr (kSplit) {
    float hi, lo;
    split_tf32(v, hi, lo);
    dst[0] = hi;
    dst[low] = lo;
  } else {
    (void)low;
    *dst = static_cast<scalar_t>(v);
  }
}

// Rows of ones and zeros under the columns for a GEMM that adds the bias
// (folded_forward_gemm).
constexpr int64_t kBiasRows = 4;

// The folded bias's small writes, which the im2col's threads do before
// their columns rather than in a launch of their own: w_fold (O, CK +
// kBiasRows) = [weight | bias | 0...] and the columns' extra rows
// (kBiasRows, BP) = [1...; 0...].  w_fold == nullptr: nothing to write.
template <typename scalar_t>
struct BiasFold {
  const scalar_t* weight = nullptr;  // (O, CK)
  const scalar_t* bias = nullptr;    // (O)
  scalar_t* w_fold = nullptr;
  scalar_t* extra_rows = nullptr;
  int64_t out_channels = 0, column_rows = 0, columns = 0;  // O, CK, BP

  __device__ void write() const {
    const int64_t R = column_rows + kBiasRows, wn = out_channels * R;
    const int64_t total = wn + kBiasRows * columns;
    for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
      if (i < wn) {
        const int64_t o = i / R, j = i - o * R;
        w_fold[i] = j < column_rows ? weight[o * column_rows + j]
                                    : (j == column_rows ? bias[o] : scalar_t(0));
      } else {
        extra_rows[i - wn] = i - wn < columns ? scalar_t(1) : scalar_t(0);
      }
    }
  }
};

template <typename scalar_t, typename T, typename index_t, bool kSplit>
__global__ void __launch_bounds__(kThreads) deform_im2col_kernel(
    Chunk<scalar_t> ch, BiasFold<scalar_t> fold, index_t slices,
    int64_t per_slice, index_t total, scalar_t* __restrict__ columns) {
  if (fold.w_fold != nullptr) {
    fold.write();
  }
  const int64_t plane = ch.plane(), cpg = ch.g.group_channels();
  const int64_t row_step = ch.g.taps() * ch.images * ch.g.pixels();
  const int64_t low = ch.g.channels * row_step;  // kSplit: the low parts' offset
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const Position q = position_of(i, ch, slices);
    const Slice sl = slice_of(q, cpg, per_slice);
    DeformTaps<T> t;
    T m;
    ch.sample(q.og, q.k, q.b, q.p, t, m);
    const scalar_t* src = ch.input + (q.b * ch.g.channels + sl.c0) * plane;
    scalar_t* dst = columns + ch.column(sl.c0, q.k, q.b) + q.p;
    int64_t c = sl.c0;
    // Four channels' loads before their stores: the compiler cannot move a
    // load above a store that might alias it, and one channel at a time
    // leaves a single load round trip in flight per thread.
    for (; c + kIm2colBatch <= sl.c1; c += kIm2colBatch) {
      T v[kIm2colBatch][4];
#pragma unroll
      for (int u = 0; u < kIm2colBatch; ++u) {
        deform_corners(src + u * plane, t, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kIm2colBatch; ++u) {
        store_column<kSplit, scalar_t, T>(dst + u * row_step, low, m * deform_dot(t.w, v[u]));
      }
      src += kIm2colBatch * plane;
      dst += kIm2colBatch * row_step;
    }
    for (; c < sl.c1; ++c, src += plane, dst += row_step) {
      T v[4];
      deform_corners(src, t, v);
      store_column<kSplit, scalar_t, T>(dst, low, m * deform_dot(t.w, v));
    }
  }
}

// Adds gv times the corners' weights into a plane with atomics.  On sm_90
// a float row pair (x0, x0 + 1) that sits in one aligned 16-byte chunk goes
// as one float4 atomic, zeros in the other lanes (adding +0 changes no
// value): the scatter is bound by the L2's atomic operations, not bytes.
// `end`: one past the buffer the plane lies in, which the chunk must not
// cross.
template <typename T>
__device__ __forceinline__ void scatter_corners(T* plane, const DeformTaps<T>& t,
                                                T gv, const T* end) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      const int c0 = 2 * row, c1 = c0 + 1;
      const unsigned both = (1u << c0) | (1u << c1);
      if ((t.valid & both) == both) {
        float* e = plane + t.idx[c0];
        const uintptr_t addr = reinterpret_cast<uintptr_t>(e);
        float* base = reinterpret_cast<float*>(addr & ~uintptr_t(15));
        const int lane = static_cast<int>((addr & 15) >> 2);
        if (lane <= 2 && base + 4 <= end) {
          float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int q = 0; q < 3; ++q) {
            if (q == lane) {
              v[q] = gv * t.w[c0];
              v[q + 1] = gv * t.w[c1];
            }
          }
          atomicAdd(reinterpret_cast<float4*>(base), make_float4(v[0], v[1], v[2], v[3]));
          continue;
        }
      }
#pragma unroll
      for (int c = c0; c <= c1; ++c) {
        if ((t.valid >> c) & 1u) {
          atomicAdd(plane + t.idx[c], gv * t.w[c]);
        }
      }
    }
    return;
  }
#endif
  (void)end;
#pragma unroll
  for (int corner = 0; corner < 4; ++corner) {
    if ((t.valid >> corner) & 1u) {
      atomicAdd(plane + t.idx[corner], gv * t.w[corner]);
    }
  }
}

// grad_input += the bilinear scatter of grad_columns (atomicAdd).
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) deform_col2im_atomic_kernel(
    Chunk<scalar_t> ch, const scalar_t* __restrict__ grad_columns,
    index_t slices, int64_t per_slice, index_t total,
    T* __restrict__ grad_input) {
  const int64_t plane = ch.plane(), cpg = ch.g.group_channels();
  const int64_t row_step = ch.g.taps() * ch.images * ch.g.pixels();
  const T* end = grad_input + ch.images * ch.g.channels * plane;
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const Position q = position_of(i, ch, slices);
    DeformTaps<T> t;
    T m;
    if (!ch.sample(q.og, q.k, q.b, q.p, t, m) || t.valid == 0) {
      continue;
    }
    const Slice sl = slice_of(q, cpg, per_slice);
    T* dst = grad_input + (q.b * ch.g.channels + sl.c0) * plane;
    const scalar_t* gc = grad_columns + ch.column(sl.c0, q.k, q.b) + q.p;
    int64_t c = sl.c0;
    // As in the im2col: the batch's loads first, then its atomics.
    for (; c + kIm2colBatch <= sl.c1; c += kIm2colBatch) {
      T gv[kIm2colBatch];
#pragma unroll
      for (int u = 0; u < kIm2colBatch; ++u) {
        gv[u] = static_cast<T>(gc[u * row_step]) * m;
      }
#pragma unroll
      for (int u = 0; u < kIm2colBatch; ++u) {
        scatter_corners(dst + u * plane, t, gv[u], end);
      }
      dst += kIm2colBatch * plane;
      gc += kIm2colBatch * row_step;
    }
    for (; c < sl.c1; ++c, dst += plane, gc += row_step) {
      scatter_corners(dst, t, static_cast<T>(*gc) * m, end);
    }
  }
}

// grad_offset and grad_mask: one thread per sample position (slices == 1),
// summing over the channels of its offset group in order.
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) deform_coordinate_grad_kernel(
    Chunk<scalar_t> ch, const scalar_t* __restrict__ grad_columns,
    index_t total, scalar_t* __restrict__ grad_offset,
    scalar_t* __restrict__ grad_mask) {
  const int64_t plane = ch.plane(), cpg = ch.g.group_channels();
  const int64_t K = ch.g.taps(), P = ch.g.pixels(), OG = ch.g.offset_groups;
  const int64_t row_step = K * ch.images * P;
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const Position q = position_of(i, ch, index_t(1));
    DeformTaps<T> t;
    T m;
    T acc_y = T(0), acc_x = T(0), acc_m = T(0);
    if (ch.sample(q.og, q.k, q.b, q.p, t, m) && t.valid != 0) {
      const int64_t c0 = q.og * cpg;
      const scalar_t* src = ch.input + (q.b * ch.g.channels + c0) * plane;
      const scalar_t* gc = grad_columns + ch.column(c0, q.k, q.b) + q.p;
      for (int64_t c = 0; c < cpg; ++c, src += plane, gc += row_step) {
        T v[4];
        deform_corners(src, t, v);
        const T g = static_cast<T>(*gc);
        acc_m += g * deform_dot(t.w, v);
        acc_y += g * deform_dot(t.dy, v);
        acc_x += g * deform_dot(t.dx, v);
      }
    }
    scalar_t* go = grad_offset + q.b * 2 * OG * K * P + (q.og * K + q.k) * 2 * P + q.p;
    go[0] = static_cast<scalar_t>(acc_y * m);
    go[P] = static_cast<scalar_t>(acc_x * m);
    if (grad_mask != nullptr) {
      grad_mask[q.b * OG * K * P + (q.og * K + q.k) * P + q.p] =
          static_cast<scalar_t>(acc_m);
    }
  }
}

// The deterministic input gradient's contributions: sample position i
// writes entries 4 i .. 4 i + 3, one per corner.  key: the corner's pixel in
// the (image, offset group) plane set, (b * OG + og) * H * W + idx, or
// `sentinel` for a corner outside the image; src: the column position
// (k * B + b) * P + p, which channel c offsets by c * K * B * P.
template <typename scalar_t, typename T, typename key_t, typename index_t>
__global__ void __launch_bounds__(kThreads) deform_contributions_kernel(
    Chunk<scalar_t> ch, index_t total, key_t* __restrict__ keys,
    Contribution<T, key_t>* __restrict__ entries) {
  const int64_t plane = ch.plane();
  const int64_t OG = ch.g.offset_groups, B = ch.images, P = ch.g.pixels();
  const key_t sentinel = static_cast<key_t>(B * OG * plane);
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const Position q = position_of(i, ch, index_t(1));
    DeformTaps<T> t;
    T m;
    ch.sample(q.og, q.k, q.b, q.p, t, m);
    const int64_t base = (q.b * OG + q.og) * plane;
    const key_t from = static_cast<key_t>((q.k * B + q.b) * P + q.p);
    const int64_t e = static_cast<int64_t>(i) * 4;
#pragma unroll
    for (int corner = 0; corner < 4; ++corner) {
      const bool ok = (t.valid >> corner) & 1u;
      keys[e + corner] = ok ? static_cast<key_t>(base + t.idx[corner]) : sentinel;
      entries[e + corner] = {from, ok ? m * t.w[corner] : T(0)};
    }
  }
}

// Channels of one pixel that share a gather thread: the pixel's
// contribution list is read once per 8 channels instead of once per channel.
constexpr int kGatherChannels = 8;

// Gather group i of the chunk: image b, offset group og, its channel group
// s, pixel d (fastest, so adjacent threads write adjacent grad_input
// elements); it gathers the contributions of key (b * OG + og) * H * W + d
// from the grad_columns row blocks of its channels.
struct PlaneGroups {
  int64_t channels, cpg, offset_groups, plane, row_block, groups_per_og;
  template <typename index_t>
  __device__ __forceinline__ GatherGroup operator()(index_t i) const {
    const index_t hw = static_cast<index_t>(plane);
    const index_t d = i % hw;
    index_t r = i / hw;
    const int64_t s = static_cast<int64_t>(r % static_cast<index_t>(groups_per_og));
    r /= static_cast<index_t>(groups_per_og);
    const int64_t og = static_cast<int64_t>(r % static_cast<index_t>(offset_groups));
    const int64_t b = static_cast<int64_t>(r / static_cast<index_t>(offset_groups));
    const int64_t c0 = og * cpg + s * kGatherChannels;
    const int64_t left = cpg - s * kGatherChannels;
    return {(b * offset_groups + og) * plane + d,
            c0 * row_block,
            1,
            row_block,
            (b * channels + c0) * plane + d,
            plane,
            static_cast<int>(left < kGatherChannels ? left : kGatherChannels)};
  }
};

int multiprocessors() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return std::max(sms, 1);
}

// Channel slices per offset group: enough threads for about two full waves
// of the GPU, never slices of fewer than 8 channels unless that is all, and
// never more than `most_per_slice` channels.
struct Slicing {
  int64_t slices, per_slice;
};

// The im2col's most channels per thread: 16 for float32, where more
// channels per thread leave too few threads to hide the samples' latency;
// half types keep the waves rule, which is faster for them.
constexpr int64_t kFloatChannelsPerThread = 16;

constexpr int64_t kAnyChannelsPerThread = std::numeric_limits<int64_t>::max();

Slicing slicing(int64_t positions, int64_t cpg, int64_t most_per_slice) {
  const int64_t want = int64_t(multiprocessors()) * 2048 * 2;
  int64_t slices = std::max<int64_t>(1, ceil_div(want, std::max<int64_t>(positions, 1)));
  slices = std::min(slices, std::max<int64_t>(1, cpg / 8));
  const int64_t per = std::min(std::max<int64_t>(1, ceil_div(cpg, slices)), most_per_slice);
  return {ceil_div(std::max<int64_t>(cpg, 1), per), per};
}

template <typename scalar_t>
Chunk<scalar_t> chunk_of(const DeformChunkTensors& c) {
  return Chunk<scalar_t>{
      c.g, c.images, c.input.const_data_ptr<scalar_t>(),
      c.offset.const_data_ptr<scalar_t>(),
      c.g.use_mask ? c.mask.const_data_ptr<scalar_t>() : nullptr};
}

// Launches kernel(index_t{}, blocks) over `total` threads.
template <typename F>
void launch_over(int64_t total, F&& f) {
  if (total == 0) {
    return;
  }
  const unsigned int blocks = grid_for(total, kThreads);
  with_index_type(total, blocks, kThreads, [&](auto index) {
    f(index, blocks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Sample positions of the chunk: (offset group, tap, image, output pixel).
template <typename scalar_t>
int64_t sample_positions(const Chunk<scalar_t>& ch) {
  return ch.g.offset_groups * ch.g.taps() * ch.images * ch.g.pixels();
}

// Launches pick(index_t{}), a kernel with a thread per (sample position,
// channel slice of at most `most_per_slice` channels), as kernel(ch,
// lead..., slices, per_slice, threads, out).
template <typename scalar_t, typename Pick, typename Out, typename... Lead>
void launch_sliced(const Chunk<scalar_t>& ch, int64_t most_per_slice, Pick pick,
                   Out* out, Lead... lead) {
  const int64_t positions = sample_positions(ch);
  const Slicing sl = slicing(positions, ch.g.group_channels(), most_per_slice);
  launch_over(positions * sl.slices, [&](auto index, unsigned int blocks) {
    using index_t = decltype(index);
    pick(index)<<<blocks, kThreads, 0, current_stream()>>>(
        ch, lead..., static_cast<index_t>(sl.slices), sl.per_slice,
        static_cast<index_t>(positions * sl.slices), out);
  });
}

template <typename scalar_t>
void im2col(const Chunk<scalar_t>& ch, scalar_t* columns, bool split,
            const BiasFold<scalar_t>& fold = {}) {
  const int64_t most_per_slice = std::is_same_v<scalar_t, float>
                                     ? kFloatChannelsPerThread
                                     : kAnyChannelsPerThread;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (split) {
      launch_sliced(
          ch, most_per_slice,
          [](auto index) {
            return deform_im2col_kernel<float, float, decltype(index), true>;
          },
          columns, fold);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(!split, "deform_conv2d: split columns are float32 only");
  launch_sliced(
      ch, most_per_slice,
      [](auto index) {
        return deform_im2col_kernel<scalar_t, at::opmath_type<scalar_t>,
                                    decltype(index), false>;
      },
      columns, fold);
}

template <typename scalar_t>
void col2im_atomic(const Chunk<scalar_t>& ch, const scalar_t* grad_columns,
                   at::opmath_type<scalar_t>* grad_input) {
  launch_sliced(
      ch, kAnyChannelsPerThread,
      [](auto index) {
        return deform_col2im_atomic_kernel<scalar_t, at::opmath_type<scalar_t>,
                                           decltype(index)>;
      },
      grad_input, grad_columns);
}

template <typename scalar_t, typename key_t>
void col2im_deterministic_as(const Chunk<scalar_t>& ch,
                             const scalar_t* grad_columns,
                             const at::TensorOptions& opts,
                             scalar_t* grad_input) {
  using T = at::opmath_type<scalar_t>;
  const int64_t K = ch.g.taps(), P = ch.g.pixels(), B = ch.images;
  const int64_t OG = ch.g.offset_groups, C = ch.g.channels;
  const int64_t plane = ch.g.height * ch.g.width;
  const int64_t positions = OG * K * B * P;
  ContributionList<T, key_t> list(positions * 4, B * OG * plane, opts);
  launch_over(positions, [&](auto index, unsigned int blocks) {
    using index_t = decltype(index);
    deform_contributions_kernel<scalar_t, T, key_t, index_t>
        <<<blocks, kThreads, 0, current_stream()>>>(
            ch, static_cast<index_t>(positions), list.key_data(), list.entry_data());
  });
  const auto sorted = list.sort();
  const int64_t cpg = ch.g.group_channels();
  const int64_t per_og = ceil_div(cpg, int64_t(kGatherChannels));
  sorted_gather<kGatherChannels, scalar_t, T, key_t>(
      grad_columns, sorted, PlaneGroups{C, cpg, OG, plane, K * B * P, per_og},
      B * OG * per_og * plane, grad_input);
}

// grad_input of the chunk (every element written), deterministically.
template <typename scalar_t>
void col2im_deterministic(const Chunk<scalar_t>& ch,
                          const scalar_t* grad_columns,
                          const at::TensorOptions& opts,
                          scalar_t* grad_input) {
  const int64_t keys_end =
      ch.images * ch.g.offset_groups * ch.g.height * ch.g.width + 1;
  const int64_t src_end = ch.g.taps() * ch.images * ch.g.pixels();
  // 32-bit keys sort in half the radix passes.
  if (fits_int32(keys_end) && fits_int32(src_end)) {
    col2im_deterministic_as<scalar_t, int32_t>(ch, grad_columns, opts, grad_input);
  } else {
    col2im_deterministic_as<scalar_t, int64_t>(ch, grad_columns, opts, grad_input);
  }
}

template <typename scalar_t>
void coordinate_grads(const Chunk<scalar_t>& ch, const scalar_t* grad_columns,
                      scalar_t* grad_offset, scalar_t* grad_mask) {
  using T = at::opmath_type<scalar_t>;
  const int64_t positions = sample_positions(ch);
  launch_over(positions, [&](auto index, unsigned int blocks) {
    using index_t = decltype(index);
    deform_coordinate_grad_kernel<scalar_t, T, index_t>
        <<<blocks, kThreads, 0, current_stream()>>>(
            ch, grad_columns, static_cast<index_t>(positions), grad_offset,
            grad_mask);
  });
}

// The input gradient's path outside deterministic mode.  The gather pays a
// sort of 4 contributions per sample position, shared by the offset group's
// channels, and then reads where the scatter would add: with many channels
// per offset group it wins, with few the sort is not paid back
// (kGatherMinChannels; docs/design.md).  Its
// scratch, 24 bytes per contribution with 32-bit keys and float weights, is
// 24 / cpg times the column buffer's.
// TORCHOPS_TESTING_DEFORM_INPUT_GRAD=auto|atomic|gather (read at each call)
// forces a path, so tests reach both at any size.
enum class InputGradPath { kAuto, kAtomic, kGather };
constexpr int64_t kGatherMinChannels = 128;

static_assert(env::value_at(env::kTestingDeformInputGrad, 1, "atomic") &&
              env::value_at(env::kTestingDeformInputGrad, 2, "gather"));

InputGradPath input_grad_path(const DeformGeometry& g) {
  const auto forced = static_cast<InputGradPath>(
      env::choice("deform_conv2d", env::kTestingDeformInputGrad));
  if (forced != InputGradPath::kAuto) {
    return forced;
  }
  return g.group_channels() >= kGatherMinChannels ? InputGradPath::kGather
                                                  : InputGradPath::kAtomic;
}

// float32 GEMMs as 3xTF32 (cuda/common/split_tf32.cuh) where PyTorch lets
// convolutions use TF32 (torch.backends.cudnn.conv.fp32_precision, "tf32"
// by default, or the older torch.backends.cudnn.allow_tf32): cuDNN's own
// convolution then runs one TF32 product, with 2^-11 relative error; three
// keep the error float32-sized, so results still agree with torchvision's
// exact float32 within float32 tolerances.  With TF32 off for convolutions,
// exact float32 (cuBLAS).  Only where it is faster: one weight group, and
// every GEMM dimension (O, C * kh * kw, images * pixels) at least 256:
// there three TF32 GEMMs take about half the exact one's time, while at 64
// channels they are slower.
constexpr int64_t kSplitMinDim = 256;

bool split_gemms(at::ScalarType ct, const DeformGemm& d, int64_t batch) {
  if (ct != at::kFloat || d.groups != 1 || d.out_channels < kSplitMinDim ||
      d.column_rows < kSplitMinDim || batch * d.pixels < kSplitMinDim) {
    return false;
  }
  return conv_uses_tf32();
}

// deform_forward_gemm with split columns (2 * CK, B * P), high parts first:
// out = [hi_w | hi_w] @ [hi_cols; lo_cols] + lo_w @ hi_cols, two GEMMs that
// read the columns once each and one extra add of the (small) output.
void split_forward_gemm(const DeformGemm& d, at::Tensor& out3, int64_t n0,
                        int64_t images, const at::Tensor& weight,
                        const at::Tensor& columns, const at::Tensor& bias) {
  const int64_t O = d.out_channels, CK = d.column_rows, P = d.pixels;
  const auto opts = columns.options();
  at::Tensor w2 = at::empty({O, 2 * CK}, opts), w_lo = at::empty({O, CK}, opts);
  float* w2p = w2.mutable_data_ptr<float>();
  split_tf32_rows(weight.view({O, CK}),
                  {w2p, w2p + CK, 2 * CK, w_lo.mutable_data_ptr<float>(), CK});
  const at::Tensor prod = matmul::gemm_tf32(w2, columns);
  const at::Tensor prod_lo = matmul::gemm_tf32(w_lo, columns.narrow(0, 0, CK));
  at::Tensor dst = out3.narrow(0, n0, images);
  at::add_out(dst, prod.view({O, images, P}).permute({1, 0, 2}), bias.view({1, O, 1}));
  dst.add_(prod_lo.view({O, images, P}).permute({1, 0, 2}));
}

// deform_backward_gemm with split columns: grad_columns = W^T @ grad as one
// GEMM over [hi_wt | hi_wt | lo_wt] @ [hi_g; lo_g; hi_g] (grad is small
// beside the columns, so it is the operand stored three times), and
// grad_weight += hi_g @ hi_cols^T + lo_g @ hi_cols^T + hi_g @ lo_cols^T as
// [hi_g; lo_g] @ hi_cols^T and hi_g @ lo_cols^T, summed (weight-sized).
void split_backward_gemm(const DeformGemm& d, const at::Tensor& grad3, int64_t n0,
                         int64_t images, const at::Tensor& weight,
                         const at::Tensor& columns, at::Tensor& grad_columns,
                         at::Tensor& grad_weight) {
  const int64_t O = d.out_channels, CK = d.column_rows, BP = images * d.pixels;
  const auto opts = columns.options();
  const at::Tensor grad_t =
      grad3.narrow(0, n0, images).permute({1, 0, 2}).contiguous().view({O, BP});
  at::Tensor g3 = at::empty({3 * O, BP}, opts);
  float* g3p = g3.mutable_data_ptr<float>();
  split_tf32_rows(grad_t, {g3p, g3p + 2 * O * BP, BP, g3p + O * BP, BP});
  at::Tensor wt3 = at::empty({CK, 3 * O}, opts);
  float* wt3p = wt3.mutable_data_ptr<float>();
  split_tf32_rows(weight.view({O, CK}).t().contiguous(),
                  {wt3p, wt3p + O, 3 * O, wt3p + 2 * O, 3 * O});
  matmul::gemm_tf32_out(grad_columns, wt3, g3);
  const at::Tensor hi_cols_t = columns.narrow(0, 0, CK).t();
  const at::Tensor lo_cols_t = columns.narrow(0, CK, CK).t();
  const at::Tensor two = matmul::gemm_tf32(g3.narrow(0, 0, 2 * O), hi_cols_t);
  const at::Tensor one = matmul::gemm_tf32(g3.narrow(0, 0, O), lo_cols_t);
  at::Tensor gw = grad_weight.view({O, CK});
  gw.add_(two.narrow(0, 0, O)).add_(two.narrow(0, O, O)).add_(one);
}

// The float32 forward's GEMM on Hopper while convolutions may use TF32:
// 3xTF32 with the split done in the kernel's registers (matmul::gemm_3xtf32_out,
// cuda/matmul/api.h), so the columns are written and read once, unsplit,
// and the bias rides along folded (as folds_bias's).  Pre-split columns
// (split_gemms, still the backward's) cost a second column buffer, which at
// 64 output channels made three TF32 products slower than one exact GEMM;
// split in the kernel they are faster (docs/design.md).  Only where the reduction
// is long (C * kh * kw >= kSplitMinDim): small layers keep exact float32.
// P % 4 == 0: the columns' batch stride must suit TMA.
bool folds_3xtf32(at::ScalarType ct, const DeformGemm& d) {
  return ct == at::kFloat && d.groups == 1 && d.column_rows >= kSplitMinDim &&
         d.pixels % 4 == 0 && conv_allows_tf32() && matmul::gemm_3xtf32_available();
}

// The forward's bias, folded into its GEMM: the columns get kBiasRows more
// rows -- ones, then zeros that keep the reduction a multiple of 4 -- and
// the weight the bias as a column, then zeros, so that one strided-batched
// GEMM writes weight @ columns + bias straight into the (B, O, P) output.
// Unfolded, the GEMM writes an (O, B * P) product that a transposing add of
// the bias copies into the output: a pass over the output, against the
// fold's reduction, kBiasRows longer.  The fold is faster only for
// float32 with fewer than kSplitMinDim output channels (with its writes
// in the im2col's launch, below); not at 256 channels, not for bfloat16,
// and only where cuBLAS runs the GEMM (one weight group, not under
// deterministic algorithms).
// Folding only where C * K > kBiasRows keeps the row counts of split
// columns (2 * C * K) and folded ones (C * K + kBiasRows) apart.  The
// fold's small writes ride in the im2col's launch (BiasFold).
bool folds_bias(at::ScalarType ct, const DeformGemm& d) {
  return ct == at::kFloat && d.groups == 1 && d.out_channels < kSplitMinDim &&
         d.column_rows > kBiasRows && !at::globalContext().deterministicAlgorithms();
}

// out[n0 : n0 + B] = w_fold @ columns, the columns' extra rows written
// (BiasFold): 3xTF32 where folds_3xtf32, else exact (cuBLAS).
void folded_forward_gemm(const DeformGemm& d, at::Tensor& out3, int64_t n0,
                         int64_t images, const at::Tensor& w_fold,
                         const at::Tensor& columns) {
  const int64_t O = d.out_channels, R = d.column_rows + kBiasRows, P = d.pixels;
  at::Tensor dst = out3.narrow(0, n0, images);
  const at::Tensor cols3 = columns.view({R, images, P}).permute({1, 0, 2});
  if (folds_3xtf32(at::kFloat, d) &&
      matmul::gemm_3xtf32_out(dst, w_fold.expand({images, O, R}), cols3)) {
    return;
  }
  if (images == 1) {
    at::Tensor o = dst.select(0, 0);
    at::mm_out(o, w_fold, cols3.select(0, 0));
  } else {
    at::bmm_out(dst, w_fold.expand({images, O, R}), cols3);
  }
}

// The steps of common/deform_conv2d_steps.h, on the GPU.
struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard prepare(const char* /*op*/,
                                      const DeformConvSizes& /*s*/,
                                      const at::Tensor& input) {
    return c10::cuda::CUDAGuard(input.device());
  }

  static at::ScalarType compute_type(at::ScalarType dtype) { return dtype; }

  static at::Tensor chunk_input(const at::Tensor& in, int64_t n0,
                                int64_t images) {
    return in.narrow(0, n0, images);
  }

  template <typename Name>
  static void im2col(const DeformChunkTensors& c, const at::Tensor& cols) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, cols.scalar_type(), Name::value, [&] {
          cuda::im2col(chunk_of<scalar_t>(c), cols.mutable_data_ptr<scalar_t>(),
                       cols.size(0) == 2 * c.g.channels * c.g.taps());
        });
  }

  static int64_t column_copies(at::ScalarType ct, const DeformGemm& d, int64_t batch) {
    return split_gemms(ct, d, batch) ? 2 : 1;
  }

  static int64_t forward_column_rows(at::ScalarType ct, const DeformGemm& d,
                                     int64_t batch) {
    // The in-kernel split first: the forward then writes one column buffer
    // where split_gemms would write two (the backward still splits).
    if (folds_3xtf32(ct, d)) {
      return d.column_rows + kBiasRows;
    }
    if (split_gemms(ct, d, batch)) {
      return 2 * d.column_rows;
    }
    return folds_bias(ct, d) ? d.column_rows + kBiasRows : d.column_rows;
  }

  static void forward_chunk(const DeformChunkTensors& c, const DeformGemm& d,
                            at::Tensor& out3, int64_t n0, int64_t images,
                            const at::Tensor& weight, const at::Tensor& cols,
                            const at::Tensor& bias, at::Tensor& scratch) {
    const int64_t rows = cols.size(0);
    if (rows == d.column_rows + kBiasRows) {
      // folds_bias or folds_3xtf32: float32 only.
      TORCH_INTERNAL_ASSERT(cols.scalar_type() == at::kFloat);
      const int64_t O = d.out_channels, CK = d.column_rows;
      at::Tensor w_fold = at::empty({O, CK + kBiasRows}, weight.options());
      float* cp = cols.mutable_data_ptr<float>();
      cuda::im2col(chunk_of<float>(c), cp, /*split=*/false,
                   BiasFold<float>{weight.const_data_ptr<float>(),
                                   bias.const_data_ptr<float>(),
                                   w_fold.mutable_data_ptr<float>(), cp + CK * cols.size(1),
                                   O, CK, cols.size(1)});
      folded_forward_gemm(d, out3, n0, images, w_fold, cols);
      return;
    }
    im2col<DeformForwardName>(c, cols);
    if (rows == 2 * d.column_rows) {
      split_forward_gemm(d, out3, n0, images, weight, cols, bias);
    } else {
      deform_forward_gemm(d, out3, n0, images, weight, cols, bias, scratch);
    }
  }

  static void backward_gemm(const DeformGemm& d, const at::Tensor& grad3,
                            int64_t n0, int64_t images, const at::Tensor& weight,
                            const at::Tensor& columns, at::Tensor& grad_columns,
                            at::Tensor& grad_weight) {
    if (columns.size(0) == 2 * d.column_rows) {
      split_backward_gemm(d, grad3, n0, images, weight, columns, grad_columns,
                          grad_weight);
    } else {
      deform_backward_gemm(d, grad3, n0, images, weight, columns, grad_columns,
                           grad_weight);
    }
  }

  static at::Tensor grad_bias(const at::Tensor& grad, const at::Tensor& /*go*/,
                              at::ScalarType acc) {
    return grad.sum({0, 2, 3}, /*keepdim=*/false, acc);
  }

  // The gather writes every element of grad_input itself; the atomic
  // scatter adds into zeros (float32 for half types).
  static bool gathers_input_grad(bool deterministic, const DeformGeometry& g) {
    return deterministic || input_grad_path(g) == InputGradPath::kGather;
  }

  static at::Tensor col2im_buffer(int64_t /*chunk*/,
                                  const DeformConvSizes& /*s*/,
                                  const at::TensorOptions& /*opts*/) {
    return at::Tensor();
  }

  static void input_grads(const DeformChunkTensors& c, const at::Tensor& gcols,
                          at::Tensor grad_offset, at::Tensor grad_mask,
                          at::Tensor grad_input, at::Tensor& /*buffer*/,
                          bool gathered) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, gcols.scalar_type(),
        DeformBackwardName::value, [&] {
          using T = at::opmath_type<scalar_t>;
          const Chunk<scalar_t> ch = chunk_of<scalar_t>(c);
          const scalar_t* gcp = gcols.const_data_ptr<scalar_t>();
          coordinate_grads(ch, gcp, grad_offset.mutable_data_ptr<scalar_t>(),
                           grad_mask.defined()
                               ? grad_mask.mutable_data_ptr<scalar_t>()
                               : nullptr);
          if (gathered) {
            col2im_deterministic(ch, gcp, gcols.options(),
                                 grad_input.mutable_data_ptr<scalar_t>());
          } else {
            col2im_atomic(ch, gcp, grad_input.mutable_data_ptr<T>());
          }
        });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("deform_conv2d", &deform_conv2d_forward<CudaKernels>);
  m.impl("_deform_conv2d_backward", &deform_conv2d_backward<CudaKernels>);
}

}  // namespace torchops::cuda
