// CPU kernels of torchops.sigmoid_focal_loss and its backward.
//
// Work is cut into fixed chunks of kChunk elements, independent of the thread
// count.  A chunk is converted to the compute type (float for float, half
// and bfloat16; double for double), run through a vectorised loop, and either
// stored or summed.  Reductions sum each chunk in double into its own slot
// and add the slots up in chunk order, so "mean" and "sum" are bitwise the
// same for any number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/sigmoid_focal_loss_steps.h"
#include "common/register_kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/vec_math.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kChunk = 1024;
// Chunks per task: each element costs an exp, a log1p and two divisions,
// so tasks can be smaller than kElementwiseGrain elements.
constexpr int64_t kGrainChunks = 8;

// sigmoid_bce (common/sigmoid_focal_loss.h) for float, written so the loops
// below vectorise.
inline SigmoidBce<float> sbce(float x, float t) {
  using namespace vec_math;
  const bool neg = sign_bit(x);
  const float e = exp_vec(float_of(bits_of(x) | 0x80000000u));  // exp(-|x|)
  const float inv = 1.0f / (1.0f + e);
  const float big = inv;
  const float small = e * inv;
  return {select(neg, small, big), select(neg, big, small),
          select(neg, 0.0f, x) - x * t + log1p_unit(e)};
}

inline SigmoidBce<double> sbce(double x, double t) {
  return sigmoid_bce(x, t);
}

// The General gamma's powers: vectorisable for float, libm for double.
struct CpuPow {
  static float pow(float q, float gamma) {
    return vec_math::pow_vec(q, gamma);
  }
  static float dpow(float q, float gamma) {
    return gamma * vec_math::pow_vec(q, gamma - 1.0f);
  }
  static double pow(double q, double gamma) {
    return StdPow::pow(q, gamma);
  }
  static double dpow(double q, double gamma) {
    return StdPow::dpow(q, gamma);
  }
};

template <FocalGamma K, typename T>
TORCHOPS_CPU_MULTIVERSION void loss_loop(
    const T* __restrict__ x, const T* __restrict__ t, T* __restrict__ out,
    int64_t n, FocalParams<T> prm) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = focal_loss_value<K, CpuPow>(sbce(x[i], t[i]), t[i], prm);
  }
}

template <FocalGamma K, typename T>
TORCHOPS_CPU_MULTIVERSION void grad_loop(
    const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ t,
    T* __restrict__ out, int64_t n, FocalParams<T> prm) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = focal_loss_grad<K, CpuPow>(sbce(x[i], t[i]), t[i], g[i], prm);
  }
}

// Eight independent double accumulators (so the loop vectorises), combined
// in a fixed order.
template <typename T>
TORCHOPS_CPU_MULTIVERSION double chunk_sum(const T* __restrict__ v, int64_t n) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += static_cast<double>(v[i + j]);
    }
  }
  for (; i < n; ++i) {
    acc[i % 8] += static_cast<double>(v[i]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// One chunk's view of a tensor in the compute type T: the data itself when
// the dtypes agree, else a converted copy in buf.
template <typename T, typename scalar_t>
const T* load_chunk(const scalar_t* src, T* buf, int64_t n) {
  if constexpr (std::is_same_v<T, scalar_t>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = static_cast<T>(src[i]);
    }
    return buf;
  }
}

// Calls f(chunk_index, begin, length) for every chunk, in parallel.
template <typename F>
void for_each_chunk(int64_t n, const F& f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_range(
      chunks,
      [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t begin = c * kChunk;
          f(c, begin, std::min(kChunk, n - begin));
        }
      },
      kGrainChunks);
}

template <FocalGamma K, typename scalar_t>
void loss_none(const scalar_t* x, const scalar_t* t, scalar_t* out, int64_t n,
               FocalParams<at::opmath_type<scalar_t>> prm) {
  using T = at::opmath_type<scalar_t>;
  for_each_chunk(n, [&](int64_t, int64_t begin, int64_t len) {
    T xb[kChunk], tb[kChunk], ob[kChunk];
    const T* xc = load_chunk(x + begin, xb, len);
    const T* tc = load_chunk(t + begin, tb, len);
    if constexpr (std::is_same_v<T, scalar_t>) {
      loss_loop<K>(xc, tc, out + begin, len, prm);
    } else {
      loss_loop<K>(xc, tc, ob, len, prm);
      for (int64_t i = 0; i < len; ++i) {
        out[begin + i] = static_cast<scalar_t>(ob[i]);
      }
    }
  });
}

template <FocalGamma K, typename scalar_t>
double loss_sum(const scalar_t* x, const scalar_t* t, int64_t n,
                FocalParams<at::opmath_type<scalar_t>> prm) {
  using T = at::opmath_type<scalar_t>;
  std::vector<double> partial((n + kChunk - 1) / kChunk);
  for_each_chunk(n, [&](int64_t c, int64_t begin, int64_t len) {
    T xb[kChunk], tb[kChunk], ob[kChunk];
    loss_loop<K>(load_chunk(x + begin, xb, len), load_chunk(t + begin, tb, len),
                 ob, len, prm);
    partial[c] = chunk_sum(ob, len);
  });
  double sum = 0;
  for (const double s : partial) {
    sum += s;
  }
  return sum;
}

template <FocalGamma K, typename scalar_t>
void loss_grad(const scalar_t* g, at::opmath_type<scalar_t> g_scalar,
               const scalar_t* x, const scalar_t* t, scalar_t* out, int64_t n,
               FocalParams<at::opmath_type<scalar_t>> prm) {
  using T = at::opmath_type<scalar_t>;
  for_each_chunk(n, [&](int64_t, int64_t begin, int64_t len) {
    T gb[kChunk], xb[kChunk], tb[kChunk], ob[kChunk];
    // A scalar upstream gradient is spread over the chunk, so one loop
    // serves both cases.
    const T* gc = gb;
    if (g == nullptr) {
      std::fill(gb, gb + len, g_scalar);
    } else {
      gc = load_chunk(g + begin, gb, len);
    }
    const T* xc = load_chunk(x + begin, xb, len);
    const T* tc = load_chunk(t + begin, tb, len);
    if constexpr (std::is_same_v<T, scalar_t>) {
      grad_loop<K>(gc, xc, tc, out + begin, len, prm);
    } else {
      grad_loop<K>(gc, xc, tc, ob, len, prm);
      for (int64_t i = 0; i < len; ++i) {
        out[begin + i] = static_cast<scalar_t>(ob[i]);
      }
    }
  });
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*inputs*/) { return {}; }

  template <typename scalar_t>
  static void loss(const FocalCall<scalar_t>& c) {
    dispatch_focal_gamma(c.kind, [&](auto kind) {
      constexpr FocalGamma K = decltype(kind)::value;
      if (c.red == Reduction::None) {
        loss_none<K>(c.x, c.t, c.out, c.n, c.prm);
        return;
      }
      const double sum = loss_sum<K>(c.x, c.t, c.n, c.prm);
      *c.out = static_cast<scalar_t>(
          c.red == Reduction::Sum ? sum : sum / static_cast<double>(c.n));
    });
  }

  template <typename scalar_t>
  static void grad(const FocalCall<scalar_t>& c) {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* gp = c.grad;
    T g_scalar = 0;
    if (c.red != Reduction::None) {
      g_scalar = static_cast<T>(*gp);
      if (c.red == Reduction::Mean) {
        g_scalar /= static_cast<T>(c.n);
      }
      gp = nullptr;
    }
    dispatch_focal_gamma(c.kind, [&](auto kind) {
      constexpr FocalGamma K = decltype(kind)::value;
      loss_grad<K>(gp, g_scalar, c.x, c.t, c.out, c.n, c.prm);
    });
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CPU, sigmoid_focal_loss, CpuKernels)

}  // namespace torchops::cpu
