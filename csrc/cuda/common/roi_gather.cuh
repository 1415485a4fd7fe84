// The deterministic CUDA backward of the RoI-Align-style ops (roi_align,
// deform_roi_pool; `Boxes`: see cuda/common/roi_bins.cuh), used under
// torch.use_deterministic_algorithms(True).
//
// The scatter pattern does not depend on the channel, so it is built once
// per call as a list of (input pixel, grad bin, weight) contributions,
// sorted by pixel with a stable sort, and every grad_input element then sums
// its own contributions in that fixed order -- a gather with no atomics,
// bitwise reproducible.  Scratch memory: about 60 bytes per contribution
// (sort included), four contributions per bilinear sample: K * PH * PW * S *
// S * 4 of them, e.g. 47 MB for 1000 RoIs at 7x7 with sampling_ratio 2; plus
// channels-last copies of grad and grad_input.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cuda/common/roi_bins.cuh"

namespace torchops::cuda {

// Contributions of each RoI (adaptive sampling: the count varies per RoI;
// every bin of a RoI has the same grid).
template <typename T, typename Boxes>
__global__ void roi_contribution_counts_kernel(Boxes boxes, RoiGrid g,
                                               int64_t* __restrict__ counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= g.rois) {
    return;
  }
  const RoiAlignBox<T> box = boxes(i, 0, 0);
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  int64_t n = 0;
  if (valid_image(box.batch, g) && box.grid_h > 0 && box.grid_w > 0) {
    // Saturate absurd grids; the host rejects the total.
    n = (box.grid_h > kMaxGrid || box.grid_w > kMaxGrid)
            ? (int64_t(1) << 62)
            : box.grid_h * box.grid_w * g.pooled_height * g.pooled_width * 4;
  }
  counts[i] = n;
}

// One thread per (RoI, bin) writes the four contributions of each of the
// bin's samples, at offsets[k] (adaptive) or k * per_roi (fixed sampling,
// where invalid samples keep their slots with the sentinel key).
template <typename T, typename Boxes>
__global__ void __launch_bounds__(kRoiThreads) roi_contributions_kernel(
    Boxes boxes, RoiGrid g, int64_t n_bins,
    const int64_t* __restrict__ offsets, int64_t per_roi,
    int64_t* __restrict__ keys, int64_t* __restrict__ src,
    T* __restrict__ weight) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       t < n_bins; t += stride) {
    const int64_t pw = t % g.pooled_width;
    const int64_t ph = (t / g.pooled_width) % g.pooled_height;
    const int64_t k = t / (g.pooled_width * g.pooled_height);
    const RoiAlignBox<T> box = boxes(k, ph, pw);
    const bool valid = valid_image(box.batch, g);
    if (!valid && offsets != nullptr) {
      continue;  // counted as zero contributions
    }
    const int64_t gh = box.grid_h > 0 ? box.grid_h : 0;
    const int64_t gw = box.grid_w > 0 ? box.grid_w : 0;
    const int64_t base = (offsets != nullptr ? offsets[k] : k * per_roi) +
                         (ph * g.pooled_width + pw) * gh * gw * 4;
    const int64_t sentinel = g.n_images * g.height * g.width;
    const int64_t from = t;  // the bin (k, ph, pw), a row of grad_t
    const int64_t plane = box.batch * g.height * g.width;
    for (int64_t iy = 0; iy < gh; ++iy) {
      AxisTap<T> ty;
      const bool vy = roi_align_tap(box.start_h, box.bin_h, ph, iy, box.grid_h,
                                    g.height, ty);
      for (int64_t ix = 0; ix < gw; ++ix) {
        AxisTap<T> tx;
        const bool vx = roi_align_tap(box.start_w, box.bin_w, pw, ix,
                                      box.grid_w, g.width, tx);
        const int64_t e = base + (iy * gw + ix) * 4;
        const bool ok = valid && vy && vx;
        keys[e + 0] = ok ? plane + ty.lo * g.width + tx.lo : sentinel;
        keys[e + 1] = ok ? plane + ty.lo * g.width + tx.hi : sentinel;
        keys[e + 2] = ok ? plane + ty.hi * g.width + tx.lo : sentinel;
        keys[e + 3] = ok ? plane + ty.hi * g.width + tx.hi : sentinel;
        weight[e + 0] = ok ? ty.w_lo * tx.w_lo * box.inv_count : T(0);
        weight[e + 1] = ok ? ty.w_lo * tx.w_hi * box.inv_count : T(0);
        weight[e + 2] = ok ? ty.w_hi * tx.w_lo * box.inv_count : T(0);
        weight[e + 3] = ok ? ty.w_hi * tx.w_hi * box.inv_count : T(0);
        src[e + 0] = src[e + 1] = src[e + 2] = src[e + 3] = from;
      }
    }
  }
}

// out[d, c] = sum of weight * grad_t[src, c] over the contributions
// [bounds[d], bounds[d + 1]) of pixel d, in order.  grad_t is grad as
// (K * PH * PW, C) and out is grad_input as (N * H * W, C): adjacent threads
// take adjacent channels, so a warp shares one pixel's contribution list
// (broadcast loads, no divergence) and its grad and output accesses are
// contiguous.
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kRoiThreads) roi_gather_kernel(
    const scalar_t* __restrict__ grad_t, const int64_t* __restrict__ bounds,
    const int64_t* __restrict__ src, const T* __restrict__ weight,
    index_t channels, index_t total, scalar_t* __restrict__ out) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const index_t c = i % channels;
    const index_t d = i / channels;
    const int64_t j1 = bounds[d + 1];
    T acc = T(0);
    for (int64_t j = bounds[d]; j < j1; ++j) {
      acc += weight[j] * static_cast<T>(grad_t[src[j] * channels + c]);
    }
    out[i] = static_cast<scalar_t>(acc);
  }
}

// grad_input (N, C, H, W), contiguous, of grad's dtype: the transpose of the
// forward applied to grad (K, C, PH, PW), bitwise reproducible.  `rois`
// only supplies the device and the count; `sampling_ratio` > 0 means every
// RoI has that fixed grid (no host sync), else the grids come from `boxes`
// (one sync).  `op` names the operator in errors.  Needs at least one RoI.
template <typename scalar_t, typename Boxes>
at::Tensor roi_bins_backward_deterministic(const char* op, const at::Tensor& grad,
                                           const at::Tensor& rois,
                                           const Boxes& boxes, const RoiGrid& g,
                                           int64_t sampling_ratio) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k = g.rois;
  const int64_t bins = g.pooled_height * g.pooled_width;
  const int64_t plane = g.height * g.width;
  const auto long_opts = rois.options().dtype(at::kLong);

  // Where each RoI's contributions start.  Fixed sampling: k * per_roi, no
  // sync.  Adaptive: counted on the device, summed on the host (one sync).
  int64_t total = 0, per_roi = 0;
  at::Tensor offsets;
  if (sampling_ratio > 0) {
    per_roi = bins * sampling_ratio * sampling_ratio * 4;
    TORCH_CHECK(sampling_ratio <= (int64_t(1) << 12) &&
                    per_roi <= (int64_t(1) << 40) / std::max<int64_t>(k, 1),
                "torchops.", op, ": too many samples for the deterministic "
                "backward (sampling_ratio ", sampling_ratio, ", ", k, " RoIs)");
    total = k * per_roi;
  } else {
    at::Tensor counts = at::empty({k}, long_opts);
    roi_contribution_counts_kernel<T, Boxes>
        <<<ceil_div(k, kRoiThreads), kRoiThreads, 0, current_stream()>>>(
            boxes, g, counts.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor host = counts.cpu();
    std::vector<int64_t> starts(static_cast<size_t>(k) + 1, 0);
    const int64_t* c = host.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < k; ++i) {
      TORCH_CHECK(c[i] <= (int64_t(1) << 40) - starts[i], "torchops.", op,
                  ": too many samples for the deterministic backward "
                  "(adaptive sampling of RoI ", i, ")");
      starts[i + 1] = starts[i] + c[i];
    }
    total = starts[k];
    offsets = at::empty({k + 1}, long_opts.device(at::kCPU));
    std::copy(starts.begin(), starts.end(), offsets.mutable_data_ptr<int64_t>());
    offsets = offsets.to(rois.device());
  }

  // Written as (N, H, W, C) memory, returned as contiguous NCHW.
  at::Tensor grad_input =
      at::empty({g.n_images, g.channels, g.height, g.width}, grad.options(),
                at::MemoryFormat::ChannelsLast);
  if (grad_input.numel() == 0) {
    return grad_input.contiguous();
  }
  at::Tensor keys = at::empty({total}, long_opts);
  at::Tensor src = at::empty({total}, long_opts);
  at::Tensor weight = at::empty({total}, grad.options().dtype(
                                             c10::CppTypeToScalarType<T>::value));
  const int64_t n_bins = k * bins;
  if (n_bins > 0 && total > 0) {
    roi_contributions_kernel<T, Boxes>
        <<<grid_for(n_bins, kRoiThreads), kRoiThreads, 0, current_stream()>>>(
            boxes, g, n_bins,
            offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr,
            per_roi, keys.mutable_data_ptr<int64_t>(),
            src.mutable_data_ptr<int64_t>(), weight.mutable_data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // A stable sort keeps contributions to one pixel in generation order, so
  // the order of the sums below is fixed.
  const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0,
                               /*descending=*/false);
  const at::Tensor& order = std::get<1>(sorted);
  const at::Tensor sorted_src = src.index_select(0, order);
  const at::Tensor sorted_weight = weight.index_select(0, order);
  const at::Tensor bounds = at::searchsorted(
      std::get<0>(sorted), at::arange(g.n_images * plane + 1, long_opts));

  // Channels innermost on both sides of the gather (see the kernel); the
  // two transposes cost far less than strided gathers would.
  const at::Tensor grad_t = grad.permute({0, 2, 3, 1}).contiguous();
  const int64_t threads_total = grad_input.numel();
  const unsigned int blocks = grid_for(threads_total, kRoiThreads);
  with_index_type(threads_total, blocks, kRoiThreads, [&](auto index) {
    using index_t = decltype(index);
    roi_gather_kernel<scalar_t, T, index_t>
        <<<blocks, kRoiThreads, 0, current_stream()>>>(
            grad_t.const_data_ptr<scalar_t>(), bounds.const_data_ptr<int64_t>(),
            sorted_src.const_data_ptr<int64_t>(),
            sorted_weight.const_data_ptr<T>(),
            static_cast<index_t>(g.channels),
            static_cast<index_t>(threads_total),
            grad_input.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input.contiguous();
}

}  // namespace torchops::cuda
