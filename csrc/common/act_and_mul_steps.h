// The host steps of torchops.silu_and_mul, torchops.gelu_and_mul and their
// backward operators, written once for both devices and both ops: the
// checks, the row views of the operands, the outputs, the empty cases and
// the dtype dispatch.  Each device supplies its loops (a `Kernels` type):
//
//   Kernels::device                     c10::DeviceType
//   Kernels::guard(x)                   kept alive for the call
//                                       (CUDA: the device guard)
//   Kernels::forward<Act, scalar_t>(x, x_stride, out, rows, d)
//       out[r, c] = act(x[r, c]) * x[r, d + c]; out rows contiguous (stride d)
//   Kernels::backward<Act, scalar_t>(g, g_stride, x, x_stride, dx, rows, d)
//       dx[r, c] and dx[r, d + c] (rows of 2d, contiguous): both halves'
//       gradients for the output gradient g, in one pass
// Every row of x (and g) is contiguous along the last dimension, rows
// `*_stride` elements apart (any value, 0 included, when rows <= 1).
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "common/act_and_mul.h"

namespace torchops {

// A tensor read as `rows` rows of `width` elements, each contiguous, `stride`
// elements apart.
struct ActRows {
  at::Tensor t;  // whose data pointer is the first row
  int64_t rows;
  int64_t stride;
};

// t as rows over its last dimension.  A view of t's own memory when the last
// dimension is contiguous and the leading ones collapse into one stride (a
// contiguous tensor, a slice along the last dimension, rows picked with a
// step, an expanded batch); else a contiguous copy (a transposed tensor).
inline ActRows act_rows(const at::Tensor& t) {
  const int64_t width = t.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    rows *= t.size(i);
  }
  if (rows == 0 || width == 0) {
    return {t, 0, width};
  }
  bool collapses = width == 1 || t.stride(-1) == 1;
  int64_t stride = width;
  int64_t outer = -1;  // the stride the next outer dimension needs
  for (int64_t i = t.dim() - 2; collapses && i >= 0; --i) {
    if (t.size(i) == 1) {
      continue;
    }
    if (outer < 0) {
      stride = t.stride(i);
    } else if (t.stride(i) != outer) {
      collapses = false;
    }
    outer = t.stride(i) * t.size(i);
  }
  if (!collapses) {
    return {t.contiguous(), rows, width};
  }
  // One row: the stride is never used; a multiple of the width keeps the
  // CUDA kernels' alignment test simple.
  return {t, rows, rows == 1 ? width : stride};
}

template <typename Kernels>
at::Tensor act_and_mul_forward(const char* op, GatedActivation kind,
                               const at::Tensor& x_in) {
  check_act_and_mul(op, x_in, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(x_in);
  const int64_t d = x_in.size(-1) / 2;
  std::vector<int64_t> sizes(x_in.sizes().begin(), x_in.sizes().end());
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, x_in.options());
  if (out.numel() == 0) {
    return out;
  }
  const ActRows x = act_rows(x_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.t.scalar_type(), "torchops.act_and_mul", [&] {
        with_activation(kind, [&](auto act) {
          Kernels::template forward<decltype(act), scalar_t>(
              x.t.const_data_ptr<scalar_t>(), x.stride,
              out.mutable_data_ptr<scalar_t>(), x.rows, d);
        });
      });
  return out;
}

template <typename Kernels>
at::Tensor act_and_mul_backward(const char* op, GatedActivation kind,
                                const at::Tensor& grad_in,
                                const at::Tensor& x_in) {
  check_act_and_mul_backward(op, grad_in, x_in, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(x_in);
  at::Tensor dx = at::empty(x_in.sizes(), x_in.options());
  if (dx.numel() == 0) {
    return dx;
  }
  const int64_t d = x_in.size(-1) / 2;
  const ActRows x = act_rows(x_in);
  const ActRows g = act_rows(grad_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.t.scalar_type(),
      "torchops._act_and_mul_backward", [&] {
        with_activation(kind, [&](auto act) {
          Kernels::template backward<decltype(act), scalar_t>(
              g.t.const_data_ptr<scalar_t>(), g.stride,
              x.t.const_data_ptr<scalar_t>(), x.stride,
              dx.mutable_data_ptr<scalar_t>(), x.rows, d);
        });
      });
  return dx;
}

// The registered kernels (TORCHOPS_REGISTER_STEPS).

template <typename Kernels>
at::Tensor silu_and_mul_forward(const at::Tensor& x) {
  return act_and_mul_forward<Kernels>("silu_and_mul", GatedActivation::Silu, x);
}

template <typename Kernels>
at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  return act_and_mul_backward<Kernels>("_silu_and_mul_backward",
                                       GatedActivation::Silu, grad, x);
}

template <typename Kernels>
at::Tensor gelu_and_mul_forward(const at::Tensor& x,
                                c10::string_view approximate) {
  const char* op = "gelu_and_mul";
  check_act_and_mul(op, x, Kernels::device);
  return act_and_mul_forward<Kernels>(
      op, parse_gelu_approximate(op, approximate), x);
}

template <typename Kernels>
at::Tensor gelu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x,
                                 c10::string_view approximate) {
  const char* op = "_gelu_and_mul_backward";
  check_act_and_mul_backward(op, grad, x, Kernels::device);
  return act_and_mul_backward<Kernels>(
      op, parse_gelu_approximate(op, approximate), grad, x);
}

}  // namespace torchops
