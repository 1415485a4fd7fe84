"""Generic tests, generated for every entry of the op database (opdb.py).

CUDA variants carry the `cuda` marker (`pytest -m cuda` runs only them; they
are skipped where there is no GPU).  torch.export round trips are in
test_export.py, hypothesis property tests in test_properties.py, and the
coverage and API gates in test_gates.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from op_testing import (DEVICES, VIAS, assert_matches_reference, assert_same_outputs, call,
                        call_via, data_dependent_ok, floating, generic_param, nonempty, op_name,
                        outputs, reference, wrapper_view)
from opdb import HALF_DTYPES, OP_DB, OPCHECK_UTILS, OpInfo, Sample, Tol, convert


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_device_params(test: str, devices=DEVICES):
    """(op, device) for every entry, with its Skip records for `test`."""
    return [generic_param(test, op, d, values=(op, d), id=f"{op.name}-{d}")
            for op in OP_DB for d in devices]


def _op_device_dtype_params(test: str, devices=DEVICES, dtypes=None):
    """(op, device, dtype) for every dtype the entry has on the device (of
    `dtypes`, when given), with its Skip records for `test`."""
    return [generic_param(test, op, d, dt, values=(op, d, dt), id=f"{op.name}-{d}-{_dt(dt)}")
            for op in OP_DB for d in devices for dt in op.dtypes.get(d, ())
            if dtypes is None or dt in dtypes]


def _need_dtype(op: OpInfo, device: str, dtype: torch.dtype) -> None:
    if dtype not in op.dtypes.get(device, ()):
        pytest.skip(f"{op.name} does not support {dtype} on {device}")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Forward values
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,device,dtype", _op_device_dtype_params("correctness"))
def test_correctness(op: OpInfo, device: str, dtype: torch.dtype):
    """Every sample against the float64 reference: values, dtype, shape,
    device and (contiguous) strides; integer outputs exactly."""
    for s in op.samples(device, dtype):
        assert_matches_reference(op, s, call(op, s), reference(op, s), dtype, device)


@pytest.mark.parametrize("op,device", _op_device_params("wrapper"))
def test_wrapper(op: OpInfo, device: str):
    """The Python wrapper is the dispatcher op."""
    for s in list(op.sample_inputs(device, torch.float64))[:3]:
        assert_same_outputs(call_via(op, s, "wrapper"), wrapper_view(op, call(op, s)), None, s)


@pytest.mark.parametrize("op,dtype", [
    generic_param("cpu_vs_cuda", op, "cuda", dt, values=(op, dt), id=f"{op.name}-{_dt(dt)}")
    for op in OP_DB for dt in op.dtypes.get("cpu", ()) if dt in op.dtypes.get("cuda", ())])
def test_cpu_vs_cuda(op: OpInfo, dtype: torch.dtype):
    """CPU and CUDA kernels agree on the same inputs (integer outputs exactly)."""
    for s in op.samples("cpu", dtype):
        on_gpu = Sample(tuple(a.to("cuda") if isinstance(a, torch.Tensor) else a for a in s.args),
                        dict(s.kwargs), s.name)
        got = tuple(o.cpu() for o in outputs(call(op, on_gpu)))
        assert_same_outputs(got, call(op, s), op.tol(dtype), f"{s} cuda vs cpu")


def _first_floating_only(s: Sample, dtype: torch.dtype) -> Sample:
    """The first floating tensor in `dtype`, the other floating ones in
    float32: a mixed-precision call that only an autocast kernel accepts."""
    seen = False

    def conv(a):
        nonlocal seen
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            return a
        t = a.detach().to(dtype if not seen else torch.float32)
        seen = True
        return t
    return Sample(tuple(conv(a) for a in s.args), dict(s.kwargs), s.name + "_mixed")


@pytest.mark.parametrize("op,device,dtype",
                         _op_device_dtype_params("autocast", dtypes=HALF_DTYPES))
def test_autocast(op: OpInfo, device: str, dtype: torch.dtype):
    """Under torch.autocast, reduced-precision inputs give outputs of their own
    dtype that match the float32 computation within the dtype's tolerance.
    Ops with autocast kernels also take mixed float32/`dtype` inputs and
    return the first input's dtype (as torchvision's do)."""
    for s in op.samples(device, dtype):
        variants = [s]
        if op.autocast and sum(t.is_floating_point() for t in s.tensors()) > 1:
            variants.append(_first_floating_only(s, dtype))
        want = outputs(call(op, convert(s, torch.float32)))
        for v in variants:
            with torch.autocast(device_type=device, dtype=dtype):
                got = outputs(call(op, v))
            for g in got:
                if g.is_floating_point():
                    assert g.dtype == op.out_dtype(dtype), \
                        f"{v}: output {g.dtype} under autocast from {dtype} inputs"
            assert_same_outputs(tuple(g.float() if g.is_floating_point() else g for g in got), want,
                                op.tol(dtype), f"{v} under autocast({_dt(dtype)})")


# ---------------------------------------------------------------------------------------------
# Registration (opcheck)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,device", _op_device_params("opcheck"))
@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
def test_opcheck(op: OpInfo, device: str, requires_grad: bool):
    """torch.library.opcheck's four default test_utils on every sample; an
    entry turns one off only with a written reason (opcheck_skips)."""
    if requires_grad and not op.differentiable:
        pytest.skip("not differentiable")
    utils = [u for u in OPCHECK_UTILS if u not in op.opcheck_skips]
    for s in op.sample_inputs(device, torch.float32, requires_grad=requires_grad):
        torch.library.opcheck(op.op, s.args, s.kwargs, test_utils=utils)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------

def _grad_samples(op: OpInfo, device: str, dtype: torch.dtype, large: bool = False):
    """Samples with something to differentiate (the large ones only when
    asked: finite differences on them would take ages)."""
    gen = op.samples if large else op.sample_inputs
    for s in gen(device, dtype, requires_grad=True):
        if nonempty(s) and any(t.requires_grad for t in s.tensors()):
            yield s


def _perturbable(s: Sample) -> Sample:
    """gradcheck perturbs inputs in place, which an expanded (stride-0)
    input cannot take: give such inputs their own memory."""
    def fix(a):
        if isinstance(a, torch.Tensor) and a.requires_grad and 0 in a.stride():
            return a.detach().contiguous().requires_grad_()
        return a
    return Sample(tuple(fix(a) for a in s.args), dict(s.kwargs), s.name)


def _differentiable_fn(op: OpInfo, s: Sample):
    return lambda *args: tuple(floating(outputs(op.op(*args, **s.kwargs))))


def _gradcheck_kwargs(op: OpInfo) -> dict:
    return {"fast_mode": True, **op.gradcheck_kwargs}


@pytest.mark.parametrize("op,device", _op_device_params("gradcheck"))
def test_gradcheck(op: OpInfo, device: str):
    """Analytical gradients against finite differences, in float64."""
    if not op.differentiable:
        pytest.skip("not differentiable")
    for s in map(_perturbable, _grad_samples(op, device, torch.float64)):
        assert torch.autograd.gradcheck(_differentiable_fn(op, s), s.args, **_gradcheck_kwargs(op)), s


@pytest.mark.parametrize("op,device", _op_device_params("gradgradcheck"))
def test_gradgradcheck(op: OpInfo, device: str):
    """Double backward, for the ops that claim it."""
    if not (op.differentiable and op.supports_gradgrad):
        pytest.skip("no double backward")
    for s in map(_perturbable, _grad_samples(op, device, torch.float64)):
        assert torch.autograd.gradgradcheck(_differentiable_fn(op, s), s.args,
                                            **_gradcheck_kwargs(op)), s


@pytest.mark.parametrize("op,device,dtype", [
    generic_param("grad_vs_reference", op, d, dt, values=(op, d, dt),
                  id=f"{op.name}-{d}-{_dt(dt)}")
    for op in OP_DB for d in DEVICES for dt in (torch.float32, torch.bfloat16)])
def test_grad_vs_reference(op: OpInfo, device: str, dtype: torch.dtype):
    """Forward and gradients in float32/bfloat16, inputs requiring grad,
    against the float64 reference's."""
    if not op.differentiable:
        pytest.skip("not differentiable")
    _need_dtype(op, device, dtype)
    tol = op.tol(dtype)
    for s in _grad_samples(op, device, dtype, large=True):
        ref_s = convert(s, torch.float64)
        outs = outputs(call(op, s))
        ref_outs = outputs(op.reference(*ref_s.args, **ref_s.kwargs))
        assert_matches_reference(op, s, outs, ref_outs, dtype, device)
        outs, ref_outs = floating(outs), floating(ref_outs)
        grads_out = [torch.randn_like(o, dtype=torch.float64) for o in ref_outs]
        inputs = [t for t in s.tensors() if t.requires_grad]
        ref_inputs = [t for t in ref_s.tensors() if t.requires_grad]
        got = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(grads_out, outs)],
                                  allow_unused=True, materialize_grads=True)
        want = torch.autograd.grad(ref_outs, ref_inputs, grads_out,
                                   allow_unused=True, materialize_grads=True)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == dtype and g.shape == w.shape, f"{s}: grad {i} is {g.dtype}{tuple(g.shape)}"
            # Gradients sum over reduction dims: scale atol with their magnitude.
            scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
            torch.testing.assert_close(g.double(), w, atol=tol.atol * scale, rtol=tol.rtol,
                                       msg=lambda m: f"{s}: grad {i}: {m}")


# ---------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ---------------------------------------------------------------------------------------------

def _no_duck_sizing():
    """Sizes that happen to be equal in a sample must not become one symbol
    (that is the sample's coincidence, not the op's guard)."""
    import torch.fx.experimental._config as fx_config
    return fx_config.patch(use_duck_shape=False)


def _with_tensors(template: Sample, tensors) -> tuple:
    it = iter(tensors)
    return tuple(next(it) if isinstance(a, torch.Tensor) else a for a in template.args)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("op,device", _op_device_params("compile"))
def test_compile(op: OpInfo, device: str, via: str):
    """torch.compile(fullgraph=True, dynamic=True) with inductor, of the
    dispatcher op and of the public wrapper: forward and backward match
    eager, and three input sizes compile at most twice (a wrapper that
    breaks the graph fails fullgraph)."""
    samples = op.compile_samples(device, torch.float32, requires_grad=op.differentiable)
    assert len(samples) >= 3, (
        f"{op.name}: the compile test needs 3 non-empty samples of one structure (layouts, "
        f"scalars, dims of size 1) with different sizes; add them to sample_inputs or give "
        f"sample_inputs_compile")
    template = samples[0]
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(
        lambda *ts: call_via(op, Sample(_with_tensors(template, ts), template.kwargs), via),
        backend=counter, fullgraph=True, dynamic=True)
    tol = Tol(1e-5, 1.3e-6)
    with data_dependent_ok(op), _no_duck_sizing():
        for s in samples:
            eager = outputs(call_via(op, s, via))
            s2 = convert(s)  # fresh leaves on the same data
            compiled = outputs(fn(*s2.tensors()))
            assert_same_outputs(compiled, eager, tol, f"{s} compiled vs eager")
            if not op.differentiable:
                continue
            ins = [t for t in s.tensors() if t.requires_grad]
            ins2 = [t for t in s2.tensors() if t.requires_grad]
            go = [torch.randn_like(e) for e in floating(eager)]
            ge = torch.autograd.grad(floating(eager), ins, go, allow_unused=True, materialize_grads=True)
            gc = torch.autograd.grad(floating(compiled), ins2, go, allow_unused=True,
                                     materialize_grads=True)
            assert_same_outputs(gc, ge, tol, f"{s} compiled vs eager gradients")
    assert counter.frame_count <= 2, (
        f"{op.name}: {counter.frame_count} compilations for 3 sizes under dynamic=True "
        f"(a schema `int` where a size belongs? a guard in the fake?)")


@pytest.mark.parametrize("op", [generic_param("cuda_graph", op, "cuda", values=(op,), id=op.name)
                                for op in OP_DB])
def test_cuda_graph(op: OpInfo):
    """Capture in a CUDA graph and replay, with new data in the static
    inputs: the eager result.  A kernel launched on the default stream instead
    of the current one fails the capture or reads stale data."""
    if op.data_dependent_output:
        pytest.skip("the output size depends on the data: allocating it needs a host sync, "
                    "which CUDA graph capture forbids")
    rg = op.differentiable
    for s in filter(nonempty, op.samples("cuda", torch.float32, requires_grad=rg)):
        static = convert(s)
        ins = [t for t in static.tensors() if t.requires_grad]

        def step():
            outs = outputs(call(op, static))
            grads = ()
            if ins and floating(outs):
                grads = torch.autograd.grad(floating(outs), ins, [torch.ones_like(o) for o in floating(outs)],
                                            allow_unused=True, materialize_grads=True)
            return outs, grads

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (lazy inits) outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_outs, g_grads = step()
        with torch.no_grad():
            for t in static.tensors():
                if t.is_floating_point() and not torch._debug_has_internal_overlap(t):
                    t.mul_(0.5).add_(0.25)
        graph.replay()
        torch.cuda.synchronize()
        e_outs, e_grads = step()
        # Tolerances, not equality: atomic-add backwards sum in any order.
        tol = op.tol(torch.float32)
        assert_same_outputs(g_outs, e_outs, tol, f"{s} graph replay")
        assert_same_outputs(g_grads, e_grads, tol, f"{s} graph replay gradients")


# ---------------------------------------------------------------------------------------------
# Invalid inputs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in OP_DB])
def test_mixed_cpu_and_meta_inputs_raise(op: OpInfo):
    """A CPU and a meta tensor dispatch to the fake (Meta outranks CPU): it
    must raise like the kernels, not return an uninitialised CPU tensor."""
    s = next((s for s in op.sample_inputs("cpu", torch.float32)
              if nonempty(s) and len(s.tensors()) >= 2), None)
    if s is None:
        pytest.skip(f"{op.name} takes one tensor")
    last = max(i for i, a in enumerate(s.args) if isinstance(a, torch.Tensor))
    args = list(s.args)
    args[last] = args[last].detach().to("meta")
    with pytest.raises(RuntimeError, match=rf"torchops\.{op.name}.*device"):
        op.op(*args, **s.kwargs)


@pytest.mark.parametrize("op,device", _op_device_params("error_inputs"))
def test_error_inputs(op: OpInfo, device: str):
    """Every invalid input raises the declared error, whose message names the
    op; on CUDA the device stays usable (a valid call afterwards works)."""
    valid = next(filter(nonempty, op.sample_inputs(device, torch.float32)))
    errors = list(op.error_inputs(device))
    assert errors, f"{op.name}: no error_inputs"
    for e in errors:
        assert issubclass(e.error, (RuntimeError, ValueError, TypeError)), e
        target = e.op or op.op
        fn = op.wrapper if e.via_wrapper else target
        with pytest.raises(e.error, match=e.match) as info:
            fn(*e.sample.args, **e.sample.kwargs)
        assert op_name(target) in str(info.value), \
            f"{e.sample}: message does not name the op: {info.value}"
        if device == "cuda":
            torch.cuda.synchronize()
            call(op, valid)
            torch.cuda.synchronize()


@pytest.mark.parametrize("op,device", _op_device_params("fake_error_inputs"))
def test_fake_error_inputs(op: OpInfo, device: str):
    """Every invalid call of the dispatcher ops (the entry's and its internal
    backward ops) raises under FakeTensorMode too, with the kernels' error:
    so torch.compile and torch.export fail at trace time, naming the op and
    the argument, as eager does -- not later, or with a bare shape error.
    Inputs marked kernel_only (a value inside a tensor, a real allocation)
    are out of a fake's sight."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    checked = 0
    for e in op.error_inputs(device):
        if e.via_wrapper or e.kernel_only:
            continue
        target = e.op or op.op
        mode = FakeTensorMode()
        fake = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        args = tuple(fake(a) for a in e.sample.args)
        kwargs = {k: fake(v) for k, v in e.sample.kwargs.items()}
        with mode, pytest.raises(e.error, match=e.match) as info:
            target(*args, **kwargs)
        assert op_name(target) in str(info.value), \
            f"{e.sample}: the fake's message does not name the op: {info.value}"
        checked += 1
    assert checked, f"{op.name}: no error input reaches the fake"
