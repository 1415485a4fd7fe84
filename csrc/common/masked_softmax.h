// Shapes and argument checks of the fused masked softmaxes,
// torchops.scaled_masked_softmax and torchops.scaled_upper_triang_masked_softmax,
// written once for the CPU and CUDA kernels.
//
// Both compute, for every row of the last dimension,
//   y = softmax(scale * x) with the masked keys left out (probability 0),
// in float32 for half types (float64 for float64).  A row whose keys are all
// masked (or whose unmasked scores are all -inf) gives zeros, not NaN:
// Megatron fills masked scores with -10000 instead, which turns such a row
// into a uniform distribution over the masked keys.
//
// The backward of both is dx = scale * y * (dy - sum(dy * y)) per row; it
// needs no mask, since y is 0 wherever a key was masked.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/checks.h"

namespace torchops {

// The rows of a (B, H, Sq, Sk) or (B, Sq, Sk) softmax as the kernels see
// them: `rows` = B * H * Sq rows of `sk` contiguous scores.
struct SoftmaxRows {
  int64_t rows = 0;
  int64_t sq = 1;
  int64_t sk = 0;
  int64_t heads = 1;
  // The mask's batch size (1: one mask for every batch entry); 0 without a
  // mask.
  int64_t mask_batch = 0;
  // Key j of query i is masked for j > i (Sq == Sk).
  bool causal = false;
};

// The number of unmasked leading keys of row `row`: only those are read.
C10_HOST_DEVICE inline int64_t softmax_row_length(const SoftmaxRows& s, int64_t row) {
  return s.causal ? row % s.sq + 1 : s.sk;
}

// The offset of row `row`'s mask row in a contiguous (mask_batch, 1, Sq, Sk)
// mask.
C10_HOST_DEVICE inline int64_t softmax_mask_offset(const SoftmaxRows& s, int64_t row) {
  const int64_t q = row % s.sq;
  const int64_t b = s.mask_batch == 1 ? 0 : row / (s.heads * s.sq);
  return (b * s.sq + q) * s.sk;
}

inline SoftmaxRows softmax_rows_4d(const at::Tensor& x) {
  SoftmaxRows s;
  s.heads = x.size(1);
  s.sq = x.size(2);
  s.sk = x.size(3);
  s.rows = x.size(0) * s.heads * s.sq;
  return s;
}

inline SoftmaxRows check_scaled_masked_softmax(const at::Tensor& input,
                                               const at::Tensor& mask,
                                               c10::DeviceType device) {
  const char* op = "scaled_masked_softmax";
  check_devices(op, device, {{input, "input"}, {mask, "mask"}});
  check_floating(op, {input, "input"});
  check_dim(op, {input, "input"}, 4);
  TORCH_CHECK(mask.scalar_type() == at::kBool, "torchops.", op,
              ": expected 'mask' to be a bool tensor, but got ", mask.scalar_type());
  check_dim(op, {mask, "mask"}, 4);
  TORCH_CHECK(
      (mask.size(0) == 1 || mask.size(0) == input.size(0)) && mask.size(1) == 1 &&
          mask.size(2) == input.size(2) && mask.size(3) == input.size(3),
      "torchops.", op, ": expected 'mask' to have shape (", input.size(0), " or 1, 1, ",
      input.size(2), ", ", input.size(3), ") for 'input' of shape ", input.sizes(),
      ", but got ", mask.sizes());
  SoftmaxRows s = softmax_rows_4d(input);
  s.mask_batch = mask.size(0);
  return s;
}

inline SoftmaxRows check_upper_triang_shape(const char* op, Arg x) {
  TORCH_CHECK(x.t.dim() == 3 || x.t.dim() == 4, "torchops.", op, ": expected '", x.name,
              "' to have 3 dimensions (B, Sq, Sk) or 4 (B, H, Sq, Sk), but got ",
              x.t.dim(), " (shape ", x.t.sizes(), ")");
  TORCH_CHECK(x.t.size(-1) == x.t.size(-2), "torchops.", op, ": expected '", x.name,
              "' to be square in its last two dimensions (Sq == Sk, the causal mask "
              "of self-attention), but got shape ", x.t.sizes());
  SoftmaxRows s;
  s.sq = x.t.size(-2);
  s.sk = x.t.size(-1);
  s.heads = x.t.dim() == 4 ? x.t.size(1) : 1;
  s.rows = x.t.size(0) * s.heads * s.sq;
  s.causal = true;
  return s;
}

inline SoftmaxRows check_scaled_upper_triang_masked_softmax(const at::Tensor& input,
                                                            c10::DeviceType device) {
  const char* op = "scaled_upper_triang_masked_softmax";
  check_devices(op, device, {{input, "input"}});
  check_floating(op, {input, "input"});
  return check_upper_triang_shape(op, {input, "input"});
}

// The backward ops' arguments: `output` is the forward's result.
inline SoftmaxRows check_softmax_backward(const char* op, const at::Tensor& grad,
                                          const at::Tensor& output, bool causal,
                                          c10::DeviceType device) {
  check_devices(op, device, {{output, "output"}, {grad, "grad"}});
  check_floating(op, {output, "output"});
  check_same_dtype(op, {output, "output"}, {grad, "grad"});
  TORCH_CHECK(grad.sizes() == output.sizes(), "torchops.", op,
              ": expected 'grad' to have the shape of 'output' (", output.sizes(),
              "), but got ", grad.sizes());
  if (causal) {
    return check_upper_triang_shape(op, {output, "output"});
  }
  check_dim(op, {output, "output"}, 4);
  return softmax_rows_4d(output);
}

}  // namespace torchops
