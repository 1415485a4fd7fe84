// The CUDA kernels of the ops that pool RoI-Align-style bins -- averages of
// a grid of bilinear samples (common/roi_align.h) -- written once: roi_align
// and deform_roi_pool differ only in where each bin lies, which a `Boxes`
// functor says:
//
//   __device__ RoiAlignBox<T> operator()(int64_t k, int64_t ph, int64_t pw)
//
// returns a box whose bin (ph, pw) is bin (ph, pw) of RoI k (its batch index
// unchecked: a RoI whose image is not in the input, which the kernels cannot
// reject without a device sync, pools to zeros and gets no gradient).
//
// Forward: one thread per output element, reading the input through its
// strides (no copy for channels_last or sliced inputs; for channels_last,
// adjacent threads take adjacent channels so reads coalesce).
// Backward with atomics: one thread per grad element scatters its four
// bilinear taps per sample with atomicAdd (into a float32 buffer for half
// types); the order of the additions varies from run to run.  The
// deterministic backward is in cuda/common/roi_gather.cuh.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

#include "common/roi_align.h"
#include "cuda/common/roi.cuh"

namespace torchops::cuda {

constexpr int kRoiThreads = 256;

// The sizes every RoI-Align-style kernel needs.
struct RoiGrid {
  int64_t rois, n_images, channels, height, width;
  int64_t pooled_height, pooled_width;
};

__device__ __forceinline__ bool valid_image(int64_t b, const RoiGrid& g) {
  return b >= 0 && b < g.n_images;
}

// The average of the samples of bin (ph, pw) of `box` in one input plane
// (element strides stride_h, stride_w).  I indexes inside the plane: int32
// where the caller knows its offsets fit (see plane_fits_int32), since the
// per-sample index math is most of the kernel's instructions.
// With kSlopes, also the average's derivatives with respect to a shift of
// the bin's whole sampling grid along x (dx) and y (dy), in input pixels:
// for ops whose bins move (deform_roi_pool), computed from the taps the
// average reads anyway.  Along x a sample's derivative is
// roi_align_slope * (the y-interpolated difference of its right and left
// columns), likewise along y.
template <bool kSlopes, typename scalar_t, typename T, typename I>
__device__ __forceinline__ T roi_bin_average(const scalar_t* plane, I stride_h,
                                             I stride_w,
                                             const RoiAlignBox<T>& box, I ph,
                                             I pw, I height, I width, T& dx,
                                             T& dy) {
  T acc = T(0);
  const I grid_h = static_cast<I>(box.grid_h), grid_w = static_cast<I>(box.grid_w);
  for (I iy = 0; iy < grid_h; ++iy) {
    const T vy = roi_align_sample(box.start_h, box.bin_h, ph, iy, grid_h);
    AxisTap<T, I> ty;
    if (!roi_align_axis(vy, height, ty.lo, ty.hi, ty.w_lo, ty.w_hi)) {
      continue;
    }
    const scalar_t* row0 = plane + ty.lo * stride_h;
    const scalar_t* row1 = plane + ty.hi * stride_h;
    for (I ix = 0; ix < grid_w; ++ix) {
      const T vx = roi_align_sample(box.start_w, box.bin_w, pw, ix, grid_w);
      AxisTap<T, I> tx;
      if (!roi_align_axis(vx, width, tx.lo, tx.hi, tx.w_lo, tx.w_hi)) {
        continue;
      }
      const I o0 = tx.lo * stride_w, o1 = tx.hi * stride_w;
      const T v00 = static_cast<T>(row0[o0]), v01 = static_cast<T>(row0[o1]);
      const T v10 = static_cast<T>(row1[o0]), v11 = static_cast<T>(row1[o1]);
      // w_lo > 0 always; a w_hi of 0 (a sample on a pixel, or clamped to
      // the last one) leaves its taps unread (roi_align_weighted).
      acc += ty.w_lo * (tx.w_lo * v00 + roi_align_weighted(tx.w_hi, v01)) +
             roi_align_weighted(ty.w_hi, tx.w_lo * v10 + roi_align_weighted(tx.w_hi, v11));
      if constexpr (kSlopes) {
        dx += roi_align_slope(vx, static_cast<int64_t>(width)) *
              (ty.w_lo * (v01 - v00) + ty.w_hi * (v11 - v10));
        dy += roi_align_slope(vy, static_cast<int64_t>(height)) *
              (tx.w_lo * (v10 - v00) + tx.w_hi * (v11 - v01));
      }
    }
  }
  if constexpr (kSlopes) {
    dx *= box.inv_count;
    dy *= box.inv_count;
  }
  return acc * box.inv_count;
}

// plane[tap] += g * weight for every tap of bin (ph, pw) of `box`, with
// atomics; `g` already holds the 1 / count of the average.
template <typename T>
__device__ __forceinline__ void roi_bin_scatter(T* plane,
                                                const RoiAlignBox<T>& box,
                                                int64_t ph, int64_t pw,
                                                const RoiGrid& grid, T g) {
  const int64_t width = grid.width;
  for (int64_t iy = 0; iy < box.grid_h; ++iy) {
    AxisTap<T> ty;
    if (!roi_align_tap(box.start_h, box.bin_h, ph, iy, box.grid_h, grid.height,
                       ty)) {
      continue;
    }
    T* row0 = plane + ty.lo * width;
    T* row1 = plane + ty.hi * width;
    const T gy0 = g * ty.w_lo, gy1 = g * ty.w_hi;
    for (int64_t ix = 0; ix < box.grid_w; ++ix) {
      AxisTap<T> tx;
      if (!roi_align_tap(box.start_w, box.bin_w, pw, ix, box.grid_w, grid.width,
                         tx)) {
        continue;
      }
      atomicAdd(row0 + tx.lo, gy0 * tx.w_lo);
      atomicAdd(row0 + tx.hi, gy0 * tx.w_hi);
      atomicAdd(row1 + tx.lo, gy1 * tx.w_lo);
      atomicAdd(row1 + tx.hi, gy1 * tx.w_hi);
    }
  }
}

// The forward's register cap: 5 blocks of kRoiThreads per SM (<= 51
// registers).  Uncapped the kernel takes 60 registers and runs 4 blocks; the
// fifth block hides more of the loads' latency, while 6 or 8 blocks cost
// more in spilled registers than they hide.
constexpr int kRoiForwardMinBlocks = 5;

// With slopes the kernel keeps three sums per thread; it runs uncapped.
template <typename scalar_t, typename T, typename index_t, typename plane_t,
          RoiOrder kOrder, bool kSlopes, typename Boxes>
__global__ void __launch_bounds__(kRoiThreads, kSlopes ? 1 : kRoiForwardMinBlocks)
    roi_bins_forward_kernel(const scalar_t* __restrict__ input, Strides4 s,
                            Boxes boxes, RoiGrid g, index_t total,
                            scalar_t* __restrict__ out, T* __restrict__ slopes) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = roi_bin_of<kOrder, index_t>(
        i, static_cast<index_t>(g.channels),
        static_cast<index_t>(g.pooled_height),
        static_cast<index_t>(g.pooled_width), static_cast<index_t>(g.rois));
    const RoiAlignBox<T> box = boxes(b.k, b.ph, b.pw);
    T acc = T(0), dx = T(0), dy = T(0);
    if (valid_image(box.batch, g)) {
      acc = roi_bin_average<kSlopes, scalar_t, T, plane_t>(
          input + box.batch * s.n + b.c * s.c, static_cast<plane_t>(s.h),
          static_cast<plane_t>(s.w), box, static_cast<plane_t>(b.ph),
          static_cast<plane_t>(b.pw), static_cast<plane_t>(g.height),
          static_cast<plane_t>(g.width), dx, dy);
    }
    const int64_t o = roi_bin_offset(b, g.channels, g.pooled_height, g.pooled_width);
    out[o] = static_cast<scalar_t>(acc);
    if constexpr (kSlopes) {
      slopes[o] = dx;
      slopes[static_cast<int64_t>(total) + o] = dy;
    }
  }
}

// out (K, C, PH, PW), contiguous, from input (N, C, H, W) of any strides.
// With `slopes` (not null), also slopes[0] and slopes[1], each laid out as
// `out` in T = opmath_type<scalar_t>: the derivatives of out with respect
// to a shift of its bin along x and y, in input pixels (roi_bin_average).
template <typename scalar_t, typename Boxes>
void launch_roi_bins_forward(const at::Tensor& input, const Boxes& boxes,
                             const RoiGrid& g, at::Tensor& out,
                             at::opmath_type<scalar_t>* slopes = nullptr) {
  using T = at::opmath_type<scalar_t>;
  const int64_t total = out.numel();
  if (total == 0) {
    return;
  }
  const unsigned int blocks = grid_for(total, kRoiThreads);
  const bool inner = channels_inner(input);
  // In-plane offsets in 32 bits where they fit: 64-bit address arithmetic
  // is most of a sample's instructions.  Channel-major order (RoiOrder)
  // keeps the planes in use in L2, which memory order does not on large
  // feature maps.
  const bool narrow = plane_fits_int32(input);
  with_index_type(total, blocks, kRoiThreads, [&](auto index) {
    using index_t = decltype(index);
    auto launch = [&](auto plane, auto order, auto with_slopes) {
      roi_bins_forward_kernel<scalar_t, T, index_t, decltype(plane),
                              decltype(order)::value, decltype(with_slopes)::value, Boxes>
          <<<blocks, kRoiThreads, 0, current_stream()>>>(
              input.const_data_ptr<scalar_t>(), strides4(input), boxes, g,
              static_cast<index_t>(total), out.mutable_data_ptr<scalar_t>(), slopes);
    };
    using Inner = std::integral_constant<RoiOrder, RoiOrder::kChannelsInner>;
    using Outer = std::integral_constant<RoiOrder, RoiOrder::kChannelsOuter>;
    with_index_type_if(narrow, [&](auto plane) {
      auto by_order = [&](auto with_slopes) {
        if (inner) {
          launch(plane, Inner{}, with_slopes);
        } else {
          launch(plane, Outer{}, with_slopes);
        }
      };
      if (slopes != nullptr) {
        by_order(std::true_type{});
      } else {
        by_order(std::false_type{});
      }
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t, typename T, typename index_t, typename Boxes>
__global__ void __launch_bounds__(kRoiThreads) roi_bins_backward_atomic_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs, Boxes boxes, RoiGrid g,
    index_t total, T* __restrict__ grad_input) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    // Memory order, as torchvision: the forward's channels-outer order
    // would aim every thread in flight at one channel plane, and atomics to
    // the same addresses serialise.
    const RoiBin b = roi_bin_of<RoiOrder::kMemory, index_t>(
        i, static_cast<index_t>(g.channels),
        static_cast<index_t>(g.pooled_height),
        static_cast<index_t>(g.pooled_width), static_cast<index_t>(g.rois));
    const RoiAlignBox<T> box = boxes(b.k, b.ph, b.pw);
    if (!valid_image(box.batch, g)) {
      continue;
    }
    const T gv = static_cast<T>(grad[b.k * gs.n + b.c * gs.c + b.ph * gs.h +
                                     b.pw * gs.w]) * box.inv_count;
    roi_bin_scatter(
        grad_input + (box.batch * g.channels + b.c) * g.height * g.width, box,
        b.ph, b.pw, g, gv);
  }
}

// grad_input (N, C, H, W), contiguous and zeroed, of T = opmath_type of
// grad's scalar_t, += the transpose of the forward applied to grad.
template <typename scalar_t, typename Boxes>
void launch_roi_bins_backward_atomic(const at::Tensor& grad, const Boxes& boxes,
                                     const RoiGrid& g, at::Tensor& grad_input) {
  using T = at::opmath_type<scalar_t>;
  const int64_t total = grad.numel();
  if (total == 0 || grad_input.numel() == 0) {
    return;
  }
  const unsigned int blocks = grid_for(total, kRoiThreads);
  with_index_type(total, blocks, kRoiThreads, [&](auto index) {
    using index_t = decltype(index);
    roi_bins_backward_atomic_kernel<scalar_t, T, index_t, Boxes>
        <<<blocks, kRoiThreads, 0, current_stream()>>>(
            grad.const_data_ptr<scalar_t>(), strides4(grad), boxes, g,
            static_cast<index_t>(total), grad_input.mutable_data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torchops::cuda
