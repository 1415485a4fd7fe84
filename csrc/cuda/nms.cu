// CUDA kernels of torchops.nms and torchops.batched_nms (one algorithm: the
// batched variant only adds "same category" to the suppression test).
//
// Everything stays on the device; the one host sync reads the number of kept
// boxes to size the result.
//
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

  const at::Tensor order = std::get<1>(
      at::sort(scores, /*stable=*/true, /*dim=*/0, /*descending=*/true));
  const int64_t* order_p = order.const_data_ptr<int64_t>();
  at::Tensor mask = new_nms_mask(nb, long_opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.nms", [&] {
        using T = at::opmath_type<scalar_t>;
        // Sorted boxes in the op math type; the allocator's alignment (at
        // least 256 bytes) satisfies Box<T>'s.
        at::Tensor sorted = at::empty(
            {n, 4}, boxes.options().dtype(c10::CppTypeToScalarType<T>::value));
        Box<T>* sorted_p = reinterpret_cast<Box<T>*>(sorted.mutable_data_ptr<T>());
        at::Tensor cls;
        int64_t* cls_p = nullptr;
        const int64_t* idx_p = nullptr;
        int64_t idx_stride = 0;
        if (idxs != nullptr) {
          cls = at::empty({n}, long_opts);
          cls_p = cls.mutable_data_ptr<int64_t>();
          idx_p = idxs->const_data_ptr<int64_t>();
          idx_stride = idxs->stride(0);
        }
        const scalar_t* bp = boxes.const_data_ptr<scalar_t>();
        const int64_t s0 = boxes.stride(0);
        const int64_t s1 = boxes.stride(1);
        launch_elementwise(n, [=] __device__(int64_t p) {
          const int64_t src = order_p[p];
          const scalar_t* row = bp + src * s0;
          sorted_p[p] = Box<T>{static_cast<T>(row[0]), static_cast<T>(row[s1]),
                               static_cast<T>(row[2 * s1]),
                               static_cast<T>(row[3 * s1])};
          if (cls_p != nullptr) {
            cls_p[p] = idx_p[src * idx_stride];
          }
        });
        launch_nms_mask(sorted_p, cls_p, n, nb,
                        AxisAlignedTest<T>{static_cast<T>(iou_threshold)},
                        mask);
      });

  return resolve_nms_mask(mask, n, nb, order_p, long_opts);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("nms", &nms_entry<nms_impl>);
  m.impl("batched_nms", &batched_nms_entry<nms_impl>);
}

}  // namespace torchops::cuda
