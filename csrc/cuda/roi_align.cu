// CUDA kernels of torchops.roi_align and its backward.
//
// Forward: one thread per output element, reading the input through its
// strides (no copy for channels_last or sliced inputs; for channels_last,
// adjacent threads take adjacent channels so reads coalesce).
//
// Backward, two algorithms:
//  * default: one thread per grad element scatters its four bilinear taps
//    per sample with atomicAdd (into a float32 buffer for half types).  The
//    order of the additions varies from run to run.
//  * under torch.use_deterministic_algorithms(True): the scatter pattern does
//    not depend on the channel, so it is built once per call as a list of
//    (input pixel, grad element, weight) contributions, sorted by pixel
//    with a stable sort, and every grad_input element then sums its own
//    contributions in that fixed order -- a gather with no atomics,
//    bitwise reproducible.  Scratch memory: about 60 bytes per contribution
//    (sort included), four contributions per bilinear sample: K * PH * PW *
//    S * S * 4 of them, e.g. 47 MB for 1000 RoIs at 7x7 with
//    sampling_ratio 2; plus channels-last copies of grad and grad_input.
//
// RoIs whose batch index is not an image of the input (checking it would
// need a device sync) pool to zeros and get no gradient.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/roi_align.h"
#include "cuda/common/roi.cuh"
#include "cuda/common/sorted_gather.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

struct Params {
  int64_t rois, n_images, channels, height, width;
  int64_t pooled_height, pooled_width, sampling_ratio;
  bool aligned;
};

template <typename scalar_t, typename T>
__device__ __forceinline__ RoiAlignBox<T> box_of(const scalar_t* rois,
                                                 int64_t k, T spatial_scale,
                                                 const Params& p) {
  return roi_align_box<T>(rois + k * 5, spatial_scale, p.pooled_height,
                          p.pooled_width, p.sampling_ratio, p.aligned, p.height,
                          p.width);
}

__device__ __forceinline__ bool valid_image(int64_t b, const Params& p) {
  return b >= 0 && b < p.n_images;
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

template <typename scalar_t, typename T, typename index_t, RoiOrder kOrder>
__global__ void __launch_bounds__(kThreads) roi_align_forward_kernel(
    const scalar_t* __restrict__ input, Strides4 s,
    const scalar_t* __restrict__ rois, T spatial_scale, Params p,
    index_t total, scalar_t* __restrict__ out) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = roi_bin_of<kOrder, index_t>(
        i, static_cast<index_t>(p.channels),
        static_cast<index_t>(p.pooled_height),
        static_cast<index_t>(p.pooled_width), static_cast<index_t>(p.rois));
    const RoiAlignBox<T> box = box_of(rois, b.k, spatial_scale, p);
    T acc = T(0);
    if (valid_image(box.batch, p)) {
      const scalar_t* plane = input + box.batch * s.n + b.c * s.c;
      for (int64_t iy = 0; iy < box.grid_h; ++iy) {
        AxisTap<T> ty;
        if (!roi_align_tap(box.start_h, box.bin_h, b.ph, iy, box.grid_h,
                           p.height, ty)) {
          continue;
        }
        const scalar_t* row0 = plane + ty.lo * s.h;
        const scalar_t* row1 = plane + ty.hi * s.h;
        for (int64_t ix = 0; ix < box.grid_w; ++ix) {
          AxisTap<T> tx;
          if (!roi_align_tap(box.start_w, box.bin_w, b.pw, ix, box.grid_w,
                             p.width, tx)) {
            continue;
          }
          const int64_t o0 = tx.lo * s.w, o1 = tx.hi * s.w;
          acc += ty.w_lo * (tx.w_lo * static_cast<T>(row0[o0]) +
                            tx.w_hi * static_cast<T>(row0[o1])) +
                 ty.w_hi * (tx.w_lo * static_cast<T>(row1[o0]) +
                            tx.w_hi * static_cast<T>(row1[o1]));
        }
      }
      acc *= box.inv_count;
    }
    out[roi_bin_offset(b, p.channels, p.pooled_height, p.pooled_width)] =
        static_cast<scalar_t>(acc);
  }
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
  const int64_t total = out.numel();
  if (total == 0) {
    return out;
  }
  const Params p{k, input.size(0), channels, input.size(2), input.size(3),
                 pooled_height, pooled_width, sampling_ratio, aligned};
  const unsigned int blocks = grid_for(total, kThreads);
  const bool inner = channels_inner(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_align", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(total, blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          auto launch = [&](auto order) {
            roi_align_forward_kernel<scalar_t, T, index_t, decltype(order)::value>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    input.const_data_ptr<scalar_t>(), strides4(input),
                    rois.const_data_ptr<scalar_t>(),
                    static_cast<T>(spatial_scale), p,
                    static_cast<index_t>(total),
                    out.mutable_data_ptr<scalar_t>());
          };
          if (inner) {
            launch(std::integral_constant<RoiOrder, RoiOrder::kChannelsInner>{});
          } else {
            launch(std::integral_constant<RoiOrder, RoiOrder::kChannelsOuter>{});
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return out;
}

// ---------------------------------------------------------------------------
// Backward with atomics (default)
// ---------------------------------------------------------------------------

template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_align_backward_atomic_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs,
    const scalar_t* __restrict__ rois, T spatial_scale, Params p,
    index_t total, T* __restrict__ grad_input) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = roi_bin_of<RoiOrder::kChannelsOuter, index_t>(
        i, static_cast<index_t>(p.channels),
        static_cast<index_t>(p.pooled_height),
        static_cast<index_t>(p.pooled_width), static_cast<index_t>(p.rois));
    const RoiAlignBox<T> box = box_of(rois, b.k, spatial_scale, p);
    if (!valid_image(box.batch, p)) {
      continue;
    }
    const T g = static_cast<T>(grad[b.k * gs.n + b.c * gs.c + b.ph * gs.h +
                                    b.pw * gs.w]) * box.inv_count;
    T* plane = grad_input + (box.batch * p.channels + b.c) * p.height * p.width;
    for (int64_t iy = 0; iy < box.grid_h; ++iy) {
      AxisTap<T> ty;
      if (!roi_align_tap(box.start_h, box.bin_h, b.ph, iy, box.grid_h,
                         p.height, ty)) {
        continue;
      }
      T* row0 = plane + ty.lo * p.width;
      T* row1 = plane + ty.hi * p.width;
      const T gy0 = g * ty.w_lo, gy1 = g * ty.w_hi;
      for (int64_t ix = 0; ix < box.grid_w; ++ix) {
        AxisTap<T> tx;
        if (!roi_align_tap(box.start_w, box.bin_w, b.pw, ix, box.grid_w,
                           p.width, tx)) {
          continue;
        }
        atomicAdd(row0 + tx.lo, gy0 * tx.w_lo);
        atomicAdd(row0 + tx.hi, gy0 * tx.w_hi);
        atomicAdd(row1 + tx.lo, gy1 * tx.w_lo);
        atomicAdd(row1 + tx.hi, gy1 * tx.w_hi);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Deterministic backward: contributions sorted by destination, then gathered
// ---------------------------------------------------------------------------

// Contributions of each RoI (adaptive sampling: the count varies per RoI).
template <typename scalar_t, typename T>
__global__ void roi_align_contribution_counts_kernel(
    const scalar_t* __restrict__ rois, T spatial_scale, Params p, int64_t k,
    int64_t* __restrict__ counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= k) {
    return;
  }
  const RoiAlignBox<T> box = box_of(rois, i, spatial_scale, p);
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  int64_t n = 0;
  if (valid_image(box.batch, p) && box.grid_h > 0 && box.grid_w > 0) {
    // Saturate absurd grids; the host rejects the total.
    n = (box.grid_h > kMaxGrid || box.grid_w > kMaxGrid)
            ? (int64_t(1) << 62)
            : box.grid_h * box.grid_w * p.pooled_height * p.pooled_width * 4;
  }
  counts[i] = n;
}

// One thread per (RoI, bin) writes the four contributions of each of the
// bin's samples, at offsets[k] (adaptive) or k * per_roi (fixed sampling,
// where invalid samples keep their slots with the sentinel key).
template <typename scalar_t, typename T>
__global__ void __launch_bounds__(kThreads) roi_align_contributions_kernel(
    const scalar_t* __restrict__ rois, T spatial_scale, Params p,
    int64_t n_bins, const int64_t* __restrict__ offsets, int64_t per_roi,
    int64_t* __restrict__ keys, int64_t* __restrict__ src,
    T* __restrict__ weight) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       t < n_bins; t += stride) {
    const int64_t pw = t % p.pooled_width;
    const int64_t ph = (t / p.pooled_width) % p.pooled_height;
    const int64_t k = t / (p.pooled_width * p.pooled_height);
    const RoiAlignBox<T> box = box_of(rois, k, spatial_scale, p);
    const bool valid = valid_image(box.batch, p);
    if (!valid && offsets != nullptr) {
      continue;  // counted as zero contributions
    }
    const int64_t gh = box.grid_h > 0 ? box.grid_h : 0;
    const int64_t gw = box.grid_w > 0 ? box.grid_w : 0;
    const int64_t base = (offsets != nullptr ? offsets[k] : k * per_roi) +
                         (ph * p.pooled_width + pw) * gh * gw * 4;
    const int64_t sentinel = p.n_images * p.height * p.width;
    const int64_t from = t;  // the bin (k, ph, pw), a row of grad_t
    const int64_t plane = box.batch * p.height * p.width;
    for (int64_t iy = 0; iy < gh; ++iy) {
      AxisTap<T> ty;
      const bool vy = roi_align_tap(box.start_h, box.bin_h, ph, iy, box.grid_h,
                                    p.height, ty);
      for (int64_t ix = 0; ix < gw; ++ix) {
        AxisTap<T> tx;
        const bool vx = roi_align_tap(box.start_w, box.bin_w, pw, ix,
                                      box.grid_w, p.width, tx);
        const int64_t e = base + (iy * gw + ix) * 4;
        const bool ok = valid && vy && vx;
        keys[e + 0] = ok ? plane + ty.lo * p.width + tx.lo : sentinel;
        keys[e + 1] = ok ? plane + ty.lo * p.width + tx.hi : sentinel;
        keys[e + 2] = ok ? plane + ty.hi * p.width + tx.lo : sentinel;
        keys[e + 3] = ok ? plane + ty.hi * p.width + tx.hi : sentinel;
        weight[e + 0] = ok ? ty.w_lo * tx.w_lo * box.inv_count : T(0);
        weight[e + 1] = ok ? ty.w_lo * tx.w_hi * box.inv_count : T(0);
        weight[e + 2] = ok ? ty.w_hi * tx.w_lo * box.inv_count : T(0);
        weight[e + 3] = ok ? ty.w_hi * tx.w_hi * box.inv_count : T(0);
        src[e + 0] = src[e + 1] = src[e + 2] = src[e + 3] = from;
      }
    }
  }
}

// Gather sites of grad_input as (N * H * W, C) memory: element i is
// channel c of pixel d and reads grad_t, grad as (K * PH * PW, C), at
// src * C + c.  Adjacent threads take adjacent channels, so a warp shares
// one pixel's contribution list (broadcast loads, no divergence) and its
// grad and output accesses are contiguous.
struct ChannelsInnerSites {
  int64_t channels;
  template <typename index_t>
  __device__ __forceinline__ GatherSite operator()(index_t i) const {
    const index_t c = i % static_cast<index_t>(channels);
    return {static_cast<int64_t>(i / static_cast<index_t>(channels)),
            static_cast<int64_t>(c), channels};
  }
};

template <typename scalar_t>
at::Tensor roi_align_backward_deterministic(const at::Tensor& grad,
                                            const at::Tensor& rois,
                                            double spatial_scale,
                                            const Params& p) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k = rois.size(0);
  const int64_t bins = p.pooled_height * p.pooled_width;
  const int64_t plane = p.height * p.width;
  const auto long_opts = rois.options().dtype(at::kLong);
  const T scale = static_cast<T>(spatial_scale);
  const scalar_t* rp = rois.const_data_ptr<scalar_t>();

  // Where each RoI's contributions start.  Fixed sampling: k * per_roi, no
  // sync.  Adaptive: counted on the device, summed on the host (one sync).
  int64_t total = 0, per_roi = 0;
  at::Tensor offsets;
  if (p.sampling_ratio > 0) {
    per_roi = bins * p.sampling_ratio * p.sampling_ratio * 4;
    TORCH_CHECK(p.sampling_ratio <= (int64_t(1) << 12) &&
                    per_roi <= (int64_t(1) << 40) / std::max<int64_t>(k, 1),
                "torchops._roi_align_backward: too many samples for the "
                "deterministic backward (sampling_ratio ", p.sampling_ratio,
                ", ", k, " RoIs)");
    total = k * per_roi;
  } else {
    at::Tensor counts = at::empty({k}, long_opts);
    roi_align_contribution_counts_kernel<scalar_t, T>
        <<<ceil_div(k, kThreads), kThreads, 0, current_stream()>>>(
            rp, scale, p, k, counts.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor host = counts.cpu();
    std::vector<int64_t> starts(static_cast<size_t>(k) + 1, 0);
    const int64_t* c = host.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < k; ++i) {
      TORCH_CHECK(c[i] <= (int64_t(1) << 40) - starts[i],
                  "torchops._roi_align_backward: too many samples for the "
                  "deterministic backward (adaptive sampling of RoI ", i, ")");
      starts[i + 1] = starts[i] + c[i];
    }
    total = starts[k];
    offsets = at::empty({k + 1}, long_opts.device(at::kCPU));
    std::copy(starts.begin(), starts.end(), offsets.mutable_data_ptr<int64_t>());
    offsets = offsets.to(rois.device());
  }

  // Written as (N, H, W, C) memory, returned as contiguous NCHW.
  at::Tensor grad_input =
      at::empty({p.n_images, p.channels, p.height, p.width}, grad.options(),
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
    roi_align_contributions_kernel<scalar_t, T>
        <<<grid_for(n_bins, kThreads), kThreads, 0, current_stream()>>>(
            rp, scale, p, n_bins,
            offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr,
            per_roi, keys.mutable_data_ptr<int64_t>(),
            src.mutable_data_ptr<int64_t>(), weight.mutable_data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // A stable sort keeps contributions to one pixel in generation order, so
  // the order of the sums is fixed.
  const SortedContributions sorted =
      sort_contributions(keys, src, weight, p.n_images * plane);

  // Channels innermost on both sides of the gather (see ChannelsInnerSites);
  // the two transposes cost far less than strided gathers would.
  const at::Tensor grad_t = grad.permute({0, 2, 3, 1}).contiguous();
  sorted_gather<scalar_t, T, int64_t>(
      grad_t.const_data_ptr<scalar_t>(), sorted,
      ChannelsInnerSites{p.channels}, grad_input.numel(),
      grad_input.mutable_data_ptr<scalar_t>());
  return grad_input.contiguous();
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
  const Params p{rois.size(0), batch_size, channels, height, width,
                 pooled_height, pooled_width, sampling_ratio, aligned};
  const at::ScalarType dtype = grad.scalar_type();
  if (rois.size(0) == 0 || grad.numel() == 0) {
    return new_output(op, {batch_size, channels, height, width}, grad.options(),
                      /*zero=*/true);
  }
  if (at::globalContext().deterministicAlgorithms()) {
    at::Tensor out;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "torchops._roi_align_backward", [&] {
          out = roi_align_backward_deterministic<scalar_t>(grad, rois,
                                                           spatial_scale, p);
        });
    return out;
  }
  // Half types accumulate in a float32 buffer, rounded once at the end.
  const at::ScalarType acc_type = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  if (grad_input.numel() == 0) {
    return grad_input.to(dtype);
  }
  const int64_t total = grad.numel();
  const unsigned int blocks = grid_for(total, kThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_align_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(total, blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          roi_align_backward_atomic_kernel<scalar_t, T, index_t>
              <<<blocks, kThreads, 0, current_stream()>>>(
                  grad.const_data_ptr<scalar_t>(), strides4(grad),
                  rois.const_data_ptr<scalar_t>(), static_cast<T>(spatial_scale),
                  p, static_cast<index_t>(total), grad_input.mutable_data_ptr<T>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("roi_align", &roi_align);
  m.impl("_roi_align_backward", &roi_align_backward);
}

}  // namespace torchops::cuda
