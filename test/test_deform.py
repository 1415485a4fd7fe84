"""Op-specific tests of deform_conv2d (the generic ones come from its opdb
entry): torchvision's out-of-image rule with non-finite pixels, the chunked
im2col + GEMM paths, the deterministic CPU backward, and on a GPU agreement
with torchvision (values and all five gradients), the deterministic CUDA
backward, bfloat16 against float64 and CPU/CUDA agreement."""

from __future__ import annotations

import pytest
import torch

import torchops
from op_testing import deterministic
from torchops.references import deform_conv2d as _reference

OP = torch.ops.torchops.deform_conv2d.default
BACKWARD = torch.ops.torchops._deform_conv2d_backward.default
BUDGET = "TORCHOPS_TESTING_DEFORM_COLUMN_BYTES"


def _out(size, k, s, p, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _problem(n=2, c=4, h=9, w=8, o=6, k=(3, 3), stride=1, pad=1, dil=1, groups=1, og=1,
             use_mask=True, reach=6, device="cpu", dtype=torch.float64, seed=0):
    """Arguments of the dispatcher op.  Offsets up to +-`reach` pixels with
    fractional parts in [0.1, 0.9]: samples reach outside the image but never
    sit on a kink of the bilinear weights."""
    g = torch.Generator().manual_seed(seed)
    kh, kw = k
    oh, ow = _out(h, kh, stride, pad, dil), _out(w, kw, stride, pad, dil)

    def rand(*shape, lo=-1.0, hi=1.0):
        return torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo

    whole = torch.randint(-reach, reach, (n, 2 * og * kh * kw, oh, ow), generator=g)
    offset = whole + rand(n, 2 * og * kh * kw, oh, ow, lo=0.1, hi=0.9)
    mask = rand(n, og * kh * kw, oh, ow, lo=0, hi=1) if use_mask else torch.zeros(n, 1)
    ts = [rand(n, c, h, w), rand(o, c // groups, kh, kw), offset, mask, rand(o)]
    ts = [t.to(device=device, dtype=dtype) for t in ts]
    return (*ts, stride, stride, pad, pad, dil, dil, groups, og, use_mask)


def _grads(fn, args, grad):
    """Output and gradients (input, weight, offset, mask or None, bias) of
    fn(*args) for the incoming gradient `grad`."""
    ts = [t.detach().clone().requires_grad_(i != 3 or args[13]) for i, t in enumerate(args[:5])]
    out = fn(*ts, *args[5:])
    out.backward(grad)
    return [out.detach()] + [t.grad for t in ts]


# ---------------------------------------------------------------------------------
# CPU (and CUDA where noted)
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixel_stays_in_the_samples_that_read_it(device, bad):
    """Corners outside the image are skipped, not read as pixel 0 times a zero
    weight (torchvision's rule): a NaN or Inf at (0, 0) only reaches the
    outputs and gradients of samples whose bilinear corners include (0, 0)."""
    args = list(_problem(n=1, c=2, h=6, w=7, o=3, reach=3, device=device))
    x = args[0].clone()
    x[:, :, 0, 0] = bad
    args[0] = x
    grad = torch.ones(1, 3, 6, 7, dtype=torch.float64, device=device)
    got = _grads(OP, args, grad)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    want = _grads(_reference, cpu_args, grad.cpu())
    out = got[0].cpu()
    # Some outputs read (0, 0), most do not.
    assert 0 < (~out.isfinite()).sum() < out.numel() / 2
    assert torch.equal(out.isfinite(), want[0].isfinite())
    torch.testing.assert_close(out, want[0], equal_nan=True)
    for name, i in (("offset", 3), ("mask", 4)):
        g, w = got[i].cpu(), want[i]
        assert torch.equal(g.isfinite(), w.isfinite()), name
        fin = w.isfinite()
        assert fin.float().mean() > 0.5, name
        torch.testing.assert_close(g[fin], w[fin], msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_infinite_gradient_does_not_leak_into_unread_pixels(device):
    """grad_input: an infinite incoming gradient scatters only into the
    pixels its samples read (a skipped corner adds nothing, not Inf * 0)."""
    args = _problem(n=1, c=2, h=6, w=7, o=3, reach=3, device=device)
    grad = torch.zeros(1, 3, 6, 7, dtype=torch.float64, device=device)
    grad[0, :, 0, 6] = float("inf")
    gi = BACKWARD(grad, *args)[0].cpu()
    # The pixels read by output (0, 6): everything else stays finite.
    off = args[2][0, :, 0, 6].cpu().view(9, 2)
    read = torch.zeros(6, 7, dtype=torch.bool)
    for k in range(9):
        y = -1 + k // 3 + off[k, 0].item()
        x = 5 + k % 3 + off[k, 1].item()
        if -1 < y < 6 and -1 < x < 7:
            for yy in (int(y // 1), int(y // 1) + 1):
                for xx in (int(x // 1), int(x // 1) + 1):
                    if 0 <= yy < 6 and 0 <= xx < 7:
                        read[yy, xx] = True
    assert torch.equal(gi[0].isfinite().all(0), ~read)


@pytest.mark.parametrize("use_mask", [True, False])
def test_chunked_paths_match_one_chunk(monkeypatch, use_mask):
    """Images are processed in chunks bounded by the column buffer's size
    (256 MB): forced down to one image per chunk, forward and backward agree
    with the single-chunk run."""
    args = _problem(n=3, c=4, o=4, groups=2, og=2, use_mask=use_mask)
    grad = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    one = _grads(OP, args, grad)
    monkeypatch.setenv(BUDGET, "1")
    many = _grads(OP, args, grad)
    for a, b in zip(one, many):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_cpu_backward_is_reproducible():
    args = _problem(n=2, c=8, o=4, og=2, reach=2, dtype=torch.float32)
    grad = torch.randn(2, 4, 9, 8)
    first, second = BACKWARD(grad, *args), BACKWARD(grad, *args)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_wrapper_without_mask_compiles_and_exports():
    """mask=None (DCNv1) and bias=None: the wrapper makes their stand-ins
    itself (the mask left uninitialised, never read); under
    torch.compile(fullgraph=True, dynamic=True) at three sizes and through
    torch.export it equals eager, gradients included."""
    w = torch.randn(3, 4, 3, 3, requires_grad=True)

    def f(x, off, w):
        return torchops.deform_conv2d(x, off, w, padding=1)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for n, h, wd in ((2, 7, 8), (3, 9, 6), (1, 5, 11)):
        x = torch.randn(n, 4, h, wd, requires_grad=True)
        off = torch.randn(n, 18, h, wd, requires_grad=True)
        want, got = f(x, off, w), compiled(x, off, w)
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (x, off, w), g),
                        torch.autograd.grad(want, (x, off, w), g)):
            torch.testing.assert_close(a, b)

    class Module(torch.nn.Module):
        def forward(self, x, off, w):
            return f(x, off, w)

    x, off = torch.randn(2, 4, 7, 8), torch.randn(2, 18, 7, 8)
    program = torch.export.export(Module(), (x, off, w.detach()))
    torch.testing.assert_close(program.module()(x, off, w.detach()), f(x, off, w.detach()))


def test_wrapper_infers_groups_and_defaults():
    x, w, off, mask, b, *_ = _problem(c=4, o=6, groups=2, og=2, k=(3, 2), stride=2, pad=1, dil=2)
    got = torchops.deform_conv2d(x, off, w, b, stride=2, padding=1, dilation=2, mask=mask)
    want = OP(x, w, off, mask, b, 2, 2, 1, 1, 2, 2, 2, 2, True)
    assert torch.equal(got, want)
    no_bias = torchops.deform_conv2d(x, off, w, stride=(2, 2), padding=(1, 1), dilation=2)
    torch.testing.assert_close(
        no_bias, OP(x, w, off, torch.zeros(2, 1, dtype=x.dtype), torch.zeros_like(b),
                    2, 2, 1, 1, 2, 2, 2, 2, False))


# ---------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------

# name, problem keywords: offsets reaching outside, masks on and off, groups,
# offset groups, strides and dilations.
TV_CASES = [
    ("mask", dict(use_mask=True)),
    ("no_mask", dict(use_mask=False)),
    ("groups2", dict(c=4, o=6, groups=2, use_mask=True)),
    ("offset_groups2", dict(c=4, og=2, use_mask=False)),
    ("groups2_og2", dict(c=8, o=4, groups=2, og=2, use_mask=True)),
    ("stride2_dil2", dict(h=13, w=12, stride=2, dil=2, pad=2, use_mask=True)),
    ("stride2_kernel32", dict(h=11, w=10, k=(3, 2), stride=2, pad=1, use_mask=False)),
]


INPUT_GRAD = "TORCHOPS_TESTING_DEFORM_INPUT_GRAD"


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["atomic", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,kw", TV_CASES, ids=[c[0] for c in TV_CASES])
def test_cuda_matches_torchvision(name, kw, dtype, path, monkeypatch):
    """Both input-gradient paths (the atomic scatter and the sorted gather,
    forced by the testing switch) against torchvision."""
    monkeypatch.setenv(INPUT_GRAD, path)
    tv = pytest.importorskip("torchvision")
    kw = dict(kw)
    args = _problem(n=3, c=kw.pop("c", 6), device="cuda", dtype=dtype, seed=1, **kw)
    x, w, off, mask, b, sh, _, ph, _, dh, _, _, _, use_mask = args

    def torchvision_op(x, w, off, mask, b, *_):
        return tv.ops.deform_conv2d(x, off, w, b, (sh, sh), (ph, ph), (dh, dh),
                                    mask if use_mask else None)

    grad = torch.randn(OP(*args).shape, device="cuda", dtype=dtype)
    got = _grads(OP, args, grad)
    want = _grads(torchvision_op, args, grad)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for what, g, t in zip(("output", "input", "weight", "offset", "mask", "bias"), got, want):
        if t is None:
            assert not use_mask and what == "mask"
            continue
        scale = max(1.0, t.abs().max().item())
        torch.testing.assert_close(g, t, atol=tol * scale, rtol=tol, msg=what)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cuda_deterministic_backward_is_bitwise_reproducible(dtype, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the input gradient is
    gathered from sorted contributions instead of scattered with atomics,
    and the GEMMs are torchops.matmul's: bitwise equal over runs, close to
    the default (atomic, cuBLAS) backward, and no CUBLAS_WORKSPACE_CONFIG
    needed (cuBLAS would raise without it in this mode)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args = _problem(n=4, c=32, h=24, w=20, o=16, og=2, reach=3, device="cuda",
                    dtype=dtype, seed=3)
    grad = torch.randn(4, 16, 24, 20, device="cuda", dtype=dtype)
    atomic = BACKWARD(grad, *args)
    with deterministic():
        first = BACKWARD(grad, *args)
        second = BACKWARD(grad, *args)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "not bitwise equal"
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    for a, b in zip(first, atomic):
        assert a.dtype == dtype
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, atol=tol * scale, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_gather_is_the_default_with_many_channels_per_offset_group(dtype, monkeypatch):
    """With 128 or more channels per offset group the default backward
    gathers grad_input (bitwise the forced gather's, so reproducible); the
    atomic scatter agrees with it; a bad switch value is a RuntimeError."""
    args = _problem(n=2, c=128, h=9, w=8, o=8, og=1, reach=3, device="cuda",
                    dtype=dtype, seed=7)
    grad = torch.randn(2, 8, 9, 8, device="cuda", dtype=dtype)
    default = BACKWARD(grad, *args)
    monkeypatch.setenv(INPUT_GRAD, "gather")
    gathered = BACKWARD(grad, *args)
    assert torch.equal(default[0], gathered[0])
    monkeypatch.setenv(INPUT_GRAD, "atomic")
    scattered = BACKWARD(grad, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = max(1.0, gathered[0].abs().max().item())
    torch.testing.assert_close(scattered[0], gathered[0], atol=tol * scale, rtol=tol)
    monkeypatch.setenv(INPUT_GRAD, "sideways")
    with pytest.raises(RuntimeError, match=INPUT_GRAD):
        BACKWARD(grad, *args)


@pytest.mark.cuda
@pytest.mark.parametrize("conv_tf32", [True, False], ids=["3xtf32", "exact"])
@pytest.mark.parametrize("budget", [None, "1"], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("hw", [12, 13], ids=["pixels_4k", "pixels_odd"])
def test_cuda_float32_gemms_keep_float32_accuracy(conv_tf32, budget, hw, monkeypatch):
    """Where every GEMM dimension is 256 or more, float32 GEMMs run as three
    TF32 products while convolutions may use TF32 (PyTorch's default), else
    exactly: either way, output and gradients within float32-sized error
    of the float64 op on the same inputs (one TF32 product would be ~3e-4),
    in one chunk of images or several.  On Hopper the forward splits in the
    kernel where the pixel count suits TMA (12 x 12) and on pre-split
    columns where it does not (13 x 13)."""
    if budget is not None:
        monkeypatch.setenv(BUDGET, budget)
    args64 = _problem(n=2, c=32, h=hw, w=hw, o=256, reach=3, device="cuda", seed=8)
    args32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args64]
    grad = torch.randn(2, 256, hw, hw, device="cuda", dtype=torch.float64)
    want = _grads(OP, args64, grad)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=conv_tf32):
        got = _grads(OP, args32, grad.float())
    for what, g, t in zip(("output", "input", "weight", "offset", "mask", "bias"), got, want):
        assert g.dtype == torch.float32, what
        err = (g.double() - t).abs().max().item() / t.abs().max().item()
        # offset's gradient differences neighbouring pixels: cancellation
        limit = 1e-4 if what == "offset" else 1e-5
        assert err < limit, (what, err)


@pytest.mark.cuda
@pytest.mark.parametrize("o,k,c", [(64, (3, 3), 16), (7, (3, 3), 5), (5, (2, 2), 1)],
                         ids=["folded", "folded_odd", "four_rows"])
@pytest.mark.parametrize("budget", [None, "1"], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("use_mask", [True, False])
def test_cuda_float32_forward_with_the_bias_folded_in(o, k, c, budget, use_mask, monkeypatch):
    """With one weight group and fewer than 256 output channels the float32
    forward folds the bias into its GEMM (a row of ones under the columns):
    the output, images batched or one per chunk, is the float64 op's within
    float32 error.  C * kh * kw = 4 is the size where folded and split
    column counts would coincide; it does not fold and must be right too."""
    if budget is not None:
        monkeypatch.setenv(BUDGET, budget)
    args64 = _problem(n=3, c=c, h=11, w=10, o=o, k=k, use_mask=use_mask, reach=3,
                      device="cuda", seed=11)
    args32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args64]
    want = OP(*args64)
    got = OP(*args32)
    assert got.dtype == torch.float32 and got.is_contiguous()
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-5, err


@pytest.mark.cuda
@pytest.mark.parametrize("o,c,h,w", [(64, 32, 12, 12), (64, 64, 12, 12), (70, 30, 16, 18),
                                     (64, 32, 13, 11)],
                         ids=["one_tile", "split_k", "odd_channels", "pixels_not_4"])
@pytest.mark.parametrize("budget", [None, "1"], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("use_mask", [True, False])
def test_cuda_float32_forward_3xtf32_in_kernel(o, c, h, w, budget, use_mask, monkeypatch):
    """Layers with C * kh * kw >= 256 that do not split their columns (fewer
    than 256 output channels) run the float32 forward GEMM as 3xTF32 split
    in the kernel on Hopper while convolutions may use TF32 (exact float32
    elsewhere, and where the pixel count does not suit TMA): float32-sized
    error against float64 either way, bitwise reproducible (also under
    deterministic algorithms, split-K included), and on Hopper not the exact
    path's bits (so the 3xTF32 kernel is what ran)."""
    if budget is not None:
        monkeypatch.setenv(BUDGET, budget)
    args64 = _problem(n=2, c=c, h=h, w=w, o=o, use_mask=use_mask, reach=3, device="cuda",
                      seed=12)
    args32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args64]
    want = OP(*args64)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        exact = OP(*args32)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        got = OP(*args32)
        with deterministic():
            det = [OP(*args32) for _ in range(2)]
    for out in (exact, got, det[0]):
        assert out.dtype == torch.float32 and out.is_contiguous()
        err = (out.double() - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, err
    assert torch.equal(det[0], det[1])
    in_kernel = torch.cuda.get_device_capability() == (9, 0) and (h * w) % 4 == 0
    assert torch.equal(got, exact) != in_kernel
    if in_kernel:
        assert torch.equal(got, det[0])  # the same kernel, deterministic anyway


@pytest.mark.cuda
def test_cuda_deterministic_backward_chunked(monkeypatch):
    """The multi-chunk deterministic path equals the CPU backward (float64)."""
    monkeypatch.setenv(BUDGET, "1")
    args = _problem(n=3, c=6, o=4, groups=2, og=3, device="cuda", seed=4)
    grad = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    with deterministic():
        got = BACKWARD(grad.cuda(), *args)
    cpu = BACKWARD(grad, *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    for a, b in zip(got, cpu):
        torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("use_mask", [True, False])
def test_cuda_bfloat16_against_float64(use_mask):
    """bf16 columns and GEMMs with float32 accumulation: within bf16's
    rounding of the float64 result, for the value and every gradient."""
    args16 = _problem(n=2, c=16, h=12, w=11, o=8, og=2, use_mask=use_mask, reach=3,
                      device="cuda", dtype=torch.bfloat16, seed=5)
    # The reference sees the same (bf16-rounded) inputs: only the kernel's
    # own rounding is measured.
    args64 = [a.double() if isinstance(a, torch.Tensor) else a for a in args16]
    grad = torch.randn(2, 8, 12, 11, device="cuda", dtype=torch.float64)
    want = _grads(OP, args64, grad)
    got = _grads(OP, args16, grad.bfloat16())
    for what, g, t in zip(("output", "input", "weight", "offset", "mask", "bias"), got, want):
        if t is None:
            continue
        assert g.dtype == torch.bfloat16, what
        err = (g.double() - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
        assert err < 3e-2, (what, err)


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, "1"])
def test_cuda_matches_cpu_channels_last_and_chunks(monkeypatch, budget):
    if budget is not None:
        monkeypatch.setenv(BUDGET, budget)
    args = list(_problem(n=3, c=8, h=10, w=9, o=6, groups=2, og=4, device="cuda", seed=6))
    args[0] = args[0].to(memory_format=torch.channels_last)
    grad = torch.randn(3, 6, 10, 9, device="cuda", dtype=torch.float64)
    got = _grads(OP, args, grad)
    cpu = _grads(OP, [a.cpu() if isinstance(a, torch.Tensor) else a for a in args], grad.cpu())
    for g, c in zip(got, cpu):
        torch.testing.assert_close(g.cpu(), c, atol=1e-10, rtol=1e-10)
