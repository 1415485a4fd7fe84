// CPU kernels of torchops.nms and torchops.batched_nms (one algorithm: the
// batched variant only adds "same category" to the suppression test).
//
// Greedy NMS, blocked so that it vectorises and runs in parallel:
//  1. stable sort by decreasing score; copy the boxes, in that order, into
//     structure-of-arrays buffers in the op math type (x1[], y1[], ...);
//  2. take the next block of kBlock candidates and resolve it sequentially
//     (each kept box suppresses the later boxes of the block);
//  3. suppress every remaining candidate that overlaps any box kept in step 2:
//     a unit-stride loop over the SoA arrays (SIMD), split over threads with
//     at::parallel_for when the tail is long;
//  4. compact the tail once a quarter of it is suppressed, so dead boxes stop
//     costing work; repeat from 2.
// Work is O(kept * remaining) IoU tests like the textbook greedy loop, but
// the boxes kept in a block share each pass over the tail, which amortises the
// threading overhead and keeps a tile of the tail in L1 across them.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_unique.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/nms.h"
#include "cpu/common/box_arrays.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kBlock = 256;      // candidates resolved sequentially per round
constexpr int64_t kTile = 512;       // tail elements kept in L1 across kept boxes
constexpr int64_t kTaskPairs = 1 << 16;  // IoU tests per thread task, at least

// Integer of the op math width: flags and categories are stored in it so the
// suppression loop compares and blends in lanes of one width.
template <typename T>
using lane_int = std::conditional_t<sizeof(T) == 8, int64_t, int32_t>;

// Boxes in score order, structure of arrays.
template <typename T>
struct Boxes {
  using I = lane_int<T>;
  explicit Boxes(int64_t n, bool batched)
      : x1(n), y1(n), x2(n), y2(n), area(n), cls(batched ? n : 0), dead(n, 0),
        index(n) {}
  std::vector<T> x1, y1, x2, y2, area;
  std::vector<I> cls;          // category (batched_nms only)
  std::vector<I> dead;         // 1 once suppressed
  std::vector<int64_t> index;  // row in the caller's `boxes`

  void move(int64_t from, int64_t to) {
    x1[to] = x1[from];
    y1[to] = y1[from];
    x2[to] = x2[from];
    y2[to] = y2[from];
    area[to] = area[from];
    if (!cls.empty()) {
      cls[to] = cls[from];
    }
    dead[to] = dead[from];
    index[to] = index[from];
  }
};

// Raw pointers of the arrays the hot loop reads.
template <typename T>
struct View {
  const T *x1, *y1, *x2, *y2, *area;
  const lane_int<T>* cls;
  lane_int<T>* dead;
};

// Marks dead every box j in [begin, end) that one of the nk boxes `k`
// suppresses; returns how many were alive before.
template <typename T, bool Batched>
inline __attribute__((always_inline)) int64_t suppress_impl(
    View<T> v, View<T> k, int64_t nk, int64_t begin, int64_t end, T thr) {
  using I = lane_int<T>;
  int64_t newly = 0;
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t t1 = std::min(end, t0 + kTile);
    I tile_newly = 0;
    for (int64_t c = 0; c < nk; ++c) {
      const T cx1 = k.x1[c], cy1 = k.y1[c], cx2 = k.x2[c], cy2 = k.y2[c];
      const T carea = k.area[c];
      const I ccls = Batched ? k.cls[c] : I(0);
#pragma omp simd reduction(+ : tile_newly)
      for (int64_t j = t0; j < t1; ++j) {
        const T inter = box_intersection(
            cx1, cy1, cx2, cy2, v.x1[j], v.y1[j], v.x2[j], v.y2[j]);
        I hit = iou_of(inter, carea, v.area[j]) > thr;
        if constexpr (Batched) {
          hit &= static_cast<I>(v.cls[j] == ccls);
        }
        const I d = v.dead[j];
        tile_newly += hit & (d ^ 1);
        v.dead[j] = d | hit;
      }
    }
    newly += tile_newly;
  }
  return newly;
}

// Function multiversioning (target_clones) does not apply to templates: one
// multiversioned instantiation per (type, batched).
#define TORCHOPS_SUPPRESS_CLONE(NAME, T, BATCHED)                          \
  TORCHOPS_CPU_MULTIVERSION int64_t NAME(View<T> v, View<T> k, int64_t nk, \
                                         int64_t b, int64_t e, T t) {      \
    return suppress_impl<T, BATCHED>(v, k, nk, b, e, t);                   \
  }
TORCHOPS_SUPPRESS_CLONE(suppress_f32, float, false)
TORCHOPS_SUPPRESS_CLONE(suppress_f64, double, false)
TORCHOPS_SUPPRESS_CLONE(suppress_batched_f32, float, true)
TORCHOPS_SUPPRESS_CLONE(suppress_batched_f64, double, true)
#undef TORCHOPS_SUPPRESS_CLONE

inline int64_t suppress(bool batched, View<float> v, View<float> k, int64_t nk,
                        int64_t b, int64_t e, float t) {
  return batched ? suppress_batched_f32(v, k, nk, b, e, t)
                 : suppress_f32(v, k, nk, b, e, t);
}
inline int64_t suppress(bool batched, View<double> v, View<double> k,
                        int64_t nk, int64_t b, int64_t e, double t) {
  return batched ? suppress_batched_f64(v, k, nk, b, e, t)
                 : suppress_f64(v, k, nk, b, e, t);
}

template <typename T>
View<T> view_of(Boxes<T>& b, int64_t offset) {
  return {b.x1.data() + offset, b.y1.data() + offset, b.x2.data() + offset,
          b.y2.data() + offset, b.area.data() + offset,
          b.cls.empty() ? nullptr : b.cls.data() + offset,
          b.dead.data() + offset};
}

// Greedy NMS over boxes already in score order; writes the kept rows'
// indices to `keep` (in order) and returns how many.
template <typename T>
int64_t greedy_nms(Boxes<T>& boxes, int64_t n, T thr, int64_t* keep) {
  const bool batched = !boxes.cls.empty();
  Boxes<T> kept(kBlock, batched);  // this round's kept boxes
  const View<T> all = view_of(boxes, 0);
  const View<T> kv = view_of(kept, 0);
  int64_t n_keep = 0;
  int64_t head = 0;  // boxes[head, tail_end) are still undecided
  int64_t tail_end = n;
  int64_t dead_in_tail = 0;
  while (head < tail_end) {
    const int64_t block_end = std::min(tail_end, head + kBlock);
    int64_t nk = 0;
    for (int64_t p = head; p < block_end; ++p) {
      if (boxes.dead[p]) {
        continue;
      }
      keep[n_keep++] = boxes.index[p];
      kept.x1[nk] = boxes.x1[p];
      kept.y1[nk] = boxes.y1[p];
      kept.x2[nk] = boxes.x2[p];
      kept.y2[nk] = boxes.y2[p];
      kept.area[nk] = boxes.area[p];
      if (batched) {
        kept.cls[nk] = boxes.cls[p];
      }
      suppress(batched, all, view_of(kept, nk), 1, p + 1, block_end, thr);
      ++nk;
    }
    head = block_end;
    if (nk == 0 || head == tail_end) {
      continue;
    }
    const int64_t grain = std::max<int64_t>(kTile, kTaskPairs / nk);
    std::atomic<int64_t> newly{0};
    at::parallel_for(head, tail_end, grain, [&](int64_t b, int64_t e) {
      newly += suppress(batched, all, kv, nk, b, e, thr);
    });
    dead_in_tail += newly.load();
    // Compacting costs one pass over the tail and happens only after a
    // quarter of it died: O(n) moves over the whole run.
    if (4 * dead_in_tail > tail_end - head) {
      int64_t w = head;
      for (int64_t r = head; r < tail_end; ++r) {
        if (!boxes.dead[r]) {
          boxes.move(r, w++);
        }
      }
      tail_end = w;
      dead_in_tail = 0;
    }
  }
  return n_keep;
}

// Dense categories of the width of the SIMD lanes: idxs shifted to start at
// 0 when their range fits, else their rank among the distinct values.
template <typename I>
void fill_categories(const at::Tensor& idxs, const int64_t* order, int64_t n,
                     I* cls) {
  const at::Tensor idx = idxs.contiguous();
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(ip, ip + n);
  at::Tensor ranks;
  int64_t base = *lo;
  if (static_cast<uint64_t>(*hi) - static_cast<uint64_t>(*lo) >
      static_cast<uint64_t>(std::numeric_limits<I>::max())) {
    ranks = std::get<1>(at::_unique(idx, /*sorted=*/true, /*return_inverse=*/true))
                .contiguous();
    ip = ranks.const_data_ptr<int64_t>();
    base = 0;
  }
  parallel_range(n, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      cls[p] = static_cast<I>(ip[order[p]] - base);
    }
  });
}

at::Tensor nms_impl(const char* op, const at::Tensor& boxes_in,
                    const at::Tensor& scores, const at::Tensor* idxs,
                    double iou_threshold) {
  check_nms(op, boxes_in, scores, idxs, iou_threshold, c10::DeviceType::CPU);
  const int64_t n = boxes_in.size(0);
  at::Tensor keep = at::empty({n}, boxes_in.options().dtype(at::kLong));
  if (n == 0) {
    return keep;
  }
  const at::Tensor order = std::get<1>(
      at::sort(scores, /*stable=*/true, /*dim=*/0, /*descending=*/true));
  const int64_t* op_order = order.const_data_ptr<int64_t>();
  const at::Tensor boxes = boxes_in.contiguous();
  int64_t n_keep = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes.scalar_type(), "torchops.nms", [&] {
        using T = at::opmath_type<scalar_t>;
        Boxes<T> sorted(n, idxs != nullptr);
        const scalar_t* bp = boxes.const_data_ptr<scalar_t>();
        parallel_range(n, [&](int64_t b, int64_t e) {
          for (int64_t p = b; p < e; ++p) {
            const int64_t src = op_order[p];
            load_box<T>(bp, src, sorted, p);
            sorted.index[p] = src;
          }
        });
        if (idxs != nullptr) {
          fill_categories(*idxs, op_order, n, sorted.cls.data());
        }
        n_keep = greedy_nms(sorted, n, static_cast<T>(iou_threshold),
                            keep.mutable_data_ptr<int64_t>());
      });
  return keep.narrow(0, 0, n_keep);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("nms", &nms_entry<nms_impl>);
  m.impl("batched_nms", &batched_nms_entry<nms_impl>);
  m.impl("nms_padded", &nms_padded_entry<nms_impl>);
}

}  // namespace torchops::cpu
