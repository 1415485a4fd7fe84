"""Op-specific tests of carafe (the generic ones come from its opdb entry):
mmcv's semantics against a literal loop, softmax kernels reproducing constant
features, a deterministic backward (independent of the CPU thread count,
bitwise repeatable on every device, with or without
torch.use_deterministic_algorithms), and on a GPU the tiled CUDA kernels
against the generic ones (TORCHOPS_TESTING_CARAFE_PATH) for every kernel
size, scale and dtype they serve."""

from __future__ import annotations

import pytest
import torch

import op_testing
import torchops
from opdb import carafe_inputs
from torchops import references

CARAFE = torch.ops.torchops.carafe.default
BACKWARD = torch.ops.torchops._carafe_backward.default
PATH_SWITCH = "TORCHOPS_TESTING_CARAFE_PATH"


def _mmcv_loop(f, m, k, g, s):
    """mmcv's naive CARAFE kernel, one output value at a time."""
    n, c, h, w = f.shape
    r, cg = (k - 1) // 2, c // g
    out = torch.zeros(n, c, h * s, w * s, dtype=f.dtype)
    for b in range(n):
        for ch in range(c):
            grp = ch // cg
            for oh in range(h * s):
                for ow in range(w * s):
                    acc = 0.0
                    for iy in range(oh // s - r, oh // s + r + 1):
                        for ix in range(ow // s - r, ow // s + r + 1):
                            if 0 <= iy < h and 0 <= ix < w:
                                mc = (grp * k + iy - oh // s + r) * k + ix - ow // s + r
                                acc += f[b, ch, iy, ix] * m[b, mc, oh, ow]
                    out[b, ch, oh, ow] = acc
    return out


@pytest.mark.parametrize("shape,k,g,s", [((1, 4, 3, 4), 3, 2, 2), ((2, 2, 3, 2), 5, 1, 3),
                                         ((1, 3, 2, 3), 1, 3, 1)])
def test_carafe_matches_mmcv_loop(shape, k, g, s):
    f, m = carafe_inputs(shape, k, g, s, "cpu", torch.float64)
    expect = _mmcv_loop(f, m, k, g, s)
    torch.testing.assert_close(torchops.carafe(f, m, k, g, s), expect)
    torch.testing.assert_close(references.carafe(f, m, k, g, s), expect)


def test_carafe_softmax_kernels_keep_constant_features():
    """Kernels that sum to 1 reproduce a constant map wherever the whole
    neighbourhood lies inside it."""
    k, g, s = 5, 2, 2
    f = torch.full((1, 4, 9, 8), 2.5, dtype=torch.float64)
    logits = torch.randn(1, g, k * k, 18, 16, dtype=torch.float64)
    m = torch.softmax(logits, dim=2).view(1, g * k * k, 18, 16)
    out = torchops.carafe(f, m, k, g, s)
    inner = out[:, :, 2 * s:-2 * s, 2 * s:-2 * s]
    torch.testing.assert_close(inner, torch.full_like(inner, 2.5))


def _grads(f, m, k, g, s, grad):
    return BACKWARD(grad, f, m, k, g, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carafe_cpu_backward_is_independent_of_threads(dtype):
    k, g, s = 5, 2, 2
    f, m = carafe_inputs((2, 6, 7, 9), k, g, s, "cpu", dtype)
    grad = torch.randn(2, 6, 14, 18).to(dtype)
    with op_testing.num_threads(1):
        one = _grads(f, m, k, g, s, grad)
        out1 = CARAFE(f, m, k, g, s)
    with op_testing.num_threads(2):
        two = _grads(f, m, k, g, s, grad)
        out2 = CARAFE(f, m, k, g, s)
    torch.testing.assert_close(out1, out2, rtol=0, atol=0)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------

cuda = pytest.mark.cuda

# (features (N, C, H, W), kernel_size, group_size, scale_factor): every
# tiled kernel size with even and odd scales (2 x 2, 1 x 2 and 1 x 1 output
# blocks per thread), many channels (channel chunks, several staging
# passes), edges of 32-column tiles, and what only the generic kernels
# serve (k 9; grad_features for s > 2).
_CUDA_CASES = [
    ((2, 8, 9, 37), 1, 4, 2), ((2, 6, 9, 37), 3, 2, 2), ((1, 40, 7, 33), 5, 1, 2),
    ((1, 6, 5, 35), 7, 3, 2), ((1, 4, 11, 34), 3, 1, 1), ((1, 4, 6, 33), 5, 2, 1),
    ((1, 3, 5, 40), 7, 1, 1), ((1, 4, 3, 10), 3, 2, 3), ((1, 2, 5, 12), 5, 1, 4),
    ((2, 256, 3, 5), 5, 1, 2), ((1, 3, 4, 6), 9, 1, 2), ((1, 2, 3, 3), 7, 1, 8),
]


def _run(path, monkeypatch, f, m, k, g, s, grad):
    if path is None:
        monkeypatch.delenv(PATH_SWITCH, raising=False)
    else:
        monkeypatch.setenv(PATH_SWITCH, path)
    out = CARAFE(f, m, k, g, s)
    gf, gm = BACKWARD(grad, f, m, k, g, s)
    torch.cuda.synchronize()
    return out, gf, gm


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,k,g,s", _CUDA_CASES)
def test_carafe_cuda_tiled_equals_generic_and_reference(shape, k, g, s, dtype, monkeypatch):
    f, m = carafe_inputs(shape, k, g, s, "cuda", dtype)
    grad = torch.randn(shape[0], shape[1], shape[2] * s, shape[3] * s, device="cuda").to(dtype)
    auto = _run(None, monkeypatch, f, m, k, g, s, grad)
    generic = _run("generic", monkeypatch, f, m, k, g, s, grad)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5}.get(dtype, 2e-2)
    for a, b in zip(auto, generic):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    f64, m64 = f.double().requires_grad_(), m.double().requires_grad_()
    ref = references.carafe(f64, m64, k, g, s)
    ref_grads = torch.autograd.grad(ref, (f64, m64), grad.double())
    for got, want in zip(auto, (ref, *ref_grads)):
        scale = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


@cuda
@pytest.mark.parametrize("shape,k,g,s,kernels", [
    ((1, 4, 5, 6), 5, 1, 2, "forward, grad_masks and grad_features"),
    ((1, 4, 5, 6), 3, 2, 1, "forward, grad_masks and grad_features")])
def test_carafe_cuda_tiled_path_runs_where_claimed(shape, k, g, s, kernels, monkeypatch):
    """With the switch at "tiled", a call the tiled kernels cannot serve
    raises, so these runs prove the tiled kernels took them."""
    f, m = carafe_inputs(shape, k, g, s, "cuda", torch.float32)
    grad = torch.randn(shape[0], shape[1], shape[2] * s, shape[3] * s, device="cuda")
    tiled = _run("tiled", monkeypatch, f, m, k, g, s, grad)
    generic = _run("generic", monkeypatch, f, m, k, g, s, grad)
    for a, b in zip(tiled, generic):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@cuda
def test_carafe_cuda_testing_switch_errors(monkeypatch):
    f, m = carafe_inputs((1, 2, 3, 4), 9, 1, 2, "cuda", torch.float32)
    monkeypatch.setenv(PATH_SWITCH, "tiled")
    with pytest.raises(RuntimeError, match=r"torchops\.carafe: .*=tiled.*cannot run"):
        CARAFE(f, m, 9, 1, 2)
    monkeypatch.setenv(PATH_SWITCH, "fast")
    with pytest.raises(RuntimeError, match=r"torchops\.carafe: .*'fast' is not one of"):
        CARAFE(f, m, 9, 1, 2)


@cuda
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carafe_cuda_backward_is_bitwise_repeatable(deterministic, dtype):
    # An FPN level's shape at a quarter of the channels: every kernel tiled.
    k, g, s = 5, 1, 2
    f, m = carafe_inputs((2, 64, 50, 76), k, g, s, "cuda", dtype)
    grad = torch.randn(2, 64, 100, 152, device="cuda").to(dtype)
    with op_testing.deterministic(deterministic):
        first = _grads(f, m, k, g, s, grad)
        for _ in range(3):
            again = _grads(f, m, k, g, s, grad)
            for a, b in zip(first, again):
                assert torch.equal(a, b)


@cuda
def test_carafe_cuda_matches_cpu_on_an_fpn_level():
    k, g, s = 5, 1, 2
    f, m = carafe_inputs((1, 32, 25, 38), k, g, s, "cpu", torch.float32)
    grad = torch.randn(1, 32, 50, 76)
    cpu = (CARAFE(f, m, k, g, s), *BACKWARD(grad, f, m, k, g, s))
    fc, mc, gc = f.cuda(), m.cuda(), grad.cuda()
    gpu = (CARAFE(fc, mc, k, g, s), *BACKWARD(gc, fc, mc, k, g, s))
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b.cpu(), a, rtol=2e-5, atol=2e-5)
