"""Op-specific tests of the norms (rms_norm, fused_add_rms_norm,
fused_add_rms_norm_, layer_norm): drop-in equality with torch.nn.functional,
eps=None, the fused sum's rounding, the in-place variant, mixed precision,
autocast, and the determinism of the parameter gradients.  Values against the
reference, gradients, compile and export are the op database's (opdb/norms.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchops
from op_testing import at_thread_counts
from opdb import devices

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)


@pytest.fixture(params=devices())
def device(request):
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_f_rms_norm_with_default_eps(device, dtype):
    x = torch.randn(6, 4, 10, device=device, dtype=dtype) * 0.01  # eps matters at this scale
    w = torch.rand(4, 10, device=device, dtype=dtype) + 0.5
    for weight in (w, None):
        got = torchops.rms_norm(x, (4, 10), weight)
        want = F.rms_norm(x.double(), (4, 10), None if weight is None else weight.double(),
                          torch.finfo(dtype).eps).to(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want)
    # An int is a one-dim normalized_shape, as in torch.nn.functional.
    torch.testing.assert_close(torchops.rms_norm(x, 10), torchops.rms_norm(x, [10]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_is_f_layer_norm(device, dtype):
    x = torch.randn(5, 3, 12, device=device, dtype=dtype) * 4 + 2
    w = torch.rand(12, device=device, dtype=dtype) + 0.5
    b = torch.randn(12, device=device, dtype=dtype)
    got = torchops.layer_norm(x, (12,), w, b, 1e-5)
    want = F.layer_norm(x.double(), (12,), w.double(), b.double(), 1e-5).to(dtype)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_precision_weights(device, dtype):
    """A float32 weight beside a half input: the input's dtype out, computed
    from the float32 weight (not a rounded copy of it)."""
    x = torch.randn(7, 64, device=device, dtype=dtype)
    w = torch.rand(64, device=device) + 0.5
    b = torch.randn(64, device=device)
    out = torchops.rms_norm(x, [64], w, 1e-6)
    assert out.dtype == dtype
    want = F.rms_norm(x.double(), [64], w.double(), 1e-6)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    out = torchops.layer_norm(x, [64], w, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), F.layer_norm(x.double(), [64], w.double(),
                                                          b.double()), atol=3e-2, rtol=1e-2)
    # Gradients: each in its input's dtype, against float64.
    g = torch.randn(7, 64, device=device, dtype=dtype)
    for op in ("rms", "ln"):
        leaves = [x.detach().requires_grad_(), w.detach().requires_grad_(),
                  b.detach().requires_grad_()]
        ref = [t.detach().double().requires_grad_() for t in leaves]
        if op == "rms":
            out = torchops.rms_norm(leaves[0], [64], leaves[1])
            want = F.rms_norm(ref[0], [64], ref[1], torch.finfo(dtype).eps)
            leaves, ref = leaves[:2], ref[:2]
        else:
            out = torchops.layer_norm(*leaves[:1], [64], *leaves[1:])
            want = F.layer_norm(ref[0], [64], ref[1], ref[2])
        got = torch.autograd.grad(out, leaves, g)
        exp = torch.autograd.grad(want, ref, g.double())
        for t, a, e in zip(leaves, got, exp):
            assert a.dtype == t.dtype
            torch.testing.assert_close(a.double(), e, atol=5e-2 * max(1.0, e.abs().max().item()),
                                       rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_sum_is_rounded_before_the_norm(device, dtype):
    x = torch.randn(9, 48, device=device, dtype=dtype)
    r = torch.randn(9, 48, device=device, dtype=dtype)
    w = torch.rand(48, device=device, dtype=dtype) + 0.5
    out, s = torchops.fused_add_rms_norm(x, r, [48], w, 1e-6)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, torchops.rms_norm(x + r, [48], w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_variant_writes_what_the_fused_op_returns(device, dtype):
    x = torch.randn(3, 5, 40, device=device, dtype=dtype)
    r = torch.randn(3, 5, 40, device=device, dtype=dtype)
    w = torch.rand(40, device=device, dtype=dtype) + 0.5
    out, s = torchops.fused_add_rms_norm(x, r, [40], w, 1e-6)
    x_ptr = x.data_ptr()
    assert torchops.fused_add_rms_norm_(x, r, w, 1e-6) is None
    assert x.data_ptr() == x_ptr
    torch.testing.assert_close(x, out, rtol=0, atol=0)
    torch.testing.assert_close(r, s, rtol=0, atol=0)


def test_inplace_variant_under_compile_and_inference_mode():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32) + 0.5
    want = torchops.fused_add_rms_norm(x, r, [32], w, 1e-6)

    @torch.compile(fullgraph=True)
    def step(x, r, w):
        torchops.fused_add_rms_norm_(x, r, w, 1e-6)
        return x * 2

    with torch.inference_mode():
        x2, r2 = x.clone(), r.clone()
        doubled = step(x2, r2, w)
    torch.testing.assert_close(x2, want[0], rtol=0, atol=0)
    torch.testing.assert_close(r2, want[1], rtol=0, atol=0)
    torch.testing.assert_close(doubled, want[0] * 2)


def test_fused_gradients_reach_input_and_residual_alike():
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    out, s = torchops.fused_add_rms_norm(x, r, [16], w, 1e-6)
    (out.sin().sum() + (s * s).sum()).backward()
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, r, w))
    s2 = x2 + r2
    (F.rms_norm(s2, [16], w2, 1e-6).sin().sum() + (s2 * s2).sum()).backward()
    for got, want in ((x.grad, x2.grad), (r.grad, r2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(got, want)
    # Two leaves, two gradients: not one tensor shared between them.
    assert x.grad.data_ptr() != r.grad.data_ptr()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_parameter_gradients_do_not_depend_on_the_thread_count(op):
    x = torch.randn(300, 96, requires_grad=True)
    w = (torch.rand(96) + 0.5).requires_grad_()
    b = torch.randn(96, requires_grad=True)
    g = torch.randn(300, 96)

    def grads():
        y = (torchops.rms_norm(x, [96], w) if op == "rms_norm"
             else torchops.layer_norm(x, [96], w, b))
        return torch.autograd.grad(y, [x, w], g)

    first, *rest = at_thread_counts(grads)
    for other in rest:
        for a, b_ in zip(first, other):
            assert torch.equal(a, b_)


def test_autocast_keeps_the_input_dtype_as_pytorch_does():
    """PyTorch's CPU autocast leaves F.layer_norm / F.rms_norm in the input's
    dtype (a float32 input stays float32); so do these, and a weight of
    another dtype is cast to what the input takes."""
    x = torch.randn(4, 16)
    w = torch.rand(16) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torchops.layer_norm(x, [16], w).dtype == F.layer_norm(x, [16], w).dtype
        assert torchops.rms_norm(x, [16], w).dtype == F.rms_norm(x, [16], w).dtype
        xb = x.bfloat16()
        assert torchops.layer_norm(xb, [16], w).dtype == F.layer_norm(xb, [16], w).dtype
        # float32 input, bfloat16 weight: rejected outside autocast, cast inside.
        out = torchops.rms_norm(x, [16], w.bfloat16())
        assert out.dtype == torch.float32
        out, s = torchops.fused_add_rms_norm(xb, x, [16], w)
        assert out.dtype == s.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"torchops\.rms_norm.*'weight'.*dtype"):
        torchops.rms_norm(x, [16], w.bfloat16())


def test_statistics_are_saved_not_recomputed():
    """The _forward ops return the row statistics the backward reads."""
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    y, mean, rstd = torch.ops.torchops._layer_norm_forward(x, [8], None, None, 1e-5)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, (x.var(-1, unbiased=False) + 1e-5).rsqrt())
    y, rstd = torch.ops.torchops._rms_norm_forward(x.half(), [3, 8], None, None)
    assert rstd.shape == (2,) and rstd.dtype == torch.float32
