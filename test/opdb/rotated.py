"""Entries of the rotated-box ops (box_iou_rotated, nms_rotated,
batched_nms_rotated) and of soft_nms, which arrived with them; and the
rotated-box sample maker that op-specific tests share (make_rotated_boxes)."""

from __future__ import annotations

import torch

from .boxes import _nms_errors_common, make_boxes, make_scores
from .core import ErrorInput, OpInfo, Sample, Skip

# Rotated samples draw centres, sizes and angles from continuous
# distributions (rounded to the dtype under test; the float64 references see
# the rounded values): an IoU that lands exactly on a threshold -- where the
# kernels' clipping and the reference's vertex sort could round to different
# sides -- then has probability zero.  Exact ties, axis-aligned boxes and
# the 90-degree symmetry are tested in test_rotated.py.


def make_rotated_boxes(n, device, dtype, *, spread=16.0, min_size=1.0, max_size=6.0,
                       transposed=False):
    """n boxes (x_ctr, y_ctr, w, h, angle): centres in [0, spread)^2, sides in
    [min_size, max_size), angles in [-180, 180) degrees."""
    ctr = torch.rand(n, 2, device=device, dtype=torch.float64) * spread
    wh = min_size + torch.rand(n, 2, device=device, dtype=torch.float64) * (max_size - min_size)
    angle = torch.rand(n, 1, device=device, dtype=torch.float64) * 360 - 180
    b = torch.cat([ctr, wh, angle], 1).to(dtype)
    if transposed:
        b = b.t().contiguous().t()
    return b


def _with_degenerate(b):
    """`b` with every third box's width or height set to 0."""
    b = b.clone()
    b[0::3, 2] = 0
    b[1::6, 3] = 0
    return b


def _box_iou_rotated_samples(device, dtype, requires_grad=False):
    rb = lambda n, **kw: make_rotated_boxes(n, device, dtype, **kw)  # noqa: E731
    for n, m in ((3, 5), (1, 1), (0, 4), (4, 0), (0, 0), (17, 33), (64, 65), (2, 300)):
        yield Sample((rb(n), rb(m)), name=f"iou{n}x{m}")
    yield Sample((rb(9, transposed=True), rb(11, transposed=True)), name="transposed")
    yield Sample((rb(20)[::2], rb(6)), name="strided_rows")
    yield Sample((rb(1).expand(5, 5), rb(7)), name="expanded")
    yield Sample((_with_degenerate(rb(12)), _with_degenerate(rb(10))), name="degenerate")
    # Far from the origin: the kernels centre the coordinates on the first box.
    far = rb(10, spread=8.0)
    far[:, :2] += 1000
    yield Sample((far, far.flip(0).contiguous()), name="far")


def _box_iou_rotated_errors(device):
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    name = r"torchops\.box_iou_rotated"
    yield ErrorInput(Sample((b(5), b(3, 5))), rf"{name}.*'boxes1'.*\(N, 5\)")
    yield ErrorInput(Sample((b(3, 4), b(3, 5))), rf"{name}.*'boxes1'.*\(N, 5\)")
    yield ErrorInput(Sample((b(3, 5), b(2, 3, 5))), rf"{name}.*'boxes2'.*\(N, 5\)")
    yield ErrorInput(Sample((b(3, 5), b(3, 5, dt=torch.float64))), rf"{name}.*'boxes2'.*dtype")
    yield ErrorInput(Sample((b(3, 5, dt=torch.int32), b(3, 5, dt=torch.int32))),
                     rf"{name}.*'boxes1'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((b(3, 5), b(3, 5, dev="cpu"))), rf"{name}.*'boxes2'")


BOX_IOU_ROTATED = OpInfo(name="box_iou_rotated", sample_inputs=_box_iou_rotated_samples,
                         error_inputs=_box_iou_rotated_errors, differentiable=False)


def _nms_rotated_sample_boxes(device, dtype):
    """(name, boxes, scores) cases shared by nms_rotated and batched_nms_rotated."""
    rb = lambda n, **kw: make_rotated_boxes(n, device, dtype, **kw)  # noqa: E731
    for n in (0, 1, 2, 7, 64, 65, 150):
        yield f"n{n}", rb(n), make_scores(n, device, dtype)
    # Crowded: heavy suppression, chains across 64-box blocks.
    yield "crowded", rb(130, spread=6.0), make_scores(130, device, dtype)
    yield "sparse", rb(130, spread=200.0, max_size=8.0), make_scores(130, device, dtype)
    # Identical boxes and equal scores: input order breaks the ties.
    yield "identical", rb(1).expand(9, 5).contiguous(), torch.full((9,), 0.5, device=device,
                                                                  dtype=dtype)
    # Zero-area boxes overlap nothing, and equal scores among them.
    s = make_scores(40, device, dtype)
    s[::4] = s[0]
    yield "degenerate_ties", _with_degenerate(rb(40, spread=6.0)), s
    yield "strided", rb(70, transposed=True), make_scores(140, device, dtype)[::2]


def _nms_rotated_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_rotated_sample_boxes(device, dtype)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        yield Sample((boxes, scores, thr), name=f"{name}_t{thr}")
    b = make_rotated_boxes(40, device, dtype, spread=8.0)
    s = make_scores(40, device, dtype)
    for thr in (0.0, 1.0, -0.5):  # 0: any overlap suppresses; 1: nothing; <0: everything later
        yield Sample((b, s, thr), name=f"t{thr}")


def _rotated_errors(op, device, extra):
    """nms's invalid calls with rotated rows, and a (N, 4) box array."""
    for e in _nms_errors_common(op, device, extra):
        boxes = e.sample.args[0]
        if boxes.dim() == 2 and boxes.shape[1] == 5:
            continue  # nms's wrong shape is a right one here
        args = tuple(torch.zeros(*a.shape[:-1], 5, dtype=a.dtype, device=a.device)
                     if i == 0 and a.dim() == 2 and a.shape[-1] == 4 else a
                     for i, a in enumerate(e.sample.args))
        yield ErrorInput(Sample(args), e.match.replace(r"\(N, 4\)", r"\(N, 5\)"))
    b4, s = torch.zeros(5, 4, device=device), torch.zeros(5, device=device)
    yield ErrorInput(Sample((b4, s, *extra(5))), rf"torchops\.{op}.*'boxes'.*\(N, 5\)")


def _nms_rotated_errors(device):
    yield from _rotated_errors("nms_rotated", device, lambda n: (0.5,))


_NMS_TRAITS = dict(differentiable=False, data_dependent_output=True, autocast=True)

NMS_ROTATED = OpInfo(name="nms_rotated", sample_inputs=_nms_rotated_samples,
                     error_inputs=_nms_rotated_errors, **_NMS_TRAITS)


def _batched_nms_rotated_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_rotated_sample_boxes(device, dtype)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        idxs = torch.randint(0, 3, (boxes.shape[0],), device=device)
        yield Sample((boxes, scores, idxs, thr), name=f"{name}_t{thr}")
    n = 100
    boxes, scores = make_rotated_boxes(n, device, dtype, spread=6.0), make_scores(n, device, dtype)
    wide = torch.tensor([-(2**40), -3, 0, 7, 2**40], device=device)[
        torch.randint(0, 5, (n,), device=device)]
    yield Sample((boxes, scores, wide, 0.5), name="wide_idxs")
    yield Sample((boxes, scores, torch.zeros(n, dtype=torch.int64, device=device), 0.5),
                 name="one_category")
    yield Sample((boxes, scores, torch.randint(0, 4, (2 * n,), device=device)[::2], 0.4),
                 name="strided_idxs")


def _batched_nms_rotated_errors(device):
    op = "batched_nms_rotated"
    idx = lambda n: (torch.zeros(n, dtype=torch.int64, device=device), 0.5)  # noqa: E731
    yield from _rotated_errors(op, device, idx)
    b, s = torch.zeros(5, 5, device=device), torch.zeros(5, device=device)
    yield ErrorInput(Sample((b, s, torch.zeros(5, dtype=torch.int32, device=device), 0.5)),
                     rf"torchops\.{op}.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, torch.zeros(4, dtype=torch.int64, device=device), 0.5)),
                     rf"torchops\.{op}.*'idxs'.*N = 5")


BATCHED_NMS_ROTATED = OpInfo(name="batched_nms_rotated", sample_inputs=_batched_nms_rotated_samples,
                             error_inputs=_batched_nms_rotated_errors, **_NMS_TRAITS)


def _soft_nms_samples(device, dtype, requires_grad=False):
    # Axis-aligned boxes on nms's grid (exact in every dtype).
    def case(n, **kw):
        return make_boxes(n, device, dtype, **kw), make_scores(n, device, dtype)

    for i, n in enumerate((0, 1, 2, 7, 64, 65, 150)):
        b, s = case(n, cells=8)
        method = ("gaussian", "linear")[i % 2]
        yield Sample((b, s, 0.3, 0.5, 1e-3, method), name=f"n{n}_{method}")
    b, s = case(120, cells=6)
    yield Sample((b, s, 0.5, 0.5, 1e-3, "linear"), name="crowded_linear")
    yield Sample((b, s, 0.3, 0.1, 0.05, "gaussian"), name="crowded_gaussian_narrow")
    yield Sample((b, s, 0.3, 2.0, 0.0, "gaussian"), name="keep_all")
    yield Sample((b, s, 0.0, 0.5, 0.5, "linear"), name="high_min_score")
    # Identical boxes and equal scores: the lower index is selected first.
    one = make_boxes(1, device, dtype).expand(9, 4)
    yield Sample((one, torch.full((9,), 0.5, device=device, dtype=dtype), 0.3, 0.5, 1e-3,
                  "gaussian"), name="identical")
    b, s = case(70, cells=8, transposed=True)
    s2 = make_scores(140, device, dtype)[::2]
    yield Sample((b, s2, 0.3, 0.5, 1e-3, "linear"), name="strided")
    # Empty boxes have IoU 0 (never NaN).
    e = make_boxes(20, device, dtype, cells=4)
    e[::3, 2] = e[::3, 0]
    yield Sample((e, make_scores(20, device, dtype), 0.3, 0.5, 1e-3, "gaussian"),
                 name="empty_boxes")


def _soft_nms_errors(device):
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    name = r"torchops\.soft_nms"
    ok = (0.3, 0.5, 1e-3, "gaussian")
    yield ErrorInput(Sample((b(5), b(5), *ok)), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 5), b(5), *ok)), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 4), b(4), *ok)), rf"{name}.*'scores'.*N = 5")
    yield ErrorInput(Sample((b(5, 4), b(5, 1), *ok)), rf"{name}.*'scores'.*\(N,\)")
    yield ErrorInput(Sample((b(5, 4, dt=torch.int64), b(5, dt=torch.int64), *ok)),
                     rf"{name}.*'boxes'.*floating")
    yield ErrorInput(Sample((b(5, 4), b(5, dt=torch.float64), *ok)),
                     rf"{name}.*'scores'.*same dtype")
    yield ErrorInput(Sample((b(5, 4), b(5), float("nan"), 0.5, 1e-3, "linear")),
                     rf"{name}.*'iou_threshold'")
    yield ErrorInput(Sample((b(5, 4), b(5), 0.3, -0.5, 1e-3, "gaussian")), rf"{name}.*'sigma'")
    yield ErrorInput(Sample((b(5, 4), b(5), 0.3, 0.0, 1e-3, "gaussian")), rf"{name}.*'sigma'")
    yield ErrorInput(Sample((b(5, 4), b(5), 0.3, 0.5, float("nan"), "gaussian")),
                     rf"{name}.*'min_score'")
    yield ErrorInput(Sample((b(5, 4), b(5), 0.3, 0.5, 1e-3, "hard")), rf"{name}.*'method'")
    if device != "cpu":
        yield ErrorInput(Sample((b(5, 4), b(5, dev="cpu"), *ok)), rf"{name}.*'scores'")


# Half-precision scores on nms's grid tie often as real numbers after a decay
# (a score ratio equal to a ratio of 1 - IoU); the op decays in float32 and the
# float64 reference rounds such ties apart differently, so the selection order
# of the half types is checked against the CPU kernel (cpu_vs_cuda, the same
# float32 arithmetic), not the reference.
_HALF_TIES = "half scores tie after a decay; float32 and float64 order the ties differently"
SOFT_NMS = OpInfo(name="soft_nms", sample_inputs=_soft_nms_samples, error_inputs=_soft_nms_errors,
                  differentiable=False, data_dependent_output=True, autocast=True,
                  skips=[Skip("correctness", _HALF_TIES, dtype=dt)
                         for dt in (torch.float16, torch.bfloat16)])


ROTATED_OPS: list[OpInfo] = [BOX_IOU_ROTATED, NMS_ROTATED, BATCHED_NMS_ROTATED, SOFT_NMS]
