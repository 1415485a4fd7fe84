// CUDA kernels of torchops.sigmoid_focal_loss and its backward.
//
// "none" and the backward are one element-wise pass each, with 16-byte loads
// and stores when every pointer allows them.  "mean"/"sum" compute and sum in
// one pass: each thread accumulates its elements in registers, each block
// reduces with warp shuffles and writes one partial, and a one-block kernel
// adds the partials in a fixed order.  No atomics: the grid depends only on
// the size (and alignment), so a given input always gives the same bits.
//
// Half types are computed and accumulated in float (at::opmath_type), double
// in double.  gamma's kind (0, 1, 2 or other) is a runtime switch: it is the
// same for every thread, so it costs a uniform branch, not divergence, and
// keeps the number of kernel instantiations down.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/sigmoid_focal_loss_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/block_reduce.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;
// Partials of a reduction: enough blocks to fill any current GPU, few
// enough for one block to add them up quickly.
constexpr int64_t kMaxReduceBlocks = 1024;
constexpr int kFinishThreads = 256;

template <typename T>
__device__ __forceinline__ T loss_at(
    FocalGamma kind, T x, T t, const FocalParams<T>& prm) {
  const SigmoidBce<T> s = sigmoid_bce(x, t);
  switch (kind) {
    case FocalGamma::Zero:
      return focal_loss_value<FocalGamma::Zero>(s, t, prm);
    case FocalGamma::One:
      return focal_loss_value<FocalGamma::One>(s, t, prm);
    case FocalGamma::Two:
      return focal_loss_value<FocalGamma::Two>(s, t, prm);
    default:
      return focal_loss_value<FocalGamma::General>(s, t, prm);
  }
}

template <typename T>
__device__ __forceinline__ T grad_at(
    FocalGamma kind, T g, T x, T t, const FocalParams<T>& prm) {
  const SigmoidBce<T> s = sigmoid_bce(x, t);
  switch (kind) {
    case FocalGamma::Zero:
      return focal_loss_grad<FocalGamma::Zero>(s, t, g, prm);
    case FocalGamma::One:
      return focal_loss_grad<FocalGamma::One>(s, t, g, prm);
    case FocalGamma::Two:
      return focal_loss_grad<FocalGamma::Two>(s, t, g, prm);
    default:
      return focal_loss_grad<FocalGamma::General>(s, t, g, prm);
  }
}

// Element i of n is in pack i / V for i < packs * V; the rest (fewer than V)
// is the tail, one element per thread of the grid's first threads.
struct PackRange {
  int64_t packs, tail_begin, tail;
};

template <int V>
PackRange pack_range(int64_t n) {
  return {n / V, (n / V) * V, n % V};
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kThreads) focal_loss_none_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ t,
    scalar_t* __restrict__ out, PackRange r,
    FocalParams<at::opmath_type<scalar_t>> prm, FocalGamma kind) {
  using T = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  for (int64_t i = global_thread(); i < r.packs; i += grid_threads()) {
    const P xp = reinterpret_cast<const P*>(x)[i];
    const P tp = reinterpret_cast<const P*>(t)[i];
    P op;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      op.v[j] = static_cast<scalar_t>(loss_at(
          kind, static_cast<T>(xp.v[j]), static_cast<T>(tp.v[j]), prm));
    }
    reinterpret_cast<P*>(out)[i] = op;
  }
  const int64_t k = global_thread();
  if (k < r.tail) {
    const int64_t i = r.tail_begin + k;
    out[i] = static_cast<scalar_t>(
        loss_at(kind, static_cast<T>(x[i]), static_cast<T>(t[i]), prm));
  }
}

// One partial sum per block into partial[blockIdx.x]; with a single block,
// the final value (sum / divisor) straight into *out.
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kThreads) focal_loss_sum_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ t,
    PackRange r, FocalParams<at::opmath_type<scalar_t>> prm, FocalGamma kind,
    at::opmath_type<scalar_t>* __restrict__ partial, scalar_t* __restrict__ out,
    at::opmath_type<scalar_t> divisor) {
  using T = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  T acc = 0;
  for (int64_t i = global_thread(); i < r.packs; i += grid_threads()) {
    const P xp = reinterpret_cast<const P*>(x)[i];
    const P tp = reinterpret_cast<const P*>(t)[i];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      acc += loss_at(kind, static_cast<T>(xp.v[j]), static_cast<T>(tp.v[j]), prm);
    }
  }
  const int64_t k = global_thread();
  if (k < r.tail) {
    const int64_t i = r.tail_begin + k;
    acc += loss_at(kind, static_cast<T>(x[i]), static_cast<T>(t[i]), prm);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    if (gridDim.x == 1) {
      *out = static_cast<scalar_t>(acc / divisor);
    } else {
      partial[blockIdx.x] = acc;
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kFinishThreads) focal_loss_finish_kernel(
    const at::opmath_type<scalar_t>* __restrict__ partial, int64_t count,
    scalar_t* __restrict__ out, at::opmath_type<scalar_t> divisor) {
  using T = at::opmath_type<scalar_t>;
  T acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    acc += partial[i];
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    *out = static_cast<scalar_t>(acc / divisor);
  }
}

// grad_scalar: g points at one value (mean/sum), used for every element after
// division by g_divisor (numel for mean, 1 for sum); else g is per element.
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kThreads) focal_loss_grad_kernel(
    const scalar_t* __restrict__ g, bool grad_scalar,
    at::opmath_type<scalar_t> g_divisor, const scalar_t* __restrict__ x,
    const scalar_t* __restrict__ t, scalar_t* __restrict__ out, PackRange r,
    FocalParams<at::opmath_type<scalar_t>> prm, FocalGamma kind) {
  using T = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const T g0 = grad_scalar ? static_cast<T>(*g) / g_divisor : T(0);
  for (int64_t i = global_thread(); i < r.packs; i += grid_threads()) {
    const P xp = reinterpret_cast<const P*>(x)[i];
    const P tp = reinterpret_cast<const P*>(t)[i];
    P gp;
    if (!grad_scalar) {
      gp = reinterpret_cast<const P*>(g)[i];
    }
    P op;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const T gj = grad_scalar ? g0 : static_cast<T>(gp.v[j]);
      op.v[j] = static_cast<scalar_t>(grad_at(
          kind, gj, static_cast<T>(xp.v[j]), static_cast<T>(tp.v[j]), prm));
    }
    reinterpret_cast<P*>(out)[i] = op;
  }
  const int64_t k = global_thread();
  if (k < r.tail) {
    const int64_t i = r.tail_begin + k;
    const T gi = grad_scalar ? g0 : static_cast<T>(g[i]);
    out[i] = static_cast<scalar_t>(
        grad_at(kind, gi, static_cast<T>(x[i]), static_cast<T>(t[i]), prm));
  }
}

// Calls f(std::integral_constant<int, V>{}) with V the 16-byte pack size if
// every pointer is aligned for it, else 1.
template <typename scalar_t, typename F>
void dispatch_pack(std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kPack = pack_size<scalar_t>();
  if (aligned_for_packs(ptrs)) {
    f(std::integral_constant<int, kPack>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& inputs) {
    return c10::cuda::CUDAGuard(inputs.device());
  }

  template <typename scalar_t>
  static void loss(const FocalCall<scalar_t>& c) {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* xp = c.x;
    const scalar_t* tp = c.t;
    scalar_t* op = c.out;
    const int64_t n = c.n;
    if (c.red == Reduction::None) {
      dispatch_pack<scalar_t>({xp, tp, op}, [&](auto v) {
        constexpr int V = decltype(v)::value;
        const PackRange r = pack_range<V>(n);
        focal_loss_none_kernel<scalar_t, V>
            <<<grid_for(std::max<int64_t>(r.packs, r.tail), kThreads),
               kThreads, 0, current_stream()>>>(xp, tp, op, r, c.prm, c.kind);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    const T divisor =
        c.red == Reduction::Mean ? static_cast<T>(n) : T(1);
    dispatch_pack<scalar_t>({xp, tp}, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const PackRange r = pack_range<V>(n);
      const int64_t blocks = std::min<int64_t>(
          ceil_div(std::max<int64_t>(r.packs, r.tail), kThreads),
          kMaxReduceBlocks);
      at::Tensor partial;
      T* pp = nullptr;
      if (blocks > 1) {
        partial = at::empty(
            {blocks}, c.options.dtype(c10::CppTypeToScalarType<T>::value));
        pp = partial.mutable_data_ptr<T>();
      }
      focal_loss_sum_kernel<scalar_t, V>
          <<<static_cast<unsigned int>(blocks), kThreads, 0,
             current_stream()>>>(xp, tp, r, c.prm, c.kind, pp, op, divisor);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (blocks > 1) {
        focal_loss_finish_kernel<scalar_t>
            <<<1, kFinishThreads, 0, current_stream()>>>(
                pp, blocks, op, divisor);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }

  template <typename scalar_t>
  static void grad(const FocalCall<scalar_t>& c) {
    using T = at::opmath_type<scalar_t>;
    const bool grad_scalar = c.red != Reduction::None;
    const T g_divisor =
        c.red == Reduction::Mean ? static_cast<T>(c.n) : T(1);
    const scalar_t* gp = c.grad;
    const scalar_t* xp = c.x;
    const scalar_t* tp = c.t;
    scalar_t* op = c.out;
    dispatch_pack<scalar_t>(
        {grad_scalar ? nullptr : gp, xp, tp, op}, [&](auto v) {
          constexpr int V = decltype(v)::value;
          const PackRange r = pack_range<V>(c.n);
          focal_loss_grad_kernel<scalar_t, V>
              <<<grid_for(std::max<int64_t>(r.packs, r.tail), kThreads),
                 kThreads, 0, current_stream()>>>(
                  gp, grad_scalar, g_divisor, xp, tp, op, r, c.prm, c.kind);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CUDA, sigmoid_focal_loss, CudaKernels)

}  // namespace torchops::cuda
