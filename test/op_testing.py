"""Helpers the generic tests share: calling an entry's op, its reference, and
comparing outputs."""

from __future__ import annotations

import contextlib

import torch

from opdb import OpInfo, Sample, Tol, convert


def call(op: OpInfo, s: Sample):
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
        assert g.dtype == (dtype if w.is_floating_point() else w.dtype), \
            f"{where}: dtype {g.dtype}, expected {dtype if w.is_floating_point() else w.dtype}"
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
