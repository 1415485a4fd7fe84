// CUDA kernels of torchops.fused_linear_cross_entropy: the passes over one
// chunk of logits (the host steps and the GEMMs, cuBLAS through ATen, are
// common/fused_linear_cross_entropy_steps.h).
//
// One block per row of the chunk; its threads stride over the row in 16-byte
// packs where the row and the bias are aligned for them.  The stats pass
// keeps an online (max, sum of exp) per thread, rescaled once per pack, and
// combines the threads' pairs in a fixed tree (deterministic); the grad pass
// writes the gradient over the logits it reads.  Both read each logit once,
// so a chunk costs three sweeps of its memory (stats read, grad read and
// write) beside the GEMMs.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "common/env.h"
#include "common/fused_linear_cross_entropy_steps.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kMaxThreads = 512;

struct DevExp {
  __device__ float operator()(float x) const { return expf(x); }
  __device__ double operator()(double x) const { return ::exp(x); }
};

template <typename acc_t>
struct CapConsts {
  acc_t cap, inv_cap;
};

template <typename acc_t>
CapConsts<acc_t> cap_consts(const LceParams& p) {
  return {static_cast<acc_t>(p.cap), p.has_cap ? acc_t(1) / static_cast<acc_t>(p.cap) : acc_t(0)};
}

// Threads for a row of `cols` values in packs of `vec`: a power of two from
// one warp to kMaxThreads, so short rows do not leave most threads idle.
int threads_for(int64_t cols, int vec) {
  int t = 32;
  while (t < kMaxThreads && static_cast<int64_t>(t) * vec < cols) {
    t *= 2;
  }
  return t;
}

__device__ __forceinline__ int64_t local_column(int64_t target, const LceParams& p,
                                                int64_t cols) {
  const int64_t c = target - p.vocab_start;
  return target != p.ignore_index && c >= 0 && c < cols ? c : -1;
}

__device__ __forceinline__ bool out_of_range(int64_t target, const LceParams& p) {
  return target != p.ignore_index && (target < 0 || target >= p.vocab_total);
}

// (m, s) += (m2, s2): the sum of exp(z - m) over both sets, about the larger
// max.  An empty set has m = -inf (and s = 0).
template <typename acc_t>
__device__ __forceinline__ void combine(acc_t& m, acc_t& s, acc_t m2, acc_t s2) {
  const acc_t mn = m > m2 ? m : m2;
  if (mn == -std::numeric_limits<acc_t>::infinity()) {
    return;
  }
  s = (m == mn ? s : s * DevExp{}(m - mn)) + (m2 == mn ? s2 : s2 * DevExp{}(m2 - mn));
  m = mn;
}

template <typename scalar_t, int VEC>
__device__ __forceinline__ void load_pack(const scalar_t* p, int64_t j,
                                          at::opmath_type<scalar_t> (&out)[VEC]) {
  const Pack<scalar_t, VEC> v = *reinterpret_cast<const Pack<scalar_t, VEC>*>(p + j);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    out[k] = static_cast<at::opmath_type<scalar_t>>(v.v[k]);
  }
}

// z of the VEC logits of row y (plus bias) from column j.
template <typename scalar_t, int VEC, bool kCap>
__device__ __forceinline__ void capped_pack(const scalar_t* y, const scalar_t* bias, int64_t j,
                                            CapConsts<at::opmath_type<scalar_t>> cc,
                                            at::opmath_type<scalar_t> (&z)[VEC]) {
  using acc_t = at::opmath_type<scalar_t>;
  load_pack<scalar_t, VEC>(y, j, z);
  if (bias != nullptr) {
    acc_t b[VEC];
    load_pack<scalar_t, VEC>(bias, j, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      z[k] += b[k];
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    z[k] = lce_capped<kCap>(z[k], cc.cap, cc.inv_cap, DevExp{});
  }
}

template <typename scalar_t, int VEC, bool kCap>
__global__ void __launch_bounds__(kMaxThreads)
    stats_kernel(LceChunk<scalar_t> c, at::opmath_type<scalar_t>* out,
                 CapConsts<at::opmath_type<scalar_t>> cc, bool want_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t r = blockIdx.x;
  const scalar_t* y = c.logits + r * c.ld;
  acc_t m = kNegInf, s = 0, zs = 0;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < c.cols;
       j += static_cast<int64_t>(blockDim.x) * VEC) {
    acc_t z[VEC];
    capped_pack<scalar_t, VEC, kCap>(y, c.bias, j, cc, z);
    acc_t mv = z[0];
#pragma unroll
    for (int k = 1; k < VEC; ++k) {
      mv = z[k] > mv ? z[k] : mv;
    }
    if (mv > m) {
      s = m == kNegInf ? acc_t(0) : s * DevExp{}(m - mv);
      m = mv;
    }
    if (m != kNegInf) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        s += DevExp{}(z[k] - m);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      zs += z[k];
    }
  }
  // The block's (m, s) and sum: warps by shuffles, then warp 0 over the
  // warps' results, in a fixed order.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const acc_t m2 = __shfl_down_sync(0xffffffffu, m, offset);
    const acc_t s2 = __shfl_down_sync(0xffffffffu, s, offset);
    zs += __shfl_down_sync(0xffffffffu, zs, offset);
    combine(m, s, m2, s2);
  }
  __shared__ acc_t wm[32], ws[32], wz[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    wm[warp] = m;
    ws[warp] = s;
    wz[warp] = zs;
  }
  __syncthreads();
  if (warp != 0) {
    return;
  }
  const int warps = blockDim.x / 32;
  m = lane < warps ? wm[lane] : kNegInf;
  s = lane < warps ? ws[lane] : acc_t(0);
  zs = lane < warps ? wz[lane] : acc_t(0);
  for (int offset = 16; offset > 0; offset >>= 1) {
    const acc_t m2 = __shfl_down_sync(0xffffffffu, m, offset);
    const acc_t s2 = __shfl_down_sync(0xffffffffu, s, offset);
    zs += __shfl_down_sync(0xffffffffu, zs, offset);
    combine(m, s, m2, s2);
  }
  if (lane != 0) {
    return;
  }
  // All -inf, or an inf: the lse is the max itself (as torch.logsumexp);
  // a NaN logit made s NaN.
  const acc_t lse = isinf(m) ? m : m + ::log(s);
  const int64_t t = c.target[r];
  const int64_t col = local_column(t, c.p, c.cols);
  acc_t zt = 0;
  if (out_of_range(t, c.p)) {
    zt = std::numeric_limits<acc_t>::quiet_NaN();
  } else if (col >= 0) {
    acc_t v = static_cast<acc_t>(y[col]);
    if (c.bias != nullptr) {
      v += static_cast<acc_t>(c.bias[col]);
    }
    zt = lce_capped<kCap>(v, cc.cap, cc.inv_cap, DevExp{});
  }
  acc_t* o = out + r * kLceStats;
  o[kLceLse] = lse;
  o[kLceTarget] = zt;
  o[kLceSum] = want_sum ? zs : acc_t(0);
}

template <typename scalar_t, int VEC, bool kCap>
__global__ void __launch_bounds__(kMaxThreads)
    grad_kernel(LceChunk<scalar_t> c, const at::opmath_type<scalar_t>* lse,
                int64_t lse_stride, const at::opmath_type<scalar_t>* scale,
                CapConsts<at::opmath_type<scalar_t>> cc) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t r = blockIdx.x;
  scalar_t* y = c.logits + r * c.ld;
  // A target no class has (left by TORCHOPS_LCE_TARGET_CHECK=nan): a NaN
  // gradient, as its loss.
  const acc_t sc = out_of_range(c.target[r], c.p) ? std::numeric_limits<acc_t>::quiet_NaN()
                                                  : scale[r];
  const int64_t stride = static_cast<int64_t>(blockDim.x) * VEC;
  if (sc == acc_t(0)) {  // an ignored row (or a zero upstream gradient)
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < c.cols; j += stride) {
      Pack<scalar_t, VEC> v;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        v.v[k] = scalar_t(0);
      }
      *reinterpret_cast<Pack<scalar_t, VEC>*>(y + j) = v;
    }
    return;
  }
  const LceGradRow<acc_t> row = lce_grad_row<acc_t>(
      lse[r * lse_stride], sc, static_cast<acc_t>(c.p.smoothing),
      static_cast<acc_t>(c.p.z_scale), static_cast<acc_t>(c.p.vocab_total));
  const int64_t tl = local_column(c.target[r], c.p, c.cols);
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < c.cols; j += stride) {
    acc_t z[VEC];
    capped_pack<scalar_t, VEC, kCap>(y, c.bias, j, cc, z);
    Pack<scalar_t, VEC> v;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t hit = j + k == tl ? acc_t(1) : acc_t(0);
      v.v[k] = static_cast<scalar_t>(lce_grad<kCap>(z[k], hit, row, cc.inv_cap, DevExp{}));
    }
    *reinterpret_cast<Pack<scalar_t, VEC>*>(y + j) = v;
  }
}

// p[0, n) *= *s, read on the device: nothing at all when it is 1 (the
// upstream gradient of a loss that ends the graph).
template <typename scalar_t, int VEC>
__global__ void scale_kernel(scalar_t* p, int64_t n, const at::opmath_type<scalar_t>* s) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t g = *s;
  if (g == acc_t(1)) {
    return;
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n;
       i += stride) {
    Pack<scalar_t, VEC> v = *reinterpret_cast<Pack<scalar_t, VEC>*>(p + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v.v[k] = static_cast<scalar_t>(static_cast<acc_t>(v.v[k]) * g);
    }
    *reinterpret_cast<Pack<scalar_t, VEC>*>(p + i) = v;
  }
}

// Calls f(std::integral_constant<int, VEC>{}) with 16-byte packs where the
// chunk's rows and the bias allow them, else single values.
template <typename scalar_t, typename F>
void dispatch_vec(const LceChunk<scalar_t>& c, const F& f) {
  constexpr int kPack = pack_size<scalar_t>();
  if (c.cols % kPack == 0 && c.ld % kPack == 0 && aligned_for_packs({c.logits, c.bias})) {
    f(std::integral_constant<int, kPack>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& input) {
    return c10::cuda::CUDAGuard(input.device());
  }

  static bool capturing() {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
           c10::cuda::CaptureStatus::None;
  }

  // The device's memory less what this process's caching allocator has
  // handed out: the allocator's own view, with no driver call on the way to
  // the first GEMM.  Memory other processes hold is not seen.
  static uint64_t free_bytes(const at::Tensor& input) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(input.get_device());
    // Index 0: the aggregate over the allocator's pools.
    const int64_t used = std::max<int64_t>(stats.allocated_bytes[0].current, 0);
    const uint64_t total = total_bytes(input.get_device());
    return total > static_cast<uint64_t>(used) ? total - static_cast<uint64_t>(used) : 0;
  }

  // The device's memory, asked of the driver once per device (the caller's
  // device guard makes it the current device).
  static uint64_t total_bytes(c10::DeviceIndex device) {
    static std::mutex mu;
    static std::unordered_map<int, uint64_t> totals;
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = totals.find(device);
    if (it != totals.end()) {
      return it->second;
    }
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    totals.emplace(device, static_cast<uint64_t>(total));
    return total;
  }

  // TORCHOPS_LCE_TARGET_CHECK=sync (the default): one reduction and a host
  // sync, so a bad target is a RuntimeError naming the op and the position.
  // With `nan`, or while a CUDA graph is captured (where a sync is illegal),
  // the stats pass makes such a token's loss NaN instead; no kernel ever
  // reads outside the row for it.
  static void check_targets(const at::Tensor& t, const LceParams& p) {
    if (t.numel() == 0 || capturing() ||
        env::value_at(env::kLceTargetCheck,
                      env::choice("fused_linear_cross_entropy", env::kLceTargetCheck), "nan")) {
      return;
    }
    const at::Tensor bad =
        t.ne(p.ignore_index).logical_and(t.lt(0).logical_or(t.ge(p.vocab_total)));
    if (!bad.any().item<bool>()) {
      return;
    }
    const int64_t i = bad.nonzero().select(1, 0).min().item<int64_t>();
    TORCH_CHECK(false, "torchops.fused_linear_cross_entropy: expected every 'target' to be a "
                "class in [0, ", p.vocab_total, ") or ignore_index (", p.ignore_index,
                "), but target[", i, "] is ", t.select(0, i).item<int64_t>());
  }

  static void scale(const at::Tensor& t, const at::Tensor& s) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, t.scalar_type(), "torchops.fused_linear_cross_entropy", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* p = t.mutable_data_ptr<scalar_t>();
          const acc_t* sp = s.const_data_ptr<acc_t>();
          const int64_t n = t.numel();
          constexpr int kPack = pack_size<scalar_t>();
          const int threads = 256;
          if (n % kPack == 0 && aligned_for_packs({p})) {
            scale_kernel<scalar_t, kPack><<<grid_for(n / kPack, threads), threads, 0,
                                            current_stream()>>>(p, n, sp);
          } else {
            scale_kernel<scalar_t, 1><<<grid_for(n, threads), threads, 0, current_stream()>>>(
                p, n, sp);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  template <typename scalar_t>
  static void stats(const LceChunk<scalar_t>& c, at::opmath_type<scalar_t>* out) {
    using acc_t = at::opmath_type<scalar_t>;
    const auto cc = cap_consts<acc_t>(c.p);
    const bool want_sum = c.p.want_sum;
    dispatch_vec(c, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      dispatch_lce_cap(c.p.has_cap, [&](auto has_cap) {
        constexpr bool kCap = decltype(has_cap)::value;
        stats_kernel<scalar_t, VEC, kCap>
            <<<static_cast<unsigned int>(c.rows), threads_for(c.cols, VEC), 0,
               current_stream()>>>(c, out, cc, want_sum);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }

  template <typename scalar_t>
  static void grad(const LceChunk<scalar_t>& c, const at::opmath_type<scalar_t>* lse,
                   int64_t lse_stride, const at::opmath_type<scalar_t>* scale) {
    using acc_t = at::opmath_type<scalar_t>;
    const auto cc = cap_consts<acc_t>(c.p);
    dispatch_vec(c, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      dispatch_lce_cap(c.p.has_cap, [&](auto has_cap) {
        constexpr bool kCap = decltype(has_cap)::value;
        grad_kernel<scalar_t, VEC, kCap>
            <<<static_cast<unsigned int>(c.rows), threads_for(c.cols, VEC), 0,
               current_stream()>>>(c, lse, lse_stride, scale, cc);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
};

}  // namespace

TORCHOPS_REGISTER_LCE(CUDA, CudaKernels)

}  // namespace torchops::cuda
