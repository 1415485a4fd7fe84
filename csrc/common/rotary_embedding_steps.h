// The host steps of torchops.rotary_embedding, its backward and the in-place
// rotary_embedding_, written once for both devices: the checks, the
// outputs, the empty cases and the dtype dispatch are the same; each device
// supplies its loops over (b, s) rows (a `Kernels` type):
//
//   Kernels::device                 c10::DeviceType
//   Kernels::guard(q)               kept alive for the call (CUDA: the guard)
//   Kernels::forward<scalar_t>(a)   a.out[t] = rotary(a.x[t]), t = q, k;
//                                   the in-place op passes a.out = a.x and a
//                                   cache (a.pos set)
//   Kernels::backward<scalar_t>(a)  a.out[t] = rotary^T(a.dy[t]), and, when
//                                   a.dcos is set, dcos/dsin summed over
//                                   heads (and batches when cos is shared)
//
// Outputs are new contiguous tensors in q's and k's shapes (and cos's for
// the gradients of cos and sin); the inputs are read through their strides.
// Header-only, like the rest of csrc/common.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "common/rotary_embedding.h"

namespace torchops {

// One call as the kernels see it.  q is tensor 0, k tensor 1; every (B, S,
// H, D) view is in elements.
template <typename scalar_t>
struct RotaryArgs {
  RotaryGeometry g;
  bool interleaved = false;
  const scalar_t* x[2] = {nullptr, nullptr};   // forward inputs (backward:
  RotaryView xv[2] = {};                       // null without dcos)
  scalar_t* out[2] = {nullptr, nullptr};       // outputs, or x in place
  RotaryView ov[2] = {};
  const scalar_t* dy[2] = {nullptr, nullptr};  // backward: output gradients
  RotaryView dyv[2] = {};
  // Functional op: cos and sin as (Bc, S, rotary_dim) views.  In-place op:
  // cos = the cache, cv.ss its row stride, cv.sd its column stride, and sin
  // = cos + rotary_dim / 2 columns.
  const scalar_t* cos = nullptr;
  const scalar_t* sin = nullptr;
  RotaryView cv = {}, sv = {};
  scalar_t* dcos = nullptr;  // backward: contiguous (Bc, S, rotary_dim)
  scalar_t* dsin = nullptr;
  // In-place op: positions as (B, S) strides, and the cache's rows.
  const int64_t* pos = nullptr;
  int64_t pb = 0, ps = 0, max_pos = 0;
};

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> rotary_embedding_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  const char* op = "rotary_embedding";
  const RotaryGeometry g = check_rotary_embedding(op, q, k, cos, sin,
                                                  unsqueeze_dim, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(q);
  at::Tensor q_out = new_output(op, q.sizes(), q.options());
  at::Tensor k_out = new_output(op, k.sizes(), k.options());
  if (q_out.numel() == 0 && k_out.numel() == 0) {
    return {q_out, k_out};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q.scalar_type(), "torchops.rotary_embedding", [&] {
        RotaryArgs<scalar_t> a;
        a.g = g;
        a.interleaved = interleaved;
        const at::Tensor* xs[2] = {&q, &k};
        at::Tensor* outs[2] = {&q_out, &k_out};
        for (int t = 0; t < 2; ++t) {
          a.x[t] = xs[t]->const_data_ptr<scalar_t>();
          a.xv[t] = rotary_view(*xs[t], g);
          a.out[t] = outs[t]->mutable_data_ptr<scalar_t>();
          a.ov[t] = rotary_view(*outs[t], g);
        }
        a.cos = cos.const_data_ptr<scalar_t>();
        a.sin = sin.const_data_ptr<scalar_t>();
        a.cv = rotary_coef_view(cos);
        a.sv = rotary_coef_view(sin);
        Kernels::template forward<scalar_t>(a);
      });
  return {q_out, k_out};
}

// Returns (grad_q, grad_k, grad_cos, grad_sin); without cos_sin_grad the last
// two are empty (0,) tensors and q, k are not read.
template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
rotary_embedding_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                          const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& cos, const at::Tensor& sin,
                          int64_t unsqueeze_dim, bool interleaved,
                          bool cos_sin_grad) {
  const char* op = "_rotary_embedding_backward";
  const RotaryGeometry g = check_rotary_embedding(op, q, k, cos, sin,
                                                  unsqueeze_dim, Kernels::device);
  check_rotary_embedding_grads(grad_q, grad_k, q, k, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(q);
  at::Tensor dq = new_output(op, q.sizes(), q.options());
  at::Tensor dk = new_output(op, k.sizes(), k.options());
  at::Tensor dcos = new_output(op, cos_sin_grad ? cos.sizes() : c10::IntArrayRef{0},
                               cos.options());
  at::Tensor dsin = new_output(op, cos_sin_grad ? sin.sizes() : c10::IntArrayRef{0},
                               sin.options());
  if (g.B * g.S == 0 || g.H[0] + g.H[1] == 0) {
    // No rows or no heads: nothing to rotate, nothing summed into cos's grads.
    dcos.zero_();
    dsin.zero_();
    return {dq, dk, dcos, dsin};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q.scalar_type(),
      "torchops._rotary_embedding_backward", [&] {
        RotaryArgs<scalar_t> a;
        a.g = g;
        a.interleaved = interleaved;
        const at::Tensor* xs[2] = {&q, &k};
        const at::Tensor* dys[2] = {&grad_q, &grad_k};
        at::Tensor* outs[2] = {&dq, &dk};
        for (int t = 0; t < 2; ++t) {
          if (cos_sin_grad) {
            a.x[t] = xs[t]->const_data_ptr<scalar_t>();
            a.xv[t] = rotary_view(*xs[t], g);
          }
          a.dy[t] = dys[t]->const_data_ptr<scalar_t>();
          a.dyv[t] = rotary_view(*dys[t], g);
          a.out[t] = outs[t]->mutable_data_ptr<scalar_t>();
          a.ov[t] = rotary_view(*outs[t], g);
        }
        a.cos = cos.const_data_ptr<scalar_t>();
        a.sin = sin.const_data_ptr<scalar_t>();
        a.cv = rotary_coef_view(cos);
        a.sv = rotary_coef_view(sin);
        if (cos_sin_grad) {
          a.dcos = dcos.mutable_data_ptr<scalar_t>();
          a.dsin = dsin.mutable_data_ptr<scalar_t>();
        }
        Kernels::template backward<scalar_t>(a);
      });
  return {dq, dk, dcos, dsin};
}

template <typename Kernels>
void rotary_embedding_inplace(const at::Tensor& positions, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& cache,
                              bool interleaved) {
  const char* op = "rotary_embedding_";
  const RotaryGeometry g =
      check_rotary_embedding_inplace(positions, q, k, cache, Kernels::device);
  const at::Tensor* xs[2] = {&q, &k};
  const char* names[2] = {"q", "k"};
  for (int t = 0; t < 2; ++t) {
    // Several elements of one memory location would be rotated more than
    // once, by threads racing on it.
    TORCH_CHECK(at::has_internal_overlap(*xs[t]) != at::MemOverlap::Yes,
                "torchops.", op, ": '", names[t], "' is written in place and "
                "must not have overlapping elements (an expanded tensor)");
  }
  [[maybe_unused]] const auto guard = Kernels::guard(q);
  if (g.B * g.S == 0 || g.rd == 0 || g.H[0] + g.H[1] == 0) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q.scalar_type(), "torchops.rotary_embedding_", [&] {
        RotaryArgs<scalar_t> a;
        a.g = g;
        a.interleaved = interleaved;
        for (int t = 0; t < 2; ++t) {
          a.out[t] = xs[t]->mutable_data_ptr<scalar_t>();
          a.x[t] = a.out[t];
          a.xv[t] = rotary_inplace_view(*xs[t]);
          a.ov[t] = a.xv[t];
        }
        a.cos = cache.const_data_ptr<scalar_t>();
        a.sin = a.cos + (g.rd / 2) * cache.stride(1);
        a.cv = RotaryView{0, cache.stride(0), 0, cache.stride(1)};
        a.sv = a.cv;
        a.pos = positions.const_data_ptr<int64_t>();
        a.pb = positions.dim() == 2 ? positions.stride(0) : 0;
        a.ps = positions.stride(positions.dim() - 1);
        a.max_pos = cache.size(0);
        Kernels::template forward<scalar_t>(a);
      });
}

}  // namespace torchops

// Registers the three kernels of one device (CPU or CUDA) from `Kernels`.
#define TORCHOPS_REGISTER_ROTARY(key, Kernels)                               \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                                     \
    m.impl("rotary_embedding", &rotary_embedding_forward<Kernels>);          \
    m.impl("_rotary_embedding_backward", &rotary_embedding_backward<Kernels>); \
    m.impl("rotary_embedding_", &rotary_embedding_inplace<Kernels>);         \
  }
