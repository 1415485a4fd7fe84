// CUDA kernels of torchops.deform_roi_pool and its backward.
//
// Bins are roi_align's (aligned) moved by the offset (common/
// deform_roi_pool.h), so the forward and the input's gradient are the
// RoI-Align-style kernels (cuda/common/roi_bins.cuh, roi_gather.cuh) with
// DeformBoxes: the same thread layouts and the same choice of backward
// (roi_gather_by_default: the sort-and-gather with a fixed sampling ratio and
// under torch.use_deterministic_algorithms(True), atomics otherwise).
//
// The offset's gradient needs, per output element, the derivative of its
// average with respect to a shift of its bin: when the offset requires a
// gradient, the forward computes these slopes from the taps it reads anyway
// (_deform_roi_pool_forward; two values of the compute type per output
// element, 100 MB at 2 x 256 channels, 1000 RoIs, 7 x 7) and the backward
// only sums grad * slope over channels, in a fixed order: no atomics, so
// grad_offset is bitwise reproducible.  (Re-reading the input's taps in the
// backward would cost as much as a second forward.)
//
// RoIs whose batch index is not an image of the input pool to zeros and get
// no gradient (input or offset).
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/accumulate.h"
#include "common/deform_roi_pool.h"
#include "cuda/common/roi_bins.cuh"
#include "cuda/common/roi_gather.cuh"

namespace torchops::cuda {
namespace {

// Bin (ph, pw) of RoI k: its aligned box's bin, moved by the offset.
template <typename scalar_t, typename T>
struct DeformBoxes {
  const scalar_t* rois;
  const scalar_t* offset;  // (K, 2, PH, PW) with strides `os`; null: none
  Strides4 os;
  T spatial_scale, gamma;
  int64_t pooled_height, pooled_width, sampling_ratio, height, width;

  __device__ __forceinline__ DeformRoiBox<T> roi(int64_t k) const {
    return deform_roi_box<T>(rois + k * 5, spatial_scale, gamma, pooled_height,
                             pooled_width, sampling_ratio, height, width);
  }

  __device__ __forceinline__ RoiAlignBox<T> bin(const DeformRoiBox<T>& d,
                                                int64_t k, int64_t ph,
                                                int64_t pw) const {
    if (offset == nullptr) {
      return d.box;
    }
    const scalar_t* o = offset + k * os.n + ph * os.h + pw * os.w;
    return shifted_box(d, static_cast<T>(o[os.c]), static_cast<T>(o[0]));
  }

  __device__ __forceinline__ RoiAlignBox<T> operator()(int64_t k, int64_t ph,
                                                       int64_t pw) const {
    return bin(roi(k), k, ph, pw);
  }
};

template <typename scalar_t>
DeformBoxes<scalar_t, at::opmath_type<scalar_t>> deform_boxes(
    const at::Tensor& rois, const std::optional<at::Tensor>& offset,
    double spatial_scale, double gamma, int64_t sampling_ratio,
    const RoiGrid& g) {
  using T = at::opmath_type<scalar_t>;
  const bool has = offset.has_value();
  return {rois.const_data_ptr<scalar_t>(),
          has ? offset->const_data_ptr<scalar_t>() : nullptr,
          has ? strides4(*offset) : Strides4{0, 0, 0, 0},
          static_cast<T>(spatial_scale),
          static_cast<T>(gamma),
          g.pooled_height,
          g.pooled_width,
          sampling_ratio,
          g.height,
          g.width};
}

// The offset's gradient: grad_offset[k, 0, ph, pw] = gain_w(k) * sum over c
// of grad[k, c, ph, pw] * slopes[0, k, c, ph, pw], and channel 1 with
// gain_h and slopes[1].  A block is kSumBins adjacent bins (coalesced
// reads) times kSumSlices channel slices; each slice sums its channels in
// order and the block adds the slices in order, so the bits are fixed.
constexpr int kSumBins = 32;
constexpr int kSumSlices = kRoiThreads / kSumBins;

template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kRoiThreads) deform_roi_pool_offset_grad_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs, const T* __restrict__ slopes,
    DeformBoxes<scalar_t, T> boxes, RoiGrid g, scalar_t* __restrict__ grad_offset) {
  __shared__ T part[2][kSumSlices][kSumBins];
  const int64_t bins = g.pooled_height * g.pooled_width;
  const int64_t n_bins = g.rois * bins;
  const int64_t plane = g.rois * g.channels * bins;  // slopes[1] - slopes[0]
  const int lane = static_cast<int>(threadIdx.x) % kSumBins;
  const int slice = static_cast<int>(threadIdx.x) / kSumBins;
  const int64_t per_slice = (g.channels + kSumSlices - 1) / kSumSlices;
  const int64_t c0 = slice * per_slice;
  const int64_t c1 = c0 + per_slice < g.channels ? c0 + per_slice : g.channels;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kSumBins; base < n_bins;
       base += static_cast<int64_t>(gridDim.x) * kSumBins) {
    const int64_t t = base + lane;
    T sx = T(0), sy = T(0);
    if (t < n_bins) {
      const int64_t k = t / bins, b = t % bins;
      const int64_t ph = b / g.pooled_width, pw = b % g.pooled_width;
      const scalar_t* gp = grad + k * gs.n + ph * gs.h + pw * gs.w;
      const T* sp = slopes + k * g.channels * bins + b;
#pragma unroll 4
      for (int64_t c = c0; c < c1; ++c) {
        const T gv = static_cast<T>(gp[c * gs.c]);
        sx += gv * sp[c * bins];
        sy += gv * sp[plane + c * bins];
      }
    }
    part[0][slice][lane] = sx;
    part[1][slice][lane] = sy;
    __syncthreads();
    if (slice == 0 && t < n_bins) {
      for (int j = 1; j < kSumSlices; ++j) {
        sx += part[0][j][lane];
        sy += part[1][j][lane];
      }
      const int64_t k = t / bins, b = t % bins;
      const DeformRoiBox<T> d = boxes.roi(k);
      grad_offset[k * 2 * bins + b] = static_cast<scalar_t>(sx * d.gain_w);
      grad_offset[k * 2 * bins + bins + b] = static_cast<scalar_t>(sy * d.gain_h);
    }
    __syncthreads();
  }
}

template <typename scalar_t>
void launch_offset_grad(const at::Tensor& grad, const at::Tensor& slopes,
                        const DeformBoxes<scalar_t, at::opmath_type<scalar_t>>& boxes,
                        const RoiGrid& g, at::Tensor& grad_offset) {
  using T = at::opmath_type<scalar_t>;
  const int64_t n_bins = g.rois * g.pooled_height * g.pooled_width;
  if (n_bins == 0) {
    return;
  }
  deform_roi_pool_offset_grad_kernel<scalar_t, T>
      <<<grid_for(n_bins, kSumBins), kRoiThreads, 0, current_stream()>>>(
          grad.const_data_ptr<scalar_t>(), strides4(grad),
          slopes.const_data_ptr<T>(), boxes, g,
          grad_offset.mutable_data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward, and with `slopes` the derivatives of out along x and y
// (common/deform_roi_pool.h, check_deform_roi_pool_slopes).
at::Tensor forward(const char* op, const at::Tensor& input,
                   const at::Tensor& rois_in, const std::optional<at::Tensor>& offset,
                   double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                   int64_t sampling_ratio, double gamma, at::Tensor* slopes) {
  check_deform_roi_pool(op, input, rois_in, offset, pooled_height, pooled_width,
                        sampling_ratio, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  at::Tensor out =
      new_output(op, {k, channels, pooled_height, pooled_width}, input.options());
  if (slopes != nullptr) {
    *slopes = new_output(op, {2, k, channels, pooled_height, pooled_width},
                         input.options().dtype(accumulate_type(input.scalar_type())));
  }
  const RoiGrid g{k, input.size(0), channels, input.size(2), input.size(3),
                  pooled_height, pooled_width};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.deform_roi_pool",
      [&] {
        launch_roi_bins_forward<scalar_t>(
            input,
            deform_boxes<scalar_t>(rois, offset, spatial_scale, gamma,
                                   sampling_ratio, g),
            g, out,
            slopes != nullptr ? slopes->mutable_data_ptr<at::opmath_type<scalar_t>>()
                              : nullptr);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> deform_roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& rois_in,
    const std::optional<at::Tensor>& offset,
    const std::optional<at::Tensor>& slopes_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
    double gamma) {
  const char* op = "_deform_roi_pool_backward";
  check_deform_roi_pool_backward(op, grad, input, rois_in, offset, slopes_in,
                                 pooled_height, pooled_width, sampling_ratio,
                                 c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0);
  const int64_t batch_size = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const RoiGrid g{k, batch_size, channels, height, width, pooled_height,
                  pooled_width};
  const at::ScalarType dtype = grad.scalar_type();
  at::Tensor grad_offset = new_output(op, {k, 2, pooled_height, pooled_width},
                                      grad.options(), /*zero=*/true);
  if (k == 0 || grad.numel() == 0 || input.numel() == 0) {
    return {new_output(op, {batch_size, channels, height, width},
                       grad.options(), /*zero=*/true),
            grad_offset};
  }
  const at::Tensor slopes =
      slopes_in.has_value() ? slopes_in->contiguous() : at::Tensor();
  const bool gather = roi_gather_by_default(g, sampling_ratio) ||
                      at::globalContext().deterministicAlgorithms();
  // Half types accumulate the atomics in a float32 buffer, rounded once at
  // the end.
  at::Tensor grad_input;
  if (!gather) {
    grad_input = new_output(op, {batch_size, channels, height, width},
                            grad.options().dtype(accumulate_type(dtype)),
                            /*zero=*/true);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._deform_roi_pool_backward", [&] {
        const auto boxes = deform_boxes<scalar_t>(rois, offset, spatial_scale,
                                                  gamma, sampling_ratio, g);
        if (gather) {
          grad_input = roi_bins_backward_deterministic<scalar_t>(
              op, grad, rois, boxes, g, sampling_ratio);
        } else {
          launch_roi_bins_backward_atomic<scalar_t>(grad, boxes, g, grad_input);
        }
        if (slopes.defined()) {
          launch_offset_grad<scalar_t>(grad, slopes, boxes, g, grad_offset);
        }
      });
  return {gather ? grad_input : grad_input.to(dtype), grad_offset};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("deform_roi_pool", &deform_roi_pool_op<forward>);
  m.impl("_deform_roi_pool_forward", &deform_roi_pool_with_slopes_op<forward>);
  m.impl("_deform_roi_pool_backward", &deform_roi_pool_backward);
}

}  // namespace torchops::cuda
