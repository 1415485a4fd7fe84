// CUDA kernels of torchops.masked_conv2d and its backward: the data-parallel
// steps of common/masked_conv2d_steps.h (the GEMMs are torchops::matmul's).
//
// Positions: one pass flags the selected (n, oh, ow), an inclusive scan
// (at::cumsum) ranks them, and a second pass writes the position list and,
// in the flags' place, the index map.  The number of positions sizes the
// columns and the GEMM, so it is read back to the host: one sync per call.
// Under CUDA graph capture, where a sync is an error, the count is taken to
// be every position of the batch instead (the list is padded with -1, whose
// columns are zero and are never read back): the graph then holds a dense
// convolution's work and stays right for whatever mask it is replayed with.
//
// Columns are gathered through a shared-memory tile, so that both the
// input reads (along positions, i.e. along the output row) and the column
// writes (along k) coalesce.  No kernel adds with atomics: col2im gathers
// the taps of each input pixel through the index map, in a fixed order, so
// the backward is bitwise deterministic with no extra memory.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/masked_conv2d.h"
#include "common/masked_conv2d_steps.h"
#include "cuda/common/roi.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 256;
// Columns tile: kTile positions x kTile rows of k, kTile x kTileRows threads.
constexpr int kTile = 32;
constexpr int kTileRows = 8;

template <typename mask_t>
__global__ void flag_kernel(const mask_t* __restrict__ mask, int64_t sn, int64_t sh, int64_t sw,
                            MaskedConvGeometry g, int64_t* __restrict__ flags) {
  const int64_t all = g.all_positions();
  for (int64_t i = grid_start<int64_t>(); i < all; i += grid_stride<int64_t>()) {
    const MaskedConvPosition<int64_t> q(i, g.out_h, g.out_w);
    flags[i] = masked_conv_selects(mask[q.n * sn + q.oh * sh + q.ow * sw]) ? 1 : 0;
  }
}

// flags_to_map holds the flags on entry and the index map on exit; `rank`
// is their inclusive scan.
__global__ void rank_kernel(const int64_t* __restrict__ rank, int64_t all,
                            int64_t* __restrict__ flags_to_map, int64_t* __restrict__ positions) {
  for (int64_t i = grid_start<int64_t>(); i < all; i += grid_stride<int64_t>()) {
    const bool selected = flags_to_map[i] != 0;
    const int64_t r = rank[i] - 1;
    if (selected) {
      positions[r] = i;
    }
    flags_to_map[i] = selected ? r : -1;
  }
}

template <typename scalar_t>
__global__ void gather_cols_kernel(const scalar_t* __restrict__ input, Strides4 s,
                                   const int64_t* __restrict__ positions, int64_t p,
                                   MaskedConvGeometry g, scalar_t* __restrict__ cols) {
  __shared__ scalar_t tile[kTile][kTile + 1];
  const int64_t k_total = g.col_rows(), cpg = g.in_per_group();
  const int64_t taps = g.kernel_h * g.kernel_w;
  const int64_t tiles_k = (k_total + kTile - 1) / kTile;
  const int64_t tiles_p = (p + kTile - 1) / kTile;
  const int64_t tiles = g.groups * tiles_p * tiles_k;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t kt = t % tiles_k, rest = t / tiles_k;
    const int64_t pt = rest % tiles_p, grp = rest / tiles_p;
    // Load: this thread's position, kTile / kTileRows rows of k.
    const int64_t j = pt * kTile + tx;
    const int64_t flat = j < p ? positions[j] : -1;
    const MaskedConvPosition<int64_t> q(flat < 0 ? 0 : flat, g.out_h, g.out_w);
    const scalar_t* base = input + q.n * s.n + grp * cpg * s.c;
#pragma unroll
    for (int r = 0; r < kTile / kTileRows; ++r) {
      const int64_t k = kt * kTile + ty + r * kTileRows;
      scalar_t v = scalar_t(0);
      if (flat >= 0 && k < k_total) {
        const int64_t c = k / taps, tap = k - c * taps;
        const int64_t i = tap / g.kernel_w, jj = tap - i * g.kernel_w;
        const int64_t ih = masked_conv_in_coord(q.oh, i, g.stride_h, g.pad_h, g.dil_h);
        const int64_t iw = masked_conv_in_coord(q.ow, jj, g.stride_w, g.pad_w, g.dil_w);
        if (ih >= 0 && ih < g.height && iw >= 0 && iw < g.width) {
          v = base[c * s.c + ih * s.h + iw * s.w];
        }
      }
      tile[ty + r * kTileRows][tx] = v;
    }
    __syncthreads();
    // Store: kTile consecutive k of each position.
#pragma unroll
    for (int r = 0; r < kTile / kTileRows; ++r) {
      const int64_t jw = pt * kTile + ty + r * kTileRows;
      const int64_t k = kt * kTile + tx;
      if (jw < p && k < k_total) {
        cols[(grp * p + jw) * k_total + k] = tile[tx][ty + r * kTileRows];
      }
    }
    __syncthreads();
  }
}

template <typename scalar_t, typename index_t>
__global__ void write_output_kernel(const scalar_t* __restrict__ out_cols, int64_t p,
                                    const scalar_t* __restrict__ bias, int64_t bias_stride,
                                    const int64_t* __restrict__ index_map, index_t plane,
                                    index_t channels, index_t total, scalar_t* __restrict__ out) {
  using T = at::opmath_type<scalar_t>;
  for (index_t e = grid_start<index_t>(); e < total; e += grid_stride<index_t>()) {
    const index_t nc = e / plane, i = e - nc * plane;
    const index_t n = nc / channels, co = nc - n * channels;
    const int64_t r = index_map[static_cast<int64_t>(n) * plane + i];
    T v = T(0);
    if (r >= 0) {
      v = static_cast<T>(out_cols[static_cast<int64_t>(co) * p + r]);
      if (bias != nullptr) {
        v += static_cast<T>(bias[static_cast<int64_t>(co) * bias_stride]);
      }
    }
    out[e] = static_cast<scalar_t>(v);
  }
}

template <typename scalar_t, typename index_t>
__global__ void gather_grad_kernel(const scalar_t* __restrict__ grad, Strides4 s,
                                   const int64_t* __restrict__ positions, index_t p,
                                   index_t total, index_t out_h, index_t out_w,
                                   scalar_t* __restrict__ grad_cols) {
  for (index_t e = grid_start<index_t>(); e < total; e += grid_stride<index_t>()) {
    const index_t co = e / p, j = e - co * p;
    const int64_t flat = positions[j];
    scalar_t v = scalar_t(0);
    if (flat >= 0) {
      const MaskedConvPosition<index_t> q(static_cast<index_t>(flat), out_h, out_w);
      v = grad[q.n * s.n + co * s.c + q.oh * s.h + q.ow * s.w];
    }
    grad_cols[e] = v;
  }
}

// index_t: the flat index and all the geometry (with_index_type and
// geometry_fits_int32 decide); the column offsets stay int64.
template <typename scalar_t, typename index_t>
__global__ void col2im_kernel(const scalar_t* __restrict__ input_cols, int64_t p,
                              const int64_t* __restrict__ index_map, MaskedConvGeometry g,
                              index_t total, scalar_t* __restrict__ grad_input) {
  using T = at::opmath_type<scalar_t>;
  const index_t width = g.width, height = g.height, channels = g.in_channels;
  const index_t cpg = g.in_per_group(), taps = g.kernel_h * g.kernel_w;
  const index_t kh = g.kernel_h, kw = g.kernel_w, out_h = g.out_h, out_w = g.out_w;
  const index_t sh = g.stride_h, sw = g.stride_w, ph = g.pad_h, pw = g.pad_w;
  const index_t dh = g.dil_h, dw = g.dil_w;
  const int64_t k_total = g.col_rows();
  for (index_t e = grid_start<index_t>(); e < total; e += grid_stride<index_t>()) {
    const index_t iw = e % width, t1 = e / width;
    const index_t ih = t1 % height, nc = t1 / height;
    const index_t c = nc % channels, n = nc / channels;
    const index_t grp = c / cpg, cl = c - grp * cpg;
    const scalar_t* rows = input_cols + (grp * k_total + static_cast<int64_t>(cl) * taps) * p;
    const int64_t* map = index_map + static_cast<int64_t>(n) * out_h * out_w;
    T acc = T(0);
    for (index_t i = 0; i < kh; ++i) {
      const index_t oh = masked_conv_out_coord<index_t>(ih, i, sh, ph, dh, out_h);
      if (oh < 0) {
        continue;
      }
      for (index_t j = 0; j < kw; ++j) {
        const index_t ow = masked_conv_out_coord<index_t>(iw, j, sw, pw, dw, out_w);
        const int64_t r = ow < 0 ? -1 : map[oh * out_w + ow];
        if (r >= 0) {
          acc += static_cast<T>(rows[static_cast<int64_t>(i * kw + j) * p + r]);
        }
      }
    }
    grad_input[e] = static_cast<scalar_t>(acc);
  }
}

// Whether col2im_kernel's geometry terms (sizes, strides, padding, dilation
// and the intermediate i + pad - k * dil) fit in int32.
inline bool geometry_fits_int32(const MaskedConvGeometry& g) {
  constexpr int64_t kLimit = int64_t(1) << 29;
  for (const int64_t v : {g.height, g.width, g.in_channels, g.out_h * g.out_w, g.kernel_h,
                          g.kernel_w, g.kernel_h * g.kernel_w, g.stride_h, g.stride_w, g.pad_h,
                          g.pad_w, g.dil_h * g.kernel_h, g.dil_w * g.kernel_w}) {
    if (v > kLimit) {
      return false;
    }
  }
  return true;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

struct CudaKernels {
  static MaskedPositions positions(const at::Tensor& mask, const MaskedConvGeometry& g) {
    const c10::cuda::CUDAGuard guard(mask.device());
    const cudaStream_t stream = current_stream();
    const int64_t all = g.all_positions();
    at::Tensor index_map = at::empty({all}, mask.options().dtype(at::kLong));
    const unsigned int blocks = grid_for(all, kThreads);
    const int64_t sn = g.mask_broadcast ? 0 : mask.stride(0);
    AT_DISPATCH_FLOATING_TYPES_AND3(
        at::kHalf, at::kBFloat16, at::kBool, mask.scalar_type(), "torchops.masked_conv2d", [&] {
          flag_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
              mask.const_data_ptr<scalar_t>(), sn, mask.stride(1), mask.stride(2), g,
              index_map.mutable_data_ptr<int64_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    const at::Tensor rank = at::cumsum(index_map, 0);
    const bool padded = capturing(stream);
    // The one sync of the call (see the top of the file).
    const int64_t count = padded ? all : rank[all - 1].item<int64_t>();
    at::Tensor positions = padded ? at::full({all}, -1, index_map.options())
                                  : at::empty({count}, index_map.options());
    rank_kernel<<<blocks, kThreads, 0, stream>>>(rank.const_data_ptr<int64_t>(), all,
                                                 index_map.mutable_data_ptr<int64_t>(),
                                                 positions.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {positions, index_map};
  }

  // Stored (G, P, K): read transposed as the forward GEMM's (K, P) operand,
  // it is K-contiguous, the layout tensor-core GEMMs load without a copy.
  static at::Tensor gather_cols(const at::Tensor& input, const MaskedPositions& pos,
                                const MaskedConvGeometry& g) {
    const int64_t p = pos.count();
    at::Tensor cols = new_output("masked_conv2d", {g.groups, p, g.col_rows()}, input.options());
    if (cols.numel() == 0) {
      return cols;
    }
    const c10::cuda::CUDAGuard guard(input.device());
    const int64_t tiles = g.groups * ceil_div(p, kTile) * ceil_div(g.col_rows(), kTile);
    const unsigned int blocks =
        static_cast<unsigned int>(std::min<int64_t>(tiles, 65535LL * 32));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.masked_conv2d", [&] {
          gather_cols_kernel<scalar_t><<<blocks, dim3(kTile, kTileRows), 0, current_stream()>>>(
              input.const_data_ptr<scalar_t>(), strides4(input),
              pos.positions.const_data_ptr<int64_t>(), p, g, cols.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    return cols;
  }

  static void write_output(const at::Tensor& out_cols, const std::optional<at::Tensor>& bias,
                           const MaskedPositions& pos, const MaskedConvGeometry& g,
                           at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(out.device());
    const bool has_bias = bias.has_value() && bias->defined();
    const int64_t total = out.numel();
    const unsigned int blocks = grid_for(total, kThreads);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, out.scalar_type(), "torchops.masked_conv2d", [&] {
          with_index_type(total, blocks, kThreads, [&](auto index) {
            using index_t = decltype(index);
            write_output_kernel<scalar_t, index_t><<<blocks, kThreads, 0, current_stream()>>>(
                out_cols.const_data_ptr<scalar_t>(), pos.count(),
                has_bias ? bias->const_data_ptr<scalar_t>() : nullptr,
                has_bias ? bias->stride(0) : 0, pos.index_map.const_data_ptr<int64_t>(),
                static_cast<index_t>(g.out_h * g.out_w), static_cast<index_t>(g.out_channels),
                static_cast<index_t>(total), out.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }

  static void gather_grad(const at::Tensor& grad, const MaskedPositions& pos,
                          const MaskedConvGeometry& g, at::Tensor& grad_cols) {
    const int64_t total = grad_cols.numel();
    if (total == 0) {
      return;
    }
    const c10::cuda::CUDAGuard guard(grad.device());
    const unsigned int blocks = grid_for(total, kThreads);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad.scalar_type(), "torchops._masked_conv2d_backward", [&] {
          // Positions index (n, oh, ow) of the gradient: its offsets fit in
          // index_t when its element count does.
          with_index_type(std::max(total, grad.numel()), blocks, kThreads, [&](auto index) {
            using index_t = decltype(index);
            gather_grad_kernel<scalar_t, index_t><<<blocks, kThreads, 0, current_stream()>>>(
                grad.const_data_ptr<scalar_t>(), strides4(grad),
                pos.positions.const_data_ptr<int64_t>(), static_cast<index_t>(pos.count()),
                static_cast<index_t>(total), static_cast<index_t>(g.out_h),
                static_cast<index_t>(g.out_w), grad_cols.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }

  static void col2im(const at::Tensor& input_cols, const MaskedPositions& pos,
                     const MaskedConvGeometry& g, at::Tensor& grad_input) {
    const int64_t total = grad_input.numel();
    if (total == 0) {
      return;
    }
    const c10::cuda::CUDAGuard guard(grad_input.device());
    const unsigned int blocks = grid_for(total, kThreads);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad_input.scalar_type(), "torchops._masked_conv2d_backward",
        [&] {
          auto launch = [&](auto index) {
            using index_t = decltype(index);
            col2im_kernel<scalar_t, index_t><<<blocks, kThreads, 0, current_stream()>>>(
                input_cols.const_data_ptr<scalar_t>(), pos.count(),
                pos.index_map.const_data_ptr<int64_t>(), g, static_cast<index_t>(total),
                grad_input.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          };
          if (geometry_fits_int32(g)) {
            with_index_type(total, blocks, kThreads, launch);
          } else {
            launch(int64_t{});
          }
        });
  }
};

at::Tensor masked_conv2d(const at::Tensor& input, const at::Tensor& mask,
                         const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef padding, at::IntArrayRef stride,
                         at::IntArrayRef dilation, int64_t groups) {
  return masked_conv2d_forward<CudaKernels>(input, mask, weight, bias, padding, stride,
                                            dilation, groups, c10::DeviceType::CUDA);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mask,
    const at::Tensor& weight, at::IntArrayRef padding, at::IntArrayRef stride,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  return torchops::masked_conv2d_backward<CudaKernels>(grad, input, mask, weight, padding,
                                                       stride, dilation, groups, output_mask,
                                                       c10::DeviceType::CUDA);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("masked_conv2d", &masked_conv2d);
  m.impl("_masked_conv2d_backward", &masked_conv2d_backward);
}

}  // namespace torchops::cuda
