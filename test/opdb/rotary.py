"""Entries of the rotary-embedding ops: rotary_embedding (Hugging Face's
apply_rotary_pos_emb) and the in-place rotary_embedding_ (vLLM's)."""

from __future__ import annotations

import torch

from .core import ErrorInput, OpInfo, Sample, ShardingSample, Tol, make


# --- rotary_embedding ------------------------------------------------------------------


def rotary_inputs(b, hq, hk, s, d, rd, device, dtype, requires_grad=False, layout="bhsd",
                  cos_batch=None, interleaved=False, q_order="contiguous"):
    """A functional call's args: q (B, Hq, S, D) and k (B, Hk, S, D) in
    ``layout`` "bhsd" (unsqueeze_dim 1) or "bshd" (2); cos, sin (cos_batch,
    S, rd), or (S, rd) when cos_batch is 0 (None: B).  q_order: "contiguous",
    "transposed" (the other layout's memory order, as after a transpose of
    a projection's output) or "sliced" (a head-size slice of a wider
    tensor)."""
    rg = requires_grad

    def qk(h):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        if q_order == "transposed":
            mem = (shape[0], shape[2], shape[1], shape[3])
            return make(mem, device, dtype).transpose(1, 2).detach().requires_grad_(rg)
        if q_order == "sliced":
            wide = make((*shape[:3], d + 3), device, dtype)
            return wide[..., 1:d + 1].detach().requires_grad_(rg)
        return make(shape, device, dtype, rg)
    cb = b if cos_batch is None else cos_batch
    cshape = (s, rd) if cb == 0 else (cb, s, rd)
    cos = make(cshape, device, dtype, rg, low=-1, high=1)
    sin = make(cshape, device, dtype, rg, low=-1, high=1)
    return (qk(hq), qk(hk), cos, sin, 1 if layout == "bhsd" else 2, interleaved)


def _rotary_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    f = lambda *a, **kw: rotary_inputs(*a, device=device, dtype=dtype,  # noqa: E731
                                       requires_grad=rg, **kw)
    # Three of one structure, differing in sizes (compile, export).
    for b, hq, hk, s, d in [(2, 4, 2, 5, 8), (3, 6, 2, 7, 12), (2, 3, 3, 9, 16)]:
        yield Sample(f(b, hq, hk, s, d, d), name=f"bhsd{(b, hq, hk, s, d)}")
    # Each layout once, half of them interleaved (both kernels' paths are the
    # same code for either rotation).
    yield Sample(f(2, 4, 2, 6, 16, 16, layout="bshd"), name="bshd")
    yield Sample(f(2, 4, 2, 6, 16, 16, layout="bshd", interleaved=True), name="bshd_inter")
    yield Sample(f(2, 3, 1, 5, 10, 6), name="partial")
    yield Sample(f(2, 3, 1, 5, 10, 6, interleaved=True), name="partial_inter")
    yield Sample(f(3, 2, 2, 4, 8, 8, cos_batch=0), name="cos2d")
    yield Sample(f(3, 2, 4, 4, 8, 4, cos_batch=1, layout="bshd", interleaved=True),
                 name="cos1_inter")
    yield Sample(f(2, 3, 2, 5, 8, 8, q_order="transposed"), name="transposed")
    yield Sample(f(2, 2, 3, 7, 6, 4, q_order="sliced", layout="bshd", interleaved=True),
                 name="sliced_inter")
    # Vector-width heads (16-byte units on CUDA), with a pass-through tail.
    yield Sample(f(2, 4, 2, 3, 64, 32), name="wide_partial")
    yield Sample(f(1, 2, 1, 4, 32, 32, interleaved=True), name="wide_inter")
    # cos expanded over the batch (stride 0): gradients per batch entry.
    q, k, cos, sin, u, i = f(3, 2, 2, 4, 8, 8, cos_batch=1)
    cos = cos.detach().expand(3, 4, 8).requires_grad_(rg)
    sin = sin.detach().expand(3, 4, 8).requires_grad_(rg)
    yield Sample((q, k, cos, sin, u, i), name="cos_expanded")
    # Edge sizes: one of everything, empty sequence, batch, heads, rotary dim.
    yield Sample(f(1, 1, 1, 1, 2, 2), name="ones")
    yield Sample(f(2, 2, 1, 0, 4, 4), name="empty_seq")
    yield Sample(f(0, 2, 1, 3, 4, 4, cos_batch=0), name="empty_batch_cos2d")
    yield Sample(f(2, 2, 0, 3, 4, 4), name="no_k_heads")
    yield Sample(f(2, 2, 1, 3, 6, 0), name="rotary_dim0")


def _rotary_errors(device):
    op_re = r"torchops\.rotary_embedding"

    def args(**kw):
        return rotary_inputs(2, 4, 2, 5, 8, 8, device, torch.float32, **kw)
    q, k, cos, sin, u, i = args()
    yield ErrorInput(Sample((q, k, cos, sin, 3, False)), rf"{op_re}.*'unsqueeze_dim'")
    yield ErrorInput(Sample((q[0], k, cos, sin, 1, False)), rf"{op_re}.*'q'.*4 dimensions")
    yield ErrorInput(Sample((q, k[0], cos, sin, 1, False)), rf"{op_re}.*'k'.*4 dimensions")
    yield ErrorInput(Sample((q.long(), k.long(), cos.long(), sin.long(), 1, False)),
                     rf"{op_re}.*'q'.*floating")
    yield ErrorInput(Sample((q, k.double(), cos, sin, 1, False)), rf"{op_re}.*'k'.*same dtype")
    yield ErrorInput(Sample((q, k, cos.double(), sin, 1, False)), rf"{op_re}.*'cos'.*same dtype")
    yield ErrorInput(Sample((q, k[:, :, :4], cos, sin, 1, False)),
                     rf"{op_re}.*'k'.*batch and sequence")
    yield ErrorInput(Sample((q, k, cos[0, 0], sin[0, 0], 1, False)), rf"{op_re}.*'cos'.*shape")
    yield ErrorInput(Sample((q, k, cos, sin[:, :, :6], 1, False)), rf"{op_re}.*'sin'.*shape")
    yield ErrorInput(Sample((q, k, cos[:, :4], sin[:, :4], 1, False)), rf"{op_re}.*'cos'.*match")
    yield ErrorInput(Sample((q, q, cos, sin, 2, False)), rf"{op_re}.*'cos'.*match")
    yield ErrorInput(Sample((q, k, cos[..., :5], sin[..., :5], 1, False)),
                     rf"{op_re}.*'cos'.*even")
    big = make((2, 5, 10), device, torch.float32)
    yield ErrorInput(Sample((q, k, big, big, 1, False)), rf"{op_re}.*'cos'.*at most the head")
    if device != "cpu":
        yield ErrorInput(Sample((q, k, cos.cpu(), sin.cpu(), 1, False)), rf"{op_re}.*'cos'")
    # The backward op checks its arguments too (a compiled backward is traced
    # through its fake).
    backward = torch.ops.torchops._rotary_embedding_backward.default
    name = r"torchops\._rotary_embedding_backward"
    gq, gk = torch.ones_like(q), torch.ones_like(k)
    yield ErrorInput(Sample((gq[:, :2], gk, q, k, cos, sin, 1, False, True)),
                     rf"{name}.*'grad_q'.*shape", op=backward)
    yield ErrorInput(Sample((gq, gk.double(), q, k, cos, sin, 1, False, True)),
                     rf"{name}.*'grad_k'.*same dtype", op=backward)
    yield ErrorInput(Sample((gq, gk, q, k, cos[..., :5], sin[..., :5], 1, False, True)),
                     rf"{name}.*'cos'.*even", op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((gq.cpu(), gk, q, k, cos, sin, 1, False, True)),
                         rf"{name}.*'grad_q'", op=backward)


def _rotary_large(device, dtype, requires_grad=False):
    f = lambda *a, **kw: rotary_inputs(*a, device=device, dtype=dtype,  # noqa: E731
                                       requires_grad=requires_grad, **kw)
    yield Sample(f(2, 8, 2, 257, 128, 128), name="large")
    yield Sample(f(2, 8, 2, 129, 128, 64, layout="bshd", interleaved=True), name="large_inter")
    yield Sample(f(1, 4, 4, 300, 96, 96, cos_batch=0, q_order="transposed"), name="large_T")


def _rotary_sharding(device):
    # Batch, sequence or heads shard; cos and sin follow on their dim (or
    # stay replicated: shared by the batch, or any heads sharding), and
    # their gradients are Partial where they sum over a sharded dim.
    # Odd sizes shard unevenly.
    f = lambda *a, **kw: rotary_inputs(*a, device=device, dtype=torch.float32,  # noqa: E731
                                       requires_grad=True, **kw)
    nones = (None, None)
    yield ShardingSample(Sample(f(3, 4, 2, 5, 8, 8)), inputs=("S0", "S0", "S0", "S0", *nones),
                         outputs=("S0", "S0"))
    yield ShardingSample(Sample(f(4, 2, 2, 5, 8, 6, cos_batch=0)),
                         inputs=("S0", "S0", "R", "R", *nones), outputs=("S0", "S0"))
    yield ShardingSample(Sample(f(2, 2, 1, 7, 8, 8)), inputs=("S2", "S2", "S1", "S1", *nones),
                         outputs=("S2", "S2"))
    yield ShardingSample(Sample(f(2, 3, 2, 6, 8, 8, cos_batch=0, layout="bshd",
                                  interleaved=True)),
                         inputs=("S1", "S1", "S0", "S0", *nones), outputs=("S1", "S1"))
    yield ShardingSample(Sample(f(2, 6, 2, 5, 8, 8)), inputs=("S1", "S1", "R", "R", *nones),
                         outputs=("S1", "S1"))
    yield ShardingSample(Sample(f(2, 5, 4, 3, 8, 4, layout="bshd", cos_batch=1)),
                         inputs=("S2", "S2", "R", "R", *nones), outputs=("S2", "S2"))
    # cos and sin frozen (HF's rotary module): the backward skips their sums.
    q, k, cos, sin, u, i = f(2, 4, 2, 5, 8, 8)
    yield ShardingSample(Sample((q, k, cos.detach(), sin.detach(), u, i)),
                         inputs=("S1", "S1", "R", "R", *nones), outputs=("S1", "S1"))


ROTARY_EMBEDDING = OpInfo(
    name="rotary_embedding",
    sample_inputs=_rotary_samples,
    error_inputs=_rotary_errors,
    internal_ops=("_rotary_embedding_backward",),
    # cos's and sin's gradients are sums over heads and batches, rounded
    # once to the half type.
    tols={torch.float16: Tol(2e-3, 2e-3), torch.bfloat16: Tol(2e-2, 1.6e-2)},
    sample_inputs_large=_rotary_large,
    sharding_samples=_rotary_sharding,
)


# --- rotary_embedding_ ------------------------------------------------------------------


def rotary_cache_inputs(pshape, hq, hk, d, rd, max_pos, device, dtype, interleaved=False,
                        qk_order="contiguous"):
    """An in-place call's args: positions of ``pshape`` in [0, max_pos), q, k
    (*pshape, H, D), cos_sin_cache (max_pos, rd).  qk_order "fused": q and k
    are slices of one (*pshape, (hq + hk + hk) * d) projection (vLLM's qkv)."""
    positions = torch.randint(0, max_pos, pshape, device=device)
    if qk_order == "fused":
        qkv = make((*pshape, (hq + 2 * hk) * d), device, dtype)
        q = qkv[..., :hq * d].unflatten(-1, (hq, d))
        k = qkv[..., hq * d:(hq + hk) * d].unflatten(-1, (hk, d))
    elif qk_order == "transposed":
        q = make((*pshape[:-1], hq, pshape[-1], d), device, dtype).transpose(-2, -3)
        k = make((*pshape[:-1], hk, pshape[-1], d), device, dtype).transpose(-2, -3)
    else:
        q = make((*pshape, hq, d), device, dtype)
        k = make((*pshape, hk, d), device, dtype)
    cache = make((max_pos, rd), device, dtype, low=-1, high=1)
    return (positions, q, k, cache, interleaved)


def _rotary_inplace_samples(device, dtype, requires_grad=False):
    f = lambda *a, **kw: rotary_cache_inputs(*a, device=device, dtype=dtype, **kw)  # noqa: E731
    for t, hq, hk, d in [(5, 4, 2, 8), (7, 6, 2, 12), (9, 3, 3, 16)]:
        yield Sample(f((t,), hq, hk, d, d, 20), name=f"tokens{(t, hq, hk, d)}")
    yield Sample(f((2, 5), 4, 2, 8, 8, 16), name="batched")
    yield Sample(f((6,), 3, 1, 10, 6, 12, interleaved=True), name="partial_inter")
    yield Sample(f((7,), 2, 2, 8, 8, 9, qk_order="fused"), name="fused_qkv")
    yield Sample(f((7,), 2, 2, 8, 8, 9, interleaved=True, qk_order="fused"),
                 name="fused_qkv_inter")
    yield Sample(f((2, 4), 3, 2, 8, 4, 10, qk_order="transposed"), name="transposed")
    yield Sample(f((3,), 4, 2, 64, 32, 8), name="wide_partial")
    yield Sample(f((3,), 2, 1, 32, 32, 8, interleaved=True), name="wide_inter")
    yield Sample(f((1,), 1, 1, 2, 2, 1), name="ones")
    yield Sample(f((0,), 2, 1, 4, 4, 3), name="no_tokens")
    yield Sample(f((4,), 2, 0, 4, 4, 3), name="no_k_heads")


def _rotary_inplace_errors(device):
    op_re = r"torchops\.rotary_embedding_"
    pos, q, k, cache, _ = rotary_cache_inputs((5,), 4, 2, 8, 8, 16, device, torch.float32)
    yield ErrorInput(Sample((pos.int(), q, k, cache)), rf"{op_re}.*'positions'.*int64")
    yield ErrorInput(Sample((pos.view(1, 1, 5), q, k, cache)), rf"{op_re}.*'positions'.*1-D")
    yield ErrorInput(Sample((pos, q[:4], k, cache)), rf"{op_re}.*'q' and 'k'.*shape")
    yield ErrorInput(Sample((pos, q, k[None], cache)), rf"{op_re}.*'q' and 'k'.*shape")
    yield ErrorInput(Sample((pos, q.long(), k.long(), cache.long())), rf"{op_re}.*'q'.*floating")
    yield ErrorInput(Sample((pos, q, k.double(), cache)), rf"{op_re}.*'k'.*same dtype")
    yield ErrorInput(Sample((pos, q, k, cache.double())),
                     rf"{op_re}.*'cos_sin_cache'.*same dtype")
    yield ErrorInput(Sample((pos, q, k, cache[0])), rf"{op_re}.*'cos_sin_cache'.*2 dimensions")
    yield ErrorInput(Sample((pos, q, k, cache[:, :5])), rf"{op_re}.*'cos_sin_cache'.*even")
    yield ErrorInput(Sample((pos, q, k, make((16, 10), device, torch.float32))),
                     rf"{op_re}.*'cos_sin_cache'.*at most the head")
    expanded = make((5, 1, 8), device, torch.float32).expand(5, 4, 8)
    yield ErrorInput(Sample((pos, expanded, k, cache)), rf"{op_re}.*'q'.*overlapping",
                     kernel_only="a fake cannot tell whether memory overlaps")
    if device == "cpu":
        # On CUDA a bad position fails a device-side assertion instead.
        bad = pos.clone()
        bad[3] = 16
        yield ErrorInput(Sample((bad, q, k, cache)), rf"{op_re}.*'positions'.*\[0, 16\)",
                         kernel_only="the positions' values")
        yield ErrorInput(Sample((-bad, q, k, cache)), rf"{op_re}.*'positions'",
                         kernel_only="the positions' values")
    else:
        yield ErrorInput(Sample((pos, q, k, cache.cpu())), rf"{op_re}.*'cos_sin_cache'")


def _rotary_inplace_large(device, dtype, requires_grad=False):
    f = lambda *a, **kw: rotary_cache_inputs(*a, device=device, dtype=dtype, **kw)  # noqa: E731
    yield Sample(f((513,), 8, 2, 128, 128, 4096), name="large")
    yield Sample(f((2, 257), 8, 2, 128, 64, 1024, interleaved=True, qk_order="fused"),
                 name="large_fused_inter")


ROTARY_EMBEDDING_ = OpInfo(
    name="rotary_embedding_",
    sample_inputs=_rotary_inplace_samples,
    error_inputs=_rotary_inplace_errors,
    mutated_args=(1, 2),
    # Its outputs are q and k themselves, written in place through their
    # strides (slices of a fused qkv stay slices).
    contiguous_outputs=False,
    sample_inputs_large=_rotary_inplace_large,
)


ROTARY_OPS: list[OpInfo] = [ROTARY_EMBEDDING, ROTARY_EMBEDDING_]
