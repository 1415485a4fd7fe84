// CUDA kernels of torchops.nms, torchops.batched_nms and torchops.nms_padded
// (one algorithm: the batched variant only adds "same category" to the
// suppression test; the padded one returns all N rows and the count instead
// of reading the count on the host).
//
// Everything stays on the device; nms and batched_nms read the number of
// kept boxes on the host to size their result, nms_padded reads nothing.
// Up to about 1,700 boxes (on GPUs with 227 KB of shared memory per block),
// one launch does all of it (cuda/common/nms_mask.cuh says how).  Above
// that:
//  1. order = stable sort of the scores, descending (ATen's radix sort);
//     the boxes are gathered in that order, converted to the op math type.
//  2, 3. The suppression bitmask and its greedy resolution, shared with the
//     rotated NMS kernels: cuda/common/nms_mask.cuh.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common/nms.h"
#include "cuda/common/elementwise.cuh"
#include "cuda/common/nms_mask.cuh"

namespace torchops::cuda {
namespace {

// nms's suppression test (step 2's `test`).
template <typename T>
struct AxisAlignedTest {
  T threshold;
  __device__ bool operator()(const Box<T>& a, const Box<T>& b) const {
    return nms_suppresses(a, b, threshold);
  }
};

// The inputs as the kernels read them, in place: row i's box in the op math
// type T, its score and its category.
template <typename scalar_t, typename T>
struct AxisAlignedSource {
  const scalar_t* boxes;
  int64_t box_stride, coord_stride;
  const scalar_t* scores;
  int64_t score_stride;
  const int64_t* idxs;  // nullptr unless batched
  int64_t idx_stride;

  __device__ T score(int64_t i) const {
    return static_cast<T>(scores[i * score_stride]);
  }
  __device__ Box<T> box(int64_t i) const {
    const scalar_t* row = boxes + i * box_stride;
    return Box<T>{static_cast<T>(row[0]), static_cast<T>(row[coord_stride]),
                  static_cast<T>(row[2 * coord_stride]),
                  static_cast<T>(row[3 * coord_stride])};
  }
  __device__ int64_t category(int64_t i) const { return idxs[i * idx_stride]; }
};

// The kept rows into keep[0, count) by decreasing score and count into
// num_keep, for n > 0 checked boxes; with `pad`, keep[count, n) = -1.
void nms_into(const at::Tensor& boxes, const at::Tensor& scores,
              const at::Tensor* idxs, double iou_threshold, int64_t nb,
              at::Tensor& keep, at::Tensor& num_keep, bool pad) {
  const int64_t n = boxes.size(0);
  const at::TensorOptions long_opts = keep.options();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.nms", [&] {
        using T = at::opmath_type<scalar_t>;
        using Source = AxisAlignedSource<scalar_t, T>;
        using Test = AxisAlignedTest<T>;
        const Source src{
            boxes.const_data_ptr<scalar_t>(),
            boxes.stride(0),
            boxes.stride(1),
            scores.const_data_ptr<scalar_t>(),
            scores.stride(0),
            idxs != nullptr ? idxs->const_data_ptr<int64_t>() : nullptr,
            idxs != nullptr ? idxs->stride(0) : 0};
        const Test test{static_cast<T>(iou_threshold)};
        const auto single_launch = [&](auto batched) {
          constexpr bool kBatched = decltype(batched)::value;
          if (!nms_small_fits<T, Box<T>, kBatched, Source, Test>(n)) {
            return false;
          }
          launch_nms_small<T, Box<T>, kBatched>(src, n, test, keep, num_keep, pad);
          return true;
        };
        if (idxs != nullptr ? single_launch(std::true_type{})
                            : single_launch(std::false_type{})) {
          return;
        }
        const at::Tensor order = std::get<1>(
            at::sort(scores, /*stable=*/true, /*dim=*/0, /*descending=*/true));
        const int64_t* order_p = order.const_data_ptr<int64_t>();
        // Sorted boxes in the op math type; the allocator's alignment (at
        // least 256 bytes) satisfies Box<T>'s.
        at::Tensor sorted = at::empty(
            {n, 4}, boxes.options().dtype(c10::CppTypeToScalarType<T>::value));
        Box<T>* sorted_p = reinterpret_cast<Box<T>*>(sorted.mutable_data_ptr<T>());
        at::Tensor cls;
        int64_t* cls_p = nullptr;
        if (idxs != nullptr) {
          cls = at::empty({n}, long_opts);
          cls_p = cls.mutable_data_ptr<int64_t>();
        }
        launch_elementwise(n, [=] __device__(int64_t p) {
          const int64_t row = order_p[p];
          sorted_p[p] = src.box(row);
          if (cls_p != nullptr) {
            cls_p[p] = src.category(row);
          }
        });
        at::Tensor mask = new_nms_mask(nb, long_opts);
        launch_nms_mask(sorted_p, cls_p, n, nb, test, mask);
        resolve_nms_mask(mask, n, nb, order_p, keep, num_keep, pad);
      });
}

at::Tensor nms_impl(const char* op, const at::Tensor& boxes,
                    const at::Tensor& scores, const at::Tensor* idxs,
                    double iou_threshold) {
  check_nms(op, boxes, scores, idxs, iou_threshold, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(boxes.device());
  const int64_t n = boxes.size(0);
  const at::TensorOptions long_opts = boxes.options().dtype(at::kLong);
  if (n == 0) {
    return at::empty({0}, long_opts);
  }
  const int64_t nb = nms_blocks(op, n);
  at::Tensor keep = at::empty({n}, long_opts);
  at::Tensor num_keep = at::empty({}, long_opts);
  nms_into(boxes, scores, idxs, iou_threshold, nb, keep, num_keep, false);
  return kept_prefix(keep, num_keep);
}

std::tuple<at::Tensor, at::Tensor> nms_padded(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    const std::optional<at::Tensor>& idxs) {
  const at::Tensor* idx = idxs.has_value() ? &*idxs : nullptr;
  check_nms("nms_padded", boxes, scores, idx, iou_threshold,
            c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(boxes.device());
  const int64_t n = boxes.size(0);
  const at::TensorOptions long_opts = boxes.options().dtype(at::kLong);
  at::Tensor keep = at::empty({n}, long_opts);
  at::Tensor num_keep = at::empty({}, long_opts);
  if (n == 0) {
    num_keep.zero_();
  } else {
    nms_into(boxes, scores, idx, iou_threshold, nms_blocks("nms_padded", n),
             keep, num_keep, true);
  }
  return {keep, num_keep};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("nms", &nms_entry<nms_impl>);
  m.impl("batched_nms", &batched_nms_entry<nms_impl>);
  m.impl("nms_padded", &nms_padded);
}

}  // namespace torchops::cuda
