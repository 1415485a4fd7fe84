// CUDA kernels of torchops.roi_pool and its backward.
//
// Forward, inputs whose pixels are adjacent along W (NCHW, channel slices):
// one warp per (channel chunk, RoI) unit; a bin is scanned by a group of G
// lanes (G a power of two up to 32, from the RoI's bin width, the same for
// the whole warp) that take consecutive columns of each row, then reduce
// with shuffles to the (largest value, smallest index) pair.  Why this beats
// one thread per bin (torchvision's scheme, and ours before): there, a warp
// load touches 32 bins' scattered pixels (~15-20 L1 wavefronts per load,
// the real limit); here the groups of a round are adjacent bins of one row,
// so a load reads ~32 contiguous pixels (1-2 wavefronts).  One RoI per warp
// also keeps loop trip counts uniform (a warp that straddled two RoIs of
// different sizes ran for the larger).  Units walk all RoIs of a channel
// chunk before the next chunk, so the planes in use stay in L2 (and in L1
// across overlapping RoIs).  Result identical to the sequential scan: each
// lane scans its columns in row-major order with a strict '>', and the
// reduction keeps the smaller flat index among equal values, i.e. the first
// maximum in row-major order; NaNs and values not above the initial maximum
// are never chosen (index -1), as in the scan.
//
// Forward, channels_last inputs: one thread per output element, adjacent
// threads taking adjacent channels of one bin (coalesced reads).
//
// Backward: each grad element goes to exactly one input pixel, the one its
// argmax names.  By default with atomicAdd (into a float32 buffer for half
// types).  Under torch.use_deterministic_algorithms(True): the destinations
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

#include <algorithm>
#include <cmath>
#include <tuple>

#include "common/roi_pool.h"
#include "cuda/common/roi.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;

struct Params {
  int64_t rois, n_images, channels, height, width;
  int64_t pooled_height, pooled_width;
};

template <RoiOrder kOrder, typename index_t>
__device__ __forceinline__ RoiBin bin_of(index_t i, const Params& p) {
  return roi_bin_of<kOrder, index_t>(
      i, static_cast<index_t>(p.channels), static_cast<index_t>(p.pooled_height),
      static_cast<index_t>(p.pooled_width), static_cast<index_t>(p.rois));
}

__device__ __forceinline__ int64_t offset_of(const RoiBin& b, const Params& p) {
  return roi_bin_offset(b, p.channels, p.pooled_height, p.pooled_width);
}

template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_forward_channels_last_kernel(
    const scalar_t* __restrict__ input, Strides4 s,
    const scalar_t* __restrict__ rois, T spatial_scale, Params p,
    index_t total, scalar_t* __restrict__ out, int64_t* __restrict__ argmax) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = bin_of<RoiOrder::kChannelsInner>(i, p);
    const RoiPoolBox<T> box = roi_pool_box<T>(rois + b.k * 5, spatial_scale,
                                              p.pooled_height, p.pooled_width);
    T best = T(0);
    int64_t best_at = -1;
    if (box.batch >= 0 && box.batch < p.n_images) {
      int64_t h0, h1, w0, w1;
      roi_pool_bin(box.bin_h, b.ph, box.start_h, p.height, h0, h1);
      roi_pool_bin(box.bin_w, b.pw, box.start_w, p.width, w0, w1);
      if (h1 > h0 && w1 > w0) {
        best = roi_pool_initial_max<T>();
      }
      const scalar_t* plane = input + box.batch * s.n + b.c * s.c;
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t w = w0; w < w1; ++w) {
          const T v = static_cast<T>(plane[h * s.h + w * s.w]);
          if (v > best) {
            best = v;
            best_at = h * p.width + w;
          }
        }
      }
    }
    const int64_t o = offset_of(b, p);
    out[o] = static_cast<scalar_t>(best);
    argmax[o] = best_at;
  }
}

constexpr int kWarp = 32;

// Lanes per bin: the largest power of two (at most a warp) not above the
// bin's narrowest width in columns, ceil(bin_w), so that most lanes of a
// group load a pixel on every row.
template <typename T>
__device__ __forceinline__ int lanes_per_bin(T bin_w) {
  const T columns = std::ceil(bin_w);
  int g = 1;
  while (g < kWarp && static_cast<T>(2 * g) <= columns) {
    g *= 2;
  }
  return g;
}

// Merges another lane's (value, index) into ours.  Lanes hold either a value
// above the initial maximum with its index, or (initial maximum, -1), so
// "larger value, else smaller index" is the sequential scan's choice.
template <typename T>
__device__ __forceinline__ void keep_first_max(T& best, int64_t& best_at,
                                               T other, int64_t other_at) {
  if (other > best || (other == best && other_at < best_at)) {
    best = other;
    best_at = other_at;
  }
}

// Unit u: RoI u % rois, channels [c0, c0 + channels_per_unit) with c0 =
// (u / rois) * channels_per_unit; its outputs (c, ph, pw) are contiguous in
// the result and go to the warp's lane groups in rounds of 32 / G.
template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_forward_rows_kernel(
    const scalar_t* __restrict__ input, Strides4 s,
    const scalar_t* __restrict__ rois, T spatial_scale, Params p,
    index_t channels_per_unit, index_t units, scalar_t* __restrict__ out,
    int64_t* __restrict__ argmax) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const index_t n_rois = static_cast<index_t>(p.rois);
  const index_t channels = static_cast<index_t>(p.channels);
  const index_t pooled_width = static_cast<index_t>(p.pooled_width);
  const index_t bins = static_cast<index_t>(p.pooled_height * p.pooled_width);
  const index_t warps = grid_stride<index_t>() / kWarp;
  // u is the same for all lanes of a warp (kThreads is a multiple of 32), so
  // are the RoI, G and the number of rounds: every lane reaches the shuffles.
  for (index_t u = grid_start<index_t>() / kWarp; u < units; u += warps) {
    const index_t k = u % n_rois;
    const index_t c0 = (u / n_rois) * channels_per_unit;
    const index_t n_out =
        (channels - c0 < channels_per_unit ? channels - c0 : channels_per_unit) *
        bins;
    const RoiPoolBox<T> box = roi_pool_box<T>(
        rois + static_cast<int64_t>(k) * 5, spatial_scale, p.pooled_height,
        p.pooled_width);
    const bool valid = box.batch >= 0 && box.batch < p.n_images;
    const int group = lanes_per_bin(box.bin_w);
    const int sub = lane & (group - 1);
    const index_t per_round = kWarp / group;
    const int64_t first = (static_cast<int64_t>(k) * p.channels + c0) * bins;
    const scalar_t* image = input + (valid ? box.batch : 0) * s.n;
    for (index_t r = 0; r < n_out; r += per_round) {
      const index_t o = r + lane / group;
      T best = roi_pool_initial_max<T>();
      int64_t best_at = -1;
      bool empty = true;
      if (valid && o < n_out) {
        const index_t c = c0 + o / bins;
        const index_t bin = o % bins;
        int64_t h0, h1, w0, w1;
        roi_pool_bin(box.bin_h, static_cast<int64_t>(bin / pooled_width),
                     box.start_h, p.height, h0, h1);
        roi_pool_bin(box.bin_w, static_cast<int64_t>(bin % pooled_width),
                     box.start_w, p.width, w0, w1);
        empty = !(h1 > h0 && w1 > w0);
        const scalar_t* plane = image + static_cast<int64_t>(c) * s.c;
        for (int64_t h = h0; h < h1; ++h) {
          const scalar_t* row = plane + h * s.h;
          for (int64_t w = w0 + sub; w < w1; w += group) {
            const T v = static_cast<T>(row[w * s.w]);
            if (v > best) {
              best = v;
              best_at = h * p.width + w;
            }
          }
        }
      }
      for (int offset = group / 2; offset > 0; offset /= 2) {
        const T other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int64_t other_at = __shfl_xor_sync(0xffffffffu, best_at, offset);
        keep_first_max(best, best_at, other, other_at);
      }
      if (sub == 0 && o < n_out) {
        // An empty bin (or a RoI of no image) gives 0 and argmax -1.
        out[first + o] = static_cast<scalar_t>(empty ? T(0) : best);
        argmax[first + o] = best_at;
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> roi_pool(const at::Tensor& input,
                                            const at::Tensor& rois_in,
                                            double spatial_scale,
                                            int64_t pooled_height,
                                            int64_t pooled_width) {
  check_roi_forward("roi_pool", input, rois_in, pooled_height, pooled_width,
                    c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor rois = rois_in.contiguous();
  const int64_t k = rois.size(0), channels = input.size(1);
  at::Tensor out =
      at::empty({k, channels, pooled_height, pooled_width}, input.options());
  at::Tensor argmax = at::empty(out.sizes(), input.options().dtype(at::kLong));
  const int64_t total = out.numel();
  if (total == 0) {
    return {out, argmax};
  }
  const Params p{k, input.size(0), channels, input.size(2), input.size(3),
                 pooled_height, pooled_width};
  const bool inner = channels_inner(input);
  // Enough channels per unit that a unit's last round, partly idle, is a
  // small part of its work.
  const int64_t channels_per_unit =
      std::min(channels, ceil_div(128, pooled_height * pooled_width));
  const int64_t units = k * ceil_div(channels, channels_per_unit);
  const int64_t threads = inner ? total : units * kWarp;
  const unsigned int blocks = grid_for(threads, kThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.roi_pool", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(std::max(total, threads), blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          if (inner) {
            roi_pool_forward_channels_last_kernel<scalar_t, T, index_t>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    input.const_data_ptr<scalar_t>(), strides4(input),
                    rois.const_data_ptr<scalar_t>(),
                    static_cast<T>(spatial_scale), p,
                    static_cast<index_t>(total),
                    out.mutable_data_ptr<scalar_t>(),
                    argmax.mutable_data_ptr<int64_t>());
          } else {
            roi_pool_forward_rows_kernel<scalar_t, T, index_t>
                <<<blocks, kThreads, 0, current_stream()>>>(
                    input.const_data_ptr<scalar_t>(), strides4(input),
                    rois.const_data_ptr<scalar_t>(),
                    static_cast<T>(spatial_scale), p,
                    static_cast<index_t>(channels_per_unit),
                    static_cast<index_t>(units),
                    out.mutable_data_ptr<scalar_t>(),
                    argmax.mutable_data_ptr<int64_t>());
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

template <typename scalar_t, typename T, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_backward_atomic_kernel(
    const scalar_t* __restrict__ grad, Strides4 gs,
    const scalar_t* __restrict__ rois, const int64_t* __restrict__ argmax,
    Params p, index_t total, T* __restrict__ grad_input) {
  for (index_t i = grid_start<index_t>(); i < total; i += grid_stride<index_t>()) {
    const RoiBin b = bin_of<RoiOrder::kChannelsOuter>(i, p);
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
  TORCH_CHECK(argmax_in.scalar_type() == at::kLong && argmax_in.sizes() == grad.sizes(),
              "torchops._roi_pool_backward: expected 'argmax' to be an int64 "
              "tensor of the shape of 'grad' (", grad.sizes(), "), but got ",
              argmax_in.scalar_type(), " of shape ", argmax_in.sizes());
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  const Params p{rois.size(0), batch_size, channels, height, width,
                 pooled_height, pooled_width};
  const at::ScalarType dtype = grad.scalar_type();
  const int64_t total = grad.numel();
  const unsigned int blocks = grid_for(total, kThreads);
  if (total == 0 || batch_size * channels * height * width == 0) {
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  if (at::globalContext().deterministicAlgorithms()) {
    const int64_t sentinel = batch_size * channels * height * width;
    at::Tensor keys = at::empty({total}, argmax.options());
    at::Tensor grad_input =
        at::zeros({batch_size, channels, height, width}, grad.options());
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
  const at::ScalarType acc_type = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_input = at::zeros({batch_size, channels, height, width},
                                    grad.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "torchops._roi_pool_backward", [&] {
        using T = at::opmath_type<scalar_t>;
        with_index_type(total, blocks, kThreads, [&](auto index) {
          using index_t = decltype(index);
          roi_pool_backward_atomic_kernel<scalar_t, T, index_t>
              <<<blocks, kThreads, 0, current_stream()>>>(
                  grad.const_data_ptr<scalar_t>(), strides4(grad),
                  rois.const_data_ptr<scalar_t>(),
                  argmax.const_data_ptr<int64_t>(), p,
                  static_cast<index_t>(total), grad_input.mutable_data_ptr<T>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return grad_input.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("roi_pool", &roi_pool);
  m.impl("_roi_pool_backward", &roi_pool_backward);
}

}  // namespace torchops::cuda
