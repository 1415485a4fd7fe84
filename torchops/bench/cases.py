"""The benchmark registry: every torchops operator's benchmarks, declared once.

Add an operator's benchmark here, beside the others: its sizes per device, an
input factory (torchops/bench/inputs.py), a pure-PyTorch reference
(torchops/bench/references.py), a peer (torchops/bench/peers.py) and a work
counter.  ``python -m torchops bench`` runs every case in this order; a case
whose operator is not registered in the running build is skipped with a note.
"""

from __future__ import annotations

import torch

from torchops.bench import inputs, references
from torchops.bench.case import Case, Size
from torchops.bench.peers import torchvision_op

__all__ = ["CASES", "by_name", "select"]

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
ALL = ("all",)
SCALING = (1, 2, "all")   # CPU rows that show how an op scales with threads


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _mm(m, k, n, dtype=f32, b=None, quick=False):
    label = f"{m}x{k}x{n}" if b is None else f"{b} x {m}x{k}x{n}"
    return Size(label, {"m": m, "k": k, "n": n, "b": b}, dtype, quick)


def _mm_flops(args) -> float:
    a, b = args[:2]
    return 2.0 * a.numel() * b.shape[-1]


def _elements(n, dtype=f32, quick=False):
    return Size(f"2^{n.bit_length() - 1}", {"n": n}, dtype, quick)


def _boxes(n, regime, quick=False, threads=ALL, **extra):
    return Size(f"n={n} {regime}", {"n": n, "regime": regime, **extra}, f32, quick, threads)


def _rois(n, c, h, w, rois, quick=False, threads=ALL):
    return Size(f"{n}x{c}x{h}x{w}, {rois} RoIs", {"n": n, "c": c, "h": h, "w": w, "rois": rois},
                f32, quick, threads)


# Detection-sized RoI problems: issue 5's comparison sizes, and a small one.
ROI_CUDA = [_rois(2, 256, 200, 200, 1000), _rois(2, 256, 50, 50, 256, quick=True)]
ROI_CPU = [_rois(2, 256, 100, 100, 256, quick=True, threads=SCALING)]
ROI_CPU_BWD = [_rois(2, 256, 100, 100, 256, quick=True)]


def _roi_out(args) -> tuple[int, int]:
    """Elements and bytes of a RoI op's pooled output."""
    x, rois, _, ph, pw = args[:5]
    numel = rois.shape[0] * x.shape[1] * ph * pw
    return numel, numel * x.element_size()


def _roi_fwd_bytes(args) -> float:
    return _nbytes(args[0], args[1]) + _roi_out(args)[1]


def _roi_fwd_bwd_bytes(args) -> float:
    # forward, then: read the output's gradient, write the input's gradient.
    return _roi_fwd_bytes(args) + _roi_out(args)[1] + _nbytes(args[0])


def _roi_pool_argmax_bytes(args) -> float:
    return _roi_out(args)[0] * 8  # int64 argmax, written forward, read backward


CASES: list[Case] = [
    # --- linear algebra ------------------------------------------------------------
    Case(
        name="matmul", op="matmul", inputs=inputs.matrices,
        sizes={
            "cuda": [_mm(512, 512, 512, quick=True), _mm(1024, 1024, 1024),
                     _mm(4096, 4096, 4096), _mm(4096, 4096, 4096, bf16),
                     _mm(4096, 4096, 4096, f16), _mm(512, 512, 512, b=32),
                     _mm(512, 512, 512, bf16, b=32)],
            "cpu": [_mm(256, 256, 256, quick=True), _mm(512, 512, 512), _mm(1024, 1024, 1024),
                    _mm(256, 256, 256, b=16)],
        },
        reference=torch.matmul, reference_name="torch.matmul (cuBLAS / CPU BLAS)",
        flops=_mm_flops,
        note="The eager reference is the vendor BLAS (torch.mm/bmm), i.e. the peer.",
    ),
    # --- elementwise -------------------------------------------------------------------
    Case(
        name="d_sigmoid", op="d_sigmoid", inputs=inputs.vector,
        sizes={
            "cuda": [_elements(1 << 16, quick=True), _elements(1 << 20), _elements(1 << 24),
                     _elements(1 << 24, bf16)],
            "cpu": [_elements(1 << 16, quick=True), _elements(1 << 20), _elements(1 << 24)],
        },
        reference=references.d_sigmoid, reference_name="s*(1-s), s=torch.sigmoid(z)",
        bytes=lambda a: 2 * _nbytes(a[0]),
    ),
    Case(
        name="d_sigmoid fwd+bwd", op="d_sigmoid", inputs=inputs.vector, backward=True,
        sizes={
            "cuda": [_elements(1 << 20, quick=True), _elements(1 << 24)],
            "cpu": [_elements(1 << 16, quick=True), _elements(1 << 20)],
        },
        reference=references.d_sigmoid, reference_name="s*(1-s), s=torch.sigmoid(z)",
        # forward reads z and writes y; backward reads the gradient and z, writes z's.
        bytes=lambda a: 5 * _nbytes(a[0]),
    ),
    # --- detection: boxes -------------------------------------------------------------
    Case(
        name="nms", op="nms", inputs=inputs.nms_args,
        sizes={
            "cuda": [_boxes(n, r, quick=(n == 1000 and r == "sparse"))
                     for n in (1000, 5000, 20000, 100000) for r in ("sparse", "dense")],
            "cpu": [_boxes(5000, r, quick=(r == "sparse"), threads=SCALING)
                    for r in ("sparse", "dense")],
        },
        peer=torchvision_op("nms"),
        note="No eager reference: exact NMS is a sequential loop over the boxes.",
    ),
    Case(
        name="batched_nms", op="batched_nms", inputs=inputs.batched_nms_args,
        sizes={
            "cuda": [_boxes(5000, "dense", quick=True, classes=80),
                     _boxes(20000, "dense", classes=80)],
            "cpu": [_boxes(5000, "dense", quick=True, threads=SCALING, classes=80)],
        },
        peer=torchvision_op("batched_nms"),
        note="80 classes. No eager reference (see nms).",
    ),
    Case(
        name="box_iou", op="box_iou", inputs=inputs.box_pairs,
        sizes={
            "cuda": [Size("1000 x 1000", {"n": 1000, "m": 1000}, quick=True),
                     Size("5000 x 5000", {"n": 5000, "m": 5000}),
                     Size("20000 x 1000", {"n": 20000, "m": 1000})],
            "cpu": [Size("1000 x 1000", {"n": 1000, "m": 1000}, quick=True),
                    Size("5000 x 5000", {"n": 5000, "m": 5000})],
        },
        reference=references.box_iou, reference_name="broadcast formula",
        peer=torchvision_op("box_iou"),
        bytes=lambda a: _nbytes(*a) + a[0].shape[0] * a[1].shape[0] * a[0].element_size(),
    ),
    # --- detection: RoI pooling ---------------------------------------------------------
    Case(
        name="roi_align", op="roi_align", inputs=inputs.roi_align_args,
        sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU},
        reference=references.roi_align, reference_name="gather formula",
        peer=torchvision_op("roi_align"), bytes=_roi_fwd_bytes,
        note="7x7 bins, sampling_ratio 2, aligned=True, spatial_scale 1/8.",
    ),
    Case(
        name="roi_align fwd+bwd", op="roi_align", inputs=inputs.roi_align_args, backward=True,
        sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU_BWD},
        reference=references.roi_align, reference_name="gather formula",
        peer=torchvision_op("roi_align"), bytes=_roi_fwd_bwd_bytes,
    ),
    Case(
        name="roi_align fwd+bwd deterministic", op="roi_align", inputs=inputs.roi_align_args,
        backward=True, deterministic=True, sizes={"cuda": ROI_CUDA[:1]},
        peer=torchvision_op("roi_align", slow=True), compile=False, bytes=_roi_fwd_bwd_bytes,
        note="Under torch.use_deterministic_algorithms(True). torchvision then runs its "
             "pure-PyTorch path (tens of seconds, GBs): timed only with --slow.",
    ),
    Case(
        name="roi_pool", op="roi_pool", inputs=inputs.roi_pool_args,
        sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU},
        peer=torchvision_op("roi_pool"),
        bytes=lambda a: _roi_fwd_bytes(a) + _roi_pool_argmax_bytes(a),
        note="No eager reference: max over variable-size bins does not vectorise simply.",
    ),
    Case(
        name="roi_pool fwd+bwd", op="roi_pool", inputs=inputs.roi_pool_args, backward=True,
        sizes={"cuda": ROI_CUDA[:1], "cpu": ROI_CPU_BWD},
        peer=torchvision_op("roi_pool"),
        bytes=lambda a: _roi_fwd_bwd_bytes(a) + 2 * _roi_pool_argmax_bytes(a),
    ),
    # --- losses -------------------------------------------------------------------------
    Case(
        name="sigmoid_focal_loss fwd+bwd", op="sigmoid_focal_loss", inputs=inputs.focal_loss_args,
        backward=True,
        sizes={
            "cuda": [Size("8192x80", {"n": 8192, "c": 80}, quick=True),
                     Size("65536x80", {"n": 65536, "c": 80})],
            "cpu": [Size("8192x80", {"n": 8192, "c": 80}, quick=True)],
        },
        reference=references.sigmoid_focal_loss, reference_name="torchvision's formula",
        peer=torchvision_op("sigmoid_focal_loss"),
        # forward reads logits and targets; backward reads both again, writes the gradient.
        bytes=lambda a: 5 * _nbytes(a[0]),
        note="alpha 0.25, gamma 2, reduction 'mean'.",
    ),
]


def by_name() -> dict[str, Case]:
    return {c.name: c for c in CASES}


def select(names: list[str] | None) -> list[Case]:
    """Cases whose case name or operator name is in `names` (all when None)."""
    if not names:
        return list(CASES)
    known = {c.name for c in CASES} | {c.op for c in CASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {sorted(known)}")
    return [c for c in CASES if c.name in names or c.op in names]
