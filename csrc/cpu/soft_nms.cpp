// CPU kernel of torchops.soft_nms (semantics in common/soft_nms.h).
//
// The selection is sequential: each step outputs the best remaining box and
// decays the others' scores by their overlap with it.  The remaining boxes
// sit in arrays of the op math type; one pass per step decays every live
// box, drops those below min_score and finds the next best, split over
// threads when the arrays are long (each chunk's best is merged under a
// lock; the order (score, index) is total, so the merge order does not
// matter).  Dropped boxes are compacted away once a quarter of the arrays
// is dead, so a scene that decays quickly costs little.  At most N steps.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "common/soft_nms.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kGrain = 4096;  // boxes per thread task, at least

template <typename T>
struct Best {
  T score;
  int64_t index = -1;  // the box's row; -1: none
  int64_t pos = -1;    // its slot in the arrays

  void offer(T s, int64_t i, int64_t p) {
    if (index < 0 || soft_nms_before(s, i, score, index)) {
      score = s;
      index = i;
      pos = p;
    }
  }
};

template <typename scalar_t>
int64_t soft_nms_loop(const at::Tensor& boxes, const at::Tensor& scores,
                      double iou_threshold, double sigma, double min_score,
                      bool gaussian, int64_t* keep, scalar_t* new_scores) {
  using T = at::opmath_type<scalar_t>;
  const int64_t n = boxes.size(0);
  const T thr = static_cast<T>(iou_threshold);
  const T sig = static_cast<T>(sigma);
  const T min_s = static_cast<T>(min_score);
  std::vector<Box<T>> box(n);
  std::vector<T> score(n);
  std::vector<int64_t> index(n);
  std::vector<uint8_t> live(n);
  const scalar_t* bp = boxes.const_data_ptr<scalar_t>();
  const scalar_t* sp = scores.const_data_ptr<scalar_t>();
  const int64_t b0 = boxes.stride(0), b1 = boxes.stride(1);
  const int64_t s0 = scores.stride(0);
  Best<T> best;
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* row = bp + i * b0;
    box[i] = Box<T>{static_cast<T>(row[0]), static_cast<T>(row[b1]),
                    static_cast<T>(row[2 * b1]), static_cast<T>(row[3 * b1])};
    score[i] = static_cast<T>(sp[i * s0]);
    index[i] = i;
    live[i] = score[i] >= min_s;
    if (live[i]) {
      best.offer(score[i], i, i);
    }
  }
  int64_t m = n;     // arrays' length
  int64_t dead = 0;  // dead slots among them
  int64_t count = 0;
  std::mutex merge;
  for (int64_t step = 0; step < n && best.index >= 0; ++step) {
    keep[count] = best.index;
    new_scores[count] = static_cast<scalar_t>(best.score);
    ++count;
    live[best.pos] = 0;
    ++dead;
    const Box<T> sel = box[best.pos];
    Best<T> next;
    at::parallel_for(0, m, kGrain, [&](int64_t b, int64_t e) {
      Best<T> local;
      int64_t died = 0;
      for (int64_t j = b; j < e; ++j) {
        if (!live[j]) {
          continue;
        }
        const T iou = soft_nms_iou(sel, box[j]);
        const T s = score[j] * soft_nms_weight(iou, gaussian, thr, sig);
        score[j] = s;
        if (!(s >= min_s)) {
          live[j] = 0;
          ++died;
          continue;
        }
        local.offer(s, index[j], j);
      }
      const std::lock_guard<std::mutex> lock(merge);
      dead += died;
      if (local.index >= 0) {
        next.offer(local.score, local.index, local.pos);
      }
    });
    best = next;
    if (4 * dead > m) {
      int64_t w = 0;
      for (int64_t r = 0; r < m; ++r) {
        if (live[r]) {
          if (r == best.pos) {
            best.pos = w;
          }
          box[w] = box[r];
          score[w] = score[r];
          index[w] = index[r];
          live[w] = 1;
          ++w;
        }
      }
      m = w;
      dead = 0;
    }
  }
  return count;
}

std::tuple<at::Tensor, at::Tensor> soft_nms(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double sigma, double min_score, c10::string_view method) {
  check_soft_nms(boxes, scores, iou_threshold, sigma, min_score,
                 c10::DeviceType::CPU);
  const bool gaussian = soft_nms_is_gaussian(method);
  const int64_t n = boxes.size(0);
  at::Tensor keep = at::empty({n}, boxes.options().dtype(at::kLong));
  at::Tensor new_scores = at::empty({n}, scores.options());
  int64_t count = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.soft_nms", [&] {
        count = soft_nms_loop<scalar_t>(
            boxes, scores, iou_threshold, sigma, min_score, gaussian,
            keep.mutable_data_ptr<int64_t>(),
            new_scores.mutable_data_ptr<scalar_t>());
      });
  return {keep.narrow(0, 0, count), new_scores.narrow(0, 0, count)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("soft_nms", &soft_nms);
}

}  // namespace torchops::cpu
