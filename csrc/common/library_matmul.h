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

}  // namespace torchops
