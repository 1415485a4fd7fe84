// CUDA kernels of torchops.silu_and_mul, torchops.gelu_and_mul and their
// backward operators: memory-bound element-wise passes over rows.
//
// The grid is two-dimensional, so no thread divides a flat index by the row
// width: threads along x cover a tile of columns of a row, threads along y
// (and blockIdx.y, in a grid-stride loop) cover rows.  A thread owns U items
// of its row's tile, blockDim.x apart, so each warp-wide access stays
// coalesced while the thread issues all its 2U (backward 3U) loads before
// any math or store: many independent loads in flight per thread are what
// keeps a streaming kernel near copy bandwidth.  An item is a pack of P
// consecutive columns (16 bytes: 8 half, 4 float, 2 double) when every
// access is 16-byte aligned (the half width d and every row stride a
// multiple of P, and the base pointers aligned); anything else (an odd d, a
// slice that starts mid-pack) takes the same kernel with P = 1 and more
// items per thread.  Inputs are read once and outputs written once, so the
// loads and stores are streaming (evict-first).  Row offsets are 64-bit,
// computed once per row; column indices are 32-bit unless a row passes it.
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16-math.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/act_and_mul_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;
// Resident blocks per SM times this many bound the grid: enough blocks to
// keep every SM full through the tail, few enough that a block loops over
// several rows of a tall input.
constexpr int64_t kWaves = 16;

// Items per thread: eight single elements (narrow accesses need many in
// flight for their bytes); four 16-byte packs forward, two backward, whose
// three operands and heavier math would otherwise hold so many registers
// (over 160 for bf16 erf) that one block fits an SM; one pack of doubles
// backward, whose double erf spills with two.
template <int P, bool Backward>
constexpr int items_per_thread() {
  return P == 1 ? 8 : (!Backward ? 4 : (P == 2 ? 1 : 2));
}

// The math of the half types: float, with the hardware's approximate exp
// and reciprocal (one MUFU instruction each, relative error about 2^-21,
// far below a half type's rounding of the result).  The accurate expf and
// reciprocal cost this streaming kernel registers and instructions enough to
// lower its occupancy, and its bandwidth with it.  float and double keep
// ScalarMath: their results are held to their own precision.
struct HalfMath : ScalarMath {
  __device__ __forceinline__ static float exp(const float& x) { return __expf(x); }
  __device__ __forceinline__ static float recip(const float& x) {
    return __fdividef(1.0f, x);
  }
};

template <typename scalar_t>
using MathFor = std::conditional_t<c10::is_reduced_floating_point_v<scalar_t>,
                                   HalfMath, ScalarMath>;

// The unsigned word of each access width, for the streaming intrinsics.
template <int Bytes>
struct Word;
template <>
struct Word<2> { using type = unsigned short; };
template <>
struct Word<4> { using type = unsigned int; };
template <>
struct Word<8> { using type = unsigned long long; };
template <>
struct Word<16> { using type = uint4; };

// One streaming (evict-first) load or store of a Pack.
template <typename PackT>
__device__ __forceinline__ PackT load_stream(const PackT* p) {
  using W = typename Word<sizeof(PackT)>::type;
  static_assert(sizeof(W) == sizeof(PackT) && alignof(PackT) >= alignof(W));
  const W w = __ldcs(reinterpret_cast<const W*>(p));
  PackT v;
  memcpy(&v, &w, sizeof(PackT));
  return v;
}

template <typename PackT>
__device__ __forceinline__ void store_stream(PackT* p, const PackT& v) {
  using W = typename Word<sizeof(PackT)>::type;
  static_assert(sizeof(W) == sizeof(PackT) && alignof(PackT) >= alignof(W));
  W w;
  memcpy(&w, &v, sizeof(PackT));
  __stcs(reinterpret_cast<W*>(p), w);
}

// The first row of this thread and the rows between its iterations.
__device__ __forceinline__ int64_t row_start() {
  return static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
}
__device__ __forceinline__ int64_t row_stride() {
  return static_cast<int64_t>(gridDim.y) * blockDim.y;
}

// out[r, c] = act(x[r, c]) * x[r, d + c] over `rows` rows of `packs` packs
// of P columns (d = packs * P) in `tiles` tiles of blockDim.x * U packs;
// out rows are contiguous.
template <typename Act, int P, typename index_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    act_and_mul_forward_kernel(const scalar_t* __restrict__ x, int64_t x_stride,
                               scalar_t* __restrict__ out, int64_t rows,
                               index_t packs, index_t tiles) {
  using opmath_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, P>;
  constexpr int U = items_per_thread<P, false>();
  const index_t d = packs * P;
  const index_t tx = static_cast<index_t>(blockDim.x);
  for (index_t tile = blockIdx.x; tile < tiles; tile += static_cast<index_t>(gridDim.x)) {
    const index_t c0 = tile * tx * U + static_cast<index_t>(threadIdx.x);
    for (int64_t r = row_start(); r < rows; r += row_stride()) {
      const scalar_t* a_row = x + r * x_stride;
      const scalar_t* b_row = a_row + d;
      scalar_t* out_row = out + r * static_cast<int64_t>(d);
      PackT a[U], b[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const index_t c = c0 + k * tx;
        if (c < packs) {
          a[k] = load_stream(reinterpret_cast<const PackT*>(a_row + c * P));
          b[k] = load_stream(reinterpret_cast<const PackT*>(b_row + c * P));
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const index_t c = c0 + k * tx;
        if (c < packs) {
          PackT o;
#pragma unroll
          for (int j = 0; j < P; ++j) {
            o.v[j] = static_cast<scalar_t>(act_and_mul_value<Act, MathFor<scalar_t>>(
                static_cast<opmath_t>(a[k].v[j]), static_cast<opmath_t>(b[k].v[j])));
          }
          store_stream(reinterpret_cast<PackT*>(out_row + c * P), o);
        }
      }
    }
  }
}

// dx[r, c] and dx[r, d + c] (rows of 2d, contiguous) for the output gradient
// g, both halves in one pass; the same layout as the forward.
template <typename Act, int P, typename index_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    act_and_mul_backward_kernel(const scalar_t* __restrict__ g, int64_t g_stride,
                                const scalar_t* __restrict__ x, int64_t x_stride,
                                scalar_t* __restrict__ dx, int64_t rows,
                                index_t packs, index_t tiles) {
  using opmath_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, P>;
  constexpr int U = items_per_thread<P, true>();
  const index_t d = packs * P;
  const index_t tx = static_cast<index_t>(blockDim.x);
  for (index_t tile = blockIdx.x; tile < tiles; tile += static_cast<index_t>(gridDim.x)) {
    const index_t c0 = tile * tx * U + static_cast<index_t>(threadIdx.x);
    for (int64_t r = row_start(); r < rows; r += row_stride()) {
      const scalar_t* g_row = g + r * g_stride;
      const scalar_t* a_row = x + r * x_stride;
      const scalar_t* b_row = a_row + d;
      scalar_t* da_row = dx + r * 2 * static_cast<int64_t>(d);
      scalar_t* db_row = da_row + d;
      PackT gv[U], a[U], b[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const index_t c = c0 + k * tx;
        if (c < packs) {
          gv[k] = load_stream(reinterpret_cast<const PackT*>(g_row + c * P));
          a[k] = load_stream(reinterpret_cast<const PackT*>(a_row + c * P));
          b[k] = load_stream(reinterpret_cast<const PackT*>(b_row + c * P));
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const index_t c = c0 + k * tx;
        if (c < packs) {
          PackT da, db;
#pragma unroll
          for (int j = 0; j < P; ++j) {
            opmath_t ga, gb;
            act_and_mul_grad<Act, MathFor<scalar_t>>(
                static_cast<opmath_t>(gv[k].v[j]), static_cast<opmath_t>(a[k].v[j]),
                static_cast<opmath_t>(b[k].v[j]), ga, gb);
            da.v[j] = static_cast<scalar_t>(ga);
            db.v[j] = static_cast<scalar_t>(gb);
          }
          store_stream(reinterpret_cast<PackT*>(da_row + c * P), da);
          store_stream(reinterpret_cast<PackT*>(db_row + c * P), db);
        }
      }
    }
  }
}

// Whether rows of `d` columns at `stride` from `ptr` can be read in packs of
// P elements (16-byte aligned: d, stride and the base pointer).
template <int P, typename scalar_t>
bool packable(const scalar_t* ptr, int64_t stride, int64_t d) {
  return d % P == 0 && stride % P == 0 && aligned_for_packs({ptr});
}

// The launch shape for `rows` rows of `packs` items, U per thread: the row
// splits into the fewest tiles of at most kThreads * U items, and blockDim.x
// into as many threads as one tile needs (not rounded to a warp: a warp
// may span rows, so narrow rows still fill their warps); the rest of the
// block's threads take further rows.  Column tiles and row blocks beyond the
// grid's limits (or the waves bound) are looped over.
struct ActLaunch {
  dim3 grid, block;
  int64_t tiles;
};

template <int U>
ActLaunch act_launch(int64_t rows, int64_t packs) {
  const int64_t tiles = ceil_div(packs, int64_t(kThreads) * U);
  const int64_t tx = ceil_div(packs, tiles * U);  // in [1, kThreads]
  const int64_t ty = std::max<int64_t>(1, std::min<int64_t>(kThreads / tx, rows));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  const int64_t resident = std::max<int64_t>(sms, 1) * std::max<int64_t>(1, 2048 / (tx * ty));
  const int64_t gx = std::min<int64_t>(tiles, std::numeric_limits<int32_t>::max());
  const int64_t gy = std::max<int64_t>(
      1, std::min({ceil_div(rows, ty), int64_t(65535), kWaves * resident / gx}));
  return {dim3(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy)),
          dim3(static_cast<unsigned int>(tx), static_cast<unsigned int>(ty)), tiles};
}

// Whether the column indices (up to 2d, plus a tile's and the tile loop's
// overshoot) fit in 32 bits; row offsets are always 64-bit.
inline bool columns_fit_32(int64_t d, int64_t tiles) {
  return fits_int32(2 * d + 2 * tiles * int64_t(kThreads) * 8 + kThreads * 8);
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
      const ActLaunch l = act_launch<items_per_thread<P, false>()>(rows, packs);
      with_index_type_if(columns_fit_32(d, l.tiles), [&](auto index) {
        using index_t = decltype(index);
        act_and_mul_forward_kernel<Act, P, index_t>
            <<<l.grid, l.block, 0, current_stream()>>>(
                x, x_stride, out, rows, static_cast<index_t>(packs),
                static_cast<index_t>(l.tiles));
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
      const ActLaunch l = act_launch<items_per_thread<P, true>()>(rows, packs);
      with_index_type_if(columns_fit_32(d, l.tiles), [&](auto index) {
        using index_t = decltype(index);
        act_and_mul_backward_kernel<Act, P, index_t>
            <<<l.grid, l.block, 0, current_stream()>>>(
                g, g_stride, x, x_stride, dx, rows, static_cast<index_t>(packs),
                static_cast<index_t>(l.tiles));
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
