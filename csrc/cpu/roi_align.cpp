// CPU kernels of torchops.roi_align and its backward.
//
// Each RoI's sampling pattern is computed once and reused for every channel.
// Because bilinear sampling is separable, the pattern is stored per axis:
// for every output row ph, the input rows its samples touch with their
// summed weights (1/count folded in), and likewise for every output column.
// A bin is then sum_r wy[r] * sum_q wx[q] * in[r, q] over distinct pixels
// only: samples closer than a pixel share taps, so small bins read each
// pixel once instead of up to four times per sample.
//
// Both passes run plane-major (cpu/common/roi_loops.h): each input plane is
// read once for all RoIs of its image, and in the backward each plane of
// grad_input is written by one thread, RoI after RoI in index order, so the
// result is deterministic and independent of the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

#include "common/accumulate.h"
#include "common/env.h"
#include "common/roi_align.h"
#include "cpu/common/parallel.h"
#include "cpu/common/roi_taps.h"

namespace torchops::cpu {
namespace {

// How pool_plane / scatter_plane walk one RoI's taps (chosen per RoI by an
// operation count, in build_taps).
enum class TapWalk {
  // Per bin, every (row, column) tap through the index lists.
  kSparse,
  // Per bin, exactly 4 x 4 taps from fixed-size tables (padded with zero
  // weights): no inner loops or list bounds, the common case of
  // sampling_ratio <= 2 with bins larger than a pixel.
  kFour,
  // Per output row, one vectorised pass over every column the RoI uses
  // (sum of the row taps), then per bin a few reads of that row: cheapest
  // when the bins' columns cover their range densely (small bins).
  kDense,
};

// Testing switch: TORCHOPS_TESTING_ROI_ALIGN_WALK=sparse|four|dense makes
// every RoI walk its taps that way instead of the cheapest way, and a RoI that
// walk cannot serve raises.  The cost model alone decides which walk a box
// gets, so without this a test cannot tell which walks its boxes reached, and
// a walk that computes wrongly could go untested after a retune.  Unset,
// empty or auto: the cost-based choice.  Read at each call (common/env.h), so
// a test can set it in-process.
constexpr const char* kWalkSwitch = env::kTestingRoiAlignWalk.name;

const char* walk_name(TapWalk walk) {
  switch (walk) {
    case TapWalk::kSparse:
      return "sparse";
    case TapWalk::kFour:
      return "four";
    case TapWalk::kDense:
      return "dense";
  }
  return "?";
}

std::optional<TapWalk> forced_walk(const char* op) {
  const int i = env::choice(op, env::kTestingRoiAlignWalk);
  if (i == 0) {
    return std::nullopt;
  }
  const std::string_view v(env::kTestingRoiAlignWalk.values[i]);
  for (const TapWalk walk : {TapWalk::kSparse, TapWalk::kFour, TapWalk::kDense}) {
    if (v == walk_name(walk)) {
      return walk;
    }
  }
  TORCH_INTERNAL_ASSERT(false, kWalkSwitch, "=", v, " is allowed but names no tap walk");
}

template <typename T>
struct RoiTaps {
  int64_t batch = 0;
  AxisTaps<T> rows, cols;
  TapWalk walk = TapWalk::kSparse;
  // kFour tables: per output row 4 (row offset, weight), per output
  // column 4 (column, weight).
  Taps4<T> row4, col4;

  int64_t span() const { return cols.last - cols.first + 1; }

  // False when `forced` cannot walk these taps.
  bool choose_walk(int64_t width, std::optional<TapWalk> forced) {
    const int64_t ph = static_cast<int64_t>(rows.offsets.size()) - 1;
    const int64_t pw = static_cast<int64_t>(cols.offsets.size()) - 1;
    int64_t sparse = 0;
    for (int64_t p = 0; p < ph; ++p) {
      sparse += (rows.end(p) - rows.begin(p)) * cols.taps();
    }
    // Rough cycle counts (measured on AVX2): a sparse tap about three, a
    // padded tap a half, and a dense row pass over four rows half a cycle
    // per column plus a fixed cost, then two per column tap.  (A padded tap
    // at one cycle sent most of the benchmark's RoIs to the dense walk: 25.2
    // ms at one thread on an AVX-512 Xeon, against 19.6 with every RoI
    // padded; RoIs of 16-48 and 200-800 pixels at stride 8 alike.)
    const int64_t cost_sparse = 3 * sparse;
    const bool four = Taps4<T>::fits(rows) && Taps4<T>::fits(cols);
    const int64_t cost_four = four ? ph * pw * 8 : cost_sparse + 1;
    int64_t cost_dense = cols.taps() == 0 ? cost_sparse + 1 : 2 * ph * cols.taps();
    for (int64_t p = 0; p < ph && cols.taps() > 0; ++p) {
      cost_dense += (rows.end(p) - rows.begin(p) + 3) / 4 * (span() / 2 + 8);
    }
    walk = TapWalk::kSparse;
    if (cost_four <= cost_sparse && cost_four <= cost_dense) {
      walk = TapWalk::kFour;
    } else if (cost_dense < cost_sparse) {
      walk = TapWalk::kDense;
    }
    if (forced) {
      // The same conditions that keep the cost model off these walks: kFour
      // indexes each bin's first tap, kDense spans the RoI's columns.
      if ((*forced == TapWalk::kFour && !four) ||
          (*forced == TapWalk::kDense && cols.taps() == 0)) {
        return false;
      }
      walk = *forced;
    }
    if (walk == TapWalk::kFour) {
      row4.build(rows, width);
      col4.build(cols, 1);
    }
    return true;
  }
};

struct RoiAlignParams {
  double spatial_scale;
  int64_t pooled_height, pooled_width, sampling_ratio;
  bool aligned;
};

// Sampling patterns of every RoI, built in parallel.
template <typename scalar_t, typename T>
std::vector<RoiTaps<T>> build_taps(const char* op, const scalar_t* rois,
                                   int64_t k, int64_t height, int64_t width,
                                   const RoiAlignParams& p,
                                   std::optional<TapWalk> forced) {
  std::vector<RoiTaps<T>> taps(static_cast<size_t>(k));
  at::parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(static_cast<size_t>(std::max(height, width)), T(0));
    for (int64_t i = begin; i < end; ++i) {
      const RoiAlignBox<T> box = roi_align_box<T>(
          rois + i * 5, static_cast<T>(p.spatial_scale), p.pooled_height,
          p.pooled_width, p.sampling_ratio, p.aligned, height, width);
      RoiTaps<T>& t = taps[static_cast<size_t>(i)];
      t.batch = box.batch;
      t.rows.build(box.start_h, box.bin_h, box.grid_h, height,
                   p.pooled_height, box.inv_count, scratch);
      t.cols.build(box.start_w, box.bin_w, box.grid_w, width, p.pooled_width,
                   T(1), scratch);
      TORCH_CHECK(t.choose_walk(width, forced), "torchops.", op, ": ",
                  kWalkSwitch, "=", walk_name(*forced), " cannot walk RoI ", i,
                  " (four needs 1 to 4 input rows and columns in every bin, "
                  "dense a RoI that samples some column)");
    }
  });
  return taps;
}

// acc[j] = sum_r w[r] * plane[rows[r], x0 + j] for j < n: the vectorised
// row pass, compiled per input dtype for AVX2 and the baseline.  Rows go
// four at a time (a missing one is the first with weight zero), so acc is
// stored once per four rows.
template <typename scalar_t, typename T>
inline __attribute__((always_inline)) void weighted_rows_impl(
    const scalar_t* __restrict__ plane, int64_t width,
    const int64_t* __restrict__ rows, const T* __restrict__ w, int64_t nr,
    int64_t x0, int64_t n, T* __restrict__ acc) {
  if (nr == 0) {
    std::fill(acc, acc + n, T(0));
    return;
  }
  for (int64_t r = 0; r < nr; r += 4) {
    const scalar_t* __restrict__ p[4];
    T wk[4];
    for (int k = 0; k < 4; ++k) {
      const bool real = r + k < nr;
      p[k] = plane + rows[real ? r + k : r] * width + x0;
      wk[k] = real ? w[r + k] : T(0);
    }
    const scalar_t* __restrict__ p0 = p[0];
    const scalar_t* __restrict__ p1 = p[1];
    const scalar_t* __restrict__ p2 = p[2];
    const scalar_t* __restrict__ p3 = p[3];
    const T w0 = wk[0], w1 = wk[1], w2 = wk[2], w3 = wk[3];
    if (r == 0) {
      for (int64_t j = 0; j < n; ++j) {
        acc[j] = w0 * static_cast<T>(p0[j]) + w1 * static_cast<T>(p1[j]) +
                 w2 * static_cast<T>(p2[j]) + w3 * static_cast<T>(p3[j]);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        acc[j] += w0 * static_cast<T>(p0[j]) + w1 * static_cast<T>(p1[j]) +
                  w2 * static_cast<T>(p2[j]) + w3 * static_cast<T>(p3[j]);
      }
    }
  }
}

// plane[rows[r], x0 + j] += w[r] * g[j]: the transpose of the row pass.
template <typename T>
inline __attribute__((always_inline)) void add_weighted_rows_impl(
    T* __restrict__ plane, int64_t width, const int64_t* __restrict__ rows,
    const T* __restrict__ w, int64_t nr, int64_t x0, int64_t n,
    const T* __restrict__ g) {
  for (int64_t r = 0; r < nr; ++r) {
    T* __restrict__ row = plane + rows[r] * width + x0;
    const T wr = w[r];
    for (int64_t j = 0; j < n; ++j) {
      row[j] += wr * g[j];
    }
  }
}

#define TORCHOPS_ROI_ROWS(scalar_t, T)                                        \
  TORCHOPS_CPU_MULTIVERSION void weighted_rows(                               \
      const scalar_t* plane, int64_t width, const int64_t* rows, const T* w,  \
      int64_t nr, int64_t x0, int64_t n, T* acc) {                            \
    weighted_rows_impl(plane, width, rows, w, nr, x0, n, acc);                \
  }
TORCHOPS_ROI_ROWS(float, float)
TORCHOPS_ROI_ROWS(double, double)
TORCHOPS_ROI_ROWS(c10::Half, float)
TORCHOPS_ROI_ROWS(c10::BFloat16, float)
#undef TORCHOPS_ROI_ROWS

TORCHOPS_CPU_MULTIVERSION void add_weighted_rows(
    float* plane, int64_t width, const int64_t* rows, const float* w,
    int64_t nr, int64_t x0, int64_t n, const float* g) {
  add_weighted_rows_impl(plane, width, rows, w, nr, x0, n, g);
}

TORCHOPS_CPU_MULTIVERSION void add_weighted_rows(
    double* plane, int64_t width, const int64_t* rows, const double* w,
    int64_t nr, int64_t x0, int64_t n, const double* g) {
  add_weighted_rows_impl(plane, width, rows, w, nr, x0, n, g);
}

// One (RoI, channel): out[ph, pw] = sum_r wy * sum_q wx * plane[r, q].
// `buf` holds at least `width` values.
template <typename scalar_t, typename T>
void pool_plane(const scalar_t* __restrict__ plane, int64_t width,
                const RoiTaps<T>& t, int64_t pooled_height,
                int64_t pooled_width, T* __restrict__ buf,
                scalar_t* __restrict__ out) {
  const auto [ri, rw, ci, cw] = TapArrays<T>(t.rows, t.cols);
  if (t.walk == TapWalk::kFour) {
    // Padding taps (zero weight) reread the bin's first row or column.
    for (int64_t ph = 0; ph < pooled_height; ++ph) {
      const int64_t* ro = t.row4.at_of(ph);
      const T* wr = t.row4.w_of(ph);
      for (int64_t pw = 0; pw < pooled_width; ++pw) {
        out[ph * pooled_width + pw] = static_cast<scalar_t>(settle_nan(
            sum4x4(plane, ro, wr, t.col4.at_of(pw), t.col4.w_of(pw)), plane, width,
            t.rows, ph, t.cols, pw));
      }
    }
    return;
  }
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t r0 = t.rows.begin(ph), r1 = t.rows.end(ph);
    scalar_t* o = out + ph * pooled_width;
    if (t.walk == TapWalk::kDense) {
      // buf[x - first] = sum_r wy[r] * plane[r, x], then gather per bin.
      const int64_t x0 = t.cols.first;
      weighted_rows(plane, width, ri + r0, rw + r0, r1 - r0, x0, t.span(), buf);
      for (int64_t pw = 0; pw < pooled_width; ++pw) {
        T acc = T(0);
        for (int64_t q = t.cols.begin(pw); q < t.cols.end(pw); ++q) {
          acc += cw[q] * buf[ci[q] - x0];
        }
        o[pw] = static_cast<scalar_t>(settle_nan(acc, plane, width, t.rows, ph, t.cols, pw));
      }
      continue;
    }
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      o[pw] = static_cast<scalar_t>(settle_nan(
          separable_sum(plane, width, t.rows, ph, t.cols, pw), plane, width, t.rows, ph,
          t.cols, pw));
    }
  }
}

// The transpose of pool_plane: plane[r, q] += g[ph, pw] * wy * wx.
template <typename scalar_t, typename T>
void scatter_plane(const scalar_t* __restrict__ grad, const RoiTaps<T>& t,
                   int64_t pooled_height, int64_t pooled_width, int64_t width,
                   T* __restrict__ buf, T* __restrict__ plane) {
  const auto [ri, rw, ci, cw] = TapArrays<T>(t.rows, t.cols);
  if (t.walk == TapWalk::kFour) {
    for (int64_t ph = 0; ph < pooled_height; ++ph) {
      for (int64_t pw = 0; pw < pooled_width; ++pw) {
        add4x4(static_cast<T>(grad[ph * pooled_width + pw]), t.row4.at_of(ph),
               t.row4.w_of(ph), t.col4.at_of(pw), t.col4.w_of(pw), plane);
      }
    }
    return;
  }
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t r0 = t.rows.begin(ph), r1 = t.rows.end(ph);
    const scalar_t* g = grad + ph * pooled_width;
    if (t.walk == TapWalk::kDense) {
      const int64_t x0 = t.cols.first, n = t.span();
      std::fill(buf, buf + n, T(0));
      for (int64_t pw = 0; pw < pooled_width; ++pw) {
        const T gv = static_cast<T>(g[pw]);
        for (int64_t q = t.cols.begin(pw); q < t.cols.end(pw); ++q) {
          buf[ci[q] - x0] += gv * cw[q];
        }
      }
      add_weighted_rows(plane, width, ri + r0, rw + r0, r1 - r0, x0, n, buf);
      continue;
    }
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      separable_add(static_cast<T>(g[pw]), t.rows, ph, t.cols, pw, width, plane);
    }
  }
}

// Scratch row of `width` values, one per thread.
template <typename T>
T* thread_buffer(int64_t width) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < width) {
    buf.resize(static_cast<size_t>(width));
  }
  return buf.data();
}

at::Tensor roi_align(const at::Tensor& input_in, const at::Tensor& rois_in,
                     double spatial_scale, int64_t pooled_height,
                     int64_t pooled_width, int64_t sampling_ratio,
                     bool aligned) {
  const char* op = "roi_align";
  check_roi_forward(op, input_in, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CPU);
  check_sampling_ratio(op, sampling_ratio);
  const std::optional<TapWalk> walk = forced_walk(op);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  at::Tensor out = new_output(op, {k, channels, pooled_height, pooled_width},
                              input.options());
  const RoiAlignParams p{spatial_scale, pooled_height, pooled_width,
                         sampling_ratio, aligned};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_align", [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, input.size(0));
        if (out.numel() == 0) {
          return;
        }
        const std::vector<RoiTaps<T>> taps =
            build_taps<scalar_t, T>(op, rp, k, height, width, p, walk);
        const scalar_t* in = input.const_data_ptr<scalar_t>();
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        for_each_roi_plane</*Scatter=*/false>(
            taps, input.size(0), channels, height * width,
            pooled_height * pooled_width,
            [&](const RoiTaps<T>& t, int64_t src, int64_t dst) {
              pool_plane(in + src, width, t, pooled_height, pooled_width,
                         thread_buffer<T>(width), o + dst);
            });
      });
  return out;
}

at::Tensor roi_align_backward(const at::Tensor& grad_in,
                              const at::Tensor& rois_in, double spatial_scale,
                              int64_t pooled_height, int64_t pooled_width,
                              int64_t batch_size, int64_t channels,
                              int64_t height, int64_t width,
                              int64_t sampling_ratio, bool aligned) {
  const char* op = "_roi_align_backward";
  check_roi_backward(op, grad_in, rois_in, pooled_height, pooled_width,
                     batch_size, channels, height, width, c10::DeviceType::CPU);
  check_sampling_ratio(op, sampling_ratio);
  const std::optional<TapWalk> walk = forced_walk(op);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0);
  const at::ScalarType dtype = grad.scalar_type();
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  const RoiAlignParams p{spatial_scale, pooled_height, pooled_width,
                         sampling_ratio, aligned};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_align_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, batch_size);
        if (grad_input.numel() == 0 || k == 0) {
          return;
        }
        const std::vector<RoiTaps<T>> taps =
            build_taps<scalar_t, T>(op, rp, k, height, width, p, walk);
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        T* gi = grad_input.mutable_data_ptr<T>();
        for_each_roi_plane</*Scatter=*/true>(
            taps, batch_size, channels, height * width,
            pooled_height * pooled_width,
            [&](const RoiTaps<T>& t, int64_t src, int64_t dst) {
              scatter_plane(gp + dst, t, pooled_height, pooled_width, width,
                            thread_buffer<T>(width), gi + src);
            });
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("roi_align", &roi_align);
  m.impl("_roi_align_backward", &roi_align_backward);
}

}  // namespace torchops::cpu
