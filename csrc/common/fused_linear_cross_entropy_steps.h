// The host steps of torchops.fused_linear_cross_entropy and its internal ops,
// written once for both devices: checks, chunking, the GEMMs and the loss
// from the row statistics are the same; each device supplies its kernels (a
// `Kernels` type with these static members):
//
//   Kernels::device                      c10::DeviceType
//   Kernels::guard(t)                    kept alive for the call (CUDA: the
//                                        device guard)
//   Kernels::check_targets(t, p)         raises for a target outside
//                                        [0, vocab_total) that is not
//                                        p.ignore_index (CUDA: where it may
//                                        sync; the passes make such a row
//                                        NaN, never reading outside it).
//                                        Called after the passes are queued,
//                                        so a sync finds the device busy
//                                        instead of leaving it idle.
//   Kernels::free_bytes(t)               memory the chunk may come from
//   Kernels::stats<scalar_t>(c, stats)   each row's (lse, z_t, sum z) over
//                                        the chunk's columns, into `stats`
//                                        (rows x kLceStats)
//   Kernels::grad<scalar_t>(c, lse, lse_stride, scale)
//                                        overwrites the chunk's logits with
//                                        scale * dloss/dy, in place
//   Kernels::scale(t, s)                 t *= s in place (s a 0-dim tensor
//                                        on the device), nothing when s is 1
//
// The chunk loop.  Rows of input are taken `chunk` at a time (lce_chunk_rows:
// a memory budget over V); per chunk the logits (rows x V, the input's dtype)
// are one GEMM, the stats pass reads them, the grad pass turns them into
// dloss/dlogits, and two more GEMMs give the chunk's rows of grad_input and
// its contribution to grad_weight (added in place; the first chunk writes).
// The logits are never stored beyond one chunk, and the gradients come out
// of the same pass that computes the loss when the forward is asked for them
// (output_mask), which the autograd kernel does for a scalar loss: the
// backward then only scales them.
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <tuple>

#include "common/env.h"
#include "common/fused_linear_cross_entropy.h"
#include "common/library_matmul.h"

namespace torchops {

// One chunk of rows as the kernels see it.
template <typename scalar_t>
struct LceChunk {
  scalar_t* logits;       // rows x cols, rows ld apart (without the bias)
  int64_t rows, cols, ld;
  const int64_t* target;  // rows class indices, of the whole vocabulary
  const scalar_t* bias;   // cols, or nullptr
  LceParams p;
};

// The operands, checked and laid out for the GEMMs.
struct LceOperands {
  at::Tensor x;  // (N, H), contiguous
  at::Tensor w;  // (V, H), contiguous
  at::Tensor t;  // (N), contiguous int64
  at::Tensor b;  // (V), contiguous, or undefined
  LceShape s;
  LceParams p;
  at::ScalarType acc;
};

inline LceOperands lce_operands(const char* op, const at::Tensor& input,
                                const at::Tensor& weight, const at::Tensor& target,
                                const std::optional<at::Tensor>& bias, LceParams p,
                                c10::DeviceType device) {
  LceOperands o;
  o.s = check_lce_operands(op, input, weight, target, bias, device);
  o.p = p;
  if (o.p.vocab_total == 0) {
    o.p.vocab_total = o.s.v;
  }
  check_lce_vocab(op, o.p.vocab_start, o.p.vocab_total, o.s.v);
  o.x = input.reshape({o.s.n, o.s.h}).contiguous();
  o.w = weight.contiguous();
  o.t = target.reshape({o.s.n}).contiguous();
  if (bias.has_value() && bias->defined()) {
    o.b = bias->contiguous();
  }
  o.acc = lce_acc_type(input.scalar_type());
  return o;
}

// The default chunk budget (MiB) and its floor: a chunk stays in cache-sized
// pieces on the CPU; on CUDA it is large enough that the weight-gradient
// GEMM, whose depth is the chunk's row count, stays compute-bound rather
// than bound by reading and writing grad_weight once per chunk.
constexpr int64_t kLceChunkMibCuda = 512;
constexpr int64_t kLceChunkMibCpu = 32;

// Rows per chunk: the budget (TORCHOPS_LCE_CHUNK_MIB, at most a quarter of
// the free memory) over one row of logits, in whole 128-row GEMM tiles when
// there are more than 256, at least one.
inline int64_t lce_chunk_rows(const LceShape& s, int64_t elem, uint64_t free_bytes,
                              bool cuda) {
  const int64_t mib = std::min<int64_t>(
      env::integer("fused_linear_cross_entropy", env::kLceChunkMib)
          .value_or(cuda ? kLceChunkMibCuda : kLceChunkMibCpu),
      int64_t{1} << 30);
  const uint64_t budget = std::min<uint64_t>(static_cast<uint64_t>(mib) << 20, free_bytes / 4);
  int64_t rows = static_cast<int64_t>(budget / static_cast<uint64_t>(s.v * elem));
  if (rows > 256) {
    rows = rows / 128 * 128;
  }
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(s.n, 1));
}

// Per-row scale of the gradient: `g` (0-dim for "mean"/"sum", N values for
// "none"), divided by the tokens counted for "mean", 0 on ignored rows.
inline at::Tensor lce_row_scale(const at::Tensor& g, const at::Tensor& valid,
                                Reduction red, at::ScalarType acc) {
  at::Tensor gs = g.to(acc);
  if (red == Reduction::None) {
    gs = gs.reshape({-1});
  } else if (red == Reduction::Mean) {
    gs = gs / valid.sum().to(acc);
  }
  return at::where(valid, gs, at::zeros({}, gs.options()));
}

// The loss from the row statistics (N x kLceStats): per token, then reduced.
inline at::Tensor lce_loss(const at::Tensor& stats, const at::Tensor& valid,
                           const LceParams& p, c10::IntArrayRef target_shape) {
  const at::Tensor lse = stats.select(1, kLceLse);
  at::Tensor per = lse - stats.select(1, kLceTarget) * (1.0 - p.smoothing);
  // Terms with a zero coefficient are left out, not multiplied by 0: an
  // infinite logit would make them NaN.
  if (p.smoothing != 0.0) {
    per = per - stats.select(1, kLceSum) * (p.smoothing / static_cast<double>(p.vocab_total));
  }
  if (p.z_scale != 0.0) {
    per = per + lse * lse * p.z_scale;
  }
  per = at::where(valid, per, at::zeros({}, per.options()));
  switch (p.red) {
    case Reduction::None:
      return per.reshape(target_shape);
    case Reduction::Sum:
      return per.sum();
    case Reduction::Mean:
    default:
      // No tokens counted: 0 / 0 = nan, as torch's cross_entropy.
      return per.sum() / valid.sum().to(per.scalar_type());
  }
}

// Gradients being accumulated over the chunks.
struct LceGrads {
  std::array<bool, 3> mask{};  // input, weight, bias
  at::Tensor input;            // (N, H)
  at::Tensor weight;           // (V, H), written by the first chunk
  at::Tensor bias;             // (V), in the accumulation type
  bool weight_started = false;
};

// The chunk loop.  `stats` (N x kLceStats): filled when defined.  `scale`
// (N): when defined, the gradients in `g` are computed, with each row's lse
// from `lse` (stride lse_stride) or, when that is undefined, from `stats`.
template <typename Kernels>
void lce_chunks(const LceOperands& o, const at::Tensor& stats, const at::Tensor& lse,
                const at::Tensor& scale, LceGrads& g) {
  const int64_t n = o.s.n;
  if (n == 0) {
    return;
  }
  const at::Tensor wt = o.w.t();
  const int64_t chunk = lce_chunk_rows(o.s, o.x.element_size(), Kernels::free_bytes(o.x),
                                       Kernels::device == c10::DeviceType::CUDA);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    const at::Tensor xc = o.x.narrow(0, r0, rows);
    at::Tensor logits = op_matmul(xc, wt);  // rows x V, contiguous
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, o.x.scalar_type(), "torchops.fused_linear_cross_entropy",
        [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const LceChunk<scalar_t> c{
              logits.mutable_data_ptr<scalar_t>(), rows, o.s.v, o.s.v,
              o.t.const_data_ptr<int64_t>() + r0,
              o.b.defined() ? o.b.const_data_ptr<scalar_t>() : nullptr, o.p};
          if (stats.defined()) {
            Kernels::template stats<scalar_t>(
                c, stats.mutable_data_ptr<acc_t>() + r0 * kLceStats);
          }
          if (scale.defined()) {
            const acc_t* lse_p = lse.defined()
                ? lse.const_data_ptr<acc_t>() + r0
                : stats.const_data_ptr<acc_t>() + r0 * kLceStats + kLceLse;
            Kernels::template grad<scalar_t>(c, lse_p, lse.defined() ? 1 : kLceStats,
                                             scale.const_data_ptr<acc_t>() + r0);
          }
        });
    if (!scale.defined()) {
      continue;
    }
    // `logits` now holds dloss/dlogits of the chunk's rows.
    if (g.mask[0]) {
      at::Tensor gi = g.input.narrow(0, r0, rows);
      op_matmul_out(gi, logits, o.w);
    }
    if (g.mask[1]) {
      // The CPU's op_matmul_out (torchops.matmul, which has no out= form)
      // would make a temporary the size of grad_weight: there the first
      // chunk accumulates into zeros, like the others.
      if (!g.weight_started && Kernels::device == c10::DeviceType::CPU) {
        g.weight.zero_();
        g.weight_started = true;
      }
      if (g.weight_started) {
        op_matmul_accumulate(g.weight, logits.t(), xc);
      } else {
        op_matmul_out(g.weight, logits.t(), xc);
        g.weight_started = true;
      }
    }
    if (g.mask[2]) {
      g.bias.add_(logits.sum(0, /*keepdim=*/false, o.acc));
    }
  }
}

inline LceGrads lce_new_grads(const char* op, const LceOperands& o,
                              std::array<bool, 3> mask) {
  LceGrads g;
  g.mask = mask;
  g.mask[2] = mask[2] && o.b.defined();
  const auto opts = o.x.options();
  g.input = g.mask[0] ? new_output(op, {o.s.n, o.s.h}, opts) : at::empty({0}, opts);
  // Zeros: with no rows there is no chunk to write it.
  g.weight = g.mask[1] ? new_output(op, {o.s.v, o.s.h}, opts, /*zero=*/o.s.n == 0)
                       : at::empty({0}, opts);
  g.bias = g.mask[2] ? at::zeros({o.s.v}, opts.dtype(o.acc)) : at::empty({0}, opts);
  return g;
}

// The gradients as returned: grad_input in input's shape, grad_bias in the
// bias's dtype, (0,)-shaped placeholders where not asked for.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_finish_grads(
    LceGrads& g, const at::Tensor& input) {
  at::Tensor gi = g.mask[0] ? g.input.view(input.sizes()) : g.input;
  at::Tensor gb = g.mask[2] ? g.bias.to(input.scalar_type()) : g.bias;
  return {gi, g.weight, gb};
}

// fused_linear_cross_entropy: the loss alone.
template <typename Kernels>
at::Tensor fused_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    c10::string_view reduction, double lse_square_scale, std::optional<double> softcap);

// _fused_linear_cross_entropy_forward: (loss, lse, grad_input, grad_weight,
// grad_bias), the gradients those of the loss itself (upstream gradient 1),
// for a scalar loss only.
template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_linear_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    c10::string_view reduction, double lse_square_scale, std::optional<double> softcap,
    std::array<bool, 3> output_mask) {
  const char* op = "_fused_linear_cross_entropy_forward";
  const LceParams p = check_lce_options(op, ignore_index, label_smoothing, reduction,
                                        lse_square_scale, softcap);
  const bool grads = output_mask[0] || output_mask[1] || output_mask[2];
  TORCH_CHECK(!grads || p.red != Reduction::None, "torchops.", op,
              ": gradients are computed in the forward only for a scalar loss (reduction "
              "'mean' or 'sum'), but got reduction 'none'");
  [[maybe_unused]] const auto guard = Kernels::guard(input);
  const LceOperands o = lce_operands(op, input, weight, target, bias, p, Kernels::device);
  const at::Tensor stats = at::empty({o.s.n, kLceStats}, o.x.options().dtype(o.acc));
  const at::Tensor valid = o.t.ne(o.p.ignore_index);
  LceGrads g = lce_new_grads(op, o, output_mask);
  at::Tensor scale;
  if (grads) {
    scale = lce_row_scale(at::ones({}, o.x.options().dtype(o.acc)), valid, o.p.red, o.acc);
  }
  lce_chunks<Kernels>(o, stats, at::Tensor(), scale, g);
  at::Tensor loss = lce_loss(stats, valid, o.p, target.sizes());
  at::Tensor lse = stats.select(1, kLceLse).contiguous();
  auto [gi, gw, gb] = lce_finish_grads(g, input);
  Kernels::check_targets(o.t, o.p);
  return {loss, lse, gi, gw, gb};
}

template <typename Kernels>
at::Tensor fused_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    c10::string_view reduction, double lse_square_scale, std::optional<double> softcap) {
  const char* op = "fused_linear_cross_entropy";
  const LceParams p = check_lce_options(op, ignore_index, label_smoothing, reduction,
                                        lse_square_scale, softcap);
  [[maybe_unused]] const auto guard = Kernels::guard(input);
  const LceOperands o = lce_operands(op, input, weight, target, bias, p, Kernels::device);
  const at::Tensor stats = at::empty({o.s.n, kLceStats}, o.x.options().dtype(o.acc));
  LceGrads none;
  lce_chunks<Kernels>(o, stats, at::Tensor(), at::Tensor(), none);
  at::Tensor loss = lce_loss(stats, o.t.ne(o.p.ignore_index), o.p, target.sizes());
  Kernels::check_targets(o.t, o.p);
  return loss;
}

// _fused_linear_cross_entropy_backward: the gradients for an upstream `grad`,
// recomputing each chunk's logits, given each row's lse over the whole
// vocabulary (weight may hold classes [vocab_start, vocab_start + V) of
// vocab_size).
template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_cross_entropy_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& target, const std::optional<at::Tensor>& bias, const at::Tensor& lse,
    int64_t ignore_index, double label_smoothing, c10::string_view reduction,
    double lse_square_scale, std::optional<double> softcap, int64_t vocab_start,
    int64_t vocab_size, std::array<bool, 3> output_mask) {
  const char* op = "_fused_linear_cross_entropy_backward";
  LceParams p = check_lce_options(op, ignore_index, label_smoothing, reduction,
                                  lse_square_scale, softcap);
  p.vocab_start = vocab_start;
  TORCH_CHECK(vocab_size > 0, "torchops.", op, ": expected 'vocab_size' > 0, but got ",
              vocab_size);
  p.vocab_total = vocab_size;
  [[maybe_unused]] const auto guard = Kernels::guard(input);
  const LceOperands o = lce_operands(op, input, weight, target, bias, p, Kernels::device);
  check_devices(op, Kernels::device, {{input, "input"}, {grad, "grad"}, {lse, "lse"}});
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == o.s.n && lse.scalar_type() == o.acc,
              "torchops.", op, ": expected 'lse' of shape (", o.s.n, ") and dtype ", o.acc,
              ", but got shape ", lse.sizes(), " and dtype ", lse.scalar_type());
  TORCH_CHECK(grad.scalar_type() == o.acc, "torchops.", op, ": expected 'grad' of dtype ",
              o.acc, " (the loss's), but got ", grad.scalar_type());
  if (o.p.red == Reduction::None) {
    TORCH_CHECK(grad.numel() == o.s.n, "torchops.", op, ": expected 'grad' to have one "
                "value per token (", o.s.n, ") for reduction 'none', but got shape ",
                grad.sizes());
  } else {
    TORCH_CHECK(grad.dim() == 0, "torchops.", op, ": expected 'grad' to be a 0-dim tensor "
                "for reduction '", std::string(reduction), "', but got shape ", grad.sizes());
  }
  const at::Tensor valid = o.t.ne(o.p.ignore_index);
  LceGrads g = lce_new_grads(op, o, output_mask);
  if (g.mask[0] || g.mask[1] || g.mask[2]) {
    const at::Tensor scale = lce_row_scale(grad, valid, o.p.red, o.acc).contiguous();
    lce_chunks<Kernels>(o, at::Tensor(), lse.contiguous(), scale, g);
  }
  Kernels::check_targets(o.t, o.p);
  return lce_finish_grads(g, input);
}

// _fused_linear_cross_entropy_stats: (N, 3) rows (lse, z_target, sum z) over
// the classes weight holds, [vocab_start, vocab_start + V) of vocab_size;
// z_target is 0 where the target is another slice's (or ignored).
template <typename Kernels>
at::Tensor fused_linear_cross_entropy_stats(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index,
    std::optional<double> softcap, int64_t vocab_start, int64_t vocab_size) {
  const char* op = "_fused_linear_cross_entropy_stats";
  LceParams p = check_lce_options(op, ignore_index, 0.0, "none", 0.0, softcap);
  p.vocab_start = vocab_start;
  TORCH_CHECK(vocab_size > 0, "torchops.", op, ": expected 'vocab_size' > 0, but got ",
              vocab_size);
  p.vocab_total = vocab_size;
  p.want_sum = true;  // this op promises the sum whatever the smoothing
  [[maybe_unused]] const auto guard = Kernels::guard(input);
  const LceOperands o = lce_operands(op, input, weight, target, bias, p, Kernels::device);
  const at::Tensor stats = at::empty({o.s.n, kLceStats}, o.x.options().dtype(o.acc));
  LceGrads none;
  lce_chunks<Kernels>(o, stats, at::Tensor(), at::Tensor(), none);
  Kernels::check_targets(o.t, o.p);
  return stats;
}

// _fused_linear_cross_entropy_scale_: each of `grads` (contiguous, on the
// device) times `scale`, in place.
template <typename Kernels>
void fused_linear_cross_entropy_scale_(at::TensorList grads, const at::Tensor& scale) {
  const char* op = "_fused_linear_cross_entropy_scale_";
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& t = grads[i];
    check_devices(op, Kernels::device, {{t, "grads"}, {scale, "scale"}});
    check_floating(op, {t, "grads"});
    TORCH_CHECK(t.is_contiguous() && scale.dim() == 0 &&
                    scale.scalar_type() == lce_acc_type(t.scalar_type()),
                "torchops.", op, ": expected contiguous grads and a 0-dim scale of their "
                "accumulation type, but grads[", i, "] is ", t.scalar_type(), " of shape ",
                t.sizes(), " and scale ", scale.scalar_type(), " of shape ", scale.sizes());
  }
  for (const at::Tensor& t : grads) {
    if (t.numel() > 0) {
      [[maybe_unused]] const auto guard = Kernels::guard(t);
      Kernels::scale(t, scale);
    }
  }
}

}  // namespace torchops

// Registers the five ops' kernels at `key`, from Kernels.
#define TORCHOPS_REGISTER_LCE(key, Kernels)                                                    \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                                                      \
    m.impl("fused_linear_cross_entropy", &torchops::fused_linear_cross_entropy<Kernels>);    \
    m.impl("_fused_linear_cross_entropy_forward",                                             \
           &torchops::fused_linear_cross_entropy_forward<Kernels>);                          \
    m.impl("_fused_linear_cross_entropy_backward",                                            \
           &torchops::fused_linear_cross_entropy_backward<Kernels>);                         \
    m.impl("_fused_linear_cross_entropy_stats",                                               \
           &torchops::fused_linear_cross_entropy_stats<Kernels>);                            \
    m.impl("_fused_linear_cross_entropy_scale_",                                              \
           &torchops::fused_linear_cross_entropy_scale_<Kernels>);                           \
  }
