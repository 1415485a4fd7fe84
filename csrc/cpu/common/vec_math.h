// float math that GCC and Clang auto-vectorise.
//
// A loop that calls std::exp, std::log or std::pow stays scalar (libm calls,
// errno), and a float comparison inside a loop blocks if-conversion under the
// default -ftrapping-math (a `<` may raise FE_INVALID).  These helpers use
// only arithmetic and integer operations on the bit patterns, so a loop built
// from them vectorises at -O3 (and, in TORCHOPS_CPU_MULTIVERSION functions,
// to AVX2 + FMA).  Results are within a few ulp of libm on the documented
// domains; special values (0, inf, NaN) behave as in libm unless noted.
//
// One more GCC trap: a select between a computed value and a constant lets
// GCC move the computation into a branch (and then not vectorise).  Special
// cases are therefore applied as a factor or an addend, never as a select of
// the result.
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

namespace detail {

constexpr uint32_t kSign = 0x80000000u;
constexpr uint32_t kInf = 0x7F800000u;
constexpr uint32_t kNan = 0x7FC00000u;
constexpr uint32_t kOne = 0x3F800000u;
constexpr float kLn2Hi = 0.693359375f;  // few bits: k * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;

// exp(y) for y in [-87, 88] (Cephes' expf): n = round(y / ln 2),
// r = y - n ln 2 with ln 2 split in two, a degree-6 polynomial for exp(r) on
// |r| <= ln2 / 2, and 2^n built in the exponent field (n + 127 in [1, 254]).
inline float exp_core(float y) {
  constexpr float kLog2e = 1.44269504088896341f;
  // 1.5 * 2^23: adding it rounds to an integer, which then sits in the low
  // mantissa bits (floats in [2^23, 2^24) are exactly the integers).
  constexpr float kShift = 12582912.0f;
  const float shifted = y * kLog2e + kShift;
  const uint32_t biased_n = bits_of(shifted) - bits_of(kShift) + 127u;
  const float n = shifted - kShift;
  const float r = (y - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.0f) * float_of(biased_n << 23);
}

}  // namespace detail

// exp(y).  Results below exp(-87) (~1.6e-38, the edge of the normal range)
// are flushed to 0, and above exp(88) (~1.65e38) they are inf.
inline float exp_vec(float y) {
  using namespace detail;
  constexpr uint32_t k87 = 0x42AE0000u;  // 87.0f
  constexpr uint32_t k88 = 0x42B00000u;  // 88.0f
  const uint32_t b = bits_of(y);
  const uint32_t a = b & ~kSign;
  const bool neg = (b >> 31) != 0;
  const uint32_t limit = neg ? k87 : k88;
  const float clamped = float_of((a < limit ? a : limit) | (b & kSign));
  // 1 in range; 0 or inf past it; NaN for NaN.
  const uint32_t factor = a <= limit ? kOne : a <= kInf ? (neg ? 0u : kInf) : kNan;
  return exp_core(clamped) * float_of(factor);
}

// 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ... + s^kLast/kLast), by Horner's rule
// in z = s^2 (log_vec and log1p_unit both reduce to it).  The loop has
// constant bounds, so it unrolls into the same straight-line, vectorisable
// code as writing the terms out.
template <int kLast>
inline float two_atanh_series(float s) {
  const float z = s * s;
  float p = 1.0f / kLast;
  for (int d = kLast - 2; d >= 3; d -= 2) {
    p = p * z + 1.0f / static_cast<float>(d);
  }
  const float w = 2.0f * s;
  return w + w * z * p;
}

// log(q) for 0 <= q < 2^127 (0 gives -inf, +inf gives inf, negative or NaN
// gives NaN).
//
// q = m 2^k with m in [sqrt(1/2), sqrt(2)) (q scaled into the normal range
// first),
// log m = 2 atanh(s) with s = (m - 1) / (m + 1), |s| <= 0.172, by its odd
// series up to s^11.
inline float log_vec(float q) {
  using namespace detail;
  constexpr uint32_t kMinNormal = 0x00800000u;
  constexpr uint32_t kSqrt2Mantissa = 0x003504F3u;
  const uint32_t b0 = bits_of(q);
  const bool subnormal = b0 < kMinNormal;
  // Subnormals are scaled by 2^24, the rest by 2 (not 1: GCC would fold a
  // multiplication by 1 and leave the other one in a branch).
  const uint32_t b = bits_of(q * float_of(subnormal ? 0x4B800000u : 0x40000000u));
  const uint32_t mantissa = b & 0x007FFFFFu;
  const bool high = mantissa > kSqrt2Mantissa;
  const float m = float_of(mantissa | (high ? 0x3F000000u : kOne));
  const int32_t k = static_cast<int32_t>((b >> 23) & 0xFFu) - (high ? 126 : 127) -
      (subnormal ? 24 : 1);
  const float kf = static_cast<float>(k);
  const float r = kf * kLn2Hi +
      (two_atanh_series<11>((m - 1.0f) / (m + 1.0f)) + kf * kLn2Lo);
  const uint32_t special = (b0 & ~kSign) == 0 ? (kSign | kInf)  // -inf for +-0
      : b0 < kInf ? 0u                                          // + 0.0
      : b0 == kInf ? kInf : kNan;
  return r + float_of(special);
}

// q^gamma for 0 <= q < 2^127 and gamma != 0, as exp(gamma log q) (0^gamma
// is 0 for gamma > 0 and inf for gamma < 0).  The rounding of gamma log q
// makes the relative error grow with |gamma log q|: within ~20 ulp (1e-6)
// while q^gamma > 1e-5, ~4e-6 near exp's flush to zero.
inline float pow_vec(float q, float gamma) {
  return exp_vec(gamma * log_vec(q));
}

// log1p(e) for e in [0, 1] (NaN gives NaN).
//
// log1p(e) = 2 atanh(s) with s = e / (2 + e) in [0, 1/3]: no cancellation
// for small e, and the odd series 2 (s + s^3/3 + s^5/5 + ...) truncated after
// s^15 is below float rounding for s^2 <= 1/9.
inline float log1p_unit(float e) {
  return two_atanh_series<15>(e / (2.0f + e));
}

}  // namespace torchops::cpu::vec_math
