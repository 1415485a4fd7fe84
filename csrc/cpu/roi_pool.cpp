// CPU kernels of torchops.roi_pool and its backward.
//
// Each RoI's bin ranges are computed once.  Both passes run plane-major
// (cpu/common/roi_loops.h); in the backward each plane of grad_input is
// written by one thread, RoI after RoI in index order, so the result is
// deterministic.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/accumulate.h"
#include "common/roi_pool.h"
#include "common/register_kernels.h"
#include "cpu/common/roi_loops.h"

namespace torchops::cpu {
namespace {

// Pixel ranges of every bin of one RoI, per axis.
struct BinRanges {
  int64_t batch = 0;
  std::vector<int64_t> h_lo, h_hi, w_lo, w_hi;

  template <typename T, typename scalar_t>
  void build(const scalar_t* roi, T spatial_scale, int64_t pooled_height,
             int64_t pooled_width, int64_t height, int64_t width) {
    const RoiPoolBox<T> b =
        roi_pool_box<T>(roi, spatial_scale, pooled_height, pooled_width);
    batch = b.batch;
    h_lo.resize(pooled_height);
    h_hi.resize(pooled_height);
    w_lo.resize(pooled_width);
    w_hi.resize(pooled_width);
    for (int64_t ph = 0; ph < pooled_height; ++ph) {
      roi_pool_bin(b.bin_h, ph, b.start_h, height, h_lo[ph], h_hi[ph]);
    }
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      roi_pool_bin(b.bin_w, pw, b.start_w, width, w_lo[pw], w_hi[pw]);
    }
  }
};

std::tuple<at::Tensor, at::Tensor> roi_pool(const at::Tensor& input_in,
                                            const at::Tensor& rois_in,
                                            double spatial_scale,
                                            int64_t pooled_height,
                                            int64_t pooled_width) {
  const char* op = "roi_pool";
  check_roi_forward(op, input_in, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CPU);
  const at::Tensor input = input_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  at::Tensor out =
      new_output(op, {k, channels, pooled_height, pooled_width}, input.options());
  at::Tensor argmax = new_output(op, out.sizes(), input.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_pool", [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, input.size(0));
        if (out.numel() == 0) {
          return;
        }
        std::vector<BinRanges> ranges(static_cast<size_t>(k));
        std::vector<int64_t> images(static_cast<size_t>(k));
        for (int64_t i = 0; i < k; ++i) {
          ranges[i].build<T>(rp + i * 5, static_cast<T>(spatial_scale),
                             pooled_height, pooled_width, height, width);
          images[i] = ranges[i].batch;
        }
        const scalar_t* in = input.const_data_ptr<scalar_t>();
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        int64_t* am = argmax.mutable_data_ptr<int64_t>();
        const int64_t bins = pooled_height * pooled_width;
        const int64_t plane = height * width;
        parallel_over_roi_channels(images, input.size(0), channels, bins * 4,
                                   [&](int64_t i, int64_t c) {
          const BinRanges& r = ranges[static_cast<size_t>(i)];
          const scalar_t* pl = in + (r.batch * channels + c) * plane;
          const int64_t base = (i * channels + c) * bins;
          for (int64_t ph = 0; ph < pooled_height; ++ph) {
            for (int64_t pw = 0; pw < pooled_width; ++pw) {
              const bool empty =
                  r.h_hi[ph] <= r.h_lo[ph] || r.w_hi[pw] <= r.w_lo[pw];
              T best = empty ? T(0) : roi_pool_initial_max<T>();
              int64_t best_at = -1;
              for (int64_t h = r.h_lo[ph]; h < r.h_hi[ph]; ++h) {
                for (int64_t w = r.w_lo[pw]; w < r.w_hi[pw]; ++w) {
                  const T v = static_cast<T>(pl[h * width + w]);
                  if (v > best) {
                    best = v;
                    best_at = h * width + w;
                  }
                }
              }
              o[base + ph * pooled_width + pw] = static_cast<scalar_t>(best);
              am[base + ph * pooled_width + pw] = best_at;
            }
          }
        });
      });
  return {out, argmax};
}

at::Tensor roi_pool_backward(const at::Tensor& grad_in,
                             const at::Tensor& rois_in,
                             const at::Tensor& argmax_in, double spatial_scale,
                             int64_t pooled_height, int64_t pooled_width,
                             int64_t batch_size, int64_t channels,
                             int64_t height, int64_t width) {
  const char* op = "_roi_pool_backward";
  (void)spatial_scale;  // the argmax already says where each value came from
  check_roi_backward(op, grad_in, rois_in, pooled_height, pooled_width,
                     batch_size, channels, height, width, c10::DeviceType::CPU);
  check_device_type(op, {argmax_in, "argmax"}, c10::DeviceType::CPU);
  check_roi_pool_argmax(op, grad_in, argmax_in);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  const int64_t k = rois.size(0);
  const at::ScalarType dtype = grad.scalar_type();
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_pool_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* rp = rois.const_data_ptr<scalar_t>();
        check_roi_batch_indices<scalar_t, T>(op, rp, k, batch_size);
        if (grad_input.numel() == 0 || k == 0) {
          return;
        }
        std::vector<int64_t> images(static_cast<size_t>(k));
        for (int64_t i = 0; i < k; ++i) {
          images[i] = roi_batch_index(static_cast<T>(rp[i * 5]));
        }
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        const int64_t* am = argmax.const_data_ptr<int64_t>();
        T* gi = grad_input.mutable_data_ptr<T>();
        const int64_t bins = pooled_height * pooled_width;
        const int64_t plane = height * width;
        parallel_over_planes(images, batch_size, channels, bins,
                             [&](int64_t i, int64_t c) {
          T* dst = gi + (images[i] * channels + c) * plane;
          const int64_t base = (i * channels + c) * bins;
          for (int64_t j = 0; j < bins; ++j) {
            const int64_t a = am[base + j];
            if (a == -1) {
              continue;  // empty bin: nothing was pooled
            }
            TORCH_CHECK(a >= 0 && a < plane,
                        "torchops._roi_pool_backward: 'argmax' holds ", a,
                        ", outside the ", height, "x", width, " plane");
            dst[a] += static_cast<T>(gp[base + j]);
          }
        });
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCHOPS_REGISTER_KERNELS(CPU, roi_pool)

}  // namespace torchops::cpu
