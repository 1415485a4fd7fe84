// at::vec::Vectorized for the CPU kernels, on AVX2 + FMA where the library is
// built for x86-64 with GCC.
//
// The library is compiled for baseline x86-64 (wheels must run on any
// x86-64), while ATen's vector headers choose their implementation at
// compile time from the CPU_CAPABILITY macros: included plainly there,
// Vectorized<float> is a loop over an array whose exp calls libm once per
// element.  This header includes them the way ATen compiles its own AVX2
// kernels -- CPU_CAPABILITY=AVX2, under `#pragma GCC target("avx2,fma,f16c")`
// -- so their code lands in the namespace at::vec::AVX2, apart from every
// baseline function of the library.  Vectorized's exp, erf and tanh are then
// ATen's AVX2 ones (SLEEF's, which libtorch_cpu exports, and ATen's own).
//
// Use:
//   * include this header before anything else that includes
//     ATen/cpu/vec (a plain include would win, and Vectorized would be the
//     slow one);
//   * define the functions that use Vectorized between TORCHOPS_VEC_BEGIN and
//     TORCHOPS_VEC_END, so they are compiled for the same target (lambdas
//     and templates defined there included);
//   * call them only when vec_available(): on a CPU without AVX2 the
//     baseline code path runs instead.
// Elsewhere (another architecture or compiler), Vectorized is ATen's default
// for the build flags (NEON on AArch64), the markers are empty and
// vec_available() is always true.
#pragma once

// Everything the vector headers include that is not their own: included
// here first, these headers compile for the baseline target.
#include <ATen/NumericUtils.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/intrinsics.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/TypeCast.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>
#include <c10/util/qint32.h>
#include <c10/util/qint8.h>
#include <c10/util/quint8.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(CPU_CAPABILITY)
#define TORCHOPS_VEC_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // their CUDA-style unrolls
// GCC notes the AVX ABI of their vector-returning lambdas when templates
// from outside (always inlined into this code) are instantiated with them.
#pragma GCC diagnostic ignored "-Wpsabi"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
// The pragma does not define the feature macros, and sleef.h declares its
// 256-bit functions only under them.
#ifndef __AVX__
#define TORCHOPS_VEC_UNDEF_AVX
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define TORCHOPS_VEC_UNDEF_AVX2
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define TORCHOPS_VEC_UNDEF_FMA
#define __FMA__ 1
#endif
#ifndef __F16C__
#define TORCHOPS_VEC_UNDEF_F16C
#define __F16C__ 1
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#ifdef TORCHOPS_VEC_UNDEF_AVX
#undef __AVX__
#undef TORCHOPS_VEC_UNDEF_AVX
#endif
#ifdef TORCHOPS_VEC_UNDEF_AVX2
#undef __AVX2__
#undef TORCHOPS_VEC_UNDEF_AVX2
#endif
#ifdef TORCHOPS_VEC_UNDEF_FMA
#undef __FMA__
#undef TORCHOPS_VEC_UNDEF_FMA
#endif
#ifdef TORCHOPS_VEC_UNDEF_F16C
#undef __F16C__
#undef TORCHOPS_VEC_UNDEF_F16C
#endif
// Later ATen headers must not put their code into the AVX2 namespace.
#undef CPU_CAPABILITY
#undef CPU_CAPABILITY_AVX2
#pragma GCC diagnostic pop
#pragma GCC pop_options
#define TORCHOPS_VEC_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define TORCHOPS_VEC_END _Pragma("GCC pop_options")
#else
#define TORCHOPS_VEC_AVX2 0
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#define TORCHOPS_VEC_BEGIN
#define TORCHOPS_VEC_END
#endif

namespace torchops::cpu {

// Whether the code between TORCHOPS_VEC_BEGIN and TORCHOPS_VEC_END may run
// here.  On x86-64 it follows PyTorch's own choice (at::get_cpu_capability:
// AVX2 or AVX-512 found, and not lowered with ATEN_CPU_CAPABILITY=default),
// read once.
inline bool vec_available() {
#if TORCHOPS_VEC_AVX2
  static const bool available = [] {
    const std::string c = at::get_cpu_capability();
    return c == "AVX2" || c == "AVX512";
  }();
  return available;
#else
  return true;
#endif
}

}  // namespace torchops::cpu
