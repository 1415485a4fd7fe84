// The steps of torchops.deform_conv2d and its backward, written once for
// both devices: the checks, the chunking over images and the GEMMs
// (common/deform_gemm.h) are the same; each device supplies its kernels and
// the few choices that differ (a `Kernels` type with the static members
// below).
//
//   Kernels::device                              c10::DeviceType
//   Kernels::prepare(op, s, input)               the device's own checks;
//                                                returns what must live for
//                                                the call (CUDA: the guard)
//   Kernels::compute_type(dtype)                 the dtype the kernels and
//                                                GEMMs work in (CPU: the
//                                                accumulate type; CUDA: the
//                                                input's)
//   Kernels::chunk_input(in, n0, images)         the chunk's input planes as
//                                                the kernels read them
//   Kernels::column_copies(ct, d, N)             1, or 2 where the GEMMs
//                                                want the columns split
//                                                (CUDA: 3xTF32, rows of the
//                                                high parts, then the low)
//   Kernels::forward_column_rows(ct, d, N)       the forward's column rows:
//                                                copies * C * K, or more
//                                                where its GEMM wants them
//                                                (CUDA: the bias folded in)
//   Kernels::im2col<Name>(chunk, cols)           cols (copies * C * K, B * P);
//                                                Name: the dtype dispatch's
//                                                name
//   Kernels::forward_chunk(chunk, d, out3, n0, B, w, cols, b, scratch)
//                                                the chunk's im2col and
//                                                GEMM into out3 (N, O, P):
//                                                deform_forward_gemm
//                                                (common/deform_gemm.h), or
//                                                the device's own
//   Kernels::backward_gemm(...)                  deform_backward_gemm, or
//                                                the device's own
//   Kernels::grad_bias(grad, go, acc)            go: grad as (N, O, P) in
//                                                the compute type
//   Kernels::gathers_input_grad(deterministic, g)
//                                                whether the kernels write
//                                                every element of grad_input
//                                                (else they add into zeros
//                                                in the accumulate type)
//   Kernels::col2im_buffer(chunk, s, opts)       scratch the input gradient
//                                                kernels reuse across chunks
//   Kernels::input_grads(chunk, gcols, grad_offset, grad_mask, grad_input,
//                        buffer, gathered)       the chunk's offset, mask and
//                                                input gradients from
//                                                gcols (C * K, B * P)
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <tuple>

#include "common/accumulate.h"
#include "common/deform_conv2d.h"
#include "common/deform_gemm.h"

namespace torchops {

// The names the kernels' dtype dispatches report an unsupported dtype under
// (AT_DISPATCH wants constant expressions).
struct DeformForwardName {
  static constexpr const char value[] = "torchops.deform_conv2d";
};
struct DeformBackwardName {
  static constexpr const char value[] = "torchops._deform_conv2d_backward";
};

// The images [n0, n0 + images) of one call, as its kernels read them; all
// contiguous, in the compute type.
struct DeformChunkTensors {
  DeformGeometry g;
  int64_t images;
  at::Tensor input;   // Kernels::chunk_input's
  at::Tensor offset;  // (images, 2 * OG * K, out_h, out_w)
  at::Tensor mask;    // (images, OG * K, out_h, out_w); undefined without use_mask
};

// t in dtype ct, contiguous: t itself where it already is.
inline at::Tensor deform_operand(const at::Tensor& t, at::ScalarType ct) {
  return t.to(ct).contiguous();
}

// The chunk's rows of t (undefined stays undefined).
inline at::Tensor deform_rows(const at::Tensor& t, int64_t n0, int64_t images) {
  return t.defined() ? t.narrow(0, n0, images) : t;
}

template <typename Kernels>
DeformChunkTensors deform_chunk_tensors(const DeformGeometry& g,
                                        const at::Tensor& in,
                                        const at::Tensor& off,
                                        const at::Tensor& msk, int64_t n0,
                                        int64_t images) {
  return {g, images, Kernels::chunk_input(in, n0, images),
          off.narrow(0, n0, images), deform_rows(msk, n0, images)};
}

template <typename Kernels>
at::Tensor deform_conv2d_forward(const at::Tensor& input,
                                 const at::Tensor& weight,
                                 const at::Tensor& offset,
                                 const at::Tensor& mask, const at::Tensor& bias,
                                 int64_t stride_h, int64_t stride_w,
                                 int64_t pad_h, int64_t pad_w,
                                 int64_t dilation_h, int64_t dilation_w,
                                 int64_t groups, int64_t offset_groups,
                                 bool use_mask) {
  const char* op = "deform_conv2d";
  const auto [s, g] = check_deform_call(
      op, Kernels::device, input, weight, offset, mask, bias, stride_h,
      stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups,
      use_mask);
  [[maybe_unused]] const auto prepared = Kernels::prepare(op, s, input);
  const at::ScalarType dtype = input.scalar_type();
  const at::ScalarType ct = Kernels::compute_type(dtype);
  const int64_t N = s.batch, O = s.out_channels, C = s.channels;
  const int64_t K = g.taps(), P = g.pixels();
  at::Tensor out = new_output(op, {N, O, s.out_h, s.out_w},
                              input.options().dtype(ct));
  if (out.numel() == 0) {
    return out.to(dtype);
  }
  const at::Tensor b = deform_operand(bias, ct);
  at::Tensor out3 = out.view({N, O, P});
  if (C == 0) {
    out3.copy_(b.view({1, O, 1}).expand({N, O, P}));
    return out.to(dtype);
  }
  const at::Tensor in = deform_operand(input, ct), w = deform_operand(weight, ct),
                   off = deform_operand(offset, ct);
  const at::Tensor msk = use_mask ? deform_operand(mask, ct) : at::Tensor();
  const DeformGemm d{groups, O, C * K, P};
  const int64_t rows = Kernels::forward_column_rows(ct, d, N);
  const int64_t chunk = deform_chunk(N, rows, P, at::elementSize(ct));
  at::Tensor columns = at::empty({rows * chunk * P}, in.options());
  at::Tensor scratch;  // allocated by the first chunk that needs it
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t B = std::min(chunk, N - n0);
    const at::Tensor cols = columns.narrow(0, 0, rows * B * P).view({rows, B * P});
    Kernels::forward_chunk(deform_chunk_tensors<Kernels>(g, in, off, msk, n0, B),
                           d, out3, n0, B, w, cols, b, scratch);
  }
  return out.to(dtype);
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward(const at::Tensor& grad, const at::Tensor& input,
                       const at::Tensor& weight, const at::Tensor& offset,
                       const at::Tensor& mask, const at::Tensor& bias,
                       int64_t stride_h, int64_t stride_w, int64_t pad_h,
                       int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
                       int64_t groups, int64_t offset_groups, bool use_mask) {
  const char* op = "_deform_conv2d_backward";
  const auto [s, g] = check_deform_call(
      op, Kernels::device, input, weight, offset, mask, bias, stride_h,
      stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups,
      use_mask);
  check_deform_grad(op, Kernels::device, grad, input, s);
  [[maybe_unused]] const auto prepared = Kernels::prepare(op, s, input);
  const at::ScalarType dtype = input.scalar_type();
  const at::ScalarType ct = Kernels::compute_type(dtype);
  const at::ScalarType acc = accumulate_type(dtype);
  const int64_t N = s.batch, O = s.out_channels, C = s.channels;
  const int64_t H = s.height, W = s.width, K = g.taps(), P = g.pixels();
  const bool gathered =
      Kernels::gathers_input_grad(at::globalContext().deterministicAlgorithms(), g);
  const auto opts = input.options().dtype(ct);
  // A gathered grad_input is written whole by the kernels; a scattered one
  // is added into zeros (float32 for half types).
  at::Tensor grad_input = new_output(op, {N, C, H, W},
                                     opts.dtype(gathered ? ct : acc),
                                     /*zero=*/!gathered);
  at::Tensor grad_weight = new_output(op, weight.sizes(), opts.dtype(acc), true);
  at::Tensor grad_offset = new_output(op, offset.sizes(), opts, true);
  at::Tensor grad_mask = new_output(op, mask.sizes(), opts, true);
  const at::Tensor go = deform_operand(grad, ct).view({N, O, P});
  at::Tensor grad_bias = Kernels::grad_bias(grad, go, acc);
  if (N > 0 && C > 0 && O > 0) {
    const at::Tensor in = deform_operand(input, ct), w = deform_operand(weight, ct),
                     off = deform_operand(offset, ct);
    const at::Tensor msk = use_mask ? deform_operand(mask, ct) : at::Tensor();
    const DeformGemm d{groups, O, C * K, P};
    const int64_t copies = Kernels::column_copies(ct, d, N);
    const int64_t rows = copies * C * K;
    const int64_t chunk = deform_chunk(N, rows, P, at::elementSize(ct));
    at::Tensor columns = at::empty({rows * chunk * P}, opts);
    at::Tensor grad_columns = at::empty({C * K * chunk * P}, opts);
    at::Tensor buffer = Kernels::col2im_buffer(chunk, s, opts);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t B = std::min(chunk, N - n0);
      const at::Tensor cols = columns.narrow(0, 0, rows * B * P).view({rows, B * P});
      at::Tensor gcols =
          grad_columns.narrow(0, 0, C * K * B * P).view({C * K, B * P});
      const DeformChunkTensors ch =
          deform_chunk_tensors<Kernels>(g, in, off, msk, n0, B);
      Kernels::template im2col<DeformBackwardName>(ch, cols);
      Kernels::backward_gemm(d, go, n0, B, w, cols, gcols, grad_weight);
      Kernels::input_grads(ch, gcols, grad_offset.narrow(0, n0, B),
                           use_mask ? grad_mask.narrow(0, n0, B) : at::Tensor(),
                           grad_input.narrow(0, n0, B), buffer, gathered);
    }
  } else if (gathered) {
    grad_input.zero_();
  }
  return {grad_input.to(dtype), grad_weight.to(dtype), grad_offset.to(dtype),
          grad_mask.to(dtype), grad_bias.to(dtype)};
}

}  // namespace torchops
