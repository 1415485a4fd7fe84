// A float32 as the sum of two TF32 values, x = hi + lo (the "3xTF32" split,
// explained in split_tf32.cuh).  Torch-free, so the matmul paths' headers
// (scripts/matmul_dev builds them without ATen) split in their kernels with
// the same rounding as the ATen-side helpers.
#pragma once

#include <cstdint>

namespace torchops::cuda {

// x = hi + lo, both TF32-representable (low 13 mantissa bits zero).  Inf and
// NaN stay in hi with lo = 0, so they reach the result as in one product; a
// value that would round up to Inf is truncated instead.
__device__ __forceinline__ void split_tf32(float x, float& hi, float& lo) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    hi = x;
    lo = 0.f;
    return;
  }
  uint32_t r = (u + 0x1000u) & 0xffffe000u;  // nearest, ties away from zero
  if ((r & 0x7f800000u) == 0x7f800000u) {
    r = u & 0xffffe000u;
  }
  hi = __uint_as_float(r);
  const float d = x - hi;  // exact: hi and x share the leading bits
  lo = __uint_as_float((__float_as_uint(d) + 0x1000u) & 0xffffe000u);
}

}  // namespace torchops::cuda
