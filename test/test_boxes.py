"""Op-specific tests of the box ops (nms, batched_nms, box_iou): threshold
ties, determinism, gradients at the formula's kinks, autocast, compile and
export with data-dependent sizes, and -- on a GPU -- equality with
torchvision and with the CPU kernels."""

from __future__ import annotations

import pytest
import torch

import torchops
from opdb import make_boxes, make_scores
from torchops import references

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CUDA = [pytest.param("cuda", marks=pytest.mark.cuda)]
DEVICES = ["cpu", *CUDA]


def _t(rows, device, dtype=torch.float32):
    return torch.tensor(rows, device=device, dtype=torch.float64).to(dtype)


def _random_boxes(n, device, dtype=torch.float32, scale=1000.0, max_wh=100.0, gen=None):
    """Continuous random boxes, like detection benchmarks use."""
    xy = torch.rand(n, 2, generator=gen, dtype=torch.float64) * scale
    wh = torch.rand(n, 2, generator=gen, dtype=torch.float64) * max_wh + 1
    return torch.cat([xy, xy + wh], 1).to(device=device, dtype=dtype)


def _distinct_scores(n, device, dtype=torch.float32, gen=None):
    # Distinct in float32 (and exactly representable): no tie for a sort to break.
    return (torch.randperm(n, generator=gen).to(torch.float64) / max(n, 1)).to(device=device, dtype=dtype)


# --- nms: semantics ------------------------------------------------------------------

# Pairs (big box, small box inside it) with IoU exactly 3/10, 1/2 and 7/10.
_EXACT = {0.3: [[0, 0, 10, 1], [0, 0, 3, 1]],
          0.5: [[0, 0, 2, 1], [0, 0, 1, 1]],
          0.7: [[0, 0, 10, 1], [0, 0, 7, 1]]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("iou", sorted(_EXACT))
def test_nms_iou_equal_to_threshold_does_not_suppress(device, dtype, iou):
    boxes = _t(_EXACT[iou], device, dtype)
    scores = _t([0.9, 0.8], device, dtype)
    assert torchops.nms(boxes, scores, iou).tolist() == [0, 1]
    # Just below the threshold the small box goes (also in bfloat16: the
    # threshold is compared in the op math type, float32).
    assert torchops.nms(boxes, scores, iou - 1e-6).tolist() == [0]
    assert torchops.nms(boxes, scores, iou + 1e-6).tolist() == [0, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_iou_just_around_threshold(device):
    eps = 2.0 ** -20  # representable next to 1 in float32
    big = [0.0, 0.0, 2.0, 1.0]
    for width, kept in ((1.0 + eps, [0]), (1.0 - eps, [0, 1])):  # IoU = width / 2
        boxes = _t([big, [0.0, 0.0, width, 1.0]], device)
        assert torchops.nms(boxes, _t([0.9, 0.8], device), 0.5).tolist() == kept


@pytest.mark.parametrize("device", DEVICES)
def test_nms_only_kept_boxes_suppress(device):
    # IoU(0, 1) = IoU(1, 2) = 1/3, IoU(0, 2) = 0: 0 suppresses 1; 1 would
    # suppress 2, but 1 is gone, so 2 stays.
    boxes = _t([[0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10]], device)
    scores = _t([0.9, 0.8, 0.7], device)
    assert torchops.nms(boxes, scores, 0.3).tolist() == [0, 2]
    assert torchops.nms(boxes, scores, 0.4).tolist() == [0, 1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_equal_scores_keep_input_order(device):
    # 130 identical boxes (several 64-box blocks), identical scores: the stable
    # sort keeps the first; disjoint boxes come out in input order.
    box = _t([[1, 1, 5, 5]], device).expand(130, 4).contiguous()
    scores = torch.full((130,), 0.5, device=device)
    assert torchops.nms(box, scores, 0.5).tolist() == [0]
    disjoint = torch.arange(130, device=device, dtype=torch.float32)[:, None] * 10
    disjoint = torch.cat([disjoint, disjoint * 0, disjoint + 5, disjoint * 0 + 5], 1)
    assert torchops.nms(disjoint, scores, 0.5).tolist() == list(range(130))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 500])
@pytest.mark.parametrize("thr", [0.3, 0.5, 0.7])
def test_nms_random_vs_reference_float64(device, n, thr):
    # float64: the kernel evaluates the reference's formula in the same
    # precision, so even continuous random boxes agree exactly.
    gen = torch.Generator().manual_seed(n * 10 + int(thr * 10))
    boxes = _random_boxes(n, device, torch.float64, scale=300.0, max_wh=80.0, gen=gen)
    scores = torch.rand(n, generator=gen, dtype=torch.float64).to(device)
    keep = torchops.nms(boxes, scores, thr)
    assert keep.dtype == torch.int64 and keep.device == boxes.device
    torch.testing.assert_close(keep.cpu(), references.nms(boxes.cpu(), scores.cpu(), thr), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_nms_empty_and_single(device):
    for dtype in FLOATS:
        keep = torchops.nms(torch.empty(0, 4, device=device, dtype=dtype),
                            torch.empty(0, device=device, dtype=dtype), 0.5)
        assert keep.shape == (0,) and keep.dtype == torch.int64
        keep = torchops.batched_nms(torch.empty(0, 4, device=device, dtype=dtype),
                                    torch.empty(0, device=device, dtype=dtype),
                                    torch.empty(0, device=device, dtype=torch.int64), 0.5)
        assert keep.shape == (0,) and keep.dtype == torch.int64
        one = _t([[0, 0, 1, 1]], device, dtype)
        assert torchops.nms(one, _t([0.3], device, dtype), 0.5).tolist() == [0]


def test_cpu_nms_result_does_not_depend_on_thread_count():
    # CPU only: torch.set_num_threads changes nothing in a CUDA kernel.
    gen = torch.Generator().manual_seed(0)
    boxes = _random_boxes(3000, "cpu", gen=gen)
    scores = _distinct_scores(3000, "cpu", gen=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torchops.nms(boxes, scores, 0.5)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(torchops.nms(boxes, scores, 0.5), one, rtol=0, atol=0)


# --- batched_nms ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_batched_nms_is_nms_per_category(device):
    gen = torch.Generator().manual_seed(1)
    n = 400
    boxes = make_boxes(n, "cpu", torch.float32, cells=20).to(device)
    scores = _distinct_scores(n, device, gen=gen)
    idxs = torch.randint(-2, 3, (n,), generator=gen).to(device)
    keep = torchops.batched_nms(boxes, scores, idxs, 0.5)
    expected = []
    for c in idxs.unique().tolist():
        where = torch.nonzero(idxs == c).flatten()
        expected += where[torchops.nms(boxes[where], scores[where], 0.5)].tolist()
    expected = torch.tensor(expected, dtype=torch.int64)
    expected = expected[torch.sort(scores.cpu()[expected], descending=True, stable=True).indices]
    assert keep.cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_batched_nms_negative_coordinates_and_huge_categories(device):
    # torchvision's coordinate-offset trick needs non-negative boxes; the
    # category test in the kernel does not care.
    boxes = _t([[-100, -100, -50, -50], [-100, -100, -50, -50], [-100, -100, -51, -50]], device)
    scores = _t([0.9, 0.8, 0.7], device)
    idxs = torch.tensor([2**62, -(2**62), 2**62], device=device)
    assert torchops.batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 1]


# --- box_iou ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_box_iou_continuous_random(device, dtype):
    gen = torch.Generator().manual_seed(2)
    b1 = _random_boxes(37, device, dtype, scale=100.0, max_wh=60.0, gen=gen)
    b2 = _random_boxes(300, device, dtype, scale=100.0, max_wh=60.0, gen=gen)
    got = torchops.box_iou(b1, b2)
    assert got.dtype == dtype and got.shape == (37, 300)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(got.double(), references.box_iou(b1.double(), b2.double()),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_box_iou_integer_boxes(device, dtype):
    """Pixel boxes in integers, as torchvision takes them: exact IoUs (the
    areas and intersections are integers) in the default float dtype."""
    gen = torch.Generator().manual_seed(3)
    xy = torch.randint(0, 1000, (40, 2), generator=gen)
    wh = torch.randint(0, 200, (40, 2), generator=gen)
    boxes = torch.cat([xy, xy + wh], 1).to(device=device, dtype=dtype)
    b1, b2 = boxes[:13], boxes[13:]
    got = torchops.box_iou(b1, b2)
    assert got.dtype == torch.get_default_dtype() and got.shape == (13, 27)
    want = references.box_iou(b1.double(), b2.double()).to(got.dtype)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    fn = torch.compile(torchops.box_iou, fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(b1, b2), got, atol=0, rtol=0)

    class Iou(torch.nn.Module):
        def forward(self, x, y):
            return torchops.box_iou(x, y)

    program = torch.export.export(Iou(), (b1, b2))
    torch.testing.assert_close(program.module()(b1, b2), got, atol=0, rtol=0)


def _tie_boxes(device):
    # Identical boxes, shared edges, touching (zero-width overlap), nested,
    # disjoint: every kink of max/min/clamp.
    return _t([[0, 0, 2, 2], [0, 0, 2, 2], [1, 0, 3, 2], [2, 0, 4, 2], [0, 0, 1, 1],
               [0.5, 0.5, 1.5, 1.5], [5, 5, 6, 7]], device, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_box_iou_grad_at_ties_matches_autograd_of_reference(device):
    b = _tie_boxes(device)
    g = torch.randn(len(b), len(b), dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    x1, x2 = b.clone().requires_grad_(), b.clone().requires_grad_()
    got = torch.autograd.grad(torchops.box_iou(x1, x2), (x1, x2), g)
    r1, r2 = b.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.autograd.grad(references.box_iou(r1, r2), (r1, r2), g)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-12, rtol=1e-12)
    # The same tensor for both arguments: the two gradients add up.
    x = b.clone().requires_grad_()
    r = b.clone().requires_grad_()
    torch.testing.assert_close(torch.autograd.grad(torchops.box_iou(x, x), x, g)[0],
                               torch.autograd.grad(references.box_iou(r, r), r, g)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_box_iou_gradcheck_large_and_lopsided(device):
    # Wide and tall matrices exercise the chunked reductions of the kernels.
    for n, m in ((1, 700), (300, 2)):
        b1 = make_boxes(n, device, torch.float64, True, cells=12, step=0.25, offset=1 / 16, max_size=16)
        b2 = make_boxes(m, device, torch.float64, True, cells=12, step=0.25, offset=3 / 16, max_size=16)
        assert torch.autograd.gradcheck(torchops.box_iou, (b1, b2), fast_mode=True)


# --- autocast, compile, export ---------------------------------------------------------


class _SeenDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtypes the torchops kernels receive (below autocast)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "torchops":
            self.seen.append((func.__name__.split(".")[0], args[0].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_upcasts_nms_inputs(device):
    low = torch.bfloat16 if device == "cpu" else torch.float16
    boxes = make_boxes(50, device, low)
    scores = make_scores(50, device, low)
    idxs = torch.randint(0, 3, (50,), device=device)
    with torch.autocast(device, dtype=low), _SeenDtypes() as mode:
        keep = torchops.nms(boxes, scores, 0.5)
        bkeep = torchops.batched_nms(boxes, scores, idxs, 0.5)
    assert mode.seen == [("nms", torch.float32), ("batched_nms", torch.float32)]
    assert keep.tolist() == torchops.nms(boxes.float(), scores.float(), 0.5).tolist()
    assert bkeep.tolist() == torchops.batched_nms(boxes.float(), scores.float(), idxs, 0.5).tolist()


def _detector_tail(boxes, scores, idxs):
    keep = torchops.batched_nms(boxes, scores, idxs, 0.5)
    kept = boxes[keep]
    return kept, scores[keep], torchops.box_iou(kept, boxes).amax(1)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic(device):
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        fn = torch.compile(_detector_tail, fullgraph=True, dynamic=True)
        nms = torch.compile(torchops.nms, fullgraph=True, dynamic=True)
        for n in (120, 37):
            boxes = make_boxes(n, device, torch.float32, cells=10)
            scores = make_scores(n, device, torch.float32)
            idxs = torch.randint(0, 3, (n,), device=device)
            for got, want in zip(fn(boxes, scores, idxs), _detector_tail(boxes, scores, idxs)):
                torch.testing.assert_close(got, want)
            keep = nms(boxes, scores, 0.5)
            assert keep.tolist() == torchops.nms(boxes, scores, 0.5).tolist()


class _Tail(torch.nn.Module):
    def forward(self, boxes, scores, idxs):
        return _detector_tail(boxes, scores, idxs)


def test_export_dynamic_number_of_boxes():
    n = torch.export.Dim("n")
    boxes = make_boxes(90, "cpu", torch.float32, cells=10)
    scores, idxs = make_scores(90, "cpu", torch.float32), torch.randint(0, 3, (90,))
    ep = torch.export.export(_Tail(), (boxes, scores, idxs), dynamic_shapes=({0: n}, {0: n}, {0: n}))
    for m in (90, 41):
        boxes = make_boxes(m, "cpu", torch.float32, cells=10)
        scores, idxs = make_scores(m, "cpu", torch.float32), torch.randint(0, 3, (m,))
        for got, want in zip(ep.module()(boxes, scores, idxs), _detector_tail(boxes, scores, idxs)):
            torch.testing.assert_close(got, want)


# --- GPU: torchvision equivalence, CPU agreement -------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 1, 1000, 20000])
@pytest.mark.parametrize("thr", [0.3, 0.5, 0.7])
def test_cuda_nms_matches_torchvision(n, thr):
    tv = pytest.importorskip("torchvision")
    gen = torch.Generator().manual_seed(n + int(thr * 10))
    # Continuous boxes: torchops evaluates torchvision's IoU expression in the
    # same order, so even near-threshold pairs agree.  And integer boxes,
    # whose IoUs are exact in both.
    cont = _random_boxes(n, "cuda", gen=gen)
    grid = _random_boxes(n, "cuda", gen=gen).round()
    scores = _distinct_scores(n, "cuda", gen=gen)
    for boxes in (cont, grid):
        keep = torchops.nms(boxes, scores, thr)
        assert keep.dtype == torch.int64 and keep.is_cuda
        torch.testing.assert_close(keep, tv.ops.nms(boxes, scores, thr), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 1, 1000, 20000])
@pytest.mark.parametrize("thr", [0.3, 0.5, 0.7])
def test_cuda_batched_nms_matches_torchvision(n, thr):
    tv = pytest.importorskip("torchvision")
    gen = torch.Generator().manual_seed(n + 7)
    # Integer coordinates: torchvision's coordinate-offset trick (used below
    # 5000 boxes on GPU) then changes no IoU.
    boxes = _random_boxes(n, "cuda", gen=gen).round()
    scores = _distinct_scores(n, "cuda", gen=gen)
    idxs = torch.randint(0, 10, (n,), generator=gen).cuda()
    torch.testing.assert_close(torchops.batched_nms(boxes, scores, idxs, thr),
                               tv.ops.batched_nms(boxes, scores, idxs, thr), rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_box_iou_matches_torchvision():
    tv = pytest.importorskip("torchvision")
    gen = torch.Generator().manual_seed(5)
    b1 = _random_boxes(300, "cuda", gen=gen)
    b2 = _random_boxes(1000, "cuda", gen=gen)
    torch.testing.assert_close(torchops.box_iou(b1, b2), tv.ops.box_iou(b1, b2), atol=1e-6, rtol=1e-5)
    x1, x2 = b1.clone().requires_grad_(), b2.clone().requires_grad_()
    y1, y2 = b1.clone().requires_grad_(), b2.clone().requires_grad_()
    g = torch.randn(300, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    got = torch.autograd.grad(torchops.box_iou(x1, x2), (x1, x2), g)
    want = torch.autograd.grad(tv.ops.box_iou(y1, y2), (y1, y2), g)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_agrees_with_cpu(dtype):
    gen = torch.Generator().manual_seed(6)
    for n, cells in ((3000, 40), (5000, 400)):  # crowded, sparse
        boxes = make_boxes(n, "cpu", dtype, cells=cells, max_size=30)
        scores = make_scores(n, "cpu", dtype)
        idxs = torch.randint(0, 5, (n,), generator=gen)
        for thr in (0.3, 0.5, 0.7):
            assert torchops.nms(boxes.cuda(), scores.cuda(), thr).tolist() == \
                torchops.nms(boxes, scores, thr).tolist()
            assert torchops.batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), thr).tolist() == \
                torchops.batched_nms(boxes, scores, idxs, thr).tolist()
    b1 = make_boxes(200, "cpu", dtype, True, cells=12, step=0.25, offset=1 / 16, max_size=16)
    b2 = make_boxes(333, "cpu", dtype, True, cells=12, step=0.25, offset=3 / 16, max_size=16)
    c1, c2 = b1.detach().cuda().requires_grad_(), b2.detach().cuda().requires_grad_()
    tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(torchops.box_iou(c1, c2).cpu(), torchops.box_iou(b1, b2), atol=tol, rtol=tol)
    g = torch.randn(200, 333, generator=gen).to(dtype)
    for a, w in zip(torch.autograd.grad(torchops.box_iou(c1, c2), (c1, c2), g.cuda()),
                    torch.autograd.grad(torchops.box_iou(b1, b2), (b1, b2), g)):
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(a.cpu().double(), w.double(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nms_padded_is_nms_then_minus_one(device, dtype):
    for n, cells in ((0, 4), (1, 4), (300, 20), (2048, 60), (2049, 60)):
        boxes = make_boxes(n, device, dtype, cells=cells, max_size=12)
        scores = make_scores(n, device, dtype)
        idxs = torch.randint(0, 3, (n,), device=device)
        for extra, want in (((), torchops.nms(boxes, scores, 0.5)),
                            ((idxs,), torchops.batched_nms(boxes, scores, idxs, 0.5))):
            keep, num = torchops.nms_padded(boxes, scores, 0.5, *extra)
            assert keep.shape == (n,) and keep.dtype == torch.int64
            assert num.shape == () and num.dtype == torch.int64 and num.device == boxes.device
            k = int(num)
            assert keep[:k].tolist() == want.tolist()
            assert (keep[k:] == -1).all()


@pytest.mark.cuda
@pytest.mark.parametrize("n", [64, 1000, 2048, 2049])
def test_cuda_single_launch_limit_agrees_with_cpu(n):
    # Up to 2048 boxes one launch sorts the scores in shared memory, above
    # that ATen's sort does: either way the order is the CPU's stable sort,
    # with ties, NaN (above everything), -0 = +0 and inf.
    gen = torch.Generator().manual_seed(n)
    boxes = make_boxes(n, "cpu", torch.float32, cells=30, max_size=12)
    scores = torch.randint(0, 7, (n,), generator=gen).float() / 6
    scores[::97] = float("nan")
    scores[5::31] = -0.0
    scores[7::37] = 0.0
    scores[11::89] = float("inf")
    idxs = torch.randint(0, 3, (n,), generator=gen)
    for thr in (0.3, 0.6):
        assert torchops.nms(boxes.cuda(), scores.cuda(), thr).tolist() == \
            torchops.nms(boxes, scores, thr).tolist()
        assert torchops.batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), thr).tolist() == \
            torchops.batched_nms(boxes, scores, idxs, thr).tolist()
        for got, want in zip(torchops.nms_padded(boxes.cuda(), scores.cuda(), thr, idxs.cuda()),
                             torchops.nms_padded(boxes, scores, thr, idxs)):
            assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
def test_cuda_nms_many_boxes_global_memory_path():
    # 400k boxes: the resolution keeps its `removed` words in global memory
    # (more than 6000 blocks of 64); crowded, so the CPU check is quick.
    n = 400_000
    boxes = make_boxes(n, "cpu", torch.float32, cells=300, max_size=60)
    scores = _distinct_scores(n, "cpu")
    keep = torchops.nms(boxes.cuda(), scores.cuda(), 0.5)
    assert keep.cpu().tolist() == torchops.nms(boxes, scores, 0.5).tolist()


@pytest.mark.cuda
def test_cuda_nms_on_side_stream_and_second_device():
    boxes = make_boxes(500, "cuda", torch.float32, cells=30)
    scores = make_scores(500, "cuda", torch.float32)
    want = torchops.nms(boxes, scores, 0.5)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = torchops.nms(boxes, scores, 0.5)
    s.synchronize()
    torch.testing.assert_close(got, want)
    if torch.cuda.device_count() > 1:
        got = torchops.nms(boxes.to("cuda:1"), scores.to("cuda:1"), 0.5)
        assert got.device == torch.device("cuda:1")
        torch.testing.assert_close(got.cpu(), want.cpu())
