// CUDA kernels of torchops.roi_align and its backward.
//
// The kernels are those of every RoI-Align-style op (cuda/common/roi_bins.cuh:
// forward, backward with atomics; cuda/common/roi_gather.cuh: the
// sort-and-gather backward); roi_align's bins are those of roi_align_box
// (common/roi_align.h).  The gather is the backward under
// torch.use_deterministic_algorithms(True), and by default with a fixed
// sampling_ratio, where it is also the faster one; atomics otherwise.
//
// RoIs whose batch index is not an image of the input (checking it would
// need a device sync) pool to zeros and get no gradient.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "common/accumulate.h"
#include "common/roi_align.h"
#include "cuda/common/roi_bins.cuh"
#include "cuda/common/roi_gather.cuh"

namespace torchops::cuda {
namespace {

// Bin (ph, pw) of RoI k is bin (ph, pw) of its roi_align_box.
template <typename scalar_t, typename T>
struct AlignBoxes {
  const scalar_t* rois;
  T spatial_scale;
  int64_t pooled_height, pooled_width, sampling_ratio, height, width;
  bool aligned;

  __device__ __forceinline__ RoiAlignBox<T> operator()(int64_t k, int64_t,
                                                       int64_t) const {
    return roi_align_box<T>(rois + k * 5, spatial_scale, pooled_height,
                            pooled_width, sampling_ratio, aligned, height,
                            width);
  }
};

template <typename scalar_t>
AlignBoxes<scalar_t, at::opmath_type<scalar_t>> align_boxes(
    const at::Tensor& rois, double spatial_scale, const RoiGrid& g,
    int64_t sampling_ratio, bool aligned) {
  return {rois.const_data_ptr<scalar_t>(),
          static_cast<at::opmath_type<scalar_t>>(spatial_scale),
          g.pooled_height, g.pooled_width, sampling_ratio, g.height, g.width,
          aligned};
}

at::Tensor roi_align(const at::Tensor& input, const at::Tensor& rois_in,
                     double spatial_scale, int64_t pooled_height,
                     int64_t pooled_width, int64_t sampling_ratio,
                     bool aligned) {
  const char* op = "roi_align";
  check_roi_forward(op, input, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CUDA);
  check_sampling_ratio(op, sampling_ratio);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  at::Tensor out =
      new_output(op, {k, channels, pooled_height, pooled_width}, input.options());
  const RoiGrid g{k, input.size(0), channels, input.size(2), input.size(3),
                  pooled_height, pooled_width};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_align", [&] {
        launch_roi_bins_forward<scalar_t>(
            input, align_boxes<scalar_t>(rois, spatial_scale, g,
                                         sampling_ratio, aligned),
            g, out);
      });
  return out;
}

at::Tensor roi_align_backward(const at::Tensor& grad, const at::Tensor& rois_in,
                              double spatial_scale, int64_t pooled_height,
                              int64_t pooled_width, int64_t batch_size,
                              int64_t channels, int64_t height, int64_t width,
                              int64_t sampling_ratio, bool aligned) {
  const char* op = "_roi_align_backward";
  check_roi_backward(op, grad, rois_in, pooled_height, pooled_width, batch_size,
                     channels, height, width, c10::DeviceType::CUDA);
  check_sampling_ratio(op, sampling_ratio);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor rois = rois_in.contiguous();
  const RoiGrid g{rois.size(0), batch_size, channels, height, width,
                  pooled_height, pooled_width};
  const at::ScalarType dtype = grad.scalar_type();
  if (rois.size(0) == 0 || grad.numel() == 0) {
    return new_output(op, {batch_size, channels, height, width}, grad.options(),
                      /*zero=*/true);
  }
  if (roi_gather_by_default(g, sampling_ratio) ||
      at::globalContext().deterministicAlgorithms()) {
    at::Tensor out;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "torchops._roi_align_backward", [&] {
          out = roi_bins_backward_deterministic<scalar_t>(
              op, grad, rois,
              align_boxes<scalar_t>(rois, spatial_scale, g, sampling_ratio,
                                    aligned),
              g, sampling_ratio);
        });
    return out;
  }
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_align_backward", [&] {
        launch_roi_bins_backward_atomic<scalar_t>(
            grad,
            align_boxes<scalar_t>(rois, spatial_scale, g, sampling_ratio,
                                  aligned),
            g, grad_input);
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("roi_align", &roi_align);
  m.impl("_roi_align_backward", &roi_align_backward);
}

}  // namespace torchops::cuda
