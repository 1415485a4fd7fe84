// The deterministic CUDA backward of the RoI-Align-style ops (roi_align,
// deform_roi_pool; `Boxes`: see cuda/common/roi_bins.cuh), used under
// torch.use_deterministic_algorithms(True).
//
// The scatter pattern does not depend on the channel, so it is built once
// per call as a list of (input pixel, grad bin, weight) contributions,
// sorted by pixel with a stable sort, and every grad_input element then sums
// its own contributions in that fixed order -- a gather with no atomics,
// bitwise reproducible (cuda/common/sorted_gather.cuh).  Scratch memory:
// about 24 bytes per contribution with 32-bit keys and float weights (sort
// buffers included), four contributions per bilinear sample: K * PH * PW *
// S * S * 4 of them, e.g. 19 MB for 1000 RoIs at 7x7 with sampling_ratio 2;
// plus a (bins, channels) copy of grad, the gather's values.
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

// grad (K, C, PH, PW), any strides, copied as (K * PH * PW, C) memory: the
// gather's values, channels innermost.
template <typename scalar_t>
struct GradRows {
  const scalar_t* grad;
  int64_t stride_k, stride_c, stride_h, stride_w;
  scalar_t* rows;
};

// One thread per (RoI, bin) writes the four contributions of each of the
// bin's samples, at offsets[k] (adaptive) or k * per_roi (fixed sampling,
// where invalid samples keep their slots with the sentinel key).  The same
// launch copies grad into rows (one launch and one ATen copy fewer: the
// small cases are bound by host time); index_t: the copy's index math.
template <typename scalar_t, typename T, typename key_t, typename index_t, typename Boxes>
__global__ void __launch_bounds__(kRoiThreads) roi_contributions_kernel(
    Boxes boxes, RoiGrid g, int64_t n_bins,
    const int64_t* __restrict__ offsets, int64_t per_roi,
    key_t* __restrict__ keys, Contribution<T, key_t>* __restrict__ entries,
    GradRows<scalar_t> grad) {
  {
    const index_t channels = static_cast<index_t>(g.channels);
    const index_t pw_size = static_cast<index_t>(g.pooled_width);
    const index_t ph_size = static_cast<index_t>(g.pooled_height);
    const index_t elements = static_cast<index_t>(n_bins) * channels;
    for (index_t i = grid_start<index_t>(); i < elements; i += grid_stride<index_t>()) {
      const index_t c = i % channels, t = i / channels;
      const index_t pw = t % pw_size, r = t / pw_size;
      const index_t ph = r % ph_size, k = r / ph_size;
      grad.rows[i] = grad.grad[k * grad.stride_k + c * grad.stride_c +
                               ph * grad.stride_h + pw * grad.stride_w];
    }
  }
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
        const key_t s = static_cast<key_t>(from);
        entries[e + 0] = {s, ok ? ty.w_lo * tx.w_lo * box.inv_count : T(0)};
        entries[e + 1] = {s, ok ? ty.w_lo * tx.w_hi * box.inv_count : T(0)};
        entries[e + 2] = {s, ok ? ty.w_hi * tx.w_lo * box.inv_count : T(0)};
        entries[e + 3] = {s, ok ? ty.w_hi * tx.w_hi * box.inv_count : T(0)};
      }
    }
  }
}

// Whether the gather is the backward even when determinism is not asked
// for.  With a fixed sampling ratio it is also the faster one (atomics to
// the few pixels a RoI's bins share serialise; docs/design.md), so it is the default
// there while its scratch (24 to 48 bytes per contribution) stays within a
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

  at::Tensor grad_input =
      at::empty({g.n_images, g.channels, g.height, g.width}, grad.options());
  if (grad_input.numel() == 0) {
    return grad_input;
  }
  // 32-bit keys and sources whenever they fit: the sort, the largest cost
  // here, moves half the bytes.
  const int64_t n_bins = k * bins;
  const int64_t destinations = g.n_images * plane;
  const bool narrow = fits_int32(destinations + 1) && fits_int32(n_bins);
  // The sentinel key `destinations` sorts after every pixel (unused slots).
  at::Tensor rows = at::empty({n_bins, g.channels}, grad.options());
  const GradRows<scalar_t> grad_rows{grad.const_data_ptr<scalar_t>(), grad.stride(0),
                                     grad.stride(1), grad.stride(2), grad.stride(3),
                                     rows.mutable_data_ptr<scalar_t>()};
  auto backward = [&](auto key) {
    using key_t = decltype(key);
    ContributionList<T, key_t> list(total, destinations, long_opts);
    const int64_t elements = rows.numel();
    const unsigned int blocks = grid_for(std::max(n_bins, elements), kRoiThreads);
    // The copy's index math in 32 bits when its loop and grad's offsets fit.
    int64_t last = 0;
    for (int d = 0; d < 4; ++d) {
      last += (grad.size(d) - 1) * grad.stride(d);
    }
    with_index_type_if(fits_int32(elements + int64_t(blocks) * kRoiThreads) && fits_int32(last),
                       [&](auto index) {
      using index_t = decltype(index);
      roi_contributions_kernel<scalar_t, T, key_t, index_t, Boxes>
          <<<blocks, kRoiThreads, 0, current_stream()>>>(
              boxes, g, total > 0 ? n_bins : 0,
              offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr,
              per_roi, list.key_data(), list.entry_data(), grad_rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    sorted_gather_planes<scalar_t, T, key_t>(rows.const_data_ptr<scalar_t>(), list.sort(),
                                             g.channels, plane, destinations,
                                             grad_input.mutable_data_ptr<scalar_t>());
  };
  if (narrow) {
    backward(int32_t{});
  } else {
    backward(int64_t{});
  }
  return grad_input;
}

}  // namespace torchops::cuda
