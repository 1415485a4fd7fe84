// The problem every CUDA matmul path of torchops solves, in plain CUDA types
// (no ATen), so each path's header also builds into the stand-alone harness
// of scripts/matmul_dev/ and can be timed and checked without the extension.
//
//   C[b, i, j] = sum_k A[b, i, k] * B[b, k, j]
//
// A and B are read through element strides (transposed, sliced and expanded
// inputs included); C is written contiguous (batch, m, n), as the kernels'
// callers allocate it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace torchops::cuda::gemm {

enum class DType { f16, bf16, f32, f64 };

inline int dtype_bytes(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f32:
      return 4;
    default:
      return 8;
  }
}

struct Operand {
  const void* ptr;
  int64_t batch_stride, row_stride, col_stride;  // in elements
};

struct GemmArgs {
  Operand a;  // (batch, m, k)
  Operand b;  // (batch, k, n)
  void* c;    // (batch, m, n), contiguous
  int64_t batch, m, n, k;
  DType dtype;
  // float32 only: tensor cores with TF32 inputs allowed (PyTorch's "high").
  bool allow_tf32;
};

}  // namespace torchops::cuda::gemm
