// torchops::matmul called from another op's kernel, through the dispatcher
// (each library calls its own device's kernels; no link-time dependency).
// Ops use it where ATen's GEMM would not do: torchops.matmul is
// deterministic on every device, while cuBLAS under
// torch.use_deterministic_algorithms(True) demands CUBLAS_WORKSPACE_CONFIG
// be set before the process's first cuBLAS call, and raises otherwise.
// float32 follows torch's matmul precision, as torchops.matmul does.
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>

#include "common/op_handle.h"

namespace torchops {

// a @ b, 2-D or batched 3-D, in a's dtype.
inline at::Tensor library_matmul(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
      "torchops::matmul");
  return op.call(a, b);
}

// Whether a GEMM on `t`'s device should be library_matmul rather than
// ATen's: on CUDA under torch.use_deterministic_algorithms(True).
inline bool deterministic_cuda_gemm(const at::Tensor& t) {
  return t.is_cuda() && at::globalContext().deterministicAlgorithms();
}

// An op's internal GEMM, a @ b (2-D or batched 3-D): ATen's (cuBLAS) on
// CUDA, whose heuristics pick split-K and tile shapes for the thin GEMMs
// masked positions make; torchops.matmul under deterministic algorithms
// and on CPU, where its result does not depend on the thread count.
inline at::Tensor op_matmul(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_cuda() && !deterministic_cuda_gemm(a)) {
    return at::matmul(a, b);
  }
  return library_matmul(a, b);
}

// out = a @ b (2-D, out contiguous), by op_matmul's choice of GEMM; on CUDA
// cuBLAS writes into `out` directly.
inline void op_matmul_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (a.is_cuda() && !deterministic_cuda_gemm(a)) {
    at::mm_out(out, a, b);
  } else {
    out.copy_(library_matmul(a, b));
  }
}

// out += a @ b (2-D).  torchops.matmul has no accumulating form, and a
// temporary of out's size per call is what a chunked op exists to avoid, so
// this is ATen's addmm_ (cuBLAS or the CPU BLAS, accumulating in place)
// except under deterministic algorithms on CUDA, where it is a temporary
// from torchops.matmul added in.
inline void op_matmul_accumulate(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (deterministic_cuda_gemm(a)) {
    out.add_(library_matmul(a, b));
  } else {
    out.addmm_(a, b);
  }
}

}  // namespace torchops
