"""Entries of the fused masked softmaxes: scaled_masked_softmax and
scaled_upper_triang_masked_softmax, and the sample maker their own tests
share (attention_mask)."""

from __future__ import annotations

import torch

from .core import ErrorInput, OpInfo, Sample, ShardingSample, Tol, hyp_size, hyp_tensor, make


def attention_mask(shape, device, density: float = 0.3, seed: int = 0,
                   full_rows: int = 1) -> torch.Tensor:
    """A bool mask of `shape` (B or 1, 1, Sq, Sk), True (masked) for about
    `density` of the keys, with its first `full_rows` query rows masked
    entirely (their softmax is zeros)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < density
    if shape[2] and full_rows:
        m[:, :, :full_rows] = True
    return m.to(device)


def _leaf(t: torch.Tensor, rg: bool) -> torch.Tensor:
    return t.detach().requires_grad_(rg)


# --- scaled_masked_softmax ------------------------------------------------------------


def _masked_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    # Three of one structure (mask batch = input batch >= 2) for compile and export.
    for b, h, sq, sk in [(2, 3, 4, 5), (3, 2, 6, 7), (2, 2, 5, 9)]:
        yield Sample((make((b, h, sq, sk), device, dtype, rg),
                      attention_mask((b, 1, sq, sk), device), 0.5), name=f"{b}x{h}x{sq}x{sk}")
    # One mask for the whole batch; rows of 16-byte packs (the CUDA warp path).
    yield Sample((make((3, 2, 4, 64), device, dtype, rg),
                  attention_mask((1, 1, 4, 64), device, seed=1), 1.25), name="mask_b1")
    yield Sample((make((1, 1, 1, 1), device, dtype, rg),
                  torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device), 1.0), name="ones")
    # Odd and longer rows (the CUDA block path), a negative scale.
    yield Sample((make((1, 2, 3, 37), device, dtype, rg), attention_mask((1, 1, 3, 37), device),
                  -0.7), name="odd")
    yield Sample((make((1, 1, 2, 300), device, dtype, rg),
                  attention_mask((1, 1, 2, 300), device, density=0.9), 0.125), name="long")
    for shape in [(0, 2, 3, 4), (2, 0, 3, 4), (2, 3, 0, 4), (2, 3, 4, 0)]:
        yield Sample((make(shape, device, dtype, rg),
                      torch.zeros(shape[0], 1, *shape[2:], dtype=torch.bool, device=device), 1.0),
                     name=f"empty{shape}")
    # Strided: transposed, sliced and expanded inputs; an expanded mask.
    x = make((2, 3, 6, 4), device, dtype).transpose(-1, -2)
    yield Sample((_leaf(x, rg), attention_mask((2, 1, 4, 6), device), 0.5), name="transposed")
    x = make((2, 6, 4, 11), device, dtype)[:, ::2, :, 1:10]
    yield Sample((_leaf(x, rg), attention_mask((2, 1, 4, 9), device), 0.5), name="sliced")
    x = make((1, 3, 4, 8), device, dtype).expand(2, 3, 4, 8)
    m = attention_mask((1, 1, 4, 8), device).expand(2, 1, 4, 8)
    yield Sample((_leaf(x, rg), m, 0.5), name="expanded")


def _masked_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    b = lambda *s, dev=device: torch.zeros(s, dtype=torch.bool, device=dev)  # noqa: E731
    name = r"torchops\.scaled_masked_softmax"
    yield ErrorInput(Sample((f(2, 3, 4), b(2, 1, 4, 4), 1.0)), rf"{name}.*'input'.*4 dimensions")
    yield ErrorInput(Sample((f(2, 3, 4, 5).long(), b(2, 1, 4, 5), 1.0)),
                     rf"{name}.*'input'.*floating")
    yield ErrorInput(Sample((f(2, 3, 4, 5), b(2, 1, 4, 5).float(), 1.0)), rf"{name}.*'mask'.*bool")
    yield ErrorInput(Sample((f(2, 3, 4, 5), b(1, 4, 5), 1.0)), rf"{name}.*'mask'.*4 dimensions")
    for shape in [(3, 1, 4, 5), (2, 3, 4, 5), (2, 1, 5, 5), (2, 1, 4, 4)]:
        yield ErrorInput(Sample((f(2, 3, 4, 5), b(*shape), 1.0)), rf"{name}.*'mask'.*shape")
    if device != "cpu":
        yield ErrorInput(Sample((f(2, 3, 4, 5), b(2, 1, 4, 5, dev="cpu"), 1.0)),
                         rf"{name}.*'mask'")
    yield from _backward_errors(device, "_scaled_masked_softmax_backward", (2, 3, 4, 5),
                                (2, 3, 4, 5, 1), "4 dimensions")


def _backward_errors(device, op_name, good, bad_rank, rank_msg):
    backward = getattr(torch.ops.torchops, op_name).default
    name = rf"torchops\.{op_name}"
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    y = f(*good)
    yield ErrorInput(Sample((f(*good, dt=torch.float64), y, 1.0)),
                     rf"{name}.*'grad'.*same dtype as 'output'", op=backward)
    yield ErrorInput(Sample((f(*good[:-1], good[-1] + 1), y, 1.0)), rf"{name}.*'grad'.*shape",
                     op=backward)
    yield ErrorInput(Sample((f(*good).long(), y.long(), 1.0)), rf"{name}.*'output'.*floating",
                     op=backward)
    yield ErrorInput(Sample((f(*bad_rank), f(*bad_rank), 1.0)), rf"{name}.*'output'.*{rank_msg}",
                     op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((f(*good, dev="cpu"), y, 1.0)), rf"{name}.*'grad'", op=backward)


def _masked_large(device, dtype, requires_grad=False):
    # Rows in registers up to 2048 keys (CUDA warp path), and past it.
    for sk in (1024, 2048, 3000, 8192):
        yield Sample((make((2, 2, 3, sk), device, dtype, requires_grad),
                      attention_mask((2, 1, 3, sk), device, density=0.5), 0.125),
                     name=f"sk{sk}")


def _masked_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    b, h, sq, sk = (hyp_size(draw, 6) for _ in range(4))
    mb = draw(st.sampled_from([1, b]))
    density = draw(st.sampled_from([0.0, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    mag = draw(st.sampled_from([1.0, 10.0]))
    scale = draw(st.sampled_from([1.0, 0.125, -2.0]))
    x = hyp_tensor(draw, (b, h, sq, sk), device, dtype, -mag, mag)
    m = attention_mask((mb, 1, sq, sk), device, density=density, seed=seed, full_rows=0)
    return Sample((x, m, scale), name=f"hyp{tuple(x.shape)}m{mb}")


def _masked_sharding(device):
    # Batch sharded with a mask per batch entry (sharded too) or one mask
    # (replicated); heads sharded (the mask replicated).
    x = lambda: make((4, 3, 5, 6), device, torch.float32, requires_grad=True)  # noqa: E731
    yield ShardingSample(Sample((x(), attention_mask((4, 1, 5, 6), device), 0.5)),
                         inputs=("S0", "S0", None), outputs=("S0",))
    yield ShardingSample(Sample((x(), attention_mask((1, 1, 5, 6), device), 0.5)),
                         inputs=("S0", "R", None), outputs=("S0",))
    yield ShardingSample(Sample((x(), attention_mask((4, 1, 5, 6), device), 0.5)),
                         inputs=("S1", "R", None), outputs=("S1",))
    yield ShardingSample(Sample((x(), attention_mask((1, 1, 5, 6), device), 0.5)),
                         inputs=("R", "R", None), outputs=("R",))


# Half types: the output is rounded once to the dtype, after float32 math.
_TOLS = {torch.float16: Tol(2e-3, 2e-3)}

SCALED_MASKED_SOFTMAX = OpInfo(
    name="scaled_masked_softmax",
    sample_inputs=_masked_samples,
    error_inputs=_masked_errors,
    internal_ops=("_scaled_masked_softmax_backward",),
    tols=_TOLS,
    sample_inputs_large=_masked_large,
    hypothesis_sample=_masked_hypothesis,
    sharding_samples=_masked_sharding,
)


# --- scaled_upper_triang_masked_softmax -----------------------------------------------


def _causal_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for shape in [(2, 3, 5, 5), (3, 2, 7, 7), (2, 2, 9, 9)]:
        yield Sample((make(shape, device, dtype, rg), 0.5), name=f"{shape}")
    yield Sample((make((3, 6, 6), device, dtype, rg), 1.0), name="3d")
    yield Sample((make((2, 2, 64, 64), device, dtype, rg), 0.125), name="packs")
    yield Sample((make((1, 1, 1, 1), device, dtype, rg), 1.0), name="one")
    yield Sample((make((1, 37, 37), device, dtype, rg), -1.5), name="odd")
    for shape in [(0, 2, 3, 3), (2, 0, 3, 3), (2, 3, 0, 0), (0, 4, 4)]:
        yield Sample((make(shape, device, dtype, rg), 1.0), name=f"empty{shape}")
    x = make((2, 3, 6, 6), device, dtype).transpose(-1, -2)
    yield Sample((_leaf(x, rg), 0.5), name="transposed")
    x = make((2, 6, 5, 11), device, dtype)[:, ::2, :, 1:6]
    yield Sample((_leaf(x, rg), 0.5), name="sliced")
    x = make((1, 3, 8, 8), device, dtype).expand(2, 3, 8, 8)
    yield Sample((_leaf(x, rg), 0.5), name="expanded")


def _causal_errors(device):
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    name = r"torchops\.scaled_upper_triang_masked_softmax"
    yield ErrorInput(Sample((f(4, 4), 1.0)), rf"{name}.*'input'.*3 dimensions")
    yield ErrorInput(Sample((f(1, 2, 3, 4, 4), 1.0)), rf"{name}.*'input'.*3 dimensions")
    yield ErrorInput(Sample((f(2, 4, 5), 1.0)), rf"{name}.*'input'.*square")
    yield ErrorInput(Sample((f(2, 3, 4, 4).long(), 1.0)), rf"{name}.*'input'.*floating")
    yield from _backward_errors(device, "_scaled_upper_triang_masked_softmax_backward",
                                (2, 3, 4, 4), (4, 4), "3 dimensions")


def _causal_large(device, dtype, requires_grad=False):
    # Register rows (up to 2048), aligned rows past them, unaligned rows.
    for s in (1024, 2048, 2056, 4100):
        yield Sample((make((1, 2, s, s) if s <= 2048 else (1, s, s), device, dtype,
                           requires_grad), 0.125), name=f"s{s}")


def _causal_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    pre = draw(st.sampled_from([(), (hyp_size(draw, 4),)]))
    b, s = hyp_size(draw, 5), hyp_size(draw)
    mag = draw(st.sampled_from([1.0, 10.0]))
    scale = draw(st.sampled_from([1.0, 0.125, -2.0]))
    x = hyp_tensor(draw, (b, *pre, s, s), device, dtype, -mag, mag)
    return Sample((x, scale), name=f"hyp{tuple(x.shape)}")


def _causal_sharding(device):
    x4 = lambda: make((4, 3, 6, 6), device, torch.float32, requires_grad=True)  # noqa: E731
    for d in (0, 1):
        yield ShardingSample(Sample((x4(), 0.5)), inputs=(f"S{d}", None), outputs=(f"S{d}",))
    yield ShardingSample(Sample((make((4, 6, 6), device, torch.float32, requires_grad=True), 0.5)),
                         inputs=("S0", None), outputs=("S0",))
    yield ShardingSample(Sample((x4(), 0.5)), inputs=("R", None), outputs=("R",))


SCALED_UPPER_TRIANG_MASKED_SOFTMAX = OpInfo(
    name="scaled_upper_triang_masked_softmax",
    sample_inputs=_causal_samples,
    error_inputs=_causal_errors,
    internal_ops=("_scaled_upper_triang_masked_softmax_backward",),
    tols=_TOLS,
    sample_inputs_large=_causal_large,
    hypothesis_sample=_causal_hypothesis,
    sharding_samples=_causal_sharding,
)


SOFTMAX_OPS: list[OpInfo] = [SCALED_MASKED_SOFTMAX, SCALED_UPPER_TRIANG_MASKED_SOFTMAX]
