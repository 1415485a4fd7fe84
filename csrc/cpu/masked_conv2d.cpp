// CPU kernels of torchops.masked_conv2d and its backward: the data-parallel
// steps of common/masked_conv2d_steps.h (the GEMMs are torchops::matmul's).
//
// Inputs are read through their strides (a copy would cost more than the
// few taps each element gets at a sparse mask).  Each parallel task writes
// its own part of the result -- in col2im a whole (n, c) plane, which sums
// its image's taps in position order -- so every result of these steps is
// deterministic and independent of the number of threads.  Only the dense
// hand-off to oneDNN (dense_forward, float32 and float64 from kDenseShare
// selected) may depend on the thread count, so deterministic mode skips it.
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/masked_conv2d.h"
#include "common/masked_conv2d_steps.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Element strides of a 4-D tensor.
struct Strides4 {
  int64_t n, c, h, w;
  explicit Strides4(const at::Tensor& t)
      : n(t.stride(0)), c(t.stride(1)), h(t.stride(2)), w(t.stride(3)) {}
};

using Position = MaskedConvPosition<int64_t>;

struct CpuKernels {
  // One pass in order: ranks come out ascending (the mask is small beside
  // the convolution: N * H_out * W_out values).
  static MaskedPositions positions(
      const at::Tensor& mask, const MaskedConvGeometry& g,
      const std::function<void(const PendingPositions&)>& meanwhile) {
    meanwhile(PendingPositions{});
    const int64_t all = g.all_positions();
    at::Tensor index_map = at::empty({all}, mask.options().dtype(at::kLong));
    int64_t* map = index_map.mutable_data_ptr<int64_t>();
    const int64_t sn = g.mask_broadcast ? 0 : mask.stride(0);
    const int64_t sh = mask.stride(1), sw = mask.stride(2);
    int64_t count = 0;
    AT_DISPATCH_FLOATING_TYPES_AND3(
        at::kHalf, at::kBFloat16, at::kBool, mask.scalar_type(), "torchops.masked_conv2d",
        [&] {
          const scalar_t* m = mask.const_data_ptr<scalar_t>();
          int64_t i = 0;
          for (int64_t n = 0; n < g.batch; ++n) {
            for (int64_t oh = 0; oh < g.out_h; ++oh) {
              for (int64_t ow = 0; ow < g.out_w; ++ow, ++i) {
                map[i] = masked_conv_selects(m[n * sn + oh * sh + ow * sw]) ? count++ : -1;
              }
            }
          }
        });
    at::Tensor positions = at::empty({count}, index_map.options());
    int64_t* pos = positions.mutable_data_ptr<int64_t>();
    for (int64_t i = 0; i < all; ++i) {
      if (map[i] >= 0) {
        pos[map[i]] = i;
      }
    }
    return {positions, index_map};
  }

  // The count is known at once here: nothing to do ahead of it.
  static std::optional<at::Tensor> gather_cols_ahead(const at::Tensor& /*input*/,
                                                     const MaskedConvGeometry& /*g*/,
                                                     const PendingPositions& /*pending*/) {
    return std::nullopt;
  }

  // Stored (G, K, P), the layout the CPU GEMM reads without a copy: each
  // task fills rows of one input channel, reading one plane (which stays in
  // cache) and writing whole rows.
  static at::Tensor gather_cols(const at::Tensor& input, const MaskedPositions& pos,
                                const MaskedConvGeometry& g) {
    const int64_t p = pos.count(), k = g.col_rows(), taps = g.kernel_h * g.kernel_w;
    at::Tensor cols = new_output("masked_conv2d", {g.groups, k, p}, input.options());
    const int64_t* positions = pos.positions.const_data_ptr<int64_t>();
    // Each position's image and top-left input corner, decoded once.
    std::vector<int64_t> image(static_cast<size_t>(p)), top(image.size()), left(image.size());
    for (int64_t r = 0; r < p; ++r) {
      const Position q(positions[r], g.out_h, g.out_w);
      image[r] = q.n;
      top[r] = masked_conv_in_coord(q.oh, 0, g.stride_h, g.pad_h, g.dil_h);
      left[r] = masked_conv_in_coord(q.ow, 0, g.stride_w, g.pad_w, g.dil_w);
    }
    const Strides4 s(input);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, input.scalar_type(), "torchops.masked_conv2d", [&] {
          const scalar_t* in = input.const_data_ptr<scalar_t>();
          scalar_t* out = cols.mutable_data_ptr<scalar_t>();
          // Rows k of every group are rows of one (G * K, P) matrix; input
          // channel c = row / taps in both.
          at::parallel_for(0, g.in_channels, std::max<int64_t>(1, 16384 / (taps * p + 1)),
                           [&](int64_t begin, int64_t end) {
            for (int64_t c = begin; c < end; ++c) {
              const scalar_t* plane = in + c * s.c;
              for (int64_t i = 0; i < g.kernel_h; ++i) {
                for (int64_t j = 0; j < g.kernel_w; ++j) {
                  scalar_t* row = out + (c * taps + i * g.kernel_w + j) * p;
                  const int64_t di = i * g.dil_h, dj = j * g.dil_w;
                  for (int64_t r = 0; r < p; ++r) {
                    const int64_t ih = top[r] + di, iw = left[r] + dj;
                    row[r] = ih >= 0 && ih < g.height && iw >= 0 && iw < g.width
                                 ? plane[image[r] * s.n + ih * s.h + iw * s.w]
                                 : scalar_t(0);
                  }
                }
              }
            }
          });
        });
    return cols.transpose(1, 2);
  }

  // The share of selected positions from which float32 and float64 hand
  // off to ATen's convolution (oneDNN): the sparse path's work grows with
  // the positions, the gather's above all, while oneDNN's reads the input
  // once; the two cross between 40% and 50% on the benchmark's layer at 1
  // and 2 threads (docs/design.md).  Half types stay sparse.  Under
  // torch.use_deterministic_algorithms(True) the forward stays sparse at any
  // density: its result, unlike oneDNN's, does not depend on the thread
  // count.
  static constexpr double kDenseShare = 0.45;

  // The count is known before anything is queued: no convolution ahead of it.
  static bool expects_dense(const at::Tensor& /*input*/, const MaskedConvGeometry& /*g*/) {
    return false;
  }

  // Contiguous operands: ATen's CPU convolution crashes on some
  // channels-last calls (with a bias, a stride, a dilation and groups
  // together), and the copy is small beside the convolution it feeds.
  static at::Tensor dense_conv(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::IntArrayRef padding,
                               c10::IntArrayRef stride, c10::IntArrayRef dilation,
                               int64_t groups) {
    return masked_conv2d_dense_conv(input.contiguous(), weight.contiguous(), bias, padding,
                                    stride, dilation, groups, /*allow_tf32=*/false);
  }

  static bool dense_forward(const at::Tensor& input, const at::Tensor& mask,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::IntArrayRef padding, c10::IntArrayRef stride,
                            c10::IntArrayRef dilation, int64_t groups,
                            const MaskedConvGeometry& g, const MaskedPositions& pos,
                            const std::optional<at::Tensor>& /*early_conv*/, at::Tensor& out) {
    const at::ScalarType dtype = input.scalar_type();
    const bool worth = (dtype == at::kFloat || dtype == at::kDouble) &&
                       !at::globalContext().deterministicAlgorithms();
    if (!masked_conv2d_goes_dense(worth, kDenseShare, pos, g)) {
      return false;
    }
    masked_conv2d_dense_select(
        dense_conv(input, weight, bias, padding, stride, dilation, groups), mask, pos, g, out);
    return true;
  }

  // Exact whatever PyTorch's precision flags say: torchops.matmul on CPU
  // reads none of them.
  static at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
    return op_matmul(a, b);
  }

  // write_output writes the zeros too, in the same pass.
  static void clear_output(at::Tensor& /*out*/) {}

  // (G, C_out / G, K) @ (G, K, P): each output channel's values in a row,
  // which write_output walks plane by plane.
  static at::Tensor forward_gemm(const at::Tensor& weight3, const at::Tensor& cols) {
    return gemm(weight3, cols.transpose(1, 2));
  }

  // product: forward_gemm's (G, C_out / G, P).
  static void write_output(const at::Tensor& product, const std::optional<at::Tensor>& bias,
                           const MaskedPositions& pos, const MaskedConvGeometry& g,
                           at::Tensor& out) {
    const at::Tensor out_cols = product.view({g.out_channels, pos.count()});
    const int64_t p = pos.count(), plane = g.out_h * g.out_w;
    const int64_t* map = pos.index_map.const_data_ptr<int64_t>();
    const bool has_bias = bias.has_value() && bias->defined();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, out.scalar_type(), "torchops.masked_conv2d", [&] {
          using T = at::opmath_type<scalar_t>;
          const scalar_t* oc = out_cols.const_data_ptr<scalar_t>();
          const scalar_t* b = has_bias ? bias->const_data_ptr<scalar_t>() : nullptr;
          const int64_t bs = has_bias ? bias->stride(0) : 0;
          scalar_t* o = out.mutable_data_ptr<scalar_t>();
          at::parallel_for(0, g.batch * g.out_channels, std::max<int64_t>(1, 16384 / plane),
                           [&](int64_t begin, int64_t end) {
            for (int64_t nc = begin; nc < end; ++nc) {
              const int64_t n = nc / g.out_channels, co = nc - n * g.out_channels;
              const T bv = has_bias ? static_cast<T>(b[co * bs]) : T(0);
              const int64_t* m = map + n * plane;
              const scalar_t* src = oc + co * p;
              scalar_t* dst = o + nc * plane;
              for (int64_t i = 0; i < plane; ++i) {
                dst[i] = m[i] >= 0 ? static_cast<scalar_t>(static_cast<T>(src[m[i]]) + bv)
                                   : scalar_t(0);
              }
            }
          });
        });
  }

  static void gather_grad(const at::Tensor& grad, const MaskedPositions& pos,
                          const MaskedConvGeometry& g, at::Tensor& grad_cols) {
    const int64_t p = pos.count();
    const int64_t* positions = pos.positions.const_data_ptr<int64_t>();
    const Strides4 s(grad);
    // Each position's offset in a channel plane of 'grad', decoded once.
    std::vector<int64_t> offset(static_cast<size_t>(p));
    for (int64_t j = 0; j < p; ++j) {
      const Position q(positions[j], g.out_h, g.out_w);
      offset[j] = q.n * s.n + q.oh * s.h + q.ow * s.w;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad.scalar_type(), "torchops._masked_conv2d_backward", [&] {
          const scalar_t* gr = grad.const_data_ptr<scalar_t>();
          scalar_t* out = grad_cols.mutable_data_ptr<scalar_t>();
          at::parallel_for(0, g.out_channels, std::max<int64_t>(1, 16384 / (p + 1)),
                           [&](int64_t begin, int64_t end) {
            for (int64_t co = begin; co < end; ++co) {
              const scalar_t* plane = gr + co * s.c;
              for (int64_t j = 0; j < p; ++j) {
                out[co * p + j] = plane[offset[j]];
              }
            }
          });
        });
  }

  // One task per (n, c) plane of grad_input: it adds the taps of image n's
  // positions (a contiguous run of the sorted list) in list order, so the
  // work follows the mask and the sums do not depend on the threads.
  static void col2im(const at::Tensor& input_cols, const MaskedPositions& pos,
                     const MaskedConvGeometry& g, at::Tensor& grad_input) {
    const int64_t p = pos.count(), k = g.col_rows(), cpg = g.in_per_group();
    const int64_t plane = g.height * g.width, taps = g.kernel_h * g.kernel_w;
    const int64_t* positions = pos.positions.const_data_ptr<int64_t>();
    std::vector<int64_t> first(static_cast<size_t>(g.batch + 1));
    for (int64_t n = 0; n <= g.batch; ++n) {
      first[n] = std::lower_bound(positions, positions + p, n * g.out_h * g.out_w) - positions;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad_input.scalar_type(), "torchops._masked_conv2d_backward",
        [&] {
          using T = at::opmath_type<scalar_t>;
          const scalar_t* cols = input_cols.const_data_ptr<scalar_t>();
          scalar_t* gi = grad_input.mutable_data_ptr<scalar_t>();
          const int64_t work = std::max<int64_t>(1, p / std::max<int64_t>(1, g.batch)) * taps;
          at::parallel_for(0, g.batch * g.in_channels, std::max<int64_t>(1, 16384 / (work + plane)),
                           [&](int64_t begin, int64_t end) {
            // Half types accumulate in a float plane, rounded once.
            std::vector<T> acc(static_cast<size_t>(std::is_same_v<T, scalar_t> ? 0 : plane));
            for (int64_t nc = begin; nc < end; ++nc) {
              const int64_t n = nc / g.in_channels, c = nc - n * g.in_channels;
              const int64_t grp = c / cpg, cl = c - grp * cpg;
              const scalar_t* rows = cols + (grp * k + cl * taps) * p;
              T* dst = std::is_same_v<T, scalar_t> ? reinterpret_cast<T*>(gi + nc * plane)
                                                   : acc.data();
              std::fill(dst, dst + plane, T(0));
              for (int64_t r = first[n]; r < first[n + 1]; ++r) {
                const Position q(positions[r], g.out_h, g.out_w);
                for (int64_t i = 0; i < g.kernel_h; ++i) {
                  const int64_t ih = masked_conv_in_coord(q.oh, i, g.stride_h, g.pad_h, g.dil_h);
                  if (ih < 0 || ih >= g.height) {
                    continue;
                  }
                  for (int64_t j = 0; j < g.kernel_w; ++j) {
                    const int64_t iw =
                        masked_conv_in_coord(q.ow, j, g.stride_w, g.pad_w, g.dil_w);
                    if (iw >= 0 && iw < g.width) {
                      dst[ih * g.width + iw] += static_cast<T>(rows[(i * g.kernel_w + j) * p + r]);
                    }
                  }
                }
              }
              if constexpr (!std::is_same_v<T, scalar_t>) {
                scalar_t* out = gi + nc * plane;
                for (int64_t e = 0; e < plane; ++e) {
                  out[e] = static_cast<scalar_t>(dst[e]);
                }
              }
            }
          });
        });
  }
};

at::Tensor masked_conv2d(const at::Tensor& input, const at::Tensor& mask,
                         const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef padding, at::IntArrayRef stride,
                         at::IntArrayRef dilation, int64_t groups) {
  return masked_conv2d_forward<CpuKernels>(input, mask, weight, bias, padding, stride, dilation,
                                           groups, c10::DeviceType::CPU);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& mask,
    const at::Tensor& weight, at::IntArrayRef padding, at::IntArrayRef stride,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  return torchops::masked_conv2d_backward<CpuKernels>(grad, input, mask, weight, padding, stride,
                                                      dilation, groups, output_mask,
                                                      c10::DeviceType::CPU);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("masked_conv2d", &masked_conv2d);
  m.impl("_masked_conv2d_backward", &masked_conv2d_backward);
}

}  // namespace torchops::cpu
