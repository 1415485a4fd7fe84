// Per-axis sampling patterns of the RoI-Align-style CPU kernels (roi_align,
// deform_roi_pool).
//
// Bilinear sampling is separable: a bin's value is
// sum_r wy[r] * sum_q wx[q] * in[r, q] over the distinct rows r and columns q
// its samples touch, each with its samples' weights summed.  Samples closer
// than a pixel share taps, so a small bin reads each pixel once instead of up
// to four times per sample.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/roi_align.h"
#include "cpu/common/roi_loops.h"

namespace torchops::cpu {

// Groups of (input index, summed weight) along one axis, one group per bin
// (or per output row/column): group g is [offsets[g], offsets[g + 1]),
// indices ascending.
template <typename T>
struct AxisTaps {
  std::vector<int64_t> offsets;
  std::vector<int64_t> index;
  std::vector<T> weight;
  // d weight / d shift, when the group's samples all move together (the
  // bins of deform_roi_pool); filled by add_bin only when given `dscratch`.
  std::vector<T> slope;
  int64_t first = 0, last = -1;  // smallest and largest index used

  void clear(int64_t size) {
    offsets.assign(1, 0);
    index.clear();
    weight.clear();
    slope.clear();
    first = size;
    last = -1;
  }

  // Appends a group: the samples i < grid of bin p (roi_align_sample), their
  // weights times `scale`.  `scratch` (and `dscratch`, when slopes are
  // wanted) hold `size` zeros on entry and on exit.
  void add_bin(T start, T bin, int64_t p, int64_t grid, int64_t size, T scale,
               std::vector<T>& scratch, T* dscratch = nullptr) {
    int64_t lo_p = size, hi_p = -1;
    for (int64_t i = 0; i < grid; ++i) {
      const T v = roi_align_sample(start, bin, p, i, grid);
      AxisTap<T> tap;
      if (!roi_align_axis(v, size, tap.lo, tap.hi, tap.w_lo, tap.w_hi)) {
        continue;
      }
      scratch[tap.lo] += tap.w_lo * scale;
      scratch[tap.hi] += tap.w_hi * scale;
      if (dscratch != nullptr) {
        const T s = roi_align_slope(v, size) * scale;
        dscratch[tap.lo] -= s;
        dscratch[tap.hi] += s;
      }
      lo_p = std::min(lo_p, tap.lo);
      hi_p = std::max(hi_p, tap.hi);
    }
    for (int64_t j = lo_p; j <= hi_p; ++j) {
      // A tap of weight 0 can still have a slope (a sample on a pixel).
      if (scratch[j] != T(0) || (dscratch != nullptr && dscratch[j] != T(0))) {
        index.push_back(j);
        weight.push_back(scratch[j]);
        scratch[j] = T(0);
        if (dscratch != nullptr) {
          slope.push_back(dscratch[j]);
          dscratch[j] = T(0);
        }
        first = std::min(first, j);
        last = std::max(last, j);
      }
    }
    offsets.push_back(static_cast<int64_t>(index.size()));
  }

  // One group per output index p < pooled, all starting at `start`.
  void build(T start, T bin, int64_t grid, int64_t size, int64_t pooled,
             T scale, std::vector<T>& scratch) {
    clear(size);
    for (int64_t p = 0; p < pooled; ++p) {
      add_bin(start, bin, p, grid, size, scale, scratch);
    }
  }

  int64_t taps() const { return offsets.back(); }
  int64_t begin(int64_t p) const { return offsets[p]; }
  int64_t end(int64_t p) const { return offsets[p + 1]; }
};

// Every group of an AxisTaps padded to exactly four taps (zero weights at
// the group's first index), each index times `stride` (the row pitch, for
// rows): the fixed-size walk of sum4x4 / add4x4, with no inner loops or
// list bounds.  It serves sampling_ratio <= 2 over bins of a pixel or more,
// the common case.
template <typename T>
struct Taps4 {
  std::vector<int64_t> at;  // four per group
  std::vector<T> w;
  std::vector<T> s;  // the slopes, where `a` has them (padding: 0)

  // Whether every group of `a` has 1 to 4 taps (the padding repeats a
  // group's first tap, so an empty one cannot be padded).
  static bool fits(const AxisTaps<T>& a) {
    const int64_t groups = static_cast<int64_t>(a.offsets.size()) - 1;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n = a.end(g) - a.begin(g);
      if (n < 1 || n > 4) {
        return false;
      }
    }
    return true;
  }

  void build(const AxisTaps<T>& a, int64_t stride) {
    const int64_t groups = static_cast<int64_t>(a.offsets.size()) - 1;
    const bool slopes = !a.slope.empty();
    at.assign(static_cast<size_t>(groups * 4), 0);
    w.assign(static_cast<size_t>(groups * 4), T(0));
    s.assign(slopes ? static_cast<size_t>(groups * 4) : 0, T(0));
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t q = 0; q < 4; ++q) {
        const int64_t j = a.begin(g) + q;
        const bool real = j < a.end(g);
        at[g * 4 + q] = a.index[real ? j : a.begin(g)] * stride;
        w[g * 4 + q] = real ? a.weight[j] : T(0);
        if (slopes) {
          s[g * 4 + q] = real ? a.slope[j] : T(0);
        }
      }
    }
  }

  const int64_t* at_of(int64_t g) const { return at.data() + g * 4; }
  const T* w_of(int64_t g) const { return w.data() + g * 4; }
  const T* s_of(int64_t g) const { return s.data() + g * 4; }
};

// sum_k wr[k] * sum_j wc[j] * plane[ro[k] + co[j]] over four row and four
// column taps (Taps4 groups; ro already times the row pitch).
template <typename scalar_t, typename T>
inline T sum4x4(const scalar_t* __restrict__ plane, const int64_t* ro,
                const T* wr, const int64_t* co, const T* wc) {
  T acc = T(0);
  for (int k = 0; k < 4; ++k) {
    const scalar_t* r = plane + ro[k];
    acc += wr[k] * (wc[0] * static_cast<T>(r[co[0]]) + wc[1] * static_cast<T>(r[co[1]]) +
                    wc[2] * static_cast<T>(r[co[2]]) + wc[3] * static_cast<T>(r[co[3]]));
  }
  return acc;
}

// The transpose of sum4x4: plane[ro[k] + co[j]] += g * wr[k] * wc[j].
template <typename T>
inline void add4x4(T g, const int64_t* ro, const T* wr, const int64_t* co,
                   const T* wc, T* __restrict__ plane) {
  for (int k = 0; k < 4; ++k) {
    T* row = plane + ro[k];
    const T gr = g * wr[k];
    row[co[0]] += gr * wc[0];
    row[co[1]] += gr * wc[1];
    row[co[2]] += gr * wc[2];
    row[co[3]] += gr * wc[3];
  }
}

// The index and weight arrays of a row and a column pattern, as raw
// pointers for the inner loops (`const auto [ri, rw, ci, cw] = ...`).
template <typename T>
struct TapArrays {
  const int64_t* ri;
  const T* rw;
  const int64_t* ci;
  const T* cw;

  TapArrays(const AxisTaps<T>& rows, const AxisTaps<T>& cols)
      : ri(rows.index.data()),
        rw(rows.weight.data()),
        ci(cols.index.data()),
        cw(cols.weight.data()) {}
};

// The taps of one bin (or output pixel): row group `gr` of `rows` by column
// group `gc` of `cols`, the arrays with the bounds of the two groups.
template <typename T>
struct TapBlock : TapArrays<T> {
  int64_t r0, r1, q0, q1;

  TapBlock(const AxisTaps<T>& rows, int64_t gr, const AxisTaps<T>& cols,
           int64_t gc)
      : TapArrays<T>(rows, cols),
        r0(rows.begin(gr)),
        r1(rows.end(gr)),
        q0(cols.begin(gc)),
        q1(cols.end(gc)) {}
};

// One bin's value: sum_r wy[r] * sum_q wx[q] * plane[r, q] over row group
// `gr` of `rows` and column group `gc` of `cols`.
template <typename scalar_t, typename T>
inline T separable_sum(const scalar_t* __restrict__ plane, int64_t width,
                       const AxisTaps<T>& rows, int64_t gr,
                       const AxisTaps<T>& cols, int64_t gc) {
  const TapBlock<T> b(rows, gr, cols, gc);
  T acc = T(0);
  for (int64_t r = b.r0; r < b.r1; ++r) {
    const scalar_t* row = plane + b.ri[r] * width;
    T s = T(0);
    for (int64_t q = b.q0; q < b.q1; ++q) {
      s += b.cw[q] * static_cast<T>(row[b.ci[q]]);
    }
    acc += b.rw[r] * s;
  }
  return acc;
}

// A bin's value from a walk that may multiply taps of weight 0 (the
// padding of Taps4 and of the row pass, or taps kept only for their
// slopes): 0 * inf there would turn the value into NaN although no sample
// weighs that pixel.  Where `acc` is NaN, the bin is summed again over its
// weighted taps alone (roi_align_weighted), so it is NaN only when a sample
// reads a NaN or inf - inf.  NaN is rare: the common path pays one compare.
template <typename scalar_t, typename T>
inline T settle_nan(T acc, const scalar_t* __restrict__ plane, int64_t width,
                    const AxisTaps<T>& rows, int64_t gr, const AxisTaps<T>& cols,
                    int64_t gc) {
  if (!std::isnan(acc)) {
    return acc;
  }
  T sum = T(0);
  for (int64_t r = rows.begin(gr); r < rows.end(gr); ++r) {
    const scalar_t* row = plane + rows.index[r] * width;
    T s = T(0);
    for (int64_t q = cols.begin(gc); q < cols.end(gc); ++q) {
      s += roi_align_weighted(cols.weight[q], static_cast<T>(row[cols.index[q]]));
    }
    sum += roi_align_weighted(rows.weight[r], s);
  }
  return sum;
}

// The transpose of separable_sum: plane[r, q] += g * wy[r] * wx[q].
template <typename T>
inline void separable_add(T g, const AxisTaps<T>& rows, int64_t gr,
                          const AxisTaps<T>& cols, int64_t gc, int64_t width,
                          T* __restrict__ plane) {
  const TapBlock<T> b(rows, gr, cols, gc);
  for (int64_t r = b.r0; r < b.r1; ++r) {
    T* row = plane + b.ri[r] * width;
    const T gr_w = g * b.rw[r];
    for (int64_t q = b.q0; q < b.q1; ++q) {
      row[b.ci[q]] += gr_w * b.cw[q];
    }
  }
}

// f(t, in, out) for each RoI t of `taps` and channel c, where
// in = (t.batch * channels + c) * plane is the offset of the input plane the
// RoI reads and out = (i * channels + c) * bins that of its pooled bins.
// `Scatter` (the backward passes, which add into the input planes) splits
// the work by input plane: one thread a plane, its RoIs in index order, so
// the sums do not depend on the thread count.  The forward passes split it
// any way that keeps the threads busy.
template <bool Scatter, typename Taps, typename F>
inline void for_each_roi_plane(const std::vector<Taps>& taps, int64_t n_images,
                               int64_t channels, int64_t plane, int64_t bins,
                               const F& f) {
  const auto pair = [&](int64_t i, int64_t c) {
    const Taps& t = taps[static_cast<size_t>(i)];
    f(t, (t.batch * channels + c) * plane, (i * channels + c) * bins);
  };
  if constexpr (Scatter) {
    parallel_over_planes(images_of(taps), n_images, channels, bins * 4, pair);
  } else {
    parallel_over_roi_channels(images_of(taps), n_images, channels, bins * 4,
                               pair);
  }
}

}  // namespace torchops::cpu
