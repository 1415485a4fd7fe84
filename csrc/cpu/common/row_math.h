// Row loops of the CPU kernels that reduce over a row held in a float
// buffer (float64 for float64): branch-free half <-> float conversions, the
// row maximum and lane-wise sums, written so GCC auto-vectorises them (a
// floating max or sum would need -ffast-math to vectorise).  Shared by the
// masked softmaxes and fused_linear_cross_entropy.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/common/parallel.h"
#include "cpu/common/vec_math.h"

namespace torchops::cpu {
namespace {

namespace vm = vec_math;

constexpr int kLanes = 16;

template <typename acc_t>
constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

// float16 <-> float without branches (c10::Half's conversions branch, and
// keep the row loops scalar): integer operations, with every choice made by
// an all-ones or all-zeros mask (GCC turns a select into a branch when one
// side is computed).
inline uint32_t all_if(bool c) { return 0u - static_cast<uint32_t>(c); }

inline uint32_t choose(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & mask) | (b & ~mask);
}

inline float half_to_float(c10::Half h) {
  const uint32_t b = h.x;
  constexpr uint32_t kShiftedExp = 0x7C00u << 13;
  uint32_t o = (b & 0x7FFFu) << 13;
  const uint32_t exp = o & kShiftedExp;
  o += (127u - 15u) << 23;
  o += all_if(exp == kShiftedExp) & ((128u - 16u) << 23);  // inf and NaN
  // Zero and subnormals: renormalised by a float subtraction.
  const uint32_t sub = vm::bits_of(vm::float_of(o + (1u << 23)) - vm::float_of(113u << 23));
  o = choose(all_if(exp == 0), sub, o);
  return vm::float_of(o | ((b & 0x8000u) << 16));
}

// Rounded to nearest even, as c10::Half(float).
inline c10::Half float_to_half(float v) {
  constexpr uint32_t kInf = 255u << 23;
  constexpr uint32_t kHalfMax = (127u + 16u) << 23;
  constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t f = vm::bits_of(v);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  const uint32_t big = choose(all_if(f > kInf), 0x7E00u, 0x7C00u);  // NaN, or inf
  const uint32_t small =
      vm::bits_of(vm::float_of(f) + vm::float_of(kDenormMagic)) - kDenormMagic;
  const uint32_t mant_odd = (f >> 13) & 1u;
  const uint32_t normal = (f + ((15u - 127u) << 23) + 0xFFFu + mant_odd) >> 13;
  const uint32_t o = choose(all_if(f >= kHalfMax), big,
                            choose(all_if(f < (113u << 23)), small, normal));
  return c10::Half(static_cast<uint16_t>(o | (sign >> 16)), c10::Half::from_bits());
}

template <typename acc_t, typename T>
inline acc_t to_acc(T v) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return half_to_float(v);
  } else {
    return static_cast<acc_t>(v);
  }
}

template <typename T, typename acc_t>
inline T from_acc(acc_t v) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return float_to_half(v);
  } else {
    return static_cast<T>(v);
  }
}

// buf[j] = scale * x[j], or -inf where mask[j].  The mask is read as bytes
// and applied with bit operations: GCC vectorises neither a load of bool nor
// a select that it turns into a branch.
template <typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION void load_scaled(const T* __restrict__ x,
                                           const uint8_t* __restrict__ mask, acc_t scale,
                                           acc_t* __restrict__ buf, int64_t n) {
  if (mask == nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = to_acc<acc_t>(x[j]) * scale;
    }
  } else if constexpr (std::is_same_v<acc_t, float>) {
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t all = 0u - static_cast<uint32_t>(mask[j] != 0);
      const uint32_t v = vm::bits_of(to_acc<float>(x[j]) * scale);
      buf[j] = vm::float_of((v & ~all) | (vm::bits_of(kNegInf<float>) & all));
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = mask[j] != 0 ? kNegInf<acc_t> : to_acc<acc_t>(x[j]) * scale;
    }
  }
}

// A signed integer that orders like the float, -inf < ... < inf, with every
// NaN above inf (as the largest key, which maps back to a NaN).
inline int32_t ordered_key(float v) {
  const uint32_t u = vm::bits_of(v);
  const auto b = static_cast<int32_t>(u);
  const int32_t key = b ^ ((b >> 31) & 0x7FFFFFFF);
  const auto nan = static_cast<int32_t>(all_if((u & 0x7FFFFFFFu) > 0x7F800000u));
  return (0x7FFFFFFF & nan) | (key & ~nan);
}

// The largest value of v[0, n) (n >= 1), NaN if there is one.
TORCHOPS_CPU_MULTIVERSION float row_max(const float* __restrict__ v, int64_t n) {
  int32_t acc[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    acc[k] = ordered_key(kNegInf<float>);
  }
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const int32_t key = ordered_key(v[j + k]);
      acc[k] = acc[k] > key ? acc[k] : key;
    }
  }
  for (; j < n; ++j) {
    const int32_t key = ordered_key(v[j]);
    acc[0] = acc[0] > key ? acc[0] : key;
  }
  int32_t best = acc[0];
  for (int k = 1; k < kLanes; ++k) {
    best = std::max(best, acc[k]);
  }
  const int32_t b = best ^ ((best >> 31) & 0x7FFFFFFF);
  return vm::float_of(static_cast<uint32_t>(b));
}

inline double row_max(const double* v, int64_t n) {
  double m = kNegInf<double>;
  for (int64_t j = 0; j < n; ++j) {
    m = (v[j] > m || std::isnan(v[j])) ? v[j] : m;
  }
  return m;
}

template <typename acc_t>
inline acc_t lanes_total(const acc_t (&acc)[kLanes]) {
  acc_t t[kLanes / 2];
  for (int k = 0; k < kLanes / 2; ++k) {
    t[k] = acc[k] + acc[k + kLanes / 2];
  }
  for (int w = kLanes / 4; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) {
      t[k] += t[k + w];
    }
  }
  return t[0];
}

}  // namespace
}  // namespace torchops::cpu
