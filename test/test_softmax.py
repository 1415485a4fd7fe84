"""Op-specific tests of the fused masked softmaxes
(torchops.scaled_masked_softmax, torchops.scaled_upper_triang_masked_softmax):
what the generic opdb tests do not cover -- fully masked rows (zeros, also in
the backward), that the causal op reads only the lower triangle (forward and
backward), long rows, NaN handling, the mask's batch broadcast, the autocast
decision, determinism, and (on a GPU) every CUDA path against the CPU and the
float64 reference (TORCHOPS_TESTING_SOFTMAX_PATH forces each)."""

from __future__ import annotations

import pytest
import torch

import torchops
from opdb import attention_mask
from torchops import references

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _scores(shape, device="cpu", dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def _value_and_grad(fn, x, *args, seed=1):
    x = x.detach().requires_grad_()
    y = fn(x, *args)
    dy = _scores(y.shape, y.device, y.dtype, seed=seed, scale=1.0)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx, dy


def _close(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fully_masked_rows_are_zero_forward_and_backward(device, dtype):
    x = _scores((2, 3, 5, 40), device, dtype)
    mask = attention_mask((2, 1, 5, 40), device, full_rows=2)
    y, dx, _ = _value_and_grad(torchops.scaled_masked_softmax, x, mask, 0.5)
    assert not y.isnan().any() and not dx.isnan().any()
    assert (y[:, :, :2] == 0).all() and (dx[:, :, :2] == 0).all()
    # Masked keys: probability 0 and gradient 0; other rows sum to 1.
    assert (y.masked_select(mask.expand_as(y)) == 0).all()
    assert (dx.masked_select(mask.expand_as(dx)) == 0).all()
    _close(y[:, :, 2:].double().sum(-1), torch.ones(2, 3, 3, dtype=torch.float64, device=device),
           dtype)


def test_all_keys_masked_differs_from_megatron_fill():
    # Megatron's -10000 fill gives a uniform row; torchops gives zeros.
    x = _scores((1, 1, 2, 6))
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    assert (torchops.scaled_masked_softmax(x, mask, 1.0) == 0).all()
    megatron = torch.softmax(x.masked_fill(mask, -10000.0), -1)
    torch.testing.assert_close(megatron, torch.full_like(x, 1 / 6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("s", [7, 64, 96, 300])
def test_causal_reads_only_the_lower_triangle(device, dtype, s):
    x = _scores((2, 2, s, s), device, dtype)
    above = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    poisoned = x.masked_fill(above, float("nan"))
    y = torchops.scaled_upper_triang_masked_softmax(x, 0.3)
    y_nan = torchops.scaled_upper_triang_masked_softmax(poisoned, 0.3)
    torch.testing.assert_close(y_nan, y, atol=0, rtol=0)
    assert (y.masked_select(above) == 0).all()
    # The backward reads only the triangle of its gradient too.
    dy = _scores((2, 2, s, s), device, dtype, seed=2, scale=1.0)
    bwd = torch.ops.torchops._scaled_upper_triang_masked_softmax_backward.default
    dx = bwd(dy, y, 0.3)
    dx_nan = bwd(dy.masked_fill(above, float("nan")), y, 0.3)
    torch.testing.assert_close(dx_nan, dx, atol=0, rtol=0)
    assert (dx.masked_select(above) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_causal_equals_masked_with_the_upper_triangle(device):
    for shape in [(2, 3, 33, 33), (3, 70, 70)]:
        x = _scores(shape, device)
        s = shape[-1]
        mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
        x4 = x if x.dim() == 4 else x[:, None]
        y_masked, dx_masked, dy = _value_and_grad(torchops.scaled_masked_softmax, x4, mask, 0.7)
        x4 = x4.detach().requires_grad_()
        y = torchops.scaled_upper_triang_masked_softmax(x4, 0.7)
        (dx,) = torch.autograd.grad(y, x4, dy)
        torch.testing.assert_close(y, y_masked)
        torch.testing.assert_close(dx, dx_masked)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_long_rows(device, dtype):
    # Longer than any peer's limit and than the CUDA kernels' register rows.
    for sk in ([2048, 2056, 5000, 20000] if device == "cuda" else [5000]):
        x = _scores((1, 2, 3, sk), device, dtype)
        mask = attention_mask((1, 1, 3, sk), device, density=0.5)
        y, dx, dy = _value_and_grad(torchops.scaled_masked_softmax, x, mask, 0.25)
        x64 = x.double().requires_grad_()
        y_ref = references.scaled_masked_softmax(x64, mask, 0.25)
        (dx_ref,) = torch.autograd.grad(y_ref, x64, dy.double())
        _close(y, y_ref, dtype)
        _close(dx, dx_ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_long_causal_rows(device):
    s = 2500 if device == "cuda" else 1100
    x = _scores((1, s, s), device)
    y, dx, dy = _value_and_grad(torchops.scaled_upper_triang_masked_softmax, x, 0.125)
    x64 = x.double().requires_grad_()
    y_ref = references.scaled_upper_triang_masked_softmax(x64, 0.125)
    (dx_ref,) = torch.autograd.grad(y_ref, x64, dy.double())
    _close(y, y_ref, torch.float32)
    _close(dx, dx_ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_an_unmasked_key_spreads_a_masked_one_does_not(device):
    x = _scores((1, 1, 3, 16), device)
    mask = torch.zeros(1, 1, 3, 16, dtype=torch.bool, device=device)
    mask[..., 1, 5] = True
    x[..., 0, 3] = float("nan")
    x[..., 1, 5] = float("nan")
    y = torchops.scaled_masked_softmax(x, mask, 1.0)
    assert y[0, 0, 0].isnan().all()
    assert not y[0, 0, 1:].isnan().any()
    torch.testing.assert_close(y[0, 0, 1:], references.scaled_masked_softmax(
        x.nan_to_num(0.0), mask, 1.0)[0, 0, 1:])


@pytest.mark.parametrize("device", DEVICES)
def test_a_mask_for_the_batch_equals_the_mask_per_entry(device):
    x = _scores((3, 2, 5, 24), device)
    mask = attention_mask((1, 1, 5, 24), device, density=0.4)
    y = torchops.scaled_masked_softmax(x, mask, 0.5)
    y_each = torchops.scaled_masked_softmax(x, mask.expand(3, 1, 5, 24).contiguous(), 0.5)
    torch.testing.assert_close(y, y_each, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_no_autocast_policy_keeps_the_dtype(device, dtype):
    # Decided: no autocast kernel.  The ops compute in float32 for half types
    # already, so under autocast they return exactly the non-autocast result,
    # in the input's dtype (torch.softmax's CUDA policy would return float32).
    x = _scores((2, 2, 4, 8), device, dtype)
    mask = attention_mask((2, 1, 4, 8), device)
    plain = (torchops.scaled_masked_softmax(x, mask, 0.5),
             torchops.scaled_upper_triang_masked_softmax(x[..., :4, :4].contiguous(), 0.5))
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    with torch.autocast(device, dtype=amp):
        got = (torchops.scaled_masked_softmax(x, mask, 0.5),
               torchops.scaled_upper_triang_masked_softmax(x[..., :4, :4].contiguous(), 0.5))
    for g, p in zip(got, plain):
        assert g.dtype == dtype
        torch.testing.assert_close(g, p, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_and_independent_of_threads(device):
    x = _scores((2, 4, 16, 200), device)
    mask = attention_mask((2, 1, 16, 200), device)
    y1, dx1, _ = _value_and_grad(torchops.scaled_masked_softmax, x, mask, 0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y2, dx2, _ = _value_and_grad(torchops.scaled_masked_softmax, x, mask, 0.5)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    torch.testing.assert_close(dx1, dx2, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sk", [8, 64, 256, 520, 1024, 2048, 2049, 4096])
def test_cuda_paths_match_the_cpu(dtype, sk):
    # Aligned rows up to 2048 keys take the warp kernel, others the block
    # kernel; an offset view (not 16-byte aligned) forces the block kernel.
    x = _scores((2, 2, 3, sk + 1), "cpu", dtype)
    mask = attention_mask((2, 1, 3, sk), "cpu", density=0.3)
    for xs in (x[..., :sk].contiguous(), x.flatten()[1:2 * 2 * 3 * sk + 1].view(2, 2, 3, sk)):
        y_cpu, dx_cpu, dy = _value_and_grad(torchops.scaled_masked_softmax, xs, mask, 0.5)
        xc = xs.cuda().requires_grad_()
        y = torchops.scaled_masked_softmax(xc, mask.cuda(), 0.5)
        (dx,) = torch.autograd.grad(y, xc, dy.cuda())
        _close(y.cpu(), y_cpu, dtype)
        _close(dx.cpu(), dx_cpu, dtype)
    s = min(sk, 2100)
    xs = _scores((1, s, s), "cpu", dtype)
    y_cpu, dx_cpu, dy = _value_and_grad(torchops.scaled_upper_triang_masked_softmax, xs, 0.5)
    xc = xs.cuda().requires_grad_()
    y = torchops.scaled_upper_triang_masked_softmax(xc, 0.5)
    (dx,) = torch.autograd.grad(y, xc, dy.cuda())
    _close(y.cpu(), y_cpu, dtype)
    _close(dx.cpu(), dx_cpu, dtype)


@pytest.mark.cuda
def test_cuda_many_rows_and_a_grid_stride():
    # More rows than the warp kernel's grid covers in one sweep.
    x = torch.randn(1, 1, 1 << 24, 8, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 1 << 24, 8, dtype=torch.bool, device="cuda")
    y = torchops.scaled_masked_softmax(x, mask, 1.0)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1).to(torch.bfloat16).float(),
                               atol=1e-2, rtol=1.6e-2)


def test_cpu_float16_conversions_round_as_torch():
    # The CPU kernels convert float16 with their own branch-free code: on
    # every finite float16 input, the result equals the float32 computation
    # rounded by torch (subnormal, zero and large outputs included).
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    h = bits.view(torch.float16)
    h = h[h.isfinite()][: 992 * 64].reshape(992, 1, 1, 64)
    mask = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
    for scale in (1e-4, 1.0):
        y = torchops.scaled_masked_softmax(h, mask.expand(992, 1, 1, 64), scale)
        y32 = torchops.scaled_masked_softmax(h.float(), mask.expand(992, 1, 1, 64), scale)
        assert torch.equal(y, y32.half())
        bwd = torch.ops.torchops._scaled_masked_softmax_backward.default
        dy = h.flip(0)
        assert torch.equal(bwd(dy, y, scale), bwd(dy.float(), y.float(), scale).half())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sk", [7, 64, 3000])
def test_nonfinite_rows_match_the_reference(device, dtype, sk):
    # Masked keys are exactly 0 in every row; a NaN or +inf among the
    # unmasked scores makes the others NaN (torch.softmax's rule); -inf
    # scores count as masked; a negative NaN (0 * inf) is a NaN too.  Both
    # CUDA paths (warp rows for 64 keys, block rows for 7 and 3000).
    inf, nan = float("inf"), float("nan")
    x = _scores((1, 1, 6, sk), "cpu", torch.float64)
    mask = torch.zeros(1, 1, 6, sk, dtype=torch.bool)
    mask[..., 2:] = True
    x[0, 0, 0, 1] = nan                  # a NaN among finite scores
    x[0, 0, 1, :2] = nan                 # only NaN unmasked
    x[0, 0, 2, 0] = inf                  # +inf
    x[0, 0, 3, 0] = -inf                 # -inf and a finite score
    x[0, 0, 4, :2] = -inf                # every unmasked score -inf: zeros
    x[0, 0, 5, 0] = inf                  # 0 * inf below: a negative NaN
    x = x.to(device, dtype)
    mask = mask.to(device)
    for scale in (1.0, 0.0):
        y = torchops.scaled_masked_softmax(x, mask, scale)
        ref = references.scaled_masked_softmax(x.double(), mask, scale)
        _close(y, ref, dtype)
        if sk >= 6:
            causal = x[0, 0, :, :6].contiguous()
            y = torchops.scaled_upper_triang_masked_softmax(causal[None], scale)
            ref = references.scaled_upper_triang_masked_softmax(causal[None].double(), scale)
            _close(y, ref, dtype)


CUDA_PATHS = ["warp", "chunked", "block"]


@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sk", [8, 24, 256, 520, 2048, 2056, 5000])
def test_every_cuda_path_matches_the_reference(path, dtype, sk, monkeypatch):
    # Forced paths, forward and backward, against float64: masked rows with
    # some fully masked, an offset (not 16-byte aligned) view, which forced
    # warp and chunked paths hand to the block kernel, causal rows (a square
    # of up to 1104 keys: every length from 1), the mask's batch broadcast.
    monkeypatch.setenv("TORCHOPS_TESTING_SOFTMAX_PATH", path)
    x = _scores((2, 2, 4, sk + 1), "cpu", dtype)
    mask = attention_mask((2, 1, 4, sk), "cpu", density=0.3, full_rows=1)
    views = (x[..., :sk].contiguous(), x.flatten()[1:2 * 2 * 4 * sk + 1].view(2, 2, 4, sk))
    for xs in views:
        for m in (mask, mask[:1]):
            xc = xs.cuda().requires_grad_()
            y = torchops.scaled_masked_softmax(xc, m.cuda(), 0.5)
            dy = _scores(y.shape, "cpu", dtype, seed=3, scale=1.0)
            (dx,) = torch.autograd.grad(y, xc, dy.cuda())
            x64 = xs.double().requires_grad_()
            y_ref = references.scaled_masked_softmax(x64, m, 0.5)
            (dx_ref,) = torch.autograd.grad(y_ref, x64, dy.double())
            _close(y.cpu(), y_ref, dtype)
            _close(dx.cpu(), dx_ref, dtype)
            assert (y.cpu()[:, :, :1] == 0).all() and (dx.cpu()[:, :, :1] == 0).all()
    s = min(sk, 1104)
    xs = _scores((2, s, s), "cpu", dtype, seed=4)
    xc = xs.cuda().requires_grad_()
    y = torchops.scaled_upper_triang_masked_softmax(xc, 0.3)
    dy = _scores(y.shape, "cpu", dtype, seed=5, scale=1.0)
    (dx,) = torch.autograd.grad(y, xc, dy.cuda())
    x64 = xs.double().requires_grad_()
    y_ref = references.scaled_upper_triang_masked_softmax(x64, 0.3)
    (dx_ref,) = torch.autograd.grad(y_ref, x64, dy.double())
    _close(y.cpu(), y_ref, dtype)
    _close(dx.cpu(), dx_ref, dtype)
    above = torch.ones(s, s, dtype=torch.bool).triu(1)
    assert (y.cpu().masked_select(above) == 0).all()
    assert (dx.cpu().masked_select(above) == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cuda_path_reads_only_the_causal_triangle_and_keeps_nonfinite_rules(
        path, dtype, monkeypatch):
    monkeypatch.setenv("TORCHOPS_TESTING_SOFTMAX_PATH", path)
    test_causal_reads_only_the_lower_triangle("cuda", dtype, 300)
    for sk in (7, 64, 3000):
        test_nonfinite_rows_match_the_reference("cuda", dtype, sk)
