// CUDA kernel of torchops.soft_nms (semantics in common/soft_nms.h).
//
// The selection is sequential, so one 1024-thread block runs it all: thread
// t owns boxes t, t + 1024, ... (their scores and live flags are read and
// written by that thread only).  A first pass converts the boxes and scores
// to the op math type and drops those below min_score; then each step is a
// block-wide argmax over the owners' best live boxes (ties: lower index), one
// output, and one pass in which every owner decays its live boxes by their
// IoU with the selected one, drops those falling below min_score and keeps
// its best for the next step.  At most N steps; the loop ends early once no
// box is live.  The one host sync reads the number of selections, to size
// the outputs.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "common/soft_nms.h"
#include "cuda/common/launch.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// (s, i) := the better of (s, i) and (s2, i2); index -1 is "none".
template <typename T>
__device__ __forceinline__ void take_better(T& s, int64_t& i, T s2, int64_t i2) {
  if (i2 >= 0 && (i < 0 || soft_nms_before(s2, i2, s, i))) {
    s = s2;
    i = i2;
  }
}

// The block's best (s, i), returned in every thread.  Every thread calls it;
// `ws`/`wi` are shared arrays of kWarps + 1 entries (the last holds the
// result).  The two barriers also order each step's reads of the previous
// call's result before the next call's writes.
template <typename T>
__device__ void block_best(T& s, int64_t& i, T* ws, int64_t* wi) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    const T s2 = __shfl_down_sync(kFullMask, s, offset);
    const int64_t i2 = __shfl_down_sync(kFullMask, i, offset);
    take_better(s, i, s2, i2);
  }
  if (lane == 0) {
    ws[warp] = s;
    wi[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    s = ws[lane];  // kWarps == 32: one entry per lane
    i = wi[lane];
    for (int offset = 16; offset > 0; offset /= 2) {
      const T s2 = __shfl_down_sync(kFullMask, s, offset);
      const int64_t i2 = __shfl_down_sync(kFullMask, i, offset);
      take_better(s, i, s2, i2);
    }
    if (lane == 0) {
      ws[kWarps] = s;
      wi[kWarps] = i;
    }
  }
  __syncthreads();
  s = ws[kWarps];
  i = wi[kWarps];
}

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kThreads) soft_nms_kernel(
    const scalar_t* __restrict__ boxes, int64_t b0, int64_t b1,
    const scalar_t* __restrict__ scores, int64_t s0, int64_t n, T threshold,
    T sigma, T min_score, bool gaussian, Box<T>* __restrict__ box_buf,
    T* __restrict__ score_buf, unsigned char* __restrict__ live,
    int64_t* __restrict__ keep, scalar_t* __restrict__ new_scores,
    int64_t* __restrict__ count) {
  static_assert(kWarps == 32, "block_best reduces one entry per lane");
  __shared__ T ws[kWarps + 1];
  __shared__ int64_t wi[kWarps + 1];
  T best_s = T(0);
  int64_t best_i = -1;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const scalar_t* row = boxes + j * b0;
    box_buf[j] = Box<T>{static_cast<T>(row[0]), static_cast<T>(row[b1]),
                        static_cast<T>(row[2 * b1]), static_cast<T>(row[3 * b1])};
    const T s = static_cast<T>(scores[j * s0]);
    score_buf[j] = s;
    const bool alive = s >= min_score;
    live[j] = alive;
    if (alive) {
      take_better(best_s, best_i, s, j);
    }
  }
  int64_t step = 0;
  for (; step < n; ++step) {
    // Its barriers also publish the first pass's box_buf writes.
    block_best(best_s, best_i, ws, wi);
    if (best_i < 0) {
      break;  // uniform: every thread read the same result
    }
    if (threadIdx.x == 0) {
      keep[step] = best_i;
      new_scores[step] = static_cast<scalar_t>(best_s);
    }
    const int64_t selected = best_i;
    const Box<T> sel = box_buf[selected];
    best_s = T(0);
    best_i = -1;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      if (!live[j]) {
        continue;
      }
      if (j == selected) {
        live[j] = 0;
        continue;
      }
      const T iou = soft_nms_iou(sel, box_buf[j]);
      const T s = score_buf[j] * soft_nms_weight(iou, gaussian, threshold, sigma);
      score_buf[j] = s;
      if (!(s >= min_score)) {
        live[j] = 0;
        continue;
      }
      take_better(best_s, best_i, s, j);
    }
  }
  if (threadIdx.x == 0) {
    *count = step;
  }
}

std::tuple<at::Tensor, at::Tensor> soft_nms(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double sigma, double min_score, c10::string_view method) {
  check_soft_nms(boxes, scores, iou_threshold, sigma, min_score,
                 c10::DeviceType::CUDA);
  const bool gaussian = soft_nms_is_gaussian(method);
  const c10::cuda::CUDAGuard guard(boxes.device());
  const int64_t n = boxes.size(0);
  const at::TensorOptions long_opts = boxes.options().dtype(at::kLong);
  at::Tensor keep = at::empty({n}, long_opts);
  at::Tensor new_scores = at::empty({n}, scores.options());
  if (n == 0) {
    return {keep, new_scores};
  }
  at::Tensor count = at::empty({1}, long_opts);
  at::Tensor live = at::empty({n}, boxes.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.soft_nms", [&] {
        using T = at::opmath_type<scalar_t>;
        const at::TensorOptions math_opts =
            boxes.options().dtype(c10::CppTypeToScalarType<T>::value);
        // The allocator's alignment (at least 256 bytes) satisfies Box<T>'s.
        at::Tensor box_buf = at::empty({n, 4}, math_opts);
        at::Tensor score_buf = at::empty({n}, math_opts);
        soft_nms_kernel<scalar_t, T><<<1, kThreads, 0, current_stream()>>>(
            boxes.const_data_ptr<scalar_t>(), boxes.stride(0), boxes.stride(1),
            scores.const_data_ptr<scalar_t>(), scores.stride(0), n,
            static_cast<T>(iou_threshold), static_cast<T>(sigma),
            static_cast<T>(min_score), gaussian,
            reinterpret_cast<Box<T>*>(box_buf.mutable_data_ptr<T>()),
            score_buf.mutable_data_ptr<T>(), live.mutable_data_ptr<uint8_t>(),
            keep.mutable_data_ptr<int64_t>(),
            new_scores.mutable_data_ptr<scalar_t>(),
            count.mutable_data_ptr<int64_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  // The only host synchronisation: the outputs' length.
  const int64_t selected = count.item<int64_t>();
  return {keep.narrow(0, 0, selected), new_scores.narrow(0, 0, selected)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("soft_nms", &soft_nms);
}

}  // namespace torchops::cuda
