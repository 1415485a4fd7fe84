// CPU kernels of torchops.deform_roi_pool and its backward.
//
// Each RoI's sampling pattern is built once for all channels as separable
// taps (cpu/common/roi_taps.h), one group of rows and one of columns per
// bin: the offset moves every bin on its own, so a row of bins no longer
// shares its rows as in roi_align.  With an offset in the backward, the taps
// also carry their slopes (d weight / d shift) for the offset's gradient.
//
// The forward and grad_input run plane-major (cpu/common/roi_loops.h), so
// grad_input is deterministic and independent of the number of threads.
// When the offset needs a gradient, the forward also writes each output's
// slopes (d out / d shift of its bin, from the taps it reads anyway), and
// the backward sums grad * slope over channels, one thread per RoI, channel
// after channel, so grad_offset is deterministic too.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "common/accumulate.h"
#include "common/deform_roi_pool.h"
#include "cpu/common/roi_loops.h"
#include "cpu/common/roi_taps.h"

namespace torchops::cpu {
namespace {

struct Params {
  double spatial_scale, gamma;
  int64_t pooled_height, pooled_width, sampling_ratio;
};

// One RoI's taps: group b = ph * pooled_width + pw of `rows` and `cols` is
// bin (ph, pw).  `four`: every bin has 1 to 4 rows and columns, padded to
// four in row4 / col4 (the walk without inner loops, as roi_align's: the
// forward twice as fast on the benchmark's RoIs).
template <typename T>
struct BinTaps {
  int64_t batch = 0;
  T gain_h = T(0), gain_w = T(0);
  AxisTaps<T> rows, cols;
  bool four = false;
  Taps4<T> row4, col4;
};

// `offset`: contiguous (K, 2, PH, PW), or null.
template <typename scalar_t, typename T>
std::vector<BinTaps<T>> build_bin_taps(const scalar_t* rois,
                                       const scalar_t* offset, int64_t k,
                                       int64_t height, int64_t width,
                                       const Params& p, bool slopes) {
  std::vector<BinTaps<T>> taps(static_cast<size_t>(k));
  const int64_t bins = p.pooled_height * p.pooled_width;
  at::parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
    const size_t n = static_cast<size_t>(std::max(height, width));
    std::vector<T> scratch(n, T(0)), dscratch(n, T(0));
    T* ds = slopes ? dscratch.data() : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const DeformRoiBox<T> d = deform_roi_box<T>(
          rois + i * 5, static_cast<T>(p.spatial_scale),
          static_cast<T>(p.gamma), p.pooled_height, p.pooled_width,
          p.sampling_ratio, height, width);
      BinTaps<T>& t = taps[static_cast<size_t>(i)];
      t.batch = d.box.batch;
      t.gain_h = d.gain_h;
      t.gain_w = d.gain_w;
      t.rows.clear(height);
      t.cols.clear(width);
      for (int64_t ph = 0; ph < p.pooled_height; ++ph) {
        for (int64_t pw = 0; pw < p.pooled_width; ++pw) {
          RoiAlignBox<T> b = d.box;
          if (offset != nullptr) {
            const scalar_t* o = offset + i * 2 * bins + ph * p.pooled_width + pw;
            b = shifted_box(d, static_cast<T>(o[bins]), static_cast<T>(o[0]));
          }
          t.rows.add_bin(b.start_h, b.bin_h, ph, b.grid_h, height, b.inv_count,
                         scratch, ds);
          t.cols.add_bin(b.start_w, b.bin_w, pw, b.grid_w, width, T(1), scratch,
                         ds);
        }
      }
      t.four = Taps4<T>::fits(t.rows) && Taps4<T>::fits(t.cols);
      if (t.four) {
        t.row4.build(t.rows, width);
        t.col4.build(t.cols, 1);
      }
    }
  });
  return taps;
}

// One (RoI, channel): out[b] = sum_r wy * sum_q wx * plane[r, q]; with
// kSlopes also sx[b] = sum_r wy * sum_q sx * plane[r, q] (the derivative
// along x, in pixels) and sy[b] likewise along y.
template <bool kSlopes, typename scalar_t, typename T>
void pool_bins(const scalar_t* __restrict__ plane, int64_t width,
               const BinTaps<T>& t, int64_t bins, scalar_t* __restrict__ out,
               T* __restrict__ sx, T* __restrict__ sy) {
  if (t.four && (!kSlopes || !t.row4.s.empty())) {
    for (int64_t b = 0; b < bins; ++b) {
      if constexpr (!kSlopes) {
        out[b] = static_cast<scalar_t>(settle_nan(
            sum4x4(plane, t.row4.at_of(b), t.row4.w_of(b), t.col4.at_of(b), t.col4.w_of(b)),
            plane, width, t.rows, b, t.cols, b));
      } else {
        const int64_t* ro = t.row4.at_of(b);
        const T* rw = t.row4.w_of(b);
        const T* rs = t.row4.s_of(b);
        const int64_t* co = t.col4.at_of(b);
        const T* cw = t.col4.w_of(b);
        const T* cs = t.col4.s_of(b);
        T acc = T(0), dx = T(0), dy = T(0);
        for (int k = 0; k < 4; ++k) {
          const scalar_t* row = plane + ro[k];
          const T v0 = static_cast<T>(row[co[0]]), v1 = static_cast<T>(row[co[1]]);
          const T v2 = static_cast<T>(row[co[2]]), v3 = static_cast<T>(row[co[3]]);
          const T vw = cw[0] * v0 + cw[1] * v1 + cw[2] * v2 + cw[3] * v3;
          acc += rw[k] * vw;
          dx += rw[k] * (cs[0] * v0 + cs[1] * v1 + cs[2] * v2 + cs[3] * v3);
          dy += rs[k] * vw;
        }
        out[b] = static_cast<scalar_t>(settle_nan(acc, plane, width, t.rows, b, t.cols, b));
        sx[b] = dx;
        sy[b] = dy;
      }
    }
    return;
  }
  if constexpr (!kSlopes) {
    for (int64_t b = 0; b < bins; ++b) {
      out[b] = static_cast<scalar_t>(settle_nan(
          separable_sum(plane, width, t.rows, b, t.cols, b), plane, width, t.rows, b, t.cols,
          b));
    }
  } else {
    const auto [ri, rw, ci, cw] = TapArrays<T>(t.rows, t.cols);
    const T* rs = t.rows.slope.data();
    const T* cs = t.cols.slope.data();
    for (int64_t b = 0; b < bins; ++b) {
      const int64_t q0 = t.cols.begin(b), q1 = t.cols.end(b);
      T acc = T(0), dx = T(0), dy = T(0);
      for (int64_t r = t.rows.begin(b); r < t.rows.end(b); ++r) {
        const scalar_t* row = plane + ri[r] * width;
        T vw = T(0), vs = T(0);
        for (int64_t q = q0; q < q1; ++q) {
          const T v = static_cast<T>(row[ci[q]]);
          vw += cw[q] * v;
          vs += cs[q] * v;
        }
        acc += rw[r] * vw;
        dx += rw[r] * vs;
        dy += rs[r] * vw;
      }
      out[b] = static_cast<scalar_t>(settle_nan(acc, plane, width, t.rows, b, t.cols, b));
      sx[b] = dx;
      sy[b] = dy;
    }
  }
}

// The transpose of pool_bins: plane[r, q] += grad[b] * wy * wx.
template <typename scalar_t, typename T>
void scatter_bins(const scalar_t* __restrict__ grad, const BinTaps<T>& t,
                  int64_t bins, int64_t width, T* __restrict__ plane) {
  if (t.four) {
    for (int64_t b = 0; b < bins; ++b) {
      add4x4(static_cast<T>(grad[b]), t.row4.at_of(b), t.row4.w_of(b), t.col4.at_of(b),
             t.col4.w_of(b), plane);
    }
    return;
  }
  for (int64_t b = 0; b < bins; ++b) {
    separable_add(static_cast<T>(grad[b]), t.rows, b, t.cols, b, width, plane);
  }
}

// The forward, and with `slopes` the derivatives of out along x and y in
// pixels, (2, K, C, PH, PW) of the compute type.
at::Tensor forward(const char* op, const at::Tensor& input_in,
                   const at::Tensor& rois_in,
                   const std::optional<at::Tensor>& offset_in,
                   double spatial_scale, int64_t pooled_height,
                   int64_t pooled_width, int64_t sampling_ratio, double gamma,
                   at::Tensor* slopes) {
  check_deform_roi_pool(op, input_in, rois_in, offset_in, pooled_height,
                        pooled_width, sampling_ratio, c10::DeviceType::CPU);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor offset =
      offset_in.has_value() ? offset_in->contiguous() : at::Tensor();
  const int64_t k = rois.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  at::Tensor out = new_output(op, {k, channels, pooled_height, pooled_width},
                              input.options());
  if (slopes != nullptr) {
    *slopes = new_output(op, {2, k, channels, pooled_height, pooled_width},
                         input.options().dtype(accumulate_type(input.scalar_type())));
  }
  const Params p{spatial_scale, gamma, pooled_height, pooled_width,
                 sampling_ratio};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.deform_roi_pool",
      [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, input.size(0));
        if (out.numel() == 0) {
          return;
        }
        const bool with_slopes = slopes != nullptr;
        const std::vector<BinTaps<T>> taps = build_bin_taps<scalar_t, T>(
            rp, offset.defined() ? offset.const_data_ptr<scalar_t>() : nullptr,
            k, height, width, p, with_slopes);
        const scalar_t* in = input.const_data_ptr<scalar_t>();
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        T* sx = with_slopes ? slopes->mutable_data_ptr<T>() : nullptr;
        T* sy = with_slopes ? sx + out.numel() : nullptr;
        const int64_t bins = pooled_height * pooled_width;
        for_each_roi_plane</*Scatter=*/false>(
            taps, input.size(0), channels, height * width, bins,
            [&](const BinTaps<T>& t, int64_t src, int64_t at) {
              if (with_slopes) {
                pool_bins<true>(in + src, width, t, bins, o + at, sx + at,
                                sy + at);
              } else {
                pool_bins<false, scalar_t, T>(in + src, width, t, bins, o + at,
                                              nullptr, nullptr);
              }
            });
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> deform_roi_pool_backward(
    const at::Tensor& grad_in, const at::Tensor& input,
    const at::Tensor& rois_in, const std::optional<at::Tensor>& offset_in,
    const std::optional<at::Tensor>& slopes_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
    double gamma) {
  const char* op = "_deform_roi_pool_backward";
  check_deform_roi_pool_backward(op, grad_in, input, rois_in, offset_in,
                                 slopes_in, pooled_height, pooled_width,
                                 sampling_ratio, c10::DeviceType::CPU);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor offset =
      offset_in.has_value() ? offset_in->contiguous() : at::Tensor();
  const at::Tensor slopes =
      slopes_in.has_value() ? slopes_in->contiguous() : at::Tensor();
  const int64_t k = rois.size(0), batch_size = input.size(0);
  const int64_t channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const at::ScalarType dtype = grad.scalar_type();
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input =
      new_output(op, {batch_size, channels, height, width},
                 grad.options().dtype(acc_type), /*zero=*/true);
  at::Tensor grad_offset = new_output(op, {k, 2, pooled_height, pooled_width},
                                      grad.options(), /*zero=*/true);
  const Params p{spatial_scale, gamma, pooled_height, pooled_width,
                 sampling_ratio};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._deform_roi_pool_backward",
      [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, batch_size);
        if (k == 0 || grad_input.numel() == 0) {
          return;
        }
        const std::vector<BinTaps<T>> taps = build_bin_taps<scalar_t, T>(
            rp, offset.defined() ? offset.const_data_ptr<scalar_t>() : nullptr, k,
            height, width, p, /*slopes=*/false);
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        const int64_t bins = pooled_height * pooled_width;
        T* gi = grad_input.mutable_data_ptr<T>();
        for_each_roi_plane</*Scatter=*/true>(
            taps, batch_size, channels, height * width, bins,
            [&](const BinTaps<T>& t, int64_t src, int64_t dst) {
              scatter_bins(gp + dst, t, bins, width, gi + src);
            });
        if (!slopes.defined()) {
          return;
        }
        // grad_offset[i, :, b] = gain * sum over c of grad * slope, channel
        // after channel.
        const T* sx = slopes.const_data_ptr<T>();
        const T* sy = sx + grad.numel();
        scalar_t* go = grad_offset.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, k, roi_grain(channels * bins), [&](int64_t begin, int64_t end) {
          std::vector<T> acc(static_cast<size_t>(2 * bins));
          for (int64_t i = begin; i < end; ++i) {
            std::fill(acc.begin(), acc.end(), T(0));
            for (int64_t c = 0; c < channels; ++c) {
              const int64_t at = (i * channels + c) * bins;
              for (int64_t b = 0; b < bins; ++b) {
                const T g = static_cast<T>(gp[at + b]);
                acc[b] += g * sx[at + b];
                acc[bins + b] += g * sy[at + b];
              }
            }
            const BinTaps<T>& t = taps[static_cast<size_t>(i)];
            for (int64_t b = 0; b < bins; ++b) {
              go[i * 2 * bins + b] = static_cast<scalar_t>(t.gain_w * acc[b]);
              go[i * 2 * bins + bins + b] = static_cast<scalar_t>(t.gain_h * acc[bins + b]);
            }
          }
        });
      });
  return {grad_input.to(dtype), grad_offset};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("deform_roi_pool", &deform_roi_pool_op<forward>);
  m.impl("_deform_roi_pool_forward", &deform_roi_pool_with_slopes_op<forward>);
  m.impl("_deform_roi_pool_backward", &deform_roi_pool_backward);
}

}  // namespace torchops::cpu
