// Ampere/Ada tensor-core path of torchops.matmul (runs on sm_80 and later,
// Hopper included, without wgmma): bf16/f16 inputs with fp32 accumulation
// through mma.sync m16n8k16, and f32 through TF32 mma.sync m16n8k8 when the
// caller allows it.  Torch-free: builds into the stand-alone harness too.
//
//   global --cp.async (16-byte chunks, zero-filled past the edges)-->
//   shared (STAGES-deep ring, XOR-swizzled) --ldmatrix(.trans)--> registers
//   --mma.sync--> fp32 accumulators --> shared (the ring, reused) -->
//   16-byte coalesced, bounds-checked stores of C rows.
//
// Each operand tile is staged in shared memory along the operand's contiguous
// dimension ("K-major": rows of k; "MN-major": rows of m or n); ldmatrix
// without .trans serves a K-major tile and with .trans an MN-major one, so
// every combination of row-/column-major A and B reads global memory in
// 16-byte chunks.  fp32 MN-major tiles are the exception: .trans moves 16-bit
// halves, so their fragments come from 32-bit shared loads.
//
// A tuning harness (scripts/matmul_dev) launches candidate tile configs of
// its own through plan_call and dispatch_layout.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gemm_args.cuh"

namespace torchops::cuda::gemm {
namespace sm80_detail {

// BK counts k in 16-bit elements: a stage holds BK*2 bytes of k per row for
// every element type, so TF32 (4-byte) tiles take BK/2 floats of k and the
// same shared memory and mma-instruction count per stage.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_,
          int MIN_BLOCKS_>
struct TileCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
  static constexpr int STAGES = STAGES_, MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // warp tile
  static constexpr int MI = WM / 16, NI = WN / 8;  // mma tiles per warp
  static constexpr int KK = BK / 16;  // mma k-steps (32 bytes of k) per stage
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile: 16-multiples");
  static_assert(STAGES >= 3, "the ring's reuse distance assumes >= 3 stages");
  static_assert(KK % 2 == 0, "fragment double buffer assumes an even KK");
};

template <class Cfg>
struct Smem {
  static constexpr int A_BYTES = Cfg::BM * Cfg::BK * 2;
  static constexpr int B_BYTES = Cfg::BN * Cfg::BK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr size_t TOTAL = size_t(Cfg::STAGES) * STAGE_BYTES;
};

// A stored tile: ROWS rows of CPR 16-byte chunks.  K-major: rows are m (or n),
// chunks run along k; MN-major: rows are k, chunks along m (or n).
template <int MN, int BKE, int ES, bool KMAJOR>
struct TileShape {
  static constexpr int ROWS = KMAJOR ? MN : BKE;
  static constexpr int CPR = (KMAJOR ? BKE : MN) * ES / 16;
  // fp32 MN-major tiles are read with 32-bit loads, not ldmatrix (see swz_xor)
  static constexpr bool PAIR = !KMAJOR && ES == 4;
};

// XOR swizzle of the chunk column.  ldmatrix: the 8 rows one phase reads (same
// chunk column, 8 consecutive rows from a multiple of 8) land in 8 distinct
// 16-byte bank groups of a 128-byte line.  PAIR (32-bit fragment loads of an
// fp32 MN-major tile): a load reads rows 4q..4q+3, two adjacent chunks
// (an even pair) each; xor 2*(r&3) spreads the 4 pairs over all 8 groups.
// Both only touch the low bits of the column: a permutation within each row.
template <int CPR, bool PAIR = false>
__device__ __forceinline__ int swz_xor(int r) {
  if constexpr (PAIR) {
    static_assert(CPR >= 8, "pair swizzle needs 8 chunks a row");
    return (r & 3) << 1;
  } else if constexpr (CPR >= 8) {
    return r & 7;
  } else if constexpr (CPR == 4) {
    return (r >> 1) & 3;
  } else if constexpr (CPR == 2) {
    return (r >> 2) & 1;
  } else {
    return 0;
  }
}

template <int CPR, bool PAIR = false>
__device__ __forceinline__ int swz(int r, int c) {
  return r * CPR + (c ^ swz_xor<CPR, PAIR>(r));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TORCHOPS_SM80_DEVICE 1
#endif

// src_bytes < 16 zero-fills the rest of the chunk; 0 reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src,
                                           int src_bytes) {
#ifdef TORCHOPS_SM80_DEVICE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
#endif
}

// Writes 16 bytes of shared memory: the first `bytes` (a multiple of 2)
// from global memory, zeros after.  Ordered for readers like the ring's
// cp.async data: by the barrier that follows the stage's wait.
__device__ __forceinline__ void store_partial_chunk(uint32_t dst, const void* src, int bytes) {
#ifdef TORCHOPS_SM80_DEVICE
  uint32_t w[4] = {0, 0, 0, 0};
  const uint16_t* h = static_cast<const uint16_t*>(src);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (2 * e < bytes) w[e / 2] |= static_cast<uint32_t>(h[e]) << (16 * (e % 2));
  }
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3])
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef TORCHOPS_SM80_DEVICE
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef TORCHOPS_SM80_DEVICE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
#ifdef TORCHOPS_SM80_DEVICE
  if constexpr (TRANS) {
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr)
        : "memory");
  } else {
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr)
        : "memory");
  }
#endif
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v = 0;
#ifdef TORCHOPS_SM80_DEVICE
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
#endif
  return v;
}

// fp32 bits -> tf32, rounded to nearest (ties away), as cvt.rna.tf32.f32
// does; cvt.rna is emulated in ~4 instructions on sm_90, this is 2: add half
// an ulp of tf32 and leave the 13 low bits, which mma.sync ignores (truncates).
// Inf/NaN are kept as they are: the carry could turn a NaN into +-0.
__device__ __forceinline__ uint32_t to_tf32(uint32_t x) {
  return fabsf(__uint_as_float(x)) < __int_as_float(0x7f800000) ? x + 0x1000u
                                                                 : x;
}

// Element kinds of the kernel: inputs, output, bytes per input element.
enum Kind { kF16 = 0, kBF16 = 1, kTF32 = 2 };
template <int KIND>
struct KindTraits;
template <>
struct KindTraits<kF16> {
  using Out = __half;
  static constexpr int ES = 2;
};
template <>
struct KindTraits<kBF16> {
  using Out = __nv_bfloat16;
  static constexpr int ES = 2;
};
template <>
struct KindTraits<kTF32> {
  using Out = float;
  static constexpr int ES = 4;
};

// d += a * b over one 32-byte k-step: m16n8k16 (f16/bf16) or m16n8k8 (tf32),
// fp32 accumulators.  The fragment register layouts coincide in 32-bit words.
template <int KIND>
__device__ __forceinline__ void mma_step(float (&d)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
#ifdef TORCHOPS_SM80_DEVICE
  if constexpr (KIND == kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (KIND == kF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

struct KParams {
  const char* a;
  const char* b;
  void* c;
  // Element strides.  "outer" is the operand's non-contiguous matrix stride
  // (the one between the stored tile's rows in global memory).
  int64_t a_bs, a_os, b_bs, b_os;
  int64_t batch;
  int m, n, k;
  int tiles_m, tiles_n;
  int c_vec16;  // C rows take 16-byte stores (16-byte base, n*size % 16 == 0)
};

// Issues one stage's cp.async copies of one operand tile.  g points at the
// tile's first element (always inside the operand: the tile starts in range);
// rows at or past outer_rem and chunks at or past inner_rem are zero-filled,
// a chunk straddling inner_rem copies only its in-range elements.
// Which 16-byte chunks of a stored ROWS x CPR tile this thread copies: chunk
// column c of rows r0, r0 + RPI, ...  One mapping for the checked copy
// (load_tile) and the whole-tile one (copy_whole).
template <int ROWS, int CPR, int THREADS, bool PAIR>
struct TileChunks {
  static constexpr int RPI = THREADS / CPR;  // rows covered per pass of the block
  static_assert(THREADS % CPR == 0 && (ROWS * CPR) % THREADS == 0,
                "tile chunks must split evenly");
  // RPI is a multiple of the swizzle's period (8 rows, PAIR 4), so every
  // pass of this thread shares one swizzled column and one row step.
  static_assert(RPI % (PAIR ? 4 : 8) == 0, "swizzle period");
  int r0, c;
  uint32_t dst;  // byte offset of this thread's first chunk in the tile
  __device__ __forceinline__ explicit TileChunks(int tid)
      : r0(tid / CPR), c(tid % CPR), dst(swz<CPR, PAIR>(tid / CPR, tid % CPR) * 16) {}

  // The copy of a tile wholly in range (every tile of a big problem but the
  // edges): straight-line cp.async, src at this thread's first chunk.
  // load_tile's test and branch per chunk cost issued instructions in warps
  // the mma pipe waits on, and so would recomputing each stage's source from
  // the operand's base.  (No faster: 8 threads a row with several chunks each
  // at immediate offsets, fewer address registers; spreading a stage's
  // copies over the k-steps, which pushes the kernel into spilling.)
  __device__ __forceinline__ void copy_whole(uint32_t s_tile, const char* src,
                                             int64_t row_step) const {
#pragma unroll
    for (int i = 0; i < ROWS / RPI; ++i) {
      cp_async16(s_tile + dst + i * RPI * CPR * 16, src, 16);
      src += row_step;
    }
  }
};

template <int ROWS, int CPR, int THREADS, int ES, bool PAIR>
__device__ __forceinline__ void load_tile(uint32_t s_tile, const char* g,
                                          int64_t outer_stride, int outer_rem,
                                          int inner_rem, int tid) {
  constexpr int EPC = 16 / ES;
  using TC = TileChunks<ROWS, CPR, THREADS, PAIR>;
  constexpr int RPI = TC::RPI;
  const TC tc(tid);
  const int r0 = tc.r0;
  const int inner = tc.c * EPC;
  const int n_in = inner_rem - inner;
  const int bytes = n_in <= 0 ? 0 : (n_in >= EPC ? EPC : n_in) * ES;
  // One running pointer, not one per row: per-row 64-bit addresses hoisted
  // out of the k loop cost registers the accumulators need.
  const char* src = g + (int64_t(r0) * outer_stride + inner) * ES;
  const int64_t step = int64_t(RPI) * outer_stride * ES;
  const uint32_t dst0 = s_tile + tc.dst;
  const int rows_ok = bytes > 0 ? outer_rem - r0 : 0;  // rows r0 + i*RPI < ..
#pragma unroll
  for (int i = 0; i < ROWS / RPI; ++i) {
    const bool ok = i * RPI < rows_ok;
    const uint32_t dst = dst0 + i * RPI * CPR * 16;
    if (ok && bytes == 16) {
      cp_async16(dst, src, 16);
    } else {
      // A partial or empty chunk: plain loads of the in-range bytes, zeros
      // for the rest.  Never cp.async's zero-fill form: it names a 16-byte
      // source, which may lie past the end of a small allocation (a 1 x 1
      // operand holds 2 bytes), and compute-sanitizer counts it as read.
      store_partial_chunk(dst, src, ok ? bytes : 0);
    }
    src += step;
  }
}


// Passes of the shared-memory epilogue: the C tile (padded rows) goes through
// the ring in 1, 2, 4.. slices of each warp's rows, as many as it needs to fit.
template <class Cfg, int OS>
struct Epi {
  static constexpr int ROW_BYTES = Cfg::BN * OS + 8 * OS;  // padded: see below
  static constexpr int passes() {
    int p = 1;
    while (p < Cfg::MI &&
           size_t(Cfg::BM / p) * ROW_BYTES > Smem<Cfg>::TOTAL) {
      p *= 2;
    }
    return p;
  }
  static constexpr int P = passes();
  static_assert(Cfg::MI % P == 0 &&
                    size_t(Cfg::BM / P) * ROW_BYTES <= Smem<Cfg>::TOTAL,
                "C tile slice must fit the ring");
  static constexpr int MIP = Cfg::MI / P;     // mma row tiles per pass
  static constexpr int RPW = MIP * 16;        // rows per warp row per pass
  static constexpr int ROWS = Cfg::WARPS_M * RPW;
  static constexpr int EPC = 16 / OS;         // elements per 16-byte chunk
  static constexpr int CPR = Cfg::BN / EPC;   // chunks per C row
};

template <class Cfg, bool A_KMAJOR, bool B_KMAJOR, int KIND>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_BLOCKS)
    sm80_gemm(const KParams p) {
#ifdef TORCHOPS_SM80_DEVICE
  using KT_ = KindTraits<KIND>;
  using OutT = typename KT_::Out;
  constexpr int ES = KT_::ES;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BKE = Cfg::BK * 2 / ES;
  constexpr int STAGES = Cfg::STAGES, THREADS = Cfg::THREADS;
  constexpr int MI = Cfg::MI, NI = Cfg::NI, WM = Cfg::WM, WN = Cfg::WN;
  constexpr int KK = Cfg::KK;
  constexpr bool TF32 = KIND == kTF32;
  using SM = Smem<Cfg>;
  using TA = TileShape<BM, BKE, ES, A_KMAJOR>;
  using TB = TileShape<BN, BKE, ES, B_KMAJOR>;
  // ldmatrix serves every tile but an fp32 MN-major one (.trans moves 16-bit
  // halves, not 32-bit elements).
  constexpr bool A_LDSM = !TA::PAIR, B_LDSM = !TB::PAIR;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_base = smem_u32(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / Cfg::WARPS_N) * WM;
  const int wn0 = (warp % Cfg::WARPS_N) * WN;

  // Grouped raster (gemm_args.cuh): 8 tile rows share their B tiles while
  // they run together.
  int64_t tm, tn;
  grouped_tile(blockIdx.x, p.tiles_m, p.tiles_n, 8, tm, tn);
  const int m0 = static_cast<int>(tm) * BM;
  const int n0 = static_cast<int>(tn) * BN;

  // ldmatrix lane roles.  Matrix j = lane/8 of an x4, row lane%8 of it.
  // A x4 = m16 x k(2 chunks): j -> (m half j&1, k chunk j>>1);
  // B x4 = n16 x k(2 chunks): j -> (n half j>>1, k chunk j&1).
  // For tf32 a non-.trans b16 ldmatrix of a K-major tile hands lane l the
  // 32-bit word (row l/4, word l%4) of each 8x(4 floats) matrix: exactly the
  // m16n8k8 fragment element (row g, k t), so the addressing is the same.
  // lr: stored row within a 16-row group; lx: chunk offset xor swizzle (the
  // 16-row groups start at multiples of 8 and the chunk bases are even, so
  // (base + lc) ^ swz(base_row + lr) == base ^ (lc ^ swz(lr))).
  const int j = lane >> 3, r8 = lane & 7;
  const int a_lr = r8 + (A_KMAJOR ? (j & 1) : (j >> 1)) * 8;
  const int a_lc = A_KMAJOR ? (j >> 1) : (j & 1);
  const int a_lx = a_lc ^ swz_xor<TA::CPR, TA::PAIR>(a_lr);
  const int b_lr = r8 + (B_KMAJOR ? (j >> 1) : (j & 1)) * 8;
  const int b_lc = B_KMAJOR ? (j & 1) : (j >> 1);
  const int b_lx = b_lc ^ swz_xor<TB::CPR, TB::PAIR>(b_lr);
  // mma fragment roles (32-bit loads of fp32 MN-major tiles).
  const int fg = lane >> 2, ft = lane & 3;

  const int KT = (p.k + BKE - 1) / BKE;

#pragma unroll 1
  for (int64_t bz = blockIdx.y; bz < p.batch; bz += gridDim.y) {
    const char* a_b = p.a + bz * p.a_bs * ES;
    const char* b_b = p.b + bz * p.b_bs * ES;

    // Whole tiles (interior CTAs, k-tiles before the last partial one): each
    // thread's source advances by a fixed step per k-tile.
    const bool interior = m0 + BM <= p.m && n0 + BN <= p.n;
    const int kt_whole = p.k / BKE;
    const TileChunks<TA::ROWS, TA::CPR, THREADS, TA::PAIR> wa(tid);
    const TileChunks<TB::ROWS, TB::CPR, THREADS, TB::PAIR> wb(tid);
    constexpr int EPC = 16 / ES;
    // A K-major: rows m0.., chunks along k; MN-major: rows k, chunks m0..
    const char* a_thr = a_b + ((A_KMAJOR ? int64_t(m0 + wa.r0) * p.a_os
                                         : int64_t(wa.r0) * p.a_os + m0) + wa.c * EPC) * ES;
    const char* b_thr = b_b + ((B_KMAJOR ? int64_t(n0 + wb.r0) * p.b_os
                                         : int64_t(wb.r0) * p.b_os + n0) + wb.c * EPC) * ES;
    const int64_t a_kstep = A_KMAJOR ? int64_t(BKE) * ES : int64_t(BKE) * p.a_os * ES;
    const int64_t b_kstep = B_KMAJOR ? int64_t(BKE) * ES : int64_t(BKE) * p.b_os * ES;

    auto load_stage = [&](int stage, int kt) {
      const uint32_t s_a = s_base + stage * SM::STAGE_BYTES;
      if (interior && kt < kt_whole) {
        wa.copy_whole(s_a, a_thr + kt * a_kstep, int64_t(wa.RPI) * p.a_os * ES);
        wb.copy_whole(s_a + SM::A_BYTES, b_thr + kt * b_kstep, int64_t(wb.RPI) * p.b_os * ES);
        return;
      }
      const int k0 = kt * BKE;
      const uint32_t s_b = s_a + SM::A_BYTES;
      if constexpr (A_KMAJOR) {
        load_tile<TA::ROWS, TA::CPR, THREADS, ES, TA::PAIR>(
            s_a, a_b + (int64_t(m0) * p.a_os + k0) * ES, p.a_os, p.m - m0,
            p.k - k0, tid);
      } else {
        load_tile<TA::ROWS, TA::CPR, THREADS, ES, TA::PAIR>(
            s_a, a_b + (int64_t(k0) * p.a_os + m0) * ES, p.a_os, p.k - k0,
            p.m - m0, tid);
      }
      if constexpr (B_KMAJOR) {
        load_tile<TB::ROWS, TB::CPR, THREADS, ES, TB::PAIR>(
            s_b, b_b + (int64_t(n0) * p.b_os + k0) * ES, p.b_os, p.n - n0,
            p.k - k0, tid);
      } else {
        load_tile<TB::ROWS, TB::CPR, THREADS, ES, TB::PAIR>(
            s_b, b_b + (int64_t(k0) * p.b_os + n0) * ES, p.b_os, p.k - k0,
            p.n - n0, tid);
      }
    };

    // Byte offset in an fp32 MN-major tile of element e of stored row r,
    // r&3 == ft (rows 8kk + 4h + ft): the pair swizzle's xor is 2*ft.
    auto pair_off = [&](int CPR, int r, int e) {
      return (r * CPR + ((e >> 2) ^ (ft << 1))) * 16 + (e & 3) * 4;
    };

    uint32_t af[2][MI][4];
    uint32_t bfr[2][NI][2];
    auto load_frags = [&](int buf, int stage, int kk) {
      const uint32_t s_a = s_base + stage * SM::STAGE_BYTES;
      const uint32_t s_b = s_a + SM::A_BYTES;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int mb = wm0 + mi * 16;
        if constexpr (A_LDSM) {
          // (row base, even chunk base) of this 16x(32 bytes) block
          const int row = A_KMAJOR ? mb : kk * 16;
          const int ch = A_KMAJOR ? kk * 2 : mb / 8;
          ldsm_x4<!A_KMAJOR>(
              af[buf][mi],
              s_a + ((row + a_lr) * TA::CPR + (ch ^ a_lx)) * 16);
        } else {
          // a0 (m g, k t), a1 (m g+8, k t), a2 (m g, k t+4), a3 (g+8, t+4)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            af[buf][mi][q] = lds32(
                s_a + pair_off(TA::CPR, kk * 8 + (q >> 1) * 4 + ft,
                               mb + (q & 1) * 8 + fg));
          }
        }
        if constexpr (TF32) {
#pragma unroll
          for (int q = 0; q < 4; ++q) af[buf][mi][q] = to_tf32(af[buf][mi][q]);
        }
      }
      if constexpr (B_LDSM) {
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {
          const int nb = wn0 + nj * 16;
          const int row = B_KMAJOR ? nb : kk * 16;
          const int ch = B_KMAJOR ? kk * 2 : nb / 8;
          uint32_t r[4];
          ldsm_x4<!B_KMAJOR>(
              r, s_b + ((row + b_lr) * TB::CPR + (ch ^ b_lx)) * 16);
          bfr[buf][2 * nj][0] = r[0];
          bfr[buf][2 * nj][1] = r[1];
          bfr[buf][2 * nj + 1][0] = r[2];
          bfr[buf][2 * nj + 1][1] = r[3];
        }
      } else {
        // b0 (k t, n g), b1 (k t+4, n g)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            bfr[buf][ni][q] = lds32(s_b + pair_off(TB::CPR, kk * 8 + q * 4 + ft,
                                                   wn0 + ni * 8 + fg));
          }
        }
      }
      if constexpr (TF32) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          bfr[buf][ni][0] = to_tf32(bfr[buf][ni][0]);
          bfr[buf][ni][1] = to_tf32(bfr[buf][ni][1]);
        }
      }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

    // Group g of the cp.async sequence holds k-tile g (empty past the end).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT) load_stage(s, s);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();

    int rs = 0, ws = STAGES - 1;  // stage read / written next
    load_frags(0, 0, 0);
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        if (kk == KK - 1) {
          // Tile kt+1 landed (groups committed: STAGES+kt); every warp is done
          // with stage (kt-1)%STAGES, which kk==0 of the next tile refills.
          cp_async_wait<STAGES - 2>();
          __syncthreads();
          rs = rs + 1 == STAGES ? 0 : rs + 1;
        }
        load_frags((kk + 1) & 1, rs, (kk + 1) % KK);
        if (kk == 0) {
          // ws == (kt-1)%STAGES: its last reader finished before the barrier
          // at kk==KK-1 of tile kt-1.  (Refilling at another k-step, or
          // after this step's mma: the same within the noise.)
          const int nk = kt + STAGES - 1;
          if (nk < KT) load_stage(ws, nk);
          cp_async_commit();
          ws = ws + 1 == STAGES ? 0 : ws + 1;
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < NI; ++ni)
            mma_step<KIND>(acc[mi][ni], af[kk & 1][mi], bfr[kk & 1][ni][0],
                           bfr[kk & 1][ni][1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done reading the ring: C goes through it

    // Epilogue through shared memory, so global stores are whole 16-byte
    // chunks of C rows (the fragments hold 2 adjacent elements a row).
    // Accumulator (mi, ni): c0,c1 at (row g, cols 2t,2t+1), c2,c3 at row g+8.
    // Rows padded by 8 elements: the 8 rows x 4 lanes of one fragment store
    // hit 32 distinct banks (4-byte pairs) or, per half-warp, 4 rows x 4
    // lanes of 8-byte pairs (fp32).
    using EP = Epi<Cfg, int(sizeof(OutT))>;
    OutT* C = static_cast<OutT*>(p.c) + bz * int64_t(p.m) * p.n;
    const int wr = warp / Cfg::WARPS_N;
#pragma unroll
    for (int pass = 0; pass < EP::P; ++pass) {
#pragma unroll
      for (int ml = 0; ml < EP::MIP; ++ml) {
        const int mi = pass * EP::MIP + ml;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          unsigned char* srow =
              smem + (wr * EP::RPW + ml * 16 + fg + h * 8) * EP::ROW_BYTES;
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) {
            const int col = wn0 + ni * 8 + ft * 2;
            const float x = acc[mi][ni][2 * h], y = acc[mi][ni][2 * h + 1];
            if constexpr (KIND == kBF16) {
              *reinterpret_cast<__nv_bfloat162*>(srow + col * 2) =
                  __floats2bfloat162_rn(x, y);
            } else if constexpr (KIND == kF16) {
              *reinterpret_cast<__half2*>(srow + col * 2) =
                  __floats2half2_rn(x, y);
            } else {
              *reinterpret_cast<float2*>(srow + col * 4) = make_float2(x, y);
            }
          }
        }
      }
      __syncthreads();
      // Slice row sr: warp row sr/RPW, its local row sr%RPW of this pass.
#pragma unroll 1
      for (int idx = tid; idx < EP::ROWS * EP::CPR; idx += THREADS) {
        const int sr = idx / EP::CPR, cc = idx % EP::CPR;
        const int row = m0 + (sr / EP::RPW) * WM + pass * EP::RPW + sr % EP::RPW;
        const int col = n0 + cc * EP::EPC;
        if (row >= p.m || col >= p.n) continue;
        const unsigned char* src = smem + sr * EP::ROW_BYTES + cc * 16;
        OutT* dst = C + int64_t(row) * p.n + col;
        if (p.c_vec16 && col + EP::EPC <= p.n) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          const OutT* s = reinterpret_cast<const OutT*>(src);
          const int nv = min(EP::EPC, p.n - col);
          for (int e = 0; e < nv; ++e) dst[e] = s[e];
        }
      }
      __syncthreads();  // the slice is reused by the next pass / batch entry
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Layout of one operand viewed as a rows x cols matrix: 0 = row-contiguous
// (unit col stride), 1 = column-contiguous, -1 = neither usable.  epc:
// elements per 16-byte chunk (the other stride must keep chunks aligned).
inline int operand_layout(const Operand& o, int64_t rows, int64_t cols,
                          int epc) {
  const bool row_c = (o.col_stride == 1 || cols <= 1) &&
                     (o.row_stride % epc == 0 || rows <= 1);
  const bool col_c = (o.row_stride == 1 || rows <= 1) &&
                     (o.col_stride % epc == 0 || cols <= 1);
  return row_c ? 0 : col_c ? 1 : -1;
}

}  // namespace sm80_detail
}  // namespace torchops::cuda::gemm

// The tile configs and the choice among them, apart from the kernels.
#include "sm80_heuristics.cuh"

namespace torchops::cuda::gemm {
namespace sm80_detail {

// cudaFuncSetAttribute once per (kernel, device).  `done` must be one per
// kernel: the caller's template makes it so (all kernels share one type).
template <class Kernel>
inline cudaError_t prepare_kernel(Kernel k, size_t smem, int dev, std::atomic<uint64_t>& done) {
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(
      k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
  return e;
}

template <class Cfg, bool A_K, bool B_K, int KIND>
inline cudaError_t launch(const KParams& p0, cudaStream_t stream, int dev) {
  KParams p = p0;
  p.tiles_m = int((p.m + Cfg::BM - 1) / Cfg::BM);
  p.tiles_n = int((p.n + Cfg::BN - 1) / Cfg::BN);
  constexpr size_t smem = Smem<Cfg>::TOTAL;
  static_assert(smem <= 227 * 1024, "over sm_90's dynamic shared memory");
  auto kernel = sm80_gemm<Cfg, A_K, B_K, KIND>;
  static std::atomic<uint64_t> done{0};
  cudaError_t e = prepare_kernel(kernel, smem, dev, done);
  if (e != cudaSuccess) return e;
  const dim3 grid(unsigned(int64_t(p.tiles_m) * p.tiles_n),
                  unsigned(p.batch < 65535 ? p.batch : 65535), 1);
  kernel<<<grid, Cfg::THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

template <class Cfg, int KIND>
inline cudaError_t dispatch_layout(const KParams& p, bool a_k, bool b_k,
                                   cudaStream_t s, int dev) {
  if (a_k) {
    return b_k ? launch<Cfg, true, true, KIND>(p, s, dev)
               : launch<Cfg, true, false, KIND>(p, s, dev);
  }
  return b_k ? launch<Cfg, false, true, KIND>(p, s, dev)
             : launch<Cfg, false, false, KIND>(p, s, dev);
}

// The automatic configs, by choose_cfg's index.
template <int KIND>
inline cudaError_t dispatch_cfg(int cfg, const KParams& p, bool a_k, bool b_k,
                                cudaStream_t s, int dev) {
  switch (cfg) {
    case 0:
      return dispatch_layout<CfgBig, KIND>(p, a_k, b_k, s, dev);
    case 1:
      return dispatch_layout<CfgMid, KIND>(p, a_k, b_k, s, dev);
    case 2:
      return dispatch_layout<CfgSmall, KIND>(p, a_k, b_k, s, dev);
    default:
      return cudaErrorInvalidValue;
  }
}

inline int elems_per_chunk(DType t) { return 16 / dtype_bytes(t); }

}  // namespace sm80_detail

inline bool sm80_supports(const GemmArgs& g) {
  using sm80_detail::operand_layout;
  const bool half = g.dtype == DType::f16 || g.dtype == DType::bf16;
  const bool tf32 = g.dtype == DType::f32 && g.allow_tf32;
  if (!half && !tf32) return false;
  const int epc = sm80_detail::elems_per_chunk(g.dtype);
  constexpr int64_t kMaxDim = int64_t(1) << 30;  // int tile math in the kernel
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) return false;
  if (g.m > kMaxDim || g.n > kMaxDim || g.k > kMaxDim) return false;
  // Tiles of the smallest config go in grid.x.
  if (((g.m + 63) / 64) * ((g.n + 63) / 64) > int64_t(INT32_MAX)) return false;
  if (operand_layout(g.a, g.m, g.k, epc) < 0) return false;
  if (operand_layout(g.b, g.k, g.n, epc) < 0) return false;
  if (g.batch > 1 &&
      (g.a.batch_stride % epc != 0 || g.b.batch_stride % epc != 0)) {
    return false;
  }
  if (reinterpret_cast<uintptr_t>(g.a.ptr) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(g.b.ptr) % 16 != 0) {
    return false;
  }
  return true;
}

inline size_t sm80_workspace_bytes(const GemmArgs&) { return 0; }

namespace sm80_detail {

// One call's kernel parameters, operand layouts and automatic config
// (choose_cfg), for sm80_run to launch; a tuning harness launches other
// configs with the same parameters.
struct Call {
  KParams p;
  bool a_k = false, b_k = false;
  int dev = 0, cfg = 0;
};

inline cudaError_t plan_call(const GemmArgs& g, Call& c) {
  int sms = 0;
  cudaError_t e = cudaGetDevice(&c.dev);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c.dev);
  if (e != cudaSuccess) return e;

  // A is m x k: K-major when row-contiguous.  B is k x n: K-major when
  // column-contiguous.  The outer stride is the other matrix stride.
  const int epc = elems_per_chunk(g.dtype);
  c.a_k = operand_layout(g.a, g.m, g.k, epc) == 0;
  c.b_k = operand_layout(g.b, g.k, g.n, epc) == 1;
  KParams& p = c.p;
  p = KParams{};
  p.a = static_cast<const char*>(g.a.ptr);
  p.b = static_cast<const char*>(g.b.ptr);
  p.c = g.c;
  p.a_bs = g.batch > 1 ? g.a.batch_stride : 0;
  p.b_bs = g.batch > 1 ? g.b.batch_stride : 0;
  p.a_os = c.a_k ? g.a.row_stride : g.a.col_stride;
  p.b_os = c.b_k ? g.b.col_stride : g.b.row_stride;
  p.batch = g.batch;
  p.m = int(g.m);
  p.n = int(g.n);
  p.k = int(g.k);
  p.c_vec16 = (g.n % epc == 0) && (reinterpret_cast<uintptr_t>(g.c) % 16 == 0);

  int smem_optin = 0;
  e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c.dev);
  if (e != cudaSuccess) return e;
  c.cfg = choose_cfg(g, sms, size_t(smem_optin) >= Smem<CfgBig>::TOTAL);
  return cudaSuccess;
}

}  // namespace sm80_detail

inline cudaError_t sm80_run(const GemmArgs& g, void* /*workspace*/,
                            cudaStream_t stream) {
  using namespace sm80_detail;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return cudaSuccess;
  Call c;
  if (const cudaError_t e = plan_call(g, c); e != cudaSuccess) return e;
  switch (g.dtype) {
    case DType::bf16:
      return dispatch_cfg<kBF16>(c.cfg, c.p, c.a_k, c.b_k, stream, c.dev);
    case DType::f16:
      return dispatch_cfg<kF16>(c.cfg, c.p, c.a_k, c.b_k, stream, c.dev);
    default:
      return dispatch_cfg<kTF32>(c.cfg, c.p, c.a_k, c.b_k, stream, c.dev);
  }
}

}  // namespace torchops::cuda::gemm
