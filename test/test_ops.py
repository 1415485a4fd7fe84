"""Generic tests, generated for every entry of the op database (opdb.py)."""

from __future__ import annotations

import pytest
import torch

from opdb import OP_DB, OpInfo, Sample, convert, device_dtype_params, devices

OPS = {o.name: o for o in OP_DB}


def _params(with_dtype: bool):
    out = []
    for op in OP_DB:
        if with_dtype:
            out += [pytest.param(op, d, dt, id=f"{op.name}-{d}-{str(dt)[6:]}",
                                 marks=[pytest.mark.cuda] if d == "cuda" else [])
                    for d, dt in device_dtype_params(op)]
        else:
            out += [pytest.param(op, d, id=f"{op.name}-{d}",
                                 marks=[pytest.mark.cuda] if d == "cuda" else [])
                    for d in devices()]
    return out


def _skip_if(op: OpInfo, test: str) -> None:
    if test in op.skips:
        pytest.skip(op.skips[test])


def _call(op: OpInfo, s: Sample):
    return op.op(*s.args, **s.kwargs)


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _reference(op: OpInfo, s: Sample):
    return op.reference(*convert(s, torch.float64).args, **s.kwargs)


@pytest.mark.parametrize("op,device,dtype", _params(with_dtype=True))
def test_correctness(op: OpInfo, device: str, dtype: torch.dtype):
    """Values, dtype, shape, device and (contiguous) strides vs the float64 reference."""
    _skip_if(op, "correctness")
    tol = op.tol(dtype)
    for s in op.sample_inputs(device, dtype):
        got = _outputs(_call(op, s))
        want = _outputs(_reference(op, s))
        assert len(got) == len(want), s
        for g, w in zip(got, want):
            assert g.device == s.tensors()[0].device, s
            assert g.shape == w.shape, s
            if w.is_floating_point():
                assert g.dtype == dtype, s
            assert g.stride() == torch.empty(g.shape).stride() or g.numel() <= 1, \
                f"{s}: kernel output is not contiguous ({g.stride()})"
            torch.testing.assert_close(g.double() if w.is_floating_point() else g,
                                       w.to(g.device), atol=tol.atol, rtol=tol.rtol,
                                       msg=lambda m: f"{s}: {m}")


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
def test_wrapper_is_the_op(op: OpInfo, device: str):
    s = next(iter(op.sample_inputs(device, torch.float64)))
    for g, w in zip(_outputs(op.wrapper(*s.args, **s.kwargs)), _outputs(_call(op, s))):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
def test_opcheck(op: OpInfo, device: str, requires_grad: bool):
    """All four default test_utils of torch.library.opcheck, on every sample."""
    _skip_if(op, "opcheck")
    if requires_grad and not op.differentiable:
        pytest.skip("not differentiable")
    for s in op.sample_inputs(device, torch.float32, requires_grad=requires_grad):
        torch.library.opcheck(op.op, s.args, s.kwargs)


def _grad_samples(op: OpInfo, device: str, dtype: torch.dtype):
    for s in op.sample_inputs(device, dtype, requires_grad=True):
        if any(t.numel() == 0 for t in s.tensors()):
            continue  # nothing to differentiate
        if any(t.requires_grad for t in s.tensors()):
            yield s


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
def test_gradcheck(op: OpInfo, device: str):
    _skip_if(op, "gradcheck")
    if not op.differentiable:
        pytest.skip("not differentiable")
    for s in _grad_samples(op, device, torch.float64):
        if any(0 in t.stride() for t in s.tensors()):
            continue  # gradcheck cannot perturb overlapping (expanded) inputs
        fn = lambda *args: op.op(*args, **s.kwargs)  # noqa: E731
        assert torch.autograd.gradcheck(fn, s.args, fast_mode=True), s
        if op.supports_gradgrad:
            assert torch.autograd.gradgradcheck(fn, s.args, fast_mode=True), s


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grad_vs_reference(op: OpInfo, device: str, dtype: torch.dtype):
    """Gradients in float32/bfloat16 match the float64 reference's gradients."""
    _skip_if(op, "grad_vs_reference")
    if not op.differentiable:
        pytest.skip("not differentiable")
    if dtype not in op.dtypes.get(device, ()):
        pytest.skip(f"{dtype} not supported on {device}")
    tol = op.tol(dtype)
    for s in _grad_samples(op, device, dtype):
        ref_s = convert(s, torch.float64)
        outs = _outputs(_call(op, s))
        ref_outs = _outputs(op.reference(*ref_s.args, **ref_s.kwargs))
        grads_out = [torch.randn_like(o, dtype=torch.float64) for o in ref_outs]
        inputs = [t for t in s.tensors() if t.requires_grad]
        ref_inputs = [t for t in ref_s.tensors() if t.requires_grad]
        got = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
        want = torch.autograd.grad(ref_outs, ref_inputs, grads_out)
        for g, w in zip(got, want):
            assert g.dtype == dtype
            # Gradients sum over a reduction dim: scale atol with its magnitude.
            scale = max(1.0, w.abs().max().item())
            torch.testing.assert_close(g.double(), w, atol=tol.atol * scale, rtol=tol.rtol,
                                       msg=lambda m: f"{s}: {m}")


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
def test_compile(op: OpInfo, device: str):
    """torch.compile(fullgraph=True, dynamic=True): forward and backward match eager."""
    _skip_if(op, "compile")
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: op.op(*a), fullgraph=True, dynamic=True)
    samples = [s for s in op.sample_inputs(device, torch.float32, requires_grad=op.differentiable)
               if all(t.numel() > 0 for t in s.tensors()) and not s.kwargs][:2]
    for s in samples:
        eager = _outputs(_call(op, s))
        s2 = convert(s)
        compiled = _outputs(fn(*s2.args))
        for c, e in zip(compiled, eager):
            torch.testing.assert_close(c, e)
        if op.differentiable:
            go = [torch.ones_like(e) for e in eager if e.is_floating_point()]
            ins = [t for t in s.tensors() if t.requires_grad]
            ins2 = [t for t in s2.tensors() if t.requires_grad]
            ge = torch.autograd.grad([e for e in eager if e.is_floating_point()], ins, go)
            gc = torch.autograd.grad([c for c in compiled if c.is_floating_point()], ins2, go)
            for a, b in zip(gc, ge):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op,device", _params(with_dtype=False))
def test_error_inputs(op: OpInfo, device: str):
    """Invalid inputs raise an error naming the op (and the argument); on CUDA
    the device stays usable."""
    for e in op.error_inputs(device):
        with pytest.raises(e.error, match=e.match):
            _call(op, e.sample)
    if device == "cuda":
        torch.cuda.synchronize()
        s = next(iter(op.sample_inputs(device, torch.float32)))
        _call(op, s)
        torch.cuda.synchronize()
