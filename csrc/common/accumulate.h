// The type a kernel accumulates a dtype's sums in: double for double, float
// for float and the half types (rounded once at the end), on CPU and CUDA.
#pragma once

#include <c10/core/ScalarType.h>

namespace torchops {

inline at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace torchops
