// CPU kernels of torchops.box_iou_rotated, nms_rotated and
// batched_nms_rotated (geometry in common/rotated_boxes.h).
//
// Every box is prepared once (centre, half extents, cos/sin of its angle, in
// double), so a pair costs one circle test and, when the circles meet, one
// clipping.  box_iou_rotated splits rows over threads.  nms_rotated follows
// nms's CPU schedule without its SIMD arrays (clipping does not vectorise):
// resolve a block of candidates sequentially, then test the remaining
// candidates against the block's kept boxes, split over threads, so that the
// threading overhead is paid per block rather than per kept box.  Each
// candidate is written by one task only: results do not depend on the
// thread count.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/nms_rotated.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kBlock = 256;          // candidates resolved sequentially per round
constexpr int64_t kTaskPairs = 1 << 13;  // box pairs per thread task, at least

// Prepared boxes of `boxes` (any strides), rows in `order` when given.
std::vector<RotatedBox> prepare_boxes(const at::Tensor& boxes,
                                      const int64_t* order) {
  const int64_t n = boxes.size(0);
  std::vector<RotatedBox> out(n);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.rotated_boxes",
      [&] {
        const scalar_t* p = boxes.const_data_ptr<scalar_t>();
        const int64_t s0 = boxes.stride(0), s1 = boxes.stride(1);
        parallel_range(n, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const int64_t row = order != nullptr ? order[i] : i;
            out[i] = prepare_rotated_box(p + row * s0, s1);
          }
        });
      });
  return out;
}

at::Tensor box_iou_rotated(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  check_box_iou_rotated(boxes1, boxes2, c10::DeviceType::CPU);
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  at::Tensor out = new_output("box_iou_rotated", {n, m}, boxes1.options());
  if (n == 0 || m == 0) {
    return out;
  }
  const std::vector<RotatedBox> a = prepare_boxes(boxes1, nullptr);
  const std::vector<RotatedBox> b = prepare_boxes(boxes2, nullptr);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, out.scalar_type(), "torchops.box_iou_rotated",
      [&] {
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, n, std::max<int64_t>(1, kTaskPairs / m),
                         [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            for (int64_t j = 0; j < m; ++j) {
              o[i * m + j] = static_cast<scalar_t>(rotated_iou(a[i], b[j]));
            }
          }
        });
      });
  return out;
}

// Greedy NMS over prepared boxes in score order (`cls`: their categories, or
// empty); writes the kept boxes' rows (order[p]) to `keep`, returns how many.
int64_t greedy_nms_rotated(const std::vector<RotatedBox>& boxes,
                           const std::vector<int64_t>& cls, double threshold,
                           const int64_t* order, int64_t* keep) {
  const int64_t n = static_cast<int64_t>(boxes.size());
  const bool batched = !cls.empty();
  std::vector<uint8_t> dead(n, 0);
  std::vector<int64_t> kept;  // this round's kept positions
  kept.reserve(kBlock);
  std::vector<double> kx(kBlock), ky(kBlock), kr(kBlock);
  // IoU 0 (disjoint circles) suppresses only below a negative threshold.
  const bool prefilter = threshold >= 0.0;
  auto suppresses = [&](int64_t p, int64_t q) {
    return (!batched || cls[p] == cls[q]) &&
           rotated_suppresses(boxes[p], boxes[q], threshold);
  };
  int64_t n_keep = 0;
  for (int64_t head = 0; head < n; head += kBlock) {
    const int64_t block_end = std::min(n, head + kBlock);
    kept.clear();
    for (int64_t p = head; p < block_end; ++p) {
      if (dead[p]) {
        continue;
      }
      keep[n_keep++] = order[p];
      kept.push_back(p);
      for (int64_t q = p + 1; q < block_end; ++q) {
        if (!dead[q] && suppresses(p, q)) {
          dead[q] = 1;
        }
      }
    }
    if (kept.empty() || block_end == n) {
      continue;
    }
    const int64_t nk = static_cast<int64_t>(kept.size());
    // The kept boxes' circles as arrays: the circle test, which rejects
    // most pairs, runs over unit-stride data without touching the boxes.
    for (int64_t k = 0; k < nk; ++k) {
      const RotatedBox& bk = boxes[kept[k]];
      kx[k] = bk.x;
      ky[k] = bk.y;
      kr[k] = bk.r;
    }
    const int64_t grain = std::max<int64_t>(16, kTaskPairs / nk);
    at::parallel_for(block_end, n, grain, [&](int64_t b, int64_t e) {
      for (int64_t q = b; q < e; ++q) {
        if (dead[q]) {
          continue;
        }
        const double qx = boxes[q].x, qy = boxes[q].y, qr = boxes[q].r;
        for (int64_t k = 0; k < nk; ++k) {
          const double dx = kx[k] - qx, dy = ky[k] - qy, reach = kr[k] + qr;
          if (prefilter && dx * dx + dy * dy > reach * reach) {
            continue;  // rotated_suppresses would say no
          }
          if (suppresses(kept[k], q)) {
            dead[q] = 1;
            break;
          }
        }
      }
    });
  }
  return n_keep;
}

at::Tensor nms_rotated_impl(const char* op, const at::Tensor& boxes,
                            const at::Tensor& scores, const at::Tensor* idxs,
                            double iou_threshold) {
  check_nms_rotated(op, boxes, scores, idxs, iou_threshold,
                    c10::DeviceType::CPU);
  const int64_t n = boxes.size(0);
  at::Tensor keep = at::empty({n}, boxes.options().dtype(at::kLong));
  if (n == 0) {
    return keep;
  }
  const at::Tensor order = std::get<1>(
      at::sort(scores, /*stable=*/true, /*dim=*/0, /*descending=*/true));
  const int64_t* order_p = order.const_data_ptr<int64_t>();
  const std::vector<RotatedBox> sorted = prepare_boxes(boxes, order_p);
  std::vector<int64_t> cls;
  if (idxs != nullptr) {
    cls.resize(n);
    const int64_t* ip = idxs->const_data_ptr<int64_t>();
    const int64_t is = idxs->stride(0);
    for (int64_t p = 0; p < n; ++p) {
      cls[p] = ip[order_p[p] * is];
    }
  }
  const int64_t n_keep = greedy_nms_rotated(
      sorted, cls, iou_threshold, order_p, keep.mutable_data_ptr<int64_t>());
  return keep.narrow(0, 0, n_keep);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("box_iou_rotated", &box_iou_rotated);
  m.impl("nms_rotated", &nms_rotated_entry<nms_rotated_impl>);
  m.impl("batched_nms_rotated", &batched_nms_rotated_entry<nms_rotated_impl>);
}

}  // namespace torchops::cpu
