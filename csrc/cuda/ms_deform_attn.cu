// CUDA kernels of torchops.ms_deform_attn and its backward.
//
// Forward: a thread per (batch, query, head, V channels), V the widest
// 16-byte pack that divides C (4 floats, 8 halves): the threads of one output
// row read each corner's C contiguous values together (coalesced), and each
// computes the sample's bilinear weights once for its V channels.
//
// Backward: `lanes` threads per (batch, query, head) row (a power of two, at
// most 32, aligned in the warp), each taking every lanes-th pack of V
// channels.  Each thread adds its share of value's gradient with atomics
// (into a float32 buffer for the half types, rounded once at the end), and
// the row's threads sum the locations' and weights' gradients over C with
// warp shuffles in a fixed pattern.  Under
// torch.use_deterministic_algorithms(True) the same kernel skips the atomics
// and value's gradient is a gather instead (cuda/common/sorted_gather.cuh):
// each sample's four corner contributions are listed, sorted stably by
// destination and summed in that fixed order; bitwise reproducible, at
// about 24 bytes of scratch per contribution (B * Q * heads * L * P * 4).
//
// spatial_shapes and level_start_index are read on the device, never copied
// to the host (no sync); msda_level bounds every read by value's S
// positions, whatever they hold.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "common/accumulate.h"
#include "common/ms_deform_attn_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/sorted_gather.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ MsdaLevel load_level(const int64_t* __restrict__ shapes,
                                                const int64_t* __restrict__ starts, int64_t l,
                                                int64_t spatial) {
  return msda_level(shapes[2 * l], shapes[2 * l + 1], starts[l], spatial);
}

// V consecutive values at p (aligned to the pack), converted to T.
template <int V, typename scalar_t, typename T>
__device__ __forceinline__ void load_pack(const scalar_t* p, T (&out)[V]) {
  const Pack<scalar_t, V> pk = *reinterpret_cast<const Pack<scalar_t, V>*>(p);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    out[v] = static_cast<T>(pk.v[v]);
  }
}

// p[v] += x[v] for v < V, each element atomically.  On sm_90 and newer a
// lane adds its pack with 16-byte (or 8-byte) float atomics, so a row's
// lanes update whole contiguous sectors in one instruction; elsewhere, and
// for double, one atomic per element.  p is aligned to the pack.
template <int V>
__device__ __forceinline__ void atomic_add_pack(float* p, const float (&x)[V]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      atomicAdd(reinterpret_cast<float4*>(p + j),
                make_float4(x[j], x[j + 1], x[j + 2], x[j + 3]));
    }
    return;
  } else if constexpr (V % 2 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      atomicAdd(reinterpret_cast<float2*>(p + j), make_float2(x[j], x[j + 1]));
    }
    return;
  }
#endif
#pragma unroll
  for (int v = 0; v < V; ++v) {
    atomicAdd(p + v, x[v]);
  }
}

template <int V>
__device__ __forceinline__ void atomic_add_pack(double* p, const double (&x)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    atomicAdd(p + v, x[v]);
  }
}

// out[row * C + g * V + v] for every (row, g) = (b, q, head, pack of V
// channels); value (B, S, heads, C), loc and attn (B, Q, heads, L, P[, 2]),
// out (B, Q, heads * C), all contiguous; C % V == 0.
template <typename scalar_t, int V>
__global__ void __launch_bounds__(kThreads) ms_deform_attn_forward_kernel(
    const scalar_t* __restrict__ value, const int64_t* __restrict__ shapes,
    const int64_t* __restrict__ starts, const scalar_t* __restrict__ loc,
    const scalar_t* __restrict__ attn, MsdaDims d, scalar_t* __restrict__ out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t groups = d.channels / V;
  const int64_t total = d.batch * d.queries * d.heads * groups;
  const int64_t pixel = d.heads * d.channels;  // value's stride between positions
  const int64_t lp = d.levels * d.points;
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t g = i % groups;
    const int64_t row = i / groups;  // (b, q, head)
    const int64_t h = row % d.heads;
    const int64_t b = row / (d.heads * d.queries);
    const scalar_t* lrow = loc + row * lp * 2;
    const scalar_t* arow = attn + row * lp;
    const scalar_t* first = value + b * d.spatial * pixel + h * d.channels + g * V;
    T acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      acc[v] = T(0);
    }
    for (int64_t l = 0; l < d.levels; ++l) {
      const MsdaLevel lv = load_level(shapes, starts, l, d.spatial);
      if (lv.rows == 0) {
        continue;  // nothing of this level lies inside value (lv.start unused)
      }
      const scalar_t* base = first + lv.start * pixel;
      for (int64_t p = 0; p < d.points; ++p) {
        const int64_t s = l * d.points + p;
        const MsdaTaps<T> t = msda_taps<T>(lv, static_cast<T>(lrow[2 * s]),
                                           static_cast<T>(lrow[2 * s + 1]));
        if (!t.any) {
          continue;
        }
        const T a = static_cast<T>(arow[s]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (t.pos[k] >= 0) {
            T x[V];
            load_pack<V>(base + t.pos[k] * pixel, x);
            const T w = a * t.weight[k];
#pragma unroll
            for (int v = 0; v < V; ++v) {
              acc[v] += w * x[v];
            }
          }
        }
      }
    }
    Pack<scalar_t, V> o;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      o.v[v] = static_cast<scalar_t>(acc[v]);
    }
    *reinterpret_cast<Pack<scalar_t, V>*>(out + row * d.channels + g * V) = o;
  }
}

// The gradients of sampling_locations and attention_weights (written by
// the first lane of each row), and with kScatter value's, added with
// atomics into grad_value (acc_t: float32 for the half types).  Every
// thread of a warp runs the same loop trips and shuffles (inactive tail
// threads included), so the full-mask shuffles are safe.
template <typename scalar_t, int V, bool kScatter, typename acc_t>
__global__ void __launch_bounds__(kThreads) ms_deform_attn_backward_kernel(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ value,
    const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
    const scalar_t* __restrict__ loc, const scalar_t* __restrict__ attn, MsdaDims d,
    int lanes, acc_t* __restrict__ grad_value, scalar_t* __restrict__ grad_loc,
    scalar_t* __restrict__ grad_attn) {
  using T = at::opmath_type<scalar_t>;
  const int64_t groups = d.channels / V;
  const int64_t total = d.batch * d.queries * d.heads * lanes;
  const int64_t pixel = d.heads * d.channels;
  const int64_t lp = d.levels * d.points;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base_i = static_cast<int64_t>(blockIdx.x) * blockDim.x; base_i < total;
       base_i += stride) {
    const int64_t i = base_i + threadIdx.x;
    const bool active = i < total;
    const int lane = static_cast<int>(i % lanes);
    const int64_t row = active ? i / lanes : 0;
    const int64_t h = row % d.heads;
    const int64_t b = row / (d.heads * d.queries);
    const scalar_t* g_row = grad + row * d.channels;
    const scalar_t* lrow = loc + row * lp * 2;
    const scalar_t* arow = attn + row * lp;
    const int64_t first = b * d.spatial * pixel + h * d.channels;
    for (int64_t l = 0; l < d.levels; ++l) {
      const MsdaLevel lv = load_level(shapes, starts, l, d.spatial);
      for (int64_t p = 0; p < d.points; ++p) {
        const int64_t s = l * d.points + p;
        T ga = T(0), gx = T(0), gy = T(0), a = T(0);
        if (active && lv.rows > 0) {
          const MsdaTaps<T> t = msda_taps<T>(lv, static_cast<T>(lrow[2 * s]),
                                             static_cast<T>(lrow[2 * s + 1]));
          a = static_cast<T>(arow[s]);
          if (t.any) {
            T dh[4], dw[4];
            msda_tap_slopes(t, dh, dw);
            for (int64_t cg = lane; cg < groups; cg += lanes) {
              T gv[V];
              load_pack<V>(g_row + cg * V, gv);
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                if (t.pos[k] < 0) {
                  continue;
                }
                const int64_t off = first + (lv.start + t.pos[k]) * pixel + cg * V;
                T x[V];
                load_pack<V>(value + off, x);
                T dk = T(0);
#pragma unroll
                for (int v = 0; v < V; ++v) {
                  dk += gv[v] * x[v];
                }
                ga += t.weight[k] * dk;
                gx += dw[k] * dk;
                gy += dh[k] * dk;
                if constexpr (kScatter) {
                  const T w = a * t.weight[k];
                  acc_t add[V];
#pragma unroll
                  for (int v = 0; v < V; ++v) {
                    add[v] = static_cast<acc_t>(w * gv[v]);
                  }
                  atomic_add_pack<V>(grad_value + off, add);
                }
              }
            }
          }
        }
        for (int o = lanes / 2; o > 0; o /= 2) {
          ga += __shfl_xor_sync(0xffffffffu, ga, o);
          gx += __shfl_xor_sync(0xffffffffu, gx, o);
          gy += __shfl_xor_sync(0xffffffffu, gy, o);
        }
        if (active && lane == 0 && lv.rows > 0) {
          const int64_t j = row * lp + s;
          grad_attn[j] = static_cast<scalar_t>(ga);
          grad_loc[2 * j] = static_cast<scalar_t>(a * static_cast<T>(lv.width) * gx);
          grad_loc[2 * j + 1] = static_cast<scalar_t>(a * static_cast<T>(lv.height) * gy);
        }
      }
    }
  }
}

// The deterministic backward's list: the four corner contributions of each
// sample i = (row, l, p), in slots 4 i .. 4 i + 3: destination (b, position,
// head) of value's gradient, source `row` of grad, weight attn * corner
// weight.  Corners outside keep their slots with the sentinel key
// `destinations` (sorted last, never gathered).
template <typename scalar_t, typename key_t>
__global__ void __launch_bounds__(kThreads) ms_deform_attn_contributions_kernel(
    const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
    const scalar_t* __restrict__ loc, const scalar_t* __restrict__ attn, MsdaDims d,
    int64_t destinations, key_t* __restrict__ keys,
    Contribution<at::opmath_type<scalar_t>, key_t>* __restrict__ entries) {
  using T = at::opmath_type<scalar_t>;
  const int64_t lp = d.levels * d.points;
  const int64_t samples = d.batch * d.queries * d.heads * lp;
  for (int64_t i = grid_start<int64_t>(); i < samples; i += grid_stride<int64_t>()) {
    const int64_t row = i / lp;
    const int64_t l = (i % lp) / d.points;
    const int64_t h = row % d.heads;
    const int64_t b = row / (d.heads * d.queries);
    const MsdaLevel lv = load_level(shapes, starts, l, d.spatial);
    const MsdaTaps<T> t =
        msda_taps<T>(lv, static_cast<T>(loc[2 * i]), static_cast<T>(loc[2 * i + 1]));
    const T a = static_cast<T>(attn[i]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const bool in = t.pos[k] >= 0;  // implies lv.rows > 0: lv.start is inside value
      keys[4 * i + k] = static_cast<key_t>(
          in ? (b * d.spatial + lv.start + t.pos[k]) * d.heads + h : destinations);
      entries[4 * i + k] = {static_cast<key_t>(row), in ? a * t.weight[k] : T(0)};
    }
  }
}

// Gather group i: kGroup channels of destination row i / chunks.
constexpr int kGroup = 8;

struct GradValueGroups {
  int64_t chunks, channels;
  template <typename index_t>
  __device__ __forceinline__ GatherGroup operator()(index_t i) const {
    const int64_t dest = static_cast<int64_t>(i) / chunks;
    const int64_t c0 = (static_cast<int64_t>(i) % chunks) * kGroup;
    const int64_t left = channels - c0;
    return {dest, c0, channels, 1, dest * channels + c0, 1,
            static_cast<int>(left < kGroup ? left : kGroup)};
  }
};

template <typename scalar_t>
void deterministic_grad_value(const at::Tensor& grad, const at::Tensor& shapes,
                              const at::Tensor& starts, const at::Tensor& loc,
                              const at::Tensor& attn, const MsdaDims& d,
                              at::Tensor& grad_value) {
  using T = at::opmath_type<scalar_t>;
  const int64_t rows = d.batch * d.queries * d.heads;
  const int64_t samples = rows * d.levels * d.points;
  TORCH_CHECK(samples <= (int64_t(1) << 38), "torchops._ms_deform_attn_backward: too many "
              "samples (", samples, ") for the deterministic backward");
  const int64_t destinations = d.batch * d.spatial * d.heads;
  auto run = [&](auto key) {
    using key_t = decltype(key);
    ContributionList<T, key_t> list(samples * 4, destinations,
                                    grad.options().dtype(at::kLong));
    ms_deform_attn_contributions_kernel<scalar_t, key_t>
        <<<grid_for(samples, kThreads), kThreads, 0, current_stream()>>>(
            shapes.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>(),
            loc.const_data_ptr<scalar_t>(), attn.const_data_ptr<scalar_t>(), d, destinations,
            list.key_data(), list.entry_data());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t chunks = ceil_div(d.channels, kGroup);
    sorted_gather<kGroup>(grad.const_data_ptr<scalar_t>(), list.sort(),
                          GradValueGroups{chunks, d.channels}, destinations * chunks,
                          grad_value.mutable_data_ptr<scalar_t>());
  };
  if (fits_int32(destinations + 1) && fits_int32(rows)) {
    run(int32_t{});
  } else {
    run(int64_t{});
  }
}

// The widest pack that divides C and that every pointer's alignment allows.
template <typename scalar_t, typename F>
void with_pack(int64_t channels, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kPack = pack_size<scalar_t>();
  if (channels % kPack == 0 && aligned_for_packs(ptrs)) {
    f(std::integral_constant<int, kPack>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& value) {
    return c10::cuda::CUDAGuard(value.device());
  }

  // Not checked here: the values live on the device (a check would sync);
  // the kernels bound every read instead.
  static void check_levels(const char*, const at::Tensor&, const at::Tensor&, int64_t) {}

  template <typename scalar_t>
  static void forward(const at::Tensor& value, const at::Tensor& shapes, const at::Tensor& starts,
                      const at::Tensor& loc, const at::Tensor& attn, const MsdaDims& d,
                      at::Tensor& out) {
    with_pack<scalar_t>(d.channels, {value.const_data_ptr(), out.const_data_ptr()}, [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int64_t total = d.batch * d.queries * d.heads * (d.channels / V);
      ms_deform_attn_forward_kernel<scalar_t, V>
          <<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
              value.const_data_ptr<scalar_t>(), shapes.const_data_ptr<int64_t>(),
              starts.const_data_ptr<int64_t>(), loc.const_data_ptr<scalar_t>(),
              attn.const_data_ptr<scalar_t>(), d, out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  template <typename scalar_t>
  static void backward(const at::Tensor& grad, const at::Tensor& value, const at::Tensor& shapes,
                       const at::Tensor& starts, const at::Tensor& loc, const at::Tensor& attn,
                       const MsdaDims& d, at::Tensor& grad_value, at::Tensor& grad_loc,
                       at::Tensor& grad_attn) {
    using acc_t = at::opmath_type<scalar_t>;  // float, or double for double
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    constexpr bool kNative = std::is_same_v<acc_t, scalar_t>;
    // The atomics' target: grad_value itself (float, double) or a float32
    // buffer (half types).
    at::Tensor target = grad_value;
    if (!deterministic && !kNative) {
      target = at::zeros(grad_value.sizes(), grad_value.options().dtype(at::kFloat));
    }
    with_pack<scalar_t>(d.channels, {value.const_data_ptr(), grad.const_data_ptr()},
                        [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int64_t groups = d.channels / V;
      int lanes = 1;
      while (lanes < 32 && lanes < groups) {
        lanes *= 2;
      }
      const int64_t total = d.batch * d.queries * d.heads * lanes;
      const unsigned int blocks = grid_for(total, kThreads);
      const auto launch = [&](auto scatter) {
        constexpr bool kScatter = decltype(scatter)::value;
        ms_deform_attn_backward_kernel<scalar_t, V, kScatter, acc_t>
            <<<blocks, kThreads, 0, current_stream()>>>(
                grad.const_data_ptr<scalar_t>(), value.const_data_ptr<scalar_t>(),
                shapes.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>(),
                loc.const_data_ptr<scalar_t>(), attn.const_data_ptr<scalar_t>(), d, lanes,
                kScatter ? target.mutable_data_ptr<acc_t>() : nullptr,
                grad_loc.mutable_data_ptr<scalar_t>(), grad_attn.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (deterministic) {
        launch(std::false_type{});
      } else {
        launch(std::true_type{});
      }
    });
    if (deterministic) {
      deterministic_grad_value<scalar_t>(grad, shapes, starts, loc, attn, d, grad_value);
    } else if (!kNative) {
      grad_value.copy_(target);
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CUDA, ms_deform_attn, CudaKernels)

}  // namespace torchops::cuda
