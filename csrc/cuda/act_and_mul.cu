// CUDA kernels of torchops.silu_and_mul, torchops.gelu_and_mul and their
// backward operators: memory-bound element-wise passes over rows.
//
// One thread handles one pack of P consecutive columns of a row (16 bytes:
// 8 half, 4 float, 2 double) with one vector load per operand half and one
// vector store per output half.  The packed path needs every access 16-byte
// aligned: the half width d and every row stride a multiple of P, and the
// base pointers aligned.  Anything else (an odd d, a slice that starts
// mid-pack) takes the same kernel with P = 1, one element per access, still
// coalesced.  Index arithmetic is 32-bit when every offset fits (division by
// the packs per row dominates otherwise), 64-bit beyond.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "common/act_and_mul_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

// out[r, c] = act(x[r, c]) * x[r, d + c] over `rows` rows of `packs` packs
// of P columns (d = packs * P); out rows are contiguous.
template <typename Act, int P, typename index_t, typename scalar_t>
__global__ void act_and_mul_forward_kernel(const scalar_t* __restrict__ x,
                                           index_t x_stride,
                                           scalar_t* __restrict__ out,
                                           index_t rows, index_t packs) {
  using opmath_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, P>;
  const index_t total = rows * packs;
  const index_t d = packs * P;
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const index_t r = i / packs;
    const index_t c = (i - r * packs) * P;
    const scalar_t* row = x + r * x_stride;
    const PackT a = *reinterpret_cast<const PackT*>(row + c);
    const PackT b = *reinterpret_cast<const PackT*>(row + d + c);
    PackT o;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      o.v[j] = static_cast<scalar_t>(act_and_mul_value<Act, ScalarMath>(
          static_cast<opmath_t>(a.v[j]), static_cast<opmath_t>(b.v[j])));
    }
    *reinterpret_cast<PackT*>(out + r * d + c) = o;
  }
}

// dx[r, c] and dx[r, d + c] (rows of 2d, contiguous) for the output gradient
// g, both halves in one pass.
template <typename Act, int P, typename index_t, typename scalar_t>
__global__ void act_and_mul_backward_kernel(const scalar_t* __restrict__ g,
                                            index_t g_stride,
                                            const scalar_t* __restrict__ x,
                                            index_t x_stride,
                                            scalar_t* __restrict__ dx,
                                            index_t rows, index_t packs) {
  using opmath_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, P>;
  const index_t total = rows * packs;
  const index_t d = packs * P;
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const index_t r = i / packs;
    const index_t c = (i - r * packs) * P;
    const scalar_t* row = x + r * x_stride;
    const PackT gv = *reinterpret_cast<const PackT*>(g + r * g_stride + c);
    const PackT a = *reinterpret_cast<const PackT*>(row + c);
    const PackT b = *reinterpret_cast<const PackT*>(row + d + c);
    PackT da, db;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      opmath_t ga, gb;
      act_and_mul_grad<Act, ScalarMath>(
          static_cast<opmath_t>(gv.v[j]), static_cast<opmath_t>(a.v[j]),
          static_cast<opmath_t>(b.v[j]), ga, gb);
      da.v[j] = static_cast<scalar_t>(ga);
      db.v[j] = static_cast<scalar_t>(gb);
    }
    scalar_t* dx_row = dx + r * 2 * d;
    *reinterpret_cast<PackT*>(dx_row + c) = da;
    *reinterpret_cast<PackT*>(dx_row + d + c) = db;
  }
}

// Whether rows of `d` columns at `stride` from `ptr` can be read in packs of
// P elements (16-byte aligned: d, stride and the base pointer).
template <int P, typename scalar_t>
bool packable(const scalar_t* ptr, int64_t stride, int64_t d) {
  return d % P == 0 && stride % P == 0 && aligned_for_packs({ptr});
}

// The largest element offset a launch computes, plus the grid's overshoot:
// 32-bit indices when it fits.  Offsets reach (rows - 1) * stride + 2d in
// each input and rows * 2d in the outputs; the loop index reaches
// rows * packs + the grid's thread count.
inline bool fits_32(int64_t rows, int64_t d, unsigned int blocks,
                    std::initializer_list<int64_t> strides) {
  int64_t reach = rows * 2 * d;
  for (const int64_t s : strides) {
    reach = std::max(reach, (rows - 1) * s + 2 * d);
  }
  return fits_int32(reach + int64_t(blocks) * kThreads);
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& x) {
    return c10::cuda::CUDAGuard(x.device());
  }

  template <typename Act, typename scalar_t>
  static void forward(const scalar_t* x, int64_t x_stride, scalar_t* out,
                      int64_t rows, int64_t d) {
    constexpr int kPack = pack_size<scalar_t>();
    const bool packed = packable<kPack>(x, x_stride, d) && aligned_for_packs({out});
    const auto launch = [&](auto p) {
      constexpr int P = decltype(p)::value;
      const int64_t packs = d / P;
      const unsigned int blocks = grid_for(rows * packs, kThreads);
      with_index_type_if(fits_32(rows, d, blocks, {x_stride}), [&](auto index) {
        using index_t = decltype(index);
        act_and_mul_forward_kernel<Act, P, index_t>
            <<<blocks, kThreads, 0, current_stream()>>>(
                x, static_cast<index_t>(x_stride), out,
                static_cast<index_t>(rows), static_cast<index_t>(packs));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    };
    if (packed) {
      launch(std::integral_constant<int, kPack>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  }

  template <typename Act, typename scalar_t>
  static void backward(const scalar_t* g, int64_t g_stride, const scalar_t* x,
                       int64_t x_stride, scalar_t* dx, int64_t rows, int64_t d) {
    constexpr int kPack = pack_size<scalar_t>();
    const bool packed = packable<kPack>(x, x_stride, d) &&
                        packable<kPack>(g, g_stride, d) && aligned_for_packs({dx});
    const auto launch = [&](auto p) {
      constexpr int P = decltype(p)::value;
      const int64_t packs = d / P;
      const unsigned int blocks = grid_for(rows * packs, kThreads);
      with_index_type_if(fits_32(rows, d, blocks, {x_stride, g_stride}), [&](auto index) {
        using index_t = decltype(index);
        act_and_mul_backward_kernel<Act, P, index_t>
            <<<blocks, kThreads, 0, current_stream()>>>(
                g, static_cast<index_t>(g_stride), x,
                static_cast<index_t>(x_stride), dx,
                static_cast<index_t>(rows), static_cast<index_t>(packs));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    };
    if (packed) {
      launch(std::integral_constant<int, kPack>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CUDA, silu_and_mul, CudaKernels)
TORCHOPS_REGISTER_STEPS(CUDA, gelu_and_mul, CudaKernels)

}  // namespace torchops::cuda
