// CUDA kernels of torchops.box_iou_rotated, nms_rotated and
// batched_nms_rotated (geometry in common/rotated_boxes.h).
//
// Every box is prepared once (centre, half extents, cos/sin of its angle, in
// double) by an element-wise kernel.  box_iou_rotated then runs one thread
// per pair.  The NMS ops gather the prepared boxes in score order (stable
// sort, as nms) and reuse nms's suppression bitmask and on-device greedy
// resolution (cuda/common/nms_mask.cuh) with the rotated suppression test;
// the one host sync reads the number of kept boxes.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include "common/nms_rotated.h"
#include "cuda/common/elementwise.cuh"
#include "cuda/common/nms_mask.cuh"

namespace torchops::cuda {
namespace {

constexpr int64_t kBoxDoubles = sizeof(RotatedBox) / sizeof(double);
static_assert(sizeof(RotatedBox) == kBoxDoubles * sizeof(double),
              "RotatedBox is stored in a double tensor");

// A device buffer of n prepared boxes: rows order[p] of `boxes` (order may
// be nullptr: row p), and their categories in `cls_out` when idxs is given.
at::Tensor prepare_boxes(const at::Tensor& boxes, const int64_t* order,
                         const at::Tensor* idxs, int64_t* cls_out) {
  const int64_t n = boxes.size(0);
  at::Tensor out =
      at::empty({n * kBoxDoubles}, boxes.options().dtype(at::kDouble));
  RotatedBox* out_p = reinterpret_cast<RotatedBox*>(out.mutable_data_ptr<double>());
  const int64_t* idx_p = idxs != nullptr ? idxs->const_data_ptr<int64_t>() : nullptr;
  const int64_t idx_stride = idxs != nullptr ? idxs->stride(0) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.rotated_boxes",
      [&] {
        const scalar_t* bp = boxes.const_data_ptr<scalar_t>();
        const int64_t s0 = boxes.stride(0);
        const int64_t s1 = boxes.stride(1);
        launch_elementwise(n, [=] __device__(int64_t p) {
          const int64_t src = order != nullptr ? order[p] : p;
          out_p[p] = prepare_rotated_box(bp + src * s0, s1);
          if (cls_out != nullptr) {
            cls_out[p] = idx_p[src * idx_stride];
          }
        });
      });
  return out;
}

const RotatedBox* box_ptr(const at::Tensor& prepared) {
  return reinterpret_cast<const RotatedBox*>(prepared.const_data_ptr<double>());
}

at::Tensor box_iou_rotated(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  check_box_iou_rotated(boxes1, boxes2, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(boxes1.device());
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  at::Tensor out = new_output("box_iou_rotated", {n, m}, boxes1.options());
  if (n == 0 || m == 0) {
    return out;
  }
  const at::Tensor a = prepare_boxes(boxes1, nullptr, nullptr, nullptr);
  const at::Tensor b = prepare_boxes(boxes2, nullptr, nullptr, nullptr);
  const RotatedBox* a_p = box_ptr(a);
  const RotatedBox* b_p = box_ptr(b);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, out.scalar_type(), "torchops.box_iou_rotated",
      [&] {
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        // Consecutive threads take consecutive columns: one row box for a
        // warp (a broadcast load), coalesced writes.
        launch_elementwise(n * m, [=] __device__(int64_t p) {
          const int64_t i = p / m;
          const int64_t j = p - i * m;
          o[p] = static_cast<scalar_t>(rotated_iou(a_p[i], b_p[j]));
        });
      });
  return out;
}

// nms_rotated's suppression test (the bitmask kernel's `test`).
struct RotatedTest {
  double threshold;
  __device__ bool operator()(const RotatedBox& a, const RotatedBox& b) const {
    return rotated_suppresses(a, b, threshold);
  }
};

at::Tensor nms_rotated_impl(const char* op, const at::Tensor& boxes,
                            const at::Tensor& scores, const at::Tensor* idxs,
                            double iou_threshold) {
  check_nms_rotated(op, boxes, scores, idxs, iou_threshold,
                    c10::DeviceType::CUDA);
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
  at::Tensor cls;
  int64_t* cls_p = nullptr;
  if (idxs != nullptr) {
    cls = at::empty({n}, long_opts);
    cls_p = cls.mutable_data_ptr<int64_t>();
  }
  const at::Tensor sorted = prepare_boxes(boxes, order_p, idxs, cls_p);
  at::Tensor mask = new_nms_mask(nb, long_opts);
  launch_nms_mask(box_ptr(sorted), static_cast<const int64_t*>(cls_p), n, nb,
                  RotatedTest{iou_threshold}, mask);
  at::Tensor keep = at::empty({n}, long_opts);
  at::Tensor num_keep = at::empty({}, long_opts);
  resolve_nms_mask(mask, n, nb, order_p, keep, num_keep, /*pad=*/false);
  return kept_prefix(keep, num_keep);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("box_iou_rotated", &box_iou_rotated);
  m.impl("nms_rotated", &nms_rotated_entry<nms_rotated_impl>);
  m.impl("batched_nms_rotated", &batched_nms_rotated_entry<nms_rotated_impl>);
}

}  // namespace torchops::cuda
