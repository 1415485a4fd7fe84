"""Op-specific tests of the rotated-box ops (box_iou_rotated, nms_rotated,
batched_nms_rotated) and soft_nms: known areas, axis-aligned boxes against
box_iou, the 90-degree and rotation symmetries, precision far from the
origin, exact ties and zero-area boxes, soft_nms against mmcv's loop, and --
where the installed torchvision has them -- equality with torchvision's
rotated ops."""

from __future__ import annotations

import math

import pytest
import torch

import torchops
from opdb import make_boxes, make_rotated_boxes, make_scores
from torchops import references

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CUDA = [pytest.param("cuda", marks=pytest.mark.cuda)]
DEVICES = ["cpu", *CUDA]


def _t(rows, device, dtype=torch.float64):
    return torch.tensor(rows, device=device, dtype=torch.float64).to(dtype)


def _xyxy_to_rotated(b, angle=0.0):
    return torch.cat([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2],
                      torch.full_like(b[:, :1], angle)], 1)


# --- box_iou_rotated ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_known_overlaps(device):
    # A square and itself turned by 45 degrees: a regular octagon, IoU 1/sqrt(2).
    # A 4x2 box and the same turned by 90 degrees: a 2x2 square, IoU 4/12.
    boxes = _t([[0, 0, 2, 2, 0], [0, 0, 2, 2, 45], [5, 5, 4, 2, 30], [5, 5, 4, 2, 120]], device)
    iou = torchops.box_iou_rotated(boxes, boxes)
    assert iou[0, 1].item() == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert iou[2, 3].item() == pytest.approx(1 / 3, abs=1e-12)
    assert iou[0, 2].item() == 0.0
    torch.testing.assert_close(iou.diagonal(), torch.ones(4, device=device, dtype=torch.float64))
    torch.testing.assert_close(iou, iou.t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_axis_aligned_boxes_equal_box_iou(device, dtype):
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(40, 2, generator=g, dtype=torch.float64) * 20
    b = torch.cat([xy, xy + 1 + torch.rand(40, 2, generator=g, dtype=torch.float64) * 8], 1)
    b = b.to(device, dtype)
    want = torchops.box_iou(b, b)
    for angle in (0.0, 180.0, -180.0):
        r = _xyxy_to_rotated(b, angle)
        torch.testing.assert_close(torchops.box_iou_rotated(r, r), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_ninety_degree_and_rotation_symmetry(device):
    torch.manual_seed(0)
    a = make_rotated_boxes(30, device, torch.float64, spread=8.0)
    b = make_rotated_boxes(25, device, torch.float64, spread=8.0)
    iou = torchops.box_iou_rotated(a, b)
    assert (iou > 0).sum() > 20  # the scene overlaps
    # (w, h, angle) and (h, w, angle + 90) are the same rectangle.
    a90 = torch.cat([a[:, :2], a[:, 3:4], a[:, 2:3], a[:, 4:] + 90], 1)
    torch.testing.assert_close(torchops.box_iou_rotated(a90, b), iou, atol=1e-10, rtol=1e-9)
    # Turning the whole scene about a point changes no IoU.
    theta = 37.0
    c, s = math.cos(math.radians(theta)), math.sin(math.radians(theta))
    rot = torch.tensor([[c, s], [-s, c]], device=device, dtype=torch.float64)  # the boxes' sense

    def turn(x):
        return torch.cat([(x[:, :2] - 3) @ rot.t() + 3, x[:, 2:4], x[:, 4:] + theta], 1)
    torch.testing.assert_close(torchops.box_iou_rotated(turn(a), turn(b)), iou,
                               atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_precision_far_from_the_origin(device):
    torch.manual_seed(0)
    a = make_rotated_boxes(20, device, torch.float64, spread=4.0)
    b = make_rotated_boxes(20, device, torch.float64, spread=4.0)
    want = torchops.box_iou_rotated(a, b)
    far = torch.tensor([4096.0, -8192.0, 0, 0, 0], device=device, dtype=torch.float64)
    # float32 holds these centres exactly (multiples of 2^-10 below 2^13).
    a32, b32 = ((x * 1024).round() / 1024 + far for x in (a, b))
    got = torchops.box_iou_rotated(a32.float(), b32.float()).double()
    near = torchops.box_iou_rotated(a32 - far, b32 - far)
    torch.testing.assert_close(got, near, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(near, want, atol=1e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_degenerate_and_non_finite_boxes_give_zero_or_finish(device, dtype):
    boxes = _t([[0, 0, 0, 2, 10], [0, 0, 2, 0, 0], [0, 0, -2, 2, 0], [0, 0, 2, 2, 0],
                [0, 0, float("nan"), 2, 0]], device, dtype)
    iou = torchops.box_iou_rotated(boxes, boxes)
    assert not iou.isnan().any()
    want = torch.zeros(5, 5, device=device, dtype=dtype)
    want[3, 3] = 1
    torch.testing.assert_close(iou, want)
    # Non-finite centres and angles: bounded loops, whatever the values.
    odd = _t([[float("inf"), 0, 2, 2, 0], [0, float("nan"), 2, 2, 0], [0, 0, 2, 2, float("inf")],
              [1e30, 1e30, 1e30, 1e30, 45]], device, dtype)
    torchops.box_iou_rotated(odd, torch.cat([odd, boxes]))
    torchops.nms_rotated(odd, torch.ones(4, device=device, dtype=dtype), 0.5)


# --- nms_rotated ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nms_rotated_ties_and_degenerate_boxes(device, dtype):
    # Three copies of one box with equal scores (the first is kept), a box
    # overlapping them a little (kept), zero-area boxes on top of them
    # (kept: IoU 0), and a higher-scored zero-area box.
    boxes = _t([[0, 0, 0, 4, 0],  # zero width
                [5, 5, 4, 2, 30], [5, 5, 4, 2, 30], [5, 5, 4, 2, 30],
                [7, 5, 4, 2, -30],
                [5, 5, 4, 0, 30], [5, 5, 0, 0, 0]], device, dtype)
    scores = _t([0.95, 0.5, 0.5, 0.5, 0.4, 0.5, 0.5], device, dtype)
    keep = torchops.nms_rotated(boxes, scores, 0.5)
    assert keep.tolist() == [0, 1, 5, 6, 4]
    assert keep.tolist() == references.nms_rotated(boxes.double(), scores.double(), 0.5).tolist()
    # A negative threshold suppresses everything after the first (IoU 0 > -0.5).
    assert torchops.nms_rotated(boxes, scores, -0.5).tolist() == [0]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_rotated_of_axis_aligned_boxes_is_nms(device):
    torch.manual_seed(0)
    b = make_boxes(300, device, torch.float64, cells=40, step=1.0, max_size=12)
    b = b + torch.rand(300, 4, device=device, dtype=torch.float64) * 0.01  # no exact IoU ties
    s = make_scores(300, device, torch.float64)
    for thr in (0.3, 0.5, 0.7):
        assert torch.equal(torchops.nms_rotated(_xyxy_to_rotated(b), s, thr),
                           torchops.nms(b, s, thr))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_nms_rotated_is_nms_rotated_per_category(device):
    torch.manual_seed(0)
    n = 300
    b = make_rotated_boxes(n, device, torch.float32, spread=10.0)
    s = make_scores(n, device, torch.float32)
    idxs = torch.randint(-2, 3, (n,), device=device) * 10**12
    got = torchops.batched_nms_rotated(b, s, idxs, 0.4)
    kept = torch.cat([torch.nonzero(idxs == c).flatten()[
        torchops.nms_rotated(b[idxs == c], s[idxs == c], 0.4)] for c in idxs.unique()])
    want = kept[torch.sort(s[kept], descending=True, stable=True).indices]
    assert torch.equal(got, want)


# --- soft_nms ---------------------------------------------------------------------------

def _mmcv_soft_nms(boxes, scores, iou_threshold, sigma, min_score, method):
    """mmcv's CPU loop (swap the best remaining box to the front, decay the
    rest, swap the dropped ones out), in float64 Python, with mmcv's one
    difference removed: a first box below min_score is dropped too."""
    b = boxes.double().tolist()
    s = scores.double().tolist()
    ind = list(range(len(b)))
    live = [i for i in ind if s[i] >= min_score]
    keep, kept = [], []
    while live:
        best = max(live, key=lambda i: (s[i], -i))
        keep.append(best)
        kept.append(s[best])
        live.remove(best)
        x1, y1, x2, y2 = b[best]
        for i in list(live):
            w = max(min(x2, b[i][2]) - max(x1, b[i][0]), 0.0)
            h = max(min(y2, b[i][3]) - max(y1, b[i][1]), 0.0)
            inter = w * h
            union = (x2 - x1) * (y2 - y1) + (b[i][2] - b[i][0]) * (b[i][3] - b[i][1]) - inter
            iou = inter / union if inter > 0 else 0.0
            if method == "linear":
                s[i] *= 1 - iou if iou > iou_threshold else 1.0
            else:
                s[i] *= math.exp(-(iou * iou) / sigma)
            if s[i] < min_score:
                live.remove(i)
    return keep, kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("method", ["linear", "gaussian"])
def test_soft_nms_matches_mmcv_loop(device, dtype, method):
    torch.manual_seed(0)
    xy = torch.rand(200, 2, dtype=torch.float64) * 60
    b = torch.cat([xy, xy + 5 + torch.rand(200, 2, dtype=torch.float64) * 20], 1)
    s = torch.rand(200, dtype=torch.float64)
    keep, new = torchops.soft_nms(b.to(device, dtype), s.to(device, dtype), 0.3, 0.5, 1e-3, method)
    want_keep, want_scores = _mmcv_soft_nms(b, s, 0.3, 0.5, 1e-3, method)
    assert keep.tolist() == want_keep
    torch.testing.assert_close(new.double().cpu(), torch.tensor(want_scores, dtype=torch.float64),
                               atol=1e-6, rtol=1e-5)
    ref_keep, ref_scores = references.soft_nms(b, s, 0.3, 0.5, 1e-3, method)
    assert ref_keep.tolist() == want_keep


@pytest.mark.parametrize("device", DEVICES)
def test_soft_nms_ties_select_the_lower_index(device):
    b = _t([[0, 0, 4, 4], [10, 10, 12, 12], [0, 0, 4, 4], [10, 10, 12, 12], [20, 20, 21, 21]],
           device, torch.float32)
    s = _t([0.5, 0.5, 0.5, 0.5, 0.5], device, torch.float32)
    keep, new = torchops.soft_nms(b, s, method="linear", iou_threshold=0.3)
    # Boxes 2 and 3 copy 0 and 1: linear decay by 1 - IoU = 0 drops them.
    assert keep.tolist() == [0, 1, 4]
    assert new.tolist() == [0.5, 0.5, 0.5]
    keep, new = torchops.soft_nms(b, s, sigma=0.5, min_score=0.0)
    assert keep.tolist() == [0, 1, 4, 2, 3]
    torch.testing.assert_close(new[3:], torch.full((2,), 0.5 * math.exp(-2.0), device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_soft_nms_drops_scores_below_min_score(device):
    b = make_boxes(30, device, torch.float32)
    s = torch.linspace(0.0, 0.29, 30, device=device)
    keep, new = torchops.soft_nms(b, s, min_score=0.2, sigma=1e9)  # sigma: no decay to speak of
    assert sorted(keep.tolist()) == [i for i in range(30) if s[i] >= 0.2]
    assert (new >= 0.2).all()


# --- torchvision, where it has rotated ops ----------------------------------------------------

def _torchvision_op(name):
    tv = pytest.importorskip("torchvision")
    fn = getattr(tv.ops, name, None)
    if fn is None:
        pytest.skip(f"torchvision {tv.__version__} has no ops.{name}")
    return fn


@pytest.mark.parametrize("device", DEVICES)
def test_box_iou_rotated_matches_torchvision(device):
    tv_iou = _torchvision_op("box_iou_rotated")
    torch.manual_seed(0)
    a = make_rotated_boxes(50, device, torch.float32, spread=10.0)
    b = make_rotated_boxes(60, device, torch.float32, spread=10.0)
    torch.testing.assert_close(torchops.box_iou_rotated(a, b), tv_iou(a, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_nms_rotated_matches_torchvision(device):
    tv_nms = _torchvision_op("nms_rotated")
    torch.manual_seed(0)
    b = make_rotated_boxes(300, device, torch.float32, spread=30.0)
    s = (torch.randperm(300, device=device).float() + 0.5) / 300
    try:
        want = tv_nms(b, s, 0.5)
    except (RuntimeError, NotImplementedError) as e:  # e.g. no CUDA kernel
        pytest.skip(f"torchvision's nms_rotated on {device}: {e}")
    assert torch.equal(torchops.nms_rotated(b, s, 0.5), want)
