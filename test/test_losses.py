"""Op-specific tests of the losses (torchops.sigmoid_focal_loss): what the
generic opdb tests do not cover -- errors of the wrapper, empty reductions,
determinism, the non-differentiable targets, numerics at the edges, autocast,
and (on a GPU) equality with torchvision."""

from __future__ import annotations

import math

import pytest
import torch

import torchops
from torchops.references import sigmoid_focal_loss as focal_ref

OP = torch.ops.torchops.sigmoid_focal_loss.default
BACKWARD = torch.ops.torchops._sigmoid_focal_loss_backward.default
REDUCTIONS = ("none", "mean", "sum")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# (alpha, gamma): torchvision's defaults, no weighting with a fractional
# gamma (EfficientDet uses 1.5), plain weighted BCE.
PARAMS = ((0.25, 2.0), (-1.0, 1.5), (0.25, 0.0), (0.5, 1.0))


def _data(shape, device="cpu", dtype=torch.float32, hard=True, seed=0, scale=4.0):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)  # torch 2.11's randint wants a tuple
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale
    if hard:
        t = torch.randint(0, 2, shape, generator=g).double()
    else:
        t = torch.rand(shape, generator=g, dtype=torch.float64)
    return x.to(device, dtype), t.to(device, dtype)


def _value_and_grad(fn, x, t, *args, upstream=None):
    x = x.detach().requires_grad_()
    out = fn(x, t, *args)
    g = torch.ones_like(out) if upstream is None else upstream.to(out.dtype)
    (grad,) = torch.autograd.grad(out, x, g)
    return out.detach(), grad


# --- errors --------------------------------------------------------------------------


def test_unknown_reduction_raises():
    x, t = _data((3, 4))
    with pytest.raises(RuntimeError, match=r"torchops\.sigmoid_focal_loss: .*'reduction'.*'avg'"):
        OP(x, t, 0.25, 2.0, "avg")
    # The wrapper mirrors torchvision, which raises ValueError.
    with pytest.raises(ValueError, match=r"torchops\.sigmoid_focal_loss: .*'reduction'"):
        torchops.sigmoid_focal_loss(x, t, reduction="avg")
    with pytest.raises(RuntimeError, match=r"torchops\._sigmoid_focal_loss_backward: .*'reduction'"):
        BACKWARD(torch.ones(3, 4), x, t, 0.25, 2.0, "Mean")


def test_backward_grad_shape_checked():
    x, t = _data((3, 4))
    with pytest.raises(RuntimeError, match=r"_sigmoid_focal_loss_backward: .*'grad'.*0-dim"):
        BACKWARD(torch.ones(3, 4), x, t, 0.25, 2.0, "mean")
    with pytest.raises(RuntimeError, match=r"_sigmoid_focal_loss_backward: .*'grad'.*shape"):
        BACKWARD(torch.ones(()), x, t, 0.25, 2.0, "none")
    with pytest.raises(RuntimeError, match=r"_sigmoid_focal_loss_backward: .*'grad'.*dtype"):
        BACKWARD(torch.ones((), dtype=torch.float64), x, t, 0.25, 2.0, "sum")


def test_wrapper_defaults_are_torchvisions():
    x, t = _data((5, 7))
    torch.testing.assert_close(torchops.sigmoid_focal_loss(x, t), OP(x, t, 0.25, 2.0, "none"),
                               atol=0, rtol=0)
    torch.testing.assert_close(OP(x, t), OP(x, t, 0.25, 2.0, "none"), atol=0, rtol=0)


# --- semantics -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (0, 80), (2, 0, 3)])
def test_empty_inputs(shape):
    x, t = _data(shape)
    x.requires_grad_()
    none = OP(x, t, 0.25, 2.0, "none")
    assert none.shape == shape
    total = OP(x, t, 0.25, 2.0, "sum")
    assert total.shape == () and total.item() == 0.0
    # As torchvision: loss.mean() of nothing is nan.
    mean = OP(x, t, 0.25, 2.0, "mean")
    assert mean.shape == () and math.isnan(mean.item())
    assert math.isnan(focal_ref(x.detach().double(), t.double(), reduction="mean").item())
    for out in (none.sum(), total, mean):
        (grad,) = torch.autograd.grad(out, x)
        assert grad.shape == shape


def test_targets_are_not_differentiable():
    x, t = _data((6, 5), hard=False)
    x.requires_grad_()
    t.requires_grad_()
    loss = OP(x, t, 0.25, 2.0, "mean")
    with pytest.raises(RuntimeError, match=r"torchops\.sigmoid_focal_loss: .*'targets'"):
        loss.backward()
    # Asking only for the logits' gradient works.
    loss = OP(x, t, 0.25, 2.0, "mean")
    (got,) = torch.autograd.grad(loss, x)
    (want,) = torch.autograd.grad(OP(x, t.detach(), 0.25, 2.0, "mean"), x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_gamma_zero_is_weighted_bce():
    x, t = _data((40, 9), dtype=torch.float64, hard=False)
    alpha = 0.3
    weight = alpha * t + (1 - alpha) * (1 - t)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(x, t, reduction="none")
    loss, grad = _value_and_grad(OP, x, t, alpha, 0.0, "sum")
    torch.testing.assert_close(loss, (weight * bce).sum())
    torch.testing.assert_close(grad, weight * (torch.sigmoid(x) - t))


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0, 1.5, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saturated_logits_are_finite(gamma, dtype):
    # Confident right answers: 1 - p_t underflows to 0.  For gamma == 0 the
    # factor is 0^0 = 1, for gamma >= 1 the derivative of q^gamma is finite.
    mag = torch.tensor([20.0, 40.0, 90.0, 200.0, 1e4], dtype=torch.float64)
    x = torch.cat([mag, -mag, mag, -mag])
    t = torch.cat([torch.ones(5), torch.zeros(5), torch.zeros(5), torch.ones(5)]).double()
    loss, grad = _value_and_grad(OP, x.to(dtype), t.to(dtype), 0.25, gamma, "none",
                                 upstream=torch.ones(20))
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    ref_loss, ref_grad = _value_and_grad(focal_ref, x, t, 0.25, gamma, "none",
                                         upstream=torch.ones(20, dtype=torch.float64))
    # Right answers: loss and gradient ~0; wrong ones: loss ~ 0.75 |x|, grad +-0.75.
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-5)


def test_nan_logits_propagate():
    x = torch.tensor([float("nan"), 1.0, float("nan")])
    t = torch.tensor([1.0, 0.0, 0.0])
    for gamma in (0.0, 2.0, 1.5):
        loss, grad = _value_and_grad(OP, x, t, 0.25, gamma, "none", upstream=torch.ones(3))
        assert loss.isnan().tolist() == [True, False, True]
        assert grad.isnan().tolist() == [True, False, True]


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0, 1.5, 2.5])
@pytest.mark.parametrize("target", [0.0, 1.0, 0.3])
def test_float32_accuracy_on_a_dense_grid(gamma, target):
    """The CPU float path uses its own vectorised exp/log1p/pow: check it to a
    few ulp against float64 on logits across the whole useful range (the
    float64 formula here uses log1p and sigmoid(-x), so it is accurate where
    torchvision's cancels)."""
    xf = torch.linspace(-85, 85, 200_001).float()
    x = xf.double()
    t = torch.full_like(x, target)
    ce = x.clamp_min(0) - x * t + torch.log1p(torch.exp(-x.abs()))
    q = torch.sigmoid(x) * (1 - t) + torch.sigmoid(-x) * t
    want = 0.25 * t + 0.75 * (1 - t)
    want = want * ce * q ** gamma
    got = OP(xf, t.float(), 0.25, gamma, "none").double()
    big = want.abs() > 1e-30
    rel = ((got - want).abs() / want.abs())[big]
    assert rel.max().item() < 5e-6
    assert (got[~big].abs() < 1e-29).all()


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cpu_reduction_independent_of_thread_count(dtype, reduction):
    x, t = _data((300_001,), dtype=dtype, hard=False)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_value_and_grad(OP, x, t, 0.25, 2.0, reduction))
    finally:
        torch.set_num_threads(threads)
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert torch.equal(grad, results[0][1])


# --- autocast ---------------------------------------------------------------------------


def test_autocast_cpu():
    x, t = _data((33, 7), dtype=torch.bfloat16, hard=False)
    want = OP(x.float(), t.float(), 0.25, 2.0, "mean").to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = OP(x, t, 0.25, 2.0, "mean")
        # Mixed dtypes are fine under autocast: both go to float32.
        mixed = OP(x, t.float(), 0.25, 2.0, "none")
        full = OP(x.float(), t.float(), 0.25, 2.0, "sum")
    assert got.dtype == torch.bfloat16 and mixed.dtype == torch.bfloat16
    assert full.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    xg = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = OP(xg, t, 0.25, 2.0, "sum")
    loss.backward()
    assert xg.grad.dtype == torch.bfloat16


# --- CUDA -------------------------------------------------------------------------------

CUDA_TOLS = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=1e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_matches_torchvision(dtype, reduction):
    tv = pytest.importorskip("torchvision")
    shapes = [(8192, 80), (37, 3), (1,), (5, 6, 7)]
    if dtype in (torch.float16, torch.bfloat16) and reduction == "sum":
        shapes = shapes[1:]  # a half-precision sum of 655k losses overflows
    for shape in shapes:
        for alpha, gamma in PARAMS:
            x, t = _data(shape, "cuda", dtype, hard=shape != (5, 6, 7))
            upstream = torch.randn(shape if reduction == "none" else (), device="cuda",
                                   dtype=torch.float64)
            loss, grad = _value_and_grad(OP, x, t, alpha, gamma, reduction, upstream=upstream)
            assert loss.dtype == dtype and grad.dtype == dtype
            # torchvision in float64 on the same (rounded) values.
            ref_loss, ref_grad = _value_and_grad(
                tv.ops.sigmoid_focal_loss, x.double(), t.double(), alpha, gamma, reduction,
                upstream=upstream)
            tol = CUDA_TOLS[dtype]
            msg = lambda m: f"{shape} alpha={alpha} gamma={gamma}: {m}"  # noqa: E731
            torch.testing.assert_close(loss.double(), ref_loss, **tol, msg=msg)
            scale = max(1.0, ref_grad.abs().max().item())
            torch.testing.assert_close(grad.double(), ref_grad, atol=tol["atol"] * scale,
                                       rtol=tol["rtol"], msg=msg)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cuda_reduction_deterministic(reduction):
    # Many blocks, an odd tail, and a storage offset that turns the
    # vectorised loads off.
    x, t = _data((8192 * 80 + 13,), "cuda", torch.float32, hard=False)
    for xs, ts in [(x, t), (x[1:], t[1:])]:
        first = _value_and_grad(OP, xs, ts, 0.25, 2.0, reduction)
        for _ in range(3):
            again = _value_and_grad(OP, xs, ts, 0.25, 2.0, reduction)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        ref = focal_ref(xs.double(), ts.double(), 0.25, 2.0, reduction)
        torch.testing.assert_close(first[0].double(), ref, atol=0, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_large_sum_accuracy():
    # More elements than the reduction grid has threads: every thread sums
    # many, then blocks, then the partials.
    x, t = _data((1 << 24) + 5, "cuda", torch.float32, hard=True)
    for reduction in ("mean", "sum"):
        got = OP(x, t, 0.25, 2.0, reduction)
        ref = focal_ref(x.double(), t.double(), 0.25, 2.0, reduction)
        torch.testing.assert_close(got.double(), ref, atol=0, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d)[6:])
def test_cuda_matches_cpu(dtype):
    for shape, offset in [((1000, 81), 0), ((4099,), 1), ((3, 5), 0)]:
        x, t = _data((offset + math.prod(shape),), dtype=dtype, hard=False)
        x, t = x[offset:].view(shape), t[offset:].view(shape)
        for alpha, gamma in PARAMS:
            for reduction in REDUCTIONS:
                cpu = _value_and_grad(OP, x, t, alpha, gamma, reduction)
                gpu = _value_and_grad(OP, x.cuda(), t.cuda(), alpha, gamma, reduction)
                tol = CUDA_TOLS[dtype]
                for c, g in zip(cpu, gpu):
                    torch.testing.assert_close(g.cpu().double(), c.double(), **tol)


@pytest.mark.cuda
def test_cuda_noncontiguous_and_empty():
    x, t = _data((80, 300), "cuda", torch.float32, hard=True)
    xt, tt = x.t(), t.t()
    for reduction in REDUCTIONS:
        got = _value_and_grad(OP, xt, tt, 0.25, 2.0, reduction)
        want = _value_and_grad(OP, xt.contiguous(), tt.contiguous(), 0.25, 2.0, reduction)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
        if reduction == "none":
            assert got[0].is_contiguous()
    e, et = _data((0, 80), "cuda")
    assert OP(e, et, 0.25, 2.0, "none").shape == (0, 80)
    assert OP(e, et, 0.25, 2.0, "sum").item() == 0.0
    assert math.isnan(OP(e, et, 0.25, 2.0, "mean").item())


@pytest.mark.cuda
def test_cuda_autocast():
    x, t = _data((513, 80), "cuda", torch.float16, hard=True)
    want = OP(x.float(), t.float(), 0.25, 2.0, "mean").half()
    with torch.autocast("cuda", dtype=torch.float16):
        got = OP(x, t, 0.25, 2.0, "mean")
        mixed = OP(x, t.float(), 0.25, 2.0, "none")
    assert got.dtype == torch.float16 and mixed.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
