"""Entries of the basic ops: matmul and d_sigmoid."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample, ShardingSample, Tol, hyp_size, hyp_tensor, make, make_transposed


# --- matmul ----------------------------------------------------------------------------


def _matmul_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    shapes = [  # (batch or None, M, K, N)
        (None, 3, 5, 4), (None, 1, 1, 1), (None, 17, 33, 9), (None, 0, 3, 4),
        (None, 3, 0, 4), (None, 65, 70, 66), (2, 5, 3, 4), (3, 1, 7, 1), (0, 2, 3, 4),
        (2, 64, 17, 65),
    ]
    for batch, m, k, n in shapes:
        pre = () if batch is None else (batch,)
        a_shape, b_shape = (*pre, m, k), (*pre, k, n)
        tag = f"{'b' if batch is not None else ''}mm{m}x{k}x{n}"
        yield Sample((make(a_shape, device, dtype, rg), make(b_shape, device, dtype, rg)), name=tag)
        if m and k and n:
            yield Sample((make_transposed(a_shape, device, dtype, rg),
                          make_transposed(b_shape, device, dtype, rg)), name=tag + "_T")
    # Broadcast: one right-hand matrix expanded (stride 0) over the batch.
    w = make((1, 6, 5), device, dtype).expand(4, 6, 5)
    yield Sample((make((4, 3, 6), device, dtype, rg), w.detach().requires_grad_(rg)), name="expanded_b")
    # Non-contiguous by slicing.
    a = make((8, 10), device, dtype)[::2, 1:8]
    yield Sample((a.detach().requires_grad_(rg), make((7, 3), device, dtype, rg)), name="sliced_a")


def _matmul_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3), f(3, 4))), r"torchops\.matmul.*'a'.*2-D")
    yield ErrorInput(Sample((f(2, 3, 4, 5), f(5, 4))), r"torchops\.matmul.*'a'")
    yield ErrorInput(Sample((f(3, 4), f(2, 4, 5))), r"torchops\.matmul.*'b'")
    yield ErrorInput(Sample((f(3, 4), f(5, 6))), r"torchops\.matmul: inner dimensions")
    yield ErrorInput(Sample((f(2, 3, 4), f(3, 4, 5))), r"torchops\.matmul: batch dimensions")
    yield ErrorInput(Sample((f(3, 4), f(4, 5, dt=torch.float64))), r"torchops\.matmul.*'b'.*dtype")
    yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device),
                             torch.ones(4, 5, dtype=torch.int64, device=device))),
                     r"torchops\.matmul.*'a'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((f(3, 4), f(4, 5, dev="cpu"))), r"torchops\.matmul.*'b'")


def _matmul_large(device, dtype, requires_grad=False):
    rg = requires_grad
    for pre, m, k, n in [((), 300, 257, 129), ((4,), 128, 65, 97), ((), 1, 1000, 513)]:
        # b scaled by 1/sqrt(K), as a layer's weights are: the sums stay O(1),
        # where the entry's fixed tolerance means what it says.  Unscaled,
        # K = 1000 makes partial sums of ~100, whose float32 rounding (the
        # kernel's or the summation order's) reached 1.2e-4 beside a result
        # near 0: over the 1e-4 bound on one draw in the GPU suite.
        r = 3.0 / k ** 0.5
        yield Sample((make((*pre, m, k), device, dtype, rg),
                      make((*pre, k, n), device, dtype, rg, low=-r, high=r)),
                     name=f"large{m}x{k}x{n}")
    yield Sample((make_transposed((3, 200, 300), device, dtype, rg),
                  make_transposed((3, 300, 100), device, dtype, rg)), name="large_T")


def _matmul_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    batch = draw(st.one_of(st.none(), st.integers(0, 3)))
    m, k, n = hyp_size(draw), hyp_size(draw), hyp_size(draw)
    pre = () if batch is None else (batch,)
    # Magnitudes stay where float16 cannot overflow (8 * 8 * 40 < 65504).
    mag = draw(st.sampled_from([1e-2, 1.0, 8.0]))
    a = hyp_tensor(draw, (*pre, m, k), device, dtype, -mag, mag)
    b = hyp_tensor(draw, (*pre, k, n), device, dtype, -mag, mag)
    return Sample((a, b), name=f"hyp{tuple(a.shape)}@{tuple(b.shape)}")


MATMUL = OpInfo(
    name="matmul",
    sample_inputs=_matmul_samples,
    error_inputs=_matmul_errors,
    tols={
        torch.float32: Tol(1e-4, 1e-4),
        torch.float16: Tol(1e-2, 2e-3),
        torch.bfloat16: Tol(5e-2, 2e-2),
    },
    supports_gradgrad=True,
    # torch.matmul's autocast policy (inputs cast to the region's dtype);
    # test_matmul.py's test_autocast_* check it beyond the generic test.
    autocast=True,
    sample_inputs_large=_matmul_large,
    hypothesis_sample=_matmul_hypothesis,
)


# --- d_sigmoid -------------------------------------------------------------------------


def _d_sigmoid_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for shape in [(7,), (0,), (1,), (3, 5), (2, 0, 3), (4, 33, 5), (61,), (1000,)]:
        yield Sample((make(shape, device, dtype, rg, low=-8, high=8),), name=f"z{shape}")
    yield Sample((make_transposed((6, 9), device, dtype, rg),), name="transposed")
    z = make((5, 1), device, dtype).expand(5, 7)
    yield Sample((z.detach().requires_grad_(rg),), name="expanded")
    yield Sample((make((0, 4), device, dtype, rg),), name="empty2d")
    # Contiguous but not 16-byte aligned: the kernels' unvectorised path.
    z = make((67,), device, dtype, low=-8, high=8)[3:]
    yield Sample((z.detach().requires_grad_(rg),), name="offset")


def _d_sigmoid_errors(device):
    yield ErrorInput(Sample((torch.arange(5, device=device),)), r"torchops\.d_sigmoid.*'z'.*floating")
    yield ErrorInput(Sample((torch.ones(3, dtype=torch.bool, device=device),)),
                     r"torchops\.d_sigmoid.*'z'")
    # The internal backward op validates its arguments too, and its fake must
    # reject what it rejects (a compiled backward is traced through the fake).
    backward = torch.ops.torchops._d_sigmoid_backward.default
    name = r"torchops\._d_sigmoid_backward"
    z = make((3, 4), device, torch.float32)
    g = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(Sample((g(3, 4, dt=torch.float64), z)), rf"{name}.*'grad'.*same dtype as 'z'",
                     op=backward)
    yield ErrorInput(Sample((g(4, 3), z)), rf"{name}.*'grad'.*shape", op=backward)
    yield ErrorInput(Sample((g(3, 4), z.long())), rf"{name}.*'z'.*floating", op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((g(3, 4, dev="cpu"), z)), rf"{name}.*'grad'", op=backward)


def _d_sigmoid_large(device, dtype, requires_grad=False):
    yield Sample((make((1 << 20,), device, dtype, requires_grad, low=-20, high=20),), name="z1M")
    yield Sample((make_transposed((513, 1025), device, dtype, requires_grad),), name="large_T")


def _d_sigmoid_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    shape = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(2, 9)), max_size=4))
    # Up to 1e3: deep in both tails, where s * (1 - s) underflows.
    mag = draw(st.sampled_from([0.5, 4.0, 30.0, 1e3]))
    return Sample((hyp_tensor(draw, shape, device, dtype, -mag, mag),), name=f"hyp{tuple(shape)}")


def _d_sigmoid_sharding(device):
    # Element-wise: any dim shards, forward and backward.  An odd size
    # shards unevenly (DTensor's padding of the last shard).
    for d in range(3):
        z = make((4, 7, 6), device, torch.float32, requires_grad=True)
        yield ShardingSample(Sample((z,)), inputs=(f"S{d}",), outputs=(f"S{d}",))
    yield ShardingSample(Sample((make((5, 3), device, torch.float32, requires_grad=True),)),
                         inputs=("R",), outputs=("R",))


D_SIGMOID = OpInfo(
    name="d_sigmoid",
    sample_inputs=_d_sigmoid_samples,
    error_inputs=_d_sigmoid_errors,
    internal_ops=("_d_sigmoid_backward",),
    tols={torch.float16: Tol(2e-3, 2e-3)},
    sample_inputs_large=_d_sigmoid_large,
    hypothesis_sample=_d_sigmoid_hypothesis,
    sharding_samples=_d_sigmoid_sharding,
)


BASIC_OPS: list[OpInfo] = [MATMUL, D_SIGMOID]
