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

// The paths' tile order: linear tile index t -> tile row tm and column tn,
// in groups of `group` tile rows swept column by column (rows fastest), so
// the tiles in flight at once share A rows and B columns in L2.
__host__ __device__ __forceinline__ void grouped_tile(int64_t t, int64_t tiles_m, int64_t tiles_n,
                                                      int64_t group, int64_t& tm, int64_t& tn) {
  const int64_t per_group = group * tiles_n;
  const int64_t first_m = t / per_group * group;
  const int64_t rows = tiles_m - first_m < group ? tiles_m - first_m : group;
  const int64_t in_group = t - first_m * tiles_n;
  tm = first_m + in_group % rows;
  tn = in_group / rows;
}

}  // namespace torchops::cuda::gemm
