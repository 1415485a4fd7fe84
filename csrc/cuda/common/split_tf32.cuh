// float32 GEMMs at float32 accuracy on TF32 tensor cores ("3xTF32"): each
// operand is split as x = hi + lo, hi rounded to TF32 (10 mantissa bits)
// and lo = x - hi (exact in float32) rounded to TF32 too, and
//   a @ b ~ hi_a @ hi_b + hi_a @ lo_b + lo_a @ hi_b,
// dropping lo_a @ lo_b (2^-22 of |a||b|) and lo's own rounding (2^-22).
// Every product is then exact in the tensor cores, so the error is
// float32-sized (a few times exact float32's, against TF32 alone's 2^-11;
// test_deform.py bounds it).  Three TF32 GEMMs still beat one exact float32
// GEMM on CUDA cores (Hopper's TF32 tensor-core peak is about seven times
// its float32 FMA peak) once every dimension is a few hundred.  The callers choose how to lay out the parts so that the
// three products need few launches (see deform_conv2d.cu); the sm90
// matmul path's 3xTF32 mode splits inside its kernel instead, so that the
// large operand is never stored twice (cuda/matmul/sm90.cuh).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "cuda/common/launch.cuh"
#include "cuda/common/tf32_parts.cuh"  // split_tf32

namespace torchops::cuda {

// Where a split of a (rows, cols) matrix goes: up to two copies of hi, at
// hi_ld floats per row, and one of lo at lo_ld; null: not wanted.
struct SplitDst {
  float* hi0;
  float* hi1;
  int64_t hi_ld;
  float* lo;
  int64_t lo_ld;
};

__global__ void __launch_bounds__(256) split_tf32_rows_kernel(
    const float* __restrict__ x, int64_t rows, int64_t cols, SplitDst d) {
  const int64_t total = rows * cols;
  for (int64_t i = grid_start<int64_t>(); i < total; i += grid_stride<int64_t>()) {
    const int64_t r = i / cols, c = i % cols;
    float hi, lo;
    split_tf32(x[i], hi, lo);
    const int64_t o = r * d.hi_ld + c;
    if (d.hi0 != nullptr) {
      d.hi0[o] = hi;
    }
    if (d.hi1 != nullptr) {
      d.hi1[o] = hi;
    }
    if (d.lo != nullptr) {
      d.lo[r * d.lo_ld + c] = lo;
    }
  }
}

// Splits x (rows, cols), contiguous float32, into d on the current stream.
inline void split_tf32_rows(const at::Tensor& x, const SplitDst& d) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows * cols == 0) {
    return;
  }
  split_tf32_rows_kernel<<<grid_for(rows * cols, 256), 256, 0, current_stream()>>>(
      x.const_data_ptr<float>(), rows, cols, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace torchops::cuda
