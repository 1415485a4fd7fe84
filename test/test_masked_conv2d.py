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
