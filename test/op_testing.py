"""Helpers the generic tests share: their parameters (with the entries' Skip
records as marks), calling an entry's op and its reference, and comparing
outputs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from opdb import GENERIC_TESTS, OpInfo, Sample, Tol, convert

DEVICES = ("cpu", "cuda")


def generic_param(test: str, op: OpInfo, device: str, dtype: torch.dtype | None = None, *,
                  values: tuple, id: str):
    """The pytest.param of one run of generic test `test` (a GENERIC_TESTS
    name) for `op` on `device` at `dtype`: marked `cuda` on the GPU, and
    skipped -- or, for an xfail record, expected to fail -- where one of
    the entry's Skip records targets it.  A test that runs at one fixed
    dtype takes it when `dtype` is None."""
    fixed = GENERIC_TESTS[test]
    if dtype is None and isinstance(fixed, tuple) and len(fixed) == 1:
        dtype = fixed[0]
    marks = [pytest.mark.cuda] if device == "cuda" else []
    skip = op.skip_for(test, device, dtype)
    if skip is not None:
        marks.append(pytest.mark.xfail(reason=skip.reason, strict=True) if skip.xfail
                     else pytest.mark.skip(reason=skip.reason))
    return pytest.param(*values, id=id, marks=marks)


def op_name(overload: torch._ops.OpOverload) -> str:
    """torch.ops.torchops.<name>.default -> "<name>"."""
    return overload._schema.name.split("::", 1)[1]


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its sizes and strides (a sliced or transposed input
    stays so), which an in-place op may write without touching the sample."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t.detach())


def _call_mutating(op: OpInfo, fn, s: Sample):
    """An in-place op's call (op.mutated_args): on copies of the args it
    writes, whose new values are its outputs; the sample stays unchanged, so
    the reference and a second call see the same inputs."""
    args = list(s.args)
    for i in op.mutated_args:
        args[i] = _strided_copy(args[i])
    ret = fn(*args, **s.kwargs)
    assert ret is None, f"{op.name}: an in-place op returned {type(ret)}"
    return tuple(args[i] for i in op.mutated_args)


def call(op: OpInfo, s: Sample):
    if op.mutated_args:
        return _call_mutating(op, op.op, s)
    return op.op(*s.args, **s.kwargs)


def outputs(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# How a generic test reaches an op: "op" (torch.ops.torchops.<name>) or
# "wrapper" (torchops.<name>, what users call).
VIAS = ("op", "wrapper")


def call_via(op: OpInfo, s: Sample, via: str):
    """The sample's call through the dispatcher op or the public wrapper."""
    if via == "op":
        return call(op, s)
    w = op.wrapper_sample(s) if op.wrapper_sample is not None else s
    if op.mutated_args:
        return _call_mutating(op, op.wrapper, w)
    return op.wrapper(*w.args, **w.kwargs)


def wrapper_view(op: OpInfo, out) -> tuple[torch.Tensor, ...]:
    """The op's outputs as the wrapper returns them."""
    out = outputs(out)
    return tuple(op.wrapper_outputs(out)) if op.wrapper_outputs is not None else out


def reference(op: OpInfo, s: Sample):
    r = convert(s, torch.float64)
    return op.reference(*r.args, **r.kwargs)


def floating(outs) -> list[torch.Tensor]:
    """The differentiable members of an output tuple."""
    return [o for o in outs if o.is_floating_point()]


def nonempty(s: Sample) -> bool:
    return all(t.numel() > 0 for t in s.tensors())


def data_dependent_ok(op: OpInfo):
    """Lets dynamo trace ops whose output size depends on the data."""
    if op.data_dependent_output:
        return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
    return contextlib.nullcontext()


def assert_same_outputs(got, want, tol: Tol | None, where) -> None:
    """Floating outputs within `tol` (exact when None), everything else
    exactly; same dtype, shape and device."""
    got, want = outputs(got), outputs(want)
    assert len(got) == len(want), f"{where}: {len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{where}: output {i} dtype {g.dtype}, expected {w.dtype}"
        assert g.shape == w.shape, f"{where}: output {i} shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        assert g.device == w.device, f"{where}: output {i} on {g.device}, expected {w.device}"
        exact = tol is None or not g.is_floating_point()
        torch.testing.assert_close(g, w, atol=0 if exact else tol.atol, rtol=0 if exact else tol.rtol,
                                   equal_nan=True, msg=lambda m: f"{where}: output {i}: {m}")


def assert_matches_reference(op: OpInfo, s: Sample, got, want, dtype: torch.dtype,
                             device: str, scale_atol: bool = False) -> None:
    """Kernel outputs against the float64 reference's: floating outputs in
    `dtype` within the entry's tolerance, integer outputs exactly (dtype
    included); shape, device and (contiguous) strides.  `scale_atol` scales
    the absolute tolerance with the reference's magnitude (for drawn values
    of any magnitude)."""
    got, want = outputs(got), outputs(want)
    assert len(got) == len(want), f"{s}: {len(got)} outputs, reference has {len(want)}"
    tol = op.tol(dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"{s} output {i}"
        assert g.device.type == device, f"{where}: on {g.device}"
        assert g.shape == w.shape, f"{where}: shape {tuple(g.shape)}, reference {tuple(w.shape)}"
        want_dtype = op.out_dtype(dtype) if w.is_floating_point() else w.dtype
        assert g.dtype == want_dtype, f"{where}: dtype {g.dtype}, expected {want_dtype}"
        if op.contiguous_outputs:
            assert g.stride() == torch.empty(g.shape, device="meta").stride() or g.numel() <= 1, \
                f"{where}: kernel output is not contiguous ({g.stride()})"
        w = w.to(g.device)
        if w.is_floating_point():
            scale = max(1.0, w.abs().max().item()) if scale_atol and w.numel() else 1.0
            torch.testing.assert_close(g.double(), w, atol=tol.atol * scale, rtol=tol.rtol, equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")
        else:
            torch.testing.assert_close(g, w, atol=0, rtol=0, msg=lambda m: f"{where}: {m}")


@contextlib.contextmanager
def _global_setting(get, set_, value):
    """A process-wide torch setting at `value` inside the block, restored after."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def num_threads(n: int):
    """The CPU kernels run on `n` threads inside the block."""
    return _global_setting(torch.get_num_threads, torch.set_num_threads, n)


def deterministic(on: bool = True):
    """torch.use_deterministic_algorithms(on) inside the block."""
    return _global_setting(torch.are_deterministic_algorithms_enabled,
                           torch.use_deterministic_algorithms, on)


def at_thread_counts(fn, counts=(1, 2, 3)) -> list:
    """fn()'s result at each CPU thread count, for the checks that a CPU
    result does not depend on it."""
    results = []
    for n in counts:
        with num_threads(n):
            results.append(fn())
    return results
