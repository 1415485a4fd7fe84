"""Entries of the box ops: nms, batched_nms, nms_padded, box_iou; and the box sample makers
that op-specific tests share (make_boxes, make_scores)."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample


# Box samples use coordinates on a coarse grid, exact in every dtype
# (bfloat16 included), so IoUs -- and hence which boxes nms keeps -- are the
# same in the kernels' op math and in the float64 references.  For box_iou,
# boxes1 and boxes2 sit on two grids offset by half a step: no coordinate of
# one equals one of the other and no overlap is exactly zero wide, so
# gradients are evaluated away from the formula's kinks (gradcheck perturbs by
# 1e-6; the grids are 1/8 apart).  Ties at the kinks are tested in
# test_boxes.py.


def make_boxes(n, device, dtype, requires_grad=False, *, cells=16, step=1.0, offset=0.0,
               max_size=6, transposed=False):
    """n boxes with corners on the grid offset + step * k, k in [0, cells + max_size]."""
    xy = torch.randint(0, cells, (n, 2), device=device)
    wh = torch.randint(1, max_size + 1, (n, 2), device=device)
    b = (torch.cat([xy, xy + wh], 1).to(torch.float64) * step + offset).to(dtype)
    if transposed:
        b = b.t().contiguous().t()
    return b.detach().requires_grad_(requires_grad)


def make_scores(n, device, dtype):
    """n scores uniform in [0, 1)."""
    return torch.rand(n, device=device, dtype=torch.float64).to(dtype)


def _nms_sample_boxes(device, dtype, requires_grad):
    """(name, boxes, scores) cases shared by nms and batched_nms."""
    rg = requires_grad
    for n in (0, 1, 2, 7, 64, 65, 150):
        yield f"n{n}", make_boxes(n, device, dtype, rg), make_scores(n, device, dtype)
    # Crowded: few grid cells, heavy suppression, chains across 64-box blocks.
    yield "crowded", make_boxes(200, device, dtype, rg, cells=6), make_scores(200, device, dtype)
    # Sparse: large grid, almost everything kept.
    yield "sparse", make_boxes(130, device, dtype, rg, cells=200, max_size=8), make_scores(130, device, dtype)
    # Identical boxes and equal scores: input order breaks the ties.
    b = make_boxes(1, device, dtype).expand(9, 4).contiguous().requires_grad_(rg)
    yield "identical", b, torch.full((9,), 0.5, device=device, dtype=dtype)
    # Non-contiguous inputs: boxes stored column-major, every other score.
    yield ("strided", make_boxes(70, device, dtype, rg, transposed=True),
           make_scores(140, device, dtype)[::2])


def _nms_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_sample_boxes(device, dtype, requires_grad)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        yield Sample((boxes, scores, thr), name=f"{name}_t{thr}")
    b = make_boxes(40, device, dtype, requires_grad)
    s = make_scores(40, device, dtype)
    for thr in (0.0, 1.0, -0.5):  # 0: any overlap suppresses; 1: nothing; <0: everything later
        yield Sample((b, s, thr), name=f"t{thr}")


def _nms_errors_common(op, device, extra):
    """Invalid calls for nms / batched_nms; `extra` = arguments after scores."""
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    name = rf"torchops\.{op}"
    yield ErrorInput(Sample((b(5), b(5), *extra(5))), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 5), b(5), *extra(5))), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 4), b(5, 1), *extra(5))), rf"{name}.*'scores'.*\(N,\)")
    yield ErrorInput(Sample((b(5, 4), b(4), *extra(5))), rf"{name}.*'scores'.*N = 5")
    yield ErrorInput(Sample((b(5, 4, dt=torch.int64), b(5, dt=torch.int64), *extra(5))),
                     rf"{name}.*'boxes'.*floating")
    yield ErrorInput(Sample((b(5, 4), b(5, dt=torch.float64), *extra(5))),
                     rf"{name}.*'scores'.*same dtype")
    yield ErrorInput(Sample((b(5, 4), b(5), *extra(5)[:-1], float("nan"))),
                     rf"{name}.*'iou_threshold'")
    if device != "cpu":
        yield ErrorInput(Sample((b(5, 4), b(5, dev="cpu"), *extra(5))), rf"{name}.*'scores'")


def _nms_errors(device):
    yield from _nms_errors_common("nms", device, lambda n: (0.5,))


# What nms and batched_nms are alike in: they return indices (no gradient),
# as many as the data keep, and compute in float32 under autocast.
_NMS_TRAITS = dict(differentiable=False, data_dependent_output=True, autocast=True)

NMS = OpInfo(name="nms", sample_inputs=_nms_samples, error_inputs=_nms_errors, **_NMS_TRAITS)


def _batched_nms_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_sample_boxes(device, dtype, requires_grad)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        n = boxes.shape[0]
        idxs = torch.randint(0, 3, (n,), device=device)
        yield Sample((boxes, scores, idxs, thr), name=f"{name}_t{thr}")
    n = 100
    boxes, scores = make_boxes(n, device, dtype, requires_grad, cells=6), make_scores(n, device, dtype)
    # Categories far apart, negative, beyond int32; and one category for all.
    wide = torch.tensor([-(2**40), -3, 0, 7, 2**40], device=device)[torch.randint(0, 5, (n,), device=device)]
    yield Sample((boxes, scores, wide, 0.5), name="wide_idxs")
    yield Sample((boxes, scores, torch.zeros(n, dtype=torch.int64, device=device), 0.5), name="one_category")
    yield Sample((boxes, scores, torch.arange(n, device=device).flip(0), 0.0), name="all_distinct")
    yield Sample((boxes, scores, torch.randint(0, 4, (2 * n,), device=device)[::2], 0.4), name="strided_idxs")


def _batched_nms_errors(device):
    idx = lambda n: (torch.zeros(n, dtype=torch.int64, device=device), 0.5)  # noqa: E731
    yield from _nms_errors_common("batched_nms", device, idx)
    b, s = torch.zeros(5, 4, device=device), torch.zeros(5, device=device)
    yield ErrorInput(Sample((b, s, torch.zeros(5, dtype=torch.int32, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, torch.zeros(5, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, torch.zeros(4, dtype=torch.int64, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*N = 5")
    if device != "cpu":
        yield ErrorInput(Sample((b, s, torch.zeros(5, dtype=torch.int64), 0.5)),
                         r"torchops\.batched_nms.*'idxs'")


BATCHED_NMS = OpInfo(name="batched_nms", sample_inputs=_batched_nms_samples,
                     error_inputs=_batched_nms_errors, **_NMS_TRAITS)


def _nms_padded_samples(device, dtype, requires_grad=False):
    # nms's samples, then batched_nms's with idxs as the last argument.
    yield from _nms_samples(device, dtype, requires_grad)
    for s in _batched_nms_samples(device, dtype, requires_grad):
        boxes, scores, idxs, thr = s.args
        yield Sample((boxes, scores, thr, idxs), name=f"idxs_{s.name}")


def _nms_padded_errors(device):
    yield from _nms_errors_common("nms_padded", device, lambda n: (0.5,))
    b, s = torch.zeros(5, 4, device=device), torch.zeros(5, device=device)
    yield ErrorInput(Sample((b, s, 0.5, torch.zeros(5, dtype=torch.int32, device=device))),
                     r"torchops\.nms_padded.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, 0.5, torch.zeros(4, dtype=torch.int64, device=device))),
                     r"torchops\.nms_padded.*'idxs'.*N = 5")


# Static output shapes: the generic CUDA-graph test captures it.
NMS_PADDED = OpInfo(name="nms_padded", sample_inputs=_nms_padded_samples,
                    error_inputs=_nms_padded_errors,
                    **{**_NMS_TRAITS, "data_dependent_output": False})


def _box_iou_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    # Two grids a half step apart (see the section comment); coordinates < 8
    # so that bfloat16 holds them exactly.
    b1 = lambda n, **kw: make_boxes(n, device, dtype, rg, cells=12, step=0.25,  # noqa: E731
                                    offset=1 / 16, max_size=16, **kw)
    b2 = lambda n, **kw: make_boxes(n, device, dtype, rg, cells=12, step=0.25,  # noqa: E731
                                    offset=3 / 16, max_size=16, **kw)
    for n, m in ((3, 5), (1, 1), (0, 4), (4, 0), (0, 0), (17, 33), (64, 65), (2, 300)):
        yield Sample((b1(n), b2(m)), name=f"iou{n}x{m}")
    yield Sample((b1(9, transposed=True), b2(11, transposed=True)), name="transposed")
    yield Sample((b1(20, transposed=True)[::2].detach().requires_grad_(rg), b2(6)), name="strided_rows")


def _box_iou_errors(device):
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    yield ErrorInput(Sample((b(4), b(3, 4))), r"torchops\.box_iou.*'boxes1'.*\(N, 4\)")
    yield ErrorInput(Sample((b(3, 4), b(3, 3))), r"torchops\.box_iou.*'boxes2'.*\(N, 4\)")
    yield ErrorInput(Sample((b(3, 4), b(2, 3, 4))), r"torchops\.box_iou.*'boxes2'")
    yield ErrorInput(Sample((b(3, 4), b(3, 4, dt=torch.float64))), r"torchops\.box_iou.*'boxes2'.*dtype")
    yield ErrorInput(Sample((b(3, 4, dt=torch.int32), b(3, 4, dt=torch.int32))),
                     r"torchops\.box_iou.*'boxes1'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((b(3, 4), b(3, 4, dev="cpu"))), r"torchops\.box_iou.*'boxes2'")
    # The internal backward op validates its arguments too, and its fake must
    # reject what it rejects (a compiled backward is traced through the fake).
    backward = torch.ops.torchops._box_iou_backward.default
    name = r"torchops\._box_iou_backward"
    b1, b2, g = b(3, 4), b(5, 4), b(3, 5)
    yield ErrorInput(Sample((g.double(), b1, b2)), rf"{name}.*'grad'.*same dtype as 'boxes1'",
                     op=backward)
    yield ErrorInput(Sample((g, b1, b2.double())), rf"{name}.*'boxes2'.*same dtype", op=backward)
    yield ErrorInput(Sample((g.t(), b1, b2)), rf"{name}.*'grad'.*shape", op=backward)
    yield ErrorInput(Sample((g, b1[:, :3], b2)), rf"{name}.*'boxes1'.*\(N, 4\)", op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((g.cpu(), b1, b2)), rf"{name}.*'grad'", op=backward)


BOX_IOU = OpInfo(
    name="box_iou",
    sample_inputs=_box_iou_samples,
    error_inputs=_box_iou_errors,
    internal_ops=("_box_iou_backward",),
    # To do: a "box_iou fwd+bwd" case in torchops/bench/cases.py, then drop this.
    no_benchmark={"_box_iou_backward": "torchops/bench/cases.py has no box_iou fwd+bwd case "
                                       "yet, so the backward's speed is not measured"},
)


BOX_OPS: list[OpInfo] = [NMS, BATCHED_NMS, NMS_PADDED, BOX_IOU]
