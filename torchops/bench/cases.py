"""The benchmark registry: one :class:`Case` per operator and mode, declared once.

A row of the results is one (case, device, size, CPU thread count), timed for
variants called with the same arguments (from an input factory in inputs.py):
``torchops`` (the operator), ``eager`` (the case's pure-PyTorch reference,
from torchops.references), ``compiled`` (``torch.compile`` of it) and each of
the case's peers (torchvision, PyTorch's native op, Liger-Kernel: adapted to
the operator's arguments, imported only when a run needs it; a peer's
variant is named by its ``label``).  docs/benchmarks.md says how they are timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from torchops import references
from torchops.bench import inputs

__all__ = ["Size", "Peer", "Case", "CASES", "VARIANTS", "select"]

# The fixed variants, and "peer": the label of a peer that gives none.
VARIANTS = ("torchops", "eager", "compiled", "peer")


@dataclass(frozen=True)
class Size:
    label: str                                   # shown in the tables
    params: Mapping[str, Any] = field(default_factory=dict)  # the input factory's
    dtype: torch.dtype = torch.float32
    quick: bool = False                          # part of `--quick` runs
    threads: tuple[int | str, ...] = ("all",)    # CPU thread counts ("all": torch's default)
    # Set while the row runs (every variant alike): torch's float32 matmul
    # precision ("high" allows TF32) and environment variables (a kernel's
    # testing switch, such as the forced Ampere matmul path).
    fp32_precision: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Peer:
    name: str                          # e.g. "torchvision.ops.nms"
    load: Callable[[], Callable]       # imports lazily; ImportError when absent
    slow: bool = False                 # only timed with `--slow`
    # The variant's name in the results and the table's column: unique within
    # a case ("F.rms_norm", "Liger"); a case's only peer may keep "peer".
    label: str = "peer"
    devices: tuple[str, ...] | None = None   # where it runs (None: everywhere)
    # A bound, not a drop-in (a plain softmax for a masked one): its output
    # is not compared with torchops's, and it is never the row's "best".
    bound: bool = False


@dataclass
class Case:
    name: str                                   # unique, e.g. "roi_align fwd+bwd"
    op: str                                     # torch.ops.torchops.<op>
    inputs: Callable[[Mapping[str, Any]], tuple]  # params -> the op's arguments (inputs.py)
    sizes: Mapping[str, Sequence[Size]]         # device -> sizes
    reference: Callable | None = None           # pure PyTorch, the op's arguments
    reference_name: str = "eager PyTorch"
    peer: Peer | None = None                    # shorthand for one peer (listed first)
    peers: tuple[Peer, ...] = ()                # every one timed in the same row
    compile: bool = True                        # also time torch.compile(reference)
    backward: bool = False                      # time forward + backward
    # Forward only, with inputs that require gradients (a training step's
    # forward: autograd changes what compiled code and peers save).  True:
    # the first argument, as with `backward`; a tuple: those arguments.
    requires_grad: bool | tuple[int, ...] = False
    deterministic: bool = False                 # under torch.use_deterministic_algorithms
    # Work per call: FLOPs (compute-bound ops: rows report TFLOP/s) or
    # compulsory bytes, every tensor read or written once (GB/s).
    flops: Callable[[tuple], float] | None = None
    bytes: Callable[[tuple], float] | None = None
    note: str = ""
    # float32 follows PyTorch's convolution TF32 flag (torch.backends.cudnn
    # .allow_tf32), not the matmul precision: the roofline is TF32's where
    # that flag lets CUDA convolutions use it.
    conv_precision: bool = False
    # Also measure each variant's peak memory (one more call each): the
    # rows' `mem` columns, where memory is what the op saves.
    memory: bool = False
    # Time the reference itself (the `eager` variant).  False: the reference
    # only checks torchops's result, untimed (an optimizer step has no eager
    # formulation worth timing; its peers are PyTorch's own steps).
    eager: bool = True
    # The op writes into its arguments (those its schema marks `(a!)`) and
    # returns nothing: the check compares those arguments after one call of
    # each variant on fresh copies, and a reference that returns their new
    # values (torchops.references' convention) has them written back.
    in_place: bool = False
    # float16 and bfloat16 rows check torchops against the reference run in
    # float32 (those inputs widened, the outputs rounded back to the row's
    # dtype), not against the timed eager and compiled variants, which run in
    # the row's dtype and may round beyond its tolerance; their own error
    # against the float32 run becomes a note.
    check_in_float32: bool = False

    def __post_init__(self):
        self.peers = tuple(self.peers)
        labels = [p.label for p in self.all_peers()]
        if len(set(labels)) < len(labels) or set(labels) & {"torchops", "eager", "compiled"}:
            raise ValueError(f"bench case {self.name!r}: peer labels {labels} must be unique "
                             "and differ from torchops, eager and compiled")

    def all_peers(self, device: str | None = None) -> tuple[Peer, ...]:
        """`peer` then `peers`; with `device`, those that run there."""
        every = ((self.peer,) if self.peer is not None else ()) + self.peers
        return tuple(p for p in every if device is None or p.devices is None
                     or device in p.devices)

    def grad_args(self) -> tuple[int, ...]:
        """Which arguments make_inputs marks as requiring gradients."""
        if isinstance(self.requires_grad, tuple):
            return self.requires_grad
        return (0,) if self.backward or self.requires_grad else ()

    def missing(self) -> str | None:
        if not hasattr(torch.ops.torchops, self.op):
            return f"torch.ops.torchops.{self.op} is not registered in this build"
        return None

    def torchops_fn(self) -> Callable:
        return getattr(torch.ops.torchops, self.op).default

    def make_inputs(self, size: Size, device: str) -> tuple:
        """The op's arguments at `size` on `device`: floating tensors in the
        size's dtype; those of grad_args() (with backward, the first one: the
        features, logits, ...) require their gradient.  A factory's
        inputs.Call keeps its keyword arguments (an inputs.Call again) and
        the dtype of the arguments it names in `keep`; tensors in lists are
        copied into tensors of their own (a factory may give views of one
        pool)."""
        made = self.inputs(size.params)
        keep = getattr(made, "keep", frozenset())

        def move(a, kept: bool, copy: bool = False):
            if isinstance(a, torch.Tensor):
                dtype = a.dtype if kept or not a.is_floating_point() else size.dtype
                return a.to(device, dtype, copy=copy)
            if isinstance(a, list):
                return [move(t, kept, True) for t in a]
            return a
        args = [move(a, i in keep) for i, a in enumerate(made)]
        for i in self.grad_args():
            args[i].requires_grad_()
        if isinstance(made, inputs.Call):
            return inputs.Call(args, {k: move(v, k in keep) for k, v in made.kwargs.items()},
                               keep)
        return tuple(args)

    def written(self, args: tuple) -> list:
        """The arguments of `args` that the op writes (its schema's `(a!)`
        ones, in the schema's order; None where not given): tensors or lists."""
        kwargs = getattr(args, "kwargs", {})
        return [kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
                for i, a in enumerate(self.torchops_fn()._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write]

    def sizes_for(self, device: str, quick: bool) -> list[Size]:
        sizes = list(self.sizes.get(device, ()))
        return ([s for s in sizes if s.quick] or sizes[:1]) if quick else sizes


def _torchvision(op: str, adapt: Callable = lambda f: f, slow: bool = False) -> Peer:
    def load():
        import torchvision.ops

        return adapt(getattr(torchvision.ops, op))
    return Peer(f"torchvision.ops.{op}", load, slow)


def _padded_kept(nms: Callable) -> Callable:
    """An nms as nms_padded returns its result: (kept indices then -1, count)."""
    def padded(boxes, scores, iou_threshold):
        kept = nms(boxes, scores, iou_threshold)
        keep = torch.full((boxes.shape[0],), -1, dtype=torch.int64, device=boxes.device)
        keep[:kept.shape[0]] = kept
        return keep, torch.tensor(kept.shape[0], device=boxes.device)
    return padded


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _mm(n, dtype=torch.float32, b=None, quick=False, m=None, k=None, tag="", wt=False,
        **extra):
    """(B x) m x k @ k x n, square by default; tag: a word for the label; wt: B
    is w.t() of an (n, k) weight (a linear layer's layout)."""
    m, k = m or n, k or n
    label = f"{m}x{k}x{n}" if b is None else f"{b} x {m}x{k}x{n}"
    tag = " ".join(t for t in (tag, "B=W^T" if wt else "") if t)
    return Size(label + (f" {tag}" if tag else ""), {"m": m, "k": k, "n": n, "b": b, "wt": wt},
                dtype, quick, **extra)


def _elements(n, dtype=torch.float32, quick=False):
    return Size(f"2^{n.bit_length() - 1}", {"n": n}, dtype, quick)


def _boxes(n, regime, quick=False, threads=("all",), **extra):
    return Size(f"n={n} {regime}", {"n": n, "regime": regime, **extra}, torch.float32, quick,
                threads)


def _rois(n, c, h, w, rois, quick=False, threads=("all",)):
    return Size(f"{n}x{c}x{h}x{w}, {rois} RoIs", {"n": n, "c": c, "h": h, "w": w, "rois": rois},
                torch.float32, quick, threads)


def _roi_fwd_bytes(args, backward=False) -> float:
    """Features and RoIs read, pooled output written; backward: the output's
    gradient read, the features' gradient written."""
    x, rois, _, ph, pw = args[:5]
    out = rois.shape[0] * x.shape[1] * ph * pw * x.element_size()
    return _nbytes(x, rois) + out + (out + _nbytes(x) if backward else 0)


def _argmax_bytes(args) -> float:
    return args[1].shape[0] * args[0].shape[1] * args[3] * args[4] * 8  # roi_pool's int64 argmax


bf16, f16 = torch.bfloat16, torch.float16
SCALING = (1, 2, "all")   # CPU rows that show how an op scales with threads
# Detection-sized RoI problems (two images, 256 channels, 1000 RoIs), and a small one.
ROI_CUDA = [_rois(2, 256, 200, 200, 1000), _rois(2, 256, 50, 50, 256, quick=True)]
ROI_CPU = [_rois(2, 256, 100, 100, 256, quick=True, threads=SCALING)]
ROI_CPU_BWD = [_rois(2, 256, 100, 100, 256, quick=True)]
D_SIGMOID = dict(op="d_sigmoid", inputs=inputs.vector, reference=references.d_sigmoid,
                 reference_name="s*(1-s), s=torch.sigmoid(z)")
TV_ROI_ALIGN = dict(adapt=lambda f: lambda x, rois, scale, ph, pw, sr, aligned:
                    f(x, rois, (ph, pw), scale, sr, aligned))
ROI_ALIGN = dict(op="roi_align", inputs=inputs.roi_align_args, reference=references.roi_align,
                 reference_name="gather formula", peer=_torchvision("roi_align", **TV_ROI_ALIGN))
ROI_POOL = dict(op="roi_pool", inputs=inputs.roi_pool_args, peer=_torchvision(
    "roi_pool", adapt=lambda f: lambda x, rois, scale, ph, pw: f(x, rois, (ph, pw), scale)))

def _deform_roi_bytes(args, backward=False) -> float:
    """Features, RoIs and offsets read, pooled output written; backward: the
    output's gradient and the features read, the features' and offsets'
    gradients written."""
    x, rois, off, _, ph, pw = args[:6]
    out = rois.shape[0] * x.shape[1] * ph * pw * x.element_size()
    fwd = _nbytes(x, rois, off) + out
    return fwd + (out + 2 * _nbytes(x) + _nbytes(off) if backward else 0)


# deform_roi_pool's peer: our own roi_align with aligned=True on the same
# features and RoIs (the bins deform_roi_pool moves; with the benchmark's zero
# offsets, the same samples).
DEFORM_ROI_POOL = dict(
    op="deform_roi_pool", inputs=inputs.deform_roi_pool_args,
    reference=references.deform_roi_pool, reference_name="gather formula",
    peer=Peer("torchops.roi_align (aligned=True)", lambda: lambda x, rois, off, scale, ph, pw, sr,
              gamma: torch.ops.torchops.roi_align.default(x, rois, scale, ph, pw, sr, True)))
DEFORM_ROI_NOTE = ("7x7 bins, sampling_ratio 2, gamma 0.1, spatial_scale 1/8, zero offsets. "
                   "Peer: torchops.roi_align (aligned=True), the target (within 1.2x).")

CASES: list[Case] = [
    # Square and LLM-shaped products, decode rows included.  torch.compile of torch.matmul is the
    # same cuBLAS/BLAS call: not timed.
    Case(name="matmul", op="matmul", inputs=inputs.matrices, compile=False, sizes={
        "cuda": [_mm(512, quick=True), _mm(2048, tag="exact"), _mm(4096, tag="exact"),
                 _mm(4096, tag="TF32", fp32_precision="high"),
                 _mm(4096, bf16), _mm(4096, f16), _mm(8192, bf16), _mm(8192, f16),
                 _mm(4093, bf16, m=4095, k=4097), _mm(3000, bf16, m=1000, k=768),
                 _mm(1024, bf16, m=8192, k=8192), _mm(1024, bf16, m=1024, k=16384),
                 _mm(4096, bf16, tag="Ampere path", env={"TORCHOPS_TESTING_MATMUL_PATH": "sm80"}),
                 _mm(64, f16, b=512), _mm(512, bf16, b=32), _mm(1024, torch.float64),
                 # Beyond the targets: few output tiles (split-K's rule), a batch of
                 # tokens against a linear layer's weight.
                 _mm(1024, tag="exact"), _mm(1024, bf16), _mm(4096, bf16, m=128, wt=True)],
        "cpu": [_mm(256, quick=True, threads=(1, 2)), _mm(1024, threads=SCALING),
                _mm(256, b=16),
                # A few rows against a row-major B (read in place), and a linear
                # layer's layout: against a transposed weight.
                _mm(1024, m=16, threads=(1, "all")),
                _mm(1024, m=16, wt=True, threads=(1, "all")),
                _mm(4096, m=1, wt=True, threads=(1,))]},
         reference=torch.matmul, reference_name="torch.matmul (cuBLAS / CPU BLAS)",
         flops=lambda a: 2.0 * a[0].numel() * a[1].shape[-1],
         note="The eager reference is the vendor BLAS (torch.mm/bmm), i.e. the peer. "
              "Datasheet peaks, H200/H100 SXM: 989 TFLOP/s dense bf16/fp16, 495 TF32, 67 fp32."),
    # Decode: one to 16 rows against a weight, bound by reading B; the targets'
    # row-major 4096 x 4096, then a linear layer's layout (x @ W.T) and a short
    # K, which split-K and the column slices trade against each other.
    Case(name="matmul decode", op="matmul", inputs=inputs.matrices, compile=False, sizes={
        "cuda": [_mm(4096, bf16, m=16, quick=True), _mm(4096, bf16, m=1),
                 _mm(4096, bf16, m=16, wt=True), _mm(1024, bf16, m=16, k=4096, wt=True),
                 _mm(4096, bf16, m=16, k=1024)]},
         reference=torch.matmul, reference_name="torch.matmul (cuBLAS)",
         bytes=lambda a: sum(t.numel() * t.element_size() for t in a)
         + a[0].shape[0] * a[1].shape[1] * a[0].element_size(),
         note="GB/s: A and B read once, C written once. Datasheet HBM: H200 4.8 TB/s, "
              "H100 SXM 3.35 TB/s."),
    Case(name="d_sigmoid", **D_SIGMOID, sizes={
        "cuda": [_elements(1 << 16, quick=True), _elements(1 << 20), _elements(1 << 24),
                 _elements(1 << 24, bf16)],
        "cpu": [_elements(1 << 16, quick=True), _elements(1 << 20), _elements(1 << 24)]},
         bytes=lambda a: 2 * _nbytes(a[0])),
    # Forward reads z and writes y; backward reads the gradient and z, writes z's.
    Case(name="d_sigmoid fwd+bwd", **D_SIGMOID, backward=True, sizes={
        "cuda": [_elements(1 << 20, quick=True), _elements(1 << 24)],
        "cpu": [_elements(1 << 16, quick=True), _elements(1 << 20)]},
         bytes=lambda a: 5 * _nbytes(a[0])),
    Case(name="nms", op="nms", inputs=inputs.nms_args, sizes={
        "cuda": [_boxes(n, r, quick=(n == 1000 and r == "sparse"))
                 for n in (1000, 5000, 20000, 100000) for r in ("sparse", "dense")],
        "cpu": [_boxes(5000, r, quick=(r == "sparse"), threads=SCALING)
                for r in ("sparse", "dense")]},
         peer=_torchvision("nms"),
         note="No eager reference: exact NMS is a sequential loop over the boxes."),
    Case(name="batched_nms", op="batched_nms", inputs=inputs.batched_nms_args, sizes={
        "cuda": [_boxes(5000, "dense", quick=True, classes=80), _boxes(20000, "dense", classes=80)],
        "cpu": [_boxes(5000, "dense", quick=True, threads=SCALING, classes=80)]},
         peer=_torchvision("batched_nms"), note="80 classes. No eager reference (see nms)."),
    # The static-shape form, with torchvision's nms padded the same way: the
    # time of a call with no host sync (torchvision's has one).
    Case(name="nms_padded", op="nms_padded", inputs=inputs.nms_args, sizes={
        "cuda": [_boxes(n, r, quick=(n == 1000 and r == "sparse"))
                 for n in (1000, 2000, 5000) for r in ("sparse", "dense")],
        "cpu": [_boxes(1000, "dense", quick=True)]},
         peer=_torchvision("nms", adapt=_padded_kept), compile=False,
         note="keep (N,) padded with -1 and the count, no host sync. "
              "Target (CUDA): 1000 boxes <= 30 us."),
    Case(name="box_iou", op="box_iou", inputs=inputs.box_pairs, sizes={
        "cuda": [Size("1000 x 1000", {"n": 1000, "m": 1000}, quick=True),
                 Size("5000 x 5000", {"n": 5000, "m": 5000}),
                 Size("20000 x 1000", {"n": 20000, "m": 1000})],
        "cpu": [Size("1000 x 1000", {"n": 1000, "m": 1000}, quick=True),
                Size("5000 x 5000", {"n": 5000, "m": 5000})]},
         reference=references.box_iou, reference_name="broadcast formula",
         peer=_torchvision("box_iou"),
         bytes=lambda a: _nbytes(*a) + a[0].shape[0] * a[1].shape[0] * a[0].element_size()),
    Case(name="roi_align", **ROI_ALIGN, sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU},
         bytes=_roi_fwd_bytes, note="7x7 bins, sampling_ratio 2, aligned=True, spatial_scale 1/8."),
    Case(name="roi_align fwd+bwd", **ROI_ALIGN, backward=True,
         sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU_BWD}, bytes=lambda a: _roi_fwd_bytes(a, True)),
    Case(name="roi_align fwd+bwd deterministic", op="roi_align", inputs=inputs.roi_align_args,
         backward=True, deterministic=True, sizes={"cuda": ROI_CUDA[:1]},
         peer=_torchvision("roi_align", slow=True, **TV_ROI_ALIGN),
         bytes=lambda a: _roi_fwd_bytes(a, True),
         note="Under torch.use_deterministic_algorithms(True). torchvision then runs its "
              "pure-PyTorch path (tens of seconds, GBs): timed only with --slow."),
    Case(name="roi_pool", **ROI_POOL, sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU},
         bytes=lambda a: _roi_fwd_bytes(a) + _argmax_bytes(a),
         note="No eager reference: max over variable-size bins does not vectorise simply."),
    # The argmax is written forward and read backward.
    Case(name="roi_pool fwd+bwd", **ROI_POOL, backward=True,
         sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU_BWD},
         bytes=lambda a: _roi_fwd_bytes(a, True) + 2 * _argmax_bytes(a)),
    Case(name="deform_roi_pool", **DEFORM_ROI_POOL, sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU},
         bytes=_deform_roi_bytes, note=DEFORM_ROI_NOTE),
    # The backward computes the offsets' gradient too (the op always does
    # when given offsets), though only the features' is asked for here.
    Case(name="deform_roi_pool fwd+bwd", **DEFORM_ROI_POOL, backward=True,
         sizes={"cuda": ROI_CUDA, "cpu": ROI_CPU_BWD},
         bytes=lambda a: _deform_roi_bytes(a, True), note=DEFORM_ROI_NOTE),
    Case(name="deform_roi_pool fwd+bwd deterministic", **{**DEFORM_ROI_POOL, "reference": None},
         backward=True,
         deterministic=True, sizes={"cuda": ROI_CUDA[:1]},
         bytes=lambda a: _deform_roi_bytes(a, True),
         note=DEFORM_ROI_NOTE + " Under torch.use_deterministic_algorithms(True), the peer too."),
    # Forward reads logits and targets; backward reads both again, writes the gradient.
    Case(name="sigmoid_focal_loss fwd+bwd", op="sigmoid_focal_loss", inputs=inputs.focal_loss_args,
         backward=True, sizes={
             "cuda": [Size("8192x80", {"n": 8192, "c": 80}, quick=True),
                      Size("65536x80", {"n": 65536, "c": 80})],
             "cpu": [Size("8192x80", {"n": 8192, "c": 80}, quick=True)]},
         reference=references.sigmoid_focal_loss, reference_name="torchvision's formula",
         peer=_torchvision("sigmoid_focal_loss", adapt=lambda f: lambda x, t, alpha, gamma, red:
                           f(x, t, alpha=alpha, gamma=gamma, reduction=red)),
         bytes=lambda a: 5 * _nbytes(a[0]), note="alpha 0.25, gamma 2, reduction 'mean'."),
]


# --- masked_conv2d: a guided-anchoring head, 256 -> 256, 3x3, pad 1 -----------------------------

def _masked(density: float, dtype=torch.float32, quick=False, threads=None, train=False):
    """N=2, 256 -> 256 channels at 100x152, `density` of the positions
    selected, under PyTorch's default settings: on CUDA float32 runs on TF32
    tensor cores in conv2d (the reference) and masked_conv2d alike, both
    following torch.backends.cudnn.allow_tf32."""
    return Size(f"2x256x100x152 3x3, {density:.0%}",
                {"n": 2, "c": 256, "h": 100, "w": 152, "density": density,
                 "weight_grad": train}, dtype, quick, threads or ("all",))


def _masked_flops(args, backward=False) -> float:
    """Useful FLOPs: the selected positions' convolution (forward; the
    backward's two GEMMs double it when the weight is trained, one when not)."""
    x, mask, weight = args[:3]
    selected = int((mask > 0).sum()) * (x.shape[0] if mask.shape[0] == 1 else 1)
    fwd = 2.0 * weight.numel() * selected
    if not backward:
        return fwd
    return fwd * (3 if weight.requires_grad else 2)


MASKED_CONV = dict(op="masked_conv2d", inputs=inputs.masked_conv_args, conv_precision=True,
                   reference=references.masked_conv2d,
                   reference_name="F.conv2d + torch.where (cuDNN / oneDNN)")
MASKED_CPU_THREADS = (2, 16)
CASES += [
    Case(name="masked_conv2d", **MASKED_CONV, sizes={
        "cuda": [_masked(0.05, quick=True), _masked(0.25), _masked(1.0),
                 _masked(0.05, bf16)],
        "cpu": [_masked(d, threads=MASKED_CPU_THREADS, quick=d == 0.05)
                for d in (0.05, 0.25, 1.0)]},
         flops=_masked_flops,
         note="Targets, PyTorch's default settings: against conv2d + where >= 3x at 5%, "
              ">= 1x at 25%, >= 0.9x at 100%. FLOPs count the selected positions only."),
    Case(name="masked_conv2d fwd+bwd", **MASKED_CONV, backward=True, sizes={
        "cuda": [_masked(0.05, quick=True, train=True)],
        "cpu": [_masked(0.05, threads=MASKED_CPU_THREADS, quick=True, train=True)]},
         flops=lambda a: _masked_flops(a, backward=True),
         note="Gradients of input, weight and bias."),
]

# --- deform_conv2d ------------------------------------------------------------------------
def _deform(n, c, h, w, mask=True, dtype=torch.float32, quick=False, threads=("all",), **extra):
    what = "zero offsets" if extra.get("zero_offsets") else "mask" if mask else "no mask"
    label = f"{n}x{c}x{h}x{w} 3x3 {what}"
    return Size(label, {"n": n, "c": c, "o": c, "h": h, "w": w, "mask": mask, **extra}, dtype,
                quick, threads)


def _deform_flops(args, backward=False) -> float:
    """The GEMMs: weight @ columns forward; backward adds weight^T @ grad and
    grad @ columns^T."""
    x, weight = args[0], args[1]
    n, o, (kh, kw) = x.shape[0], weight.shape[0], weight.shape[2:]
    out_h = (x.shape[2] + 2 * args[7] - (args[9] * (kh - 1) + 1)) // args[5] + 1
    out_w = (x.shape[3] + 2 * args[8] - (args[10] * (kw - 1) + 1)) // args[6] + 1
    return 2.0 * n * o * weight.shape[1] * kh * kw * out_h * out_w * (3 if backward else 1)


def _tv_deform_conv2d(f):
    """torchvision.ops.deform_conv2d on the op's arguments; it has no
    bfloat16 kernel, so bfloat16 rows run it in float32."""
    def call(x, w, off, mask, b, sh, sw, ph, pw, dh, dw, groups, og, use_mask):
        dt = x.dtype
        cast = (lambda t: t.float()) if dt == torch.bfloat16 else (lambda t: t)
        out = f(cast(x), cast(off), cast(w), cast(b), (sh, sw), (ph, pw), (dh, dw),
                cast(mask) if use_mask else None)
        return out.to(dt)
    return call


def _conv2d_peer():
    """cuDNN's convolution of the same shapes (offsets and mask ignored): the
    lower bound of a deformable convolution, which does its work and more."""
    def load():
        import torch.nn.functional as F

        return lambda x, w, off, mask, b, sh, sw, ph, pw, dh, dw, groups, og, use_mask: \
            F.conv2d(x, w, b, (sh, sw), (ph, pw), (dh, dw), groups)
    return Peer("torch.nn.functional.conv2d (cuDNN)", load)


DEFORM_CUDA = [_deform(8, 256, 64, 64), _deform(8, 256, 64, 64, mask=False),
               _deform(2, 64, 128, 128, quick=True), _deform(2, 64, 128, 128, mask=False),
               _deform(8, 256, 64, 64, dtype=bf16)]
DEFORM_CPU = [_deform(2, 64, 64, 64, quick=True, threads=(2, 16))]
DEFORM = dict(op="deform_conv2d", inputs=inputs.deform_conv2d_args,
              reference=references.deform_conv2d, reference_name="gather formula",
              peer=_torchvision("deform_conv2d", adapt=_tv_deform_conv2d),
              note="3x3, stride 1, padding 1, one offset group; offsets ~N(0, 2) pixels. "
                   "torchvision has no bfloat16 kernel: its bfloat16 rows run in float32. "
                   "TFLOP/s count the GEMMs only. float32 at PyTorch's default convolution "
                   "precision: the GEMMs run as 3xTF32 (float32-sized error), the forward's "
                   "split inside the GEMM kernel on Hopper (docs/design.md).")
DEFORM_BOUND = dict(op="deform_conv2d", inputs=inputs.deform_conv2d_args, compile=False,
                    peer=_conv2d_peer(),
                    note="Offsets 0 and mask 1, where the op equals a convolution: cuDNN's "
                         "conv2d of the same shapes is the lower bound (torchops also samples "
                         "bilinearly, and its backward computes offset and mask gradients).")
CASES += [
    Case(name="deform_conv2d", **DEFORM, sizes={"cuda": DEFORM_CUDA, "cpu": DEFORM_CPU},
         flops=_deform_flops),
    Case(name="deform_conv2d fwd+bwd", **{**DEFORM, "inputs": lambda p: inputs.deform_conv2d_args(
        {**p, "train": "all"})}, backward=True, sizes={"cuda": DEFORM_CUDA, "cpu": DEFORM_CPU},
         flops=lambda a: _deform_flops(a, True)),
    Case(name="deform_conv2d vs conv2d", **DEFORM_BOUND,
         sizes={"cuda": [_deform(8, 256, 64, 64, zero_offsets=True, quick=True),
                         _deform(2, 64, 128, 128, zero_offsets=True)]},
         flops=_deform_flops),
    Case(name="deform_conv2d vs conv2d fwd+bwd", **{**DEFORM_BOUND, "inputs": lambda p:
         inputs.deform_conv2d_args({**p, "train": "weights"})}, backward=True,
         sizes={"cuda": [_deform(8, 256, 64, 64, zero_offsets=True, quick=True)]},
         flops=lambda a: _deform_flops(a, True)),
]


def select(names: list[str] | None) -> list[Case]:
    """Cases whose case name or operator name is in `names` (all when None)."""
    known = {c.name for c in CASES} | {c.op for c in CASES}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {sorted(known)}")
    return [c for c in CASES if not names or c.name in names or c.op in names]


# --- carafe -------------------------------------------------------------------------------
def _carafe(n, c, h, w, k=5, g=1, s=2, dtype=torch.float32, quick=False, threads=("all",)):
    label = f"{n}x{c}x{h}x{w} k{k} g{g} s{s}"
    return Size(label, {"n": n, "c": c, "h": h, "w": w, "k": k, "g": g, "s": s}, dtype, quick,
                threads)


def _carafe_bytes(args, backward=False) -> float:
    """Features and masks read, the output written; backward: the output's
    gradient read, the features' and masks' gradients written."""
    x, masks, _, _, s = args
    out = x.numel() * s * s * x.element_size()
    return _nbytes(x, masks) + out + (out + _nbytes(x, masks) if backward else 0)


# mmcv's CARAFEPack defaults (k 5, one group, scale 2) on an FPN level (256 channels, 100x152).
CARAFE_CUDA = [_carafe(2, 256, 100, 152), _carafe(2, 256, 100, 152, dtype=bf16),
               _carafe(2, 64, 50, 76, quick=True)]
CARAFE_CPU = [_carafe(2, 64, 50, 76, quick=True, threads=(2, 16))]
CARAFE = dict(op="carafe", reference=references.carafe, reference_name="unfold + einsum",
              note="k 5, one group, scale 2 (mmcv's CARAFEPack defaults); softmax kernels.")
CASES += [
    Case(name="carafe", **CARAFE, inputs=inputs.carafe_args,
         sizes={"cuda": CARAFE_CUDA, "cpu": CARAFE_CPU}, bytes=_carafe_bytes),
    Case(name="carafe fwd+bwd", **CARAFE, inputs=lambda p: inputs.carafe_args({**p, "train": True}),
         backward=True, sizes={"cuda": CARAFE_CUDA, "cpu": CARAFE_CPU},
         bytes=lambda a: _carafe_bytes(a, True)),
]


# --- norms ----------------------------------------------------------------------------------
def _norm(rows, d, dtype=torch.float32, quick=False, threads=("all",), **extra):
    return Size(f"{rows}x{d}", {"rows": rows, "d": d, **extra}, dtype, quick, threads)


def _norm_sizes(kind: str, train: bool = False) -> dict:
    p = {"kind": kind, "train": train}
    return {"cuda": [_norm(16384, 4096, bf16, **p), _norm(16384, 4096, **p),
                     _norm(4096, 1024, bf16, quick=True, **p), _norm(4096, 8192, bf16, **p)],
            "cpu": [_norm(4096, 1024, quick=True, threads=(1, "all"), **p),
                    _norm(4096, 1024, bf16, threads=(1, "all"), **p)]}


def _activation_bytes(args) -> int:
    return _nbytes(args[0])


_F_RMS = Peer("torch.nn.functional.rms_norm", lambda: lambda x, shape, w, eps:
              torch.nn.functional.rms_norm(x, shape, w, eps))
_F_LN = Peer("torch.nn.functional.layer_norm", lambda: lambda x, shape, w, b, eps:
             torch.nn.functional.layer_norm(x, shape, w, b, eps))
RMS_NORM = dict(op="rms_norm", inputs=inputs.norm_args, reference=references.rms_norm,
                reference_name="x * rsqrt(mean(x^2) + eps) * w", peer=_F_RMS)
FUSED_ADD_RMS_NORM = dict(op="fused_add_rms_norm", inputs=inputs.norm_args,
                          reference=references.fused_add_rms_norm,
                          reference_name="rms_norm(x + r), x + r")
LAYER_NORM = dict(op="layer_norm", inputs=inputs.norm_args, reference=references.layer_norm,
                  reference_name="(x - mean) * rsqrt(var + eps) * w + b", peer=_F_LN)
NORM_NOTE = "GB/s over the activations each pass must move (weights left out)."
CASES += [
    # Forward: x read, y written.  Forward + backward adds grad and x read, dx written.
    Case(name="rms_norm", **RMS_NORM, sizes=_norm_sizes("rms"),
         bytes=lambda a: 2 * _activation_bytes(a), note=NORM_NOTE),
    Case(name="rms_norm fwd+bwd", **RMS_NORM, backward=True, sizes=_norm_sizes("rms", True),
         bytes=lambda a: 5 * _activation_bytes(a), note=NORM_NOTE + " Weight gradient too."),
    # x and the residual read, the norm and the sum written; the backward reads
    # both outputs' gradients and the sum, and writes one gradient (shared).
    Case(name="fused_add_rms_norm", **FUSED_ADD_RMS_NORM, sizes=_norm_sizes("fused"),
         bytes=lambda a: 4 * _activation_bytes(a), note=NORM_NOTE),
    Case(name="fused_add_rms_norm fwd+bwd", **FUSED_ADD_RMS_NORM, backward=True,
         sizes=_norm_sizes("fused", True), bytes=lambda a: 8 * _activation_bytes(a),
         note=NORM_NOTE + " Only the input requires grad (with the weight)."),
    Case(name="layer_norm", **LAYER_NORM, sizes=_norm_sizes("ln"),
         bytes=lambda a: 2 * _activation_bytes(a), note=NORM_NOTE),
    Case(name="layer_norm fwd+bwd", **LAYER_NORM, backward=True, sizes=_norm_sizes("ln", True),
         bytes=lambda a: 5 * _activation_bytes(a),
         note=NORM_NOTE + " Weight and bias gradients too."),
]

# --- softmax: attention scores, 16 heads of 128 ---------------------------------------------

def _scores(b, h, s, dtype=torch.float32, quick=False, threads=("all",), mask=False):
    return Size(f"{b}x{h}x{s}x{s}", {"b": b, "h": h, "s": s, "mask": mask}, dtype, quick, threads)


def _causal_bytes(args, backward=False) -> float:
    """The lower triangle read and the whole output written (zeros above
    the diagonal); backward: the triangles of the output and its gradient
    read, the input's gradient written."""
    x = _nbytes(args[0])
    return 1.5 * x + (2 * x if backward else 0)


def _masked_softmax_bytes(args, backward=False) -> float:
    """Scores and mask read, the output written; backward: the output and
    its gradient read, the scores' gradient written."""
    x = _nbytes(args[0])
    return 2 * x + _nbytes(args[1]) + (3 * x if backward else 0)


SOFTMAX_CUDA = [_scores(8, 16, 2048, bf16, quick=True), _scores(8, 16, 2048)]
SOFTMAX_CPU = [_scores(2, 4, 512, quick=True, threads=(1, "all"))]
MASKED_SOFTMAX_CUDA = [_scores(8, 16, 2048, bf16, quick=True, mask=True),
                       _scores(8, 16, 2048, mask=True)]
MASKED_SOFTMAX_CPU = [_scores(2, 4, 512, quick=True, threads=(1, "all"), mask=True)]


def _softmax_path(path, dtype=bf16, quick=True, mask=False):
    """8x16x2048x2048 with TORCHOPS_TESTING_SOFTMAX_PATH forcing a CUDA path."""
    return Size(f"8x16x2048x2048 {path}", {"b": 8, "h": 16, "s": 2048, "mask": mask}, dtype,
                quick, env={"TORCHOPS_TESTING_SOFTMAX_PATH": path})


SOFTMAX_CUDA += [_softmax_path("warp"), _softmax_path("chunked"),
                 _softmax_path("chunked", torch.float32, quick=False)]
MASKED_SOFTMAX_CUDA += [_softmax_path("warp", mask=True), _softmax_path("chunked", mask=True)]
CAUSAL_SOFTMAX = dict(op="scaled_upper_triang_masked_softmax", inputs=inputs.attention_scores,
                      reference=references.scaled_upper_triang_masked_softmax,
                      reference_name="masked_fill(triu) + softmax",
                      sizes={"cuda": SOFTMAX_CUDA, "cpu": SOFTMAX_CPU},
                      note="scale 1/sqrt(128); the output's zeros above the diagonal written.")
MASKED_SOFTMAX = dict(op="scaled_masked_softmax", inputs=inputs.attention_scores,
                      reference=references.scaled_masked_softmax,
                      reference_name="masked_fill + softmax",
                      sizes={"cuda": MASKED_SOFTMAX_CUDA, "cpu": MASKED_SOFTMAX_CPU},
                      note="padding mask (B, 1, S, S): each sequence keeps 1/2 to all keys.")
CASES += [
    Case(name="scaled_upper_triang_masked_softmax", **CAUSAL_SOFTMAX, bytes=_causal_bytes),
    Case(name="scaled_upper_triang_masked_softmax fwd+bwd", **CAUSAL_SOFTMAX, backward=True,
         bytes=lambda a: _causal_bytes(a, True)),
    Case(name="scaled_masked_softmax", **MASKED_SOFTMAX, bytes=_masked_softmax_bytes),
    Case(name="scaled_masked_softmax fwd+bwd", **MASKED_SOFTMAX, backward=True,
         bytes=lambda a: _masked_softmax_bytes(a, True)),
]

# --- activations --------------------------------------------------------------------------------


def _gated(rows, d, dtype=torch.float32, quick=False, threads=("all",), **extra):
    """x of rows x 2d: a LLaMA-style MLP's gate-and-up projection output."""
    return Size(f"{rows}x{2 * d}", {"rows": rows, "d": d, **extra}, dtype, quick, threads)


# Forward: x read, half of it written.  Backward: the output's gradient and x
# read, x's gradient written.
GATED_FWD_BYTES = lambda a: 1.5 * _nbytes(a[0])  # noqa: E731
GATED_FWD_BWD_BYTES = lambda a: 4.0 * _nbytes(a[0])  # noqa: E731
GATED_NOTE = ("Rows of x = [a, b]; CUDA 4096x28672 is d = 14336, a LLaMA-3-8B MLP over 4096 "
              "tokens, and 4096x28670 has an odd d, off the 16-byte packed path.")


def _gated_sizes(approximate=None, backward=False):
    extra = {} if approximate is None else {"approximate": approximate}
    cuda = [_gated(4096, 14336, bf16, quick=True, **extra), _gated(4096, 14336, **extra)]
    if not backward:
        cuda.append(_gated(4096, 14335, bf16, **extra))
    cpu = [_gated(256, 2048, quick=True, threads=(1, "all"), **extra),
           _gated(256, 2048, bf16, threads=(1, "all"), **extra)]
    return {"cuda": cuda, "cpu": cpu}


SILU_AND_MUL = dict(op="silu_and_mul", inputs=inputs.gated_args,
                    reference=references.silu_and_mul, reference_name="F.silu(a) * b",
                    note=GATED_NOTE)
GELU_AND_MUL = dict(op="gelu_and_mul", inputs=inputs.gated_args,
                    reference=references.gelu_and_mul, reference_name="F.gelu(a) * b",
                    note=GATED_NOTE + " approximate='none' (erf).")
CASES += [
    Case(name="silu_and_mul", **SILU_AND_MUL, sizes=_gated_sizes(), bytes=GATED_FWD_BYTES),
    Case(name="silu_and_mul fwd+bwd", **SILU_AND_MUL, backward=True,
         sizes=_gated_sizes(backward=True), bytes=GATED_FWD_BWD_BYTES),
    Case(name="gelu_and_mul", **GELU_AND_MUL, sizes=_gated_sizes("none"),
         bytes=GATED_FWD_BYTES),
    Case(name="gelu_and_mul fwd+bwd", **GELU_AND_MUL, backward=True,
         sizes=_gated_sizes("none", backward=True), bytes=GATED_FWD_BWD_BYTES),
]


# --- rotary -------------------------------------------------------------------------------
def _rotary(b, hq, hk, s, d, dtype=torch.float32, quick=False, threads=("all",), **extra):
    label = f"q ({b},{hq},{s},{d}), k {hk} heads" + (" bshd" if extra.get("layout") else "")
    return Size(label, {"b": b, "hq": hq, "hk": hk, "s": s, "d": d, **extra}, dtype, quick,
                threads)


def _rotary_bytes(args, backward=False) -> float:
    """q and k read and written, cos and sin read; backward: the outputs'
    gradients read, q's and k's written (and, when cos needs its gradient,
    q and k read again, cos's and sin's gradients written)."""
    q, k, cos, sin = args[:4]
    fwd = 2 * _nbytes(q, k) + _nbytes(cos, sin)
    if not backward:
        return fwd
    return fwd + 2 * _nbytes(q, k) + (_nbytes(q, k) + 2 * _nbytes(cos, sin)
                                      if cos.requires_grad else 0)


def _rotary_inplace_reference(positions, q, k, cache, interleaved):
    """The reference written back into q and k, as vLLM's native path does."""
    new_q, new_k = references.rotary_embedding_(positions, q, k, cache, interleaved)
    q.copy_(new_q)
    k.copy_(new_k)


# Llama-3-8B attention at 4 x 4096 tokens (32 query heads, 8 key heads, head size 128).
ROTARY_CUDA = [_rotary(4, 32, 8, 4096, 128, bf16, quick=True), _rotary(4, 32, 8, 4096, 128),
               _rotary(4, 32, 8, 4096, 128, bf16, layout="bshd")]
ROTARY_CPU = [_rotary(2, 8, 2, 512, 128, threads=(1, "all"), quick=True),
              _rotary(2, 8, 2, 512, 128, bf16, threads=(1, "all"))]
ROTARY = dict(op="rotary_embedding", reference=references.rotary_embedding,
              reference_name="HF apply_rotary_pos_emb formula")
CASES += [
    Case(name="rotary_embedding", **ROTARY, inputs=inputs.rotary_args,
         sizes={"cuda": ROTARY_CUDA, "cpu": ROTARY_CPU}, bytes=_rotary_bytes,
         note="Inference: no input requires grad."),
    Case(name="rotary_embedding training fwd", **ROTARY, inputs=inputs.rotary_args,
         requires_grad=(0, 1), sizes={"cuda": ROTARY_CUDA, "cpu": ROTARY_CPU},
         bytes=_rotary_bytes,
         note="Forward only, q and k require grad (cos and sin do not, as HF's rotary module "
              "makes them): compiled code then also saves what its backward needs."),
    Case(name="rotary_embedding fwd+bwd", **ROTARY, inputs=inputs.rotary_args, backward=True,
         requires_grad=(0, 1), sizes={"cuda": ROTARY_CUDA, "cpu": ROTARY_CPU},
         bytes=lambda a: _rotary_bytes(a, True), note="Gradients of q and k."),
    Case(name="rotary_embedding fwd+bwd cos grad", **ROTARY, inputs=inputs.rotary_args,
         backward=True, requires_grad=(0, 1, 2, 3),
         sizes={"cuda": ROTARY_CUDA[:1], "cpu": ROTARY_CPU[:1]},
         bytes=lambda a: _rotary_bytes(a, True),
         note="Gradients of q, k, cos and sin (cos's summed over heads)."),
    Case(name="rotary_embedding_", op="rotary_embedding_", inputs=inputs.rotary_cache_args,
         reference=_rotary_inplace_reference,
         reference_name="vLLM forward_native formula, copied back into q and k",
         sizes={"cuda": [Size("T=16384, q 32 heads, k 8, D 128", {"t": 16384, "hq": 32, "hk": 8,
                                                                    "d": 128, "max_pos": 4096},
                              bf16, quick=True)],
                "cpu": [Size("T=1024, q 8 heads, k 2, D 128", {"t": 1024, "hq": 8, "hk": 2,
                                                                 "d": 128, "max_pos": 4096},
                              threads=(1, "all"), quick=True)]},
         bytes=lambda a: 2 * _nbytes(a[1], a[2]) + a[0].numel() * a[3].shape[1] * a[3].element_size(),
         note="In place, every variant; the check column compares nothing (no outputs)."),
]


# --- peers of the transformer-layer ops ------------------------------------------------------
# PyTorch's native op and Liger-Kernel's (torchops/bench/peers.py) on every case of an op
# they implement, each timed in the same run as eager and compiled.
from torchops.bench import peers as _peers  # noqa: E402

_peers.attach(CASES)


# --- losses: fused linear cross-entropy --------------------------------------------------------
def _lce(n, h, v, dtype=bf16, quick=False, threads=("all",), softcap=None, tag=""):
    label = f"N={n} H={h} V={v}" + (f" {tag}" if tag else "")
    return Size(label, {"n": n, "h": h, "v": v, "softcap": softcap}, dtype, quick, threads)


def _lce_flops(args, backward=False) -> float:
    """The GEMMs: the logits forward; backward adds the input's and the
    weight's gradients (three in all, 6 N H V)."""
    x, w = args[0], args[1]
    return 2.0 * x.numel() * w.shape[0] * (3 if backward else 1)


# The targets' shape (Llama 3's head over 8192 tokens), a 32k and a 256k
# vocabulary, and Gemma 2 9B's head (H 3584, V 256000, logits capped at 30).
LCE_CUDA = [_lce(8192, 4096, 128256, quick=True), _lce(8192, 4096, 32000),
            _lce(8192, 4096, 256000), _lce(8192, 3584, 256000, softcap=30.0, tag="softcap 30")]
LCE_CPU = [_lce(256, 256, 8000, torch.float32, quick=True),
           _lce(1024, 1024, 32000, torch.float32, threads=(1, "all"))]
LCE = dict(op="fused_linear_cross_entropy", inputs=inputs.linear_cross_entropy_args,
           reference=references.fused_linear_cross_entropy,
           reference_name="F.cross_entropy(F.linear(x, w).float())", memory=True,
           peers=(_peers.liger("fused_linear_cross_entropy"),),
           sizes={"cuda": LCE_CUDA, "cpu": LCE_CPU})
LCE_NOTE = ("No bias, reduction 'mean', targets uniform over the vocabulary; the weight scaled "
            "by 1/sqrt(H). TFLOP/s count the GEMMs (2 N H V forward, 6 N H V with the "
            "gradients). Targets (CUDA, N=8192 H=4096 V=128256 bf16): fwd+bwd <= 38 ms and "
            "<= 0.1 GiB beyond the gradients; forward >= 1.3x compiled; CPU (N=1024 H=1024 "
            "V=32000 float32, all threads) >= 1x compiled and <= 1/4 of eager's peak memory.")
CASES += [
    Case(name="fused_linear_cross_entropy", **LCE, flops=_lce_flops,
         note=LCE_NOTE + " Evaluation: no input requires grad."),
    Case(name="fused_linear_cross_entropy fwd+bwd", **LCE, backward=True, requires_grad=(0, 1),
         flops=lambda a: _lce_flops(a, True),
         note=LCE_NOTE + " Gradients of the hidden states and the weight."),
]


# --- optim: multi-tensor optimizer steps ---------------------------------------------------
def _model(layers, d, ffn, vocab=32000, dtype=torch.float32, quick=False, threads=("all",),
           final_norm=True, **extra):
    """The parameters of a Llama-style decoder (inputs.llama_shapes), labelled
    by their count: d 2048, 22 layers, ffn 5632 and a 32k vocabulary make
    1.2B parameters in 200 tensors."""
    p = {"layers": layers, "d": d, "ffn": ffn, "vocab": vocab, "final_norm": final_norm, **extra}
    shapes = inputs.llama_shapes(p)
    n = sum(math.prod(s) for s in shapes)
    count = next(f"{n / s:.3g}{u}" for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                 if n >= s)
    return Size(f"{count} in {len(shapes)} tensors (d {d}, {layers} layers)", p, dtype, quick,
                threads)


def _adam_bytes(args) -> float:
    """Gradients read; moments (and amsgrad's maxima) read and written; the
    parameters read and written, or with masters the masters read and
    written and the low-precision parameters written: 28 bytes a parameter
    in float32, and in bf16 with float32 masters and bf16 gradients."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = args[:5]
    masters = args.kwargs.get("master_params")
    both = [*exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *(masters or params)]
    return 2 * _nbytes(*both) + _nbytes(*grads) + (_nbytes(*params) if masters else 0)


def _model_sizes(dtype=torch.float32, **extra) -> dict:
    """Per device a quick model and the targets' (CUDA 1.2B parameters in 200
    tensors; CPU 100M in 100, at 1 and all threads); `extra`: the input
    factory's other params."""
    both = (1, "all")
    return {"cuda": [_model(8, 1024, 2816, dtype=dtype, quick=True, **extra),
                     _model(22, 2048, 5632, dtype=dtype, **extra)],
            "cpu": [_model(4, 64, 172, 1000, dtype, quick=True, threads=both, **extra),
                    _model(11, 768, 2048, dtype=dtype, threads=both, final_norm=False, **extra)]}


# The reference (torch.optim.Adam's update, in torchops.references) checks
# one step on fresh copies, untimed: the alternatives timed are PyTorch's own
# steps on the same tensors.
ADAM = dict(op="fused_adam_", inputs=inputs.adam_args, reference=references.fused_adam_,
            reference_name="torch.optim.Adam's for-loop update", eager=False, compile=False,
            in_place=True, bytes=_adam_bytes)
ADAM_NOTE = ("One AdamW step (lr 1e-3, weight decay 0.01, no amsgrad) over a Llama-style "
             "model's parameters, in place; the same buffers every call. GB/s over the bytes "
             "moved (28 a parameter: gradient read, moments and parameter read and written). "
             "The check compares the parameters and states after one step on fresh copies.")
CASES += [
    Case(name="fused_adam_ AdamW", **ADAM, peers=_peers.torch_optim("fused_adam_"),
         sizes=_model_sizes(),
         note=ADAM_NOTE + " Targets: CUDA 1.2B >= 1.05x fused (>= 88% of copy); CPU >= 1.1x "
                          "fused or >= 90% of the copy roofline, at 1 and all threads."),
    Case(name="fused_adam_ AdamW bf16 master", **ADAM, sizes=_model_sizes(bf16, master=True),
         note=ADAM_NOTE + " bf16 parameters and gradients, float32 masters and moments: the "
                          "masters read and written, the bf16 copy written. PyTorch has no "
                          "fused equivalent: the target is >= 85% of the copy roofline."),
]

def _sgd_bytes(args) -> float:
    """Bytes an SGD step with momentum moves: gradient read, buffer and
    parameter (the float32 master with masters) read and written, the bf16
    parameter written with masters."""
    params, grads, bufs = args[:3]
    masters = args.kwargs.get("master_params")
    return (2 * _nbytes(*bufs, *(masters or params)) + _nbytes(*grads)
            + (_nbytes(*params) if masters else 0))


SGD = dict(op="fused_sgd_", inputs=inputs.sgd_args, reference=references.fused_sgd_,
           reference_name="torch.optim.SGD's for-loop update", eager=False, compile=False,
           in_place=True, bytes=_sgd_bytes)
SGD_NOTE = ("One SGD step with momentum 0.9 (lr 1e-3, buffers present) over a Llama-style "
            "model's parameters, in place; the same buffers every call. GB/s over the bytes "
            "moved (20 a float32 parameter). The check compares parameters and buffers after "
            "one step on fresh copies.")
CASES += [
    Case(name="fused_sgd_ momentum", **SGD, peers=_peers.torch_optim("fused_sgd_"),
         sizes=_model_sizes(), note=SGD_NOTE + " Target: CUDA >= 1.0x fused."),
    Case(name="fused_sgd_ momentum bf16 master", **SGD, sizes=_model_sizes(bf16, master=True),
         note=SGD_NOTE + " bf16 parameters and gradients, float32 masters and buffers."),
]

# Gradient clipping's pieces: declared ahead of their ops (skipped, with the
# reason, while torch.ops.torchops has no such op); a reference in
# torchops.references, once there, checks them too.
MULTI_TENSOR = dict(eager=False, compile=False, inputs=inputs.tensor_list_args)


CASES += [
    Case(name="multi_tensor_l2norm", op="multi_tensor_l2norm", **MULTI_TENSOR,
         reference=getattr(references, "multi_tensor_l2norm", None),
         peers=_peers.torch_optim("multi_tensor_l2norm"), sizes=_model_sizes(extra=(False,)),
         bytes=lambda a: _nbytes(*a[0]),
         note="The total L2 norm of a model's gradients (per_tensor=False). Target: CUDA "
              ">= 1.5x get_total_norm."),
    Case(name="multi_tensor_scale_", op="multi_tensor_scale_", **MULTI_TENSOR, in_place=True,
         reference=getattr(references, "multi_tensor_scale_", None),
         peers=_peers.torch_optim("multi_tensor_scale_"), sizes=_model_sizes(extra=(-1.0,)),
         bytes=lambda a: 2 * _nbytes(*a[0]),
         note="A model's gradients scaled in place by -1 (repeated calls keep the values: "
              "no underflow into denormals)."),
]


# --- detection: multi-scale deformable attention ---------------------------------------------
DETR_LEVELS = [(100, 150), (50, 75), (25, 38), (13, 19)]


def _msda(levels, b=2, q=None, dtype=torch.float32, quick=False, threads=("all",), tag=""):
    s = sum(h * w for h, w in levels)
    label = f"B={b} S={s} Q={q or s}" + (f" {tag}" if tag else "")
    return Size(label, {"levels": levels, "b": b, "q": q, "heads": 8, "c": 32, "points": 4},
                dtype, quick, threads)


def _msda_bytes(args, backward=False) -> float:
    """value, locations and weights read, the output written; backward: the
    output's gradient and the forward's inputs read again, their gradients
    written."""
    value, _, _, loc, attn = args
    out = loc.shape[0] * loc.shape[1] * value.shape[2] * value.shape[3] * value.element_size()
    fwd = _nbytes(value, loc, attn) + out
    return fwd + (out + 2 * _nbytes(value, loc, attn) if backward else 0)


MSDA_CUDA = [_msda(DETR_LEVELS, tag="encoder"), _msda(DETR_LEVELS, q=300, tag="decoder"),
             _msda(DETR_LEVELS, dtype=bf16, tag="encoder"),
             _msda([(25, 38), (13, 19)], b=1, q=300, quick=True)]
MSDA_CPU = [_msda([(25, 38), (13, 19), (7, 10), (4, 5)], b=1, quick=True, threads=(1, "all"))]
MSDA = dict(op="ms_deform_attn", inputs=inputs.ms_deform_attn_args,
            reference=references.ms_deform_attn_grid_sample,
            check_in_float32=True,
            reference_name="F.grid_sample per level (mmcv's pytorch formulation)",
            sizes={"cuda": MSDA_CUDA, "cpu": MSDA_CPU})
MSDA_NOTE = ("Deformable DETR: 8 heads, 32 channels, 4 points; encoder levels 100x150, 50x75, "
             "25x38, 13x19 (19947 positions; the encoder has a query per position, the decoder "
             "300); points about 2 pixels around each reference point. Targets (CUDA): encoder "
             "forward and fwd+bwd >= 5x compiled, decoder fwd+bwd >= 3x; CPU >= 5x eager. "
             "bfloat16 rows time eager and compiled grid_sample in bfloat16 and check torchops "
             "against the formulation in float32 (inputs widened, output rounded to bfloat16).")
CASES += [
    Case(name="ms_deform_attn", **MSDA, bytes=_msda_bytes, note=MSDA_NOTE),
    Case(name="ms_deform_attn fwd+bwd", **MSDA, backward=True, requires_grad=(0, 3, 4),
         bytes=lambda a: _msda_bytes(a, True),
         note=MSDA_NOTE + " Gradients of value, locations and weights."),
    # grid_sample has no deterministic CUDA backward: the baseline is the
    # explicit gathers (whose backward scatter is deterministic), eager only.
    Case(name="ms_deform_attn fwd+bwd deterministic",
         **{**MSDA, "reference": references.ms_deform_attn, "sizes": {"cuda": MSDA_CUDA[:2]},
            "reference_name": "explicit bilinear gathers"},
         backward=True, requires_grad=(0, 3, 4), deterministic=True, compile=False,
         bytes=lambda a: _msda_bytes(a, True),
         note=MSDA_NOTE + " Under torch.use_deterministic_algorithms(True)."),
]


# --- detection: rotated boxes and soft-NMS ---------------------------------------------------
def _torchvision_if_present(op: str) -> Peer:
    """torchvision's op where the installed version has it (rotated ops are recent)."""
    def load():
        import torchvision.ops

        fn = getattr(torchvision.ops, op, None)
        if fn is None:
            raise ImportError(f"torchvision.ops has no {op}")
        return fn
    return Peer(f"torchvision.ops.{op}", load, devices=("cpu",) if op == "nms_rotated" else None)


def _offset_batched_nms_rotated(boxes, scores, idxs, iou_threshold):
    """detectron2's batched_nms_rotated: each category's centres shifted past
    every other's, then one nms_rotated (in float64, where the shift costs no
    precision)."""
    b = boxes.double()
    span = 2 * (b[:, :2].abs().max() + torch.hypot(b[:, 2], b[:, 3]).max()) + 1
    shifted = torch.cat([b[:, :2] + (idxs.double() * span)[:, None], b[:, 2:]], 1)
    return torch.ops.torchops.nms_rotated(shifted, scores.double(), iou_threshold)


CASES += [
    Case(name="nms_rotated", op="nms_rotated", inputs=inputs.nms_rotated_args, sizes={
        "cuda": [_boxes(1000, "sparse", quick=True), _boxes(5000, "sparse"),
                 _boxes(5000, "dense")],
        "cpu": [_boxes(1000, "dense", quick=True), _boxes(5000, "dense", threads=SCALING),
                _boxes(5000, "sparse", threads=SCALING)]},
         peer=_torchvision_if_present("nms_rotated"),
         note="Angles uniform in [-90, 90) degrees. No eager reference (see nms). Target: "
              "CUDA 5000 boxes <= 1 ms; CPU >= torchvision's nms_rotated where installed."),
    Case(name="batched_nms_rotated", op="batched_nms_rotated",
         inputs=inputs.batched_nms_rotated_args, sizes={
             "cuda": [_boxes(5000, "dense", quick=True, classes=80)],
             "cpu": [_boxes(5000, "dense", quick=True, classes=80)]},
         peer=Peer("category offsets + torchops.nms_rotated",
                   lambda: _offset_batched_nms_rotated, label="offsets"),
         note="80 classes. No eager reference (see nms); the peer is detectron2's formulation "
              "over torchops.nms_rotated."),
    Case(name="box_iou_rotated", op="box_iou_rotated", inputs=inputs.rotated_box_pairs, sizes={
        "cuda": [Size("1000 x 1000", {"n": 1000, "m": 1000}, quick=True)],
        "cpu": [Size("300 x 300", {"n": 300, "m": 300}, quick=True, threads=SCALING)]},
         reference=references.box_iou_rotated, reference_name="vertex-sort formula",
         bytes=lambda a: _nbytes(*a) + a[0].shape[0] * a[1].shape[0] * a[0].element_size()),
    Case(name="soft_nms", op="soft_nms", inputs=inputs.soft_nms_args, compile=False, sizes={
        "cuda": [_boxes(1000, "dense", quick=True), _boxes(5000, "dense"),
                 _boxes(5000, "sparse")],
        "cpu": [_boxes(1000, "dense", quick=True), _boxes(5000, "dense", threads=SCALING),
                _boxes(5000, "sparse")]},
         reference=references.soft_nms, reference_name="vectorised PyTorch (N steps, no sync)",
         note="Gaussian, sigma 0.5, min_score 1e-3. The reference is not compiled: its loop "
              "of N steps would unroll."),
]
