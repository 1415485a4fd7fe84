"""ms_deform_attn beyond the op database's generic tests: the grid_sample
formulation (mmcv's multi_scale_deformable_attn_pytorch), thread-count and
run-to-run determinism of the backward, hostile locations and, on CUDA,
spatial_shapes that do not describe value (bounded reads, no checks in the
kernels) and the deterministic backward."""

from __future__ import annotations

import pytest
import torch

import torchops
from opdb import msda_inputs
from torchops import references

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# Deformable DETR's layout, scaled down: 3 levels, 3 heads, 4 points.
LEVELS = [(6, 9), (3, 5), (2, 3)]


def _grads(out, inputs, seed=0):
    # Drawn in float64 whatever out's dtype: float32 and float64 draws from
    # one seed are different sequences.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_grid_sample_formulation_values_and_gradients(device):
    value, shapes, starts, loc, attn = msda_inputs(LEVELS, 2, 7, 3, 5, 4, device,
                                                   torch.float64, requires_grad=True,
                                                   low=-0.2, high=1.2)
    got = torchops.ms_deform_attn(value, shapes, starts, loc, attn)
    want = references.ms_deform_attn_grid_sample(value, shapes, starts, loc, attn)
    explicit = references.ms_deform_attn(value, shapes, starts, loc, attn)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(explicit, want)
    for a, b in zip(_grads(got, (value, loc, attn)), _grads(want, (value, loc, attn))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grid_sample_formulation_in_low_precision(device, dtype):
    args = msda_inputs(LEVELS, 2, 9, 2, 8, 2, device, dtype, seed=3)
    got = torchops.ms_deform_attn(*args).double()
    want = references.ms_deform_attn_grid_sample(*[a.double() if a.is_floating_point() else a
                                                   for a in args])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_cpu_backward_is_independent_of_the_thread_count():
    args = msda_inputs(LEVELS, 2, 11, 4, 6, 3, "cpu", torch.float32, requires_grad=True, seed=5)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = torchops.ms_deform_attn(*args)
            results.append((out, *_grads(out, (args[0], args[3], args[4]))))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_hostile_locations_read_nothing(device):
    """NaN, infinite and huge locations sample nothing (zeros, zero
    gradients), like locations outside every level."""
    value, shapes, starts, loc, attn = msda_inputs([(4, 4), (2, 3)], 1, 5, 2, 4, 2, device,
                                                   torch.float32, seed=7)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30],
                       device=device)
    loc = loc.clone()
    loc[0, :, :, :, :, 0] = bad[:, None, None, None]
    for t in (value, loc, attn):
        t.requires_grad_()
    out = torchops.ms_deform_attn(value, shapes, starts, loc, attn)
    assert torch.equal(out, torch.zeros_like(out))
    gv, gl, ga = _grads(out, (value, loc, attn))
    assert torch.equal(gv, torch.zeros_like(gv)) and torch.equal(ga, torch.zeros_like(ga))
    assert torch.equal(gl, torch.zeros_like(gl))


def test_cpu_rejects_inconsistent_levels_in_the_op_itself():
    value, shapes, starts, loc, attn = msda_inputs(LEVELS, 1, 3, 2, 4, 2, "cpu", torch.float32)
    big = torch.tensor([[2**40, 2**40], [3, 5], [2, 3]])
    with pytest.raises(RuntimeError, match=r"torchops\.ms_deform_attn: .*'spatial_shapes'"):
        torch.ops.torchops.ms_deform_attn(value, big, starts, loc, attn)
    grad = torch.zeros(1, 3, 8)
    with pytest.raises(RuntimeError, match=r"torchops\._ms_deform_attn_backward: .*level_start"):
        torch.ops.torchops._ms_deform_attn_backward(grad, value, shapes, starts + 1, loc, attn)


@pytest.mark.cuda
def test_cuda_kernels_bound_reads_for_any_spatial_shapes():
    """Unchecked (validate=False, or under compile), spatial_shapes that do
    not describe value give some values but read only inside value: run
    with compute-sanitizer in the GPU check; here, they finish and every
    output and gradient is finite."""
    value, shapes, starts, loc, attn = msda_inputs(LEVELS, 2, 5, 2, 8, 2, "cuda",
                                                   torch.float32, requires_grad=True)
    hostile = [
        (torch.tensor([[2**40, 2**40], [3, 5], [2, 3]]), starts),
        (torch.tensor([[-6, 9], [3, -5], [2, 3]]), starts),
        (shapes, torch.tensor([2**62, -1, value.shape[1]])),
        (torch.tensor([[100, 1], [1, 100], [9, 9]]), torch.tensor([0, 60, 70])),
    ]
    for bad_shapes, bad_starts in hostile:
        bad_shapes, bad_starts = bad_shapes.cuda(), bad_starts.cuda()
        out = torchops.ms_deform_attn(value, bad_shapes, bad_starts, loc, attn, validate=False)
        grads = _grads(out, (value, loc, attn))
        torch.cuda.synchronize()
        for t in (out, *grads):
            assert torch.isfinite(t).all()
        with pytest.raises(RuntimeError, match=r"torchops\.ms_deform_attn"):
            torchops.ms_deform_attn(value, bad_shapes, bad_starts, loc, attn)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cuda_deterministic_backward_is_reproducible_and_equals_the_atomic_one(dtype):
    # Many queries on a small level: many contributions per destination.
    args = msda_inputs([(4, 6), (2, 2)], 2, 300, 4, 32, 4, "cuda", dtype, requires_grad=True,
                       seed=11)
    inputs = (args[0], args[3], args[4])
    out = torchops.ms_deform_attn(*args)
    atomic = _grads(out, inputs)
    torch.use_deterministic_algorithms(True)
    try:
        first = _grads(torchops.ms_deform_attn(*args), inputs)
        second = _grads(torchops.ms_deform_attn(*args), inputs)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-4)
    for a, b in zip(first, atomic):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_encoder_shape_matches_the_grid_sample_formulation():
    """Deformable DETR's encoder levels at one image, float32: forward and
    gradients against grid_sample's (in float64)."""
    levels = [(100, 150), (50, 75), (25, 38), (13, 19)]
    q = sum(h * w for h, w in levels)
    args = msda_inputs(levels, 1, q, 8, 32, 4, "cuda", torch.float32, requires_grad=True)
    inputs = (args[0], args[3], args[4])
    out = torchops.ms_deform_attn(*args)
    ref_args = [a.detach().double().requires_grad_() if a.is_floating_point() else a
                for a in args]
    want = references.ms_deform_attn_grid_sample(*ref_args)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    got_g = _grads(out, inputs)
    want_g = _grads(want, (ref_args[0], ref_args[3], ref_args[4]))
    # The location gradient jumps where a sample crosses a pixel row or
    # column; samples whose pixel coordinate lies within float32 rounding of
    # one may fall on either side in float32 and float64: left out there.
    size = torch.tensor(levels, dtype=torch.float64, device="cuda").flip(-1)  # (L, 2): W, H
    pix = ref_args[3].detach() * size[:, None, :] - 0.5  # (B, Q, heads, L, P, 2)
    smooth = ((pix - pix.round()).abs() > 1e-4).all(-1, keepdim=True).expand_as(pix)
    assert smooth.float().mean() > 0.99
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        atol = 2e-3
        if i == 1:
            # A location's gradient is the level's width times a sum of
            # value differences that mostly cancel: float32 rounds it
            # relative to the gradients' scale (up to about 8500 here), not
            # to its own size (the same formula in float64 matches to 1e-12).
            a, b = a[smooth], b[smooth]
            atol = 1e-5 * b.abs().max().item()
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=1e-3)
