// CPU kernels of torchops.d_sigmoid and its backward.
//
// float, half and bfloat16 are computed in float with vec_math's exp, so the
// loops vectorise (a loop calling std::exp stays scalar, and slower than
// eager PyTorch).  The math uses e = exp(-|z|), which never overflows:
//   s (1 - s)            = e / (1 + e)^2            (even in z)
//   s (1 - s) (1 - 2 s)  = sign(z) e (e - 1) / (1 + e)^3   (odd in z)
// double keeps libm (common/d_sigmoid.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "common/d_sigmoid_steps.h"
#include "common/register_kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/vec_math.h"

namespace torchops::cpu {
namespace {

namespace vm = vec_math;

constexpr int64_t kChunk = 1024;

inline float exp_neg_abs(float z) {
  return vm::exp_vec(vm::float_of(vm::bits_of(z) | 0x80000000u));
}

TORCHOPS_CPU_MULTIVERSION void value_loop(const float* __restrict__ z,
                                          float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_neg_abs(z[i]);
    const float d = 1.0f + e;
    out[i] = e / (d * d);
  }
}

TORCHOPS_CPU_MULTIVERSION void grad_loop(const float* __restrict__ g,
                                         const float* __restrict__ z,
                                         float* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_neg_abs(z[i]);
    const float d = 1.0f + e;
    const float sign = vm::select(vm::sign_bit(z[i]), -1.0f, 1.0f);
    out[i] = g[i] * sign * e * (e - 1.0f) / (d * d * d);
  }
}

// Runs `loop` over float views of `ins` (converted chunk by chunk for half
// types), writing `out`, in parallel.
template <typename scalar_t, size_t N, typename Loop>
void map_in_float(const scalar_t* const (&ins)[N], scalar_t* out, int64_t n,
                  Loop loop) {
  parallel_range(n, [&](int64_t begin, int64_t end) {
    float in_buf[N][kChunk];
    float out_buf[kChunk];
    for (int64_t c = begin; c < end; c += kChunk) {
      const int64_t len = std::min(kChunk, end - c);
      const float* in_ptrs[N];
      for (size_t k = 0; k < N; ++k) {
        if constexpr (std::is_same_v<scalar_t, float>) {
          in_ptrs[k] = ins[k] + c;
        } else {
          for (int64_t i = 0; i < len; ++i) {
            in_buf[k][i] = static_cast<float>(ins[k][c + i]);
          }
          in_ptrs[k] = in_buf[k];
        }
      }
      if constexpr (std::is_same_v<scalar_t, float>) {
        loop(in_ptrs, out + c, len);
      } else {
        loop(in_ptrs, out_buf, len);
        for (int64_t i = 0; i < len; ++i) {
          out[c + i] = static_cast<scalar_t>(out_buf[i]);
        }
      }
    }
  });
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*z*/) { return {}; }

  template <typename scalar_t>
  static void value(const scalar_t* z, scalar_t* out, int64_t n) {
    if constexpr (std::is_same_v<scalar_t, double>) {
      parallel_range(n, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] = d_sigmoid_value(z[i]);
        }
      });
    } else {
      const scalar_t* const ins[1] = {z};
      map_in_float(ins, out, n, [](const float* const* in, float* o, int64_t len) {
        value_loop(in[0], o, len);
      });
    }
  }

  template <typename scalar_t>
  static void grad(const scalar_t* g, const scalar_t* z, scalar_t* out, int64_t n) {
    if constexpr (std::is_same_v<scalar_t, double>) {
      parallel_range(n, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] = d_sigmoid_grad(g[i], z[i]);
        }
      });
    } else {
      const scalar_t* const ins[2] = {g, z};
      map_in_float(ins, out, n, [](const float* const* in, float* o, int64_t len) {
        grad_loop(in[0], in[1], o, len);
      });
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CPU, d_sigmoid, CpuKernels)

}  // namespace torchops::cpu
