// The suppression bitmask and its greedy resolution on the device, shared by
// the CUDA NMS kernels (nms, batched_nms, nms_rotated, batched_nms_rotated),
// which differ only in their box type and suppression test.
//
// Input: boxes already sorted by decreasing score (stable), `order` mapping
// each sorted position to its row, and for the batched ops each box's
// category.
//  Step 2, nms_mask_kernel: suppression bitmask over 64x64 tiles, upper
//     triangle only (row block <= column block), one 64-thread block per
//     tile, the tile's column boxes staged in shared memory.  Word r of tile
//     (rb, cb) holds, for row box rb*64+r, one bit per column box it
//     suppresses.  Diagonal tiles store the transposed relation instead: bit
//     j of word r says that box j < r of the block suppresses box r, which
//     is what step 3 needs.  Tiles are stored contiguously in row-major
//     triangle order, so the mask takes 64 * nb * (nb + 1) / 2 words for
//     nb = ceil(N / 64) (about N^2 / 16 bytes: 25 MB at 20k boxes, 626 MB at
//     100k).
//  Step 3, nms_resolve_kernel: greedy resolution, one 1024-thread block, one
//     step per 64-box block: warp 0 resolves block s with ballots (all
//     candidates that no earlier candidate of the block suppresses are kept
//     at once; their victims are dropped; repeat -- usually 1 to 3 rounds,
//     never more than 64), writes the kept indices straight into the output
//     (already compacted and in score order), and folds block s-1's kept
//     rows into block s's word itself.  Meanwhile the other 31 warps OR block
//     s-1's kept rows into the `removed` words of blocks s+1 .. nb-1, a few
//     lanes per word (coalesced: the 64 rows of a tile word are contiguous).
//     One __syncthreads per step; the tiles warp 0 needs next are prefetched.
//
// Work: N^2 / 2 suppression tests (step 2, fully parallel), then nb
// sequential steps whose memory traffic is sum over kept boxes of the words
// to their right.  The only host synchronisation reads the number of kept
// boxes, to size the result.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "common/boxes.h"
#include "cuda/common/launch.cuh"

namespace torchops::cuda {
// Internal linkage: every file that includes this gets its own kernels.
namespace {

using u64 = unsigned long long;

constexpr int kBits = 64;               // boxes per tile side, bits per word
constexpr int kResolveThreads = 1024;
constexpr int kResolveWarps = kResolveThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// `removed` (one word per block) lives in shared memory up to this many
// words (48 KB with the kernel's static buffers), else in global memory.
constexpr int64_t kMaxSharedWords = 6000;
// Tiles are indexed by blockIdx.x (at most 2^31 - 1).
constexpr int64_t kMaxBlocks = 65535;

// Tiles in the rows of the triangle above row block rb.
__host__ __device__ inline int64_t tiles_before(int64_t rb, int64_t nb) {
  return rb * nb - rb * (rb - 1) / 2;
}

// Index of tile (rb, cb), cb >= rb, in the triangle's row-major order.
__host__ __device__ inline int64_t tile_index(int64_t rb, int64_t cb,
                                              int64_t nb) {
  return tiles_before(rb, nb) + (cb - rb);
}

// Step 2 for any box type: `test(a, b)` says whether box a (higher score)
// suppresses box b.
template <typename BoxT, bool Batched, typename Test>
__global__ void __launch_bounds__(kBits) nms_mask_kernel(
    const BoxT* __restrict__ boxes, const int64_t* __restrict__ cls,
    int64_t n, int64_t nb, Test test, u64* __restrict__ mask) {
  __shared__ BoxT col_boxes[kBits];
  __shared__ int64_t col_cls[kBits];

  // Invert t = tiles_before(rb) + (cb - rb): the root of the quadratic,
  // then exact integer corrections for its rounding.
  const int64_t t = blockIdx.x;
  const double b = 2.0 * static_cast<double>(nb) + 1.0;
  int64_t rb = static_cast<int64_t>((b - sqrt(b * b - 8.0 * t)) / 2.0);
  rb = rb < 0 ? 0 : (rb > nb - 1 ? nb - 1 : rb);
  while (rb > 0 && tiles_before(rb, nb) > t) {
    --rb;
  }
  while (rb + 1 < nb && tiles_before(rb + 1, nb) <= t) {
    ++rb;
  }
  const int64_t cb = rb + (t - tiles_before(rb, nb));

  const int r = threadIdx.x;
  const int64_t row0 = rb * kBits;
  const int64_t col0 = cb * kBits;
  const int rows = static_cast<int>(min_of<int64_t>(kBits, n - row0));
  const int cols = static_cast<int>(min_of<int64_t>(kBits, n - col0));
  if (r < cols) {
    col_boxes[r] = boxes[col0 + r];
    if (Batched) {
      col_cls[r] = cls[col0 + r];
    }
  }
  __syncthreads();

  u64 bits = 0;
  if (r < rows) {
    const BoxT me = boxes[row0 + r];
    const int64_t my_cls = Batched ? cls[row0 + r] : 0;
    if (cb == rb) {
      // Which earlier boxes of the block suppress this one.  The earlier
      // (higher-scored) box goes first: the IoU is evaluated in the same
      // order as for every other pair.
      for (int j = 0; j < r; ++j) {
        if ((!Batched || col_cls[j] == my_cls) &&
            test(col_boxes[j], me)) {
          bits |= u64(1) << j;
        }
      }
    } else {
      for (int j = 0; j < cols; ++j) {
        if ((!Batched || col_cls[j] == my_cls) &&
            test(me, col_boxes[j])) {
          bits |= u64(1) << j;
        }
      }
    }
  }
  // Rows past N get 0, so the resolution can read whole tiles.
  mask[t * kBits + r] = bits;
}

__device__ inline u64 warp_or(u64 v, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    v |= __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ inline u64 ballot64(bool lo, bool hi) {
  return static_cast<u64>(__ballot_sync(kFullMask, lo)) |
         (static_cast<u64>(__ballot_sync(kFullMask, hi)) << 32);
}

// Warps 1..31 at step s: OR the rows `rows[0..k)` of row block `rb` (block
// s-1, kept boxes) into removed[cb] for cb in [first, nb).  g lanes share a
// word (g = k rounded up to a power of two, at most 32; two rows per lane
// when k > 32), so a warp covers 32 / g words per pass.
__device__ void or_kept_rows(const u64* __restrict__ mask, int64_t rb,
                             int64_t first, int64_t nb, int k,
                             const unsigned char* rows, u64* removed,
                             int worker, int lane) {
  int g = 1;
  while (g < k && g < 32) {
    g *= 2;
  }
  const int per_warp = 32 / g;
  const int sub = lane & (g - 1);
  const int64_t group = static_cast<int64_t>(worker) * per_warp + lane / g;
  const int64_t groups = static_cast<int64_t>(kResolveWarps - 1) * per_warp;
  const int r0 = sub < k ? rows[sub] : -1;
  const int r1 = sub + 32 < k ? rows[sub + 32] : -1;
  // Word r of tile (rb, cb) is mask[row_base + cb * kBits + r].
  const int64_t row_base = (tiles_before(rb, nb) - rb) * kBits;
  constexpr int kUnroll = 4;  // loads in flight per lane
  for (int64_t base = first; base < nb; base += kUnroll * groups) {
    u64 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t cb = base + u * groups + group;
      v[u] = 0;
      if (cb < nb) {
        const u64* word = mask + row_base + cb * kBits;
        if (r0 >= 0) {
          v[u] = word[r0];
        }
        if (r1 >= 0) {
          v[u] |= word[r1];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const u64 w = warp_or(v[u], g);
      const int64_t cb = base + u * groups + group;
      if (sub == 0 && cb < nb) {
        removed[cb] |= w;
      }
    }
  }
}

__global__ void __launch_bounds__(kResolveThreads) nms_resolve_kernel(
    const u64* __restrict__ mask, int64_t n, int64_t nb,
    const int64_t* __restrict__ order, int64_t* __restrict__ keep,
    int64_t* __restrict__ num_keep, u64* removed_global) {
  extern __shared__ u64 removed_shared[];
  __shared__ u64 kept_mask[2];               // by step parity
  __shared__ unsigned char kept_rows[2][kBits];

  u64* removed = removed_global != nullptr ? removed_global : removed_shared;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t w = threadIdx.x; w < nb; w += blockDim.x) {
    removed[w] = 0;
  }
  if (threadIdx.x < 2) {
    kept_mask[threadIdx.x] = 0;
  }

  // Warp 0's registers: this step's diagonal tile and the tile linking
  // block s-1 to block s (two words per lane: rows lane and lane + 32).
  u64 diag_lo = 0, diag_hi = 0, link_lo = 0, link_hi = 0;
  int64_t count = 0;
  if (warp == 0) {
    diag_lo = mask[lane];
    diag_hi = mask[lane + 32];
  }
  __syncthreads();

  for (int64_t s = 0; s < nb; ++s) {
    const int cur = static_cast<int>(s & 1);
    const int prev = cur ^ 1;
    if (warp == 0) {
      // Prefetch step s+1's tiles; they do not depend on this step.
      u64 next_diag_lo = 0, next_diag_hi = 0, next_link_lo = 0,
          next_link_hi = 0;
      if (s + 1 < nb) {
        const u64* d = mask + tile_index(s + 1, s + 1, nb) * kBits;
        const u64* l = mask + tile_index(s, s + 1, nb) * kBits;
        next_diag_lo = d[lane];
        next_diag_hi = d[lane + 32];
        next_link_lo = l[lane];
        next_link_hi = l[lane + 32];
      }
      // Block s's word: earlier blocks were folded in by warps 1..31 at
      // previous steps; block s-1's kept rows are folded in here.
      const u64 prev_kept = kept_mask[prev];
      u64 v = (((prev_kept >> lane) & 1) ? link_lo : 0) |
              (((prev_kept >> (lane + 32)) & 1) ? link_hi : 0);
      const u64 rem = removed[s] | warp_or(v, 32);
      const int64_t rows = min_of<int64_t>(kBits, n - s * kBits);
      const u64 valid = rows == kBits ? ~u64(0) : ((u64(1) << rows) - 1);
      u64 cand = ~rem & valid;
      // Greedy within the block.  A candidate that no earlier candidate
      // suppresses is kept (every box that could suppress it is gone);
      // candidates a newly kept box suppresses are dropped.  The lowest
      // candidate is always kept, so this terminates.
      u64 kept = 0;
      while (cand != 0) {
        const bool in_lo = (cand >> lane) & 1;
        const bool in_hi = (cand >> (lane + 32)) & 1;
        const u64 free = ballot64(in_lo && (diag_lo & cand) == 0,
                                  in_hi && (diag_hi & cand) == 0);
        const u64 dropped = ballot64(in_lo && (diag_lo & free) != 0,
                                     in_hi && (diag_hi & free) != 0);
        kept |= free;
        cand &= ~(free | dropped);
      }
      // Kept indices go straight to the output, in score order.
      if ((kept >> lane) & 1) {
        const int slot = __popcll(kept & ((u64(1) << lane) - 1));
        keep[count + slot] = order[s * kBits + lane];
        kept_rows[cur][slot] = static_cast<unsigned char>(lane);
      }
      if ((kept >> (lane + 32)) & 1) {
        const int slot = __popcll(kept & ((u64(1) << (lane + 32)) - 1));
        keep[count + slot] = order[s * kBits + lane + 32];
        kept_rows[cur][slot] = static_cast<unsigned char>(lane + 32);
      }
      count += __popcll(kept);
      if (lane == 0) {
        kept_mask[cur] = kept;
      }
      diag_lo = next_diag_lo;
      diag_hi = next_diag_hi;
      link_lo = next_link_lo;
      link_hi = next_link_hi;
    } else if (s > 0) {
      const int k = __popcll(kept_mask[prev]);
      if (k > 0) {
        or_kept_rows(mask, s - 1, s + 1, nb, k, kept_rows[prev], removed,
                     warp - 1, lane);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *num_keep = count;
  }
}

// Tile blocks for n > 0 boxes, checked against the grid's limit.
inline int64_t nms_blocks(const char* op, int64_t n) {
  const int64_t nb = ceil_div(n, kBits);
  TORCH_CHECK(
      nb <= kMaxBlocks, "torchops.", op, ": 'boxes' has ", n,
      " rows; at most ", kMaxBlocks * kBits, " are supported");
  return nb;
}

// Step 2's mask for nb blocks (every word is written by the kernel).
inline at::Tensor new_nms_mask(int64_t nb, const at::TensorOptions& long_opts) {
  return at::empty({nb * (nb + 1) / 2 * kBits}, long_opts);
}

// Step 2 over sorted boxes; `cls` (sorted categories) or nullptr.
template <typename BoxT, typename Test>
void launch_nms_mask(const BoxT* boxes, const int64_t* cls, int64_t n,
                     int64_t nb, Test test, at::Tensor& mask) {
  const int64_t tiles = nb * (nb + 1) / 2;
  u64* mask_p = reinterpret_cast<u64*>(mask.mutable_data_ptr<int64_t>());
  if (cls != nullptr) {
    nms_mask_kernel<BoxT, true, Test><<<tiles, kBits, 0, current_stream()>>>(
        boxes, cls, n, nb, test, mask_p);
  } else {
    nms_mask_kernel<BoxT, false, Test><<<tiles, kBits, 0, current_stream()>>>(
        boxes, nullptr, n, nb, test, mask_p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Step 3: the kept rows (order[p] of the kept positions p), by decreasing
// score.
inline at::Tensor resolve_nms_mask(const at::Tensor& mask, int64_t n,
                                   int64_t nb, const int64_t* order_p,
                                   const at::TensorOptions& long_opts) {
  at::Tensor keep = at::empty({n}, long_opts);
  at::Tensor num_keep = at::empty({1}, long_opts);
  at::Tensor removed;
  size_t shared_bytes = static_cast<size_t>(nb) * sizeof(u64);
  if (nb > kMaxSharedWords) {
    removed = at::empty({nb}, long_opts);
    shared_bytes = 0;
  }
  nms_resolve_kernel<<<1, kResolveThreads, shared_bytes, current_stream()>>>(
      reinterpret_cast<const u64*>(mask.const_data_ptr<int64_t>()), n, nb,
      order_p, keep.mutable_data_ptr<int64_t>(),
      num_keep.mutable_data_ptr<int64_t>(),
      removed.defined()
          ? reinterpret_cast<u64*>(removed.mutable_data_ptr<int64_t>())
          : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The only host synchronisation: the result's length.
  const int64_t kept = num_keep.item<int64_t>();
  return keep.narrow(0, 0, kept);
}

}  // namespace
}  // namespace torchops::cuda
