// CUDA kernel of torchops.matmul: a shared-memory tiled GEMM with register
// blocking, reading its inputs through their strides.
//
// Each 256-thread block computes a 64x64 tile of C; each thread owns a 4x4
// sub-tile in registers.  A and B tiles are staged in shared memory already
// converted to the accumulation type, so half/bfloat16 inputs accumulate in
// float.  Strided reads mean transposed and expanded (stride-0) inputs cost
// no copy.  Tensor cores come with a later performance issue.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/matmul.h"
#include "cuda/common/launch.cuh"

namespace torchops::cuda {
namespace {

constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 16;
constexpr int kThreads = 256;  // (kTileM / 4) * (kTileN / 4)
constexpr int kMaxGridYZ = 65535;

struct Strides3 {
  int64_t batch, row, col;
};

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) matmul_kernel(
    const scalar_t* __restrict__ a, Strides3 sa,
    const scalar_t* __restrict__ b, Strides3 sb,
    scalar_t* __restrict__ c, int64_t batch, int64_t m, int64_t n, int64_t k) {
  // +1 padding: column reads of a_tile from different rows hit different banks.
  __shared__ acc_t a_tile[kTileK][kTileM + 1];
  __shared__ acc_t b_tile[kTileK][kTileN];

  const int tid = threadIdx.x;
  const int tx = tid % (kTileN / 4);  // column group of this thread
  const int ty = tid / (kTileN / 4);  // row group
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileM;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileN;

  for (int64_t bi = blockIdx.z; bi < batch; bi += gridDim.z) {
    const scalar_t* ab = a + bi * sa.batch;
    const scalar_t* bb = b + bi * sb.batch;
    acc_t acc[4][4] = {};

    for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
      // Stage A[row0:+64, k0:+16] and B[k0:+16, col0:+64]; 4 values each per
      // thread.  For A, consecutive threads walk k (coalesced for row-major A).
#pragma unroll
      for (int r = 0; r < (kTileM * kTileK) / kThreads; ++r) {
        const int idx = tid + r * kThreads;
        const int tr = idx / kTileK;
        const int tk = idx % kTileK;
        const int64_t gr = row0 + tr;
        const int64_t gk = k0 + tk;
        a_tile[tk][tr] = (gr < m && gk < k)
            ? static_cast<acc_t>(ab[gr * sa.row + gk * sa.col])
            : acc_t(0);
      }
#pragma unroll
      for (int r = 0; r < (kTileK * kTileN) / kThreads; ++r) {
        const int idx = tid + r * kThreads;
        const int tk = idx / kTileN;
        const int tc = idx % kTileN;
        const int64_t gk = k0 + tk;
        const int64_t gc = col0 + tc;
        b_tile[tk][tc] = (gk < k && gc < n)
            ? static_cast<acc_t>(bb[gk * sb.row + gc * sb.col])
            : acc_t(0);
      }
      __syncthreads();

#pragma unroll
      for (int p = 0; p < kTileK; ++p) {
        acc_t av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          av[i] = a_tile[p][ty * 4 + i];
          // Threads of a warp take adjacent columns: conflict-free reads.
          bv[i] = b_tile[p][tx + i * (kTileN / 4)];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[i][j] += av[i] * bv[j];
          }
        }
      }
      __syncthreads();
    }

    scalar_t* cb = c + bi * m * n;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t gr = row0 + ty * 4 + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t gc = col0 + tx + j * (kTileN / 4);
        if (gr < m && gc < n) {
          cb[gr * n + gc] = static_cast<scalar_t>(acc[i][j]);
        }
      }
    }
  }
}

Strides3 strides_of(const at::Tensor& t, bool batched) {
  if (batched) {
    return {t.stride(0), t.stride(1), t.stride(2)};
  }
  return {0, t.stride(0), t.stride(1)};
}

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  const MatmulShape s = check_matmul(a, b, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor c = new_output("matmul", s.out_sizes(), a.options());
  if (c.numel() == 0) {
    return c;
  }
  const int64_t row_tiles = ceil_div(s.m, kTileM);
  TORCH_CHECK(
      row_tiles <= kMaxGridYZ, "torchops.matmul: 'a' has ", s.m,
      " rows; at most ", int64_t(kMaxGridYZ) * kTileM, " are supported");
  const dim3 grid(
      static_cast<unsigned int>(ceil_div(s.n, kTileN)),
      static_cast<unsigned int>(row_tiles),
      static_cast<unsigned int>(std::min<int64_t>(s.batch, kMaxGridYZ)));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, a.scalar_type(), "torchops.matmul", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        matmul_kernel<scalar_t, acc_t><<<grid, kThreads, 0, current_stream()>>>(
            a.const_data_ptr<scalar_t>(), strides_of(a, s.batched),
            b.const_data_ptr<scalar_t>(), strides_of(b, s.batched),
            c.mutable_data_ptr<scalar_t>(), s.batch, s.m, s.n, s.k);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("matmul", &matmul);
}

}  // namespace torchops::cuda
