// CUDA kernels of torchops.deform_roi_pool and its backward.
//
// Bins are roi_align's (aligned) moved by the offset (common/
// deform_roi_pool.h), so the forward and the input's gradient are the
// RoI-Align-style kernels (cuda/common/roi_bins.cuh, roi_gather.cuh) with
// DeformBoxes: the same thread layouts and the same choice of backward
// (roi_gather_by_default: the sort-and-gather with a fixed sampling ratio and
// under torch.use_deterministic_algorithms(True), atomics otherwise).
//
// The offset's gradient sums over channels.  One thread per grad element
// (channel-major, the order that keeps the input planes in L2) computes its
// channel's share -- in the default mode in the same pass that scatters
// grad_input -- and writes it to a (2, C, K * PH * PW) buffer, which a
// second kernel sums over channels in order: no atomics, so grad_offset is
// bitwise reproducible in both modes.  Scratch: two values of the compute
// type per grad element (100 MB at 2 x 256 channels, 1000 RoIs, 7 x 7).
//
// RoIs whose batch index is not an image of the input pool to zeros and get
// no gradient (input or offset).
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

// One grad element (k, c, ph, pw): its channel's share of d loss / d offset
// of bin (k, ph, pw) into partial[c] (x) and partial[C + c] (y), rows of K *
// PH * PW; with kScatter, also its grad_input taps, with atomics.  The
// derivative of a sample along x is slope_x * (the y-interpolated
// difference of its right and left columns), likewise along y
// (common/deform_roi_pool.h).
// plane_t indexes inside one (H, W) plane: int32 where plane_fits_int32,
// as in the forward (roi_bins.cuh).
template <typename scalar_t, typename T, typename index_t, typename plane_t, bool kScatter>
__global__ void __launch_bounds__(kRoiThreads) deform_roi_pool_backward_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs,
    const scalar_t* __restrict__ input, Strides4 is,
    DeformBoxes<scalar_t, T> boxes, RoiGrid g, index_t total,
    T* __restrict__ grad_input, T* __restrict__ partial) {
  const int64_t n_bins = g.rois * g.pooled_height * g.pooled_width;
  const plane_t height = static_cast<plane_t>(g.height), width = static_cast<plane_t>(g.width);
  const plane_t in_h = static_cast<plane_t>(is.h), in_w = static_cast<plane_t>(is.w);
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = roi_bin_of<RoiOrder::kChannelsOuter, index_t>(
        i, static_cast<index_t>(g.channels),
        static_cast<index_t>(g.pooled_height),
        static_cast<index_t>(g.pooled_width), static_cast<index_t>(g.rois));
    const DeformRoiBox<T> d = boxes.roi(b.k);
    const RoiAlignBox<T> box = boxes.bin(d, b.k, b.ph, b.pw);
    T dx = T(0), dy = T(0);
    if (valid_image(box.batch, g)) {
      const T gv = static_cast<T>(grad[b.k * gs.n + b.c * gs.c + b.ph * gs.h +
                                       b.pw * gs.w]) * box.inv_count;
      const scalar_t* plane = input + box.batch * is.n + b.c * is.c;
      T* gplane = kScatter ? grad_input + (box.batch * g.channels + b.c) *
                                              g.height * g.width
                           : nullptr;
      const plane_t ph = static_cast<plane_t>(b.ph), pw = static_cast<plane_t>(b.pw);
      const plane_t grid_h = static_cast<plane_t>(box.grid_h);
      const plane_t grid_w = static_cast<plane_t>(box.grid_w);
      for (plane_t iy = 0; iy < grid_h; ++iy) {
        const T vy = roi_align_sample(box.start_h, box.bin_h, ph, iy, grid_h);
        AxisTap<T, plane_t> ty;
        if (!roi_align_axis(vy, height, ty.lo, ty.hi, ty.w_lo, ty.w_hi)) {
          continue;
        }
        const T sy = roi_align_slope(vy, g.height);
        const scalar_t* row0 = plane + ty.lo * in_h;
        const scalar_t* row1 = plane + ty.hi * in_h;
        for (plane_t ix = 0; ix < grid_w; ++ix) {
          const T vx = roi_align_sample(box.start_w, box.bin_w, pw, ix, grid_w);
          AxisTap<T, plane_t> tx;
          if (!roi_align_axis(vx, width, tx.lo, tx.hi, tx.w_lo, tx.w_hi)) {
            continue;
          }
          const T sx = roi_align_slope(vx, g.width);
          const T v00 = static_cast<T>(row0[tx.lo * in_w]);
          const T v01 = static_cast<T>(row0[tx.hi * in_w]);
          const T v10 = static_cast<T>(row1[tx.lo * in_w]);
          const T v11 = static_cast<T>(row1[tx.hi * in_w]);
          dx += sx * (ty.w_lo * (v01 - v00) + ty.w_hi * (v11 - v10));
          dy += sy * (tx.w_lo * (v10 - v00) + tx.w_hi * (v11 - v01));
          if constexpr (kScatter) {
            const T gy0 = gv * ty.w_lo, gy1 = gv * ty.w_hi;
            T* r0 = gplane + ty.lo * width;
            T* r1 = gplane + ty.hi * width;
            atomicAdd(r0 + tx.lo, gy0 * tx.w_lo);
            atomicAdd(r0 + tx.hi, gy0 * tx.w_hi);
            atomicAdd(r1 + tx.lo, gy1 * tx.w_lo);
            atomicAdd(r1 + tx.hi, gy1 * tx.w_hi);
          }
        }
      }
      dx *= gv * d.gain_w;
      dy *= gv * d.gain_h;
    }
    const int64_t bin = (b.k * g.pooled_height + b.ph) * g.pooled_width + b.pw;
    partial[b.c * n_bins + bin] = dx;
    partial[(g.channels + b.c) * n_bins + bin] = dy;
  }
}

// grad_offset[k, 0, ph, pw] = sum over c of partial[c, bin] (and channel 1
// from partial[C + c]), channels in order; one thread per bin, adjacent
// threads on adjacent bins (coalesced).
template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kRoiThreads) deform_roi_pool_offset_sum_kernel(
    const T* __restrict__ partial, int64_t channels, int64_t n_bins,
    int64_t bins, scalar_t* __restrict__ grad_offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       t < n_bins; t += stride) {
    T sx = T(0), sy = T(0);
    for (int64_t c = 0; c < channels; ++c) {
      sx += partial[c * n_bins + t];
      sy += partial[(channels + c) * n_bins + t];
    }
    const int64_t k = t / bins, b = t % bins;
    grad_offset[k * 2 * bins + b] = static_cast<scalar_t>(sx);
    grad_offset[k * 2 * bins + bins + b] = static_cast<scalar_t>(sy);
  }
}

// grad_offset, contiguous (K, 2, PH, PW); with kScatter also grad_input
// (zeroed, of the compute type) by atomics.
template <typename scalar_t, bool kScatter>
void deform_roi_pool_offset_grad(const at::Tensor& grad, const at::Tensor& input,
                                 const DeformBoxes<scalar_t,
                                                   at::opmath_type<scalar_t>>& boxes,
                                 const RoiGrid& g, at::Tensor* grad_input,
                                 at::Tensor& grad_offset) {
  using T = at::opmath_type<scalar_t>;
  const int64_t total = grad.numel();
  const int64_t n_bins = g.rois * g.pooled_height * g.pooled_width;
  if (total == 0 || n_bins == 0) {
    return;
  }
  at::Tensor partial = at::empty({2 * g.channels * n_bins},
                                 grad.options().dtype(
                                     c10::CppTypeToScalarType<T>::value));
  const unsigned int blocks = grid_for(total, kRoiThreads);
  with_index_type(total, blocks, kRoiThreads, [&](auto index) {
    using index_t = decltype(index);
    with_index_type_if(plane_fits_int32(input), [&](auto plane) {
      deform_roi_pool_backward_kernel<scalar_t, T, index_t, decltype(plane), kScatter>
          <<<blocks, kRoiThreads, 0, current_stream()>>>(
              grad.const_data_ptr<scalar_t>(), strides4(grad),
              input.const_data_ptr<scalar_t>(), strides4(input), boxes, g,
              static_cast<index_t>(total),
              kScatter ? grad_input->mutable_data_ptr<T>() : nullptr,
              partial.mutable_data_ptr<T>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  deform_roi_pool_offset_sum_kernel<scalar_t, T>
      <<<grid_for(n_bins, kRoiThreads), kRoiThreads, 0, current_stream()>>>(
          partial.const_data_ptr<T>(), g.channels, n_bins,
          g.pooled_height * g.pooled_width,
          grad_offset.mutable_data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor deform_roi_pool(const at::Tensor& input, const at::Tensor& rois_in,
                           const std::optional<at::Tensor>& offset,
                           double spatial_scale, int64_t pooled_height,
                           int64_t pooled_width, int64_t sampling_ratio,
                           double gamma) {
  const char* op = "deform_roi_pool";
  check_deform_roi_pool(op, input, rois_in, offset, pooled_height, pooled_width,
                        sampling_ratio, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  at::Tensor out =
      new_output(op, {k, channels, pooled_height, pooled_width}, input.options());
  const RoiGrid g{k, input.size(0), channels, input.size(2), input.size(3),
                  pooled_height, pooled_width};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.deform_roi_pool",
      [&] {
        launch_roi_bins_forward<scalar_t>(
            input,
            deform_boxes<scalar_t>(rois, offset, spatial_scale, gamma,
                                   sampling_ratio, g),
            g, out);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> deform_roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& rois_in,
    const std::optional<at::Tensor>& offset, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
    double gamma) {
  const char* op = "_deform_roi_pool_backward";
  check_deform_roi_pool_backward(op, grad, input, rois_in, offset,
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
  if (roi_gather_by_default(g, sampling_ratio) ||
      at::globalContext().deterministicAlgorithms()) {
    at::Tensor grad_input;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "torchops._deform_roi_pool_backward",
        [&] {
          const auto boxes = deform_boxes<scalar_t>(rois, offset, spatial_scale,
                                                    gamma, sampling_ratio, g);
          grad_input = roi_bins_backward_deterministic<scalar_t>(
              op, grad, rois, boxes, g, sampling_ratio);
          if (offset.has_value()) {
            deform_roi_pool_offset_grad<scalar_t, /*kScatter=*/false>(
                grad, input, boxes, g, nullptr, grad_offset);
          }
        });
    return {grad_input, grad_offset};
  }
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._deform_roi_pool_backward", [&] {
        const auto boxes = deform_boxes<scalar_t>(rois, offset, spatial_scale,
                                                  gamma, sampling_ratio, g);
        if (offset.has_value()) {
          deform_roi_pool_offset_grad<scalar_t, /*kScatter=*/true>(
              grad, input, boxes, g, &grad_input, grad_offset);
        } else {
          launch_roi_bins_backward_atomic<scalar_t>(grad, boxes, g, grad_input);
        }
      });
  return {grad_input.to(dtype), grad_offset};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("deform_roi_pool", &deform_roi_pool);
  m.impl("_deform_roi_pool_backward", &deform_roi_pool_backward);
}

}  // namespace torchops::cuda
