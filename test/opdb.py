"""The op database: one entry per public torchops operator.

Every generic test (test_ops.py and friends) is generated from these entries,
in the spirit of PyTorch's OpInfo: adding an op means adding an entry here,
not writing a new test file.  An entry says how to call the op, how to make
sample inputs for a device and dtype, what the float64 pure-PyTorch reference
is, which tolerances apply, and which invalid inputs must raise what.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

import torchops

# ----------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass
class Sample:
    """One call: positional args (tensors and scalars) and kwargs."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""

    def tensors(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def __repr__(self) -> str:
        def fmt(a):
            if isinstance(a, torch.Tensor):
                return (f"T{tuple(a.shape)}{'' if a.is_contiguous() else '[nc]'}"
                        f"{'[rg]' if a.requires_grad else ''}")
            return repr(a)
        return f"{self.name}({', '.join(map(fmt, self.args))})"


@dataclass
class ErrorInput:
    """An invalid call and the error it must raise; `match` is a regex that
    must name the op (and, in the kernels, the offending argument)."""

    sample: Sample
    match: str
    error: type = RuntimeError


@dataclass
class Tol:
    atol: float
    rtol: float


DEFAULT_TOLS = {
    torch.float64: Tol(1e-9, 1e-7),
    torch.float32: Tol(1e-5, 1.3e-5),
    torch.float16: Tol(1e-3, 1e-3),
    torch.bfloat16: Tol(1e-2, 1.6e-2),
}


@dataclass
class OpInfo:
    name: str                                   # public name: torchops.<name>
    op: torch._ops.OpOverload                   # torch.ops.torchops.<name>.default
    wrapper: Callable                           # typed Python wrapper
    reference: Callable                         # pure PyTorch; called on float64 copies
    sample_inputs: Callable[..., Iterable[Sample]]   # (device, dtype, requires_grad) -> samples
    error_inputs: Callable[..., Iterable[ErrorInput]]  # (device) -> invalid calls
    dtypes: dict[str, tuple] = field(default_factory=lambda: {
        "cpu": FLOAT_DTYPES, "cuda": FLOAT_DTYPES})
    tols: dict = field(default_factory=dict)    # per-dtype overrides of DEFAULT_TOLS
    differentiable: bool = True
    supports_gradgrad: bool = False
    data_dependent_output: bool = False
    # Internal ops (backward kernels) that this entry exercises; the coverage
    # gate accepts them as covered.
    internal_ops: tuple[str, ...] = ()
    # Test name -> written reason for not running it on this op.
    skips: dict[str, str] = field(default_factory=dict)

    def tol(self, dtype: torch.dtype) -> Tol:
        return self.tols.get(dtype, DEFAULT_TOLS[dtype])

    def qualname(self) -> str:
        return f"torchops::{self.name}"


def make(shape, device, dtype, requires_grad=False, low=-3.0, high=3.0) -> torch.Tensor:
    """Fresh uniform random values (never zeros), as a leaf tensor."""
    t = torch.empty(shape, device=device, dtype=torch.float64).uniform_(low, high).to(dtype)
    return t.requires_grad_(requires_grad)


def make_transposed(shape, device, dtype, requires_grad=False, **kw) -> torch.Tensor:
    """A tensor of `shape` whose last two dimensions are transposed in memory."""
    s = list(shape)
    s[-1], s[-2] = s[-2], s[-1]
    base = make(s, device, dtype, **kw).transpose(-1, -2)
    return base.detach().requires_grad_(requires_grad)


def convert(s: Sample, dtype: torch.dtype | None = None, requires_grad: bool | None = None) -> Sample:
    """Detached copy of a sample, floating tensors optionally converted to
    `dtype`; requires_grad kept unless given."""
    def conv(a):
        if not isinstance(a, torch.Tensor):
            return a
        t = a.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        rg = a.requires_grad if requires_grad is None else requires_grad
        return t.requires_grad_(rg and t.is_floating_point())
    return Sample(tuple(conv(a) for a in s.args), dict(s.kwargs), s.name)


# ----------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------

def _matmul_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    shapes = [  # (batch or None, M, K, N)
        (None, 3, 5, 4), (None, 1, 1, 1), (None, 17, 33, 9), (None, 0, 3, 4),
        (None, 3, 0, 4), (None, 65, 70, 66), (2, 5, 3, 4), (3, 1, 7, 1), (0, 2, 3, 4),
        (2, 64, 17, 65),
    ]
    for batch, m, k, n in shapes:
        pre = () if batch is None else (batch,)
        a_shape, b_shape = (*pre, m, k), (*pre, k, n)
        tag = f"{'b' if batch is not None else ''}mm{m}x{k}x{n}"
        yield Sample((make(a_shape, device, dtype, rg), make(b_shape, device, dtype, rg)), name=tag)
        if m and k and n:
            yield Sample((make_transposed(a_shape, device, dtype, rg),
                          make_transposed(b_shape, device, dtype, rg)), name=tag + "_T")
    # Broadcast: one right-hand matrix expanded (stride 0) over the batch.
    w = make((1, 6, 5), device, dtype).expand(4, 6, 5)
    yield Sample((make((4, 3, 6), device, dtype, rg), w.detach().requires_grad_(rg)), name="expanded_b")
    # Non-contiguous by slicing.
    a = make((8, 10), device, dtype)[::2, 1:8]
    yield Sample((a.detach().requires_grad_(rg), make((7, 3), device, dtype, rg)), name="sliced_a")


def _matmul_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3), f(3, 4))), r"torchops\.matmul.*'a'.*2-D")
    yield ErrorInput(Sample((f(2, 3, 4, 5), f(5, 4))), r"torchops\.matmul.*'a'")
    yield ErrorInput(Sample((f(3, 4), f(2, 4, 5))), r"torchops\.matmul.*'b'")
    yield ErrorInput(Sample((f(3, 4), f(5, 6))), r"torchops\.matmul: inner dimensions")
    yield ErrorInput(Sample((f(2, 3, 4), f(3, 4, 5))), r"torchops\.matmul: batch dimensions")
    yield ErrorInput(Sample((f(3, 4), f(4, 5, dt=torch.float64))), r"torchops\.matmul.*'b'.*dtype")
    yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device),
                             torch.ones(4, 5, dtype=torch.int64, device=device))),
                     r"torchops\.matmul.*'a'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((f(3, 4), f(4, 5, dev="cpu"))), r"torchops\.matmul.*'b'")


MATMUL = OpInfo(
    name="matmul",
    op=torch.ops.torchops.matmul.default,
    wrapper=torchops.matmul,
    reference=lambda a, b: torch.matmul(a, b),
    sample_inputs=_matmul_samples,
    error_inputs=_matmul_errors,
    tols={
        torch.float32: Tol(1e-4, 1e-4),
        torch.float16: Tol(1e-2, 2e-3),
        torch.bfloat16: Tol(5e-2, 2e-2),
    },
    supports_gradgrad=True,
)


# ----------------------------------------------------------------------------------
# d_sigmoid
# ----------------------------------------------------------------------------------

def _d_sigmoid_ref(z):
    s = torch.sigmoid(z)
    return s * (1 - s)


def _d_sigmoid_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for shape in [(7,), (0,), (1,), (3, 5), (2, 0, 3), (4, 33, 5), (1000,)]:
        yield Sample((make(shape, device, dtype, rg, low=-8, high=8),), name=f"z{shape}")
    yield Sample((make_transposed((6, 9), device, dtype, rg),), name="transposed")
    z = make((5, 1), device, dtype).expand(5, 7)
    yield Sample((z.detach().requires_grad_(rg),), name="expanded")
    yield Sample((make((0, 4), device, dtype, rg),), name="empty2d")


def _d_sigmoid_errors(device):
    yield ErrorInput(Sample((torch.arange(5, device=device),)), r"torchops\.d_sigmoid.*'z'.*floating")
    yield ErrorInput(Sample((torch.ones(3, dtype=torch.bool, device=device),)),
                     r"torchops\.d_sigmoid.*'z'")


D_SIGMOID = OpInfo(
    name="d_sigmoid",
    op=torch.ops.torchops.d_sigmoid.default,
    wrapper=torchops.d_sigmoid,
    reference=_d_sigmoid_ref,
    sample_inputs=_d_sigmoid_samples,
    error_inputs=_d_sigmoid_errors,
    internal_ops=("_d_sigmoid_backward",),
    tols={torch.float16: Tol(2e-3, 2e-3)},
)


# --- detection: boxes -------------------------------------------------------------------
BOX_OPS: list[OpInfo] = []


# --- detection: RoI pooling -------------------------------------------------------------
# References follow torchvision's C++ semantics line by line, in float64, one
# RoI at a time (tests use few RoIs); everything inside a RoI is tensor math.

def _roi_align_axis_weights(v: torch.Tensor, size: int) -> torch.Tensor:
    """(n, size) matrix: row i interpolates linearly at coordinate v[i] with
    torchvision's boundary rules (0 outside [-1, size], clamped inside)."""
    valid = (v >= -1) & (v <= size)
    v = v.clamp(min=0)
    lo = v.floor().long()
    edge = lo >= size - 1
    lo = torch.where(edge, torch.full_like(lo, size - 1), lo)
    hi = torch.where(edge, lo, lo + 1)
    v = torch.where(edge, lo.to(v.dtype), v)
    frac = v - lo.to(v.dtype)
    m = torch.zeros(v.shape[0], size, dtype=v.dtype, device=v.device)
    if size == 0:
        return m
    rows = torch.arange(v.shape[0], device=v.device)
    keep = valid.to(v.dtype)
    m.index_put_((rows, lo.clamp(0, size - 1)), (1 - frac) * keep, accumulate=True)
    m.index_put_((rows, hi.clamp(0, size - 1)), frac * keep, accumulate=True)
    return m


def _roi_align_ref(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                   aligned):
    n, c, h, w = input.shape
    out = input.new_zeros((rois.shape[0], c, pooled_height, pooled_width))
    offset = 0.5 if aligned else 0.0
    for k, roi in enumerate(rois.tolist()):
        b = int(roi[0])
        x1, y1, x2, y2 = (v * spatial_scale - offset for v in roi[1:])
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
        grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_h)
        grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_w)
        if grid_h <= 0 or grid_w <= 0:
            continue

        def coords(start, bin_size, pooled, grid):
            p = torch.arange(pooled, dtype=input.dtype, device=input.device)[:, None]
            i = torch.arange(grid, dtype=input.dtype, device=input.device)[None, :]
            return (start + p * bin_size + (i + 0.5) * bin_size / grid).reshape(-1)

        wy = _roi_align_axis_weights(coords(y1, bin_h, pooled_height, grid_h), h)
        wx = _roi_align_axis_weights(coords(x1, bin_w, pooled_width, grid_w), w)
        samples = torch.einsum("yh,chw,xw->cyx", wy, input[b], wx)
        out[k] = samples.reshape(c, pooled_height, grid_h, pooled_width, grid_w).mean((2, 4))
    return out


def _round_half_away(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _roi_pool_ref(input, rois, spatial_scale, pooled_height, pooled_width):
    n, c, h, w = input.shape
    shape = (rois.shape[0], c, pooled_height, pooled_width)
    out = input.new_zeros(shape)
    argmax = torch.full(shape, -1, dtype=torch.int64, device=input.device)
    for k, roi in enumerate(rois.tolist()):
        b = int(roi[0])
        x1, y1, x2, y2 = (_round_half_away(v * spatial_scale) for v in roi[1:])
        bin_h = max(y2 - y1 + 1, 1) / pooled_height
        bin_w = max(x2 - x1 + 1, 1) / pooled_width
        for ph in range(pooled_height):
            hs = min(max(math.floor(ph * bin_h) + y1, 0), h)
            he = min(max(math.ceil((ph + 1) * bin_h) + y1, 0), h)
            for pw in range(pooled_width):
                ws = min(max(math.floor(pw * bin_w) + x1, 0), w)
                we = min(max(math.ceil((pw + 1) * bin_w) + x1, 0), w)
                if he <= hs or we <= ws or c == 0:
                    continue
                region = input[b, :, hs:he, ws:we].reshape(c, -1)
                value, idx = region.max(dim=1)  # first maximum wins, like the kernels
                out[k, :, ph, pw] = value
                argmax[k, :, ph, pw] = (hs + idx // (we - ws)) * w + ws + idx % (we - ws)
    return out, argmax


def _random_rois(n_images: int, k: int, height: int, width: int, scale: float, dtype, device,
                 seed: int, spread: float = 0.3) -> torch.Tensor:
    """k boxes in image coordinates (feature map / scale), mostly inside the
    image, some partly outside (by `spread` of its size) and some tiny.
    Seeded: the boxes are fixed, so a sample never lands exactly on a
    rounding boundary by chance in one run and not in the next."""
    g = torch.Generator().manual_seed(seed)
    ih, iw = height / scale, width / scale
    x1 = torch.rand(k, generator=g, dtype=torch.float64) * iw * (1 + 2 * spread) - spread * iw
    y1 = torch.rand(k, generator=g, dtype=torch.float64) * ih * (1 + 2 * spread) - spread * ih
    bw = torch.rand(k, generator=g, dtype=torch.float64) * iw * 0.8
    bh = torch.rand(k, generator=g, dtype=torch.float64) * ih * 0.8
    tiny = torch.rand(k, generator=g) < 0.2
    bw = torch.where(tiny, bw * 0.02, bw)
    bh = torch.where(tiny, bh * 0.02, bh)
    batch = torch.randint(0, max(n_images, 1), (k,), generator=g).to(torch.float64)
    rois = torch.stack([batch, x1, y1, x1 + bw, y1 + bh], dim=1)
    return rois.to(dtype=dtype, device=device)


# (name, (N, C, H, W), K, spatial_scale, pooled (ph, pw), layout)
_ROI_CASES = [
    ("basic", (2, 3, 10, 12), 6, 1.0, (3, 2), "contiguous"),
    ("scaled", (1, 2, 9, 7), 5, 0.5, (2, 3), "contiguous"),
    ("one_bin", (1, 1, 5, 6), 3, 1.0, (1, 1), "contiguous"),
    ("odd", (3, 5, 7, 11), 7, 0.25, (4, 5), "contiguous"),
    ("channels_last", (2, 4, 8, 9), 5, 1.0, (3, 3), "channels_last"),
    ("sliced", (2, 3, 9, 8), 4, 1.0, (2, 2), "sliced"),
    ("no_rois", (2, 3, 6, 6), 0, 1.0, (2, 2), "contiguous"),
    ("no_channels", (1, 0, 6, 6), 3, 1.0, (2, 2), "contiguous"),
    ("one_pixel", (1, 2, 1, 1), 3, 1.0, (2, 2), "contiguous"),
]


def _roi_features(shape, layout, device, dtype, requires_grad):
    if layout == "channels_last":
        t = make(shape, device, dtype).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        n, c, h, w = shape
        t = make((n, 2 * c, h, w + 3), device, dtype)[:, ::2, :, 1:w + 1]
    else:
        t = make(shape, device, dtype)
    return t.detach().requires_grad_(requires_grad)


def _roi_samples(device, dtype, requires_grad, extra):
    for seed, (name, shape, k, scale, (ph, pw), layout) in enumerate(_ROI_CASES):
        rois = _random_rois(shape[0], k, shape[2], shape[3], scale, dtype, device, seed)
        x = _roi_features(shape, layout, device, dtype, requires_grad)
        for tag, rest in extra(name):
            yield Sample((x, rois, scale, ph, pw, *rest), name=f"{name}{tag}")


def _roi_align_samples(device, dtype, requires_grad=False):
    def extra(name):
        yield "", (2, False)
        if name in ("basic", "odd", "channels_last"):
            yield "_aligned_adaptive", (0, True)
        if name in ("basic", "scaled"):
            yield "_adaptive", (-1, False)
            yield "_aligned_s3", (3, True)
    yield from _roi_samples(device, dtype, requires_grad, extra)
    # Reversed and degenerate boxes (x2 < x1, zero size): aligned keeps the
    # negative size (no samples when adaptive), unaligned makes them 1x1.
    x = make((1, 2, 6, 7), device, dtype, requires_grad)
    rois = torch.tensor([[0, 4.0, 4.5, 1.0, 2.0], [0, 3.0, 3.0, 3.0, 3.0], [0, -1.0, -1.0, 7.5, 6.5]],
                        dtype=dtype, device=device)
    for sr, aligned in ((2, True), (0, True), (0, False), (2, False)):
        yield Sample((x, rois, 1.0, 2, 3, sr, aligned), name=f"reversed_s{sr}_{aligned}")


def _roi_pool_samples(device, dtype, requires_grad=False):
    yield from _roi_samples(device, dtype, requires_grad, lambda name: [("", ())])
    x = make((1, 2, 6, 7), device, dtype, requires_grad)
    rois = torch.tensor([[0, 4.0, 4.5, 1.0, 2.0], [0, 3.0, 3.0, 3.0, 3.0], [0, -9.0, -9.0, -3.0, -2.0]],
                        dtype=dtype, device=device)
    yield Sample((x, rois, 1.0, 3, 2), name="reversed_and_outside")


def _roi_errors(op, extra_args):
    def errors(device):
        f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
        rois = torch.tensor([[0, 1.0, 1.0, 4.0, 4.0]], device=device)
        x = f(1, 2, 6, 6)
        name = rf"torchops\.{op}"
        yield ErrorInput(Sample((f(2, 6, 6), rois, 1.0, 2, 2, *extra_args)), rf"{name}.*'input'.*4")
        yield ErrorInput(Sample((x, rois[:, :4], 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*\(K, 5\)")
        yield ErrorInput(Sample((x, rois[0], 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'")
        yield ErrorInput(Sample((x, rois.double(), 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*dtype")
        yield ErrorInput(Sample((x.long(), rois.long(), 1.0, 2, 2, *extra_args)),
                         rf"{name}.*'input'.*floating")
        yield ErrorInput(Sample((x, rois, 1.0, 0, 2, *extra_args)), rf"{name}.*'pooled_height'")
        yield ErrorInput(Sample((x, rois, 1.0, 2, -1, *extra_args)), rf"{name}.*'pooled_width'")
        if device == "cpu":
            bad = rois.clone()
            bad[0, 0] = 1
            yield ErrorInput(Sample((x, bad, 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*batch index")
        else:
            yield ErrorInput(Sample((x, rois.cpu(), 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'")
    return errors


ROI_ALIGN = OpInfo(
    name="roi_align",
    op=torch.ops.torchops.roi_align.default,
    wrapper=lambda x, rois, scale, ph, pw, sr, aligned: torchops.roi_align(
        x, rois, (ph, pw), scale, sr, aligned),
    reference=_roi_align_ref,
    sample_inputs=_roi_align_samples,
    error_inputs=_roi_errors("roi_align", (2, False)),
    internal_ops=("_roi_align_backward",),
    # Sample coordinates are computed in float32 for the float and half
    # types: an error of ~1 ulp of a coordinate moves the value by up to
    # (coordinate * 2^-24) * (max neighbour difference).
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(2e-3, 2e-3)},
)

ROI_POOL = OpInfo(
    name="roi_pool",
    op=torch.ops.torchops.roi_pool.default,
    wrapper=lambda x, rois, scale, ph, pw: torchops.roi_pool(x, rois, (ph, pw), scale),
    reference=_roi_pool_ref,
    sample_inputs=_roi_pool_samples,
    error_inputs=_roi_errors("roi_pool", ()),
    internal_ops=("_roi_pool_backward",),
)

ROI_OPS: list[OpInfo] = [ROI_ALIGN, ROI_POOL]


# --- losses -----------------------------------------------------------------------------
LOSS_OPS: list[OpInfo] = []


OP_DB: list[OpInfo] = [MATMUL, D_SIGMOID, *BOX_OPS, *ROI_OPS, *LOSS_OPS]


def ops_by_name() -> dict[str, OpInfo]:
    return {o.name: o for o in OP_DB}


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_dtype_params(op: OpInfo) -> list[tuple[str, torch.dtype]]:
    return [(d, dt) for d in devices() for dt in op.dtypes.get(d, ())]


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("itertools", "math", "Any")]
