// CPU kernels of torchops.silu_and_mul, torchops.gelu_and_mul and their
// backward operators.
//
// The element math is common/act_and_mul.h's, run on whole vectors: its
// activations take a math policy, and VecMath below gives them Vectorized's
// exp and tanh and an erf on them (common/vectorized.h says how those become
// AVX2 code in a baseline x86-64 build).  Half types load 16 elements, compute them as
// two float vectors and round once.  exp is exp_u20 for float (ATen's
// polynomial, a few ulp from float64 on the gated activations' range; the
// tests hold it to float32 tolerances against a float64 reference) and
// SLEEF's 1-ulp exp for double.
//
// Work is split over (row, block of columns) pairs with at::parallel_for, so
// a few long rows still spread over the threads.  Rows are read in place at
// their stride (common/act_and_mul_steps.h); outputs are contiguous.
#include "cpu/common/vectorized.h"  // first: before any other vector include

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/act_and_mul_steps.h"
#include "common/register_kernels.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Columns per work item: a multiple of every vector width, long enough to
// amortise the item's setup, short enough that one long row splits.
constexpr int64_t kBlockColumns = 4096;

// f(row, c0, c1) over every row and block of columns [c0, c1) of d columns.
template <typename F>
void parallel_blocks(int64_t rows, int64_t d, const F& f) {
  const int64_t blocks = (d + kBlockColumns - 1) / kBlockColumns;
  const int64_t width = std::min(d, kBlockColumns);
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / (4 * width));
  parallel_range(rows * blocks, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / blocks;
      const int64_t c0 = (i - r * blocks) * kBlockColumns;
      f(r, c0, std::min(d, c0 + kBlockColumns));
    }
  }, grain);
}

TORCHOPS_VEC_BEGIN

using at::vec::Vectorized;

// The math policy of common/act_and_mul.h on vectors.  For float, erf is
// Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, the formula of ATen's own
// AVX2 erf) on exp_u20, sharing its exp(-z^2) with the gaussian that GELU's
// slope needs: one exp per element forward and backward.
struct VecMath {
  template <typename V>
  static V exp(const V& x) {
    if constexpr (std::is_same_v<V, Vectorized<float>>) {
      return x.exp_u20();
    } else {
      return x.exp();
    }
  }

  template <typename V>
  static void erf_and_gaussian(const V& z, V& e, V& g) {
    if constexpr (std::is_same_v<V, Vectorized<float>>) {
      const V a = z.abs();
      const V t = V(1.0f) / at::vec::fmadd(V(0.3275911f), a, V(1.0f));
      V r = at::vec::fmadd(V(1.061405429f), t, V(-1.453152027f));
      r = at::vec::fmadd(r, t, V(1.421413741f));
      r = at::vec::fmadd(r, t, V(-0.284496736f));
      r = at::vec::fmadd(r, t, V(0.254829592f));
      g = (V(0.0f) - a * a).exp_u20();
      // erf(|z|) = 1 - r t exp(-z^2), then z's sign.
      const V erf_abs = V(1.0f) - r * t * g;
      e = V::blendv(erf_abs, V(0.0f) - erf_abs, z < V(0.0f));
    } else {
      e = z.erf();
      g = (V(0) - z * z).exp();
    }
  }

  template <typename V>
  static V erf(const V& z) {
    V e, g;
    erf_and_gaussian(z, e, g);
    return e;
  }

  template <typename V>
  static V tanh(const V& x) { return x.tanh(); }
};

// Loads and stores of scalar_t as vectors of its op math type: one vector
// per step for float and double, two float vectors for the half types.
template <typename scalar_t>
struct VecIO {
  static constexpr bool kReduced = at::vec::is_reduced_floating_point_v<scalar_t>;
  using Raw = Vectorized<scalar_t>;
  using Vec = Vectorized<at::opmath_type<scalar_t>>;
  static constexpr int kParts = kReduced ? 2 : 1;
  static constexpr int64_t kStep = Raw::size();

  struct Lanes {
    Vec v[kParts];
  };

  // n <= kStep elements; the lanes past n are zeros.  Always inlined: an
  // out-of-line copy returns its vectors through memory and clears the
  // upper halves (vzeroupper) on every call, which costs the half types
  // more than their arithmetic.
  C10_ALWAYS_INLINE static Lanes load(const scalar_t* p, int64_t n) {
    const Raw raw = n == kStep ? Raw::loadu(p) : Raw::loadu(p, n);
    if constexpr (kReduced) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(raw);
      return {{lo, hi}};
    } else {
      return {{raw}};
    }
  }

  C10_ALWAYS_INLINE static void store(scalar_t* p, const Lanes& l, int64_t n) {
    Raw raw;
    if constexpr (kReduced) {
      raw = at::vec::convert_from_float<scalar_t>(l.v[0], l.v[1]);
    } else {
      raw = l.v[0];
    }
    if (n == kStep) {
      raw.store(p);
    } else {
      raw.store(p, n);
    }
  }
};

template <typename Act, typename scalar_t>
void forward_columns_vec(const scalar_t* x, scalar_t* out, int64_t d, int64_t c0,
                         int64_t c1) {
  using IO = VecIO<scalar_t>;
  for (int64_t c = c0; c < c1; c += IO::kStep) {
    const int64_t n = std::min(IO::kStep, c1 - c);
    const auto a = IO::load(x + c, n);
    const auto b = IO::load(x + d + c, n);
    typename IO::Lanes o;
    for (int k = 0; k < IO::kParts; ++k) {
      o.v[k] = act_and_mul_value<Act, VecMath>(a.v[k], b.v[k]);
    }
    IO::store(out + c, o, n);
  }
}

template <typename Act, typename scalar_t>
void backward_columns_vec(const scalar_t* g, const scalar_t* x, scalar_t* dx,
                          int64_t d, int64_t c0, int64_t c1) {
  using IO = VecIO<scalar_t>;
  for (int64_t c = c0; c < c1; c += IO::kStep) {
    const int64_t n = std::min(IO::kStep, c1 - c);
    const auto gv = IO::load(g + c, n);
    const auto a = IO::load(x + c, n);
    const auto b = IO::load(x + d + c, n);
    typename IO::Lanes da, db;
    for (int k = 0; k < IO::kParts; ++k) {
      act_and_mul_grad<Act, VecMath>(gv.v[k], a.v[k], b.v[k], da.v[k], db.v[k]);
    }
    IO::store(dx + c, da, n);
    IO::store(dx + d + c, db, n);
  }
}

TORCHOPS_VEC_END

// The same loops one element at a time, for CPUs without the vector code.
template <typename Act, typename scalar_t>
void forward_columns_scalar(const scalar_t* x, scalar_t* out, int64_t d,
                            int64_t c0, int64_t c1) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t c = c0; c < c1; ++c) {
    out[c] = static_cast<scalar_t>(act_and_mul_value<Act, ScalarMath>(
        static_cast<opmath_t>(x[c]), static_cast<opmath_t>(x[d + c])));
  }
}

template <typename Act, typename scalar_t>
void backward_columns_scalar(const scalar_t* g, const scalar_t* x, scalar_t* dx,
                             int64_t d, int64_t c0, int64_t c1) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t c = c0; c < c1; ++c) {
    opmath_t da, db;
    act_and_mul_grad<Act, ScalarMath>(
        static_cast<opmath_t>(g[c]), static_cast<opmath_t>(x[c]),
        static_cast<opmath_t>(x[d + c]), da, db);
    dx[c] = static_cast<scalar_t>(da);
    dx[d + c] = static_cast<scalar_t>(db);
  }
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*x*/) { return {}; }

  template <typename Act, typename scalar_t>
  static void forward(const scalar_t* x, int64_t x_stride, scalar_t* out,
                      int64_t rows, int64_t d) {
    const auto columns = vec_available() ? &forward_columns_vec<Act, scalar_t>
                                         : &forward_columns_scalar<Act, scalar_t>;
    parallel_blocks(rows, d, [&](int64_t r, int64_t c0, int64_t c1) {
      columns(x + r * x_stride, out + r * d, d, c0, c1);
    });
  }

  template <typename Act, typename scalar_t>
  static void backward(const scalar_t* g, int64_t g_stride, const scalar_t* x,
                       int64_t x_stride, scalar_t* dx, int64_t rows, int64_t d) {
    const auto columns = vec_available() ? &backward_columns_vec<Act, scalar_t>
                                         : &backward_columns_scalar<Act, scalar_t>;
    parallel_blocks(rows, d, [&](int64_t r, int64_t c0, int64_t c1) {
      columns(g + r * g_stride, x + r * x_stride, dx + r * 2 * d, d, c0, c1);
    });
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CPU, silu_and_mul, CpuKernels)
TORCHOPS_REGISTER_STEPS(CPU, gelu_and_mul, CpuKernels)

}  // namespace torchops::cpu
