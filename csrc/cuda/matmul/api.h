// The matmul subsystem's interface for other ops' CUDA kernels: GEMMs on
// TF32 tensor cores whatever the user's float32 precision, for ops that build
// float32 accuracy out of several TF32 products (cuda/common/split_tf32.cuh)
// or need it in one kernel (3xTF32).  Never a substitute for an exact float32
// GEMM on its own.  Ops call these functions, never a path's header: which
// path runs is the subsystem's choice (csrc/cuda/matmul/matmul.cu).
#pragma once

#include <ATen/core/Tensor.h>

namespace torchops::matmul {

// a @ b (float32, 2-D or batched 3-D, checked as torchops.matmul checks
// them) with TF32 products and float32 accumulation.
at::Tensor gemm_tf32(const at::Tensor& a, const at::Tensor& b);

// The same into `out`: contiguous, of the result's shape, float32.
void gemm_tf32_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// out = a @ b at float32 accuracy on TF32 tensor cores (3xTF32, each operand
// split into a high and a low TF32 part inside the kernel), where the GPU and
// layouts allow it: Hopper, b row-major with 16-byte-aligned strides, any a
// (broadcast over the batch too).  Shapes as torchops.matmul's; out
// contiguous.  Returns false, having done nothing, where it cannot run: the
// caller falls back.
bool gemm_3xtf32_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// Whether the current GPU has the 3xTF32 mode at all (Hopper, sm_90): lets a
// caller pick its data layout before it asks for the product.
bool gemm_3xtf32_available();

}  // namespace torchops::matmul
