// float math that GCC and Clang auto-vectorise.
//
// A loop that calls std::exp or std::log1p stays scalar (libm calls, errno),
// and a float comparison inside a loop blocks if-conversion under the default
// -ftrapping-math (a `<` may raise FE_INVALID).  These helpers use only
// arithmetic and integer operations on the bit patterns, so a loop built from
// them vectorises at -O3 (and, in TORCHOPS_CPU_MULTIVERSION functions, to
// AVX2 + FMA).  Accuracy is within a few ulp of libm on the documented
// domains.
#pragma once

#include <cstdint>
#include <cstring>

namespace torchops::cpu::vec_math {

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// c ? a : b without a floating-point branch.
inline float select(bool c, float a, float b) {
  return float_of(c ? bits_of(a) : bits_of(b));
}

// Sign bit set: true for negative numbers, -0.0 and negative NaNs.
inline bool sign_bit(float v) {
  return (bits_of(v) >> 31) != 0;
}

// exp(-a) for a >= 0 given as its bit pattern abs_bits (NaN gives NaN).
//
// Cephes' expf: n = round(-a / ln 2), r = -a - n ln 2 with ln 2 split in two
// so n ln2_hi is exact, a degree-6 polynomial for exp(r) on |r| <= ln2 / 2,
// and 2^n built in the exponent field.  Results below exp(-87) (~1.6e-38,
// where 2^n would leave the normal range) are flushed to 0.
inline float exp_neg_abs(uint32_t abs_bits) {
  constexpr uint32_t k87 = 0x42AE0000u;      // 87.0f
  constexpr uint32_t kInf = 0x7F800000u;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  // 1.5 * 2^23: adding it rounds to an integer, which then sits in the low
  // mantissa bits (floats in [2^23, 2^24) are exactly the integers).
  constexpr float kShift = 12582912.0f;

  // Clamped so 2^n stays a normal number; see `keep` below.
  const uint32_t clamped = abs_bits < k87 ? abs_bits : k87;
  const float y = float_of(clamped | 0x80000000u);
  const float shifted = y * kLog2e + kShift;
  const uint32_t biased_n = bits_of(shifted) - bits_of(kShift) + 127u;  // n + 127 in [1, 127]
  const float n = shifted - kShift;
  const float r = (y - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  // 1 in range, 0 past the clamp, NaN for NaN; applied as a factor because
  // a select of the result would again let GCC move its computation into a
  // branch.
  const uint32_t keep = abs_bits <= k87 ? 0x3F800000u
      : abs_bits <= kInf ? 0u : 0x7FC00000u;
  return er * float_of(biased_n << 23) * float_of(keep);
}

// log1p(e) for e in [0, 1] (NaN gives NaN).
//
// log1p(e) = 2 atanh(s) with s = e / (2 + e) in [0, 1/3]: no cancellation
// for small e, and the odd series 2 (s + s^3/3 + s^5/5 + ...) truncated after
// s^15 is below float rounding for s^2 <= 1/9.
inline float log1p_unit(float e) {
  const float s = e / (2.0f + e);
  const float z = s * s;
  float p = 1.0f / 15.0f;
  p = p * z + 1.0f / 13.0f;
  p = p * z + 1.0f / 11.0f;
  p = p * z + 1.0f / 9.0f;
  p = p * z + 1.0f / 7.0f;
  p = p * z + 1.0f / 5.0f;
  p = p * z + 1.0f / 3.0f;
  const float w = 2.0f * s;
  return w + w * z * p;
}

}  // namespace torchops::cpu::vec_math
