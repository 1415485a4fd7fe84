// CPU kernels of torchops.scaled_masked_softmax,
// torchops.scaled_upper_triang_masked_softmax and their backward ops.
//
// Rows run in parallel.  A forward row is four passes over a float buffer
// of the row (float64 for float64), which stays in L1/L2 for the lengths
// attention uses: load (scale, mask with -inf), max, exp and sum, store.
// Every pass is a loop that auto-vectorises (vec_math's exp; the max on
// order-preserving integer keys and the sums in kLanes independent
// accumulators, since a floating max or sum would need -ffast-math to
// vectorise).  A causal row touches only its first q + 1 keys and stores
// zeros for the rest.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/masked_softmax_steps.h"
#include "common/register_kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/row_math.h"
#include "cpu/common/vec_math.h"

namespace torchops::cpu {
namespace {

// exp(v - m), and -0.0 for a masked (-inf) v: exp never gives -0.0, so the
// store can tell a masked key (exactly 0 even in a row that a NaN or +inf
// makes NaN) from an underflow.
inline float exp_unmasked(float v, float m) {
  const uint32_t masked = all_if(vm::bits_of(v) == vm::bits_of(kNegInf<float>));
  return vm::float_of((vm::bits_of(vm::exp_vec(v - m)) & ~masked) | (0x80000000u & masked));
}

// v[j] = exp(v[j] - m) in place (0 where masked); returns their sum.
TORCHOPS_CPU_MULTIVERSION float exp_and_sum(float* __restrict__ v, int64_t n, float m) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float e = exp_unmasked(v[j + k], m);
      v[j + k] = e;
      acc[k] += e;
    }
  }
  for (; j < n; ++j) {
    const float e = exp_unmasked(v[j], m);
    v[j] = e;
    acc[0] += e;
  }
  return lanes_total(acc);
}

double exp_and_sum(double* v, int64_t n, double m) {
  double acc[kLanes] = {};
  for (int64_t j = 0; j < n; ++j) {
    v[j] = v[j] == kNegInf<double> ? -0.0 : std::exp(v[j] - m);
    acc[j % kLanes] += v[j];
  }
  return lanes_total(acc);
}

// out[j] = v[j] * mul, and 0 for the masked keys (-0.0 in v).
template <typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION void store_scaled(const acc_t* __restrict__ v, acc_t mul,
                                            T* __restrict__ out, int64_t n) {
  if constexpr (std::is_same_v<acc_t, float>) {
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t keep = ~all_if(vm::bits_of(v[j]) == 0x80000000u);
      out[j] = from_acc<T>(vm::float_of(vm::bits_of(v[j] * mul) & keep));
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      out[j] = from_acc<T>(v[j] == 0 && std::signbit(v[j]) ? acc_t(0) : v[j] * mul);
    }
  }
}

// sum(dy * y) over [0, n).
template <typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION acc_t row_dot(const T* __restrict__ dy, const T* __restrict__ y,
                                        int64_t n) {
  acc_t acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      acc[k] += to_acc<acc_t>(dy[j + k]) * to_acc<acc_t>(y[j + k]);
    }
  }
  for (; j < n; ++j) {
    acc[0] += to_acc<acc_t>(dy[j]) * to_acc<acc_t>(y[j]);
  }
  return lanes_total(acc);
}

template <typename T, typename acc_t>
TORCHOPS_CPU_MULTIVERSION void row_grad(const T* __restrict__ dy, const T* __restrict__ y,
                                        acc_t dot, acc_t scale, T* __restrict__ dx,
                                        int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const acc_t yv = to_acc<acc_t>(y[j]);
    dx[j] = from_acc<T>(scale * yv * (to_acc<acc_t>(dy[j]) - dot));
  }
}

// Rows per task: about kElementwiseGrain elements.
int64_t row_grain(int64_t sk) {
  return std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(sk, 1));
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*t*/) { return {}; }

  template <typename scalar_t>
  static void forward(const SoftmaxForward<scalar_t>& c) {
    using acc_t = at::opmath_type<scalar_t>;
    const SoftmaxRows s = c.shape;
    at::parallel_for(0, s.rows, row_grain(s.sk), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(static_cast<size_t>(s.sk));
      for (int64_t r = begin; r < end; ++r) {
        const int64_t len = softmax_row_length(s, r);
        const scalar_t* x = c.x + r * s.sk;
        scalar_t* y = c.y + r * s.sk;
        const auto* mask = c.mask != nullptr
            ? reinterpret_cast<const uint8_t*>(c.mask + softmax_mask_offset(s, r))
            : nullptr;
        load_scaled(x, mask, c.scale, buf.data(), len);
        const acc_t m = row_max(buf.data(), len);
        if (m == kNegInf<acc_t>) {
          // Every key masked: zeros, not 0 / 0.
          std::fill(y, y + s.sk, static_cast<scalar_t>(0));
          continue;
        }
        const acc_t sum = exp_and_sum(buf.data(), len, m);
        store_scaled(buf.data(), acc_t(1) / sum, y, len);
        std::fill(y + len, y + s.sk, static_cast<scalar_t>(0));
      }
    });
  }

  template <typename scalar_t>
  static void backward(const SoftmaxBackward<scalar_t>& c) {
    using acc_t = at::opmath_type<scalar_t>;
    const SoftmaxRows s = c.shape;
    at::parallel_for(0, s.rows, row_grain(s.sk), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t len = softmax_row_length(s, r);
        const int64_t off = r * s.sk;
        const acc_t dot = row_dot<scalar_t, acc_t>(c.dy + off, c.y + off, len);
        row_grad(c.dy + off, c.y + off, dot, c.scale, c.dx + off, len);
        std::fill(c.dx + off + len, c.dx + off + s.sk, static_cast<scalar_t>(0));
      }
    });
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CPU, scaled_masked_softmax, CpuKernels)
TORCHOPS_REGISTER_STEPS(CPU, scaled_upper_triang_masked_softmax, CpuKernels)

}  // namespace torchops::cpu
