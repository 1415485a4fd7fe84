// CUDA kernels of torchops.multi_tensor_l2norm and torchops.multi_tensor_scale_:
// one launch covers many tensors (cuda/common/multi_tensor.cuh).  A tensor
// scale is read on the device: no host synchronisation.
//
// The norm is deterministic (no atomics): each block of the multi-tensor
// launch writes the sum of squares of its chunk to its own slot of a buffer
// (the chunks of every tensor in list order, so tensor i's chunks are the
// slots [first_i, first_i + chunks_i), known on the host); one more block
// sums all slots into the total, and, with per_tensor, one block per tensor
// sums that tensor's slots.  Every sum is a fixed assignment of slots to
// threads followed by block_sum's fixed tree.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "common/multi_tensor_norm.h"
#include "cuda/common/block_reduce.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/multi_tensor.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 512;
constexpr int kVec = 4;
constexpr int kUnroll = 4;
// Tensors per launch of the per-tensor reduction (its table stays well under
// the 4 KiB of kernel arguments).
constexpr int kSegments = 128;

using Table = MultiTensorTable<1>;

static_assert(kChunk % kVec == 0, "chunks keep the vector alignment");

template <typename T>
__device__ inline bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0;
}

// partial[base + blockIdx.x] = the sum of squares of the block's chunk.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    l2norm_chunks_kernel(Table t, norm_acc_t<scalar_t>* partial, int64_t base) {
  using acc_t = norm_acc_t<scalar_t>;
  const BlockChunk bc = block_chunk(t, kChunk);
  const scalar_t* x = static_cast<const scalar_t*>(t.ptr[0][bc.tensor]) + bc.begin;
  const int64_t len = bc.len;
  // kUnroll independent loads in flight per thread, each into its own sum.
  acc_t s[kUnroll] = {};
  int64_t done = 0;
  if (aligned<scalar_t>(x)) {
    using P = Pack<scalar_t, kVec>;
    const P* xp = reinterpret_cast<const P*>(x);
    const int64_t packs = len / kVec;
    const int64_t stride = blockDim.x;
    int64_t k = threadIdx.x;
    for (; k + (kUnroll - 1) * stride < packs; k += kUnroll * stride) {
      P p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        p[u] = xp[k + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const acc_t v = static_cast<acc_t>(p[u].v[e]);
          s[u] += v * v;
        }
      }
    }
    for (; k < packs; k += stride) {
      const P p = xp[k];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const acc_t v = static_cast<acc_t>(p.v[e]);
        s[0] += v * v;
      }
    }
    done = packs * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < len; j += blockDim.x) {
    const acc_t v = static_cast<acc_t>(x[j]);
    s[0] += v * v;
  }
  acc_t sum = s[0];
#pragma unroll
  for (int u = 1; u < kUnroll; ++u) {
    sum += s[u];
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    partial[base + blockIdx.x] = sum;
  }
}

// The slots of up to kSegments tensors: block b sums partial[first[b],
// first[b] + count[b]) into out[index[b]] (its square root).
struct Segments {
  int64_t first[kSegments];
  int64_t count[kSegments];
  int64_t index[kSegments];
};

static_assert(sizeof(Segments) <= 3584, "kernel arguments over 4 KiB");

template <typename acc_t>
__device__ inline acc_t slots_sum(const acc_t* partial, int64_t first, int64_t count) {
  acc_t s = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    s += partial[first + k];
  }
  return block_sum(s);
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    l2norm_per_tensor_kernel(const acc_t* partial, Segments seg, acc_t* out) {
  const acc_t s = slots_sum(partial, seg.first[blockIdx.x], seg.count[blockIdx.x]);
  if (threadIdx.x == 0) {
    out[seg.index[blockIdx.x]] = sqrt(s);
  }
}

// One block: *total = sqrt(the sum of partial[0, count)).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    l2norm_total_kernel(const acc_t* partial, int64_t count, acc_t* total) {
  const acc_t s = slots_sum(partial, 0, count);
  if (threadIdx.x == 0) {
    *total = sqrt(s);
  }
}

template <typename scalar_t>
void l2norm_launch(at::TensorList tensors, bool per_tensor, const at::Tensor& total,
                   const at::Tensor& per) {
  using acc_t = norm_acc_t<scalar_t>;
  const size_t n = tensors.size();
  int64_t slots = 0;
  for (size_t i = 0; i < n; ++i) {
    slots += ceil_div(tensors[i].numel(), kChunk);
  }
  const cudaStream_t stream = current_stream();
  if (slots == 0) {  // only empty tensors: total and per are zeros already
    return;
  }
  const at::Tensor partial = at::empty({slots}, total.options());
  acc_t* part = partial.mutable_data_ptr<acc_t>();
  int64_t base = 0;
  multi_tensor_apply<1>(
      kL2NormOp, n, kChunk,
      [&](size_t i, void** ptr) {
        ptr[0] = const_cast<void*>(tensors[i].const_data_ptr());
        return tensors[i].numel();
      },
      [&](const Table& t, int blocks) {
        l2norm_chunks_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(t, part, base);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        base += blocks;
      });
  TORCH_INTERNAL_ASSERT(base == slots, "multi_tensor_l2norm: ", base, " chunks for ", slots,
                        " slots");
  l2norm_total_kernel<acc_t><<<1, kThreads, 0, stream>>>(part, slots,
                                                         total.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!per_tensor) {
    return;
  }
  acc_t* out = per.mutable_data_ptr<acc_t>();
  Segments seg;
  int used = 0;
  int64_t first = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t chunks = ceil_div(tensors[i].numel(), kChunk);
    if (chunks == 0) {
      continue;  // its norm stays 0
    }
    seg.first[used] = first;
    seg.count[used] = chunks;
    seg.index[used] = static_cast<int64_t>(i);
    first += chunks;
    if (++used == kSegments) {
      l2norm_per_tensor_kernel<acc_t><<<used, kThreads, 0, stream>>>(part, seg, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      used = 0;
    }
  }
  if (used > 0) {
    l2norm_per_tensor_kernel<acc_t><<<used, kThreads, 0, stream>>>(part, seg, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor) {
  TORCH_CHECK(!tensors.empty(), "torchops.multi_tensor_l2norm: 'tensors' is empty (the "
              "wrapper torchops.multi_tensor_l2norm returns 0 for an empty list)");
  const at::ScalarType dtype =
      check_tensor_list(kL2NormOp, c10::DeviceType::CUDA, tensors, /*distinct=*/false);
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const at::TensorOptions out = tensors[0].options().dtype(norm_acc_type(dtype));
  // Zeros: the values of an all-empty list and of empty tensors' norms.
  const at::Tensor total = at::zeros({}, out);
  const at::Tensor per =
      at::zeros({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kL2NormOp, [&] {
    l2norm_launch<scalar_t>(tensors, per_tensor, total, per);
  });
  return {total, per};
}

// x = x * scale over the block's chunk, in acc_t.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) scale_kernel(Table t, ScaleArg arg) {
  using acc_t = norm_acc_t<scalar_t>;
  const BlockChunk bc = block_chunk(t, kChunk);
  scalar_t* x = static_cast<scalar_t*>(t.ptr[0][bc.tensor]) + bc.begin;
  const int64_t len = bc.len;
  const acc_t s = arg.get<acc_t>();
  int64_t done = 0;
  if (aligned<scalar_t>(x)) {
    using P = Pack<scalar_t, kVec>;
    P* xp = reinterpret_cast<P*>(x);
    const int64_t packs = len / kVec;
    const int64_t stride = blockDim.x;
    int64_t k = threadIdx.x;
    // kUnroll loads in flight before the stores (the compiler cannot move a
    // later load above an earlier store to the same array by itself).
    for (; k + (kUnroll - 1) * stride < packs; k += kUnroll * stride) {
      P p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        p[u] = xp[k + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          p[u].v[e] = static_cast<scalar_t>(static_cast<acc_t>(p[u].v[e]) * s);
        }
        xp[k + u * stride] = p[u];
      }
    }
    for (; k < packs; k += stride) {
      P p = xp[k];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        p.v[e] = static_cast<scalar_t>(static_cast<acc_t>(p.v[e]) * s);
      }
      xp[k] = p;
    }
    done = packs * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < len; j += blockDim.x) {
    x[j] = static_cast<scalar_t>(static_cast<acc_t>(x[j]) * s);
  }
}

void multi_tensor_scale_impl(at::TensorList tensors, const at::Tensor* scale_tensor,
                             double scale) {
  if (tensors.empty()) {
    return;
  }
  const at::ScalarType dtype =
      check_tensor_list(kScaleOp, c10::DeviceType::CUDA, tensors, /*distinct=*/true);
  ScaleArg arg{scale, nullptr, false};
  if (scale_tensor != nullptr) {
    check_scale_tensor(c10::DeviceType::CUDA, tensors[0], *scale_tensor);
    arg.tensor = scale_tensor->const_data_ptr();
    arg.is_double = scale_tensor->scalar_type() == at::kDouble;
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kScaleOp, [&] {
    multi_tensor_apply<1>(
        kScaleOp, tensors.size(), kChunk,
        [&](size_t i, void** ptr) {
          ptr[0] = tensors[i].mutable_data_ptr();
          return tensors[i].numel();
        },
        [&](const Table& t, int blocks) {
          scale_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(t, arg);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

}  // namespace

TORCHOPS_REGISTER_MULTI_TENSOR_NORM(CUDA, multi_tensor_l2norm, multi_tensor_scale_impl)

}  // namespace torchops::cuda
