// Exact float32 GEMM on Hopper's CUDA cores (the simt path's kernel where
// the GPU is an sm_90 and the layout suits TMA): the FMA loop of simt.cuh's
// 128x128 tile, 8x8 outputs a thread, fed by TMA through a ring of shared-
// memory stages synchronised with mbarriers instead of loads staged in
// registers and a block-wide barrier per k tile.  Three warpgroups: one
// thread of the first issues the copies; the other two (8 warps) compute.
//
// Why: in simt.cuh's kernel (one block of 8 warps per SM) the FMA pipe
// idles while the warps wait at the k tile's __syncthreads for each other
// and issue global loads and shared stores between their FMAs.  Here a
// producer warpgroup only issues TMA copies, and each of the 8 consumer
// warps waits only for its data (a stage's "full" barrier) and frees a stage
// for the producer when it has read it ("empty": 256 arrivals), never for
// the other warps.  A dedicated producer warpgroup beats thread 0 refilling
// a stage once all have read it.
//
// Shared-memory layout of a stage (BK = 32):
//   A: [8 chunks of 4 k][128 rows][4 floats]: a thread reads its 8 rows'
//      4 k's of one chunk as float4s; the 4 rows a warp reads at once are
//      consecutive, 64 contiguous bytes (no bank conflicts).  TMA writes
//      this transposition-free view of row-major A from a 3-D map of
//      dims (4, M, K/4) with strides (lda, 16 bytes): hence K % 4 == 0.
//   B: [32 k][128 columns], row-major like B: a warp reads 128 contiguous
//      bytes of one k row (8 threads' float4s; the 4 others broadcast).
// Thread (tx, ty), 16 x 16 of them: rows ty + 16 j, columns 64 jn + 4 tx + e.
// A's fragments of the next 4-k chunk and B's of the next k are read while
// the current ones are multiplied, across stage boundaries too.
// TMA zero-fills every box past M, N and K, so any size is exact with no
// tail code; the epilogue stores what lies inside C.
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/matmul/gemm_args.cuh"
#include "cuda/matmul/tma.cuh"

namespace torchops::cuda::gemm {
namespace simt90_detail {

constexpr int kBM = 128, kBN = 128, kBK = 32;
constexpr int kChunks = kBK / 4;
constexpr int kStages = 4;
constexpr int kConsumers = 256;               // 8 warps: 16 x 16 threads of 8x8 outputs
// + a producer warpgroup: setmaxnreg works per warpgroup, and only with it
// do the consumers get the registers 8x8 outputs and two fragment sets
// need (a 9-warp block is capped at 168: 20 bytes spilled).
constexpr int kThreads = kConsumers + 128;
constexpr int kABytes = kBM * kBK * 4;        // 16 KB
constexpr int kBBytes = kBK * kBN * 4;        // 16 KB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + barriers, alignment
constexpr int kGroupM = 8;                    // tile rows per raster group (L2 reuse)

struct Params {
  float* c;
  int64_t m, n;
  int tiles_m, tiles_n, k_tiles;
  int c_vec;  // n % 4 == 0 and C 16-byte aligned: float4 stores
};

__global__ void __launch_bounds__(kThreads, 1) simt90_kernel(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    const Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace tma;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Aligned by an offset from the __shared__ array itself (not through an
  // integer): the compiler then still knows the fragment reads are shared
  // memory and emits LDS, not generic loads.
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  int64_t tm, tn;
  grouped_tile(blockIdx.x, p.tiles_m, p.tiles_n, kGroupM, tm, tn);
  const int row0 = static_cast<int>(tm) * kBM, col0 = static_cast<int>(tn) * kBN;
  const int kt = p.k_tiles;

  if (tid < 128) {  // producer warpgroup: one thread issues the copies
    setmaxnreg_dec<40>();
    if (tid == 0) {
      for (int it = 0; it < kt; ++it) {
        const int s = it % kStages;
        mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
        mbar_expect_tx(&full[s], kStageBytes);
        unsigned char* st = smem + s * kStageBytes;
        tma_load_3d(st, &map_a, &full[s], 0, row0, it * kChunks);
        tma_load_3d(st + kABytes, &map_b, &full[s], col0, it * kBK, 0);
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int warp = (tid - 128) >> 5, lane = tid & 31;
  const int tx = (warp & 1) * 8 + (lane & 7);
  const int ty = (warp >> 1) * 4 + (lane >> 3);
  const int a_off = ty * 16;            // bytes: row ty of a chunk
  const int b_off = kABytes + tx * 16;  // bytes: columns 4 tx.. of a k row

  float acc[8][8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;

  float an[8][4], bn[8];  // the next chunk's A (8 rows x 4 k), the next k's B
  auto load_a = [&](const unsigned char* st, int c) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(st + a_off + c * (kBM * 16) + j * 256);
      an[j][0] = v.x; an[j][1] = v.y; an[j][2] = v.z; an[j][3] = v.w;
    }
  };
  auto load_b = [&](const unsigned char* st, int k) {
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) {
      const float4 v = *reinterpret_cast<const float4*>(st + b_off + k * (kBN * 4) + jn * 256);
      bn[jn * 4 + 0] = v.x; bn[jn * 4 + 1] = v.y; bn[jn * 4 + 2] = v.z; bn[jn * 4 + 3] = v.w;
    }
  };

  if (kt > 0) {
    mbar_wait(&full[0], 0);
    load_a(smem, 0);
    load_b(smem, 0);
  }
  for (int it = 0; it < kt; ++it) {
    const int s = it % kStages;
    const unsigned char* st = smem + s * kStageBytes;
    const bool more = it + 1 < kt;
    const int s1 = (it + 1) % kStages;
    const unsigned char* st1 = smem + s1 * kStageBytes;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float a[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) a[j][q] = an[j][q];
      if (c + 1 < kChunks) {
        load_a(st, c + 1);
      } else if (more) {
        mbar_wait(&full[s1], ((it + 1) / kStages) & 1);
        load_a(st1, 0);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float b[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = bn[i];
        if (c * 4 + q + 1 < kBK) {
          load_b(st, c * 4 + q + 1);
        } else if (more) {
          load_b(st1, 0);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = fmaf(a[j][q], b[i], acc[j][i]);
      }
    }
    // This thread's reads of stage s are issued; the arrive's release
    // orders them before the producer's next copy into it.
    mbar_arrive(&empty[s]);
  }

  const int64_t n = p.n;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t row = row0 + ty + 16 * j;
    if (row >= p.m) continue;
    float* crow = p.c + row * n;
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) {
      const int64_t col = col0 + jn * 64 + tx * 4;
      const float* v = &acc[j][jn * 4];
      if (p.c_vec && col + 3 < n) {
        *reinterpret_cast<float4*>(crow + col) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < n) crow[col + e] = v[e];
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host never selects this kernel then
#endif
}

}  // namespace simt90_detail

// float32, one matrix (batch 1), A and B row-major with 16-byte-aligned
// starts and row strides, K % 4 == 0 (A's chunked view), sizes TMA can
// address; an sm_90 GPU.
inline bool simt90_supports(const GemmArgs& g) {
  using namespace simt90_detail;
  if (g.dtype != DType::f32 || g.batch != 1) return false;
  if (g.m < 1 || g.n < 1 || g.k < 4 || g.k % 4 != 0) return false;
  if (g.m > 0x7fffff00 || g.n > 0x7fffff00 || g.k > 0x7fffff00) return false;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(g.a.ptr) || !aligned(g.b.ptr)) return false;
  if (g.a.col_stride != 1 || (g.m > 1 && (g.a.row_stride % 4 != 0 || g.a.row_stride < g.k)))
    return false;
  if (g.b.col_stride != 1 || g.b.row_stride % 4 != 0 || g.b.row_stride < g.n) return false;
  return tma::sm90_device();
}

inline cudaError_t simt90_run(const GemmArgs& g, cudaStream_t stream) {
  using namespace simt90_detail;
  CUtensorMap ma, mb;
  // A as (4, M, K/4): element (e, i, c) is A[i, 4c + e].
  const uint64_t lda = g.m > 1 ? static_cast<uint64_t>(g.a.row_stride) : static_cast<uint64_t>(g.k);
  const uint64_t ldb = static_cast<uint64_t>(g.b.row_stride);
  const uint64_t k = static_cast<uint64_t>(g.k), m = static_cast<uint64_t>(g.m),
                 n = static_cast<uint64_t>(g.n);
  const bool oka = tma::encode_3d(&ma, g.a.ptr, 4, {4, m, k / 4}, {lda * 4, 16},
                                  {4, kBM, kChunks}, CU_TENSOR_MAP_SWIZZLE_NONE);
  // B as (N, K, 1); the unit batch's stride only has to be valid.
  const bool okb = tma::encode_3d(&mb, g.b.ptr, 4, {n, k, 1}, {ldb * 4, ldb * k * 4},
                                  {kBN, kBK, 1}, CU_TENSOR_MAP_SWIZZLE_NONE);
  if (!oka || !okb) return cudaErrorNotSupported;  // the caller takes simt.cuh's kernel
  Params p;
  p.c = static_cast<float*>(g.c);
  p.m = g.m;
  p.n = g.n;
  p.tiles_m = static_cast<int>((g.m + kBM - 1) / kBM);
  p.tiles_n = static_cast<int>((g.n + kBN - 1) / kBN);
  p.k_tiles = static_cast<int>((g.k + kBK - 1) / kBK);
  p.c_vec = g.n % 4 == 0 && reinterpret_cast<uintptr_t>(g.c) % 16 == 0;
  if (int64_t(p.tiles_m) * p.tiles_n > 0x7fffffff) return cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(simt90_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kSmemBytes);
  if (e != cudaSuccess) return e;
  simt90_kernel<<<static_cast<unsigned>(p.tiles_m * p.tiles_n), kThreads, kSmemBytes, stream>>>(
      ma, mb, p);
  return cudaGetLastError();
}

}  // namespace torchops::cuda::gemm
