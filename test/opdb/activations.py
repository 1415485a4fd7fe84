"""Entries of the gated activations: silu_and_mul and gelu_and_mul."""

from __future__ import annotations

import torch

from .core import (ErrorInput, OpInfo, Sample, ShardingSample, Tol, hyp_tensor, make,
                   make_transposed)


def _gated_layouts(device, dtype, rg, extra=()):
    """x in every layout the kernels treat differently, each with `extra`
    (the op's other arguments) appended."""
    def s(x, name):
        return Sample((x.detach().requires_grad_(rg), *extra), name=name)

    # Same layout, three sizes: what the compile and export tests take.
    for shape in [(3, 8), (5, 16), (9, 40)]:
        yield s(make(shape, device, dtype), f"x{shape}")
    # Any leading dims, an empty one, a size-1 one, an empty last one, a
    # 1-D x; d odd (the CUDA kernels' unpacked path) and d of whole 16-byte
    # packs.
    for shape in [(6,), (2,), (0, 8), (4, 0), (1, 10), (2, 3, 10), (2, 0, 4), (5, 34),
                  (7, 64), (3, 1, 2, 130)]:
        yield s(make(shape, device, dtype), f"x{shape}")
    # Transposed: the last dimension is not contiguous (copied first).
    yield s(make_transposed((6, 8), device, dtype), "transposed")
    # Sliced along the last dimension: rows read in place at their stride,
    # the first element mid-pack (CUDA: unpacked path) ...
    yield s(make((5, 20), device, dtype)[:, 2:14], "sliced_offset")
    # ... or on a 16-byte boundary with a stride of whole packs (packed path).
    yield s(make((5, 48), device, dtype)[:, 16:48], "sliced_aligned")
    # Every other row, and leading dims that do not collapse into one stride.
    yield s(make((8, 12), device, dtype)[::2], "rows_step")
    yield s(make((3, 4, 10), device, dtype).transpose(0, 1), "leading_permuted")
    # Expanded rows (stride 0), read in place.
    yield s(make((1, 12), device, dtype).expand(4, 12), "expanded_rows")
    # Large magnitudes: the activations' saturated tails.
    yield s(make((4, 32), device, dtype, low=-30, high=30), "tails")


def _silu_samples(device, dtype, requires_grad=False):
    yield from _gated_layouts(device, dtype, requires_grad)


def _gelu_samples(device, dtype, requires_grad=False):
    yield from _gated_layouts(device, dtype, requires_grad, ("none",))
    # The tanh approximation over the same layouts (but the three sizes of the
    # compile tests, which take the erf ones).
    for i, s in enumerate(_gated_layouts(device, dtype, requires_grad, ("tanh",))):
        if i >= 3:
            yield Sample(s.args, name=s.name + "_tanh")
    x = make((3, 8), device, dtype, requires_grad)
    yield Sample((x,), {"approximate": "tanh"}, name="kwarg_tanh")


def _gated_errors(op_name, extra=(), backward_extra=()):
    def errors(device):
        f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
        op = rf"torchops\.{op_name}"
        yield ErrorInput(Sample((f(3, 5), *extra)), op + r".*last dimension of 'x'.*even")
        yield ErrorInput(Sample((f(7), *extra)), op + r".*last dimension of 'x'.*even")
        yield ErrorInput(Sample((f(), *extra)), op + r".*'x'.*at least 1 dimension")
        yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device), *extra)),
                         op + r".*'x'.*floating")
        # The internal backward op validates its arguments too, and its fake
        # must reject what it rejects (a compiled backward is traced through it).
        backward = getattr(torch.ops.torchops, f"_{op_name}_backward").default
        name = rf"torchops\._{op_name}_backward"
        x = f(3, 8)
        for args, match in [
                ((f(3, 4, dt=torch.float64), x), r"'grad'.*same dtype as 'x'"),
                ((f(3, 8), x), r"'grad'.*output's shape"),
                ((f(4, 3), x), r"'grad'.*output's shape"),
                ((f(3, 4), f(3, 7)), r"last dimension of 'x'.*even"),
                ((f(3, 4), x.long()), r"'x'.*floating")]:
            yield ErrorInput(Sample((*args, *backward_extra)), rf"{name}.*{match}", op=backward)
        if device != "cpu":
            yield ErrorInput(Sample((f(3, 4, dev="cpu"), x, *backward_extra)),
                             rf"{name}.*'grad'", op=backward)
    return errors


def _gelu_errors(device):
    yield from _gated_errors("gelu_and_mul", ("none",), ("tanh",))(device)
    f = lambda *s: make(s, device, torch.float32)  # noqa: E731
    yield ErrorInput(Sample((f(3, 8), "erf")), r"torchops\.gelu_and_mul.*'approximate'")
    yield ErrorInput(Sample((f(3, 4), f(3, 8), "Tanh")),
                     r"torchops\._gelu_and_mul_backward.*'approximate'",
                     op=torch.ops.torchops._gelu_and_mul_backward.default)


def _gated_large(extra=()):
    def large(device, dtype, requires_grad=False):
        rg = requires_grad
        yield Sample((make((4096, 2 * 1024), device, dtype, rg), *extra), name="x4096x2048")
        yield Sample((make((3, 257, 2 * 1001), device, dtype, rg), *extra), name="x3x257x2002")
        x = make((1024, 4096 + 16), device, dtype)[:, 16:]
        yield Sample((x.detach().requires_grad_(rg), *extra), name="sliced_large")
        yield Sample((make_transposed((2000, 514), device, dtype, rg), *extra), name="large_T")
    return large


def _gated_hypothesis(extra=()):
    def sample(draw, device, dtype):
        from hypothesis import strategies as st
        lead = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(2, 9)), max_size=3))
        half = draw(st.one_of(st.sampled_from([0, 1, 8, 16]), st.integers(2, 40)))
        # Up to 30: deep in the tails, where the activations saturate.
        mag = draw(st.sampled_from([0.5, 4.0, 30.0]))
        shape = (*lead, 2 * half)
        return Sample((hyp_tensor(draw, shape, device, dtype, -mag, mag), *extra),
                      name=f"hyp{shape}")
    return sample


def _gated_sharding(extra=()):
    def samples(device):
        # Sharded on every dim but the last (batch, tokens), forward and
        # backward; an odd size shards unevenly.  (The last dim holds both
        # halves: no rule shards it, so DTensor would gather x first.)
        scalars = (None,) * len(extra)
        for d in range(2):
            x = make((4, 7, 12), device, torch.float32, requires_grad=True)
            yield ShardingSample(Sample((x, *extra)), inputs=(f"S{d}", *scalars),
                                 outputs=(f"S{d}",))
        yield ShardingSample(Sample((make((5, 6), device, torch.float32, requires_grad=True),
                                     *extra)), inputs=("R", *scalars), outputs=("R",))
    return samples


# Products of two rounded halves: float16's rounding of values up to ~30.
_GATED_TOLS = {torch.float16: Tol(2e-3, 2e-3)}

SILU_AND_MUL = OpInfo(
    name="silu_and_mul",
    sample_inputs=_silu_samples,
    error_inputs=_gated_errors("silu_and_mul"),
    internal_ops=("_silu_and_mul_backward",),
    tols=_GATED_TOLS,
    sample_inputs_large=_gated_large(),
    hypothesis_sample=_gated_hypothesis(),
    sharding_samples=_gated_sharding(),
)

GELU_AND_MUL = OpInfo(
    name="gelu_and_mul",
    sample_inputs=_gelu_samples,
    error_inputs=_gelu_errors,
    internal_ops=("_gelu_and_mul_backward",),
    tols=_GATED_TOLS,
    sample_inputs_large=_gated_large(("tanh",)),
    hypothesis_sample=_gated_hypothesis(("none",)),
    sharding_samples=_gated_sharding(("tanh",)),
)


ACTIVATION_OPS: list[OpInfo] = [SILU_AND_MUL, GELU_AND_MUL]
