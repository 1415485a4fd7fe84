// Hopper (sm_90a) path of torchops.matmul for bf16 and fp16: wgmma tensor
// cores fed by TMA through a ring of shared-memory stages synchronised with
// mbarriers.
//
// One persistent CTA per SM walks output tiles (BM x BN, BM = 128, or 64
// for 16-bit problems whose 128-row tiles would leave SMs idle) in a
// grouped order, so neighbouring CTAs share A rows and B columns in L2.
// Three warpgroups, specialised:
//   warpgroup 0 (producer) gives its registers away (setmaxnreg) and one of
//     its threads issues the TMA loads of A and B into the stage ring, as far
//     ahead as free stages allow, across tile boundaries;
//   warpgroups 1 and 2 (consumers) each own 64 rows of the tile (64x128
//     tiles: half of its columns; 64x64: all of it, but half of each
//     stage's k steps, the second handing its sums to the first), run wgmma
//     m64nNk16 on the stage, release it, and store their fp32 accumulators
//     (converted) to C.
// Where the tiles would leave most SMs idle and K is long, K is split:
// each (tile, split) unit stores an fp32 partial into a workspace and a
// second kernel sums them in split order (deterministic).
// TMA does the bounds: a box that reaches past M, N or K is zero-filled, so
// any size is exact with no tail code.  TMA needs the contiguous dimension
// of each operand to have unit stride and the other strides to be multiples
// of 16 bytes: sm90_supports says so, and the caller copies or falls back.
// A is read K-major (row-major A); B either K-major (B = W^T, nn.Linear's
// weight) or N-major (row-major B), the latter with wgmma's transpose bit.
//
// tf32 wgmma reads shared memory K-major only.  An M-major A reaches it
// through registers (wgmma's A-from-registers form, fragments loaded from
// the swizzled stage), and a row-major B by computing C^T = B^T A^T, where
// B^T is such an A and C^T is stored transposed: no operand is copied.
//
// The 3xTF32 mode (sm90_3xtf32_*, below) is float32 at float32 accuracy on
// those tensor cores, for callers that opt in (deform_conv2d): C^T = B^T
// A^T as above, where B^T comes through registers and is split there into
// TF32 high and low parts (cuda/common/tf32_parts.cuh), and A, small, is
// split once by a kernel of its own into the workspace, per 64 rows of A
// 64 rows of high parts then 64 of low ones.  A 128-wide B tile of the
// kernel then holds both parts of 64 output columns, and per k step
//   acc    += hi(B^T) @ [hi(A^T) | lo(A^T)]   (m64n128)
//   acc_lo += lo(B^T) @ hi(A^T)               (m64n64)
// so the output is acc[:, :64] + acc[:, 64:] + acc_lo: the three products
// of cuda/common/split_tf32.cuh, with the large operand read once and never
// stored twice.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "cuda/common/tf32_parts.cuh"
#include "cuda/matmul/gemm_args.cuh"
#include "cuda/matmul/split_k.cuh"
#include "cuda/matmul/tma.cuh"
#include "cuda/matmul/wgmma.cuh"

namespace torchops::cuda::gemm {
namespace sm90_detail {

constexpr int kBM = 128;        // two consumer warpgroups x 64 rows
// A stage holds 128 bytes of k per row (64 bf16/fp16 or 32 tf32): one
// 128-byte swizzle row, four wgmma k-steps of 32 bytes.
constexpr int kRowBytes = 128;
constexpr int kThreads = 384;   // producer + 2 consumers
constexpr int kGroupM = 16;     // tile rows per raster group (L2 reuse)

// kTM: tile rows.  128: the two consumers take 64 rows each; 64: they share
// the 64 rows of A and take BN / 2 columns each (twice the tiles of a
// problem, for those whose 128-row tiles leave SMs idle).  64 x 64 and 64 x
// 32 (kKSplit): both take the whole tile, each half of every stage's k
// steps, and the second hands its sums to the first through shared memory
// (four or eight times the tiles of 128x128, for few rows against a large
// B, without split-K's partials in memory).  64 x 32 needs a K-major B (a
// row-major B's TMA box is 64 columns wide) and the direct epilogue.
template <int BN, bool kTmaStore, int kTM = kBM>
struct Config {
  static constexpr bool kKSplit = kTM != kBM && BN <= 64;
  static constexpr int kABytes = kTM * kRowBytes;
  static constexpr int kBBytes = BN * kRowBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // a consumer's outputs: 64 x this
  static constexpr int kConsumerCols = kTM == kBM || kKSplit ? BN : BN / 2;
  // The TMA-store epilogue stages each consumer's 64 x kConsumerCols output
  // in shared memory, at the price of a stage of the ring.
  static constexpr int kCBytes = kTmaStore ? 2 * 64 * kConsumerCols * 2 : 0;
  // kKSplit: the second consumer's float sums, handed to the first.
  static constexpr int kXBytes = kKSplit ? 64 * BN * 4 : 0;
  static constexpr int kFit = (227 * 1024 - kCBytes - kXBytes - 1024 - 128) / kStageBytes;
  // The 64-row tiles read little per stage and serve few-row problems bound
  // by memory, so their ring takes all the shared memory left (64x128: 8
  // stages, 64x64: 12, 64x32: 18; cuBLAS runs 64x64 with 13 and 64x32 with
  // 16); a cap of 6 at 64x128 is measurably slower.
  static constexpr int kStages =
      kTM != kBM ? kFit
      : kTmaStore ? (BN == 256 ? 3 : BN == 192 ? 4 : 5) : (BN == 256 ? 4 : BN == 192 ? 5 : 6);
  // 1024-byte alignment of every stage (128-byte swizzle atoms), barriers after.
  static constexpr int kSmemBytes =
      kStages * kStageBytes + kCBytes + kXBytes + 1024 + 2 * kStages * 8;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block: 227 KB on sm_90");
};

struct Problem {
  int64_t batch, m, n, k;
  int tiles_m, tiles_n;
  int64_t tiles;  // batch * tiles_m * tiles_n
  int k_blocks;
  int store_t;  // the kernel computes C^T: element (i, j) goes to C[j, i]
  // Split-K: the work is `splits` x `tiles` units, split-major; split j
  // covers k blocks [j * split_kb, +split_kb) and stores its fp32 partial,
  // laid out like C, at ws + j * batch * m * n (sum_splits adds them up).
  int splits, split_kb;
  float* ws;
  int b_one;  // one B matrix for every batch (3xTF32: A's parts, shared)
};

// Unit t: its tile and its k blocks [kb0, kb0 + nkb).
__host__ __device__ __forceinline__ void unit_k(const Problem& p, int64_t t, int64_t& tile,
                                                 int& split, int& kb0, int& nkb) {
  split = static_cast<int>(t / p.tiles);
  tile = t - split * p.tiles;
  kb0 = split * p.split_kb;
  nkb = p.k_blocks - kb0 < p.split_kb ? p.k_blocks - kb0 : p.split_kb;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

using tma::mbar_arrive;
using tma::mbar_expect_tx;
using tma::mbar_init;
using tma::mbar_wait;
using tma::smem_addr;
using tma::tma_load_3d;

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Named barrier of one consumer warpgroup (id 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// Named barrier of both consumer warpgroups.
__device__ __forceinline__ void consumers_sync(int id) {
  asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.  SBO: bytes between
// groups of 8 rows (K-major) or 8 k-rows (MN-major) = one 1024-byte atom;
// LBO: bytes between 64-element column blocks of an MN-major operand
// (unused for K-major, where one k16 step stays inside the 128-byte row).
__device__ __forceinline__ uint64_t make_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr(p) & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int BN>
__device__ __forceinline__ void wgmma_step_rs(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t db,
                                              int scale_d) {
  if constexpr (BN == 256) wgmma_m64n256k8_tf32_rs(d, a, db, scale_d);
  else wgmma_m64n128k8_tf32_rs(d, a, db, scale_d);
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// One stage's A fragments (four k8 steps); with kSplit also their low
// parts (hi holds the high parts then).
template <bool kSplit>
struct RsFrags {
  uint32_t hi[4][4];
  uint32_t lo[kSplit ? 4 : 1][4];
};

// Tells the compiler the registers are used here: A fragments must stay in
// their registers until the wgmmas reading them asynchronously are waited for.
template <bool kSplit>
__device__ __forceinline__ void keep_regs(RsFrags<kSplit>& f) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      asm volatile("" : "+r"(f.hi[i][j])::"memory");
      if constexpr (kSplit) asm volatile("" : "+r"(f.lo[i][j])::"memory");
    }
}

// Where a consumer's stages are: its A rows and the B tile of stage 0.
struct RsSmem {
  const unsigned char* a;
  const unsigned char* b;
  int stage_bytes;
};

// One stage of the A-from-registers form: load the stage's fragments into
// `cur`, issue its wgmmas, and once the previous stage's are done, its
// fragments (`prev`) and buffers are free.  Two fragment sets alternate
// (the caller unrolls by two) because wgmma reads them asynchronously.
// kSplit (3xTF32, BN = 128): the fragments are split into high and low
// parts, acc takes hi @ the whole B tile (both parts of 64 columns) and
// acc_lo lo @ its first 64 rows (the high parts).
template <int S, int BN, bool kSplit>
__device__ __forceinline__ void rs_stage(float (&acc)[BN / 2], float (&acc_lo)[32],
                                         RsFrags<kSplit>& cur, RsFrags<kSplit>& prev, int kb,
                                         uint32_t& it, const RsSmem& sm, uint64_t* full,
                                         uint64_t* empty, const uint32_t (&a_off)[4]) {
  const int s = it % S;
  mbar_wait(&full[s], (it / S) & 1);
  const uint32_t sa = smem_addr(sm.a + s * sm.stage_bytes);
  const unsigned char* sb = sm.b + s * sm.stage_bytes;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint32_t x = lds32(sa + ks * 8 * kRowBytes + a_off[v]);
      if constexpr (kSplit) {
        float hi, lo;
        split_tf32(__uint_as_float(x), hi, lo);
        cur.hi[ks][v] = __float_as_uint(hi);
        cur.lo[ks][v] = __float_as_uint(lo);
      } else {
        cur.hi[ks][v] = x;
      }
    }
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint64_t db = make_desc(sb + ks * 32, 16, 1024);
    const int scale = (kb > 0 || ks > 0) ? 1 : 0;
    wgmma_step_rs<BN>(acc, cur.hi[ks], db, scale);
    if constexpr (kSplit) wgmma_m64n64k8_tf32_rs(acc_lo, cur.lo[ks], db, scale);
  }
  wgmma_commit();
  wgmma_wait<1>();
  keep_regs(prev);
  if (kb > 0) mbar_arrive(&empty[(it + S - 1) % S]);
  ++it;
}

template <typename T, int BN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_step(float (&d)[BN / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (T::kIsTf32) {
    if constexpr (BN == 256) wgmma_m64n256k8_tf32(d, da, db, scale_d);
    else wgmma_m64n128k8_tf32(d, da, db, scale_d);
  } else if constexpr (BN == 256) {
    if constexpr (T::kIsBf16) wgmma_m64n256k16_bf16<kTransA, kTransB>(d, da, db, scale_d);
    else wgmma_m64n256k16_f16<kTransA, kTransB>(d, da, db, scale_d);
  } else if constexpr (BN == 192) {
    if constexpr (T::kIsBf16) wgmma_m64n192k16_bf16<kTransA, kTransB>(d, da, db, scale_d);
    else wgmma_m64n192k16_f16<kTransA, kTransB>(d, da, db, scale_d);
  } else if constexpr (BN == 128) {
    if constexpr (T::kIsBf16) wgmma_m64n128k16_bf16<kTransA, kTransB>(d, da, db, scale_d);
    else wgmma_m64n128k16_f16<kTransA, kTransB>(d, da, db, scale_d);
  } else if constexpr (BN == 64) {
    if constexpr (T::kIsBf16) wgmma_m64n64k16_bf16<kTransA, kTransB>(d, da, db, scale_d);
    else wgmma_m64n64k16_f16<kTransA, kTransB>(d, da, db, scale_d);
  } else {
    static_assert(BN == 32, "wgmma N: 32, 64, 128, 192 or 256");
    if constexpr (T::kIsBf16) wgmma_m64n32k16_bf16<kTransA, kTransB>(d, da, db, scale_d);
    else wgmma_m64n32k16_f16<kTransA, kTransB>(d, da, db, scale_d);
  }
}

// The raster: tiles in groups of kGroupM tile rows, columns walked within a
// group, so the CTAs running at once touch few distinct A and B panels.
__device__ __forceinline__ void tile_coords(const Problem& p, int64_t t, int& bi, int& tm, int& tn) {
  const int64_t per_batch = static_cast<int64_t>(p.tiles_m) * p.tiles_n;
  bi = static_cast<int>(t / per_batch);
  int64_t m, n;
  grouped_tile(t - bi * per_batch, p.tiles_m, p.tiles_n, kGroupM, m, n);
  tm = static_cast<int>(m);
  tn = static_cast<int>(n);
}

// The producer warpgroup's work, done by one thread: for each (tile, split)
// unit of this CTA, each k block's A and B boxes into the next stage of the
// ring, once the consumers have freed it.
template <typename T, int BN, int kTransA, int kTransB, int kTM, class Cfg>
__device__ __forceinline__ void produce(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                        const Problem& p, unsigned char* smem, uint64_t* full,
                                        uint64_t* empty) {
  constexpr int kBK = kRowBytes / T::kBytes;   // k per stage
  constexpr int kMRows = kRowBytes / T::kBytes;  // MN-major box: rows of 128 bytes
  constexpr int kMBoxBytes = kRowBytes * kBK;    // one such box of a stage
  constexpr int S = Cfg::kStages;
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < p.tiles * p.splits; t += gridDim.x) {
    int64_t tile;
    int bi, tm, tn, split, kb0, nkb;
    unit_k(p, t, tile, split, kb0, nkb);
    tile_coords(p, tile, bi, tm, tn);
    for (int kb = kb0; kb < kb0 + nkb; ++kb, ++it) {
      const int s = it % S;
      mbar_wait(&empty[s], ((it / S) & 1) ^ 1);
      unsigned char* sa = smem + s * Cfg::kStageBytes;
      unsigned char* sb = sa + Cfg::kABytes;
      mbar_expect_tx(&full[s], Cfg::kStageBytes);
      if constexpr (kTransA) {
        // M-contiguous A: boxes of 128 bytes of m (64 bf16/fp16 rows,
        // 32 fp32) x kBK k, 64 rows per consumer.
#pragma unroll
        for (int j = 0; j < kTM / kMRows; ++j) {
          tma_load_3d(sa + j * kMBoxBytes, &map_a, &full[s], tm * kTM + j * kMRows, kb * kBK, bi);
        }
      } else {
        tma_load_3d(sa, &map_a, &full[s], kb * kBK, tm * kTM, bi);
      }
      if constexpr (kTransB) {
        // Row-major B: boxes of 128 bytes of n x kBK k-rows.
#pragma unroll
        for (int j = 0; j < BN / kMRows; ++j) {
          tma_load_3d(sb + j * kMBoxBytes, &map_b, &full[s], tn * BN + j * kMRows, kb * kBK, bi);
        }
      } else {
        tma_load_3d(sb, &map_b, &full[s], kb * kBK, tn * BN, p.b_one ? 0 : bi);
      }
    }
  }
}

#endif  // sm_90a

// Element tags: the kernel only moves bits; kBytes sets k per stage, Elem is C's
// element (what the split-K sum writes).
struct Bf16Tag { static constexpr bool kIsBf16 = true, kIsTf32 = false; static constexpr int kBytes = 2; using Elem = __nv_bfloat16; };
struct F16Tag { static constexpr bool kIsBf16 = false, kIsTf32 = false; static constexpr int kBytes = 2; using Elem = __half; };
// float32 inputs on TF32 tensor cores (the hardware reads 19 of 32 bits).
struct Tf32Tag { static constexpr bool kIsBf16 = false, kIsTf32 = true; static constexpr int kBytes = 4; using Elem = float; };

__device__ __forceinline__ uint32_t pack2(float lo, float hi, bool bf16) {
  uint32_t r;
  if (bf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ uint16_t pack1(float v, bool bf16) {
  uint16_t r;
  if (bf16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  }
  return r;
}

template <typename T, int BN, int kTransA, int kTransB, bool kTmaStore, bool kSplit = false,
          int kTM = kBM>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    const __grid_constant__ CUtensorMap map_c, void* __restrict__ c, const Problem p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Config<BN, kTmaStore, kTM>;
  static_assert(kTM == kBM || (!T::kIsTf32 && !kSplit &&
                                (BN == 128 || BN == 64 || (BN == 32 && !kTransB && !kTmaStore))),
                "64-row tiles: 16-bit inputs, 128 or 64 columns, or 32 with a K-major B "
                "and the direct epilogue (64x256 is not built)");
  constexpr bool kKSplit = Cfg::kKSplit;
  // A consumer's wgmma N (its columns of the tile), and where its rows and
  // columns start in the tile.
  constexpr int kCN = Cfg::kConsumerCols;
  constexpr int kBK = kRowBytes / T::kBytes;  // k per stage
  constexpr int kBox = 64 * kRowBytes;        // bytes of a 64-row box
  static_assert(!T::kIsTf32 || (!kTransB && !kTmaStore),
                "tf32: a K-major B and the direct epilogue only");
  static_assert(!kSplit || (T::kIsTf32 && kTransA && BN == 128),
                "3xTF32: A through registers, 128-wide B tiles (64 output columns)");
  // Output columns per tile: with kSplit a B tile holds two parts of each.
  constexpr int kOutBN = kSplit ? BN / 2 : BN;
  constexpr int kOutCN = kSplit ? BN / 2 : kCN;  // a consumer's output columns
  constexpr int kMBoxBytes = kRowBytes * kBK;     // one such box of a stage
  constexpr bool kRegA = T::kIsTf32 && kTransA;   // A through registers
  constexpr int S = Cfg::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* smem_c = smem + S * Cfg::kStageBytes;
  float* xsum = reinterpret_cast<float*>(smem_c + Cfg::kCBytes);  // kKSplit
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_c + Cfg::kCBytes + Cfg::kXBytes);
  uint64_t* empty = full + S;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2 * 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    tma::setmaxnreg_dec<40>();
    if (tid == 0) produce<T, BN, kTransA, kTransB, kTM, Cfg>(map_a, map_b, p, smem, full, empty);
    return;
  }

  tma::setmaxnreg_inc<232>();
  // Consumer index: rows cw*64 .. +64 of the tile (64x128: columns cw*kCN
  // ..; 64x64: k steps cw*2 .. +2 of each stage).
  const int cw = wg - 1;
  const int row_off = kTM == kBM ? cw * 64 : 0, col_off = kTM == kBM || kKSplit ? 0 : cw * kCN;
  // kKSplit: this consumer's k steps of each stage.
  constexpr int kSteps = kRowBytes / 32, kMySteps = kKSplit ? kSteps / 2 : kSteps;
  const int ks0 = kKSplit ? cw * kMySteps : 0;
  const bool bf16 = T::kIsBf16;
  float acc[kCN / 2];
  float acc_lo[32];  // kSplit only (unused registers otherwise)
  uint32_t it = 0;
  // kRegA: the byte offsets, in this consumer's 64 rows of a stage, of
  // the four A elements lane (g, t) of warp w holds per k8 step: rows
  // 16w + g (+8), k = t (+4); a row is in 32-row box (16w + ..) / 32, its
  // 16-byte chunk c of k-row k swizzled to c ^ (k % 8).
  uint32_t a_off[4] = {0, 0, 0, 0};
  if constexpr (kRegA) {
    const int w = tid / 32, g = (tid % 32) / 4, tq = tid % 4;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int row = 16 * (w % 2) + 8 * (v % 2) + g;  // in its box
      const int k = tq + 4 * (v / 2);
      a_off[v] = (w / 2) * kMBoxBytes + k * kRowBytes + (((row / 4) ^ k) * 16) + (row % 4) * 4;
    }
  }
  RsFrags<kSplit> fa = {}, fb = {};  // kRegA: A fragments of two stages in flight
  const RsSmem smem_rs{smem + cw * kBox, smem + Cfg::kABytes, Cfg::kStageBytes};
  for (int64_t t = blockIdx.x; t < p.tiles * p.splits; t += gridDim.x) {
    int64_t tile;
    int bi, tm, tn, split, kb0, nkb;
    unit_k(p, t, tile, split, kb0, nkb);
    tile_coords(p, tile, bi, tm, tn);
    // kb counts this unit's k blocks from 0 (the first one starts the sum).
    if constexpr (kRegA) {
      int kb = 0;
      for (; kb + 1 < nkb; kb += 2) {
        rs_stage<S, BN, kSplit>(acc, acc_lo, fa, fb, kb, it, smem_rs, full, empty, a_off);
        rs_stage<S, BN, kSplit>(acc, acc_lo, fb, fa, kb + 1, it, smem_rs, full, empty, a_off);
      }
      if (kb < nkb) rs_stage<S, BN, kSplit>(acc, acc_lo, fa, fb, kb, it, smem_rs, full, empty, a_off);
    }
    for (int kb = 0; kb < (kRegA ? 0 : nkb); ++kb, ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);
      const unsigned char* sa = smem + s * Cfg::kStageBytes + (kTM == kBM ? cw * kBox : 0);
      // kTM 64: this consumer's columns, kCN rows of 128 bytes (K-major) or
      // kCN / 64 boxes of 64 columns (N-major): the same byte offset.
      const unsigned char* sb = smem + s * Cfg::kStageBytes + Cfg::kABytes + col_off * kRowBytes;
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kMySteps; ++j) {
        const int ks = ks0 + j;
        // K-major: a k16 step moves 32 bytes along the 128-byte row;
        // MN-major: 16 k-rows of 128 bytes.
        const uint64_t da = kTransA ? make_desc(sa + ks * 16 * 128, kBox, 1024)
                                    : make_desc(sa + ks * 32, 16, 1024);
        const uint64_t db = kTransB ? make_desc(sb + ks * 16 * 128, kBox, 1024)
                                    : make_desc(sb + ks * 32, 16, 1024);
        wgmma_step<T, kCN, kTransA, kTransB>(acc, da, db, (kb > 0 || j > 0) ? 1 : 0);
      }
      wgmma_commit();
      // Keep this stage's wgmmas in flight; the previous stage's are done
      // after wait_group 1, so its buffers go back to the producer.
      wgmma_wait<1>();
      if (kb > 0) mbar_arrive(&empty[(it + S - 1) % S]);
    }
    wgmma_wait<0>();
    if constexpr (kRegA) {
      keep_regs(fa);
      keep_regs(fb);
    }
    mbar_arrive(&empty[(it + S - 1) % S]);
    if constexpr (kKSplit) {
      // The second consumer's sums go to the first, which adds them to its
      // own (always in this order: the same bits every run) and stores the
      // tile.  Barrier 3: written; 4: read, so the buffer is free again.
      if (cw == 1) {
#pragma unroll
        for (int r = 0; r < kCN / 2; ++r) xsum[r * 128 + tid] = acc[r];
        consumers_sync(3);
        consumers_sync(4);
        continue;
      }
      consumers_sync(3);
#pragma unroll
      for (int r = 0; r < kCN / 2; ++r) acc[r] += xsum[r * 128 + tid];
      consumers_sync(4);
    }

    // Accumulator layout of wgmma m64nN (per warp: 16 rows): register r of
    // lane l holds row 16*warp + l/4 + 8*((r/2)%2), column 8*(r/4) + 2*(l%4) + r%2.
    // kSplit: output column j < 64 is acc's column j (hi @ hi) + its column
    // j + 64 (hi @ lo), register r + 32, + acc_lo's column j (lo @ hi).
    const int warp = tid / 32, lane = tid % 32;
    auto out = [&](int r) {
      if constexpr (kSplit) {
        return acc[r] + (acc[r + 32] + acc_lo[r]);
      } else {
        return acc[r];
      }
    };
    if (p.splits > 1) {
      // This split's fp32 partial, where C's element goes (host: no TMA
      // store with split-K).
      const int64_t row0 = static_cast<int64_t>(tm) * kTM + row_off + warp * 16 + lane / 4;
      const int64_t col0 = static_cast<int64_t>(tn) * kOutBN + col_off + 2 * (lane % 4);
      float* ws = p.ws + (static_cast<int64_t>(split) * p.batch + bi) * p.m * p.n;
#pragma unroll
      for (int r = 0; r < kOutCN / 2; r += 2) {
        const int64_t row = row0 + 8 * ((r / 2) % 2);
        const int64_t col = col0 + 8 * (r / 4);
        if (row >= p.m) continue;
        if (p.store_t) {
          if (col < p.n) ws[col * p.m + row] = out(r);
          if (col + 1 < p.n) ws[(col + 1) * p.m + row] = out(r + 1);
        } else {
          if (col < p.n) ws[row * p.n + col] = out(r);
          if (col + 1 < p.n) ws[row * p.n + col + 1] = out(r + 1);
        }
      }
      continue;
    }
    if constexpr (kTmaStore) {
      // Through shared memory, 128-byte swizzled like the TMA box (64 x 64
      // blocks): the 8 rows a warp writes at once land in 8 different
      // 16-byte bank groups.  TMA then writes whole rows and clips at M, N.
      unsigned char* sc = smem_c + cw * (64 * kCN * 2);
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      warpgroup_sync(1 + cw);
#pragma unroll
      for (int r = 0; r < kCN / 2; r += 2) {
        const int row = warp * 16 + lane / 4 + 8 * ((r / 2) % 2);
        const int col = 8 * (r / 4) + 2 * (lane % 4);
        const int block = col / 64, chunk = (col % 64) / 8;
        unsigned char* dst = sc + block * (64 * 128) + row * 128 + ((chunk ^ (row % 8)) * 16) +
                             (col % 8) * 2;
        *reinterpret_cast<uint32_t*>(dst) = pack2(acc[r], acc[r + 1], bf16);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      warpgroup_sync(1 + cw);
      if (tid == 0) {
#pragma unroll
        for (int j = 0; j < kCN / 64; ++j) {
          tma_store_3d(&map_c, sc + j * (64 * 128), tn * BN + col_off + j * 64, tm * kTM + row_off, bi);
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    } else {
      const int64_t row0 = static_cast<int64_t>(tm) * kTM + row_off + warp * 16 + lane / 4;
      const int64_t col0 = static_cast<int64_t>(tn) * kOutBN + col_off + 2 * (lane % 4);
      const int64_t base = static_cast<int64_t>(bi) * p.m * p.n;
      const bool pairs = (p.n % 2) == 0;  // aligned column pairs
#pragma unroll
      for (int r = 0; r < kOutCN / 2; r += 2) {
        const int64_t row = row0 + 8 * ((r / 2) % 2);
        const int64_t col = col0 + 8 * (r / 4);
        if (row >= p.m) continue;
        if constexpr (T::kIsTf32) {
          if (p.store_t) {
            // C^T's rows are C's columns: 8 lanes write 32 contiguous bytes.
            float* dst = static_cast<float*>(c) + base + col * p.m + row;
            if (col < p.n) dst[0] = out(r);
            if (col + 1 < p.n) dst[p.m] = out(r + 1);
            continue;
          }
          float* dst = static_cast<float*>(c) + base + row * p.n + col;
          if (pairs && col + 1 < p.n) {
            *reinterpret_cast<float2*>(dst) = make_float2(out(r), out(r + 1));
          } else {
            if (col < p.n) dst[0] = out(r);
            if (col + 1 < p.n) dst[1] = out(r + 1);
          }
        } else {
          uint16_t* dst = static_cast<uint16_t*>(c) + base + row * p.n + col;
          if (pairs && col + 1 < p.n) {
            *reinterpret_cast<uint32_t*>(dst) = pack2(acc[r], acc[r + 1], bf16);
          } else {
            if (col < p.n) dst[0] = pack1(acc[r], bf16);
            if (col + 1 < p.n) dst[1] = pack1(acc[r + 1], bf16);
          }
        }
      }
    }
  }
  if constexpr (kTmaStore) {
    // Shared memory must outlive the stores' reads of it.
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
#else
  __trap();  // built without sm_90a: the host never selects this path then
#endif
}

// A 3-D (inner, outer, batch) map of an operand of 2- or 4-byte elements.
inline bool encode(CUtensorMap* map, const void* ptr, int bytes, uint64_t inner, uint64_t outer,
                   uint64_t batch, uint64_t outer_stride, uint64_t batch_stride,
                   uint32_t box_inner, uint32_t box_outer) {
  const uint64_t dims[3] = {inner, outer, batch};
  const uint64_t strides[2] = {outer_stride * bytes, batch_stride * bytes};
  const uint32_t box[3] = {box_inner, box_outer, 1};
  return tma::encode_3d(map, ptr, bytes, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

struct Layout {
  bool ok;
  bool a_m_major;  // column-major A (M contiguous)
  bool b_n_major;  // row-major B (N contiguous)
  int64_t a_ld, b_ld, a_bs, b_bs;
};

// Strides TMA can take: unit stride along the contiguous dimension, the
// others multiples of 8 elements (16 bytes), 16-byte aligned base.  A
// dimension of size 1 takes any stride; an expanded batch (stride 0) cannot
// be described, so it falls back.
inline Layout layout_of(const GemmArgs& g) {
  Layout l{false, false, false, 0, 0, 0, 0};
  const int64_t per16 = 16 / dtype_bytes(g.dtype);  // elements in 16 bytes
  auto aligned = [&](int64_t v) { return v > 0 && v % per16 == 0; };
  auto pad8 = [&](int64_t v) { return (v + per16 - 1) / per16 * per16; };
  if (reinterpret_cast<uintptr_t>(g.a.ptr) % 16 || reinterpret_cast<uintptr_t>(g.b.ptr) % 16) return l;
  // One operand (rows x cols, strides rs, cs): contiguous along cols
  // ("row-major", returns 0) or along rows (1), with its leading stride.
  auto classify = [&](const Operand& o, int64_t rows, int64_t cols, int64_t& ld) {
    if ((o.col_stride == 1 || cols == 1) && (rows == 1 || aligned(o.row_stride))) {
      ld = rows == 1 ? pad8(cols) : o.row_stride;
      return ld >= cols ? 0 : -1;
    }
    if ((o.row_stride == 1 || rows == 1) && (cols == 1 || aligned(o.col_stride))) {
      ld = cols == 1 ? pad8(rows) : o.col_stride;
      return ld >= rows ? 1 : -1;
    }
    return -1;
  };
  const int ka = classify(g.a, g.m, g.k, l.a_ld);
  const int kb = classify(g.b, g.k, g.n, l.b_ld);
  if (ka < 0 || kb < 0) return l;
  l.a_m_major = ka == 1;
  l.b_n_major = kb == 0;
  // TF32 wgmma reads shared memory K-major only; an M-major A goes through
  // registers, an N-major B through the swapped problem (sm90_run).
  if (g.dtype == DType::f32 && l.b_n_major) return l;
  if (g.batch > 1) {
    if (!aligned(g.a.batch_stride) || !aligned(g.b.batch_stride)) return l;
    l.a_bs = g.a.batch_stride;
    l.b_bs = g.b.batch_stride;
  } else {
    l.a_bs = l.a_ld * (l.a_m_major ? g.k : g.m);
    l.b_bs = l.b_ld * (l.b_n_major ? g.k : g.n);
  }
  l.ok = true;
  return l;
}

// The kernel's problem: C (batch, m, n) in tiles of tile_m x tile_n outputs,
// k in blocks of kbk.
inline Problem problem_of(int64_t batch, int64_t m, int64_t n, int64_t k, int tile_n, int kbk,
                          bool store_t, int splits, int split_kb, void* ws, bool b_one,
                          int tile_m = kBM) {
  Problem p;
  p.batch = batch;
  p.m = m;
  p.n = n;
  p.k = k;
  p.tiles_m = static_cast<int>((m + tile_m - 1) / tile_m);
  p.tiles_n = static_cast<int>((n + tile_n - 1) / tile_n);
  p.tiles = batch * p.tiles_m * p.tiles_n;
  p.k_blocks = static_cast<int>((k + kbk - 1) / kbk);
  p.store_t = store_t ? 1 : 0;
  p.splits = splits;
  p.split_kb = splits > 1 ? split_kb : p.k_blocks;
  p.ws = static_cast<float*>(ws);
  p.b_one = b_one ? 1 : 0;
  return p;
}

template <typename T, int BN, int kTransA, int kTransB, bool kTmaStore, int kTM = kBM>
cudaError_t launch(const GemmArgs& g, const Layout& l, bool store_t, int splits, int split_kb,
                   void* ws, cudaStream_t stream) {
  using Cfg = Config<BN, kTmaStore, kTM>;
  constexpr int kBK = kRowBytes / T::kBytes;
  constexpr int E = T::kBytes;
  CUtensorMap ma, mb, mc;
  constexpr uint32_t kMRows = kRowBytes / E;  // MN-major boxes: 128 bytes wide
  const bool oka = kTransA
      ? encode(&ma, g.a.ptr, E, g.m, g.k, g.batch, l.a_ld, l.a_bs, kMRows, kBK)
      : encode(&ma, g.a.ptr, E, g.k, g.m, g.batch, l.a_ld, l.a_bs, kBK, kTM);
  const bool okb = kTransB
      ? encode(&mb, g.b.ptr, E, g.n, g.k, g.batch, l.b_ld, l.b_bs, kMRows, kBK)
      : encode(&mb, g.b.ptr, E, g.k, g.n, g.batch, l.b_ld, l.b_bs, kBK, BN);
  // C is contiguous (batch, m, n); the TMA store needs n % 8 == 0.
  const bool okc = !kTmaStore || encode(&mc, g.c, E, g.n, g.m, g.batch, g.n, g.m * g.n, 64, 64);
  if (!oka || !okb || !okc) return cudaErrorInvalidValue;
  if (!kTmaStore) mc = ma;  // unused
  const Problem p = problem_of(g.batch, g.m, g.n, g.k, BN, kBK, store_t, splits, split_kb, ws,
                               /*b_one=*/false, kTM);
  auto kernel = gemm_kernel<T, BN, kTransA, kTransB, kTmaStore, false, kTM>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int grid = static_cast<int>(std::min<int64_t>(p.tiles * splits, device_sms()));
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(
      ma, mb, mc, g.c, p);
  if (splits == 1) return cudaGetLastError();
  return launch_sum_splits<typename T::Elem>(p.ws, g.c, splits, g.batch * g.m * g.n, stream);
}

}  // namespace sm90_detail
}  // namespace torchops::cuda::gemm

// Which tile, epilogue and k split a problem gets, apart from the kernels.
#include "sm90_heuristics.cuh"

namespace torchops::cuda::gemm {
namespace sm90_detail {

template <typename T, int BN, int kTransA, int kTM>
cudaError_t launch_b(const GemmArgs& g, const Layout& l, const Choice& c, void* ws, cudaStream_t s) {
  const int n = c.splits, kb = c.split_kb;
  if constexpr (BN == 32) {  // a K-major B and the direct epilogue only (pick_tile)
    if (l.b_n_major || c.tma_store) return cudaErrorInvalidValue;
    return launch<T, BN, kTransA, 0, false, kTM>(g, l, false, n, kb, ws, s);
  } else {
    if (l.b_n_major) {
      return c.tma_store ? launch<T, BN, kTransA, 1, true, kTM>(g, l, false, n, kb, ws, s)
                         : launch<T, BN, kTransA, 1, false, kTM>(g, l, false, n, kb, ws, s);
    }
    return c.tma_store ? launch<T, BN, kTransA, 0, true, kTM>(g, l, false, n, kb, ws, s)
                       : launch<T, BN, kTransA, 0, false, kTM>(g, l, false, n, kb, ws, s);
  }
}

template <typename T, int BN, int kTM = kBM>
cudaError_t launch_ab(const GemmArgs& g, const Layout& l, const Choice& c, void* ws, cudaStream_t s) {
  return l.a_m_major ? launch_b<T, BN, 1, kTM>(g, l, c, ws, s) : launch_b<T, BN, 0, kTM>(g, l, c, ws, s);
}

// The tf32 problem as run: C^T = B^T A^T where B is N-major (store_t).
inline GemmArgs swapped(const GemmArgs& g) {
  GemmArgs t = g;
  t.a = {g.b.ptr, g.b.batch_stride, g.b.col_stride, g.b.row_stride};
  t.b = {g.a.ptr, g.a.batch_stride, g.a.col_stride, g.a.row_stride};
  t.m = g.n;
  t.n = g.m;
  return t;
}

inline cudaError_t launch_tf32(const GemmArgs& g, const Layout& l, bool store_t, void* ws,
                               cudaStream_t s, const Pins& pins) {
  // fp32 output stored directly; an M-major A through registers.
  using T = Tf32Tag;
  const Choice c = choose(g, l, pins);
  const int n = c.splits, kb = c.split_kb;
  if (l.a_m_major) {
    return c.bn == 256 ? launch<T, 256, 1, 0, false>(g, l, store_t, n, kb, ws, s)
                       : launch<T, 128, 1, 0, false>(g, l, store_t, n, kb, ws, s);
  }
  return c.bn == 256 ? launch<T, 256, 0, 0, false>(g, l, store_t, n, kb, ws, s)
                     : launch<T, 128, 0, 0, false>(g, l, store_t, n, kb, ws, s);
}

template <typename T>
cudaError_t launch_t(const GemmArgs& g, const Layout& l, void* ws, cudaStream_t s,
                     const Pins& pins) {
  const Choice c = choose(g, l, pins);
  if (c.tm == 64) {
    if (c.bn == 32) return launch_ab<T, 32, 64>(g, l, c, ws, s);
    return c.bn == 64 ? launch_ab<T, 64, 64>(g, l, c, ws, s) : launch_ab<T, 128, 64>(g, l, c, ws, s);
  }
  if (c.bn == 256) return launch_ab<T, 256>(g, l, c, ws, s);
  if (c.bn == 192) return launch_ab<T, 192>(g, l, c, ws, s);
  return launch_ab<T, 128>(g, l, c, ws, s);
}

// The problem as the kernel runs it: g itself, or for tf32 with an N-major
// B, the swapped one (store_t).  ok false: sm90 cannot take it.
struct Resolved {
  GemmArgs g;
  Layout l;
  bool store_t;
  bool ok;
};

inline Resolved resolve(const GemmArgs& g) {
  Resolved r{g, layout_of(g), false, false};
  if (!r.l.ok && g.dtype == DType::f32) {
    r.g = swapped(g);
    r.l = layout_of(r.g);
    r.store_t = true;
  }
  r.ok = r.l.ok;
  return r;
}

}  // namespace sm90_detail

// An sm_90 GPU (wgmma), and a driver that encodes tensor maps.
inline bool sm90_supports_device() { return tma::sm90_device(); }

inline bool sm90_supports(const GemmArgs& g) {
  const bool tf32 = g.dtype == DType::f32 && g.allow_tf32;
  if (g.dtype != DType::bf16 && g.dtype != DType::f16 && !tf32) return false;
  if (g.m < 1 || g.n < 1 || g.k < 1 || g.batch < 1) return false;
  // TMA coordinates are 32-bit.
  if (g.m >= (int64_t(1) << 31) || g.n >= (int64_t(1) << 31) || g.k >= (int64_t(1) << 31) ||
      g.batch >= (int64_t(1) << 31)) return false;
  if (!sm90_supports_device()) return false;
  return sm90_detail::resolve(g).ok;
}

namespace sm90_detail {

// Split-K's fp32 partials (none without a split).
inline size_t workspace_bytes(const GemmArgs& g, const Pins& pins) {
  const Resolved r = resolve(g);
  if (!r.ok) return 0;
  const Choice c = choose(r.g, r.l, pins);
  if (c.splits < 2) return 0;
  return size_t(c.splits) * size_t(g.batch) * size_t(g.m) * size_t(g.n) * sizeof(float);
}

inline cudaError_t run(const GemmArgs& g, void* ws, cudaStream_t stream, const Pins& pins) {
  const Resolved r = resolve(g);
  if (!r.ok) return cudaErrorInvalidValue;
  if (choose(r.g, r.l, pins).splits > 1 && ws == nullptr) return cudaErrorInvalidValue;
  switch (g.dtype) {
    case DType::f32:
      return launch_tf32(r.g, r.l, r.store_t, ws, stream, pins);
    case DType::bf16:
      return launch_t<Bf16Tag>(r.g, r.l, ws, stream, pins);
    default:
      return launch_t<F16Tag>(r.g, r.l, ws, stream, pins);
  }
}

}  // namespace sm90_detail

inline size_t sm90_workspace_bytes(const GemmArgs& g) {
  return sm90_detail::workspace_bytes(g, sm90_detail::Pins{});
}

inline cudaError_t sm90_run(const GemmArgs& g, void* ws, cudaStream_t stream) {
  return sm90_detail::run(g, ws, stream, sm90_detail::Pins{});
}

// The 3xTF32 mode (see the top of this file).  C = A @ B for float32 with
// B row-major (N contiguous, TMA-aligned: the large operand, split in the
// kernel's registers) and A of any strides (its parts are written to the
// workspace first); A may be broadcast over the batch (batch stride 0).
namespace sm90_detail {

// A's parts in the workspace: per batch of A, rows() rows of ld floats.
struct Split3Parts {
  int64_t batches, m, ld;
  __host__ __device__ int64_t rows() const { return 2 * ((m + 63) / 64) * 64; }
  size_t bytes() const { return size_t(batches) * size_t(rows()) * size_t(ld) * sizeof(float); }
};

inline Split3Parts split3_parts(const GemmArgs& g) {
  // k padded to 4 floats: TMA wants 16-byte row strides.
  return {g.a.batch_stride == 0 ? 1 : g.batch, g.m, (g.k + 3) / 4 * 4};
}

// Row r of block r / 128 of the parts: A's row 64 * (r / 128) + r % 64,
// high part if r % 128 < 64, else low part; zero past m and k.  A block
// per row (grid-stride over rows), threads along it: no divisions per element.
__global__ void __launch_bounds__(256) split3_parts_kernel(Operand a, int64_t k, Split3Parts sp,
                                                           float* __restrict__ parts) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int64_t rows = sp.rows();
  const float* src = static_cast<const float*>(a.ptr);
  for (int64_t br = blockIdx.x; br < sp.batches * rows; br += gridDim.x) {
    const int64_t b = br / rows, r = br - b * rows;
    const int64_t row = (r / 128) * 64 + r % 64;
    const bool low = r % 128 >= 64;
    const bool real = row < sp.m;
    const float* in = real ? src + b * a.batch_stride + row * a.row_stride : src;
    float* out = parts + br * sp.ld;
    for (int64_t col = threadIdx.x; col < sp.ld; col += blockDim.x) {
      const float x = real && col < k ? in[col * a.col_stride] : 0.f;
      float hi, lo;
      split_tf32(x, hi, lo);
      out[col] = low ? lo : hi;
    }
  }
#else
  __trap();
#endif
}

// B (k, n) row-major, as the kernel's M-major A: its leading and batch
// strides, or false where TMA cannot take them.
inline bool split3_b_strides(const GemmArgs& g, int64_t& ld, int64_t& bs) {
  const Operand& b = g.b;
  if (reinterpret_cast<uintptr_t>(b.ptr) % 16 != 0) return false;
  if (b.col_stride != 1 && g.n != 1) return false;
  ld = g.k == 1 ? (g.n + 3) / 4 * 4 : b.row_stride;
  if (ld % 4 != 0 || ld < g.n) return false;
  bs = g.batch == 1 ? ld * g.k : b.batch_stride;
  return bs > 0 && bs % 4 == 0;
}

// The kernel's problem: C^T (n x m) = B^T @ A^T, 64 output columns a tile.
inline Choice split3_choice(const GemmArgs& g, const Pins& pins) {
  GemmArgs t = g;
  t.m = g.n;
  t.n = 2 * g.m;  // pick_splits counts 128-wide tiles: two per 64 outputs
  Choice c{128, false};
  pick_splits(t, c, pins);
  return c;
}

inline size_t split3_partials_bytes(const GemmArgs& g, const Pins& pins) {
  const Choice c = split3_choice(g, pins);
  if (c.splits < 2) return 0;
  const size_t b = size_t(c.splits) * size_t(g.batch) * size_t(g.m) * size_t(g.n) * sizeof(float);
  return (b + 255) / 256 * 256;
}

}  // namespace sm90_detail

inline bool sm90_3xtf32_supports(const GemmArgs& g) {
  int64_t ld = 0, bs = 0;
  // The device and size checks of the TF32 path; its layouts do not apply.
  return g.dtype == DType::f32 && g.m >= 1 && g.n >= 1 && g.k >= 1 && g.batch >= 1 &&
         g.m < (int64_t(1) << 30) && g.n < (int64_t(1) << 31) && g.k < (int64_t(1) << 31) &&
         g.batch < (int64_t(1) << 31) && sm90_detail::split3_b_strides(g, ld, bs) &&
         sm90_supports_device();
}

namespace sm90_detail {

inline size_t split3_workspace_bytes(const GemmArgs& g, const Pins& pins) {
  return split3_partials_bytes(g, pins) + split3_parts(g).bytes();
}

inline cudaError_t split3_run(const GemmArgs& g, void* ws, cudaStream_t stream, const Pins& pins) {
  int64_t ldb = 0, bsb = 0;
  if (!split3_b_strides(g, ldb, bsb) || ws == nullptr) return cudaErrorInvalidValue;
  const Choice c = split3_choice(g, pins);
  const Split3Parts sp = split3_parts(g);
  unsigned char* w = static_cast<unsigned char*>(ws);
  float* parts = reinterpret_cast<float*>(w + split3_partials_bytes(g, pins));
  const int64_t part_rows = sp.batches * sp.rows();
  split3_parts_kernel<<<static_cast<unsigned>(std::min<int64_t>(part_rows, 65535)), 256, 0,
                        stream>>>(g.a, g.k, sp, parts);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  constexpr int BN = 128, kBK = kRowBytes / 4;
  using Cfg = Config<BN, false>;
  CUtensorMap ma, mb;
  // B^T: M-major A of the kernel (m = n of C); A's parts: its K-major B.
  if (!encode(&ma, g.b.ptr, 4, g.n, g.k, g.batch, ldb, bsb, kRowBytes / 4, kBK) ||
      !encode(&mb, parts, 4, g.k, sp.rows(), sp.batches, sp.ld, sp.rows() * sp.ld, kBK, BN)) {
    return cudaErrorInvalidValue;
  }
  // 64 output columns a tile (a 128-wide B tile holds both parts of each).
  const Problem p = problem_of(g.batch, g.n, g.m, g.k, BN / 2, kBK, /*store_t=*/true, c.splits,
                               c.split_kb, c.splits > 1 ? w : nullptr, sp.batches == 1);
  auto kernel = gemm_kernel<Tf32Tag, BN, 1, 0, false, true>;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int grid = static_cast<int>(std::min<int64_t>(p.tiles * c.splits, device_sms()));
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(ma, mb, ma, g.c, p);
  if (c.splits == 1) return cudaGetLastError();
  return launch_sum_splits<float>(p.ws, g.c, c.splits, g.batch * g.m * g.n, stream);
}

}  // namespace sm90_detail

inline size_t sm90_3xtf32_workspace_bytes(const GemmArgs& g) {
  return sm90_detail::split3_workspace_bytes(g, sm90_detail::Pins{});
}

inline cudaError_t sm90_3xtf32_run(const GemmArgs& g, void* ws, cudaStream_t stream) {
  return sm90_detail::split3_run(g, ws, stream, sm90_detail::Pins{});
}

}  // namespace torchops::cuda::gemm
