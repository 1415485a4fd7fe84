// CUDA kernels of torchops.box_iou and its backward.
//
// Forward: a thread per column box (kept in registers), blocks of rows staged
// in shared memory; output rows are written coalesced.
//
// Backward, deterministic (no atomics), each gradient reduced over the other
// box set in two passes:
//  * boxes1: a warp per row box, lanes striding over the columns (coalesced
//    reads of the row of `grad`); long rows are split into chunks over
//    grid.y, each writing a partial sum;
//  * boxes2: a thread per column box, looping over a chunk of rows (grid.y)
//    staged in shared memory, reads of `grad` coalesced along the row;
//  then a small kernel adds the partial sums in a fixed order.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common/box_iou.h"
#include "common/register_kernels.h"
#include "cuda/common/elementwise.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 32;                 // forward: rows staged per pass
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kTargetWarps = 16384;   // backward: enough to fill a GPU
constexpr int64_t kTargetThreads = 1 << 19;

// A box of a (K, 4) tensor with strides (s0, s1), in the op math type.
template <typename T, typename scalar_t>
__device__ inline Box<T> load_box(const scalar_t* p, int64_t i, int64_t s0,
                                  int64_t s1) {
  const scalar_t* row = p + i * s0;
  return {static_cast<T>(row[0]), static_cast<T>(row[s1]),
          static_cast<T>(row[2 * s1]), static_cast<T>(row[3 * s1])};
}

template <typename T>
__device__ inline T area_of(const Box<T>& b) {
  return box_area(b.x1, b.y1, b.x2, b.y2);
}

struct BoxesArg {
  int64_t n, s0, s1;
};

// Boxes i0 .. i0 + count of `b` (count <= the block size) into shared
// memory with their areas, one per thread, then a barrier: the row tile
// every column thread of the block reads.  All threads must call it.
template <typename scalar_t, typename T>
__device__ inline void load_row_tile(const scalar_t* __restrict__ b,
                                     const BoxesArg& a, int64_t i0, int count,
                                     Box<T>* rows, T* row_area) {
  if (threadIdx.x < count) {
    const Box<T> r = load_box<T>(b, i0 + threadIdx.x, a.s0, a.s1);
    rows[threadIdx.x] = r;
    row_area[threadIdx.x] = area_of(r);
  }
  __syncthreads();
}

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kThreads) box_iou_kernel(
    const scalar_t* __restrict__ b1, BoxesArg a1,
    const scalar_t* __restrict__ b2, BoxesArg a2, scalar_t* __restrict__ out) {
  __shared__ Box<T> rows[kRows];
  __shared__ T row_area[kRows];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t m = a2.n;
  Box<T> col{};
  T col_area = 0;
  if (j < m) {
    col = load_box<T>(b2, j, a2.s0, a2.s1);
    col_area = area_of(col);
  }
  for (int64_t i0 = static_cast<int64_t>(blockIdx.y) * kRows; i0 < a1.n;
       i0 += static_cast<int64_t>(gridDim.y) * kRows) {
    const int count = static_cast<int>(min_of<int64_t>(kRows, a1.n - i0));
    load_row_tile(b1, a1, i0, count, rows, row_area);
    if (j < m) {
      for (int r = 0; r < count; ++r) {
        const Box<T>& a = rows[r];
        const T inter = box_intersection(a.x1, a.y1, a.x2, a.y2, col.x1,
                                         col.y1, col.x2, col.y2);
        out[(i0 + r) * m + j] =
            static_cast<scalar_t>(iou_of(inter, row_area[r], col_area));
      }
    }
    __syncthreads();
  }
}

// partial[(chunk * n + i) * 4 + k] = sum over the chunk's columns j of
// d iou(i, j) / d boxes1[i, k] * grad[i, j].
template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kThreads) grad_boxes1_kernel(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ b1,
    BoxesArg a1, const scalar_t* __restrict__ b2, BoxesArg a2,
    int64_t chunk, T* __restrict__ partial) {
  const int lane = threadIdx.x % 32;
  const int64_t m = a2.n;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t j1 = min_of(m, j0 + chunk);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                   threadIdx.x / 32;
       i < a1.n; i += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const Box<T> a = load_box<T>(b1, i, a1.s0, a1.s1);
    const T area_a = area_of(a);
    T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t j = j0 + lane; j < j1; j += 32) {
      const Box<T> b = load_box<T>(b2, j, a2.s0, a2.s1);
      const BoxPairGrad<T> d = box_iou_pair_grad(
          static_cast<T>(grad[i * m + j]), a, b, area_a, area_of(b));
      s0 += d.a.x1;
      s1 += d.a.y1;
      s2 += d.a.x2;
      s3 += d.a.y2;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, offset);
      s1 += __shfl_xor_sync(0xffffffffu, s1, offset);
      s2 += __shfl_xor_sync(0xffffffffu, s2, offset);
      s3 += __shfl_xor_sync(0xffffffffu, s3, offset);
    }
    if (lane == 0) {
      T* p = partial + (static_cast<int64_t>(blockIdx.y) * a1.n + i) * 4;
      p[0] = s0;
      p[1] = s1;
      p[2] = s2;
      p[3] = s3;
    }
  }
}

// partial[(chunk * m + j) * 4 + k] = sum over the chunk's rows i of
// d iou(i, j) / d boxes2[j, k] * grad[i, j].
template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kThreads) grad_boxes2_kernel(
    const scalar_t* __restrict__ grad, const scalar_t* __restrict__ b1,
    BoxesArg a1, const scalar_t* __restrict__ b2, BoxesArg a2,
    int64_t chunk, T* __restrict__ partial) {
  __shared__ Box<T> rows[kThreads];
  __shared__ T row_area[kThreads];
  const int64_t m = a2.n;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t i_begin = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t i_end = min_of(a1.n, i_begin + chunk);
  Box<T> b{};
  T area_b = 0;
  if (j < m) {
    b = load_box<T>(b2, j, a2.s0, a2.s1);
    area_b = area_of(b);
  }
  T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t i0 = i_begin; i0 < i_end; i0 += kThreads) {
    const int count = static_cast<int>(min_of<int64_t>(kThreads, i_end - i0));
    load_row_tile(b1, a1, i0, count, rows, row_area);
    if (j < m) {
      for (int r = 0; r < count; ++r) {
        const BoxPairGrad<T> d = box_iou_pair_grad(
            static_cast<T>(grad[(i0 + r) * m + j]), rows[r], b, row_area[r],
            area_b);
        s0 += d.b.x1;
        s1 += d.b.y1;
        s2 += d.b.x2;
        s3 += d.b.y2;
      }
    }
    __syncthreads();
  }
  if (j < m) {
    T* p = partial + (static_cast<int64_t>(blockIdx.y) * m + j) * 4;
    p[0] = s0;
    p[1] = s1;
    p[2] = s2;
    p[3] = s3;
  }
}

// out[x] = sum over chunks c of partial[c * len + x], in chunk order.
template <typename scalar_t, typename T>
void sum_partials(const at::Tensor& partial, int64_t chunks, at::Tensor& out) {
  const T* p = partial.const_data_ptr<T>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t len = out.numel();
  launch_elementwise(len, [=] __device__(int64_t x) {
    T s = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      s += p[c * len + x];
    }
    o[x] = static_cast<scalar_t>(s);
  });
}

BoxesArg arg_of(const at::Tensor& boxes) {
  return {boxes.size(0), boxes.stride(0), boxes.stride(1)};
}

at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  check_box_iou(boxes1, boxes2, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(boxes1.device());
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  at::Tensor out = new_output("box_iou", {n, m}, boxes1.options());
  if (out.numel() == 0) {
    return out;
  }
  const dim3 grid(static_cast<unsigned int>(ceil_div(m, kThreads)),
                  static_cast<unsigned int>(
                      std::min<int64_t>(ceil_div(n, kRows), kMaxGridY)));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes1.scalar_type(), "torchops.box_iou", [&] {
        using T = at::opmath_type<scalar_t>;
        box_iou_kernel<scalar_t, T><<<grid, kThreads, 0, current_stream()>>>(
            boxes1.const_data_ptr<scalar_t>(), arg_of(boxes1),
            boxes2.const_data_ptr<scalar_t>(), arg_of(boxes2),
            out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> box_iou_backward(
    const at::Tensor& grad_in, const at::Tensor& boxes1,
    const at::Tensor& boxes2) {
  check_box_iou_backward(grad_in, boxes1, boxes2, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(boxes1.device());
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  at::Tensor grad1 = at::empty({n, 4}, boxes1.options());
  at::Tensor grad2 = at::empty({m, 4}, boxes2.options());
  if (n == 0 || m == 0) {
    return {grad1.zero_(), grad2.zero_()};
  }
  const at::Tensor grad = grad_in.contiguous();
  // Chunks: enough warps / threads to fill the GPU, but at least a few
  // hundred pairs per warp or thread.
  const int64_t col_chunks = std::min<int64_t>(
      {std::max<int64_t>(1, ceil_div(kTargetWarps, n)), ceil_div(m, 256),
       kMaxGridY});
  const int64_t col_chunk = ceil_div(m, col_chunks);
  const int64_t row_chunks = std::min<int64_t>(
      {std::max<int64_t>(1, ceil_div(kTargetThreads, m)), ceil_div(n, 256),
       kMaxGridY});
  const int64_t row_chunk = ceil_div(n, row_chunks);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes1.scalar_type(),
      "torchops._box_iou_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        const auto acc = boxes1.options().dtype(c10::CppTypeToScalarType<T>::value);
        at::Tensor partial1 = at::empty({col_chunks, n, 4}, acc);
        at::Tensor partial2 = at::empty({row_chunks, m, 4}, acc);
        const dim3 grid1(
            static_cast<unsigned int>(std::min<int64_t>(
                ceil_div(n, kWarpsPerBlock), 65535LL * 32)),
            static_cast<unsigned int>(col_chunks));
        grad_boxes1_kernel<scalar_t, T><<<grid1, kThreads, 0, current_stream()>>>(
            grad.const_data_ptr<scalar_t>(), boxes1.const_data_ptr<scalar_t>(),
            arg_of(boxes1), boxes2.const_data_ptr<scalar_t>(), arg_of(boxes2),
            col_chunk, partial1.mutable_data_ptr<T>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const dim3 grid2(static_cast<unsigned int>(ceil_div(m, kThreads)),
                         static_cast<unsigned int>(row_chunks));
        grad_boxes2_kernel<scalar_t, T><<<grid2, kThreads, 0, current_stream()>>>(
            grad.const_data_ptr<scalar_t>(), boxes1.const_data_ptr<scalar_t>(),
            arg_of(boxes1), boxes2.const_data_ptr<scalar_t>(), arg_of(boxes2),
            row_chunk, partial2.mutable_data_ptr<T>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        sum_partials<scalar_t, T>(partial1, col_chunks, grad1);
        sum_partials<scalar_t, T>(partial2, row_chunks, grad2);
      });
  return {grad1, grad2};
}

}  // namespace

TORCHOPS_REGISTER_KERNELS(CUDA, box_iou)

}  // namespace torchops::cuda
