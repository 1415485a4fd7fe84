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
// Forward: parallel over (RoI, channel) pairs.  Backward: parallel over the
// (image, channel) planes of grad_input; each plane is written by one thread,
// RoI after RoI in index order, so the result is deterministic and does not
// depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/roi_align.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// The input indices along one axis that each output index p reads, with
// their summed weights: entries [offsets[p], offsets[p + 1]).
template <typename T>
struct AxisTaps {
  std::vector<int64_t> offsets;
  std::vector<int64_t> index;
  std::vector<T> weight;

  // `scratch` holds `size` zeros on entry and on exit.
  void build(T start, T bin, int64_t grid, int64_t size, int64_t pooled,
             T scale, std::vector<T>& scratch) {
    offsets.assign(1, 0);
    index.clear();
    weight.clear();
    for (int64_t p = 0; p < pooled; ++p) {
      int64_t first = size, last = -1;
      for (int64_t i = 0; i < grid; ++i) {
        int64_t lo, hi;
        T w_lo, w_hi;
        if (!roi_align_axis(roi_align_sample(start, bin, p, i, grid), size, lo,
                            hi, w_lo, w_hi)) {
          continue;
        }
        scratch[lo] += w_lo * scale;
        scratch[hi] += w_hi * scale;
        first = std::min(first, lo);
        last = std::max(last, hi);
      }
      // Samples move monotonically along the axis, so their taps lie in
      // [first, last]; collect the non-zero ones in order.
      for (int64_t j = first; j <= last; ++j) {
        if (scratch[j] != T(0)) {
          index.push_back(j);
          weight.push_back(scratch[j]);
          scratch[j] = T(0);
        }
      }
      offsets.push_back(static_cast<int64_t>(index.size()));
    }
  }
};

template <typename T>
struct RoiTaps {
  int64_t batch = 0;
  AxisTaps<T> rows, cols;
};

struct RoiAlignParams {
  double spatial_scale;
  int64_t pooled_height, pooled_width, sampling_ratio;
  bool aligned;
};

// Sampling patterns of every RoI, built in parallel.
template <typename scalar_t, typename T>
std::vector<RoiTaps<T>> build_taps(const scalar_t* rois, int64_t k,
                                   int64_t height, int64_t width,
                                   const RoiAlignParams& p) {
  std::vector<RoiTaps<T>> taps(static_cast<size_t>(k));
  at::parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(static_cast<size_t>(std::max(height, width)), T(0));
    for (int64_t i = begin; i < end; ++i) {
      const RoiAlignBox<T> box = roi_align_box<T>(
          rois + i * 5, static_cast<T>(p.spatial_scale), p.pooled_height,
          p.pooled_width, p.sampling_ratio, p.aligned);
      RoiTaps<T>& t = taps[static_cast<size_t>(i)];
      t.batch = box.batch;
      t.rows.build(box.start_h, box.bin_h, box.grid_h, height,
                   p.pooled_height, box.inv_count, scratch);
      t.cols.build(box.start_w, box.bin_w, box.grid_w, width, p.pooled_width,
                   T(1), scratch);
    }
  });
  return taps;
}

// One (RoI, channel): out[ph, pw] = sum_r wy * sum_q wx * plane[r, q].
template <typename scalar_t, typename T>
inline void pool_plane(const scalar_t* __restrict__ plane, int64_t width,
                       const RoiTaps<T>& t, int64_t pooled_height,
                       int64_t pooled_width, scalar_t* __restrict__ out) {
  const int64_t* ri = t.rows.index.data();
  const T* rw = t.rows.weight.data();
  const int64_t* ci = t.cols.index.data();
  const T* cw = t.cols.weight.data();
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t r0 = t.rows.offsets[ph], r1 = t.rows.offsets[ph + 1];
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      const int64_t q0 = t.cols.offsets[pw], q1 = t.cols.offsets[pw + 1];
      T acc = T(0);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = plane + ri[r] * width;
        T s = T(0);
        for (int64_t q = q0; q < q1; ++q) {
          s += cw[q] * static_cast<T>(row[ci[q]]);
        }
        acc += rw[r] * s;
      }
      out[ph * pooled_width + pw] = static_cast<scalar_t>(acc);
    }
  }
}

// The transpose of pool_plane: plane[r, q] += g[ph, pw] * wy * wx.
template <typename scalar_t, typename acc_t>
inline void scatter_plane(const scalar_t* __restrict__ grad,
                          const RoiTaps<acc_t>& t, int64_t pooled_height,
                          int64_t pooled_width, int64_t width,
                          acc_t* __restrict__ plane) {
  const int64_t* ri = t.rows.index.data();
  const acc_t* rw = t.rows.weight.data();
  const int64_t* ci = t.cols.index.data();
  const acc_t* cw = t.cols.weight.data();
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t r0 = t.rows.offsets[ph], r1 = t.rows.offsets[ph + 1];
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      const int64_t q0 = t.cols.offsets[pw], q1 = t.cols.offsets[pw + 1];
      const acc_t g = static_cast<acc_t>(grad[ph * pooled_width + pw]);
      for (int64_t r = r0; r < r1; ++r) {
        acc_t* row = plane + ri[r] * width;
        const acc_t gr = g * rw[r];
        for (int64_t q = q0; q < q1; ++q) {
          row[ci[q]] += gr * cw[q];
        }
      }
    }
  }
}

// Items of (pooled_height * pooled_width)-sized work per parallel chunk.
int64_t grain_for(int64_t bins) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, bins));
}

at::Tensor roi_align(const at::Tensor& input_in, const at::Tensor& rois_in,
                     double spatial_scale, int64_t pooled_height,
                     int64_t pooled_width, int64_t sampling_ratio,
                     bool aligned) {
  const char* op = "roi_align";
  check_roi_forward(op, input_in, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CPU);
  check_roi_align_sampling(op, sampling_ratio);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  at::Tensor out =
      at::empty({k, channels, pooled_height, pooled_width}, input.options());
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
            build_taps<scalar_t, T>(rp, k, height, width, p);
        const scalar_t* in = input.const_data_ptr<scalar_t>();
        scalar_t* op_ = out.mutable_data_ptr<scalar_t>();
        const int64_t bins = pooled_height * pooled_width;
        const int64_t plane = height * width;
        at::parallel_for(0, k * channels, grain_for(bins),
                         [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const RoiTaps<T>& t = taps[static_cast<size_t>(i / channels)];
            const int64_t c = i % channels;
            pool_plane(in + (t.batch * channels + c) * plane, width, t,
                       pooled_height, pooled_width, op_ + i * bins);
          }
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
  check_roi_align_sampling(op, sampling_ratio);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0);
  const at::ScalarType dtype = grad.scalar_type();
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_input = at::zeros({batch_size, channels, height, width},
                                    grad.options().dtype(acc_type));
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
            build_taps<scalar_t, T>(rp, k, height, width, p);
        std::vector<std::vector<int64_t>> rois_of(static_cast<size_t>(batch_size));
        for (int64_t i = 0; i < k; ++i) {
          rois_of[static_cast<size_t>(taps[static_cast<size_t>(i)].batch)].push_back(i);
        }
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        T* gi = grad_input.mutable_data_ptr<T>();
        const int64_t bins = pooled_height * pooled_width;
        const int64_t plane = height * width;
        const int64_t rois_per_image = std::max<int64_t>(1, k / std::max<int64_t>(1, batch_size));
        at::parallel_for(
            0, batch_size * channels,
            std::max<int64_t>(1, grain_for(bins) / rois_per_image),
            [&](int64_t begin, int64_t end) {
              for (int64_t bc = begin; bc < end; ++bc) {
                const int64_t b = bc / channels, c = bc % channels;
                for (const int64_t i : rois_of[static_cast<size_t>(b)]) {
                  scatter_plane(gp + (i * channels + c) * bins,
                                taps[static_cast<size_t>(i)], pooled_height,
                                pooled_width, width, gi + bc * plane);
                }
              }
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
