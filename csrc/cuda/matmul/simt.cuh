// Exact GEMM on CUDA cores: float32 and float64 (no TF32), and the fallback
// for half/bfloat16 layouts the tensor-core paths do not take (inputs
// converted to float on the way to shared memory, float accumulation).
//
// Block tile BM x BN x BK (automatic choices: 256 threads as a 16 x 16
// grid), each thread a (TM x TN) register tile made of 4x4 sub-tiles
// 4 * (threads along that dimension) rows/columns apart (64 for 16x16), so
// a warp's float4 shared reads cover one contiguous 64/128-byte span
// (no bank conflicts).  float: 128x128x8, 8x8 per thread; double:
// 64x64x16, 4x4 per thread (8x8 doubles would need ~200 registers).
// Both tiles are stored k-major in shared memory (A transposed), double
// buffered, with the next tile prefetched into registers while the current
// one is multiplied: one __syncthreads per BK.  Each k step's fragments are
// read from shared memory during the previous step's FMAs, the first step of
// the next tile included (read right after the barrier, before the current
// tile's last FMAs): reading them at the top of each tile would stall every
// warp of the block on shared-memory latency at once.
//
// Global loads: each thread loads groups of 4 elements consecutive along
// one dimension of the operand (a template flag picks which, so the
// contiguous dimension of either layout is walked by consecutive threads);
// a group is one vector load when the host found that dimension contiguous
// and aligned and the group lies inside the matrix, else 4 guarded scalar
// loads (zero fill), which also serve arbitrary strides and stride 0.
//
// On Hopper, float32 problems that take the big float tile and whose
// layout suits TMA (row-major A and B, K % 4 == 0, one matrix) run
// simt90.cuh's kernel instead: the same FMA loop fed by TMA and mbarriers.
//
// The tile shape is a template (TileCfg): a tuning harness
// (scripts/matmul_dev) launches candidate configs of its own, and pins
// choices through Pins.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm_args.cuh"
#include "simt90.cuh"
#include "split_k.cuh"

namespace torchops::cuda::gemm {
namespace simt_detail {

constexpr int kPad = 4;  // keeps float4 alignment; spreads transposed stores over banks
constexpr int kGroupM = 8;  // tile rows per L2-friendly group of the tile order
constexpr int kMaxGridZ = 65535;

template <typename T> struct AccOf { using type = float; };  // float, half, bfloat16
template <> struct AccOf<double> { using type = double; };

// Block tile BM x BN x BK; each thread a TM x TN register tile of 4x4
// pieces; (BM/TM) x (BN/TN) threads, warps of 8 (n) x 4 (m) threads.
// MIN_BLOCKS is __launch_bounds__' second argument (1: up to 255 registers
// at 256 threads).
// SPLIT: blocks whose tile lies inside C, with vector loads on both
// operands, load their full k tiles without per-group bounds checks (fewer
// non-FMA instructions per k tile; the k tail keeps the checked loads).
template <int BM_, int BN_, int BK_, int TM_, int TN_, int MIN_BLOCKS_, bool SPLIT_ = true>
struct TileCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, TM = TM_, TN = TN_;
  static constexpr int MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr bool SPLIT = SPLIT_;
  static constexpr int TY = BM / TM, TX = BN / TN;  // threads along m, n
  static constexpr int THREADS = TX * TY;
  static_assert(BM % TM == 0 && BN % TN == 0, "whole threads");
  static_assert(TM % 4 == 0 && TN % 4 == 0, "4x4 sub-tiles");
  static_assert(TX % 8 == 0 && TY % 4 == 0, "warps of 8 x 4 threads");
  // BK even: the k steps alternate between two fragment slots.
  static_assert(BK % 4 == 0 && BM <= 256 && BN <= 256, "int tile math (simt_supports)");
  static_assert((BM * BK) % (4 * THREADS) == 0 && (BK * BN) % (4 * THREADS) == 0,
                "whole 4-element load groups per thread");
  template <typename Acc>
  static constexpr int smem_bytes() {
    return 2 * BK * (BM + BN + 2 * kPad) * int(sizeof(Acc));
  }
};

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// 4 consecutive elements at p (aligned to 4 elements) -> accumulation type.
__device__ __forceinline__ void ldg4(const float* p, float* o) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void ldg4(const double* p, double* o) {
  const double2 v0 = __ldg(reinterpret_cast<const double2*>(p));
  const double2 v1 = __ldg(reinterpret_cast<const double2*>(p) + 1);
  o[0] = v0.x; o[1] = v0.y; o[2] = v1.x; o[3] = v1.y;
}
__device__ __forceinline__ void ldg4(const __half* p, float* o) {
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
}
__device__ __forceinline__ void ldg4(const __nv_bfloat16* p, float* o) {
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
  // bfloat16 -> float is a 16-bit shift: exact, and cheap on every arch.
  o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
  o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
}

__device__ __forceinline__ void lds4(const float* p, float* o) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void lds4(const double* p, double* o) {
  const double2 v0 = reinterpret_cast<const double2*>(p)[0];
  const double2 v1 = reinterpret_cast<const double2*>(p)[1];
  o[0] = v0.x; o[1] = v0.y; o[2] = v1.x; o[3] = v1.y;
}
__device__ __forceinline__ void sts4(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void sts4(double* p, const double* v) {
  reinterpret_cast<double2*>(p)[0] = make_double2(v[0], v[1]);
  reinterpret_cast<double2*>(p)[1] = make_double2(v[2], v[3]);
}

// 4 consecutive outputs (aligned to 4 elements).
__device__ __forceinline__ void stg4(float* p, const float* v) { sts4(p, v); }
__device__ __forceinline__ void stg4(double* p, const double* v) { sts4(p, v); }
__device__ __forceinline__ void stg4(__half* p, const float* v) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]);
  const __half2 hi = __floats2half2_rn(v[2], v[3]);
  uint2 u;
  u.x = *reinterpret_cast<const unsigned*>(&lo);
  u.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void stg4(__nv_bfloat16* p, const float* v) {
  __nv_bfloat16 h[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __float2bfloat16_rn(v[e]);
  uint2 u;
  u.x = static_cast<unsigned>(__bfloat16_as_ushort(h[0])) |
        (static_cast<unsigned>(__bfloat16_as_ushort(h[1])) << 16);
  u.y = static_cast<unsigned>(__bfloat16_as_ushort(h[2])) |
        (static_cast<unsigned>(__bfloat16_as_ushort(h[3])) << 16);
  *reinterpret_cast<uint2*>(p) = u;
}
template <typename T, typename Acc>
__device__ __forceinline__ void stg1(T* p, Acc v) { *p = to_out<T, Acc>(v); }

template <typename T>
struct Params {
  const T* a;
  int64_t a_bs, a_rs, a_cs;
  const T* b;
  int64_t b_bs, b_rs, b_cs;
  T* c;
  int64_t batch, m, n, k;
  int64_t tiles_m, tiles_n;
  bool a_vec, b_vec, c_vec;
};

// A split-K launch's (blockIdx.y is the split): split j sums k in
// [j * kps, +kps) and stores its partial at ws + j * batch * m * n, laid out
// like C (sum_splits adds them in split order).  Apart from Params, whose
// layout alone moves ptxas's register allocation of the unsplit big float
// tile (it is slower with these fields in it).
template <typename T>
struct SplitParams : Params<T> {
  int64_t kps;
  typename AccOf<T>::type* ws;
  bool ws_vec;
};

template <typename T, bool kSplit>
using ParamsOf = std::conditional_t<kSplit, SplitParams<T>, Params<T>>;

// A_K: a thread's 4 A elements run along k (else along m).
// B_N: a thread's 4 B elements run along n (else along k).
// kSplit: a split-K launch (SplitParams).
template <typename T, typename C, bool A_K, bool B_N, bool kSplit>
__global__ void __launch_bounds__(C::THREADS, C::MIN_BLOCKS) simt_kernel(const ParamsOf<T, kSplit> p) {
  using Acc = typename AccOf<T>::type;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  constexpr int TM = C::TM, TN = C::TN;
  constexpr int kThreads = C::THREADS;
  constexpr int AG = BM * BK / 4 / kThreads;  // 4-element groups per thread
  constexpr int BG = BK * BN / 4 / kThreads;
  // Sub-tile strides: piece i of a thread's rows starts at i * MS + ty * 4.
  constexpr int MS = C::TY * 4, NS = C::TX * 4;

  // Dynamic shared memory (configs above 48 KB): A then B, both k-major.
  extern __shared__ float4 simt_smem[];
  auto As = reinterpret_cast<Acc (*)[BK][BM + kPad]>(simt_smem);
  auto Bs = reinterpret_cast<Acc (*)[BK][BN + kPad]>(
      reinterpret_cast<Acc*>(simt_smem) + 2 * BK * (BM + kPad));

  const int tid = threadIdx.x;
  // Warp = 8 (tx) x 4 (ty) threads: its shared reads are 4 distinct A and
  // 8 distinct B float4s per piece, each span contiguous.
  const int warp = tid >> 5, lane = tid & 31;
  const int tx = (warp % (C::TX / 8)) * 8 + (lane & 7);
  const int ty = (warp / (C::TX / 8)) * 4 + (lane >> 3);

  // Tile order: gemm_args.cuh's grouped one.
  int64_t tm, tn;
  grouped_tile(blockIdx.x, p.tiles_m, p.tiles_n, kGroupM, tm, tn);
  // Sizes fit in int (simt_supports); only element offsets need 64 bits.
  // k: this split's depth; the operands' pointers start at its first k.
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n);
  int64_t kbeg = 0;
  int k = static_cast<int>(p.k);
  if constexpr (kSplit) {
    kbeg = int64_t(blockIdx.y) * p.kps;
    k = static_cast<int>(p.k - kbeg < p.kps ? p.k - kbeg : p.kps);
  }
  const int row0 = static_cast<int>(tm) * BM, col0 = static_cast<int>(tn) * BN;
  const int ntiles = (k + BK - 1) / BK;

  // Per-group tile coordinates (fixed for the whole k loop).
  int a_r[AG], a_kk[AG], b_c[BG], b_kk[BG];
#pragma unroll
  for (int g = 0; g < AG; ++g) {
    const int idx = tid + g * kThreads;
    if (A_K) { a_r[g] = idx / (BK / 4); a_kk[g] = (idx % (BK / 4)) * 4; }
    else     { a_kk[g] = idx / (BM / 4); a_r[g] = (idx % (BM / 4)) * 4; }
  }
#pragma unroll
  for (int g = 0; g < BG; ++g) {
    const int idx = tid + g * kThreads;
    if (B_N) { b_kk[g] = idx / (BN / 4); b_c[g] = (idx % (BN / 4)) * 4; }
    else     { b_c[g] = idx / (BK / 4); b_kk[g] = (idx % (BK / 4)) * 4; }
  }

  for (int64_t bi = blockIdx.z; bi < p.batch; bi += gridDim.z) {
    // Group pointers at k0 = 0, advanced by BK along k per tile.
    const T* pa[AG];
    const T* pb[BG];
#pragma unroll
    for (int g = 0; g < AG; ++g)
      pa[g] = p.a + bi * p.a_bs + int64_t(row0 + a_r[g]) * p.a_rs + (kbeg + a_kk[g]) * p.a_cs;
#pragma unroll
    for (int g = 0; g < BG; ++g)
      pb[g] = p.b + bi * p.b_bs + (kbeg + b_kk[g]) * p.b_rs + int64_t(col0 + b_c[g]) * p.b_cs;

    Acc ra[AG][4], rb[BG][4];
    // full: the k tile at k0 is inside A and B and so is this block's tile,
    // with vector loads allowed (no checks).
    auto load = [&](int k0, auto full_t) {
      constexpr bool full = decltype(full_t)::value;
#pragma unroll
      for (int g = 0; g < AG; ++g) {
        const int gr = row0 + a_r[g], gk = k0 + a_kk[g];
        const T* src = pa[g];
        if (A_K) {
          if (full || (p.a_vec && gr < m && gk + 3 < k)) {
            ldg4(src, ra[g]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              ra[g][e] = (gr < m && gk + e < k) ? to_acc(src[e * p.a_cs]) : Acc(0);
          }
        } else {
          if (full || (p.a_vec && gk < k && gr + 3 < m)) {
            ldg4(src, ra[g]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              ra[g][e] = (gk < k && gr + e < m) ? to_acc(src[e * p.a_rs]) : Acc(0);
          }
        }
        pa[g] += BK * p.a_cs;
      }
#pragma unroll
      for (int g = 0; g < BG; ++g) {
        const int gk = k0 + b_kk[g], gc = col0 + b_c[g];
        const T* src = pb[g];
        if (B_N) {
          if (full || (p.b_vec && gk < k && gc + 3 < n)) {
            ldg4(src, rb[g]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              rb[g][e] = (gk < k && gc + e < n) ? to_acc(src[e * p.b_cs]) : Acc(0);
          }
        } else {
          if (full || (p.b_vec && gc < n && gk + 3 < k)) {
            ldg4(src, rb[g]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              rb[g][e] = (gc < n && gk + e < k) ? to_acc(src[e * p.b_rs]) : Acc(0);
          }
        }
        pb[g] += BK * p.b_rs;
      }
    };
    auto store = [&](int buf) {
#pragma unroll
      for (int g = 0; g < AG; ++g) {
        if (A_K) {
#pragma unroll
          for (int e = 0; e < 4; ++e) As[buf][a_kk[g] + e][a_r[g]] = ra[g][e];
        } else {
          sts4(&As[buf][a_kk[g]][a_r[g]], ra[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < BG; ++g) {
        if (B_N) {
          sts4(&Bs[buf][b_kk[g]][b_c[g]], rb[g]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) Bs[buf][b_kk[g] + e][b_c[g]] = rb[g][e];
        }
      }
    };

    Acc acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

    // k tiles below full_tiles need no bounds checks (C::SPLIT).
    const bool interior = C::SPLIT && p.a_vec && p.b_vec && row0 + BM <= m && col0 + BN <= n;
    const int full_tiles = interior ? k / BK : 0;
    // Float: the fragments of step kk+1 are read while step kk's FMAs run,
    // across the tile boundary too: the next tile's first fragments are read
    // right after the barrier, before the current tile's last FMAs, so no warp
    // waits on shared-memory latency at the start of a tile.  Double: one
    // fragment slot, read at each step (a second slot of doubles spills),
    // and the barrier after the tile.
    constexpr bool kAhead = sizeof(Acc) == 4;
    constexpr int kSlots = kAhead ? 2 : 1;
    Acc af[kSlots][TM], bf[kSlots][TN];
    auto frags = [&](int buf, int kk, int slot) {
#pragma unroll
      for (int i = 0; i < TM / 4; ++i) lds4(&As[buf][kk][i * MS + ty * 4], &af[slot][i * 4]);
#pragma unroll
      for (int j = 0; j < TN / 4; ++j) lds4(&Bs[buf][kk][j * NS + tx * 4], &bf[slot][j * 4]);
    };
    if (kAhead) __syncthreads();  // the previous batch entry's last reads of buffer 0
    load(0, std::false_type{});
    store(0);
    __syncthreads();
    if (kAhead) frags(0, 0, 0);
    for (int t = 0; t < ntiles; ++t) {
      const int cur = t & 1;
      const bool more = t + 1 < ntiles;
      if (more) {  // in flight during the FMAs below
        if (C::SPLIT && t + 1 < full_tiles) load((t + 1) * BK, std::true_type{});
        else load((t + 1) * BK, std::false_type{});
      }
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        if (!kAhead) {
          frags(cur, kk, 0);
        } else if (kk + 1 < BK) {
          frags(cur, kk + 1, (kk + 1) & 1);
        } else if (more) {
          // The other buffer's last reads came before the previous barrier.
          store(cur ^ 1);
          __syncthreads();
          frags(cur ^ 1, 0, 0);
        }
        const int slot = kAhead ? (kk & 1) : 0;
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = fma(af[slot][i], bf[slot][j], acc[i][j]);
      }
      if (!kAhead) {
        // The other buffer was last read before the previous barrier.
        if (more) store(cur ^ 1);
        __syncthreads();
      }
    }

    // C, or this split's partial.  Addresses from one per-thread base: fewer
    // live values for ptxas to hoist above the main loop.
    const int rb0 = row0 + ty * 4, cb0 = col0 + tx * 4;
    using O = std::conditional_t<kSplit, Acc, T>;
    O* out;
    bool vec;
    if constexpr (kSplit) {
      out = p.ws + int64_t(blockIdx.y) * p.batch * p.m * p.n;
      vec = p.ws_vec;
    } else {
      out = p.c;
      vec = p.c_vec;
    }
    O* const cthr = out + bi * p.m * p.n + int64_t(rb0) * n + cb0;
#pragma unroll
    for (int i = 0; i < TM / 4; ++i) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (rb0 + i * MS + r >= m) continue;
        O* const crow = cthr + int64_t(i * MS + r) * n;
#pragma unroll
        for (int j = 0; j < TN / 4; ++j) {
          const int left = n - (cb0 + j * NS);  // columns left from this group
          const Acc* v = &acc[i * 4 + r][j * 4];
          if (vec && left >= 4) {
            stg4(crow + j * NS, v);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (e < left) stg1<O, Acc>(crow + j * NS + e, v[e]);
          }
        }
      }
    }
  }
}

// Walk dimension 1 with consecutive threads?  A dimension of size 1 has no
// meaningful stride.
inline bool walk_first(int64_t s1, int64_t n1, int64_t s2, int64_t n2) {
  if (n1 <= 1) return false;
  if (n2 <= 1) return true;
  return (s1 < 0 ? -s1 : s1) <= (s2 < 0 ? -s2 : s2);
}

// Vector loads of 4 along dimension 1: unit stride there, and every group
// start (multiple of 4 along dim 1, any index along dim 2 and batch) aligned.
inline bool vec_ok(const void* ptr, int elt, int64_t s1, int64_t s2, int64_t n2,
                   int64_t bs, int64_t batch) {
  return s1 == 1 && (n2 <= 1 || s2 % 4 == 0) && (batch <= 1 || bs % 4 == 0) &&
         reinterpret_cast<uintptr_t>(ptr) % (4 * static_cast<uintptr_t>(elt)) == 0;
}

inline int splits_of(const GemmArgs& g, int64_t kps) {
  return kps >= g.k ? 1 : static_cast<int>((g.k + kps - 1) / kps);
}

// kps: k per split (split_kps); splits > 1 need a workspace of splits x C
// in the accumulator type, and kCanSplit (the split kernels are compiled
// only for the tiles that may split).
template <typename T, typename C, bool kCanSplit = true>
cudaError_t launch(const GemmArgs& g, int64_t kps, void* ws, cudaStream_t stream) {
  using Acc = typename AccOf<T>::type;
  Params<T> p;
  p.a = static_cast<const T*>(g.a.ptr);
  p.a_bs = g.a.batch_stride; p.a_rs = g.a.row_stride; p.a_cs = g.a.col_stride;
  p.b = static_cast<const T*>(g.b.ptr);
  p.b_bs = g.b.batch_stride; p.b_rs = g.b.row_stride; p.b_cs = g.b.col_stride;
  p.c = static_cast<T*>(g.c);
  p.batch = g.batch; p.m = g.m; p.n = g.n; p.k = g.k;
  p.tiles_m = (g.m + C::BM - 1) / C::BM;
  p.tiles_n = (g.n + C::BN - 1) / C::BN;
  if (p.tiles_m * p.tiles_n > 0x7fffffff) return cudaErrorInvalidValue;
  const int elt = static_cast<int>(sizeof(T));
  const bool a_k = walk_first(g.a.col_stride, g.k, g.a.row_stride, g.m);
  const bool b_n = walk_first(g.b.col_stride, g.n, g.b.row_stride, g.k);
  p.a_vec = a_k ? vec_ok(p.a, elt, g.a.col_stride, g.a.row_stride, g.m, g.a.batch_stride, g.batch)
                : vec_ok(p.a, elt, g.a.row_stride, g.a.col_stride, g.k, g.a.batch_stride, g.batch);
  p.b_vec = b_n ? vec_ok(p.b, elt, g.b.col_stride, g.b.row_stride, g.k, g.b.batch_stride, g.batch)
                : vec_ok(p.b, elt, g.b.row_stride, g.b.col_stride, g.n, g.b.batch_stride, g.batch);
  p.c_vec = g.n % 4 == 0 && reinterpret_cast<uintptr_t>(p.c) % (4 * static_cast<uintptr_t>(elt)) == 0;
  const int splits = splits_of(g, kps);
  if (splits > 1 && (ws == nullptr || !kCanSplit)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.tiles_m * p.tiles_n), static_cast<unsigned>(splits),
                  static_cast<unsigned>(g.batch < kMaxGridZ ? g.batch : kMaxGridZ));
  constexpr int smem = C::template smem_bytes<Acc>();
  auto run = [&](const auto& params, auto split) {
    constexpr bool s = decltype(split)::value;
    auto kernel = a_k ? (b_n ? simt_kernel<T, C, true, true, s> : simt_kernel<T, C, true, false, s>)
                      : (b_n ? simt_kernel<T, C, false, true, s> : simt_kernel<T, C, false, false, s>);
    if constexpr (smem > 48 * 1024) {
      const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
    }
    kernel<<<grid, C::THREADS, smem, stream>>>(params);
    return cudaGetLastError();
  };
  if constexpr (kCanSplit) {
    if (splits > 1) {
      SplitParams<T> sp;
      static_cast<Params<T>&>(sp) = p;
      sp.kps = kps;
      sp.ws = static_cast<Acc*>(ws);
      sp.ws_vec = g.n % 4 == 0 && reinterpret_cast<uintptr_t>(ws) % (4 * sizeof(Acc)) == 0;
      const cudaError_t e = run(sp, std::true_type{});
      if (e != cudaSuccess) return e;
      return launch_sum_splits<T, Acc>(sp.ws, g.c, splits, g.batch * g.m * g.n, stream);
    }
  }
  return run(p, std::false_type{});
}

}  // namespace simt_detail

// The fallback: every dtype and layout.  Sizes below 2^31 - 256 (int tile
// indices), tile grid within grid.x.
inline bool simt_supports(const GemmArgs& g) {
  constexpr int64_t kMax = 0x7fffffff - 256;
  if (g.batch < 0 || g.m < 0 || g.n < 0 || g.k < 0) return false;
  if (g.m > kMax || g.n > kMax || g.k > kMax) return false;
  const int64_t bm = g.dtype == DType::f64 ? 64 : 128;
  const int64_t tiles = ((g.m + bm - 1) / bm) * ((g.n + bm - 1) / bm);
  return tiles <= 0x7fffffff;
}

}  // namespace torchops::cuda::gemm

// The tiles and the split-K choice, apart from the kernels.
#include "simt_heuristics.cuh"

namespace torchops::cuda::gemm {
namespace simt_detail {

// The split-K partials' workspace, in the accumulator type.
inline size_t workspace_bytes(const GemmArgs& g, const Pins& pins) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return 0;
  const Tile t = pick_tile(g, pins);
  const int splits = splits_of(g, plan_kps(g, t, pins));
  if (splits == 1) return 0;
  return static_cast<size_t>(splits) * g.batch * g.m * g.n * (t == Tile::f64 ? 8 : 4);
}

inline cudaError_t run(const GemmArgs& g, void* workspace, cudaStream_t stream, const Pins& pins) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return cudaSuccess;
  const Tile t = pick_tile(g, pins);
  const int64_t kps = plan_kps(g, t, pins);
  switch (t) {
    case Tile::f32_tma: {
      const cudaError_t e = simt90_run(g, stream);
      // pinned to simt90 (harness): no silent fallback
      if (e != cudaErrorNotSupported || pins.simt90 == 2) return e;
      return launch<float, CfgF32, false>(g, g.k, nullptr, stream);
    }
    case Tile::f32_big: return launch<float, CfgF32, false>(g, kps, workspace, stream);
    case Tile::f32_small: return launch<float, CfgF32Small>(g, kps, workspace, stream);
    case Tile::f64: return launch<double, CfgF64>(g, kps, workspace, stream);
    default:
      return g.dtype == DType::f16 ? launch<__half, CfgF32, false>(g, kps, workspace, stream)
                                   : launch<__nv_bfloat16, CfgF32, false>(g, kps, workspace, stream);
  }
}

}  // namespace simt_detail

inline size_t simt_workspace_bytes(const GemmArgs& g) {
  return simt_detail::workspace_bytes(g, simt_detail::Pins{});
}

inline cudaError_t simt_run(const GemmArgs& g, void* workspace, cudaStream_t stream) {
  return simt_detail::run(g, workspace, stream, simt_detail::Pins{});
}

}  // namespace torchops::cuda::gemm
