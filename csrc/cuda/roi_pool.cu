// CUDA kernels of torchops.roi_pool and its backward.
//
// Forward: a small kernel first works out, per RoI, its image and the pixel
// range of every bin row and column (roi_pool_ranges_kernel); then one
// thread per output element takes the max over its bin, reading the input
// through its strides (channel-inner thread order for channels_last inputs,
// memory order otherwise).
//
// Backward: each grad element goes to exactly one input pixel, the one its
// argmax names.  By default with atomicAdd (into a float32 buffer for half
// types), in channel-outer thread order where the input planes do not fit
// in L2 and in memory order where they do (memory_order_scatter).  Under
// torch.use_deterministic_algorithms(True): the destinations
// are sorted with a stable sort and the first thread of each run of equal
// destinations sums the run in that fixed order (no atomics, bitwise
// reproducible; about 40 bytes of scratch per grad element, sort included).
//
// RoIs whose batch index is not an image of the input (checking it would
// need a device sync) pool to zeros with argmax -1 and get no gradient;
// argmax values outside the plane are ignored likewise.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "common/accumulate.h"
#include "common/roi_pool.h"
#include "common/register_kernels.h"
#include "cuda/common/roi.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

struct Params {
  int64_t rois, n_images, channels, height, width;
  int64_t pooled_height, pooled_width;
};

template <RoiOrder kOrder, typename index_t>
__device__ __forceinline__ RoiBinT<index_t> bin_of(index_t i, const Params& p) {
  return roi_bin_of<kOrder, index_t>(
      i, static_cast<index_t>(p.channels), static_cast<index_t>(p.pooled_height),
      static_cast<index_t>(p.pooled_width), static_cast<index_t>(p.rois));
}

template <typename I>
__device__ __forceinline__ I offset_of(const RoiBinT<I>& b, const Params& p) {
  return roi_bin_offset<I>(b, static_cast<I>(p.channels), static_cast<I>(p.pooled_height),
                           static_cast<I>(p.pooled_width));
}

// The max over one bin's pixels.  plane_t indexes inside one (H, W) plane:
// int32 whenever the plane's element offsets fit (always, in practice), since
// this loop is the kernel's whole cost and 64-bit address arithmetic doubles
// its instruction count.  A dense plane (unit column stride, rows W apart:
// any contiguous input) walks one running index that is both the load's
// offset and the argmax, as torchvision's kernel does: ncu counted 1.4x
// torchvision's instructions for the strided walk on the large bench case.
template <typename scalar_t, typename T, typename plane_t>
__device__ __forceinline__ void bin_max(const scalar_t* __restrict__ plane,
                                        plane_t stride_h, plane_t stride_w,
                                        plane_t width, plane_t h0, plane_t h1,
                                        plane_t w0, plane_t w1, T& best,
                                        plane_t& best_at) {
  if (stride_w == 1 && stride_h == width) {
    for (plane_t h = h0; h < h1; ++h) {
      for (plane_t idx = h * width + w0, end = h * width + w1; idx < end; ++idx) {
        const T v = static_cast<T>(plane[idx]);
        if (v > best) {
          best = v;
          best_at = idx;
        }
      }
    }
    return;
  }
  for (plane_t h = h0; h < h1; ++h) {
    const scalar_t* row = plane + h * stride_h;
    for (plane_t w = w0; w < w1; ++w) {
      const T v = static_cast<T>(row[w * stride_w]);
      if (v > best) {
        best = v;
        best_at = h * width + w;
      }
    }
  }
}

// What every bin of RoI k reads, computed once per RoI and bin row/column
// rather than once per output element (the forward is C times as many
// elements): ranges[k * E] is the RoI's image, or -1 when it pools to zeros;
// then the PH row ranges [lo, hi) and the PW column ranges, clipped to the
// plane (E = 1 + 2 * (PH + PW)).  Redoing roi_pool_box and roi_pool_bin
// (float-to-int64 conversions) per element would cost a quarter of the
// forward's time on small feature maps.
__host__ __device__ inline int64_t roi_pool_range_entries(const Params& p) {
  return 1 + 2 * (p.pooled_height + p.pooled_width);
}

template <typename scalar_t, typename T, typename range_t>
__global__ void __launch_bounds__(kThreads) roi_pool_ranges_kernel(
    const scalar_t* __restrict__ rois, T spatial_scale, Params p, int64_t total,
    range_t* __restrict__ ranges) {
  const int64_t per_roi = 1 + p.pooled_height + p.pooled_width;
  const int64_t e = roi_pool_range_entries(p);
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t k = i / per_roi, j = i % per_roi;
    const RoiPoolBox<T> box = roi_pool_box<T>(rois + k * 5, spatial_scale,
                                              p.pooled_height, p.pooled_width);
    range_t* r = ranges + k * e;
    int64_t lo = 0, hi = 0;
    if (j == 0) {
      r[0] = box.batch >= 0 && box.batch < p.n_images ? static_cast<range_t>(box.batch) : -1;
      continue;
    }
    if (j <= p.pooled_height) {
      roi_pool_bin(box.bin_h, j - 1, box.start_h, p.height, lo, hi);
    } else {
      roi_pool_bin(box.bin_w, j - 1 - p.pooled_height, box.start_w, p.width, lo, hi);
    }
    r[2 * j - 1] = static_cast<range_t>(lo);
    r[2 * j] = static_cast<range_t>(hi);
  }
}

// The forward's register cap: 8 blocks of kThreads per SM (<= 32
// registers), full occupancy for a kernel that waits on loads; caps of 5
// and 6 blocks are slower.
constexpr int kForwardMinBlocks = 8;

// plane_t: the type of in-plane offsets, of the ranges and of argmax's
// values (int32 when plane_fits_int32).
template <typename scalar_t, typename T, typename index_t, typename plane_t,
          RoiOrder kOrder>
__global__ void __launch_bounds__(kThreads, kForwardMinBlocks) roi_pool_forward_kernel(
    const scalar_t* __restrict__ input, Strides4 s,
    const plane_t* __restrict__ ranges, Params p,
    index_t total, scalar_t* __restrict__ out, int64_t* __restrict__ argmax) {
  const index_t e = static_cast<index_t>(roi_pool_range_entries(p));
  const index_t ph_count = static_cast<index_t>(p.pooled_height);
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBinT<index_t> b = bin_of<kOrder>(i, p);
    const plane_t* r = ranges + static_cast<int64_t>(b.k) * e;  // k * e can pass total
    const plane_t image = r[0];
    T best = T(0);
    plane_t best_at = -1;
    if (image >= 0) {
      const index_t rh = 1 + 2 * b.ph;
      const index_t rw = 1 + 2 * (ph_count + b.pw);
      const plane_t h0 = r[rh], h1 = r[rh + 1], w0 = r[rw], w1 = r[rw + 1];
      if (h1 > h0 && w1 > w0) {
        best = roi_pool_initial_max<T>();
      }
      bin_max<scalar_t, T, plane_t>(
          input + image * s.n + int64_t(b.c) * s.c, static_cast<plane_t>(s.h),
          static_cast<plane_t>(s.w), static_cast<plane_t>(p.width), h0, h1, w0,
          w1, best, best_at);
    }
    // Memory order visits the result in its own order.
    const index_t o = kOrder == RoiOrder::kMemory ? i : offset_of(b, p);
    out[o] = static_cast<scalar_t>(best);
    argmax[o] = best_at;
  }
}

std::tuple<at::Tensor, at::Tensor> roi_pool(const at::Tensor& input,
                                            const at::Tensor& rois_in,
                                            double spatial_scale,
                                            int64_t pooled_height,
                                            int64_t pooled_width) {
  const char* op = "roi_pool";
  check_roi_forward(op, input, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  at::Tensor out =
      new_output(op, {k, channels, pooled_height, pooled_width}, input.options());
  at::Tensor argmax = new_output(op, out.sizes(), input.options().dtype(at::kLong));
  const int64_t total = out.numel();
  if (total == 0) {
    return {out, argmax};
  }
  const Params p{k, input.size(0), channels, input.size(2), input.size(3),
                 pooled_height, pooled_width};
  const unsigned int blocks = grid_for(total, kThreads);
  // Thread order: adjacent channels for channels_last inputs (coalesced
  // reads); otherwise memory order, which is faster here than the
  // channels-outer order of roi_align: a
  // bin's max reads whole pixel rows, which neighbouring bins of one RoI share
  // cache lines with.
  const bool inner = channels_inner(input);
  // The ranges hold image indices too.
  const bool narrow = plane_fits_int32(input) && fits_int32(input.size(0));
  const int64_t range_total = k * (1 + pooled_height + pooled_width);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_pool", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(total, blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          auto launch = [&](auto plane, auto order) {
            using plane_t = decltype(plane);
            at::Tensor ranges =
                at::empty({k * roi_pool_range_entries(p)},
                          input.options().dtype(sizeof(plane_t) == 4 ? at::kInt : at::kLong));
            roi_pool_ranges_kernel<scalar_t, T, plane_t>
                <<<grid_for(range_total, kThreads), kThreads, 0, current_stream()>>>(
                    rois.const_data_ptr<scalar_t>(), static_cast<T>(spatial_scale), p,
                    range_total, static_cast<plane_t*>(ranges.mutable_data_ptr()));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            roi_pool_forward_kernel<scalar_t, T, index_t, plane_t,
                                    decltype(order)::value>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    input.const_data_ptr<scalar_t>(), strides4(input),
                    static_cast<const plane_t*>(ranges.const_data_ptr()), p,
                    static_cast<index_t>(total),
                    out.mutable_data_ptr<scalar_t>(),
                    argmax.mutable_data_ptr<int64_t>());
          };
          using Inner = std::integral_constant<RoiOrder, RoiOrder::kChannelsInner>;
          using Memory = std::integral_constant<RoiOrder, RoiOrder::kMemory>;
          if (narrow && inner) {
            launch(int32_t{}, Inner{});
          } else if (narrow) {
            launch(int32_t{}, Memory{});
          } else if (inner) {
            launch(int64_t{}, Inner{});
          } else {
            launch(int64_t{}, Memory{});
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {out, argmax};
}

// Flat index into grad_input of bin b's destination, or -1.
template <typename scalar_t, typename T>
__device__ __forceinline__ int64_t destination(const scalar_t* rois,
                                               const int64_t* argmax,
                                               const RoiBin& b,
                                               const Params& p) {
  const int64_t a = argmax[offset_of(b, p)];
  const int64_t image = roi_batch_index(static_cast<T>(rois[b.k * 5]));
  if (a < 0 || a >= p.height * p.width || image < 0 || image >= p.n_images) {
    return -1;
  }
  return (image * p.channels + b.c) * p.height * p.width + a;
}

template <typename scalar_t, typename T, typename index_t, RoiOrder kOrder>
__global__ void __launch_bounds__(kThreads) roi_pool_backward_atomic_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs,
    const scalar_t* __restrict__ rois, const int64_t* __restrict__ argmax,
    Params p, index_t total, T* __restrict__ grad_input) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = bin_of<kOrder>(i, p);
    const int64_t d = destination<scalar_t, T>(rois, argmax, b, p);
    if (d >= 0) {
      atomicAdd(grad_input + d,
                static_cast<T>(grad[b.k * gs.n + b.c * gs.c + b.ph * gs.h +
                                    b.pw * gs.w]));
    }
  }
}

// keys[i] = destination of grad element i; ignored elements get `sentinel`
// (larger than every destination, so they sort last).
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_destinations_kernel(
    const scalar_t* __restrict__ rois, const int64_t* __restrict__ argmax,
    Params p, index_t total, int64_t sentinel, int64_t* __restrict__ keys) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = bin_of<RoiOrder::kMemory>(i, p);
    const int64_t d = destination<scalar_t, T>(rois, argmax, b, p);
    keys[i] = d >= 0 ? d : sentinel;
  }
}

// The first element of each run of equal sorted keys sums the run's grads
// in sorted order and writes the destination (grad_input starts at zero).
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_run_sums_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs,
    const int64_t* __restrict__ keys, const int64_t* __restrict__ order,
    Params p, index_t total, int64_t sentinel,
    scalar_t* __restrict__ grad_input) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const int64_t key = keys[i];
    if (key == sentinel || (i > 0 && keys[i - 1] == key)) {
      continue;
    }
    T acc = T(0);
    for (int64_t j = i; j < total && keys[j] == key; ++j) {
      const RoiBin b = bin_of<RoiOrder::kMemory, int64_t>(order[j], p);
      acc += static_cast<T>(
          grad[b.k * gs.n + b.c * gs.c + b.ph * gs.h + b.pw * gs.w]);
    }
    grad_input[key] = static_cast<scalar_t>(acc);
  }
}

// The atomic scatter's thread order.  Channel-outer keeps the planes being
// added into in L2 while all RoIs of a channel pass, which pays where the
// planes do not all fit; where they do, memory
// order spreads each plane's atomics over time instead of sending every
// RoI of a channel at the same few addresses at once.  `bytes`: the planes'
// (grad_input's) size.
bool memory_order_scatter(int64_t bytes) {
  int dev = 0, l2 = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  return 2 * bytes <= static_cast<int64_t>(l2);
}

at::Tensor roi_pool_backward(const at::Tensor& grad, const at::Tensor& rois_in,
                             const at::Tensor& argmax_in, double spatial_scale,
                             int64_t pooled_height, int64_t pooled_width,
                             int64_t batch_size, int64_t channels,
                             int64_t height, int64_t width) {
  const char* op = "_roi_pool_backward";
  (void)spatial_scale;  // the argmax already says where each value came from
  check_roi_backward(op, grad, rois_in, pooled_height, pooled_width, batch_size,
                     channels, height, width, c10::DeviceType::CUDA);
  check_same_device(op, {grad, "grad"}, {argmax_in, "argmax"});
  check_roi_pool_argmax(op, grad, argmax_in);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  const Params p{rois.size(0), batch_size, channels, height, width,
                 pooled_height, pooled_width};
  const at::ScalarType dtype = grad.scalar_type();
  const int64_t total = grad.numel();
  const unsigned int blocks = grid_for(total, kThreads);
  if (total == 0 || batch_size == 0 || channels == 0 || height == 0 ||
      width == 0) {
    return new_output(op, {batch_size, channels, height, width}, grad.options(),
                      /*zero=*/true);
  }
  if (at::globalContext().deterministicAlgorithms()) {
    // Allocated first: that checks the sizes, so the sentinel cannot overflow.
    at::Tensor grad_input = new_output(
        op, {batch_size, channels, height, width}, grad.options(), /*zero=*/true);
    const int64_t sentinel = grad_input.numel();
    at::Tensor keys = at::empty({total}, argmax.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "torchops._roi_pool_backward", [&] {
          using T = at::opmath_type<scalar_t>;
          with_index_type(total, blocks, kThreads, [&](auto index) {
            using index_t = decltype(index);
            roi_pool_destinations_kernel<scalar_t, T, index_t>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    rois.const_data_ptr<scalar_t>(),
                    argmax.const_data_ptr<int64_t>(), p,
                    static_cast<index_t>(total), sentinel,
                    keys.mutable_data_ptr<int64_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0,
                                         /*descending=*/false);
            roi_pool_run_sums_kernel<scalar_t, T, index_t>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    grad.const_data_ptr<scalar_t>(), strides4(grad),
                    std::get<0>(sorted).const_data_ptr<int64_t>(),
                    std::get<1>(sorted).const_data_ptr<int64_t>(), p,
                    static_cast<index_t>(total), sentinel,
                    grad_input.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
    return grad_input;
  }
  const at::ScalarType acc_type = accumulate_type(dtype);
  at::Tensor grad_input = new_output(op, {batch_size, channels, height, width},
                                     grad.options().dtype(acc_type), /*zero=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_pool_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(total, blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          auto launch = [&](auto order) {
            roi_pool_backward_atomic_kernel<scalar_t, T, index_t, decltype(order)::value>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    grad.const_data_ptr<scalar_t>(), strides4(grad),
                    rois.const_data_ptr<scalar_t>(),
                    argmax.const_data_ptr<int64_t>(), p,
                    static_cast<index_t>(total), grad_input.mutable_data_ptr<T>());
          };
          if (memory_order_scatter(grad_input.nbytes())) {
            launch(std::integral_constant<RoiOrder, RoiOrder::kMemory>{});
          } else {
            launch(std::integral_constant<RoiOrder, RoiOrder::kChannelsOuter>{});
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCHOPS_REGISTER_KERNELS(CUDA, roi_pool)

}  // namespace torchops::cuda
