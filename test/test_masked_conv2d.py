"""torchops.masked_conv2d beyond the op database's generic tests: what the
mask means (only selected positions are computed, a shared mask equals its
expansion), the gradients a frozen input or weight leaves, determinism
(bitwise equal runs; on CPU, equal for any thread count), and CUDA graph
capture, where the op sizes its work for every position and must then stay
right for any mask it is replayed with."""

from __future__ import annotations

import pytest
import torch

import torchops
from torchops import references

from opdb import make, random_mask

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def _args(device, dtype=torch.float64, n=2, c=4, c_out=6, h=9, w=11, density=0.4, seed=0,
          requires_grad=True):
    x = make((n, c, h, w), device, dtype, requires_grad)
    weight = make((c_out, c, 3, 3), device, dtype, requires_grad)
    bias = make((c_out,), device, dtype, requires_grad)
    mask = random_mask((n, h, w), device, density=density, seed=seed)
    return x, mask, weight, bias


def test_unselected_positions_are_not_computed():
    """A NaN the selected positions never read leaves every output finite
    (conv2d + where would compute it and then drop it)."""
    x, _, weight, bias = _args("cpu", requires_grad=False)
    x = x.clone()
    x[:, :, :3, :3] = float("nan")
    mask = torch.zeros(2, 9, 11, dtype=torch.bool)
    mask[:, 5:, 5:] = True
    out = torchops.masked_conv2d(x, mask, weight, bias, padding=1)
    assert torch.isfinite(out).all()
    assert (out[:, :, :5] == 0).all() and (out[:, :, :, :5] == 0).all()
    clean = x.nan_to_num(0.0)
    torch.testing.assert_close(out, references.masked_conv2d(clean, mask, weight, bias, [1, 1]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, needs_cuda])])
def test_shared_mask_equals_its_expansion(device):
    x, _, weight, bias = _args(device, requires_grad=False)
    shared = random_mask((1, 9, 11), device, torch.float32, seed=4)
    a = torchops.masked_conv2d(x, shared, weight, bias, padding=1)
    b = torchops.masked_conv2d(x, shared.expand(2, 9, 11).contiguous(), weight, bias, padding=1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, needs_cuda])])
@pytest.mark.parametrize("wanted", ["input", "weight", "bias", "weight_no_bias"])
def test_partial_gradients(device, wanted):
    """Only the gradients asked for are computed (the backward is told which),
    and those equal the reference's."""
    x, mask, weight, bias = _args(device)
    x.requires_grad_(wanted == "input")
    weight.requires_grad_(wanted.startswith("weight"))
    bias.requires_grad_(wanted == "bias")
    b = None if wanted == "weight_no_bias" else bias
    mask = random_mask((2, 9, 6), device, seed=5)  # the output of stride (1, 2)
    leaf = {"input": x, "bias": bias}.get(wanted, weight)
    out = torchops.masked_conv2d(x, mask, weight, b, padding=1, stride=(1, 2))
    ref = references.masked_conv2d(x, mask, weight, b, [1, 1], [1, 2])
    go = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, leaf, go)
    (want,) = torch.autograd.grad(ref, leaf, go)
    torch.testing.assert_close(got, want)


def test_cpu_result_is_independent_of_threads():
    x, mask, weight, bias = _args("cpu", torch.float32, n=3, c=8, c_out=16, h=20, w=24,
                                  density=0.3)
    prev = torch.get_num_threads()

    def run(threads):
        torch.set_num_threads(threads)
        out = torchops.masked_conv2d(x, mask, weight, bias, padding=(1, 2), dilation=(1, 2))
        return (out, *torch.autograd.grad(out, (x, weight, bias), torch.ones_like(out)))

    try:
        one, two = run(1), run(max(prev, 2))
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@cuda
@needs_cuda
def test_cuda_backward_is_deterministic():
    """Under torch.use_deterministic_algorithms(True) nothing raises and two
    runs agree bitwise (the backward has no atomics at all)."""
    x, mask, weight, bias = _args("cuda", torch.float32, n=2, c=32, c_out=32, h=40, w=48,
                                  density=0.3)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = torchops.masked_conv2d(x, mask, weight, bias, padding=1)
            runs.append((out, *torch.autograd.grad(out, (x, weight, bias),
                                                   torch.ones_like(out))))
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@cuda
@needs_cuda
def test_cuda_graph_replays_any_mask():
    """Captured, the op cannot count the selected positions (that is a sync):
    it takes all of them, so a replay with another mask is still right."""
    x, mask, weight, bias = _args("cuda", torch.float32, requires_grad=False)
    _replay_with_masks(x, mask.float(), weight, bias,
                       lambda m: torchops.masked_conv2d(x, m, weight, bias, padding=1), tol=1e-5)


def _replay_with_masks(x, mask, weight, bias, want, tol):
    """Captures the op on `mask`, then replays it with masks of other
    densities written into `mask`, each against want(mask)."""
    torchops.masked_conv2d(x, mask, weight, bias, padding=1)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torchops.masked_conv2d(x, mask, weight, bias, padding=1)
    for seed, density in ((1, 0.1), (2, 0.9), (3, 0.0)):
        mask.copy_(random_mask(mask.shape, "cuda", mask.dtype, seed=seed, density=density))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double(), want(mask).double(), rtol=tol, atol=tol)


PATH_SWITCH = "TORCHOPS_TESTING_MASKED_CONV_PATH"


DEVICES = ["cpu", pytest.param("cuda", marks=[cuda, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["sparse", "dense", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "strided_groups", "shared_float_mask"])
def test_forward_paths_match_float64(monkeypatch, device, path, dtype, case):
    """Both forwards (the sparse gather + GEMM, and the dense hand-off to the
    library's convolution -- cuDNN, oneDNN -- that high densities take, and
    the default's pick at a density above every device's threshold) against
    the float64 reference, with float32 exact (the default precision)."""
    monkeypatch.setenv(PATH_SWITCH, path)
    torch.manual_seed(3)
    n, c, c_out, h, w = 2, 8, 12, 13, 17
    stride, dilation, groups = (1, 1), (1, 1), 1
    if case == "strided_groups":
        stride, dilation, groups = (2, 1), (1, 2), 2
    x = torch.randn(n, c, h, w, device=device, dtype=torch.float64)
    weight = torch.randn(c_out, c // groups, 3, 3, device=device, dtype=torch.float64)
    bias = torch.randn(c_out, device=device, dtype=torch.float64)
    h_out = (h + 2 - dilation[0] * 2 - 1) // stride[0] + 1
    w_out = (w + 2 - dilation[1] * 2 - 1) // stride[1] + 1
    if case == "shared_float_mask":
        mask = random_mask((1, h_out, w_out), device, torch.float32, density=0.6, seed=7)
    else:
        mask = random_mask((n, h_out, w_out), device, density=0.6, seed=7)
    want = references.masked_conv2d(x, mask, weight, bias, (1, 1), stride, dilation, groups)
    got = torchops.masked_conv2d(x.to(dtype), mask, weight.to(dtype), bias.to(dtype), padding=1,
                                 stride=stride, dilation=dilation, groups=groups)
    assert got.dtype == dtype and got.is_contiguous()
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert (got[~(mask > 0).expand(n, h_out, w_out).unsqueeze(1).expand_as(got)] == 0).all()


@cuda
@needs_cuda
@pytest.mark.parametrize("density", [0.0, 0.03, 0.12, 0.125, 0.13, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_sparse_forward_on_both_sides_of_the_gather_ahead(monkeypatch, density, dtype):
    """The sparse forward gathers the columns before the host has the count
    when they fit in a buffer for an eighth of the positions, and after it
    otherwise: densities on both sides of the boundary, 0 and 1 included,
    against the float64 reference."""
    monkeypatch.setenv(PATH_SWITCH, "sparse")
    torch.manual_seed(5)
    n, c, c_out, h, w = 2, 16, 24, 16, 20
    x = torch.randn(n, c, h, w, device="cuda", dtype=torch.float64)
    weight = torch.randn(c_out, c, 3, 3, device="cuda", dtype=torch.float64)
    bias = torch.randn(c_out, device="cuda", dtype=torch.float64)
    mask = torch.zeros(n * h * w, dtype=torch.bool)
    mask[torch.randperm(n * h * w)[:round(density * n * h * w)]] = True
    mask = mask.view(n, h, w).cuda()
    want = references.masked_conv2d(x, mask, weight, bias, (1, 1), (1, 1), (1, 1), 1)
    got = torchops.masked_conv2d(x.to(dtype), mask, weight.to(dtype), bias.to(dtype), padding=1)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # The next call, with other positions, reuses no stale columns.
    got2 = torchops.masked_conv2d(x.to(dtype), mask.flip(2), weight.to(dtype), bias.to(dtype),
                                  padding=1)
    want2 = references.masked_conv2d(x, mask.flip(2), weight, bias, (1, 1), (1, 1), (1, 1), 1)
    torch.testing.assert_close(got2.double(), want2, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_path_keeps_unread_nan_out(device):
    """The dense hand-off convolves every position, but where() (not a
    product with the mask) keeps the unselected ones exactly 0, NaN inputs
    included."""
    x, _, weight, bias = _args(device, torch.float32, requires_grad=False)
    x = x.clone()
    x[:, :, :3, :3] = float("nan")
    mask = torch.zeros(2, 9, 11, dtype=torch.bool, device=device)
    mask[:, 5:, 5:] = True
    with pytest.MonkeyPatch.context() as m:
        m.setenv(PATH_SWITCH, "dense")
        out = torchops.masked_conv2d(x, mask, weight, bias, padding=1)
    assert torch.isfinite(out).all()
    assert (out[:, :, :5] == 0).all() and (out[:, :, :, :5] == 0).all()


@cuda
@needs_cuda
def test_cuda_graph_capture_with_tensor_cores_replays_any_mask():
    """bfloat16 may use tensor cores, so under capture (every position
    counted) the forward is the dense hand-off: still right for any mask."""
    x, mask, weight, bias = (t.bfloat16() if t.is_floating_point() else t
                             for t in _args("cuda", torch.float32, requires_grad=False))
    _replay_with_masks(
        x, mask, weight, bias,
        lambda m: references.masked_conv2d(x.double(), m, weight.double(), bias.double(), (1, 1)),
        tol=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_path_switch_rejects_unknown_values(monkeypatch, device):
    """The testing switch is checked: a typo raises instead of silently
    testing the default path."""
    monkeypatch.setenv(PATH_SWITCH, "fast")
    x, mask, weight, bias = _args(device, torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="TORCHOPS_TESTING_MASKED_CONV_PATH"):
        torchops.masked_conv2d(x, mask, weight, bias, padding=1)


@pytest.mark.parametrize("density", [0.9, 1.0])
def test_cpu_dense_masks_stay_sparse_and_thread_independent_when_deterministic(density):
    """On CPU a dense mask goes to oneDNN by default, whose result may depend
    on the thread count; under torch.use_deterministic_algorithms(True) the
    forward stays on the sparse path, bitwise the same at any thread count."""
    x, mask, weight, bias = _args("cpu", torch.float32, n=2, c=8, c_out=16, h=20, w=24,
                                  density=density, requires_grad=False)
    prev_threads, prev_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()

    def run(threads):
        torch.set_num_threads(threads)
        return torchops.masked_conv2d(x, mask, weight, bias, padding=1)

    try:
        torch.use_deterministic_algorithms(True)
        one, two = run(1), run(max(prev_threads, 2))
        with pytest.MonkeyPatch.context() as m:
            m.setenv(PATH_SWITCH, "sparse")
            sparse = run(1)
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det)
    assert torch.equal(one, two) and torch.equal(one, sparse)
    want = references.masked_conv2d(x.double(), mask, weight.double(), bias.double(), [1, 1])
    torch.testing.assert_close(one.double(), want, rtol=1e-4, atol=1e-4)


# --- the convolution precision rule ---------------------------------------------------------

def _flags(conv_tf32: bool, matmul_precision: str):
    """Sets PyTorch's TF32 switch for convolutions and its float32 matmul
    precision; returns a function that restores both."""
    old_conv, old_mm = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = conv_tf32
    torch.set_float32_matmul_precision(matmul_precision)

    def restore():
        torch.backends.cudnn.allow_tf32 = old_conv
        torch.set_float32_matmul_precision(old_mm)
    return restore


def _forward_and_grads(x, mask, weight, bias, dtype):
    """masked_conv2d at `dtype` (padding 1) and the gradients of input, weight
    and bias for a fixed output gradient, as float64."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, weight, bias)]
    out = torchops.masked_conv2d(leaves[0], mask, leaves[1], leaves[2], padding=1)
    go = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, go.view_as(out).to(dtype))
    return [t.double() for t in (out, *grads)]


@cuda
@needs_cuda
@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("matmul_precision", ["highest", "high"])
def test_cuda_float32_follows_the_convolution_precision_rule(monkeypatch, path,
                                                            matmul_precision):
    """masked_conv2d is a convolution: in float32 on CUDA it uses TF32 exactly
    where PyTorch lets conv2d use it (torch.backends.cudnn.allow_tf32),
    forward and backward, on both forward paths, whatever the matmul
    precision says.  With the convolution switch off every result is within
    float32 rounding of the float64 reference; with it on, within TF32's
    (and measurably not exact, so TF32 is really used)."""
    monkeypatch.setenv(PATH_SWITCH, path)
    torch.manual_seed(11)
    n, c, c_out, h, w = 2, 64, 32, 12, 14   # K = 576 products per output
    x = torch.randn(n, c, h, w, device="cuda", dtype=torch.float64)
    weight = torch.randn(c_out, c, 3, 3, device="cuda", dtype=torch.float64)
    bias = torch.randn(c_out, device="cuda", dtype=torch.float64)
    mask = random_mask((n, h, w), "cuda", density=0.5, seed=1)
    want = _forward_and_grads(x, mask, weight, bias, torch.float64)
    restore = _flags(False, matmul_precision)
    try:
        exact = _forward_and_grads(x, mask, weight, bias, torch.float32)
        torch.backends.cudnn.allow_tf32 = True
        tf32 = _forward_and_grads(x, mask, weight, bias, torch.float32)
    finally:
        restore()
    for name, e, t, r in zip(("output", "grad input", "grad weight", "grad bias"),
                             exact, tf32, want):
        scale = r.abs().max().item()
        err_exact = (e - r).abs().max().item() / scale
        err_tf32 = (t - r).abs().max().item() / scale
        # Exact float32: about 1e-6 of the largest value here; one TF32
        # product per term: a few 1e-4.
        assert err_exact < 5e-5, f"{name}: exact float32 off by {err_exact:.2e}"
        assert err_tf32 < 5e-3, f"{name}: TF32 off by {err_tf32:.2e}"
        if name != "grad bias":   # a plain sum: no product to round
            assert err_tf32 > 5e-5, f"{name}: TF32 allowed but the result is exact"


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_cpu_result_ignores_precision_flags(monkeypatch, path):
    """On CPU masked_conv2d is exact float32 whatever PyTorch's TF32 and
    matmul precision switches say: forward and gradients bitwise equal."""
    monkeypatch.setenv(PATH_SWITCH, path)
    torch.manual_seed(12)
    x = torch.randn(2, 16, 10, 12, dtype=torch.float64)
    weight = torch.randn(8, 16, 3, 3, dtype=torch.float64)
    bias = torch.randn(8, dtype=torch.float64)
    mask = random_mask((2, 10, 12), "cpu", density=0.5, seed=2)
    results = []
    for conv_tf32, precision in ((False, "highest"), (True, "highest"), (True, "high"),
                                 (False, "medium")):
        restore = _flags(conv_tf32, precision)
        try:
            results.append(_forward_and_grads(x, mask, weight, bias, torch.float32))
        finally:
            restore()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


# --- hostile inputs ---------------------------------------------------------------------------

def test_cpu_dense_hand_off_of_channels_last_input_does_not_crash(monkeypatch):
    """ATen's CPU convolution crashes on a channels-last input with a bias, a
    stride, a dilation and groups: the dense hand-off (taken from 45% of the
    positions selected) gives it contiguous operands."""
    x = torch.randn(1, 4, 5, 1).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(4, 2, 3, 1), torch.randn(4)
    m = torch.zeros(1, 7, 2)
    m.view(-1)[:7] = 1
    args = dict(padding=(2, 1), stride=(1, 2), dilation=(1, 3), groups=2)
    out = torchops.masked_conv2d(x, m, w, b, **args)
    monkeypatch.setenv(PATH_SWITCH, "sparse")
    torch.testing.assert_close(out, torchops.masked_conv2d(x, m, w, b, **args))
    want = references.masked_conv2d(x.double().contiguous(), m, w.double(), b.double(), (2, 1),
                                    (1, 2), (1, 3), 2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_dense_hand_off_fuzz(monkeypatch, device):
    """A seeded sweep of the dense hand-off against the sparse path and the
    reference: input and weight layouts (channels-last, transposed), stride,
    dilation, groups, padding, bias, masks up to every position selected.
    The failing case is printed."""
    gen = torch.Generator().manual_seed(46)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    for case in range(60):
        groups = draw(1, 3)
        c, c_out = groups * draw(1, 3), groups * draw(1, 3)
        kh, kw = draw(1, 3), draw(1, 3)
        pad, stride, dil = (draw(0, 2), draw(0, 2)), (draw(1, 3), draw(1, 3)), \
            (draw(1, 3), draw(1, 3))
        h = max(1, (kh - 1) * dil[0] + 1 - 2 * pad[0]) + draw(0, 5)
        w = max(1, (kw - 1) * dil[1] + 1 - 2 * pad[1]) + draw(0, 5)
        n = draw(1, 3)
        h_out = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
        w_out = (w + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
        density = (0.45, 0.8, 1.0)[draw(0, 2)]
        x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
        weight = torch.randn(c_out, c // groups, kh, kw, generator=gen, dtype=torch.float64)
        bias = torch.randn(c_out, generator=gen, dtype=torch.float64) if draw(0, 1) else None
        mask = torch.rand(draw(0, 1) or n, h_out, w_out, generator=gen) < density
        layouts = (("contiguous", "channels_last", "transposed")[draw(0, 2)],
                   ("contiguous", "channels_last")[draw(0, 1)])
        what = (f"case {case}: x {tuple(x.shape)} {layouts[0]}, w {tuple(weight.shape)} "
                f"{layouts[1]}, bias {bias is not None}, padding {pad}, stride {stride}, "
                f"dilation {dil}, groups {groups}, mask {tuple(mask.shape)} {density}")
        x, weight, mask = (_layout(x, layouts[0]).to(device), _layout(weight, layouts[1])
                           .to(device), mask.to(device))
        bias = bias.to(device) if bias is not None else None
        want = references.masked_conv2d(x, mask, weight, bias, pad, stride, dil, groups)
        for path in ("auto", "dense", "sparse"):
            monkeypatch.setenv(PATH_SWITCH, path)
            for dtype in (torch.float64, torch.float32):
                got = torchops.masked_conv2d(
                    x.to(dtype), mask, weight.to(dtype), None if bias is None else bias.to(dtype),
                    padding=pad, stride=stride, dilation=dil, groups=groups)
                assert got.is_contiguous(), f"{what}, {path} {dtype}: strides {got.stride()}"
                tol = 1e-10 if dtype == torch.float64 else 1e-4
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol,
                                           msg=lambda m: f"{what}, {path} {dtype}: {m}")


def _empty_input_case(device, case):
    """An input without elements that the op still convolves: no input
    channels, or a zero height (width) that only the padding makes room for.
    Returns the arguments and the output shape."""
    if case == "no_channels":
        x, weight, pad = torch.randn(2, 0, 4, 4), torch.randn(2, 0, 3, 3), (0, 0)
    elif case == "zero_height":
        x, weight, pad = torch.randn(2, 3, 0, 4), torch.randn(2, 3, 1, 3), (1, 1)
    else:
        x, weight, pad = torch.randn(2, 3, 5, 0), torch.randn(2, 3, 3, 2), (1, 1)
    h_out = x.shape[2] + 2 * pad[0] - weight.shape[2] + 1
    w_out = x.shape[3] + 2 * pad[1] - weight.shape[3] + 1
    mask = torch.rand(2, h_out, w_out, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[0, 0, 0] = True
    bias = torch.randn(2)
    return ([t.to(device) for t in (x, mask, weight, bias)], pad,
            (2, weight.shape[0], h_out, w_out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["auto", "sparse", "dense"])
@pytest.mark.parametrize("case", ["no_channels", "zero_height", "zero_width"])
def test_input_without_elements_gives_the_bias(monkeypatch, device, path, case):
    """No input channels, or a zero height or width that the padding makes
    room for: every tap reads zero padding, so the output is the bias at the
    selected positions and 0 elsewhere, of the shape the fake gives, on every
    path (ATen's convolution, which the dense hand-off would call, returns no
    output channels for the first and rejects the others); the backward gives
    zero input and weight gradients and the bias's."""
    monkeypatch.setenv(PATH_SWITCH, path)
    (x, mask, weight, bias), pad, shape = _empty_input_case(device, case)
    x.requires_grad_()
    weight.requires_grad_()
    bias.requires_grad_()
    out = torchops.masked_conv2d(x, mask, weight, bias, padding=pad)
    assert out.shape == shape and out.is_contiguous()
    sel = mask.unsqueeze(1).expand(shape)
    want = torch.where(sel, bias.detach().view(1, -1, 1, 1).expand(shape), 0.0)
    assert torch.equal(out.detach(), want)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torchops.masked_conv2d(*(mode.from_tensor(t) for t in (x, mask, weight, bias)),
                                      padding=pad)
    assert fake.shape == shape and fake.stride() == out.stride()
    go = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device)
    gx, gw, gb = torch.autograd.grad(out, (x, weight, bias), go)
    assert gx.shape == x.shape and gw.shape == weight.shape
    assert not gw.any()
    torch.testing.assert_close(gb, (go * sel).sum((0, 2, 3)))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_height_without_room_for_the_kernel_is_rejected_alike(device):
    """A zero height whose padding leaves less than the kernel: the kernel
    and the fake raise the same error, naming the op and the argument."""
    x, weight = torch.randn(2, 3, 0, 4, device=device), torch.randn(2, 3, 3, 3, device=device)
    mask = torch.ones(2, 1, 4, dtype=torch.bool, device=device)
    match = r"torchops\.masked_conv2d: the dilated kernel of 'weight'.*padded 'input'"
    with pytest.raises(RuntimeError, match=match):
        torchops.masked_conv2d(x, mask, weight, padding=(0, 1))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        with pytest.raises(RuntimeError, match=match):
            torchops.masked_conv2d(mode.from_tensor(x), mode.from_tensor(mask),
                                   mode.from_tensor(weight), padding=(0, 1))


@cuda
@needs_cuda
def test_cuda_dense_streak_never_changes_results(monkeypatch):
    """After a few dense calls of a layer the forward queues cuDNN's
    convolution before the count is known; the count still decides. A
    sparse mask after such a streak (the queued convolution unused), and
    the dense calls with and without it, give what a fresh call of the
    same path gives."""
    torch.manual_seed(13)
    x = torch.randn(2, 32, 20, 24, device="cuda")
    weight = torch.randn(48, 32, 3, 3, device="cuda") / 17
    bias = torch.randn(48, device="cuda")
    dense_mask = random_mask((2, 20, 24), "cuda", density=0.9, seed=3)
    full_mask = torch.ones(2, 20, 24, dtype=torch.bool, device="cuda")
    sparse_mask = random_mask((2, 20, 24), "cuda", density=0.05, seed=4)
    restore = _flags(True, "highest")
    try:
        def run(mask, path="auto"):
            monkeypatch.setenv(PATH_SWITCH, path)
            return torchops.masked_conv2d(x, mask, weight, bias, padding=1)

        fresh = {id(m): run(m, p) for m, p in ((dense_mask, "dense"), (full_mask, "dense"),
                                              (sparse_mask, "sparse"))}
        for mask in (sparse_mask, dense_mask, dense_mask, dense_mask, full_mask, full_mask,
                     sparse_mask, dense_mask, sparse_mask):
            got = run(mask)
            assert got.is_contiguous()
            torch.testing.assert_close(got, fresh[id(mask)], rtol=1e-6, atol=1e-6)
    finally:
        restore()
    want = references.masked_conv2d(x.double(), dense_mask, weight.double(), bias.double(),
                                    (1, 1))
    torch.testing.assert_close(fresh[id(dense_mask)].double(), want, rtol=5e-3, atol=5e-3)
