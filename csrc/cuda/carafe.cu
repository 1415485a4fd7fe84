// CUDA kernels of torchops.carafe and its backward.
//
// The forward is memory-bound (an FPN level, 2 x 256 x 100 x 152 -> 200 x
// 304 with k = 5: 168 MB of compulsory traffic for 1.6 GFLOP), so each input
// is read about once, each output written once, with coalesced accesses:
//
//  * Tiled forward (k = 1, 3, 5, 7).  A block takes a tile of source pixels
//    of one (image, group) and a chunk of its channels.  Each thread owns a
//    PH x PW block of output pixels inside one source pixel's s x s block,
//    so they all read the same k x k neighbourhood: the thread keeps their
//    PH PW k^2 mask weights in registers (read once, shared by every
//    channel), and per channel reads the neighbourhood from shared memory
//    once for PH PW k^2 multiply-adds (2 x 2 for even s: one shared load per
//    four FMAs, the rate shared memory sustains).  The features of the tile
//    plus its halo are staged a few channels at a time, converted to the
//    compute type.  Adjacent threads own adjacent output columns, so mask
//    loads and output stores coalesce (PW = 2: one 2-element store per row).
//    Channel chunks (when the tiles alone would not fill the GPU) re-read
//    the masks, from L2.
//
// The backward is a gather everywhere: no atomics, and bitwise the same on
// every run, whatever torch.use_deterministic_algorithms says.
//
//  * grad_masks (tiled for k <= 7): the forward's tiling; each thread
//    accumulates grad * feature for its PH PW k^2 mask weights over all the
//    group's channels in order (so a block takes every channel of its tile,
//    and tiles shrink when there are too few of them), then writes them.
//  * grad_features (tiled for k <= 7, s <= 2 where the weights fit in
//    registers): a thread per feature pixel holds the mask weights of the
//    k^2 s^2 output pixels whose neighbourhoods contain it, and per channel
//    sums grad times weight over them, reading grad from a staged tile.
//    The tile stores each output row split by column parity (column ox of
//    sub-column j at [j][ox / s]) so that neighbouring threads read
//    neighbouring words.
//  * Generic kernels (any k and s): one thread per output value, reading
//    global memory directly; they also serve shapes the tiles cannot (huge
//    maps, large s).  TORCHOPS_TESTING_CARAFE_PATH=generic forces them and
//    =tiled requires the tiled kernels (raising where they cannot run), so
//    the tests can compare the two.
//
// Half types compute in float.  Every tap contributes (feature or zero
// padding) x weight, as in the unfold formulation.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "common/carafe.h"
#include "common/env.h"
#include "common/carafe_steps.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 128;           // at most, per tiled block
constexpr int kMinBlocksPerSm = 3;      // register cap: 65536 / (128 * 3)
constexpr int kTileCols = 32;           // source columns of a full tile
constexpr int kStageSlots = 4;          // staged values per thread and channel
constexpr int kMaxStagedChannels = 8;   // channels staged per pass
constexpr int kSmemBudget = 24 * 1024;  // staging bytes per block
constexpr int kGenericThreads = 256;

// ---------------------------------------------------------------------------
// Testing switch
// ---------------------------------------------------------------------------

enum class PathChoice { kAuto, kGeneric, kTiled };

static_assert(env::value_at(env::kTestingCarafePath, 1, "generic") &&
              env::value_at(env::kTestingCarafePath, 2, "tiled"));

PathChoice path_choice(const char* op) {
  return static_cast<PathChoice>(env::choice(op, env::kTestingCarafePath));
}

// Raises when the testing switch requires the tiled kernels and `kernel`
// could not run tiled.
void check_forced_path(const char* op, const char* kernel, bool tiled) {
  TORCH_CHECK(tiled || path_choice(op) != PathChoice::kTiled, "torchops.", op,
              ": TORCHOPS_TESTING_CARAFE_PATH=tiled, but the tiled ", kernel,
              " kernel cannot run this call (kernel size, scale factor or "
              "sizes out of its range)");
}

// ---------------------------------------------------------------------------
// Tiling
// ---------------------------------------------------------------------------

// Everything a tiled kernel needs, by value.
struct TileArgs {
  int64_t h, w, ho, wo;        // feature and output sizes
  int64_t plane, oplane;       // h w, ho wo
  int g, cg, s;                // groups, channels per group, scale
  int tile_w, tile_h;          // source pixels of a tile
  int cw, ch;                  // thread blocks of outputs across / down a tile
  int tiles_w, tiles_h;
  int chunks, chunk_channels;  // channel chunks (a grid dimension)
  int cb;                      // channels staged per pass
  int sp;                      // staged values per channel
};

struct BlockPos {
  int64_t ng;  // image * groups + group
  int x0, y0;  // tile origin, source pixels
  int c0, c1;  // channel range within the group
};

__device__ __forceinline__ BlockPos block_pos(const TileArgs& a) {
  int64_t b = blockIdx.x;
  BlockPos p;
  const int chunk = static_cast<int>(b % a.chunks);
  b /= a.chunks;
  p.x0 = static_cast<int>(b % a.tiles_w) * a.tile_w;
  b /= a.tiles_w;
  p.y0 = static_cast<int>(b % a.tiles_h) * a.tile_h;
  p.ng = b / a.tiles_h;
  p.c0 = chunk * a.chunk_channels;
  p.c1 = min(a.cg, p.c0 + a.chunk_channels);
  return p;
}

// The register budget of the weights a thread keeps: about 100 32-bit
// registers, so that three 128-thread blocks fit an SM without spills.
constexpr int kWeightWords = 100;

template <typename T>
constexpr int words_of() {
  return static_cast<int>(sizeof(T) / 4);
}

// Output pixels per thread (rows, columns) of the tiled forward and
// grad_masks kernels for an even scale; odd scales take 1 x 1.
template <typename T, int K>
constexpr int big_rows() {
  return K * K * 4 * words_of<T>() <= kWeightWords ? 2 : 1;
}
template <typename T, int K>
constexpr int big_cols() {
  return K * K * 2 * words_of<T>() <= kWeightWords ? 2 : 1;
}

// Whether the tiled grad_features kernel holds the k^2 s^2 weights.
template <typename T, int K, int S>
constexpr bool grad_features_fits() {
  return K * K * S * S * words_of<T>() <= kWeightWords;
}

// Coordinates stay int32 in the tiled kernels (offsets into a plane
// included); the generic kernels take the rest.
bool small_maps(const CarafeShape& p) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max() / 4;
  return p.h <= kMax && p.w <= kMax && p.ho <= kMax && p.wo <= kMax &&
         p.h * p.w <= kMax;
}

struct Plan {
  bool ok = false;
  TileArgs a{};
  int threads = 0;
  int64_t blocks = 0;
  size_t smem = 0;
};

// Channel chunks: enough blocks for about eight per SM, at least 16
// channels each.
void split_channels(TileArgs& a, int64_t base_blocks, int sms) {
  const int64_t want = ceil_div(8 * static_cast<int64_t>(sms), std::max<int64_t>(base_blocks, 1));
  const int64_t most = std::max<int64_t>(1, ceil_div(a.cg, 16));
  const int64_t chunks = std::max<int64_t>(1, std::min(want, most));
  a.chunk_channels = static_cast<int>(ceil_div(a.cg, chunks));
  a.chunks = static_cast<int>(ceil_div(a.cg, a.chunk_channels));
}

TileArgs base_args(const CarafeShape& p) {
  TileArgs a{};
  a.h = p.h;
  a.w = p.w;
  a.ho = p.ho;
  a.wo = p.wo;
  a.plane = p.h * p.w;
  a.oplane = p.ho * p.wo;
  a.g = static_cast<int>(p.g);
  a.cg = static_cast<int>(p.group_channels());
  a.s = static_cast<int>(p.s);
  a.chunks = 1;
  a.chunk_channels = a.cg;
  return a;
}

bool finish_plan(Plan& plan, const CarafeShape& p, size_t per_channel_bytes) {
  TileArgs& a = plan.a;
  a.tiles_w = static_cast<int>(ceil_div(p.w, a.tile_w));
  a.tiles_h = static_cast<int>(ceil_div(p.h, a.tile_h));
  a.cb = static_cast<int>(std::clamp<int64_t>(
      kSmemBudget / static_cast<int64_t>(per_channel_bytes), 1, kMaxStagedChannels));
  plan.smem = per_channel_bytes * a.cb;
  plan.blocks = p.n * p.g * a.tiles_w * a.tiles_h * a.chunks;
  return plan.blocks <= std::numeric_limits<int32_t>::max();
}

// The forward / grad_masks tiling for a thread block of ph x pw outputs.
// A warp spans 32 threads' blocks across an output row where it can
// (tile_w = 32 / (s / pw) source columns); rows fill the block up to 128
// threads, at most `max_tile_h` source rows.
Plan plan_pixel_tiles(const CarafeShape& p, int k, int ph, int pw,
                      size_t elem, int max_tile_h) {
  Plan plan;
  if (!small_maps(p) || p.s % ph != 0 || p.s % pw != 0 || p.s > 64) {
    return plan;
  }
  TileArgs a = base_args(p);
  const int sub_w = a.s / pw, sub_h = a.s / ph;
  if (sub_w > kTileCols) {
    return plan;
  }
  a.tile_w = kTileCols / sub_w;
  a.cw = a.tile_w * sub_w;
  a.tile_h = std::max(1, std::min(max_tile_h, (kThreads / a.cw) / sub_h));
  a.ch = a.tile_h * sub_h;
  if (a.cw * a.ch > kThreads) {
    return plan;
  }
  plan.threads = static_cast<int>(ceil_div(a.cw * a.ch, 32) * 32);
  // Staged rows have a fixed pitch (a full tile and its halo), so the
  // kernels address them with constants.
  a.sp = (a.tile_h + k - 1) * (kTileCols + k - 1);
  if (a.sp > kStageSlots * plan.threads) {
    return plan;
  }
  plan.a = a;
  plan.ok = finish_plan(plan, p, static_cast<size_t>(a.sp) * elem);
  return plan;
}

// ---------------------------------------------------------------------------
// Staging of a feature tile (forward, grad_masks)
// ---------------------------------------------------------------------------

constexpr int kPad = -1;     // the slot holds zero padding
constexpr int kNoSlot = -2;  // this thread has no such slot

// The staged values this thread loads for every channel: offsets within a
// feature plane, the same for every channel (computed once).
template <int K>
struct StageSlots {
  int off[kStageSlots];

  __device__ __forceinline__ StageSlots(const TileArgs& a, int y0, int x0) {
    constexpr int R = (K - 1) / 2, kPitch = kTileCols + K - 1;
#pragma unroll
    for (int i = 0; i < kStageSlots; ++i) {
      const int e = threadIdx.x + i * blockDim.x;
      if (e >= a.sp) {
        off[i] = kNoSlot;
        continue;
      }
      const int y = y0 - R + e / kPitch, x = x0 - R + e % kPitch;
      off[i] = (y >= 0 && y < a.h && x >= 0 && x < a.w)
                   ? static_cast<int>(y * a.w + x)
                   : kPad;
    }
  }

  // tile[c][e] = channel c of `src` (nc channels, planes `plane` apart) at
  // staged position e, as T.  Two channels per step keep eight loads in
  // flight.
  template <typename scalar_t, typename T>
  __device__ __forceinline__ void stage(T* tile, const scalar_t* src,
                                        int64_t plane, int nc, int sp) const {
    for (int c = 0; c < nc; c += 2) {
      T v[2][kStageSlots];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int i = 0; i < kStageSlots; ++i) {
          v[u][i] = (c + u < nc && off[i] >= 0)
                        ? static_cast<T>(src[(c + u) * plane + off[i]])
                        : T(0);
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int i = 0; i < kStageSlots; ++i) {
          if (c + u < nc && off[i] != kNoSlot) {
            tile[(c + u) * sp + threadIdx.x + i * blockDim.x] = v[u][i];
          }
        }
      }
    }
  }
};

// This thread's PH x PW output block in a forward / grad_masks tile.
template <int PH, int PW>
struct PixelBlock {
  int ly, lx;      // its source pixel, in the tile
  int oy, ox;      // its first output pixel
  bool active;

  __device__ __forceinline__ PixelBlock(const TileArgs& a, const BlockPos& b) {
    const int bx = threadIdx.x % a.cw, by = threadIdx.x / a.cw;
    ly = by * PH / a.s;
    lx = bx * PW / a.s;
    oy = b.y0 * a.s + by * PH;
    ox = b.x0 * a.s + bx * PW;
    active = by < a.ch && b.y0 + ly < a.h && b.x0 + lx < a.w;
  }

  __device__ __forceinline__ int64_t offset(const TileArgs& a) const {
    return static_cast<int64_t>(oy) * a.wo + ox;
  }
};

// f(tap, value) for each tap of the K x K window at `win` in a staged
// feature tile (rows kTileCols + K - 1 apart).
template <int K, typename T, typename F>
__device__ __forceinline__ void for_each_tap(const T* win, F&& f) {
  constexpr int kPitch = kTileCols + K - 1;
#pragma unroll
  for (int ky = 0; ky < K; ++ky) {
#pragma unroll
    for (int kx = 0; kx < K; ++kx) {
      f(ky * K + kx, win[ky * kPitch + kx]);
    }
  }
}

// PH rows of PW values from `v` to `dst` (rows `pitch` apart); PW = 2
// stores are aligned: even output width, even column.
template <int PH, int PW, typename scalar_t, typename T>
__device__ __forceinline__ void store_block(scalar_t* dst, int64_t pitch,
                                            const T* v) {
#pragma unroll
  for (int i = 0; i < PH; ++i) {
    if constexpr (PW == 2) {
      Pack<scalar_t, 2> pk;
      pk.v[0] = static_cast<scalar_t>(v[i * 2]);
      pk.v[1] = static_cast<scalar_t>(v[i * 2 + 1]);
      *reinterpret_cast<Pack<scalar_t, 2>*>(dst + i * pitch) = pk;
    } else {
#pragma unroll
      for (int j = 0; j < PW; ++j) {
        dst[i * pitch + j] = static_cast<scalar_t>(v[i * PW + j]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Tiled forward
// ---------------------------------------------------------------------------

template <typename scalar_t, typename T, int K, int PH, int PW>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    carafe_forward_tiled(const scalar_t* __restrict__ features,
                         const scalar_t* __restrict__ masks,
                         scalar_t* __restrict__ out, TileArgs a) {
  constexpr int KK = K * K, P = PH * PW, kPitch = kTileCols + K - 1;
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);
  const BlockPos b = block_pos(a);
  const PixelBlock<PH, PW> t(a, b);
  const StageSlots<K> slots(a, b.y0, b.x0);

  T m[P][KK];
  {
    const scalar_t* mp = masks + b.ng * KK * a.oplane + t.offset(a);
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
      for (int i = 0; i < PH; ++i) {
#pragma unroll
        for (int j = 0; j < PW; ++j) {
          // A tap outside the map reads zero padding and is skipped, its
          // weight included (carafe_tap_inside).
          m[i * PW + j][kk] =
              t.active && carafe_tap_inside(b.y0 + t.ly, b.x0 + t.lx, kk / K, kk % K,
                                            (K - 1) / 2, a.h, a.w)
                  ? static_cast<T>(mp[kk * a.oplane + i * a.wo + j])
                  : T(0);
        }
      }
    }
  }
  const scalar_t* fp = features + (b.ng * a.cg + b.c0) * a.plane;
  scalar_t* op = out + (b.ng * a.cg + b.c0) * a.oplane + t.offset(a);
  for (int c = b.c0; c < b.c1; c += a.cb) {
    const int nc = min(a.cb, b.c1 - c);
    __syncthreads();  // the previous pass is read
    slots.stage(tile, fp, a.plane, nc, a.sp);
    __syncthreads();
    if (t.active) {
      const T* win = tile + t.ly * kPitch + t.lx;
      for (int cl = 0; cl < nc; ++cl) {
        T acc[P];
#pragma unroll
        for (int q = 0; q < P; ++q) {
          acc[q] = T(0);
        }
        for_each_tap<K>(win, [&](int kk, T v) {
#pragma unroll
          for (int q = 0; q < P; ++q) {
            acc[q] += v * m[q][kk];
          }
        });
        store_block<PH, PW>(op, a.wo, acc);
        win += a.sp;
        op += a.oplane;
      }
    }
    fp += nc * a.plane;
  }
}

// ---------------------------------------------------------------------------
// Tiled grad_masks
// ---------------------------------------------------------------------------

template <int PH, int PW, typename scalar_t, typename T>
__device__ __forceinline__ void load_block(const scalar_t* src, int64_t pitch,
                                           T* v) {
#pragma unroll
  for (int i = 0; i < PH; ++i) {
#pragma unroll
    for (int j = 0; j < PW; ++j) {
      v[i * PW + j] = static_cast<T>(src[i * pitch + j]);
    }
  }
}

template <typename scalar_t, typename T, int K, int PH, int PW>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    carafe_grad_masks_tiled(const scalar_t* __restrict__ grad,
                            const scalar_t* __restrict__ features,
                            scalar_t* __restrict__ grad_masks, TileArgs a) {
  constexpr int KK = K * K, P = PH * PW, kPitch = kTileCols + K - 1;
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);
  const BlockPos b = block_pos(a);  // one chunk: every channel of the group
  const PixelBlock<PH, PW> t(a, b);
  const StageSlots<K> slots(a, b.y0, b.x0);

  T acc[P][KK];
#pragma unroll
  for (int q = 0; q < P; ++q) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      acc[q][kk] = T(0);
    }
  }
  const scalar_t* fp = features + b.ng * a.cg * a.plane;
  const scalar_t* gp = grad + b.ng * a.cg * a.oplane + t.offset(a);
  for (int c = 0; c < a.cg; c += a.cb) {
    const int nc = min(a.cb, a.cg - c);
    __syncthreads();
    slots.stage(tile, fp, a.plane, nc, a.sp);
    __syncthreads();
    if (t.active) {
      const T* win = tile + t.ly * kPitch + t.lx;
      // One channel's grad loaded ahead of its use.
      T next[P];
      load_block<PH, PW>(gp, a.wo, next);
      for (int cl = 0; cl < nc; ++cl) {
        T gv[P];
#pragma unroll
        for (int q = 0; q < P; ++q) {
          gv[q] = next[q];
        }
        if (cl + 1 < nc) {
          load_block<PH, PW>(gp + a.oplane, a.wo, next);
        }
        for_each_tap<K>(win, [&](int kk, T v) {
#pragma unroll
          for (int q = 0; q < P; ++q) {
            acc[q][kk] += gv[q] * v;
          }
        });
        win += a.sp;
        gp += a.oplane;
      }
    }
    fp += nc * a.plane;
  }
  if (t.active) {
    scalar_t* dst = grad_masks + b.ng * KK * a.oplane + t.offset(a);
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      T v[P];
#pragma unroll
      for (int q = 0; q < P; ++q) {
        v[q] = acc[q][kk];
      }
      store_block<PH, PW>(dst + kk * a.oplane, a.wo, v);
    }
  }
}

// ---------------------------------------------------------------------------
// Tiled grad_features
// ---------------------------------------------------------------------------

// Staged grad of a tile: the output rows and columns of its source pixels
// and their halo, (tile_h + K - 1) S rows of (32 + K - 1) S columns per
// channel, each row stored as S sub-rows [j][ox / S] (ox % S == j).
template <int K, int S>
struct GradTile {
  static constexpr int kQw = kTileCols + K - 1;  // source columns
  static constexpr int kCols = kQw * S;          // output columns
  static constexpr int kIters = (kCols + 31) / 32;

  __host__ __device__ static int channel_size(int tile_h) {
    return (tile_h + K - 1) * S * S * kQw;
  }

  // Warp-per-row: a lane loads columns lane, lane + 32, ... of a row.
  template <typename scalar_t, typename T>
  __device__ __forceinline__ static void stage(T* tile, const scalar_t* src,
                                               const TileArgs& a, int nc,
                                               int oy0, int ox0) {
    const int rows = (a.tile_h + K - 1) * S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int lines = nc * rows;
    for (int line = warp; line < lines; line += warps) {
      const int c = line / rows, row = line - c * rows;
      const int oh = oy0 + row;
      const bool row_ok = oh >= 0 && oh < a.ho;
      const scalar_t* sp =
          src + c * a.oplane + static_cast<int64_t>(row_ok ? oh : 0) * a.wo;
      T v[kIters];
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int col = lane + 32 * it, ow = ox0 + col;
        v[it] = (row_ok && col < kCols && ow >= 0 && ow < a.wo)
                    ? static_cast<T>(sp[ow])
                    : T(0);
      }
      T* dst = tile + line * S * kQw;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int col = lane + 32 * it;
        if (col < kCols) {
          dst[(col % S) * kQw + col / S] = v[it];
        }
      }
    }
  }
};

template <typename scalar_t, typename T, int K, int S>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    carafe_grad_features_tiled(const scalar_t* __restrict__ grad,
                               const scalar_t* __restrict__ masks,
                               scalar_t* __restrict__ grad_features,
                               TileArgs a) {
  constexpr int R = (K - 1) / 2, KK = K * K, SS = S * S;
  using Tile = GradTile<K, S>;
  constexpr int kQw = Tile::kQw;
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);
  const BlockPos b = block_pos(a);
  const int lx = threadIdx.x % kTileCols, ly = threadIdx.x / kTileCols;
  const int y = b.y0 + ly, x = b.x0 + lx;
  const bool active = y < a.h && x < a.w;

  // The weight of output pixel (i, j) of source pixel (y + R - ky,
  // x + R - kx) for tap (ky, kx): the taps that read (y, x).
  T mk[KK][SS];
  {
    const scalar_t* mp = masks + b.ng * KK * a.oplane;
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        const int qy = y + R - ky, qx = x + R - kx;
        const bool ok = active && qy >= 0 && qy < a.h && qx >= 0 && qx < a.w;
        const scalar_t* src = mp + (ky * K + kx) * a.oplane +
                              static_cast<int64_t>(ok ? qy : 0) * S * a.wo +
                              (ok ? qx : 0) * S;
#pragma unroll
        for (int i = 0; i < S; ++i) {
#pragma unroll
          for (int j = 0; j < S; ++j) {
            mk[ky * K + kx][i * S + j] =
                ok ? static_cast<T>(src[i * a.wo + j]) : T(0);
          }
        }
      }
    }
  }
  const int channel = Tile::channel_size(a.tile_h);
  const scalar_t* gp = grad + (b.ng * a.cg + b.c0) * a.oplane;
  scalar_t* dst = grad_features + (b.ng * a.cg + b.c0) * a.plane +
                  static_cast<int64_t>(y) * a.w + x;
  for (int c = b.c0; c < b.c1; c += a.cb) {
    const int nc = min(a.cb, b.c1 - c);
    __syncthreads();
    Tile::stage(tile, gp, a, nc, (b.y0 - R) * S, (b.x0 - R) * S);
    __syncthreads();
    if (active) {
      // Source pixel (y + R - ky) is staged row ly + K - 1 - ky.
      const T* base = tile + ly * SS * kQw + lx;
      for (int cl = 0; cl < nc; ++cl) {
        T acc = T(0);
#pragma unroll
        for (int ky = 0; ky < K; ++ky) {
#pragma unroll
          for (int kx = 0; kx < K; ++kx) {
#pragma unroll
            for (int i = 0; i < S; ++i) {
#pragma unroll
              for (int j = 0; j < S; ++j) {
                const T g = base[(((K - 1 - ky) * S + i) * S + j) * kQw + K - 1 - kx];
                acc += g * mk[ky * K + kx][i * S + j];
              }
            }
          }
        }
        *dst = static_cast<scalar_t>(acc);
        base += channel;
        dst += a.plane;
      }
    }
    gp += nc * a.oplane;
  }
}

template <int K, int S>
Plan plan_grad_features(const CarafeShape& p, size_t elem, int sms) {
  Plan plan;
  if (!small_maps(p)) {
    return plan;
  }
  TileArgs a = base_args(p);
  a.tile_w = kTileCols;
  a.tile_h = kThreads / kTileCols;
  a.cw = kTileCols;
  a.ch = a.tile_h;
  plan.threads = kThreads;
  split_channels(a, p.n * p.g * ceil_div(p.w, a.tile_w) * ceil_div(p.h, a.tile_h), sms);
  plan.a = a;
  plan.ok = finish_plan(
      plan, p, static_cast<size_t>(GradTile<K, S>::channel_size(a.tile_h)) * elem);
  return plan;
}

// ---------------------------------------------------------------------------
// Generic kernels: any kernel size and scale, int64 indexing
// ---------------------------------------------------------------------------

struct GenericArgs {
  int64_t c, h, w, ho, wo, plane, oplane;
  int64_t k, g, cg, s, radius;
};

GenericArgs generic_args(const CarafeShape& p) {
  return {p.c, p.h, p.w, p.ho, p.wo, p.h * p.w, p.ho * p.wo,
          p.k, p.g, p.group_channels(), p.s, p.radius()};
}

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kGenericThreads) carafe_forward_generic(
    const scalar_t* __restrict__ features, const scalar_t* __restrict__ masks,
    scalar_t* __restrict__ out, GenericArgs a, int64_t total) {
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t ow = i % a.wo, oh = (i / a.wo) % a.ho;
    const int64_t nc = i / a.oplane, c = nc % a.c, n = nc / a.c;
    const scalar_t* fp = features + nc * a.plane;
    const scalar_t* mp =
        masks + (n * a.g + c / a.cg) * a.k * a.k * a.oplane + oh * a.wo + ow;
    T acc = T(0);
    for (int64_t ky = 0; ky < a.k; ++ky) {
      const int64_t y = carafe_source(oh, ky, a.s, a.radius, a.h);
      for (int64_t kx = 0; kx < a.k; ++kx) {
        const int64_t x = carafe_source(ow, kx, a.s, a.radius, a.w);
        if (y >= 0 && x >= 0) {  // a tap outside the map is skipped
          acc += static_cast<T>(fp[y * a.w + x]) *
                 static_cast<T>(mp[(ky * a.k + kx) * a.oplane]);
        }
      }
    }
    out[i] = static_cast<scalar_t>(acc);
  }
}

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kGenericThreads) carafe_grad_masks_generic(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ features,
    scalar_t* __restrict__ grad_masks, GenericArgs a, int64_t total) {
  const int64_t taps = a.k * a.k;
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t o = i % a.oplane, ow = o % a.wo, oh = o / a.wo;
    const int64_t mc = i / a.oplane;  // (image * groups + group) * taps + tap
    const int64_t tap = mc % taps, ng = mc / taps;
    const int64_t y = carafe_source(oh, tap / a.k, a.s, a.radius, a.h);
    const int64_t x = carafe_source(ow, tap % a.k, a.s, a.radius, a.w);
    T acc = T(0);
    if (y >= 0 && x >= 0) {
      const scalar_t* gp = grad + ng * a.cg * a.oplane + o;
      const scalar_t* fp = features + ng * a.cg * a.plane + y * a.w + x;
      for (int64_t c = 0; c < a.cg; ++c) {
        acc += static_cast<T>(gp[c * a.oplane]) * static_cast<T>(fp[c * a.plane]);
      }
    }
    grad_masks[i] = static_cast<scalar_t>(acc);
  }
}

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kGenericThreads) carafe_grad_features_generic(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ masks,
    scalar_t* __restrict__ grad_features, GenericArgs a, int64_t total) {
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t x = i % a.w, y = (i / a.w) % a.h;
    const int64_t nc = i / a.plane, c = nc % a.c, n = nc / a.c;
    const scalar_t* gp = grad + nc * a.oplane;
    const scalar_t* mp = masks + (n * a.g + c / a.cg) * a.k * a.k * a.oplane;
    T acc = T(0);
    for (int64_t ky = 0; ky < a.k; ++ky) {
      const int64_t qy = y + a.radius - ky;
      if (qy < 0 || qy >= a.h) {
        continue;
      }
      for (int64_t kx = 0; kx < a.k; ++kx) {
        const int64_t qx = x + a.radius - kx;
        if (qx < 0 || qx >= a.w) {
          continue;
        }
        const scalar_t* mt = mp + (ky * a.k + kx) * a.oplane;
        for (int64_t si = 0; si < a.s; ++si) {
          const int64_t row = (qy * a.s + si) * a.wo + qx * a.s;
          for (int64_t sj = 0; sj < a.s; ++sj) {
            acc += static_cast<T>(gp[row + sj]) * static_cast<T>(mt[row + sj]);
          }
        }
      }
    }
    grad_features[i] = static_cast<scalar_t>(acc);
  }
}

template <typename Kernel, typename... Args>
void launch_generic(Kernel kernel, int64_t total, Args... args) {
  const unsigned int blocks = grid_for(total, kGenericThreads);
  kernel<<<blocks, kGenericThreads, 0, current_stream()>>>(args..., total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// Dispatch of the tiled kernels over the kernel size
// ---------------------------------------------------------------------------

// f(std::integral_constant<int, K>{}) for the tiled kernel sizes.
template <typename F>
void with_tiled_kernel_size(int64_t k, F&& f) {
  switch (k) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 5:
      f(std::integral_constant<int, 5>{});
      break;
    case 7:
      f(std::integral_constant<int, 7>{});
      break;
    default:
      break;
  }
}

// The tiled forward for kernel size K; false when it cannot run the call.
template <typename scalar_t, int K>
bool forward_tiled(const CarafeShape& p, const scalar_t* features,
                   const scalar_t* masks, scalar_t* out, int sms) {
  using T = at::opmath_type<scalar_t>;
  constexpr int BH = big_rows<T, K>(), BW = big_cols<T, K>();
  const bool big = p.s % 2 == 0;
  Plan plan = plan_pixel_tiles(p, K, big ? BH : 1, big ? BW : 1, sizeof(T),
                               std::numeric_limits<int>::max());
  if (!plan.ok) {
    return false;
  }
  split_channels(plan.a, plan.blocks, sms);
  if (!finish_plan(plan, p, static_cast<size_t>(plan.a.sp) * sizeof(T))) {
    return false;
  }
  const dim3 grid(static_cast<unsigned int>(plan.blocks));
  if (big) {
    carafe_forward_tiled<scalar_t, T, K, BH, BW>
        <<<grid, plan.threads, plan.smem, current_stream()>>>(features, masks,
                                                              out, plan.a);
  } else {
    carafe_forward_tiled<scalar_t, T, K, 1, 1>
        <<<grid, plan.threads, plan.smem, current_stream()>>>(features, masks,
                                                              out, plan.a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// The tiled grad_masks for kernel size K; false when it cannot run the call.
template <typename scalar_t, int K>
bool grad_masks_tiled(const CarafeShape& p, const scalar_t* grad,
                      const scalar_t* features, scalar_t* out, int sms) {
  using T = at::opmath_type<scalar_t>;
  constexpr int BH = big_rows<T, K>(), BW = big_cols<T, K>();
  const bool big = p.s % 2 == 0;
  // A block takes every channel of its tile: shorter tiles until there
  // are two blocks per SM (or tiles of one row).
  Plan plan;
  for (int max_h = std::numeric_limits<int>::max(); max_h >= 1;
       max_h = plan.a.tile_h / 2) {
    const Plan next =
        plan_pixel_tiles(p, K, big ? BH : 1, big ? BW : 1, sizeof(T), max_h);
    if (!next.ok) {
      break;
    }
    plan = next;
    if (plan.blocks >= 2 * sms) {
      break;
    }
  }
  if (!plan.ok) {
    return false;
  }
  const dim3 grid(static_cast<unsigned int>(plan.blocks));
  if (big) {
    carafe_grad_masks_tiled<scalar_t, T, K, BH, BW>
        <<<grid, plan.threads, plan.smem, current_stream()>>>(grad, features,
                                                              out, plan.a);
  } else {
    carafe_grad_masks_tiled<scalar_t, T, K, 1, 1>
        <<<grid, plan.threads, plan.smem, current_stream()>>>(grad, features,
                                                              out, plan.a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// The tiled grad_features for kernel size K and scale S; false when it
// cannot run the call.
template <typename scalar_t, int K, int S>
bool grad_features_tiled(const CarafeShape& p, const scalar_t* grad,
                         const scalar_t* masks, scalar_t* out, int sms) {
  using T = at::opmath_type<scalar_t>;
  if constexpr (!grad_features_fits<T, K, S>()) {
    return false;
  } else {
    const Plan plan = plan_grad_features<K, S>(p, sizeof(T), sms);
    if (!plan.ok) {
      return false;
    }
    carafe_grad_features_tiled<scalar_t, T, K, S>
        <<<static_cast<unsigned int>(plan.blocks), plan.threads, plan.smem,
           current_stream()>>>(grad, masks, out, plan.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
}

// `tiled(kc)` for kernel size kc (it returns whether it could run the call)
// where the testing switch and `tiled_ok` allow it, else `generic()`.
template <typename Tiled, typename Generic>
void tiled_or_generic(const char* op, const char* kernel, int64_t k,
                      bool tiled_ok, Tiled&& tiled, Generic&& generic) {
  bool ran = false;
  if (path_choice(op) != PathChoice::kGeneric && tiled_ok) {
    with_tiled_kernel_size(k, [&](auto kc) { ran = tiled(kc); });
  }
  check_forced_path(op, kernel, ran);
  if (!ran) {
    generic();
  }
}

template <typename scalar_t>
void run_forward(const CarafeShape& p, const scalar_t* features,
             const scalar_t* masks, scalar_t* out, int sms) {
  tiled_or_generic(
      "carafe", "forward", p.k, true,
      [&](auto kc) {
        return forward_tiled<scalar_t, decltype(kc)::value>(p, features, masks,
                                                            out, sms);
      },
      [&] {
        launch_generic(
            carafe_forward_generic<scalar_t, at::opmath_type<scalar_t>>,
            p.n * p.c * p.ho * p.wo, features, masks, out, generic_args(p));
      });
}

template <typename scalar_t>
void run_grad_masks(const CarafeShape& p, const scalar_t* grad,
                const scalar_t* features, scalar_t* out, int sms) {
  tiled_or_generic(
      "_carafe_backward", "grad_masks", p.k, true,
      [&](auto kc) {
        return grad_masks_tiled<scalar_t, decltype(kc)::value>(p, grad, features,
                                                               out, sms);
      },
      [&] {
        launch_generic(
            carafe_grad_masks_generic<scalar_t, at::opmath_type<scalar_t>>,
            p.n * p.g * p.taps() * p.ho * p.wo, grad, features, out,
            generic_args(p));
      });
}

template <typename scalar_t>
void run_grad_features(const CarafeShape& p, const scalar_t* grad,
                   const scalar_t* masks, scalar_t* out, int sms) {
  tiled_or_generic(
      "_carafe_backward", "grad_features", p.k, p.s == 1 || p.s == 2,
      [&](auto kc) {
        constexpr int K = decltype(kc)::value;
        return p.s == 1
                   ? grad_features_tiled<scalar_t, K, 1>(p, grad, masks, out, sms)
                   : grad_features_tiled<scalar_t, K, 2>(p, grad, masks, out, sms);
      },
      [&] {
        launch_generic(
            carafe_grad_features_generic<scalar_t, at::opmath_type<scalar_t>>,
            p.n * p.c * p.h * p.w, grad, masks, out, generic_args(p));
      });
}

// ---------------------------------------------------------------------------
// Operators
// ---------------------------------------------------------------------------

// The steps of common/carafe_steps.h, on the GPU.
struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& features) {
    return c10::cuda::CUDAGuard(features.device());
  }

  struct Features {
    at::Tensor t;
    int sms;
  };
  static Features features(const at::Tensor& features,
                           const CarafeShape& /*p*/) {
    const at::Tensor t = features.contiguous();
    return {t, sm_count(t)};
  }

  template <typename scalar_t>
  static void forward(const CarafeShape& p, const Features& f,
                      const scalar_t* masks, scalar_t* out) {
    run_forward<scalar_t>(p, f.t.const_data_ptr<scalar_t>(), masks, out, f.sms);
  }

  template <typename scalar_t>
  static void grad_masks(const CarafeShape& p, const scalar_t* grad,
                         const Features& f, scalar_t* out) {
    run_grad_masks<scalar_t>(p, grad, f.t.const_data_ptr<scalar_t>(), out,
                             f.sms);
  }

  template <typename scalar_t>
  static void grad_features(const CarafeShape& p, const scalar_t* grad,
                            const scalar_t* masks, const Features& f,
                            scalar_t* out) {
    run_grad_features<scalar_t>(p, grad, masks, out, f.sms);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("carafe", &carafe_forward<CudaKernels>);
  m.impl("_carafe_backward", &carafe_backward<CudaKernels>);
}

}  // namespace torchops::cuda
