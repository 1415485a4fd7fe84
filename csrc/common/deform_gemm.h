// The GEMM half of deform_conv2d, the same on CPU and CUDA (ATen's BLAS /
// cuBLAS calls, or torchops.matmul on CUDA under deterministic algorithms;
// the im2col kernels around them are per device).
//
// A chunk of B images has its columns as one (C * kh * kw, B * P) matrix,
// rows (channel, tap), columns (image, pixel), so that each weight group
// needs one GEMM for the whole chunk -- a GEMM per image would be B small
// ones, and the weight gradient, a reduction over images and pixels, would
// need B GEMMs with a short reduction each.  The price is a transpose of
// the chunk's output (forward) and of its incoming gradient (backward),
// each a fraction of the column buffer's traffic.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <cstdint>

#include "common/library_matmul.h"

namespace torchops {

// out (G, M, N) = a (G, M, K) @ b (G, K, N): one plain GEMM when G == 1.
// Under deterministic algorithms on CUDA, torchops.matmul instead of cuBLAS
// (common/library_matmul.h: no CUBLAS_WORKSPACE_CONFIG needed).
inline void grouped_mm_out(at::Tensor& out, const at::Tensor& a,
                           const at::Tensor& b) {
  if (deterministic_cuda_gemm(a)) {
    out.copy_(library_matmul(a, b));
  } else if (a.size(0) == 1) {
    at::Tensor o = out.select(0, 0);
    at::mm_out(o, a.select(0, 0), b.select(0, 0));
  } else {
    at::bmm_out(out, a, b);
  }
}

// out += a @ b, in out's dtype: accumulated by the GEMM itself when the
// dtypes match, else (half inputs, float accumulator) added after it.
inline void grouped_mm_add(at::Tensor& out, const at::Tensor& a,
                           const at::Tensor& b) {
  if (deterministic_cuda_gemm(a)) {
    out.add_(library_matmul(a, b));
  } else if (out.scalar_type() == a.scalar_type()) {
    if (a.size(0) == 1) {
      out.select(0, 0).addmm_(a.select(0, 0), b.select(0, 0));
    } else {
      out.baddbmm_(a, b);
    }
  } else {
    at::Tensor prod = at::empty(out.sizes(), a.options());
    grouped_mm_out(prod, a, b);
    out.add_(prod);
  }
}

// Shapes of the GEMMs of one call.
struct DeformGemm {
  int64_t groups, out_channels, column_rows, pixels;
  int64_t out_rows() const { return out_channels / groups; }     // Og
  int64_t group_rows() const { return column_rows / groups; }   // Cg * K
};

// out[n0 : n0 + B] = weight @ columns + bias, out viewed (N, O, P) and
// columns (C * K, B * P).  `scratch` holds the (O, B * P) product between
// the GEMM and the transposing copy that adds the bias; allocated here on
// first use (the first chunk is the largest) and reused by later chunks, so
// that paths of the device that need none (CUDA's folded bias) pay none.
inline void deform_forward_gemm(const DeformGemm& d, at::Tensor& out3,
                                int64_t n0, int64_t images,
                                const at::Tensor& weight,
                                const at::Tensor& columns,
                                const at::Tensor& bias, at::Tensor& scratch) {
  const int64_t G = d.groups, BP = images * d.pixels;
  if (!scratch.defined() || scratch.numel() < d.out_channels * BP) {
    scratch = at::empty({d.out_channels * BP}, columns.options());
  }
  at::Tensor prod = scratch.narrow(0, 0, d.out_channels * BP)
                        .view({G, d.out_rows(), BP});
  grouped_mm_out(prod, weight.view({G, d.out_rows(), d.group_rows()}),
                 columns.view({G, d.group_rows(), BP}));
  at::Tensor dst = out3.narrow(0, n0, images);
  at::add_out(dst,
              prod.view({d.out_channels, images, d.pixels}).permute({1, 0, 2}),
              bias.view({1, d.out_channels, 1}));
}

// For images [n0, n0 + B): grad_columns (C * K, B * P) = weight^T @ grad,
// and grad_weight (in its accumulator dtype) += grad @ columns^T.
inline void deform_backward_gemm(const DeformGemm& d, const at::Tensor& grad3,
                                 int64_t n0, int64_t images,
                                 const at::Tensor& weight,
                                 const at::Tensor& columns,
                                 at::Tensor& grad_columns,
                                 at::Tensor& grad_weight) {
  const int64_t G = d.groups, BP = images * d.pixels;
  // (B, O, P) -> (O, B * P); no copy for a single image.
  const at::Tensor grad_t = grad3.narrow(0, n0, images)
                                .permute({1, 0, 2})
                                .contiguous()
                                .view({G, d.out_rows(), BP});
  const at::Tensor w = weight.view({G, d.out_rows(), d.group_rows()});
  at::Tensor gcol = grad_columns.view({G, d.group_rows(), BP});
  grouped_mm_out(gcol, w.transpose(1, 2), grad_t);
  at::Tensor gw = grad_weight.view({G, d.out_rows(), d.group_rows()});
  grouped_mm_add(gw, grad_t, columns.view({G, d.group_rows(), BP}).transpose(1, 2));
}

}  // namespace torchops
