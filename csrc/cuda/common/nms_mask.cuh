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
// boxes, to size the result (nms_padded reads none).
//
// Small inputs take one launch instead of a sort, a gather and steps 2
// and 3, because there latency is everything: nms_small_kernel, for up to
// kSmallMax boxes whose mask fits in shared memory (nms_small_fits).  Every
// block sorts all N scores itself (a block radix sort costs less than a
// second launch), computes its share of the tiles from the boxes in that
// order, and the block that arrives last (an arrival counter, zeroed by a
// 4-byte memset before the launch) copies the mask into shared memory and
// resolves it with one warp, without a barrier per step.  No host work
// depends on the data, so the launch can be captured in a CUDA graph.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cub/block/block_radix_sort.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

// Tile t of the triangle: its row block rb and column block cb.
__device__ inline void tile_blocks(int64_t t, int64_t nb, int64_t& rb,
                                   int64_t& cb) {
  // Invert t = tiles_before(rb) + (cb - rb): the root of the quadratic,
  // then exact integer corrections for its rounding.
  const double b = 2.0 * static_cast<double>(nb) + 1.0;
  rb = static_cast<int64_t>((b - sqrt(b * b - 8.0 * static_cast<double>(t))) / 2.0);
  rb = rb < 0 ? 0 : (rb > nb - 1 ? nb - 1 : rb);
  while (rb > 0 && tiles_before(rb, nb) > t) {
    --rb;
  }
  while (rb + 1 < nb && tiles_before(rb + 1, nb) <= t) {
    ++rb;
  }
  cb = rb + (t - tiles_before(rb, nb));
}

// The bits of columns [j0, j1) of word r of a tile: row box `me` against
// the tile's column boxes.
template <bool Batched, typename BoxT, typename Test>
__device__ inline u64 tile_word(const BoxT& me, int64_t my_cls,
                                const BoxT* col_boxes, const int64_t* col_cls,
                                int r, int j0, int j1, bool diagonal,
                                const Test& test) {
  u64 bits = 0;
  if (diagonal) {
    // Which earlier boxes of the block suppress this one.  The earlier
    // (higher-scored) box goes first: the IoU is evaluated in the same
    // order as for every other pair.
    for (int j = j0; j < j1 && j < r; ++j) {
      if ((!Batched || col_cls[j] == my_cls) && test(col_boxes[j], me)) {
        bits |= u64(1) << j;
      }
    }
  } else {
    for (int j = j0; j < j1; ++j) {
      if ((!Batched || col_cls[j] == my_cls) && test(me, col_boxes[j])) {
        bits |= u64(1) << j;
      }
    }
  }
  return bits;
}

// Step 2 for any box type: `test(a, b)` says whether box a (higher score)
// suppresses box b.
template <typename BoxT, bool Batched, typename Test>
__global__ void __launch_bounds__(kBits) nms_mask_kernel(
    const BoxT* __restrict__ boxes, const int64_t* __restrict__ cls,
    int64_t n, int64_t nb, Test test, u64* __restrict__ mask) {
  __shared__ BoxT col_boxes[kBits];
  __shared__ int64_t col_cls[kBits];

  const int64_t t = blockIdx.x;
  int64_t rb, cb;
  tile_blocks(t, nb, rb, cb);
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
    bits = tile_word<Batched>(boxes[row0 + r], Batched ? cls[row0 + r] : 0,
                              col_boxes, col_cls, r, 0, cols, cb == rb, test);
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

// Warps 1..kWarps-1 at step s: OR the rows `rows[0..k)` of row block `rb` (block
// s-1, kept boxes) into removed[cb] for cb in [first, nb).  g lanes share a
// word (g = k rounded up to a power of two, at most 32; two rows per lane
// when k > 32), so a warp covers 32 / g words per pass.
template <int kWarps>
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
  const int64_t groups = static_cast<int64_t>(kWarps - 1) * per_warp;
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

// Block s of step 3, by one warp: the greedy within the block over the
// candidates `cand` (diag_lo, diag_hi: this lane's rows, lane and lane + 32,
// of the diagonal tile).  A candidate that no earlier candidate suppresses
// is kept (every box that could suppress it is gone); candidates a newly
// kept box suppresses are dropped.  The lowest candidate is always kept, so
// this terminates.  The kept rows go straight to keep[count, ...) as
// order[s * 64 + row], in score order, and are listed in rows_out; returns
// them as bits.
template <typename OrderT>
__device__ u64 keep_block(u64 cand, u64 diag_lo, u64 diag_hi, int64_t s,
                          const OrderT* order, int64_t* keep, int64_t count,
                          unsigned char* rows_out) {
  const int lane = threadIdx.x % 32;
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
  if ((kept >> lane) & 1) {
    const int slot = __popcll(kept & ((u64(1) << lane) - 1));
    keep[count + slot] = static_cast<int64_t>(order[s * kBits + lane]);
    rows_out[slot] = static_cast<unsigned char>(lane);
  }
  if ((kept >> (lane + 32)) & 1) {
    const int slot = __popcll(kept & ((u64(1) << (lane + 32)) - 1));
    keep[count + slot] = static_cast<int64_t>(order[s * kBits + lane + 32]);
    rows_out[slot] = static_cast<unsigned char>(lane + 32);
  }
  return kept;
}

// Step 3 by one block of kWarps warps (see the top of the file): the kept
// rows order[p] of the kept positions p go to keep[0, count), by decreasing
// score; *num_keep = count; with `pad`, keep[count, n) = -1.  `removed`
// holds nb words.  `order` is the sorted positions' rows (int64_t in global
// memory, or uint16_t in the single-launch kernel's shared memory).
template <int kWarps, typename OrderT>
__device__ void resolve_nms(const u64* __restrict__ mask, int64_t n, int64_t nb,
                            const OrderT* order, int64_t* keep,
                            int64_t* num_keep, u64* removed, bool pad) {
  __shared__ u64 kept_mask[2];               // by step parity
  __shared__ unsigned char kept_rows[2][kBits];
  __shared__ int64_t kept_count;

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
      // Block s's word: earlier blocks were folded in by the other warps at
      // previous steps; block s-1's kept rows are folded in here.
      const u64 prev_kept = kept_mask[prev];
      u64 v = (((prev_kept >> lane) & 1) ? link_lo : 0) |
              (((prev_kept >> (lane + 32)) & 1) ? link_hi : 0);
      const u64 rem = removed[s] | warp_or(v, 32);
      const int64_t rows = min_of<int64_t>(kBits, n - s * kBits);
      const u64 valid = rows == kBits ? ~u64(0) : ((u64(1) << rows) - 1);
      const u64 cand = ~rem & valid;
      const u64 kept = keep_block(cand, diag_lo, diag_hi, s, order, keep,
                                  count, kept_rows[cur]);
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
        or_kept_rows<kWarps>(mask, s - 1, s + 1, nb, k, kept_rows[prev],
                             removed, warp - 1, lane);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *num_keep = count;
    kept_count = count;
  }
  if (pad) {
    __syncthreads();
    for (int64_t i = kept_count + threadIdx.x; i < n; i += blockDim.x) {
      keep[i] = -1;
    }
  }
}

__global__ void __launch_bounds__(kResolveThreads) nms_resolve_kernel(
    const u64* __restrict__ mask, int64_t n, int64_t nb,
    const int64_t* __restrict__ order, int64_t* __restrict__ keep,
    int64_t* __restrict__ num_keep, u64* removed_global, bool pad) {
  extern __shared__ u64 removed_shared[];
  resolve_nms<kResolveWarps>(
      mask, n, nb, order, keep, num_keep,
      removed_global != nullptr ? removed_global : removed_shared, pad);
}

// --- the single launch for small inputs ------------------------------------

constexpr int kSmallThreads = 256;
constexpr int kSmallItems = 8;  // sort keys per thread
constexpr int kSmallMax = kSmallThreads * kSmallItems;
constexpr int kQuarter = kBits / (kSmallThreads / kBits);  // columns per thread

// Sort keys: unsigned integers in the order of at::sort(descending)'s
// comparison of T -- NaN above everything (torch.sort's rule), -0 = +0 --
// with 0 left for the sort's padding, below every real key.
__device__ __forceinline__ uint32_t score_key(float x) {
  if (x != x) {
    return 0xffffffffu;
  }
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint64_t score_key(double x) {
  if (x != x) {
    return ~uint64_t(0);
  }
  const auto u = static_cast<uint64_t>(__double_as_longlong(x == 0.0 ? 0.0 : x));
  return (u >> 63) ? ~u : (u | (uint64_t(1) << 63));
}

// The mask of the single launch, in the order its resolution reads it:
// row block rb's strip holds, for each of its 64 rows, the words of column
// blocks rb .. nb-1 side by side.  So when lane c reads column block c's
// word of one row, the warp reads consecutive words.
__device__ __forceinline__ int64_t strip_word(int64_t rb, int64_t cb, int r,
                                              int64_t nb) {
  return kBits * tiles_before(rb, nb) + r * (nb - rb) + (cb - rb);
}

// Step 3 by one warp, the mask in shared memory (strip layout, nb <= 32
// blocks).  Lane c keeps block c's `removed` word in a register; at step s
// it ORs in block s's kept rows' words for block c: the kept rows are
// listed in shared memory first, so the loads are independent, eight in
// flight.  No barrier between steps.
template <typename OrderT>
__device__ void resolve_strips(const u64* mask, int n, int nb,
                               const OrderT* order, int64_t* keep,
                               int64_t* num_keep) {
  __shared__ unsigned char kept_rows[kBits];
  const int lane = threadIdx.x % 32;
  u64 removed = 0;
  int64_t count = 0;
  for (int s = 0; s < nb; ++s) {
    const int width = nb - s;
    const u64* strip = mask + kBits * tiles_before(s, nb);
    const u64 diag_lo = strip[lane * width];
    const u64 diag_hi = strip[(lane + 32) * width];
    const u64 rem = __shfl_sync(kFullMask, removed, s);
    const int rows = min_of(kBits, n - s * kBits);
    const u64 valid = rows == kBits ? ~u64(0) : ((u64(1) << rows) - 1);
    const u64 cand = ~rem & valid;
    const u64 kept = keep_block(cand, diag_lo, diag_hi, s, order, keep, count,
                                kept_rows);
    const int k = __popcll(kept);
    count += k;
    __syncwarp();
    const bool later = lane > s && lane < nb;
    u64 acc = 0;
    constexpr int kInFlight = 8;
    for (int u0 = 0; u0 < k; u0 += kInFlight) {
      u64 w[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        w[u] = later && u0 + u < k ? strip[kept_rows[u0 + u] * width + (lane - s)] : 0;
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        acc |= w[u];
      }
    }
    removed |= acc;
    __syncwarp();  // the list is rewritten at the next step
  }
  if (lane == 0) {
    *num_keep = count;
  }
}

// Source: the op's inputs, read in place.  `score(i)` in T (exact for every
// dtype: the half types widen to float), `box(i)` as the gather of the
// multi-launch path converts it, `category(i)` for the batched ops.
template <typename T, typename BoxT, bool Batched, typename Source,
          typename Test>
__global__ void __launch_bounds__(kSmallThreads) nms_small_kernel(
    Source src, int n, int nb, Test test, u64* mask, unsigned int* arrivals,
    int64_t* keep, int64_t* num_keep, bool pad) {
  using Key = decltype(score_key(T(0)));
  using Sort = cub::BlockRadixSort<Key, kSmallThreads, kSmallItems, uint16_t>;
  __shared__ union {
    typename Sort::TempStorage sort;
    struct {
      BoxT boxes[kBits];
      int64_t cls[kBits];
      u64 words[kBits];
    } tile;
  } scratch;
  __shared__ uint16_t order[kSmallMax];
  __shared__ bool last;

  // 1. Every block sorts the n scores: a stable radix sort of their keys,
  //    descending, each thread holding consecutive rows (the blocked
  //    arrangement), so equal keys keep the rows' order.
  {
    Key keys[kSmallItems];
    uint16_t rows[kSmallItems];
#pragma unroll
    for (int u = 0; u < kSmallItems; ++u) {
      const int i = threadIdx.x * kSmallItems + u;
      keys[u] = i < n ? score_key(src.score(i)) : Key(0);
      rows[u] = static_cast<uint16_t>(i);
    }
    Sort(scratch.sort).SortDescending(keys, rows);
#pragma unroll
    for (int u = 0; u < kSmallItems; ++u) {
      order[threadIdx.x * kSmallItems + u] = rows[u];
    }
  }
  __syncthreads();

  // 2. This block's tiles, one at a time: thread (q, r) tests row r of the
  //    tile against its q-th quarter of the columns; the quarters meet in
  //    a shared word.  Words go to the strip layout.
  const int r = threadIdx.x % kBits;
  const int q = threadIdx.x / kBits;
  const int64_t tiles = static_cast<int64_t>(nb) * (nb + 1) / 2;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t rb, cb;
    tile_blocks(t, nb, rb, cb);
    const int rows = min_of<int>(kBits, n - static_cast<int>(rb) * kBits);
    const int cols = min_of<int>(kBits, n - static_cast<int>(cb) * kBits);
    if (threadIdx.x < cols) {
      const int row = order[cb * kBits + threadIdx.x];
      scratch.tile.boxes[threadIdx.x] = src.box(row);
      if (Batched) {
        scratch.tile.cls[threadIdx.x] = src.category(row);
      }
    }
    if (threadIdx.x < kBits) {
      scratch.tile.words[threadIdx.x] = 0;
    }
    __syncthreads();
    if (r < rows) {
      const int row = order[rb * kBits + r];
      const int j0 = q * kQuarter;
      const u64 bits = tile_word<Batched>(
          src.box(row), Batched ? src.category(row) : 0, scratch.tile.boxes,
          scratch.tile.cls, r, j0, min_of(cols, j0 + kQuarter), cb == rb, test);
      if (bits != 0) {
        atomicOr(&scratch.tile.words[r], bits);
      }
    }
    __syncthreads();
    if (threadIdx.x < kBits) {
      mask[strip_word(rb, cb, threadIdx.x, nb)] = scratch.tile.words[threadIdx.x];
    }
    __syncthreads();
  }

  // 3. The last block to arrive resolves, from shared memory.  Each
  //    thread's mask writes are made visible device-wide before its block
  //    counts itself in; the words are read back from L2 (ld.global.cg),
  //    never through L1, which may hold older data.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(arrivals, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) {
    return;
  }
  __threadfence();
  extern __shared__ uint4 staged[];  // tiles * 64 words: an even count
  const uint4* from = reinterpret_cast<const uint4*>(mask);
  const int chunks = static_cast<int>(tiles) * (kBits / 2);
#pragma unroll 8
  for (int i = threadIdx.x; i < chunks; i += kSmallThreads) {
    staged[i] = __ldcg(from + i);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    resolve_strips(reinterpret_cast<const u64*>(staged), n, nb, order, keep,
                   num_keep);
  }
  if (pad) {
    __syncthreads();
    const int64_t kept = *num_keep;
    for (int64_t i = kept + threadIdx.x; i < n; i += blockDim.x) {
      keep[i] = -1;
    }
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

// Step 3 into keep (n rows) and num_keep (one int64): the kept rows
// (order[p] of the kept positions p), by decreasing score; with `pad`, the
// rest of keep is -1.
inline void resolve_nms_mask(const at::Tensor& mask, int64_t n, int64_t nb,
                             const int64_t* order_p, at::Tensor& keep,
                             at::Tensor& num_keep, bool pad) {
  at::Tensor removed;
  size_t shared_bytes = static_cast<size_t>(nb) * sizeof(u64);
  if (nb > kMaxSharedWords) {
    removed = at::empty({nb}, keep.options());
    shared_bytes = 0;
  }
  nms_resolve_kernel<<<1, kResolveThreads, shared_bytes, current_stream()>>>(
      reinterpret_cast<const u64*>(mask.const_data_ptr<int64_t>()), n, nb,
      order_p, keep.mutable_data_ptr<int64_t>(),
      num_keep.mutable_data_ptr<int64_t>(),
      removed.defined()
          ? reinterpret_cast<u64*>(removed.mutable_data_ptr<int64_t>())
          : nullptr,
      pad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// nms's result: the first *num_keep rows of keep.  The one host
// synchronisation of the NMS ops.
inline at::Tensor kept_prefix(const at::Tensor& keep, const at::Tensor& num_keep) {
  return keep.narrow(0, 0, num_keep.item<int64_t>());
}

// The single launch's kernel serves n boxes when there are at most
// kSmallMax and their mask fits the device's shared memory.
template <typename T, typename BoxT, bool Batched, typename Source, typename Test>
bool nms_small_fits(int64_t n) {
  if (n > kSmallMax) {
    return false;
  }
  const int64_t nb = ceil_div(n, kBits);
  const size_t mask_bytes = static_cast<size_t>(nb * (nb + 1) / 2) * kBits * sizeof(u64);
  return mask_bytes <= dynamic_shared_limit(&nms_small_kernel<T, BoxT, Batched, Source, Test>);
}

// Steps 1-3 in one launch for 0 < n boxes that nms_small_fits (see the top
// of the file), into keep and num_keep as resolve_nms_mask writes them.
template <typename T, typename BoxT, bool Batched, typename Source, typename Test>
void launch_nms_small(const Source& src, int64_t n, Test test, at::Tensor& keep,
                      at::Tensor& num_keep, bool pad) {
  const int64_t nb = ceil_div(n, kBits);
  const int64_t tiles = nb * (nb + 1) / 2;
  // The mask, then one word for the arrival counter.
  at::Tensor scratch = at::empty({tiles * kBits + 1}, keep.options());
  u64* mask_p = reinterpret_cast<u64*>(scratch.mutable_data_ptr<int64_t>());
  auto* arrivals = reinterpret_cast<unsigned int*>(mask_p + tiles * kBits);
  const cudaStream_t stream = current_stream();
  C10_CUDA_CHECK(cudaMemsetAsync(arrivals, 0, sizeof(unsigned int), stream));
  // Blocks take tiles in turn; no more blocks than fit on the device at
  // once, since a second wave would sort the scores again.
  const size_t mask_bytes = static_cast<size_t>(tiles) * kBits * sizeof(u64);
  auto* kernel = &nms_small_kernel<T, BoxT, Batched, Source, Test>;
  const int64_t resident =
      int64_t(sm_count(keep)) * resident_blocks(kernel, kSmallThreads, mask_bytes);
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>(tiles, resident));
  kernel<<<blocks, kSmallThreads, mask_bytes, stream>>>(
          src, static_cast<int>(n), static_cast<int>(nb), test, mask_p, arrivals,
          keep.mutable_data_ptr<int64_t>(), num_keep.mutable_data_ptr<int64_t>(), pad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace torchops::cuda
