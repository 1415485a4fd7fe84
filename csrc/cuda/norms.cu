// CUDA kernels of the norm ops (common/norms_steps.h has the host steps).
//
// A row is normalised by a group of T threads (a power of two from 32 up,
// the least that keeps the row in registers at a few chunks a thread, at
// most 256 in the forward and 512 in the backward; R = 256 / T groups share
// a block when T < 256).  A chunk is VEC elements,
// 16 bytes, moved by one vector instruction when every pointer is aligned
// and D is a multiple of VEC (else VEC = 1).  Rows too long for the
// registers loop over memory instead (the second read mostly hits L2).
// Sums are in the accumulation type: warp shuffles, then the group's warps
// through shared memory, in a fixed order.
//
// The backward writes dx row by row from the saved statistics, and sums the
// weight and bias gradients per row group into float partials [slots, D],
// which a column kernel reduces in order: no atomics, the same bits on every
// run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/norms_steps.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

// Chunks a thread keeps in registers, and the largest row group, of the
// forward and the backward (which holds twice the forward's values per chunk,
// the weight and bias sums included, so keeps fewer chunks).
constexpr int kForwardItems = 4;
constexpr int kForwardMaxThreads = 256;
constexpr int kBackwardItems = 2;
constexpr int kBackwardMaxThreads = 512;
// Threads of a block of small row groups.
constexpr int kBlockThreads = 256;

template <typename A>
__device__ __forceinline__ A inv_sqrt(A v) {
  if constexpr (std::is_same_v<A, float>) {
    return rsqrtf(v);
  } else {
    return A(1) / sqrt(v);
  }
}

template <int VEC, typename T, typename A>
__device__ __forceinline__ void load_chunk(const T* p, int64_t c, A (&v)[VEC]) {
  const Pack<T, VEC> pk = reinterpret_cast<const Pack<T, VEC>*>(p)[c];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    v[k] = static_cast<A>(pk.v[k]);
  }
}

template <int VEC, typename T, typename A>
__device__ __forceinline__ void store_chunk(T* p, int64_t c, const A (&v)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    pk.v[k] = static_cast<T>(v[k]);
  }
  reinterpret_cast<Pack<T, VEC>*>(p)[c] = pk;
}

// Sums over the blockDim.x threads of this row group, in every one of them:
// warp shuffles, then the group's warps through shared memory.  Every thread
// of the block makes the same calls (they __syncthreads).  `red` holds two
// buffers that successive calls alternate (`phase` counts the calls), so one
// barrier per call suffices: a buffer is written again only after the next
// call's barrier, which every thread reaches after reading it.
template <typename A, int N>
struct GroupReduce {
  A (*red)[N][32];
  int phase = 0;

  __device__ __forceinline__ void sum(A (&v)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
      }
    }
    const int warps = blockDim.x / 32;
    if (warps > 1) {
      A(&buf)[N][32] = red[phase];
      phase ^= 1;
      const int base = threadIdx.y * warps;
      if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) buf[i][base + threadIdx.x / 32] = v[i];
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < N; ++i) {
        v[i] = A(0);
        for (int w = 0; w < warps; ++w) {
          v[i] += buf[i][base + w];
        }
      }
    }
  }

  __device__ __forceinline__ A sum1(A v) {
    A t[N] = {};
    t[0] = v;
    sum(t);
    return t[0];
  }
};

template <NormKind kind, bool kAdd, int VEC, typename T, typename W, typename A>
__global__ void __launch_bounds__(kForwardMaxThreads)
    norm_forward_kernel(const NormForwardArgs<T, W, A> a) {
  constexpr int kItems = kForwardItems;
  __shared__ A red[2][1][32];
  GroupReduce<A, 1> reduce{red};
  const int64_t D = a.cols;
  const int64_t nch = D / VEC;
  const int threads = blockDim.x;
  const int tx = threadIdx.x;
  const int R = blockDim.y;
  const bool cached = nch <= static_cast<int64_t>(threads) * kItems;
  const A inv_d = A(1) / static_cast<A>(D);
  for (int64_t g = blockIdx.x; g * R < a.rows; g += gridDim.x) {
    const int64_t row = g * R + threadIdx.y;
    const bool active = row < a.rows;
    const int64_t off = active ? row * D : 0;
    const T* x = a.x + off;
    // The row's values: x, or x + residual rounded to T (also written to sum).
    auto first = [&](int64_t c, A(&out)[VEC]) {
      load_chunk<VEC>(x, c, out);
      if constexpr (kAdd) {
        A r[VEC];
        load_chunk<VEC>(a.residual + off, c, r);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          out[k] = static_cast<A>(static_cast<T>(out[k] + r[k]));
        }
        store_chunk<VEC>(a.sum + off, c, out);
      }
    };
    auto again = [&](int64_t c, A(&out)[VEC]) {
      load_chunk<VEC>(kAdd ? a.sum + off : x, c, out);
    };
    A v[kItems][VEC];
    A s = 0;
    if (cached) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t c = tx + static_cast<int64_t>(j) * threads;
        if (active && c < nch) {
          first(c, v[j]);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            s += kind == NormKind::kRms ? v[j][k] * v[j][k] : v[j][k];
          }
        }
      }
    } else if (active) {
      for (int64_t c = tx; c < nch; c += threads) {
        A t[VEC];
        first(c, t);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          s += kind == NormKind::kRms ? t[k] * t[k] : t[k];
        }
      }
    }
    s = reduce.sum1(s);
    A mean = 0;
    A rstd;
    if constexpr (kind == NormKind::kLayerNorm) {
      mean = s * inv_d;
      A q = 0;
      if (cached) {
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const int64_t c = tx + static_cast<int64_t>(j) * threads;
          if (active && c < nch) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const A d = v[j][k] - mean;
              q += d * d;
            }
          }
        }
      } else if (active) {
        for (int64_t c = tx; c < nch; c += threads) {
          A t[VEC];
          again(c, t);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const A d = t[k] - mean;
            q += d * d;
          }
        }
      }
      q = reduce.sum1(q);
      rstd = inv_sqrt(q * inv_d + a.eps);
    } else {
      rstd = inv_sqrt(s * inv_d + a.eps);
    }
    if (active && tx == 0) {
      if (a.mean != nullptr) a.mean[row] = mean;
      if (a.rstd != nullptr) a.rstd[row] = rstd;
    }
    auto write = [&](int64_t c, const A(&in)[VEC]) {
      A y[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[k] = (in[k] - mean) * rstd;
      }
      if (a.weight != nullptr) {
        A w[VEC];
        load_chunk<VEC>(a.weight, c, w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) y[k] *= w[k];
      }
      if (a.bias != nullptr) {
        A b[VEC];
        load_chunk<VEC>(a.bias, c, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) y[k] += b[k];
      }
      store_chunk<VEC>(a.y + off, c, y);
    };
    if (cached) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t c = tx + static_cast<int64_t>(j) * threads;
        if (active && c < nch) {
          write(c, v[j]);
        }
      }
    } else if (active) {
      for (int64_t c = tx; c < nch; c += threads) {
        A t[VEC];
        again(c, t);
        write(c, t);
      }
    }
  }
}

// dx of each row, and the row group's sums of grad * xhat and grad into its
// slot (blockIdx.x * blockDim.y + threadIdx.y) of part_w / part_b.
template <NormKind kind, int VEC, typename T, typename W, typename A>
__global__ void __launch_bounds__(kBackwardMaxThreads)
    norm_backward_kernel(const NormBackwardArgs<T, W, A> a, A* part_w, A* part_b) {
  constexpr int kItems = kBackwardItems;
  constexpr int kSums = kind == NormKind::kLayerNorm ? 2 : 1;
  __shared__ A red[2][kSums][32];
  GroupReduce<A, kSums> reduce{red};
  const int64_t D = a.cols;
  const int64_t nch = D / VEC;
  const int threads = blockDim.x;
  const int tx = threadIdx.x;
  const int R = blockDim.y;
  const bool cached = nch <= static_cast<int64_t>(threads) * kItems;
  const A inv_d = A(1) / static_cast<A>(D);
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * R + threadIdx.y;
  A* pw = part_w != nullptr ? part_w + slot * D : nullptr;
  A* pb = part_b != nullptr ? part_b + slot * D : nullptr;
  // The bias gradient's accumulators exist for layer_norm only (kBiasAcc).
  constexpr int kBiasAcc = kind == NormKind::kLayerNorm ? kItems : 1;
  A acc_w[kItems][VEC];
  A acc_b[kBiasAcc][VEC];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_w[j][k] = A(0);
    }
  }
#pragma unroll
  for (int j = 0; j < kBiasAcc; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_b[j][k] = A(0);
    }
  }
  if (!cached) {
    // This thread's chunks of the slot are its own for the whole kernel.
    for (int64_t c = tx; c < nch; c += threads) {
      for (int k = 0; k < VEC; ++k) {
        if (pw != nullptr) pw[c * VEC + k] = A(0);
        if (pb != nullptr) pb[c * VEC + k] = A(0);
      }
    }
  }
  for (int64_t g = blockIdx.x; g * R < a.rows; g += gridDim.x) {
    const int64_t row = g * R + threadIdx.y;
    const bool active = row < a.rows;
    const int64_t off = active ? row * D : 0;
    const A mean = (kind == NormKind::kLayerNorm && active) ? a.mean[row] : A(0);
    const A rstd = active ? a.rstd[row] : A(0);
    // xhat and grad * weight of a chunk.
    auto load = [&](int64_t c, A(&xh)[VEC], A(&gr)[VEC], A(&gw)[VEC]) {
      load_chunk<VEC>(a.x + off, c, xh);
      load_chunk<VEC>(a.grad + off, c, gr);
      A w[VEC];
      if (a.weight != nullptr) {
        load_chunk<VEC>(a.weight, c, w);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        xh[k] = (xh[k] - mean) * rstd;
        gw[k] = a.weight != nullptr ? gr[k] * w[k] : gr[k];
      }
    };
    A xh[kItems][VEC];
    A gw[kItems][VEC];
    A s1 = 0;  // sum of gw * xhat
    A s2 = 0;  // sum of gw
    if (cached) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t c = tx + static_cast<int64_t>(j) * threads;
        if (active && c < nch) {
          A gr[VEC];
          load(c, xh[j], gr, gw[j]);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            acc_w[j][k] += gr[k] * xh[j][k];
            if constexpr (kind == NormKind::kLayerNorm) {
              acc_b[j][k] += gr[k];
            }
            s1 += gw[j][k] * xh[j][k];
            s2 += gw[j][k];
          }
        }
      }
    } else if (active) {
      for (int64_t c = tx; c < nch; c += threads) {
        A x1[VEC], gr[VEC], g1[VEC];
        load(c, x1, gr, g1);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if (pw != nullptr) pw[c * VEC + k] += gr[k] * x1[k];
          if (pb != nullptr) pb[c * VEC + k] += gr[k];
          s1 += g1[k] * x1[k];
          s2 += g1[k];
        }
      }
    }
    if (a.dx == nullptr) {
      continue;  // uniform over the block: every thread skips the same sums
    }
    A sums[kSums];
    sums[0] = s1;
    if constexpr (kSums > 1) {
      sums[1] = s2;
    }
    reduce.sum(sums);
    const A c1 = sums[0] * inv_d;
    const A c2 = kSums > 1 ? sums[kSums - 1] * inv_d : A(0);
    auto write = [&](int64_t c, const A(&x1)[VEC], const A(&g1)[VEC]) {
      A d[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        d[k] = rstd * (g1[k] - c2 - x1[k] * c1);
      }
      store_chunk<VEC>(a.dx + off, c, d);
    };
    if (cached) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t c = tx + static_cast<int64_t>(j) * threads;
        if (active && c < nch) {
          write(c, xh[j], gw[j]);
        }
      }
    } else if (active) {
      for (int64_t c = tx; c < nch; c += threads) {
        A x1[VEC], gr[VEC], g1[VEC];
        load(c, x1, gr, g1);
        write(c, x1, g1);
      }
    }
  }
  if (cached) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t c = tx + static_cast<int64_t>(j) * threads;
      if (c < nch) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if (pw != nullptr) pw[c * VEC + k] = acc_w[j][k];
          if constexpr (kind == NormKind::kLayerNorm) {
            if (pb != nullptr) pb[c * VEC + k] = acc_b[j][k];
          }
        }
      }
    }
  }
}

// out[col] = sum over slots of part[slot, col], in slot order within each of
// the 32 row lanes, then over the lanes in order.  Block (32, 32).
template <typename A>
__global__ void column_sum_kernel(const A* part, int64_t slots, int64_t D, A* out) {
  __shared__ A sums[32][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (col < D) {
    for (int64_t p = threadIdx.y; p < slots; p += 32) {
      s += part[p * D + col];
    }
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    A t = 0;
    for (int i = 0; i < 32; ++i) {
      t += sums[i][threadIdx.x];
    }
    out[col] = t;
  }
}

// The launch shape of a row length: threads per row group and groups per block.
struct RowLayout {
  int threads;
  int groups;
};

inline RowLayout row_layout(int64_t chunks, int items, int max_threads) {
  int t = 32;
  while (t < max_threads && static_cast<int64_t>(t) * items < chunks) {
    t *= 2;
  }
  return {t, std::max(1, kBlockThreads / t)};
}

// Whether the 16-byte path applies: D a multiple of VEC and every pointer
// aligned to a chunk of its type.
template <int VEC>
bool vector_ok(int64_t D, std::initializer_list<std::pair<const void*, size_t>> ptrs) {
  if (VEC == 1 || D % VEC != 0) {
    return false;
  }
  for (const auto& [p, elem] : ptrs) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % (elem * VEC) != 0) {
      return false;
    }
  }
  return true;
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& t) {
    return c10::cuda::CUDAGuard(t.device());
  }

  template <NormKind kind, typename T, typename W, typename A>
  static void forward(const NormForwardArgs<T, W, A>& a) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vector_ok<kVec>(
        a.cols, {{a.x, sizeof(T)}, {a.residual, sizeof(T)}, {a.y, sizeof(T)},
                 {a.sum, sizeof(T)}, {a.weight, sizeof(W)}, {a.bias, sizeof(W)}});
    const RowLayout l =
        row_layout(vec ? a.cols / kVec : a.cols, kForwardItems, kForwardMaxThreads);
    const int64_t groups = ceil_div(a.rows, l.groups);
    const auto grid = static_cast<unsigned int>(std::min<int64_t>(groups, int64_t{1} << 20));
    const dim3 block(l.threads, l.groups);
    auto launch = [&](auto vec_c, auto add_c) {
      constexpr int V = decltype(vec_c)::value;
      constexpr bool kAdd = decltype(add_c)::value;
      norm_forward_kernel<kind, kAdd, V, T, W, A><<<grid, block, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    using One = std::integral_constant<int, 1>;
    using Vec = std::integral_constant<int, kVec>;
    if constexpr (kind == NormKind::kRms) {
      if (a.residual != nullptr) {
        vec ? launch(Vec{}, std::true_type{}) : launch(One{}, std::true_type{});
        return;
      }
    }
    vec ? launch(Vec{}, std::false_type{}) : launch(One{}, std::false_type{});
  }

  template <NormKind kind, typename T, typename W, typename A>
  static void backward(const NormBackwardArgs<T, W, A>& a) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vector_ok<kVec>(a.cols, {{a.x, sizeof(T)}, {a.grad, sizeof(T)},
                                              {a.dx, sizeof(T)}, {a.weight, sizeof(W)}});
    const RowLayout l =
        row_layout(vec ? a.cols / kVec : a.cols, kBackwardItems, kBackwardMaxThreads);
    const int64_t groups = ceil_div(a.rows, l.groups);
    const dim3 block(l.threads, l.groups);
    const auto kernel = vec ? &norm_backward_kernel<kind, kVec, T, W, A>
                            : &norm_backward_kernel<kind, 1, T, W, A>;
    // One wave of resident blocks, each looping over its rows: the fewest
    // partial sums of the parameter gradients that keep the device busy.
    const int per_sm = resident_blocks(kernel, static_cast<int>(block.x * block.y));
    const int64_t wave = static_cast<int64_t>(sm_count_current()) * per_sm;
    const auto grid = static_cast<unsigned int>(std::max<int64_t>(1, std::min(groups, wave)));
    const int64_t slots = static_cast<int64_t>(grid) * l.groups;
    const auto acc_options =
        at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value).device(
            at::kCUDA, c10::cuda::current_device());
    at::Tensor part_w, part_b;
    if (a.dweight != nullptr) part_w = at::empty({slots, a.cols}, acc_options);
    if (a.dbias != nullptr) part_b = at::empty({slots, a.cols}, acc_options);
    A* pw = part_w.defined() ? part_w.mutable_data_ptr<A>() : nullptr;
    A* pb = part_b.defined() ? part_b.mutable_data_ptr<A>() : nullptr;
    kernel<<<grid, block, 0, current_stream()>>>(a, pw, pb);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const dim3 col_block(32, 32);
    const auto col_grid = static_cast<unsigned int>(ceil_div(a.cols, 32));
    if (pw != nullptr) {
      column_sum_kernel<A><<<col_grid, col_block, 0, current_stream()>>>(pw, slots, a.cols,
                                                                         a.dweight);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (pb != nullptr) {
      column_sum_kernel<A><<<col_grid, col_block, 0, current_stream()>>>(pb, slots, a.cols,
                                                                         a.dbias);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  static int sm_count_current() {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                          c10::cuda::current_device()));
    return std::max(sms, 1);
  }
};

}  // namespace

TORCHOPS_REGISTER_NORMS(CUDA, CudaKernels)

}  // namespace torchops::cuda
