// CPU kernels of torchops.d_sigmoid and its backward.
//
// float, half and bfloat16 are computed in float with vec_math's exp, so the
// loops vectorise (a loop calling std::exp stays scalar, and slower than
// eager PyTorch).  The math uses e = exp(-|z|), which never overflows:
//   s (1 - s)            = e / (1 + e)^2            (even in z)
//   s (1 - s) (1 - 2 s)  = sign(z) e (e - 1) / (1 + e)^3   (odd in z)
// double keeps libm (common/d_sigmoid.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "common/d_sigmoid.h"
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

at::Tensor d_sigmoid(const at::Tensor& z_in) {
  check_d_sigmoid(z_in, c10::DeviceType::CPU);
  const at::Tensor z = z_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(), "torchops.d_sigmoid", [&] {
        const scalar_t* zp = z.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        if constexpr (std::is_same_v<scalar_t, double>) {
          parallel_range(z.numel(), [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              op[i] = d_sigmoid_value(zp[i]);
            }
          });
        } else {
          const scalar_t* const ins[1] = {zp};
          map_in_float(ins, op, z.numel(), [](const float* const* in, float* o, int64_t n) {
            value_loop(in[0], o, n);
          });
        }
      });
  return out;
}

at::Tensor d_sigmoid_backward(const at::Tensor& grad_in, const at::Tensor& z_in) {
  check_d_sigmoid_backward(grad_in, z_in, c10::DeviceType::CPU);
  const at::Tensor z = z_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(),
      "torchops._d_sigmoid_backward", [&] {
        const scalar_t* zp = z.const_data_ptr<scalar_t>();
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        if constexpr (std::is_same_v<scalar_t, double>) {
          parallel_range(z.numel(), [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              op[i] = d_sigmoid_grad(gp[i], zp[i]);
            }
          });
        } else {
          const scalar_t* const ins[2] = {gp, zp};
          map_in_float(ins, op, z.numel(), [](const float* const* in, float* o, int64_t n) {
            grad_loop(in[0], in[1], o, n);
          });
        }
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("d_sigmoid", &d_sigmoid);
  m.impl("_d_sigmoid_backward", &d_sigmoid_backward);
}

}  // namespace torchops::cpu
