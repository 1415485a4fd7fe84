// The deterministic CUDA backward of the RoI-Align-style ops (roi_align,
// deform_roi_pool; `Boxes`: see cuda/common/roi_bins.cuh), used under
// torch.use_deterministic_algorithms(True).
//
// The scatter pattern does not depend on the channel, so it is built once
// per call as a list of (input pixel, grad bin, weight) contributions,
// sorted by pixel with a stable sort, and every grad_input element then sums
// its own contributions in that fixed order -- a gather with no atomics,
// bitwise reproducible (cuda/common/sorted_gather.cuh).  Scratch memory: about 60 bytes per contribution
// (sort included), four contributions per bilinear sample: K * PH * PW * S *
// S * 4 of them, e.g. 47 MB for 1000 RoIs at 7x7 with sampling_ratio 2; plus
// channels-last copies of grad and grad_input.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "cuda/common/roi_bins.cuh"
#include "cuda/common/sorted_gather.cuh"

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
template <typename T, typename key_t, typename Boxes>
__global__ void __launch_bounds__(kRoiThreads) roi_contributions_kernel(
    Boxes boxes, RoiGrid g, int64_t n_bins,
    const int64_t* __restrict__ offsets, int64_t per_roi,
    key_t* __restrict__ keys, key_t* __restrict__ src,
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
        keys[e + 0] = static_cast<key_t>(ok ? plane + ty.lo * g.width + tx.lo : sentinel);
        keys[e + 1] = static_cast<key_t>(ok ? plane + ty.lo * g.width + tx.hi : sentinel);
        keys[e + 2] = static_cast<key_t>(ok ? plane + ty.hi * g.width + tx.lo : sentinel);
        keys[e + 3] = static_cast<key_t>(ok ? plane + ty.hi * g.width + tx.hi : sentinel);
        weight[e + 0] = ok ? ty.w_lo * tx.w_lo * box.inv_count : T(0);
        weight[e + 1] = ok ? ty.w_lo * tx.w_hi * box.inv_count : T(0);
        weight[e + 2] = ok ? ty.w_hi * tx.w_lo * box.inv_count : T(0);
        weight[e + 3] = ok ? ty.w_hi * tx.w_hi * box.inv_count : T(0);
        src[e + 0] = src[e + 1] = src[e + 2] = src[e + 3] = static_cast<key_t>(from);
      }
    }
  }
}

// Whether the gather is the backward even when determinism is not asked
// for.  With a fixed sampling ratio it is also the faster one (H200, fp32,
// roi_align at 7x7 bins, sampling_ratio 2, forward + backward: 1.05 vs 2.21
// ms with atomics at 2x256x200x200 with 1000 RoIs), so it is the default
// there while its scratch (about 60 bytes per contribution) stays within a
// few times grad_input's own size.  Adaptive sampling would need a device
// sync to size the contribution list: atomics by default then.
inline bool roi_gather_by_default(const RoiGrid& g, int64_t sampling_ratio) {
  if (sampling_ratio <= 0) {
    return false;
  }
  // In double: a product of arbitrary sizes cannot overflow it.
  const double contributions = static_cast<double>(g.rois) *
                               static_cast<double>(g.pooled_height) *
                               static_cast<double>(g.pooled_width) *
                               static_cast<double>(sampling_ratio) *
                               static_cast<double>(sampling_ratio) * 4.0;
  const double grad_input_elements =
      static_cast<double>(g.n_images) * static_cast<double>(g.channels) *
      static_cast<double>(g.height) * static_cast<double>(g.width);
  return contributions <= grad_input_elements / 4;
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
  // Before any size arithmetic: grad_input's sizes are arguments.
  check_output_size(op, {g.n_images, g.channels, g.height, g.width}, grad.options());
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
  // 32-bit keys and sources whenever they fit: the sort, the largest cost
  // here, moves half the bytes.
  const int64_t n_bins = k * bins;
  const int64_t destinations = g.n_images * plane;
  const bool narrow = fits_int32(destinations + 1) && fits_int32(n_bins);
  const auto key_opts = long_opts.dtype(narrow ? at::kInt : at::kLong);
  at::Tensor keys = at::empty({total}, key_opts);
  at::Tensor src = at::empty({total}, key_opts);
  at::Tensor weight = at::empty({total}, grad.options().dtype(
                                             c10::CppTypeToScalarType<T>::value));
  auto fill = [&](auto key) {
    using key_t = decltype(key);
    if (n_bins > 0 && total > 0) {
      roi_contributions_kernel<T, key_t, Boxes>
          <<<grid_for(n_bins, kRoiThreads), kRoiThreads, 0, current_stream()>>>(
              boxes, g, n_bins,
              offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr,
              per_roi, keys.mutable_data_ptr<key_t>(), src.mutable_data_ptr<key_t>(),
              weight.mutable_data_ptr<T>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  // The sentinel key `destinations` sorts after every pixel (unused slots).
  const SortedContributions sorted = [&] {
    if (narrow) {
      fill(int32_t{});
    } else {
      fill(int64_t{});
    }
    return sort_contributions(keys, src, weight, destinations);
  }();

  // Channels innermost on both sides of the gather (ChannelsInnerSites); the
  // two transposes cost far less than strided gathers would.
  const at::Tensor grad_t = grad.permute({0, 2, 3, 1}).contiguous();
  const ChannelsInnerSites sites{g.channels};
  if (narrow) {
    sorted_gather<1, scalar_t, T, int32_t>(grad_t.const_data_ptr<scalar_t>(), sorted, sites,
                                        grad_input.numel(),
                                        grad_input.mutable_data_ptr<scalar_t>());
  } else {
    sorted_gather<1, scalar_t, T, int64_t>(grad_t.const_data_ptr<scalar_t>(), sorted, sites,
                                        grad_input.numel(),
                                        grad_input.mutable_data_ptr<scalar_t>());
  }
  return grad_input.contiguous();
}

}  // namespace torchops::cuda
