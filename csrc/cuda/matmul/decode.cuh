// Small-M GEMM (decode: M <= 16), bound by streaming B once from memory.
//
// Every CTA owns a slice of output columns and (with split-K) a K-range;
// its warps interleave over that K-range, each streaming its part of B
// with 16-byte loads, and their partial sums meet in a fixed-order tree in
// shared memory.  A (at most 16 rows) is re-read through L1.
//
// half/bfloat16 (sm_80+): tensor cores, mma.m16n8k16 with A's rows padded
// to 16 (the MMA is nearly free here; loads are the cost).  The K order
// inside an MMA is free, so each lane's 16-byte vector is used as loaded:
//   B k-contiguous (nn.Linear weight): lane (g, t) loads B column n0+g,
//     k = kc+8t..+7; words 0,1 feed one MMA and words 2,3 the next, and A is
//     loaded with the same k permutation (16 bytes of rows g and g+8).
//   B n-contiguous: lane (g, t) loads 4 rows k = kc+4t..+3, columns
//     n0+8g..+7, and byte_perm's them into k-pairs: column n0+8g+e is
//     column g of n-tile e (a warp covers 64 columns in 8 MMAs).
// float32: exact FMA on CUDA cores (lane = 4 k's of 4 columns, or 4
// columns of 4 k's), register tile MT x 4 with MT >= M a template.
//
// Split-K over CTAs (when the column slices alone cannot fill the GPU)
// sums the float partials in split order: bitwise reproducible.  On Hopper
// with two splits, the two CTAs of a column slice run as one thread-block
// cluster and each sums half of the outputs from both CTAs' shared memory:
// one kernel, no workspace.  Otherwise the partials go to the workspace,
// [split][batch][m][n], and a second kernel sums them (or, in the
// one-kernel variant a tuning harness may pick, the last CTA of a column
// slice to arrive, through a self-resetting ticket per slice).
//
// A tuning harness (scripts/matmul_dev) runs other kernel shapes and split
// policies through make_plan's Choice and run_plan.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm_args.cuh"
#include "split_k.cuh"

namespace torchops::cuda::gemm {
namespace decode_detail {

constexpr int kMaxM = 16;
constexpr int kMaxGridZ = 65535;

// One-kernel split-K: a ticket per (column slice, batch) CTA column.  Zero at
// module load; the last arriving CTA puts it back to 0, so no memset is
// needed between calls (CUDA-graph safe).  Not safe for two such launches
// running at once on different streams: they would share tickets (this is
// why the automatic choice does not use it yet).
constexpr int kTickets = 8192;
static __device__ unsigned int decode_tickets[kTickets];

struct Params {
  const void* a;
  int64_t a_bs, a_rs;  // A's k stride is 1
  const void* b;
  int64_t b_bs, b_ld;  // B's other stride is 1 (k for the BK kernels, n for BN)
  void* c;
  float* ws;  // split-K partials, used when splits > 1
  int64_t batch;
  int m, n, k;
  int splits, kps;  // K per split (multiple of 64)
  int one_kernel;   // splits > 1: the last CTA of a slice reduces (tickets)
  int cluster;      // splits > 1 (sm_90+): the splits of a slice are one cluster
                    // and its rank 0 sums their partials from shared memory
};

// Cluster split-K: each CTA's partials, (row, col % kPartCols), in its
// shared memory; the widest CTA slice is 128 columns.
constexpr int kPartCols = 128;
__device__ __forceinline__ float* cluster_part() {
  static __shared__ __align__(16) float part[kMaxM * kPartCols];
  return part;
}

__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// The splits of a cluster split-K (make_plan clusters only two).
constexpr int kClusterSplits = 2;

// The address `p` has here, in CTA `rank`'s shared memory.
__device__ __forceinline__ unsigned peer_addr(const float* p, unsigned rank) {
  unsigned a = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(a) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
#endif
  return a;
}

// A float of CTA `rank`'s shared memory, at the address `p` has here.
__device__ __forceinline__ float ld_peer(const float* p, unsigned rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer_addr(p, rank)) : "memory");
#endif
  return v;
}

// Four floats of CTA `rank`'s shared memory (p 16-byte aligned).
__device__ __forceinline__ float4 ld_peer4(const float* p, unsigned rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(peer_addr(p, rank))
               : "memory");
#endif
  return v;
}

// Kernel shape.  NW warps per CTA; BKT n-tiles (8 columns each) per CTA of
// the B-k-contiguous kernel; BNG 64-column groups per CTA of the
// B-n-contiguous kernel (its warps split into BNG groups); UK/UN/UF chunks
// per warp step (independent 16-byte B loads in flight per lane: 4*UK, 4*UN,
// 4*UF) of the bk, bn and f32 kernels; LD the flavour of B's loads (0
// ld.global.cs, 1 ld.global.nc.L1::no_allocate, 2 the same with an L2 256-byte
// prefetch hint, 3 the same with an L2 evict-first policy, 4 ld.global.cs with
// that policy); MINB CTAs per SM asked of ptxas (and the auto split's target).
template <int NW_, int BKT_, int BNG_, int UK_, int UN_, int UF_, int LD_, int MINB_>
struct KCfg {
  static constexpr int NW = NW_, BKT = BKT_, BNG = BNG_, UK = UK_, UN = UN_, UF = UF_, LD = LD_,
                       MINB = MINB_;
};
struct Geom {
  int nw, bkt, bng, uk, un, uf, minb;
};
template <class C> constexpr Geom geom_of() { return {C::NW, C::BKT, C::BNG, C::UK, C::UN, C::UF, C::MINB}; }


__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }
__device__ __forceinline__ uint2 ldg8(const void* p) { return __ldg(static_cast<const uint2*>(p)); }

// B is read exactly once.  LD 0: streaming (evict-first) loads.  LD 1/2:
// the read-only path without L1 allocation (B never returns to L1; A does).
// LD 3/4: with an explicit L2 evict-first policy (meant to keep what else
// the L2 holds; no faster in the bench, see below).
template <int LD>
__device__ __forceinline__ uint4 ldb16(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (LD == 1 || (LD == 2 && __CUDA_ARCH__ < 800)) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  } else if constexpr (LD == 2) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (LD == 3 || LD == 4) {
    // An L2 policy that marks B's lines first to go, so that streaming B
    // does not push out what else is cached.  Behind an L2 full of dirty
    // lines (a benchmark's flush by memset) it times as .cs does: the
    // write-backs cost both alike, cuBLAS too.  The automatic config (K0)
    // uses it with the nc load (LD 3).
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    uint4 v;
    if constexpr (LD == 3) {
      asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    } else {
      asm("ld.global.cs.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    }
    return v;
  }
#endif
  return __ldcs(static_cast<const uint4*>(p));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// d += A(16x16, row) * B(16x8, col), float accumulation.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (IsBf16<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#else
  __trap();  // decode_supports refuses half types below sm_80
#endif
}

// Sums v over the NW warps (of one group) into warp 0, in a fixed tree
// (w += w + half, half = NW/2 .. 1).  red: (NW/2) * NV * 32 floats.  Every
// thread of the block calls it (it syncs the block).
template <int NW, int NV>
__device__ __forceinline__ void tree_reduce(float (&v)[NV], float* red, int warp, int lane) {
#pragma unroll
  for (int half = NW / 2; half >= 1; half >>= 1) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int j = 0; j < NV; ++j) red[((warp - half) * NV + j) * 32 + lane] = v[j];
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int j = 0; j < NV; ++j) v[j] += red[(warp * NV + j) * 32 + lane];
    }
    __syncthreads();
  }
}

template <typename T>
__device__ __forceinline__ void put(const Params& p, int64_t bi, int row, int col, float v) {
  const int64_t idx = (bi * p.m + row) * p.n + col;
  if (p.splits == 1) {
    static_cast<T*>(p.c)[idx] = to_out<T, float>(v);
  } else if (p.cluster) {
    cluster_part()[row * kPartCols + col % kPartCols] = v;
  } else {
    p.ws[int64_t(blockIdx.y) * p.batch * p.m * p.n + idx] = v;
  }
}

// fence.acq_rel at GPU scope: enough for the ticket's release/acquire, and
// lighter than __threadfence() (fence.sc).
__device__ __forceinline__ void fence_acq_rel_gpu() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
  __threadfence();
#endif
}

// Cluster split-K's sum (split_finish), for half/bfloat16 outputs: each
// CTA takes a contiguous half of the outputs, and where the slice's width
// allows a thread reads four columns per split with one 16-byte remote load,
// both splits' loads issued before the sums (a remote load is a round trip
// of hundreds of cycles, paid once per element by the loop below).  Not for
// float32: in the float kernels its registers join the main loop's
// allocation and push it into spills; as a non-inlined function it would
// slow the half kernels instead.
template <typename T>
__device__ __forceinline__ bool cluster_sum_quads(T* c, int m, int n, int n0, int w) {
  if constexpr (std::is_same<T, float>::value) {
    return false;
  } else {
    if (w % 4 != 0 || n0 % 4 != 0) return false;
    const float* part = cluster_part();
    const int wq = w / 4, total = m * wq, per = (total + kClusterSplits - 1) / kClusterSplits;
    const int end = min(total, (int(blockIdx.y) + 1) * per);
    for (int e = int(blockIdx.y) * per + threadIdx.x; e < end; e += blockDim.x) {
      const int row = e / wq, col = n0 + 4 * (e % wq);
      const float* at = part + row * kPartCols + col % kPartCols;
      float4 v[kClusterSplits];
#pragma unroll
      for (int j = 0; j < kClusterSplits; ++j) v[j] = ld_peer4(at, j);
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kClusterSplits; ++j) {
        s[0] += v[j].x, s[1] += v[j].y, s[2] += v[j].z, s[3] += v[j].w;
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) c[int64_t(row) * n + col + q] = to_out<T, float>(s[q]);
    }
    return true;
  }
}

// One-kernel split-K: after this CTA's partials of columns n0..n0+ncols-1
// are in the workspace, the last CTA of the slice (over blockIdx.y) sums the
// splits in order 0..S-1 from 0.f, as sum_splits does (same bits).  All
// threads call it; grid.z == batch here (one batch entry per CTA).
template <typename T>
__device__ __forceinline__ void split_finish(const Params& p, int64_t bi, int n0, int ncols) {
  if (p.cluster) {
    // The cluster is the slice's splits, rank = blockIdx.y.  Each CTA sums
    // its share of the outputs over the splits' partials, in split order
    // from 0.f (sum_splits' bits), reading the others' shared memory;
    // the second barrier keeps that memory alive (and unchanged by the next
    // batch entry) until every CTA has read it.
    cluster_sync_all();
    const int w = min(ncols, p.n - n0);
    if (!cluster_sum_quads<T>(static_cast<T*>(p.c) + bi * p.m * p.n, p.m, p.n, n0, w)) {
      const float* part = cluster_part();
      for (int e = threadIdx.x + blockIdx.y * blockDim.x; e < p.m * w; e += p.splits * blockDim.x) {
        const int row = e / w, col = n0 + e % w;
        const float* at = part + row * kPartCols + col % kPartCols;
        float s = 0.f;
        for (int j = 0; j < p.splits; ++j) s += ld_peer(at, j);
        static_cast<T*>(p.c)[(bi * p.m + row) * p.n + col] = to_out<T, float>(s);
      }
    }
    cluster_sync_all();
    return;
  }
  if (!p.one_kernel) return;  // uniform over the grid
  __shared__ unsigned s_last;
  __syncthreads();  // the CTA's partial stores, before thread 0's release (as CUTLASS's semaphore)
  if (threadIdx.x == 0) {
    unsigned* tk = &decode_tickets[blockIdx.z * gridDim.x + blockIdx.x];
    fence_acq_rel_gpu();  // release (cumulative: covers what the barrier ordered before it)
    const unsigned last = atomicAdd(tk, 1u) == gridDim.y - 1;
    if (last) {
      atomicExch(tk, 0u);  // every CTA of the slice has arrived: ready for the next call
      fence_acq_rel_gpu();  // acquire: the other CTAs' partials
    }
    s_last = last;
  }
  __syncthreads();
  if (s_last) {
    fence_acq_rel_gpu();
    const int w = min(ncols, p.n - n0);
    const int64_t total = p.batch * p.m * p.n;
    for (int e = threadIdx.x; e < p.m * w; e += blockDim.x) {
      const int row = e / w, col = n0 + e % w;
      const int64_t idx = (bi * p.m + row) * p.n + col;
      float s = 0.f;
      for (int j = 0; j < p.splits; ++j) s += __ldcg(p.ws + j * total + idx);  // L2, not L1
      static_cast<T*>(p.c)[idx] = to_out<T, float>(s);
    }
  }
  __syncthreads();  // s_last and shared memory are reused by the next batch entry
}

// ---- half/bfloat16, B k-contiguous: CTA = 8*BKT columns, NW warps over K.
template <typename T, class C>
__global__ void __launch_bounds__(C::NW * 32, C::MINB) decode_mma_bk(const Params p) {
  constexpr int NW = C::NW, TILES = C::BKT, U = C::UK;
  constexpr int NV = TILES * 4;
  constexpr int KSTEP = 32 * U;
  constexpr int COLS = 8 * TILES;
  __shared__ float red[(NW / 2 > 0 ? NW / 2 : 1) * NV * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * COLS;
  const int kbeg = blockIdx.y * p.kps;
  const int kend = min(p.k, kbeg + p.kps);  // multiple of 8: whole lane vectors in or out

  for (int64_t bi = blockIdx.z; bi < p.batch; bi += gridDim.z) {
    const T* A = static_cast<const T*>(p.a) + bi * p.a_bs;
    const T* B = static_cast<const T*>(p.b) + bi * p.b_bs;
    const bool ar0 = g < p.m, ar1 = g + 8 < p.m;
    const T* a0 = A + int64_t(g) * p.a_rs;
    const T* a1 = A + int64_t(g + 8) * p.a_rs;
    const T* bcol[TILES];
    bool bok[TILES];
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const int col = n0 + j * 8 + g;
      bok[j] = col < p.n;
      bcol[j] = B + int64_t(col) * p.b_ld;
    }
    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    for (int kc = kbeg + warp * KSTEP; kc < kend; kc += NW * KSTEP) {
      uint4 av[U][2], bv[U][TILES];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = kc + u * 32 + t * 8;
        const bool kin = kk < kend;
        const uint4 z = make_uint4(0, 0, 0, 0);
        av[u][0] = (kin && ar0) ? ldg16(a0 + kk) : z;
        av[u][1] = (kin && ar1) ? ldg16(a1 + kk) : z;
#pragma unroll
        for (int j = 0; j < TILES; ++j) bv[u][j] = (kin && bok[j]) ? ldb16<C::LD>(bcol[j] + kk) : z;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
          mma16816<T>(acc[j], av[u][0].x, av[u][1].x, av[u][0].y, av[u][1].y, bv[u][j].x, bv[u][j].y);
          mma16816<T>(acc[j], av[u][0].z, av[u][1].z, av[u][0].w, av[u][1].w, bv[u][j].z, bv[u][j].w);
        }
      }
    }

    float (&flat)[NV] = *reinterpret_cast<float(*)[NV]>(&acc[0][0]);
    tree_reduce<NW, NV>(flat, red, warp, lane);
    if (warp == 0) {
#pragma unroll
      for (int j = 0; j < TILES; ++j) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = g + (r >> 1) * 8, col = n0 + j * 8 + t * 2 + (r & 1);
          if (row < p.m && col < p.n) put<T>(p, bi, row, col, acc[j][r]);
        }
      }
    }
    split_finish<T>(p, bi, n0, COLS);
  }
}

// ---- half/bfloat16, B n-contiguous: CTA = BNG groups of 64 columns (8
// n-tiles), NW/BNG warps per group over K.
template <typename T, class C>
__global__ void __launch_bounds__(C::NW * 32, C::MINB) decode_mma_bn(const Params p) {
  constexpr int G = C::BNG, WPG = C::NW / C::BNG, U = C::UN;
  constexpr int NV = 8 * 4;
  constexpr int KSTEP = 16 * U;
  constexpr int RED = (WPG / 2 > 0 ? WPG / 2 : 1) * NV * 32;
  __shared__ float red[G * RED];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = warp / WPG, wk = warp % WPG;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = (blockIdx.x * G + grp) * 64;
  const int colg = n0 + g * 8;  // n % 8 == 0: a lane's 8 columns are all in or all out
  const int kbeg = blockIdx.y * p.kps;
  const int kend = min(p.k, kbeg + p.kps);

  for (int64_t bi = blockIdx.z; bi < p.batch; bi += gridDim.z) {
    const T* A = static_cast<const T*>(p.a) + bi * p.a_bs;
    const T* B = static_cast<const T*>(p.b) + bi * p.b_bs + colg;
    const bool ar0 = g < p.m, ar1 = g + 8 < p.m, cok = colg < p.n;
    const T* a0 = A + int64_t(g) * p.a_rs;
    const T* a1 = A + int64_t(g + 8) * p.a_rs;
    float acc[8][4];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e][0] = acc[e][1] = acc[e][2] = acc[e][3] = 0.f;

    for (int kc = kbeg + wk * KSTEP; kc < kend; kc += WPG * KSTEP) {
      uint2 av[U][2];
      uint4 bv[U][4];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kr = kc + u * 16 + t * 4;  // this lane's 4 k rows; kend % 4 == 0
        const bool kin = kr < kend;
        av[u][0] = (kin && ar0) ? ldg8(a0 + kr) : make_uint2(0, 0);
        av[u][1] = (kin && ar1) ? ldg8(a1 + kr) : make_uint2(0, 0);
#pragma unroll
        for (int r = 0; r < 4; ++r)
          bv[u][r] = (kin && cok) ? ldb16<C::LD>(B + int64_t(kr + r) * p.b_ld) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          // k-pairs (rows 0,1) and (rows 2,3) of column e: logical k (2t, 2t+1)
          // and (2t+8, 2t+9), matching A's words x and y.
          const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
          const uint32_t b0 = __byte_perm(word(bv[u][0], e >> 1), word(bv[u][1], e >> 1), sel);
          const uint32_t b1 = __byte_perm(word(bv[u][2], e >> 1), word(bv[u][3], e >> 1), sel);
          mma16816<T>(acc[e], av[u][0].x, av[u][1].x, av[u][0].y, av[u][1].y, b0, b1);
        }
      }
    }

    float (&flat)[NV] = *reinterpret_cast<float(*)[NV]>(&acc[0][0]);
    tree_reduce<WPG, NV>(flat, red + grp * RED, wk, lane);
    if (wk == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          // MMA column 2t+(r&1) of n-tile e is column n0 + 8*(2t+(r&1)) + e.
          const int row = g + (r >> 1) * 8, col = n0 + (t * 2 + (r & 1)) * 8 + e;
          if (row < p.m && col < p.n) put<T>(p, bi, row, col, acc[e][r]);
        }
      }
    }
    split_finish<T>(p, bi, blockIdx.x * G * 64, G * 64);
  }
}

// ---- float32, B k-contiguous: CTA = 4 columns, 8 warps; lane = 4 k's.
constexpr int kF32BkWarps = 8, kF32BkCols = 4;

template <int MT, int U, int LD>
__global__ void __launch_bounds__(kF32BkWarps * 32) decode_f32_bk(const Params p) {
  constexpr int NC = kF32BkCols;
  constexpr int KSTEP = 128 * U;
  __shared__ float red[kF32BkWarps][MT * NC];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = blockIdx.x * NC;
  const int kbeg = blockIdx.y * p.kps;
  const int kend = min(p.k, kbeg + p.kps);  // multiple of 4

  for (int64_t bi = blockIdx.z; bi < p.batch; bi += gridDim.z) {
    const float* A = static_cast<const float*>(p.a) + bi * p.a_bs;
    const float* B = static_cast<const float*>(p.b) + bi * p.b_bs;
    float acc[MT][NC];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[i][c] = 0.f;

    for (int kc = kbeg + warp * KSTEP; kc < kend; kc += kF32BkWarps * KSTEP) {
      float4 w[U][NC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = kc + u * 128 + lane * 4;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const uint4 v = (kk < kend && n0 + c < p.n)
                              ? ldb16<LD>(B + int64_t(n0 + c) * p.b_ld + kk)
                              : make_uint4(0, 0, 0, 0);
          w[u][c] = *reinterpret_cast<const float4*>(&v);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = kc + u * 128 + lane * 4;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const uint4 v = (kk < kend && i < p.m) ? ldg16(A + int64_t(i) * p.a_rs + kk)
                                                 : make_uint4(0, 0, 0, 0);
          const float4 a = *reinterpret_cast<const float4*>(&v);
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            float s = acc[i][c];
            s = fmaf(a.x, w[u][c].x, s);
            s = fmaf(a.y, w[u][c].y, s);
            s = fmaf(a.z, w[u][c].z, s);
            s = fmaf(a.w, w[u][c].w, s);
            acc[i][c] = s;
          }
        }
      }
    }

    // Butterfly: every lane ends with the same (order-fixed) warp sum.
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float s = acc[i][c];
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        acc[i][c] = s;
      }
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int c = 0; c < NC; ++c) red[warp][i * NC + c] = acc[i][c];
    }
    __syncthreads();
    if (threadIdx.x < MT * NC) {
      const int i = threadIdx.x / NC, c = threadIdx.x % NC;
      float s = 0.f;
#pragma unroll
      for (int w2 = 0; w2 < kF32BkWarps; ++w2) s += red[w2][threadIdx.x];
      if (i < p.m && n0 + c < p.n) put<float>(p, bi, i, n0 + c, s);
    }
    __syncthreads();
    split_finish<float>(p, bi, n0, NC);
  }
}

// ---- float32, B n-contiguous: CTA = 128 columns (lane = 4 columns), 8 warps.
constexpr int kF32BnWarps = 8;
constexpr int kF32BnCols = 128;

template <int MT, int U, int LD>
__global__ void __launch_bounds__(kF32BnWarps * 32) decode_f32_bn(const Params p) {
  constexpr int NV = MT * 4;
  constexpr int KSTEP = 4 * U;  // U: 4-row steps per warp step
  __shared__ float red[kF32BnWarps / 2 * NV * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = blockIdx.x * kF32BnCols + lane * 4;  // n % 4 == 0: all 4 in or out
  const int kbeg = blockIdx.y * p.kps;
  const int kend = min(p.k, kbeg + p.kps);

  for (int64_t bi = blockIdx.z; bi < p.batch; bi += gridDim.z) {
    const float* A = static_cast<const float*>(p.a) + bi * p.a_bs;
    const float* B = static_cast<const float*>(p.b) + bi * p.b_bs + col;
    const bool cok = col < p.n;
    float acc[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    for (int kc = kbeg + warp * KSTEP; kc < kend; kc += kF32BnWarps * KSTEP) {
      float4 w[U][4];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kr = kc + u * 4;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint4 v = (kr < kend && cok) ? ldb16<LD>(B + int64_t(kr + r) * p.b_ld)
                                             : make_uint4(0, 0, 0, 0);
          w[u][r] = *reinterpret_cast<const float4*>(&v);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kr = kc + u * 4;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          // Same address in every lane: one broadcast load.
          const uint4 v = (kr < kend && i < p.m) ? ldg16(A + int64_t(i) * p.a_rs + kr)
                                                 : make_uint4(0, 0, 0, 0);
          const float4 a = *reinterpret_cast<const float4*>(&v);
          acc[i][0] = fmaf(a.w, w[u][3].x, fmaf(a.z, w[u][2].x, fmaf(a.y, w[u][1].x, fmaf(a.x, w[u][0].x, acc[i][0]))));
          acc[i][1] = fmaf(a.w, w[u][3].y, fmaf(a.z, w[u][2].y, fmaf(a.y, w[u][1].y, fmaf(a.x, w[u][0].y, acc[i][1]))));
          acc[i][2] = fmaf(a.w, w[u][3].z, fmaf(a.z, w[u][2].z, fmaf(a.y, w[u][1].z, fmaf(a.x, w[u][0].z, acc[i][2]))));
          acc[i][3] = fmaf(a.w, w[u][3].w, fmaf(a.z, w[u][2].w, fmaf(a.y, w[u][1].w, fmaf(a.x, w[u][0].w, acc[i][3]))));
        }
      }
    }

    float (&flat)[NV] = *reinterpret_cast<float(*)[NV]>(&acc[0][0]);
    tree_reduce<kF32BnWarps, NV>(flat, red, warp, lane);
    if (warp == 0 && cok) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
        if (i < p.m) {
#pragma unroll
          for (int c = 0; c < 4; ++c) put<float>(p, bi, i, col + c, acc[i][c]);
        }
    }
    split_finish<float>(p, bi, blockIdx.x * kF32BnCols, kF32BnCols);
  }
}

enum class Kind { none, mma_bk, mma_bn, f32_bk, f32_bn };

struct Plan {
  Kind kind = Kind::none;
  int64_t col_ctas = 0;
  int splits = 1, kps = 0;
  bool one_kernel = false;
  bool cluster = false;  // split-K summed inside a cluster (no workspace)
};

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int device_cc_major() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
  return major;
}

}  // namespace decode_detail
}  // namespace torchops::cuda::gemm

// The automatic kernel shape and the launch plan, apart from the kernels.
#include "decode_heuristics.cuh"

namespace torchops::cuda::gemm {
namespace decode_detail {

inline dim3 grid_of(const Plan& pl, const Params& p) {
  return dim3(static_cast<unsigned>(pl.col_ctas), static_cast<unsigned>(pl.splits),
              static_cast<unsigned>(p.batch < kMaxGridZ ? p.batch : kMaxGridZ));
}

// A launch, as a cluster of the splits of a column slice where p.cluster.
template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, const Params& p, cudaStream_t st) {
  if (!p.cluster) {
    kernel<<<grid, threads, 0, st>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim = {1, static_cast<unsigned>(p.splits), 1};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int MT, class C>
cudaError_t launch_f32_mt(Kind kind, dim3 grid, const Params& p, cudaStream_t st) {
  if (kind == Kind::f32_bk) return launch(decode_f32_bk<MT, C::UF, C::LD>, grid, kF32BkWarps * 32, p, st);
  return launch(decode_f32_bn<MT, C::UF, C::LD>, grid, kF32BnWarps * 32, p, st);
}

template <class C>
cudaError_t launch_f32(const Plan& pl, const Params& p, cudaStream_t st) {
  const dim3 grid = grid_of(pl, p);
  if (p.m <= 1) return launch_f32_mt<1, C>(pl.kind, grid, p, st);
  if (p.m <= 2) return launch_f32_mt<2, C>(pl.kind, grid, p, st);
  if (p.m <= 4) return launch_f32_mt<4, C>(pl.kind, grid, p, st);
  if (p.m <= 8) return launch_f32_mt<8, C>(pl.kind, grid, p, st);
  return launch_f32_mt<16, C>(pl.kind, grid, p, st);
}

template <typename T, class C>
cudaError_t launch_mma(const Plan& pl, const Params& p, cudaStream_t st) {
  const dim3 grid = grid_of(pl, p);
  if (pl.kind == Kind::mma_bk) return launch(decode_mma_bk<T, C>, grid, C::NW * 32, p, st);
  return launch(decode_mma_bn<T, C>, grid, C::NW * 32, p, st);
}

template <class C>
cudaError_t launch_cfg(DType dt, const Plan& pl, const Params& p, cudaStream_t st) {
  switch (dt) {
    case DType::bf16: return launch_mma<__nv_bfloat16, C>(pl, p, st);
    case DType::f16: return launch_mma<__half, C>(pl, p, st);
    default: return launch_f32<C>(pl, p, st);
  }
}

// The split-K partials' workspace of a plan (none for one split, or where
// a cluster sums them on chip).
inline size_t workspace_bytes(const GemmArgs& g, const Plan& pl) {
  if (pl.kind == Kind::none || pl.splits <= 1 || pl.cluster) return 0;
  return size_t(pl.splits) * size_t(g.batch) * size_t(g.m) * size_t(g.n) * sizeof(float);
}

// Runs a plan with the kernel shape C (the one make_plan's Choice
// described), then sums the splits where a second kernel must.
template <class C>
cudaError_t run_plan(const GemmArgs& g, const Plan& pl, void* workspace, cudaStream_t stream) {
  if (pl.kind == Kind::none) return cudaErrorInvalidValue;
  if (pl.splits > 1 && !pl.cluster && workspace == nullptr) return cudaErrorInvalidValue;
  Params p;
  p.a = g.a.ptr; p.a_bs = g.a.batch_stride; p.a_rs = g.a.row_stride;
  p.b = g.b.ptr; p.b_bs = g.b.batch_stride;
  p.b_ld = (pl.kind == Kind::mma_bk || pl.kind == Kind::f32_bk) ? g.b.col_stride : g.b.row_stride;
  p.c = g.c;
  p.ws = static_cast<float*>(workspace);
  p.batch = g.batch;
  p.m = static_cast<int>(g.m); p.n = static_cast<int>(g.n); p.k = static_cast<int>(g.k);
  p.splits = pl.splits; p.kps = pl.kps;
  p.one_kernel = pl.one_kernel ? 1 : 0;
  p.cluster = pl.cluster ? 1 : 0;
  const cudaError_t err = launch_cfg<C>(g.dtype, pl, p, stream);
  if (err != cudaSuccess || pl.splits == 1 || pl.one_kernel || pl.cluster) return err;
  const int64_t total = g.batch * g.m * g.n;
  switch (g.dtype) {
    case DType::bf16: return launch_sum_splits<__nv_bfloat16>(p.ws, g.c, pl.splits, total, stream);
    case DType::f16: return launch_sum_splits<__half>(p.ws, g.c, pl.splits, total, stream);
    default: return launch_sum_splits<float>(p.ws, g.c, pl.splits, total, stream);
  }
}

}  // namespace decode_detail

// M <= 16; f32/f16/bf16 (half types on sm_80+); A k-contiguous; B with
// unit stride along k or n; 16-byte aligned pointers and vector-multiple
// strides; k (and, n-contiguous B, n) a multiple of 16 bytes' elements.
inline bool decode_supports(const GemmArgs& g) {
  return decode_detail::make_plan(g).kind != decode_detail::Kind::none;
}

inline size_t decode_workspace_bytes(const GemmArgs& g) {
  return decode_detail::workspace_bytes(g, decode_detail::make_plan(g));
}

inline cudaError_t decode_run(const GemmArgs& g, void* workspace, cudaStream_t stream) {
  using namespace decode_detail;
  return run_plan<K0>(g, make_plan(g), workspace, stream);
}

}  // namespace torchops::cuda::gemm
