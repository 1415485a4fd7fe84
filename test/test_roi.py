"""Op-specific tests of roi_align, roi_pool and deform_roi_pool (the generic
ones come from their opdb entries): the torchvision-style wrappers, empty inputs, the
deterministic CPU backward, autocast, and on a GPU the deterministic CUDA
backwards, CPU/CUDA agreement and equivalence with torchvision."""

from __future__ import annotations

import pytest
import torch

import torchops
from op_testing import at_thread_counts, deterministic
from opdb import random_rois as _random_rois
from torchops.references import roi_align as _roi_align_ref

ALIGN = torch.ops.torchops.roi_align.default
POOL = torch.ops.torchops.roi_pool.default


def _features(shape, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _problem(n=2, c=8, h=24, w=20, k=40, scale=0.5, device="cpu", dtype=torch.float32, seed=0):
    x = _features((n, c, h, w), device, dtype, seed)
    rois = _random_rois(n, k, h, w, scale, dtype, device, seed)
    return x, rois, scale


def _cuda_problem(dtype, layout):
    """The CPU-vs-CUDA tests' problem on the GPU, its input in `layout`."""
    x, rois, scale = _problem(c=6, k=30, device="cuda", dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.cat([x, x], dim=1)[:, 1::2]
    return x, rois, scale


def _align_grad(x, rois, scale, ph, pw, sr, aligned, grad_out):
    x = x.detach().requires_grad_()
    ALIGN(x, rois, scale, ph, pw, sr, aligned).backward(grad_out)
    return x.grad


def _pool_grad(x, rois, scale, ph, pw, grad_out):
    x = x.detach().requires_grad_()
    POOL(x, rois, scale, ph, pw)[0].backward(grad_out)
    return x.grad


# ---------------------------------------------------------------------------------
# Wrappers (torchvision.ops signatures)
# ---------------------------------------------------------------------------------

def test_wrappers_accept_torchvision_box_formats():
    x, rois, scale = _problem(k=12)
    per_image = [rois[rois[:, 0] == i, 1:] for i in range(x.shape[0])]
    ordered = torch.cat([rois[rois[:, 0] == i] for i in range(x.shape[0])])
    want = ALIGN(x, ordered, scale, 3, 3, 2, True)
    torch.testing.assert_close(torchops.roi_align(x, per_image, 3, scale, 2, True), want,
                               atol=0, rtol=0)
    torch.testing.assert_close(torchops.roi_align(x, ordered, (3, 3), scale, 2, True), want,
                               atol=0, rtol=0)
    out = torchops.roi_pool(x, per_image, (2, 3), scale)
    torch.testing.assert_close(out, POOL(x, ordered, scale, 2, 3)[0], atol=0, rtol=0)


def test_wrapper_defaults_match_torchvision():
    # torchvision.ops.roi_align(input, boxes, output_size, spatial_scale=1.0,
    # sampling_ratio=-1, aligned=False)
    x, rois, _ = _problem(k=5, scale=1.0)
    torch.testing.assert_close(torchops.roi_align(x, rois, 2), ALIGN(x, rois, 1.0, 2, 2, -1, False),
                               atol=0, rtol=0)
    torch.testing.assert_close(torchops.roi_pool(x, rois, 2), POOL(x, rois, 1.0, 2, 2)[0],
                               atol=0, rtol=0)


def test_wrapper_rejects_bad_boxes():
    x = _features((1, 2, 6, 6))
    with pytest.raises(RuntimeError, match=r"torchops\.roi_align.*'boxes'"):
        torchops.roi_align(x, torch.zeros(3, 4), 2)
    with pytest.raises(RuntimeError, match=r"torchops\.roi_pool.*'boxes'"):
        torchops.roi_pool(x, [torch.zeros(3, 5)], 2)
    with pytest.raises(TypeError, match=r"torchops\.roi_align.*'boxes'"):
        torchops.roi_align(x, "boxes", 2)


# ---------------------------------------------------------------------------------
# Empty inputs
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_empty_inputs(device):
    x = _features((2, 3, 5, 5), device).requires_grad_()
    no_rois = torch.empty(0, 5, device=device)
    out = ALIGN(x, no_rois, 1.0, 2, 3, 2, False)
    assert out.shape == (0, 3, 2, 3)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    pooled, argmax = POOL(x, no_rois, 1.0, 2, 3)
    assert pooled.shape == argmax.shape == (0, 3, 2, 3) and argmax.dtype == torch.int64
    rois = torch.tensor([[1, 0.0, 0.0, 3.0, 3.0]], device=device)
    no_channels = _features((2, 0, 5, 5), device)
    assert ALIGN(no_channels, rois, 1.0, 2, 2, 2, True).shape == (1, 0, 2, 2)
    assert POOL(no_channels, rois, 1.0, 2, 2)[0].shape == (1, 0, 2, 2)
    grad = torch.ops.torchops._roi_align_backward(
        torch.empty(0, 3, 2, 2, device=device), no_rois, 1.0, 2, 2, 2, 3, 5, 5, 2, False)
    assert torch.equal(grad, torch.zeros(2, 3, 5, 5, device=device))


# ---------------------------------------------------------------------------------
# CPU backward: deterministic whatever the number of threads
# ---------------------------------------------------------------------------------

def test_cpu_backward_is_thread_count_independent():
    # CPU tensors even where the default device is a GPU: set_num_threads
    # governs the CPU kernels only (test_cuda_*_deterministic_backward covers
    # the CUDA backwards).
    x, rois, scale = _problem(c=16, k=60, device="cpu")
    g_align = _features((60, 16, 4, 3), "cpu", seed=1)
    g_pool = _features((60, 16, 3, 3), "cpu", seed=2)
    results = at_thread_counts(lambda: (_align_grad(x, rois, scale, 4, 3, 0, True, g_align),
                                        _pool_grad(x, rois, scale, 3, 3, g_pool)))
    for a, p in results[1:]:
        assert torch.equal(a, results[0][0])
        assert torch.equal(p, results[0][1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("walk", ["auto", "sparse", "four", "dense"])
def test_cpu_tap_walks(walk, dtype, monkeypatch):
    """The CPU kernel's three ways of walking the taps (sparse lists, padded
    4x4, dense row pass), each forced on every RoI through the kernel's
    testing switch TORCHOPS_TESTING_ROI_ALIGN_WALK, against the float64
    reference, forward and backward.  "auto" is the per-RoI choice by cost,
    which these boxes spread over all three: wide bins sampled once (sparse),
    twice (4x4), small bins (dense)."""
    switch = "TORCHOPS_TESTING_ROI_ALIGN_WALK"
    if walk == "auto":
        monkeypatch.delenv(switch, raising=False)
    else:
        monkeypatch.setenv(switch, walk)
    x = _features((1, 3, 64, 400), dtype=dtype)
    rois = torch.tensor([[0, 10.0, 1.0, 360.0, 14.0],   # 50-pixel bins
                         [0, 20.0, 2.0, 230.0, 13.0],   # 30-pixel bins
                         [0, 5.0, 3.0, 40.0, 12.0],     # 5-pixel bins
                         [0, 100.0, 0.5, 103.0, 2.0],   # sub-pixel bins
                         # 30 x 8-pixel bins: at sampling ratio 2 a bin has
                         # 4 rows as well as 4 columns, the 4x4 walk's most.
                         [0, 50.0, 4.3, 260.0, 59.9]],
                        dtype=dtype)
    # The 4x4 walk serves bins of at most 4 taps per axis, so not the wide
    # bins' adaptive grids (sampling_ratio 0): those it refuses, below.
    for sr in (1, 2) if walk == "four" else (1, 2, 0):
        xr = x.clone().requires_grad_()
        out = ALIGN(xr, rois, 1.0, 7, 7, sr, False)
        xd = x.double().clone().requires_grad_()
        want = _roi_align_ref(xd, rois.double(), 1.0, 7, 7, sr, False)
        tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.double(), want, **tol)
        g = _features(out.shape, dtype=torch.float64, seed=7)
        out.backward(g.to(dtype))
        want.backward(g)
        torch.testing.assert_close(xr.grad.double(), xd.grad, **tol)
    # A forced walk that cannot serve a RoI raises instead of falling back, so
    # the passes above ran the walk named; these show the switch is honoured.
    if walk == "four":
        with pytest.raises(RuntimeError, match=f"{switch}=four cannot walk RoI 0"):
            ALIGN(x, rois, 1.0, 7, 7, 0, False)
    if walk == "dense":
        left_of_image = torch.tensor([[0, -30.0, 1.0, -20.0, 14.0]], dtype=dtype)
        with pytest.raises(RuntimeError, match=f"{switch}=dense cannot walk RoI 0"):
            ALIGN(x, left_of_image, 1.0, 7, 7, 2, False)
        monkeypatch.setenv(switch, "sparse")
        assert not ALIGN(x, left_of_image, 1.0, 7, 7, 2, False).any()
    if walk == "auto":
        monkeypatch.setenv(switch, "diagonal")
        with pytest.raises(RuntimeError, match=f"{switch}='diagonal' is not one of auto, sparse"):
            ALIGN(x, rois, 1.0, 7, 7, 2, False)


# ---------------------------------------------------------------------------------
# Autocast: computed in float32, returned in the input's dtype (like torchvision)
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
])
def test_autocast(device, dtype):
    x, rois, scale = _problem(k=10, device=device)
    xl = x.to(dtype)
    want_align = ALIGN(xl.float(), rois, scale, 3, 3, 2, True).to(dtype)
    want_pool = POOL(xl.float(), rois, scale, 3, 3)
    with torch.autocast(device, dtype=dtype):
        # Mixed dtypes, as AMP produces them: reduced-precision features,
        # float32 boxes.  Without autocast this is a dtype error.
        got_align = ALIGN(xl, rois, scale, 3, 3, 2, True)
        got_pool = POOL(xl, rois, scale, 3, 3)
        # float32 features stay float32.
        assert ALIGN(x, rois, scale, 3, 3, 2, True).dtype == torch.float32
    assert got_align.dtype == dtype and got_pool[0].dtype == dtype
    assert got_pool[1].dtype == torch.int64
    torch.testing.assert_close(got_align, want_align, atol=0, rtol=0)
    torch.testing.assert_close(got_pool[0], want_pool[0].to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(got_pool[1], want_pool[1], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match=r"torchops\.roi_align.*'rois'.*dtype"):
        ALIGN(xl, rois, scale, 3, 3, 2, True)

    xg = xl.detach().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        ALIGN(xg, rois, scale, 3, 3, 2, True).float().sum().backward()
    assert xg.grad is not None and xg.grad.dtype == dtype


# ---------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------

def _detection_problem(dtype=torch.float32, n=2, c=64, h=50, w=50, k=300, seed=0):
    """Many overlapping boxes, so many grad elements hit the same pixels."""
    x, rois, scale = _problem(n, c, h, w, k, 0.25, "cuda", dtype, seed)
    return x, rois, scale


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sampling_ratio,aligned", [(2, True), (0, False), (3, False)])
def test_cuda_roi_align_deterministic_backward(dtype, sampling_ratio, aligned):
    x, rois, scale = _detection_problem(dtype)
    rois[::17, 0] = 7  # invalid batch index: no output, no gradient
    g = _features((rois.shape[0], x.shape[1], 7, 7), "cuda", dtype, seed=3)
    args = (rois, scale, 7, 7, sampling_ratio, aligned)
    atomic = _align_grad(x, *args, g)
    with deterministic():
        first = _align_grad(x, *args, g)
        second = _align_grad(x, *args, g)
    assert first.dtype == dtype
    assert torch.equal(first, second)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3,
           torch.bfloat16: 2e-2}[dtype]
    scale_ = max(1.0, atomic.abs().max().item())
    torch.testing.assert_close(first, atomic, atol=tol * scale_, rtol=tol)
    # ... and with the CPU kernel, which rejects the invalid boxes that CUDA
    # treats as empty.
    valid = (rois[:, 0] < x.shape[0]).cpu()
    cpu = _align_grad(x.cpu(), rois.cpu()[valid], *args[1:], g.cpu()[valid])
    torch.testing.assert_close(first.cpu(), cpu, atol=tol * scale_, rtol=tol)


@pytest.mark.cuda
def test_cuda_roi_align_default_backward_is_the_gather_when_cheap():
    # A fixed sampling ratio and few samples per input element: the default
    # backward is the gather kernel, so the same bits as under determinism.
    x, rois, scale = _detection_problem(c=256, k=40)
    g = _features((rois.shape[0], x.shape[1], 7, 7), "cuda", seed=6)
    args = (rois, scale, 7, 7, 2, True)
    first, second = _align_grad(x, *args, g), _align_grad(x, *args, g)
    with deterministic():
        strict = _align_grad(x, *args, g)
    assert torch.equal(first, second) and torch.equal(first, strict)


@pytest.mark.cuda
@pytest.mark.parametrize("c", [5, 40])
@pytest.mark.parametrize("layout", ["expanded", "channels_last", "sliced"])
def test_cuda_roi_align_gather_backward_reads_any_grad_layout(c, layout):
    # The gather backward copies the incoming gradient through its strides
    # and writes grad_input by 32x32 (pixel, channel) tiles: channel counts
    # that leave a tile partly empty, and gradients that are not contiguous,
    # must give the float64 CPU kernel's result.
    x, rois, scale = _detection_problem(c=c, k=120)
    k = rois.shape[0]
    full = _features((k, c, 7, 7), "cuda", seed=7)
    g = {"expanded": full[:, :1].expand(k, c, 7, 7),
         "channels_last": full.contiguous(memory_format=torch.channels_last),
         "sliced": _features((k, 2 * c, 7, 9), "cuda", seed=7)[:, ::2, :, 1:8]}[layout]
    assert not g.is_contiguous()
    args = (rois, scale, 7, 7, 2, True)
    with deterministic():
        got = _align_grad(x, *args, g)
    assert got.is_contiguous() and got.shape == x.shape
    want = _align_grad(x.double().cpu(), rois.double().cpu(), *args[1:], g.double().cpu())
    # Sums of up to hundreds of float32 terms of size ~10: an absolute
    # tolerance scaled by the largest element, as in the tests above.
    torch.testing.assert_close(got.double().cpu(), want,
                               atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)



@pytest.mark.cuda
@pytest.mark.parametrize("where", ["corner", "nowhere"])
def test_cuda_roi_align_gather_backward_with_long_runs_of_untouched_pixels(where):
    # The sorted gather finds each pixel's range of contributions; pixels no
    # RoI touches (the whole first image and most of the second, or every
    # pixel when no RoI is valid) must come out exactly zero, and the rest
    # must match the float64 CPU kernel.
    x, rois, scale = _detection_problem(c=33, k=60)
    h, w = x.shape[2] / scale, x.shape[3] / scale  # image size in RoI coordinates
    rois[:, 0] = 1 if where == "corner" else 5  # 5: no such image
    rois[:, 1:3] = rois[:, 1:3] * 0.1 + torch.tensor([0.8 * w, 0.8 * h], device="cuda")
    rois[:, 3:5] = rois[:, 1:3] + 0.1 * torch.tensor([w, h], device="cuda")
    g = _features((rois.shape[0], x.shape[1], 7, 7), "cuda", seed=8)
    args = (rois, scale, 7, 7, 2, True)
    with deterministic():
        got = _align_grad(x, *args, g)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    if where == "nowhere":
        assert torch.equal(got, torch.zeros_like(got))
        return
    assert got[1].abs().sum() > 0
    assert torch.equal(got[1, :, : x.shape[2] // 2], torch.zeros_like(got[1, :, : x.shape[2] // 2]))
    want = _align_grad(x.double().cpu(), rois.double().cpu(), *args[1:], g.double().cpu())
    torch.testing.assert_close(got.double().cpu(), want,
                               atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_cuda_roi_pool_deterministic_backward(dtype):
    x, rois, scale = _detection_problem(dtype)
    rois[::13, 0] = -1
    g = _features((rois.shape[0], x.shape[1], 7, 7), "cuda", dtype, seed=4)
    atomic = _pool_grad(x, rois, scale, 7, 7, g)
    with deterministic():
        first = _pool_grad(x, rois, scale, 7, 7, g)
        second = _pool_grad(x, rois, scale, 7, 7, g)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, atomic, atol=1e-2 if dtype == torch.float16 else 1e-5,
                               rtol=1e-3)


@pytest.mark.cuda
def test_cuda_deterministic_backward_under_compile():
    x, rois, scale = _detection_problem(k=50)
    g = _features((50, x.shape[1], 7, 7), "cuda", seed=5)

    def step(x):
        return (ALIGN(x, rois, scale, 7, 7, 2, True) * g).sum() + POOL(x, rois, scale, 7, 7)[0].sum()

    compiled = torch.compile(step, fullgraph=True)
    with deterministic():
        xe = x.clone().requires_grad_()
        step(xe).backward()
        xc = x.clone().requires_grad_()
        compiled(xc).backward()
    assert torch.equal(xe.grad, xc.grad)


@pytest.mark.cuda
def test_cuda_invalid_batch_index_is_empty():
    x, rois, scale = _problem(k=8, device="cuda")
    rois[2, 0] = 5
    rois[5, 0] = -3
    rois[6, 0] = float("nan")
    out = ALIGN(x, rois, scale, 2, 2, 2, False)
    pooled, argmax = POOL(x, rois, scale, 2, 2)
    bad = torch.tensor([2, 5, 6], device="cuda")
    assert torch.equal(out[bad], torch.zeros_like(out[bad]))
    assert torch.equal(pooled[bad], torch.zeros_like(pooled[bad]))
    assert torch.equal(argmax[bad], torch.full_like(argmax[bad], -1))
    good = torch.tensor([0, 1, 3, 4, 7], device="cuda")
    torch.testing.assert_close(out[good].cpu(),
                               ALIGN(x.cpu(), rois[good].cpu(), scale, 2, 2, 2, False))
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_cuda_matches_cpu(dtype, layout):
    x, rois, scale = _cuda_problem(dtype, layout)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype in (torch.float32, torch.float64) else \
        dict(atol=2e-2, rtol=2e-2)
    for sr, aligned in ((2, True), (0, False)):
        out = ALIGN(x, rois, scale, 5, 4, sr, aligned)
        torch.testing.assert_close(out.cpu(), ALIGN(x.cpu(), rois.cpu(), scale, 5, 4, sr, aligned),
                                   **tol)
        g = torch.randn_like(out)
        torch.testing.assert_close(
            _align_grad(x, rois, scale, 5, 4, sr, aligned, g).cpu(),
            _align_grad(x.cpu(), rois.cpu(), scale, 5, 4, sr, aligned, g.cpu()), **tol)
    pooled, argmax = POOL(x, rois, scale, 3, 4)
    cpu_pooled, cpu_argmax = POOL(x.cpu(), rois.cpu(), scale, 3, 4)
    torch.testing.assert_close(pooled.cpu(), cpu_pooled, atol=0, rtol=0)
    assert torch.equal(argmax.cpu(), cpu_argmax)
    g = torch.randn_like(pooled)
    torch.testing.assert_close(_pool_grad(x, rois, scale, 3, 4, g).cpu(),
                               _pool_grad(x.cpu(), rois.cpu(), scale, 3, 4, g.cpu()), **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sampling_ratio,aligned", [(2, False), (2, True), (0, True), (-1, False)])
def test_cuda_roi_align_matches_torchvision(dtype, sampling_ratio, aligned):
    tv = pytest.importorskip("torchvision")
    x, rois, scale = _detection_problem(dtype, c=32, k=200)
    want_x = x.clone().requires_grad_()
    want = tv.ops.roi_align(want_x, rois, (7, 7), scale, sampling_ratio, aligned)
    got_x = x.clone().requires_grad_()
    got = torchops.roi_align(got_x, rois, (7, 7), scale, sampling_ratio, aligned)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    # Both add with atomics, in different orders: allow for the rounding of
    # sums of hundreds of terms.
    grad_tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else tol
    torch.testing.assert_close(got_x.grad, want_x.grad, **grad_tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hw", [50, 800], ids=["planes_in_l2", "planes_beyond_l2"])
def test_cuda_roi_pool_matches_torchvision(dtype, hw):
    """Values, argmax and input gradient as torchvision's; the atomic
    backward's two thread orders (memory order where the input planes fit in
    L2, channel-outer where they do not: 2 x 32 x 800 x 800 is 164 MB)."""
    tv = pytest.importorskip("torchvision")
    x, rois, scale = _detection_problem(dtype, c=32, h=hw, w=hw, k=200)
    want_out, want_argmax = torch.ops.torchvision.roi_pool(x, rois, scale, 7, 7)
    got_out, got_argmax = POOL(x, rois, scale, 7, 7)
    torch.testing.assert_close(got_out, want_out, atol=0, rtol=0)
    assert torch.equal(got_argmax, want_argmax.long())
    want_x = x.clone().requires_grad_()
    got_x = x.clone().requires_grad_()
    g = torch.randn_like(want_out)
    tv.ops.roi_pool(want_x, rois, 7, scale).backward(g)
    torchops.roi_pool(got_x, rois, 7, scale).backward(g)
    torch.testing.assert_close(got_x.grad, want_x.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_other_device_and_stream():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, rois, scale = _problem(k=10, device="cuda:1")
    s = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(s):
        out = ALIGN(x, rois, scale, 3, 3, 2, True)
        pooled = POOL(x, rois, scale, 3, 3)[0]
    s.synchronize()
    assert out.device == x.device
    torch.testing.assert_close(out.cpu(), ALIGN(x.cpu(), rois.cpu(), scale, 3, 3, 2, True),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pooled.cpu(), POOL(x.cpu(), rois.cpu(), scale, 3, 3)[0])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_roi_pool_ties_nan_and_wide_bins(dtype):
    """The CUDA forward scans a bin with 1 to 32 lanes (by bin width) and
    reduces them: ties must still go to the first maximum in row-major order,
    NaNs never win, and all-NaN bins give -FLT_MAX with argmax -1, like the
    CPU kernel's sequential scan."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (2, 5, 40, 300), generator=g).to(dtype)  # many ties
    x[torch.rand(x.shape, generator=g) < 0.05] = float("nan")
    x[0, 1, 8:16, :] = float("nan")
    rois = torch.tensor([[0, 0.0, 0.0, 299.0, 39.0],    # 43-column bins: 32 lanes
                         [1, 10.0, 3.0, 130.0, 20.0],   # 17 columns: 16 lanes
                         [0, 5.0, 8.0, 60.0, 15.0],     # all-NaN rows in channel 1
                         [1, 2.0, 2.0, 9.0, 30.0],      # narrow: 1 or 2 lanes
                         [1, 250.0, 30.0, 320.0, 50.0]],  # clipped at the edge
                        dtype=dtype)
    for ph, pw in ((7, 7), (3, 5), (2, 1)):
        want = POOL(x, rois, 1.0, ph, pw)
        got = POOL(x.cuda(), rois.cuda(), 1.0, ph, pw)
        torch.testing.assert_close(got[0].cpu(), want[0], atol=0, rtol=0, equal_nan=True)
        assert torch.equal(got[1].cpu(), want[1])
    for layout in ("sliced", "channels_last"):
        xs = torch.stack([x, x], dim=2).flatten(1, 2)[:, ::2] if layout == "sliced" else \
            x.contiguous(memory_format=torch.channels_last)
        got = POOL(xs.cuda(), rois.cuda(), 1.0, 7, 7)
        want = POOL(x, rois, 1.0, 7, 7)
        assert torch.equal(got[1].cpu(), want[1])


# ---------------------------------------------------------------------------------
# Bounded work: no RoI, however absurd, can hang a kernel
# ---------------------------------------------------------------------------------

# Runs in a subprocess with a time limit, so that a regression fails the test
# instead of hanging the suite in native code that cannot be interrupted.
_ABSURD_ROIS = r"""
import sys, torch, torchops
device = sys.argv[1]
x = torch.randn(2, 16, 48, 40, device=device, requires_grad=True)
big = [1e12, 1e30, -1e30, float("inf"), float("nan")]
rows = [[i % 2, -v, -v, v, v] for i, v in enumerate(big)] + [[0, 0.0, 0.0, 1e12, 3.0]]
rois = torch.tensor(rows, device=device)
for aligned in (False, True):
    for ph, pw in ((7, 7), (1, 1)):
        y = torchops.roi_align(x, rois, (ph, pw), 1.0, 0, aligned)
        y.sum().backward()
        torchops.roi_pool(x, rois, (ph, pw), 1.0).sum().backward()
# deform_roi_pool: the absurd RoIs, and absurd offsets moving a sane RoI.
sane = torch.tensor([[0, 2.0, 3.0, 30.0, 40.0]] * 4, device=device)
far = torch.tensor([1e30, -1e30, float("inf"), float("nan")], device=device)
for r, o in ((rois, torch.randn(len(rows), 2, 7, 7, device=device)),
             (sane, far[:, None, None, None].expand(4, 2, 7, 7).contiguous())):
    o.requires_grad_()
    torchops.deform_roi_pool(x, r, o, 7, 1.0, 0).sum().backward()
if device == "cuda":
    torch.cuda.synchronize()
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_absurd_rois_finish(device):
    """RoIs at 1e12 or 1e30 (or inf, NaN) with adaptive sampling: before the
    cap, one such RoI ran for minutes (1e30: no end in sight).  The limit is
    generous (a normal run takes well under a second of kernel time); it only
    separates 'bounded' from 'hangs'."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _ABSURD_ROIS, device], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and "FINISHED" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_adaptive_cap_keeps_results_of_boxes_that_fit(device):
    """The cap (2 * (H // pooled_height + 1) samples per axis) changes
    nothing for boxes up to twice the map's size, and the capped result of a
    huge box is finite."""
    x = _features((1, 3, 20, 17), device, torch.float64)
    rois = torch.tensor([[0, 0.0, 0.0, 17.0, 20.0], [0, 2.5, 0.0, 17.0, 19.0],
                         [0, -8.0, -10.0, 26.0, 30.0], [0, 0.0, 0.0, 1e12, 1e12]],
                        dtype=torch.float64, device=device)
    for ph, pw in ((1, 1), (3, 2), (7, 7)):
        for aligned in (False, True):
            got = ALIGN(x, rois, 1.0, ph, pw, 0, aligned)
            want = _roi_align_ref(x.cpu(), rois[:3].cpu(), 1.0, ph, pw, 0, aligned)
            torch.testing.assert_close(got[:3].cpu(), want)
            assert torch.isfinite(got[3]).all()


def test_sampling_ratio_limit():
    x, rois, scale = _problem(k=3)
    limit = torchops.ops.MAX_SAMPLING_RATIO
    assert limit == 64
    ALIGN(x, rois, scale, 2, 2, limit, False)  # the limit itself is allowed
    for sr in (limit + 1, 2**31 - 1):
        with pytest.raises(RuntimeError, match=r"torchops\.roi_align.*'sampling_ratio'.*at most 64"):
            torchops.roi_align(x, rois, 2, scale, sr)
        with pytest.raises(RuntimeError, match=r"torchops\._roi_align_backward.*'sampling_ratio'"):
            torch.ops.torchops._roi_align_backward(torch.ones(3, 8, 2, 2), rois, scale, 2, 2,
                                                   2, 8, 24, 20, sr, False)
        # The fake rejects it too, so compile and export fail at trace time.
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=r"'sampling_ratio'"):
            ALIGN(mode.from_tensor(x), mode.from_tensor(rois), scale, 2, 2, sr, False)


def test_wrappers_with_box_lists_compile_fullgraph():
    """The torchvision-style wrappers with a list of per-image boxes, inside
    torch.compile(fullgraph=True, dynamic=True): no graph break."""
    torch._dynamo.reset()
    x, rois, scale = _problem(k=10)
    per_image = [rois[rois[:, 0] == i, 1:] for i in range(x.shape[0])]

    def f(x, boxes):
        return (torchops.roi_align(x, boxes, (3, 2), scale, 2, True),
                torchops.roi_pool(x, boxes, 3, scale))

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for got, want in zip(compiled(x, per_image), f(x, per_image)):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------
# deform_roi_pool
# ---------------------------------------------------------------------------------

DEFORM = torch.ops.torchops.deform_roi_pool.default


def _deform_grads(x, rois, off, scale, ph, pw, sr, gamma, grad_out):
    x = x.detach().requires_grad_()
    off = None if off is None else off.detach().requires_grad_()
    DEFORM(x, rois, off, scale, ph, pw, sr, gamma).backward(grad_out)
    return x.grad, None if off is None else off.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_deform_roi_pool_without_offset_is_aligned_roi_align(device, dtype):
    """offset None (and an all-zero offset) pools exactly as roi_align with
    aligned=True, values and input gradient alike."""
    x, rois, scale = _problem(c=5, k=20, device=device, dtype=dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    for sr, (ph, pw) in ((2, (3, 4)), (0, (7, 7)), (-1, (2, 1))):
        want = ALIGN(x, rois, scale, ph, pw, sr, True)
        g = torch.randn_like(want)
        want_grad = _align_grad(x, rois, scale, ph, pw, sr, True, g)
        zero = torch.zeros(rois.shape[0], 2, ph, pw, device=device, dtype=dtype)
        for off in (None, zero):
            got = DEFORM(x, rois, off, scale, ph, pw, sr, 0.1)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            gx, goff = _deform_grads(x, rois, off, scale, ph, pw, sr, 0.1, g)
            torch.testing.assert_close(gx, want_grad, atol=tol, rtol=tol)
            assert goff is None or goff.shape == zero.shape
        with_list = torchops.deform_roi_pool(x, [rois[rois[:, 0] == i, 1:] for i in range(2)],
                                             None, (ph, pw), scale, sr)
        order = torch.cat([torch.nonzero(rois[:, 0] == i).flatten() for i in range(2)])
        torch.testing.assert_close(with_list, want[order], atol=tol, rtol=tol)


def test_deform_roi_pool_offset_moves_bins():
    """A whole-RoI shift by offset (1, 0) with gamma 0.5 moves the RoI by half
    its width: the result is that of the moved box without offset."""
    x = _features((1, 3, 16, 20), dtype=torch.float64)
    rois = torch.tensor([[0, 2.0, 3.0, 10.0, 11.0]], dtype=torch.float64)
    off = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    off[:, 0] = 1.0
    moved = rois + torch.tensor([0, 4.0, 0, 4.0, 0], dtype=torch.float64)
    torch.testing.assert_close(DEFORM(x, rois, off, 1.0, 4, 4, 2, 0.5),
                               DEFORM(x, moved, None, 1.0, 4, 4, 2, 0.5))
    off[:, 0], off[:, 1] = 0.0, -0.25  # y: a quarter of the height up, at gamma 1
    moved = rois - torch.tensor([0, 0, 2.0, 0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(DEFORM(x, rois, off, 1.0, 4, 4, 0, 1.0),
                               DEFORM(x, moved, None, 1.0, 4, 4, 0, 1.0))


def test_deform_roi_pool_offset_gradient_at_the_edges():
    """Samples clamped to the edge pixels (or outside the map) do not move
    with the offset: its gradient is exactly zero there, and elsewhere it is
    the reference's (autograd through the float64 formula)."""
    x = _features((1, 2, 6, 7), dtype=torch.float64)
    rois = torch.tensor([[0, 5.0, 4.0, 9.0, 8.0], [0, -3.0, -3.0, 2.0, 1.0]], dtype=torch.float64)
    off = torch.zeros(2, 2, 2, 2, dtype=torch.float64)
    g = torch.ones(2, 2, 2, 2, dtype=torch.float64)
    _, goff = _deform_grads(x, rois, off, 1.0, 2, 2, 1, 0.1, g)
    # Box 0's right column of bins samples x = 7.5 (past the last pixel) and
    # its bottom row y = 6.5: clamped (or outside) along that axis.
    assert torch.equal(goff[0, 0, :, 1], torch.zeros(2, dtype=torch.float64))
    assert torch.equal(goff[0, 1, 1, :], torch.zeros(2, dtype=torch.float64))
    assert goff[0, 0, 0, 0] != 0 and goff[0, 1, 0, 0] != 0
    offr = off.clone().requires_grad_()
    ref = torchops.references.deform_roi_pool(x, rois, offr, 1.0, 2, 2, 1, 0.1)
    (want,) = torch.autograd.grad(ref, offr, g)
    torch.testing.assert_close(goff, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_deform_roi_pool_forward_slopes_are_the_offset_jacobian(device, dtype):
    """_deform_roi_pool_forward (the forward when the offset needs a
    gradient) returns the op's output and, per output element, its
    derivative with respect to its bin's offset divided by the gain
    gamma * roi size: checked channel by channel against autograd through
    the float64 reference.  The backward sums grad * slopes; without slopes
    grad_offset is zeros."""
    x, rois, scale = _problem(c=3, k=12, device=device, dtype=dtype)
    off = _features((12, 2, 3, 4), device, dtype, seed=5) * 0.5
    gamma, sr = 0.2, 2
    out, slopes = torch.ops.torchops._deform_roi_pool_forward(x, rois, off, scale, 3, 4, sr, gamma)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert slopes.shape == (2, 12, 3, 3, 4) and slopes.dtype == compute
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-2)
    torch.testing.assert_close(out, DEFORM(x, rois, off, scale, 3, 4, sr, gamma),
                               atol=tol, rtol=tol)
    x64, r64 = x.double().cpu(), rois.double().cpu()
    off64 = off.double().cpu().requires_grad_()
    ref = torchops.references.deform_roi_pool(x64, r64, off64, scale, 3, 4, sr, gamma)
    gain = gamma * scale * (r64[:, 3:5] - r64[:, 1:3])  # (K, 2): gamma * (roi w, roi h)
    for c in range(3):
        (d,) = torch.autograd.grad(ref[:, c].sum(), off64, retain_graph=True)
        got = slopes[:, :, c].double().cpu() * gain.T[:, :, None, None]  # (2, K, PH, PW)
        torch.testing.assert_close(got, d.transpose(0, 1), atol=tol * 10, rtol=tol * 10)
    g = _features(out.shape, device, dtype, seed=7)
    backward = torch.ops.torchops._deform_roi_pool_backward
    gx, goff = backward(g, x, rois, off, slopes, scale, 3, 4, sr, gamma)
    gx_none, goff_none = backward(g, x, rois, off, None, scale, 3, 4, sr, gamma)
    assert torch.equal(goff_none, torch.zeros_like(goff_none))
    torch.testing.assert_close(gx_none, gx, atol=tol, rtol=tol)  # (CUDA: atomics)
    (want,) = torch.autograd.grad(ref, off64, g.double().cpu())
    torch.testing.assert_close(goff.double().cpu(), want, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_deform_roi_pool_cpu_backward_is_thread_count_independent(sampling_ratio):
    """sampling_ratio 2 takes the padded 4x4 walk, 0 mostly the sparse one,
    in the forward's slopes and the backward's scatter alike."""
    x, rois, scale = _problem(c=16, k=300, device="cpu")
    off = _features((300, 2, 4, 3), "cpu", seed=3) * 0.5
    g = _features((300, 16, 4, 3), "cpu", seed=1)
    results = at_thread_counts(
        lambda: _deform_grads(x, rois, off, scale, 4, 3, sampling_ratio, 0.2, g))
    for gx, goff in results[1:]:
        assert torch.equal(gx, results[0][0]) and torch.equal(goff, results[0][1])


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
])
def test_deform_roi_pool_autocast(device, dtype):
    x, rois, scale = _problem(k=10, device=device)
    off = _features((10, 2, 3, 3), device, seed=2)
    xl, offl = x.to(dtype), off.to(dtype)
    want = DEFORM(xl.float(), rois, offl.float(), scale, 3, 3, 2, 0.1).to(dtype)
    with torch.autocast(device, dtype=dtype):
        got = DEFORM(xl, rois, offl, scale, 3, 3, 2, 0.1)
        got_none = DEFORM(xl, rois, None, scale, 3, 3, 2, 0.1)
    assert got.dtype == dtype and got_none.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    xg, og = xl.detach().requires_grad_(), offl.detach().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        DEFORM(xg, rois, og, scale, 3, 3, 2, 0.1).float().sum().backward()
    assert xg.grad.dtype == dtype and og.grad.dtype == dtype


def test_deform_roi_pool_wrapper_compiles_fullgraph():
    torch._dynamo.reset()
    x, rois, scale = _problem(k=10)
    per_image = [rois[rois[:, 0] == i, 1:] for i in range(x.shape[0])]
    off = _features((10, 2, 3, 2), seed=4)

    def f(x, boxes, off):
        return torchops.deform_roi_pool(x, boxes, off, (3, 2), scale, 2, 0.2)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, per_image, off), f(x, per_image, off))
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sampling_ratio", [2, 0])
def test_cuda_deform_roi_pool_deterministic_backward(dtype, sampling_ratio):
    x, rois, scale = _detection_problem(dtype)
    rois[::17, 0] = 7  # invalid batch index: no output, no gradient
    k = rois.shape[0]
    off = _features((k, 2, 7, 7), "cuda", dtype, seed=4) * 0.5
    g = _features((k, x.shape[1], 7, 7), "cuda", dtype, seed=3)
    args = (rois, off, scale, 7, 7, sampling_ratio, 0.1)
    atomic = _deform_grads(x, *args, g)
    # grad_offset never uses atomics: the same bits on every run.
    assert torch.equal(_deform_grads(x, *args, g)[1], atomic[1])
    with deterministic():
        first = _deform_grads(x, *args, g)
        second = _deform_grads(x, *args, g)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3,
           torch.bfloat16: 2e-2}[dtype]
    valid = (rois[:, 0] < x.shape[0]).cpu()
    cpu = _deform_grads(x.cpu(), rois.cpu()[valid], off.cpu()[valid], *args[2:], g.cpu()[valid])
    for f, s in zip(first, second):
        assert f.dtype == dtype and torch.equal(f, s)
    v = valid.cuda()
    assert torch.equal(first[1][~v], torch.zeros_like(first[1][~v]))
    for got, want in ((first[0], atomic[0]), (first[1], atomic[1]), (first[0].cpu(), cpu[0]),
                      (first[1][v].cpu(), cpu[1])):
        scale_ = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, atol=tol * scale_, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_cuda_deform_roi_pool_matches_cpu(dtype, layout):
    x, rois, scale = _cuda_problem(dtype, layout)
    off = _features((30, 2, 4, 5), "cuda", dtype, seed=6).transpose(2, 3)  # strided
    tol = dict(atol=1e-4, rtol=1e-4) if dtype in (torch.float32, torch.float64) else \
        dict(atol=2e-2, rtol=2e-2)
    for sr, o in ((2, off), (0, off), (2, None)):
        args = (rois, o, scale, 5, 4, sr, 0.2)
        out = DEFORM(x, *args)
        cpu_args = (rois.cpu(), None if o is None else o.cpu(), *args[2:])
        torch.testing.assert_close(out.cpu(), DEFORM(x.cpu(), *cpu_args), **tol)
        g = torch.randn_like(out)
        for got, want in zip(_deform_grads(x, *args, g), _deform_grads(x.cpu(), *cpu_args, g.cpu())):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.cuda
def test_cuda_deform_roi_pool_invalid_batch_index_is_empty():
    x, rois, scale = _problem(k=8, device="cuda")
    rois[2, 0] = 5
    rois[5, 0] = float("nan")
    off = _features((8, 2, 2, 2), "cuda", seed=1)
    out = DEFORM(x, rois, off, scale, 2, 2, 2, 0.1)
    bad = torch.tensor([2, 5], device="cuda")
    assert torch.equal(out[bad], torch.zeros_like(out[bad]))
    good = torch.tensor([0, 1, 3, 4, 6, 7], device="cuda")
    torch.testing.assert_close(out[good].cpu(),
                               DEFORM(x.cpu(), rois[good].cpu(), off[good].cpu(), scale, 2, 2, 2, 0.1))
