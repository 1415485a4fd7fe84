// CPU kernels of torchops.deform_conv2d and its backward.
//
// Forward, per image: a deformable im2col builds the columns
// (channels * kh * kw, out_h * out_w) -- each entry the masked bilinear
// sample of one input channel at one kernel tap's shifted position -- and a
// GEMM per weight group multiplies them by the weight.  The sampling
// geometry (position, corners, weights) depends on the offset group, kernel
// tap and output pixel, not on the channel, so it is computed once and used
// for every channel of the offset group.
//
// Backward, per image: grad_columns = weight^T @ grad (per group); the
// weight gradient is grad @ columns^T; the offset and mask gradients reduce
// grad_columns over each offset group's channels (one thread owns each
// output element); the input gradient scatters grad_columns into the input
// planes with one thread per channel plane.  No atomics: the result is
// deterministic and independent of the thread count.
//
// Half types are computed in float32 (inputs converted once, results rounded
// once at the end).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common/deform_conv2d.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

struct Geometry {
  DeformConvSizes s;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t groups, offset_groups;
  bool use_mask;
  int64_t taps() const { return s.kernel_h * s.kernel_w; }           // K
  int64_t pixels() const { return s.out_h * s.out_w; }               // P
  int64_t group_channels() const { return s.channels / offset_groups; }
};

// Where sample (offset group og, kernel tap k, output pixel p) of image n
// reads, and its mask value.
template <typename T>
inline void sample_at(const Geometry& g, const T* offset_n, const T* mask_n,
                      int64_t og, int64_t k, int64_t p, T& y, T& x, T& m) {
  const int64_t K = g.taps(), P = g.pixels();
  const int64_t i = k / g.s.kernel_w, j = k % g.s.kernel_w;
  const int64_t oy = p / g.s.out_w, ox = p % g.s.out_w;
  const T* o = offset_n + (og * K + k) * 2 * P;
  y = static_cast<T>(oy * g.stride_h - g.pad_h + i * g.dilation_h) + o[p];
  x = static_cast<T>(ox * g.stride_w - g.pad_w + j * g.dilation_w) + o[P + p];
  m = g.use_mask ? mask_n[(og * K + k) * P + p] : T(1);
}

// columns[(c * K + k) * P + p] for image n.
template <typename T>
void deformable_im2col(const Geometry& g, const T* in_n, const T* offset_n,
                       const T* mask_n, T* columns) {
  const int64_t K = g.taps(), P = g.pixels(), cpg = g.group_channels();
  const int64_t plane = g.s.height * g.s.width;
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(cpg, 1));
  parallel_range(g.offset_groups * K * P, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t p = q % P, k = (q / P) % K, og = q / (P * K);
      T y, x, m;
      sample_at(g, offset_n, mask_n, og, k, p, y, x, m);
      DeformTaps<T> t;
      deform_taps(y, x, g.s.height, g.s.width, t);
      for (int64_t c = og * cpg; c < (og + 1) * cpg; ++c) {
        const T* src = in_n + c * plane;
        const T v = t.w[0] * src[t.idx[0]] + t.w[1] * src[t.idx[1]] +
                    t.w[2] * src[t.idx[2]] + t.w[3] * src[t.idx[3]];
        columns[(c * K + k) * P + p] = m * v;
      }
    }
  }, grain);
}

Geometry geometry(const DeformConvSizes& s, int64_t stride_h, int64_t stride_w,
                  int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                  int64_t dilation_w, int64_t groups, int64_t offset_groups,
                  bool use_mask) {
  return Geometry{s,          stride_h, stride_w, pad_h,         pad_w,
                  dilation_h, dilation_w, groups, offset_groups, use_mask};
}

at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor up(const at::Tensor& t, at::ScalarType ct) {
  return t.to(ct).contiguous();
}

at::Tensor deform_conv2d(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& offset, const at::Tensor& mask,
                         const at::Tensor& bias, int64_t stride_h,
                         int64_t stride_w, int64_t pad_h, int64_t pad_w,
                         int64_t dilation_h, int64_t dilation_w, int64_t groups,
                         int64_t offset_groups, bool use_mask) {
  const char* op = "deform_conv2d";
  const DeformConvSizes s = check_deform_conv2d(
      op, c10::DeviceType::CPU, input, weight, offset, mask, bias, stride_h,
      stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups,
      use_mask);
  const Geometry g = geometry(s, stride_h, stride_w, pad_h, pad_w, dilation_h,
                              dilation_w, groups, offset_groups, use_mask);
  const at::ScalarType dtype = input.scalar_type(), ct = compute_type(dtype);
  const int64_t N = s.batch, O = s.out_channels, C = s.channels;
  const int64_t K = g.taps(), P = g.pixels();
  at::Tensor out = new_output(op, {N, O, s.out_h, s.out_w},
                              input.options().dtype(ct));
  if (out.numel() == 0) {
    return out.to(dtype);
  }
  const at::Tensor in = up(input, ct), w = up(weight, ct),
                   off = up(offset, ct), b = up(bias, ct);
  const at::Tensor msk = use_mask ? up(mask, ct) : at::Tensor();
  const int64_t og_rows = O / groups, gc_rows = (C / groups) * K;
  const at::Tensor wg = w.view({groups, og_rows, gc_rows});
  at::Tensor columns = at::empty({C * K, P}, in.options());
  at::Tensor out3 = out.view({N, O, P});
  AT_DISPATCH_FLOATING_TYPES(ct, "torchops.deform_conv2d", [&] {
    const scalar_t* ip = in.const_data_ptr<scalar_t>();
    const scalar_t* op_ = off.const_data_ptr<scalar_t>();
    const scalar_t* mp = use_mask ? msk.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* cp = columns.mutable_data_ptr<scalar_t>();
    for (int64_t n = 0; n < N; ++n) {
      deformable_im2col<scalar_t>(g, ip + n * C * s.height * s.width,
                                  op_ + n * 2 * offset_groups * K * P,
                                  mp ? mp + n * offset_groups * K * P : nullptr,
                                  cp);
      at::Tensor out_n = out3.select(0, n);
      for (int64_t grp = 0; grp < groups; ++grp) {
        at::Tensor dst = out_n.narrow(0, grp * og_rows, og_rows);
        at::mm_out(dst, wg.select(0, grp),
                   columns.narrow(0, grp * gc_rows, gc_rows));
      }
    }
  });
  out3.add_(b.view({1, O, 1}));
  return out.to(dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward(const at::Tensor& grad, const at::Tensor& input,
                       const at::Tensor& weight, const at::Tensor& offset,
                       const at::Tensor& mask, const at::Tensor& bias,
                       int64_t stride_h, int64_t stride_w, int64_t pad_h,
                       int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
                       int64_t groups, int64_t offset_groups, bool use_mask) {
  const char* op = "_deform_conv2d_backward";
  const DeformConvSizes s = check_deform_conv2d(
      op, c10::DeviceType::CPU, input, weight, offset, mask, bias, stride_h,
      stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups,
      use_mask);
  check_devices(op, c10::DeviceType::CPU, {{input, "input"}, {grad, "grad"}});
  check_same_dtype(op, {input, "input"}, {grad, "grad"});
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == s.batch &&
                  grad.size(1) == s.out_channels && grad.size(2) == s.out_h &&
                  grad.size(3) == s.out_w,
              "torchops.", op, ": expected 'grad' to have shape (", s.batch,
              ", ", s.out_channels, ", ", s.out_h, ", ", s.out_w,
              ") = (batch, out_channels, out_h, out_w), but got ",
              grad.sizes());
  const Geometry g = geometry(s, stride_h, stride_w, pad_h, pad_w, dilation_h,
                              dilation_w, groups, offset_groups, use_mask);
  const at::ScalarType dtype = input.scalar_type(), ct = compute_type(dtype);
  const int64_t N = s.batch, O = s.out_channels, C = s.channels;
  const int64_t H = s.height, W = s.width, K = g.taps(), P = g.pixels();
  const auto opts = input.options().dtype(ct);
  at::Tensor grad_input = new_output(op, {N, C, H, W}, opts, /*zero=*/true);
  at::Tensor grad_weight = new_output(op, weight.sizes(), opts, true);
  at::Tensor grad_offset = new_output(op, offset.sizes(), opts, true);
  at::Tensor grad_mask = new_output(op, mask.sizes(), opts, true);
  const at::Tensor go = up(grad, ct).view({N, O, P});
  at::Tensor grad_bias = go.sum(at::IntArrayRef{0, 2});
  if (N > 0 && C > 0 && O > 0) {
    const at::Tensor in = up(input, ct), w = up(weight, ct),
                     off = up(offset, ct);
    const at::Tensor msk = use_mask ? up(mask, ct) : at::Tensor();
    const int64_t og_rows = O / groups, gc_rows = (C / groups) * K;
    const at::Tensor wg = w.view({groups, og_rows, gc_rows});
    at::Tensor gwg = grad_weight.view({groups, og_rows, gc_rows});
    at::Tensor columns = at::empty({C * K, P}, opts);
    at::Tensor grad_columns = at::empty({C * K, P}, opts);
    const int64_t cpg = g.group_channels(), plane = H * W;
    AT_DISPATCH_FLOATING_TYPES(ct, "torchops._deform_conv2d_backward", [&] {
      using T = scalar_t;
      const T* ip = in.const_data_ptr<T>();
      const T* offp = off.const_data_ptr<T>();
      const T* mp = use_mask ? msk.const_data_ptr<T>() : nullptr;
      T* cp = columns.mutable_data_ptr<T>();
      const T* gcp = grad_columns.const_data_ptr<T>();
      T* gip = grad_input.mutable_data_ptr<T>();
      T* gop = grad_offset.mutable_data_ptr<T>();
      T* gmp = use_mask ? grad_mask.mutable_data_ptr<T>() : nullptr;
      for (int64_t n = 0; n < N; ++n) {
        const T* in_n = ip + n * C * plane;
        const T* off_n = offp + n * 2 * offset_groups * K * P;
        const T* mask_n = mp ? mp + n * offset_groups * K * P : nullptr;
        deformable_im2col<T>(g, in_n, off_n, mask_n, cp);
        const at::Tensor go_n = go.select(0, n);
        for (int64_t grp = 0; grp < groups; ++grp) {
          const at::Tensor go_g = go_n.narrow(0, grp * og_rows, og_rows);
          gwg.select(0, grp).addmm_(
              go_g, columns.narrow(0, grp * gc_rows, gc_rows).t());
          at::Tensor gcol = grad_columns.narrow(0, grp * gc_rows, gc_rows);
          at::mm_out(gcol, wg.select(0, grp).t(), go_g);
        }
        // Offset and mask gradients: one thread per (og, k, p).
        T* gop_n = gop + n * 2 * offset_groups * K * P;
        T* gmp_n = gmp ? gmp + n * offset_groups * K * P : nullptr;
        const int64_t grain = std::max<int64_t>(1, 2048 / cpg);
        parallel_range(offset_groups * K * P, [&](int64_t begin, int64_t end) {
          for (int64_t q = begin; q < end; ++q) {
            const int64_t p = q % P, k = (q / P) % K, og = q / (P * K);
            T y, x, m;
            sample_at(g, off_n, mask_n, og, k, p, y, x, m);
            DeformTaps<T> t;
            T acc_y = T(0), acc_x = T(0), acc_m = T(0);
            if (deform_taps(y, x, H, W, t)) {
              for (int64_t c = og * cpg; c < (og + 1) * cpg; ++c) {
                const T* src = in_n + c * plane;
                const T gc = gcp[(c * K + k) * P + p];
                const T v0 = src[t.idx[0]], v1 = src[t.idx[1]],
                        v2 = src[t.idx[2]], v3 = src[t.idx[3]];
                acc_m += gc * (t.w[0] * v0 + t.w[1] * v1 + t.w[2] * v2 +
                               t.w[3] * v3);
                acc_y += gc * (t.dy[0] * v0 + t.dy[1] * v1 + t.dy[2] * v2 +
                               t.dy[3] * v3);
                acc_x += gc * (t.dx[0] * v0 + t.dx[1] * v1 + t.dx[2] * v2 +
                               t.dx[3] * v3);
              }
            }
            gop_n[(og * K + k) * 2 * P + p] = acc_y * m;
            gop_n[((og * K + k) * 2 + 1) * P + p] = acc_x * m;
            if (gmp_n != nullptr) {
              gmp_n[(og * K + k) * P + p] = acc_m;
            }
          }
        }, grain);
        // Input gradient: one thread per channel plane.
        T* gi_n = gip + n * C * plane;
        parallel_range(C, [&](int64_t begin, int64_t end) {
          for (int64_t c = begin; c < end; ++c) {
            const int64_t og = c / cpg;
            T* dst = gi_n + c * plane;
            for (int64_t k = 0; k < K; ++k) {
              const T* gc_row = gcp + (c * K + k) * P;
              for (int64_t p = 0; p < P; ++p) {
                T y, x, m;
                sample_at(g, off_n, mask_n, og, k, p, y, x, m);
                DeformTaps<T> t;
                if (!deform_taps(y, x, H, W, t)) {
                  continue;
                }
                const T gv = gc_row[p] * m;
                dst[t.idx[0]] += gv * t.w[0];
                dst[t.idx[1]] += gv * t.w[1];
                dst[t.idx[2]] += gv * t.w[2];
                dst[t.idx[3]] += gv * t.w[3];
              }
            }
          }
        }, 1);
      }
    });
  }
  return {grad_input.to(dtype), grad_weight.to(dtype), grad_offset.to(dtype),
          grad_mask.to(dtype), grad_bias.to(dtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("deform_conv2d", &deform_conv2d);
  m.impl("_deform_conv2d_backward", &deform_conv2d_backward);
}

}  // namespace torchops::cpu
