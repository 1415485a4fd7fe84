// The argument checks and the geometry of torchops.rotary_embedding, its
// backward and the in-place rotary_embedding_, written once for the CPU and
// CUDA kernels.
//
// Both kernels see q and k as (B, S, H, D) views through strides, whatever
// the caller's layout: (B, H, S, D) when unsqueeze_dim is 1, (B, S, H, D)
// when it is 2, (B, S, H, D) or (1, T, H, D) for the in-place op.  Nothing
// is copied to make them contiguous.  A head's first rotary_dim entries are
// rotated in pairs (a, b):
//
//   out_a = x_a cos_a - x_b sin_a        out_b = x_b cos_b + x_a sin_b
//
// halves (NeoX, Llama): a = j, b = j + rotary_dim / 2; interleaved (GPT-J):
// a = 2 i, b = 2 i + 1.  This is Hugging Face's x cos + rotate_half(x) sin
// entry by entry, with cos and sin read at each entry's own index (their two
// halves need not be equal).  The in-place op reads vLLM's cache row
// [cos | sin] of rotary_dim / 2 entries each, with cos_a = cos_b = cos[i].
// The rest of a head (rotary_dim .. D) passes through.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "common/checks.h"

namespace torchops {

// One of q, k (or their gradients, outputs) as a (B, S, H, D) strided view.
struct RotaryView {
  int64_t sb, ss, sh, sd;
};

// The shape of one call: q and k share B and S; each has its own H and D.
struct RotaryGeometry {
  int64_t B = 0, S = 0;
  int64_t H[2] = {0, 0};
  int64_t D[2] = {0, 0};
  int64_t rd = 0;   // rotary_dim: even, at most D of both
  int64_t Bc = 1;   // cos/sin batch: 1 (shared by every batch) or B
  // q/k dims, in the caller's layout, holding S and H (B is dim 0, D is 3).
  int s_dim = 2, h_dim = 1;
};

// x (4-D, in the caller's layout) as a (B, S, H, D) view.
inline RotaryView rotary_view(const at::Tensor& x, const RotaryGeometry& g) {
  return {x.stride(0), x.stride(g.s_dim), x.stride(g.h_dim), x.stride(3)};
}

inline void check_rotary_qk(const char* op, const at::Tensor& q,
                            const at::Tensor& k, RotaryGeometry& g) {
  check_dim(op, {q, "q"}, 4);
  check_dim(op, {k, "k"}, 4);
  check_floating(op, {q, "q"});
  check_same_dtype(op, {q, "q"}, {k, "k"});
  g.B = q.size(0);
  g.S = q.size(g.s_dim);
  TORCH_CHECK(k.size(0) == g.B && k.size(g.s_dim) == g.S, "torchops.", op,
              ": expected 'k' to have the batch and sequence sizes of 'q' (",
              g.B, ", ", g.S, "), but got shape ", k.sizes());
  g.H[0] = q.size(g.h_dim);
  g.H[1] = k.size(g.h_dim);
  g.D[0] = q.size(3);
  g.D[1] = k.size(3);
}

inline void check_rotary_dim(const char* op, const RotaryGeometry& g,
                             const char* name) {
  TORCH_CHECK(g.rd % 2 == 0, "torchops.", op, ": expected the rotary dim (the "
              "last size of '", name, "') to be even, but got ", g.rd);
  TORCH_CHECK(g.rd <= g.D[0] && g.rd <= g.D[1], "torchops.", op,
              ": expected the rotary dim (the last size of '", name, "', ",
              g.rd, ") to be at most the head size of 'q' (", g.D[0],
              ") and of 'k' (", g.D[1], ")");
}

// The functional op's checks: returns the call's geometry.
inline RotaryGeometry check_rotary_embedding(
    const char* op, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim,
    c10::DeviceType device) {
  check_devices(op, device, {{q, "q"}, {k, "k"}, {cos, "cos"}, {sin, "sin"}});
  TORCH_CHECK(unsqueeze_dim == 1 || unsqueeze_dim == 2, "torchops.", op,
              ": expected 'unsqueeze_dim' to be 1 (q, k of shape (B, H, S, D)) "
              "or 2 (shape (B, S, H, D)), but got ", unsqueeze_dim);
  RotaryGeometry g;
  g.s_dim = unsqueeze_dim == 1 ? 2 : 1;
  g.h_dim = unsqueeze_dim == 1 ? 1 : 2;
  check_rotary_qk(op, q, k, g);
  check_same_dtype(op, {q, "q"}, {cos, "cos"});
  check_same_dtype(op, {q, "q"}, {sin, "sin"});
  TORCH_CHECK(cos.dim() == 2 || cos.dim() == 3, "torchops.", op,
              ": expected 'cos' to have shape (B, S, rotary_dim) or "
              "(S, rotary_dim), but got ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), "torchops.", op,
              ": expected 'sin' to have the shape of 'cos' (", cos.sizes(),
              "), but got ", sin.sizes());
  const int64_t cs = cos.size(-2);
  g.Bc = cos.dim() == 3 ? cos.size(0) : 1;
  TORCH_CHECK(cs == g.S && (g.Bc == 1 || g.Bc == g.B), "torchops.", op,
              ": expected 'cos' to have shape (", g.B, " or 1, ", g.S,
              ", rotary_dim) or (", g.S, ", rotary_dim) to match 'q' "
              "(batch ", g.B, ", sequence ", g.S, "), but got ", cos.sizes());
  g.rd = cos.size(-1);
  check_rotary_dim(op, g, "cos");
  return g;
}

// cos or sin as (Bc, S, rotary_dim) strides (batch stride 0 for a 2-D one).
inline RotaryView rotary_coef_view(const at::Tensor& c) {
  return c.dim() == 3 ? RotaryView{c.stride(0), c.stride(1), 0, c.stride(2)}
                      : RotaryView{0, c.stride(0), 0, c.stride(1)};
}

// The backward's checks beyond the forward's (which it repeats first).
inline void check_rotary_embedding_grads(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q,
    const at::Tensor& k, c10::DeviceType device) {
  const char* op = "_rotary_embedding_backward";
  check_devices(op, device, {{q, "q"}, {grad_q, "grad_q"}, {grad_k, "grad_k"}});
  check_same_dtype(op, {q, "q"}, {grad_q, "grad_q"});
  check_same_dtype(op, {q, "q"}, {grad_k, "grad_k"});
  TORCH_CHECK(grad_q.sizes() == q.sizes(), "torchops.", op,
              ": expected 'grad_q' to have the shape of 'q' (", q.sizes(),
              "), but got ", grad_q.sizes());
  TORCH_CHECK(grad_k.sizes() == k.sizes(), "torchops.", op,
              ": expected 'grad_k' to have the shape of 'k' (", k.sizes(),
              "), but got ", grad_k.sizes());
}

// The in-place op's checks: positions (T) or (B, S) int64; q and k of
// shape (*positions.shape, H, D); cos_sin_cache (max_position, rotary_dim).
// Returns the geometry with a 1-D positions seen as (1, T).
inline RotaryGeometry check_rotary_embedding_inplace(
    const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& cache, c10::DeviceType device) {
  const char* op = "rotary_embedding_";
  check_devices(op, device, {{q, "q"}, {k, "k"}, {positions, "positions"},
                             {cache, "cos_sin_cache"}});
  TORCH_CHECK(positions.scalar_type() == at::kLong, "torchops.", op,
              ": expected 'positions' to be an int64 tensor, but got ",
              positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 || positions.dim() == 2, "torchops.", op,
              ": expected 'positions' to be 1-D (tokens) or 2-D (batch, "
              "sequence), but got shape ", positions.sizes());
  const int64_t pd = positions.dim();
  TORCH_CHECK(q.dim() == pd + 2 && k.dim() == pd + 2 &&
                  q.sizes().slice(0, pd) == positions.sizes() &&
                  k.sizes().slice(0, pd) == positions.sizes(),
              "torchops.", op, ": expected 'q' and 'k' to have shape "
              "(*positions.shape, heads, head_size) with positions of shape ",
              positions.sizes(), ", but got ", q.sizes(), " and ", k.sizes());
  check_floating(op, {q, "q"});
  check_same_dtype(op, {q, "q"}, {k, "k"});
  check_same_dtype(op, {q, "q"}, {cache, "cos_sin_cache"});
  check_dim(op, {cache, "cos_sin_cache"}, 2);
  RotaryGeometry g;
  g.B = pd == 2 ? positions.size(0) : 1;
  g.S = positions.size(pd - 1);
  g.H[0] = q.size(pd);
  g.H[1] = k.size(pd);
  g.D[0] = q.size(pd + 1);
  g.D[1] = k.size(pd + 1);
  g.rd = cache.size(1);
  check_rotary_dim(op, g, "cos_sin_cache");
  return g;
}

// q or k of the in-place op, of shape (*positions.shape, H, D), as a
// (B, S, H, D) view.
inline RotaryView rotary_inplace_view(const at::Tensor& x) {
  return x.dim() == 4
             ? RotaryView{x.stride(0), x.stride(1), x.stride(2), x.stride(3)}
             : RotaryView{0, x.stride(0), x.stride(1), x.stride(2)};
}

}  // namespace torchops
