"""Typed Python wrappers of the torchops operators, each beside its fake.

This is the module that ``csrc/schema.cpp`` names with ``set_python_module``:
PyTorch requires every fake (meta) kernel of a C++-defined op to be
registered from here.  A fake allocates its output exactly as the real kernel
does -- same shape, dtype, device and strides -- which is what lets
torch.compile and torch.export trace the ops without running them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchops import _loader

_loader.load()

__all__ = ["matmul", "d_sigmoid"]  # each section below adds its ops

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# The message lambdas of torch._check below capture plain values read
# beforehand (dtypes, shapes), never a tensor.  The fakes run outside dynamo,
# where that is enough; code that dynamo traces (the public wrappers, under
# torch.compile(fullgraph=True)) must not use such messages at all: see
# _roi_rows.


def _check_floating(op: str, name: str, t: Tensor) -> None:
    dtype = t.dtype
    torch._check(
        dtype in _FLOATING,
        lambda: f"torchops.{op}: expected '{name}' to be a floating-point tensor "
        f"(float32, float64, float16 or bfloat16), but got {dtype}")


def _check_same_device(op: str, **tensors: Tensor) -> None:
    """The kernels' device rule, for the fakes: with a CPU and a meta tensor
    the dispatcher runs the fake, which must raise as the kernels do instead
    of returning an uninitialised tensor."""
    (first, t0), *rest = tensors.items()
    for name, t in rest:
        dev0, dev = t0.device, t.device
        torch._check(dev == dev0, lambda: f"torchops.{op}: expected '{name}' to be on the "
                     f"same device as '{first}' ({dev0}), but got {dev}")


def _check_same_dtype(op: str, **tensors: Tensor) -> None:
    """The kernels' check_same_dtype: every tensor has the first one's dtype."""
    (first, t0), *rest = tensors.items()
    for name, t in rest:
        dtype0, dtype = t0.dtype, t.dtype
        torch._check(dtype == dtype0, lambda: f"torchops.{op}: expected '{name}' to have the "
                     f"same dtype as '{first}' ({dtype0}), but got {dtype}")


def _check_output_size(op: str, shape, dtype: torch.dtype) -> None:
    """The kernels' allocation check (csrc/common/checks.h new_output), where
    the sizes are known: the byte count must fit in int64."""
    if all(isinstance(d, int) for d in shape):
        n = dtype.itemsize
        for d in shape:
            n *= d
        torch._check(n < 2**63, lambda: f"torchops.{op}: the output of shape {tuple(shape)} "
                     f"({dtype}) is too large to allocate: its byte count overflows int64")


# --- matmul ---------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product ``a @ b`` with :func:`torch.matmul`'s shape rules.

    1-D operands are a row (``a``) or a column (``b``), removed from the
    result; batch dimensions broadcast, so ``(B, T, K) @ (K, N)`` (a linear
    layer) and ``(B, H, M, K) @ (B, H, K, N)`` (attention scores) work as they
    do with ``@``.  Supports float32, float64, float16 and bfloat16 (the half
    types accumulate in float32) on CPU and CUDA, any strides (transposed and
    expanded inputs are read in place where the product is 2-D or 3-D), and
    autograd to both inputs.  Both inputs have one dtype; the result is a new
    tensor of that dtype.

    The operator itself, ``torch.ops.torchops.matmul``, takes 2-D ``(M, K) @
    (K, N)`` or 3-D ``(B, M, K) @ (B, K, N)``; this wrapper folds every other
    case into one of those with views (a copy only where ``reshape`` needs
    one), as torch.matmul does.
    """
    da, db = a.dim(), b.dim()
    if da == db and (da == 2 or (da == 3 and a.shape[0] == b.shape[0])):
        return torch.ops.torchops.matmul.default(a, b)  # the operator's own shapes
    # Plain raises, not torch._check: dynamo traces this wrapper (see _roi_rows).
    if da == 0 or db == 0:
        raise RuntimeError(f"torchops.matmul: both arguments need at least 1 dimension, "
                           f"got {da}-D and {db}-D")
    if db == 1:  # b is one column
        return matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if da == 1:  # a is one row
        return matmul(a.unsqueeze(-2), b).squeeze(-2)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if k != b.shape[-2]:  # named here: the folded shapes would confuse the operator's message
        raise RuntimeError(f"torchops.matmul: inner dimensions differ: 'a' has shape "
                           f"{tuple(a.shape)} and 'b' has shape {tuple(b.shape)}")
    if db == 2:  # a's batch dimensions fold into its rows: one 2-D product
        rows = m
        for d in a.shape[:-2]:
            rows = rows * d
        out = torch.ops.torchops.matmul.default(a.reshape(rows, k), b)
        return out.reshape(*a.shape[:-1], n)
    batch = []
    pa, pb = a.shape[:-2], b.shape[:-2]
    for i in range(1, max(len(pa), len(pb)) + 1):
        x = pa[-i] if i <= len(pa) else 1
        y = pb[-i] if i <= len(pb) else 1
        if x != y and x != 1 and y != 1:
            raise RuntimeError(f"torchops.matmul: the batch dimensions of 'a' "
                               f"{tuple(pa)} and 'b' {tuple(pb)} do not broadcast")
        batch.insert(0, y if x == 1 else x)
    nb = 1
    for d in batch:
        nb = nb * d
    a3 = a.expand(*batch, m, k).reshape(nb, m, k)
    b3 = b.expand(*batch, k, n).reshape(nb, k, n)
    return torch.ops.torchops.matmul.default(a3, b3).reshape(*batch, m, n)


@torch.library.register_fake("torchops::matmul")
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() in (2, 3), lambda: f"torchops.matmul: expected 'a' to be 2-D or 3-D, got {a.dim()}-D")
    torch._check(b.dim() == a.dim(), lambda: f"torchops.matmul: expected 'b' to have {a.dim()} dimensions like 'a'")
    _check_floating("matmul", "a", a)
    _check_same_device("matmul", a=a, b=b)
    _check_same_dtype("matmul", a=a, b=b)
    torch._check(a.shape[-1] == b.shape[-2], lambda: "torchops.matmul: inner dimensions differ")
    if a.dim() == 3:
        torch._check(a.shape[0] == b.shape[0], lambda: "torchops.matmul: batch dimensions differ")
    shape = (*a.shape[:-1], b.shape[-1])
    _check_output_size("matmul", shape, a.dtype)
    return a.new_empty(shape)


# --- d_sigmoid ------------------------------------------------------------------------


def d_sigmoid(z: Tensor) -> Tensor:
    """Derivative of the logistic sigmoid, ``s * (1 - s)`` with ``s = sigmoid(z)``.

    Element-wise, any shape; float32, float64, float16, bfloat16 (half types
    computed in float32) on CPU and CUDA; differentiable (once).  Returns a
    new contiguous tensor.
    """
    return torch.ops.torchops.d_sigmoid.default(z)


@torch.library.register_fake("torchops::d_sigmoid")
def _d_sigmoid_fake(z: Tensor) -> Tensor:
    _check_floating("d_sigmoid", "z", z)
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)


@torch.library.register_fake("torchops::_d_sigmoid_backward")
def _d_sigmoid_backward_fake(grad: Tensor, z: Tensor) -> Tensor:
    op = "_d_sigmoid_backward"
    _check_same_device(op, z=z, grad=grad)
    _check_floating(op, "z", z)
    _check_same_dtype(op, z=z, grad=grad)
    z_shape, grad_shape = tuple(z.shape), tuple(grad.shape)
    torch._check(grad.shape == z.shape, lambda: f"torchops.{op}: expected 'grad' to have the "
                 f"shape of 'z' ({z_shape}), but got {grad_shape}")
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)


# --- detection: boxes -------------------------------------------------------------------

__all__ += ["nms", "batched_nms", "nms_padded", "box_iou"]


def _check_boxes(op: str, name: str, t: Tensor) -> None:
    _check_floating(op, name, t)
    shape = tuple(t.shape)
    torch._check(
        t.dim() == 2 and t.shape[1] == 4,
        lambda: f"torchops.{op}: expected '{name}' to have shape (N, 4), but got shape {shape}")


def _check_nms_args(op: str, boxes: Tensor, scores: Tensor, idxs: Tensor | None,
                    iou_threshold: float, check_rows=_check_boxes) -> None:
    check_rows(op, "boxes", boxes)
    _check_floating(op, "scores", scores)
    if idxs is None:
        _check_same_device(op, boxes=boxes, scores=scores)
    else:
        _check_same_device(op, boxes=boxes, scores=scores, idxs=idxs)
    _check_same_dtype(op, boxes=boxes, scores=scores)
    torch._check(scores.dim() == 1 and scores.shape[0] == boxes.shape[0],
                 lambda: f"torchops.{op}: expected 'scores' to have shape (N,) with N = {boxes.shape[0]}")
    if idxs is not None:
        torch._check(idxs.dtype == torch.int64,
                     lambda: f"torchops.{op}: expected 'idxs' to be an int64 tensor, but got {idxs.dtype}")
        torch._check(idxs.dim() == 1 and idxs.shape[0] == boxes.shape[0],
                     lambda: f"torchops.{op}: expected 'idxs' to have shape (N,) with N = {boxes.shape[0]}")
    # The comparison IoU > nan is always false: nothing would be suppressed.
    torch._check(iou_threshold == iou_threshold,
                 lambda: f"torchops.{op}: expected 'iou_threshold' to be a number, but got nan")


def _kept_indices_fake(boxes: Tensor) -> Tensor:
    # How many boxes survive depends on the data: an unbacked size in [0, N].
    n = boxes.shape[0]
    ctx = torch.library.get_ctx()
    kept = ctx.new_dynamic_size(max=n) if isinstance(n, int) else ctx.new_dynamic_size()
    if not isinstance(n, int):
        torch._check(kept <= n)
    return boxes.new_empty((kept,), dtype=torch.int64)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Non-maximum suppression (torchvision.ops.nms semantics).

    Visits ``boxes`` ``(N, 4)`` (``x1, y1, x2, y2``) in order of decreasing
    ``scores`` ``(N,)`` and keeps a box unless a kept box overlaps it with
    IoU ``> iou_threshold``.  Returns the int64 indices of the kept boxes,
    sorted by decreasing score; equal scores keep their input order (stable),
    so the result is deterministic.

    float32, float64, float16, bfloat16 on CPU and CUDA; IoUs are computed in
    float32 for the half types (double for float64) and compared with
    ``iou_threshold`` rounded to that type.  Under ``torch.autocast`` the
    inputs are upcast to float32.  Not differentiable.  The output length
    depends on the data: under torch.compile set
    ``torch._dynamo.config.capture_dynamic_output_shape_ops = True`` to keep
    it in the graph.
    """
    return torch.ops.torchops.nms.default(boxes, scores, iou_threshold)


@torch.library.register_fake("torchops::nms")
def _nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    _check_nms_args("nms", boxes, scores, None, iou_threshold)
    return _kept_indices_fake(boxes)


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """Non-maximum suppression within each category
    (torchvision.ops.batched_nms semantics), in one call.

    ``idxs`` ``(N,)`` int64 holds each box's category; boxes of different
    categories never suppress each other.  Returns the int64 indices of the
    kept boxes sorted by decreasing score (equal scores: input order).  The
    category test is part of the kernel, so -- unlike torchvision's
    coordinate-offset trick -- box coordinates are never shifted and any
    category values (negative, huge) and coordinates (negative) work.
    Dtypes, devices, autocast and compile as for :func:`nms`.
    """
    return torch.ops.torchops.batched_nms.default(boxes, scores, idxs, iou_threshold)


@torch.library.register_fake("torchops::batched_nms")
def _batched_nms_fake(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    _check_nms_args("batched_nms", boxes, scores, idxs, iou_threshold)
    return _kept_indices_fake(boxes)


def nms_padded(boxes: Tensor, scores: Tensor, iou_threshold: float,
               idxs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`nms` (or, with ``idxs``, :func:`batched_nms`) with outputs
    whose shapes do not depend on the data, for CUDA graphs and static
    shapes under torch.compile and export.

    Returns ``(keep, num_kept)``: ``keep`` ``(N,)`` int64 holds the kept
    indices by decreasing score (the result of :func:`nms`) in its first
    ``num_kept`` entries and -1 after them; ``num_kept`` is a 0-dim int64
    tensor on the boxes' device.  On CUDA nothing is read back to the host,
    so a call can be captured in a CUDA graph; while the suppression mask
    fits in shared memory (about 1,700 boxes where a block has 227 KB) it is a
    single kernel launch.  ``keep[:num_kept]`` (which reads the count) gives
    :func:`nms`'s result.  Dtypes, devices and autocast as for :func:`nms`.
    """
    return torch.ops.torchops.nms_padded.default(boxes, scores, iou_threshold, idxs)


@torch.library.register_fake("torchops::nms_padded")
def _nms_padded_fake(boxes: Tensor, scores: Tensor, iou_threshold: float,
                     idxs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check_nms_args("nms_padded", boxes, scores, idxs, iou_threshold)
    return (boxes.new_empty((boxes.shape[0],), dtype=torch.int64),
            boxes.new_empty((), dtype=torch.int64))


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise IoU of ``boxes1`` ``(N, 4)`` and ``boxes2`` ``(M, 4)``
    (``x1, y1, x2, y2``): an ``(N, M)`` tensor (torchvision.ops.box_iou
    semantics).

    float32, float64, float16, bfloat16 on CPU and CUDA (half types computed
    in float32; unlike torchvision, which returns float32 for half inputs,
    the result has the inputs' dtype).  Integer boxes (both inputs) are
    computed in float64 and give PyTorch's default float dtype, as
    torchvision's integer division does.  Differentiable with respect to both
    floating-point inputs, with the gradient autograd gives torchvision's
    formula.  Returns a new contiguous tensor.
    """
    if not boxes1.is_floating_point() and not boxes2.is_floating_point():
        # float64 holds integer coordinates exactly up to 2^53: areas and
        # intersections as exact as torchvision's int64 arithmetic.
        iou = torch.ops.torchops.box_iou.default(boxes1.double(), boxes2.double())
        return iou.to(torch.get_default_dtype())
    return torch.ops.torchops.box_iou.default(boxes1, boxes2)


@torch.library.register_fake("torchops::box_iou")
def _box_iou_fake(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    _check_boxes("box_iou", "boxes1", boxes1)
    _check_boxes("box_iou", "boxes2", boxes2)
    _check_same_device("box_iou", boxes1=boxes1, boxes2=boxes2)
    _check_same_dtype("box_iou", boxes1=boxes1, boxes2=boxes2)
    shape = (boxes1.shape[0], boxes2.shape[0])
    _check_output_size("box_iou", shape, boxes1.dtype)
    return boxes1.new_empty(shape)


@torch.library.register_fake("torchops::_box_iou_backward")
def _box_iou_backward_fake(grad: Tensor, boxes1: Tensor, boxes2: Tensor) -> tuple[Tensor, Tensor]:
    op = "_box_iou_backward"
    _check_same_device(op, grad=grad, boxes1=boxes1, boxes2=boxes2)
    _check_boxes(op, "boxes1", boxes1)
    _check_boxes(op, "boxes2", boxes2)
    _check_same_dtype(op, boxes1=boxes1, boxes2=boxes2)
    _check_same_dtype(op, boxes1=boxes1, grad=grad)
    grad_shape = tuple(grad.shape)
    torch._check(grad.dim() == 2 and grad.shape[0] == boxes1.shape[0] and grad.shape[1] == boxes2.shape[0],
                 lambda: f"torchops.{op}: expected 'grad' to have shape (N, M) = (len(boxes1), "
                 f"len(boxes2)), but got {grad_shape}")
    return boxes1.new_empty((boxes1.shape[0], 4)), boxes2.new_empty((boxes2.shape[0], 4))



# --- detection: RoI pooling -------------------------------------------------------------

__all__ += ["roi_align", "roi_pool"]


def _roi_rows(op: str, boxes, name: str = "boxes") -> Tensor:
    """torchvision's two box formats -> one (K, 5) tensor of rows
    (batch_index, x1, y1, x2, y2); `name`: the argument's name in messages."""
    # Plain checks, not torch._check: dynamo traces these wrappers, and a
    # torch._check message may only close over constants (not even sizes,
    # which are symbolic under dynamic=True).  The column count is a
    # constant of the format, so guarding on it costs no recompile.
    if isinstance(boxes, Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise RuntimeError(f"torchops.{op}: expected '{name}' to be a (K, 5) tensor, "
                               f"got shape {tuple(boxes.shape)}")
        return boxes
    if not isinstance(boxes, (list, tuple)) or not all(isinstance(b, Tensor) for b in boxes):
        raise TypeError(f"torchops.{op}: expected '{name}' to be a (K, 5) tensor or a list of "
                        f"(L, 4) tensors, one per image, got {type(boxes).__name__}")
    if not boxes:
        raise ValueError(f"torchops.{op}: '{name}' is an empty list (one (L, 4) tensor per image)")
    for b in boxes:
        if b.dim() != 2 or b.shape[1] != 4:
            raise RuntimeError(f"torchops.{op}: expected each tensor in '{name}' to have shape "
                               f"(L, 4), got {tuple(b.shape)}")
    cat = torch.cat(list(boxes), dim=0)
    index = torch.cat([torch.full((b.shape[0], 1), i, dtype=cat.dtype, device=cat.device)
                       for i, b in enumerate(boxes)], dim=0)
    return torch.cat([index, cat], dim=1)


def _pair(op: str, value, name: str = "output_size") -> tuple[int, int]:
    """An int or a pair -> (height, width); a plain raise, not torch._check:
    dynamo traces the wrappers, and these are constants there."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"torchops.{op}: expected '{name}' to be an int or a pair, "
                             f"got {value!r}")
        return value[0], value[1]
    return value, value


def roi_align(input: Tensor, boxes: Tensor | list[Tensor], output_size: int | tuple[int, int],
              spatial_scale: float = 1.0, sampling_ratio: int = -1,
              aligned: bool = False) -> Tensor:
    """RoI Align (Mask R-CNN): bilinear average pooling of each box into an
    ``output_size`` grid.  A drop-in for ``torchvision.ops.roi_align``: same
    arguments, same semantics, same results (within float rounding).

    Args:
        input: features ``(N, C, H, W)``, float32/float64/float16/bfloat16,
            any strides (CPU copies non-contiguous inputs; CUDA reads them in
            place).
        boxes: ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)``, or a list
            of ``(L_i, 4)`` tensors of ``(x1, y1, x2, y2)``, one per image; in
            ``input``'s dtype, in image coordinates.
        output_size: ``(pooled_height, pooled_width)`` or one int for both.
        spatial_scale: maps box coordinates to ``input``'s pixels
            (e.g. 1/16 for a stride-16 feature map).
        sampling_ratio: samples per bin along each axis, at most
            ``MAX_SAMPLING_RATIO`` (64; more raises); ``<= 0`` means
            adaptive, ``ceil(bin size)``, capped at
            ``2 * (H // pooled_height + 1)`` rows and
            ``2 * (W // pooled_width + 1)`` columns of samples.  The cap
            changes nothing for a box up to twice the feature map's size; it
            bounds the work of an absurd box (coordinates of 1e12, say) by
            that of such a box.
        aligned: shift boxes by -0.5 pixel (pixel-centre alignment, the
            Detectron2 default); ``False`` reproduces the original RoIAlign.

    Returns ``(K, C, pooled_height, pooled_width)`` in ``input``'s dtype
    (half types accumulate in float32).  Differentiable with respect to
    ``input`` (not ``boxes``).  The CUDA backward has two kernels: a
    sort-and-gather one (bitwise reproducible; scratch memory of about 96
    bytes per bilinear sample plus a copy of the incoming gradient, e.g. 19 MB
    + 50 MB for 1000 RoIs and 256 channels at 7x7 with
    sampling_ratio 2), used with a fixed ``sampling_ratio`` (where it is
    also the faster one) and always under
    ``torch.use_deterministic_algorithms(True)``; and atomic adds, used for
    adaptive sampling otherwise.  Under ``torch.autocast`` it computes in float32 and
    returns the input's dtype.  On CPU a batch index outside ``[0, N)``
    raises; on CUDA (where checking would need a device sync) such a box
    pools to zeros and gets no gradient.
    """
    ph, pw = _pair("roi_align", output_size)
    rois = _roi_rows("roi_align", boxes)
    return torch.ops.torchops.roi_align.default(input, rois, spatial_scale, ph, pw,
                                                sampling_ratio, aligned)


# csrc/common/roi.h: the explicit sampling_ratio limit that keeps every
# RoI op's work bounded.
MAX_SAMPLING_RATIO = 64


def _check_sampling_ratio(op: str, sampling_ratio: int) -> None:
    torch._check(sampling_ratio <= MAX_SAMPLING_RATIO,
                 lambda: f"torchops.{op}: expected 'sampling_ratio' to be at most "
                 f"{MAX_SAMPLING_RATIO} samples per bin and axis (<= 0: adaptive), but got "
                 f"{sampling_ratio}")


def _check_roi_args(op: str, input: Tensor, rois: Tensor, pooled_height, pooled_width) -> None:
    _check_same_device(op, input=input, rois=rois)
    _check_floating(op, "input", input)
    ndim, rois_shape = input.dim(), tuple(rois.shape)
    torch._check(ndim == 4,
                 lambda: f"torchops.{op}: expected 'input' to have 4 dimensions, got {ndim}")
    torch._check(rois.dim() == 2 and rois.shape[1] == 5,
                 lambda: f"torchops.{op}: expected 'rois' to have shape (K, 5), got "
                 f"{rois_shape}")
    _check_same_dtype(op, input=input, rois=rois)
    _check_pooled_size(op, pooled_height, pooled_width)


def _check_pooled_size(op: str, pooled_height, pooled_width) -> None:
    torch._check(pooled_height > 0,
                 lambda: f"torchops.{op}: expected 'pooled_height' to be positive")
    torch._check(pooled_width > 0,
                 lambda: f"torchops.{op}: expected 'pooled_width' to be positive")


def _check_roi_backward_args(op: str, grad: Tensor, rois: Tensor, pooled_height, pooled_width,
                             batch_size, channels, height, width) -> None:
    _check_same_device(op, grad=grad, rois=rois)
    _check_floating(op, "grad", grad)
    torch._check(rois.dim() == 2 and rois.shape[1] == 5,
                 lambda: f"torchops.{op}: expected 'rois' to have shape (K, 5)")
    _check_same_dtype(op, grad=grad, rois=rois)
    _check_pooled_size(op, pooled_height, pooled_width)
    torch._check(batch_size >= 0 and channels >= 0 and height >= 0 and width >= 0,
                 lambda: f"torchops.{op}: expected 'batch_size', 'channels', 'height' and "
                 f"'width' to be non-negative")
    grad_shape = tuple(grad.shape)
    torch._check(grad.dim() == 4 and grad.shape[0] == rois.shape[0] and grad.shape[1] == channels
                 and grad.shape[2] == pooled_height and grad.shape[3] == pooled_width,
                 lambda: f"torchops.{op}: expected 'grad' to have shape (K, channels, "
                 f"pooled_height, pooled_width), but got {grad_shape}")
    _check_output_size(op, (batch_size, channels, height, width), grad.dtype)


@torch.library.register_fake("torchops::roi_align")
def _roi_align_fake(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height,
                    pooled_width, sampling_ratio: int, aligned: bool) -> Tensor:
    _check_roi_args("roi_align", input, rois, pooled_height, pooled_width)
    _check_sampling_ratio("roi_align", sampling_ratio)
    shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
    _check_output_size("roi_align", shape, input.dtype)
    return input.new_empty(shape)


@torch.library.register_fake("torchops::_roi_align_backward")
def _roi_align_backward_fake(grad: Tensor, rois: Tensor, spatial_scale: float, pooled_height,
                             pooled_width, batch_size, channels, height, width,
                             sampling_ratio: int, aligned: bool) -> Tensor:
    _check_roi_backward_args("_roi_align_backward", grad, rois, pooled_height, pooled_width,
                             batch_size, channels, height, width)
    _check_sampling_ratio("_roi_align_backward", sampling_ratio)
    return grad.new_empty((batch_size, channels, height, width))


def roi_pool(input: Tensor, boxes: Tensor | list[Tensor], output_size: int | tuple[int, int],
             spatial_scale: float = 1.0) -> Tensor:
    """RoI max pooling (Fast R-CNN).  A drop-in for ``torchvision.ops.roi_pool``:
    same arguments and results, and like it this returns only the pooled
    values.  The operator ``torch.ops.torchops.roi_pool`` returns
    ``(output, argmax)`` like ``torch.ops.torchvision.roi_pool``, except that
    argmax is int64 (torchvision: int32): the index ``h * W + w`` of each
    maximum in its input plane, -1 for an empty bin.

    Args:
        input: features ``(N, C, H, W)``, float32/float64/float16/bfloat16.
        boxes: ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)``, or a list
            of ``(L_i, 4)`` tensors, one per image, in ``input``'s dtype.
        output_size: ``(pooled_height, pooled_width)`` or one int for both.
        spatial_scale: maps box coordinates to ``input``'s pixels.

    Box corners are rounded to pixels, each bin is the maximum over its
    pixels (0 for a bin outside the image).  Returns ``(K, C,
    pooled_height, pooled_width)`` in ``input``'s dtype, differentiable with
    respect to ``input``; the CUDA backward honours
    ``torch.use_deterministic_algorithms``.  Autocast and invalid batch
    indices behave as in :func:`roi_align`.
    """
    ph, pw = _pair("roi_pool", output_size)
    rois = _roi_rows("roi_pool", boxes)
    return torch.ops.torchops.roi_pool.default(input, rois, spatial_scale, ph, pw)[0]


@torch.library.register_fake("torchops::roi_pool")
def _roi_pool_fake(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height,
                   pooled_width) -> tuple[Tensor, Tensor]:
    _check_roi_args("roi_pool", input, rois, pooled_height, pooled_width)
    shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
    _check_output_size("roi_pool", shape, torch.int64)
    return input.new_empty(shape), input.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("torchops::_roi_pool_backward")
def _roi_pool_backward_fake(grad: Tensor, rois: Tensor, argmax: Tensor, spatial_scale: float,
                            pooled_height, pooled_width, batch_size, channels, height,
                            width) -> Tensor:
    _check_roi_backward_args("_roi_pool_backward", grad, rois, pooled_height, pooled_width,
                             batch_size, channels, height, width)
    _check_same_device("_roi_pool_backward", grad=grad, argmax=argmax)
    torch._check(argmax.dtype == torch.int64 and argmax.shape == grad.shape,
                 lambda: "torchops._roi_pool_backward: expected 'argmax' to be an int64 tensor "
                 "of the shape of 'grad'")
    return grad.new_empty((batch_size, channels, height, width))




# --- detection: deformable RoI pooling --------------------------------------------------------

__all__ += ["deform_roi_pool"]


def deform_roi_pool(input: Tensor, rois: Tensor | list[Tensor], offset: Tensor | None,
                    output_size: int | tuple[int, int], spatial_scale: float = 1.0,
                    sampling_ratio: int = 0, gamma: float = 0.1) -> Tensor:
    """Deformable RoI pooling (Deformable ConvNets; mmcv's
    ``mmcv.ops.deform_roi_pool``, same arguments and semantics): RoI Align
    with ``aligned=True`` whose bins each move by an offset.

    Args:
        input: features ``(N, C, H, W)``, float32/float64/float16/bfloat16,
            any strides (CPU copies non-contiguous inputs; CUDA reads them in
            place).
        rois: ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)``, or a list of
            ``(L_i, 4)`` tensors, one per image; in ``input``'s dtype.
        offset: ``(K, 2, pooled_height, pooled_width)`` of ``input``'s dtype,
            or None.  Bin ``(ph, pw)`` of RoI ``k`` moves by
            ``gamma * roi_width * offset[k, 0, ph, pw]`` along x and
            ``gamma * roi_height * offset[k, 1, ph, pw]`` along y (roi size in
            feature-map pixels).
        output_size: ``(pooled_height, pooled_width)`` or one int for both.
        spatial_scale: maps RoI coordinates to ``input``'s pixels.
        sampling_ratio: samples per bin along each axis, at most 64; ``<= 0``
            adaptive (``ceil(bin size)``, capped as in :func:`roi_align`).
        gamma: the offset's scale.

    Box corners are scaled by ``spatial_scale`` and shifted by -0.5 pixel
    (pixel-centre alignment); each bin averages bilinear samples on a regular
    grid, as :func:`roi_align` with ``aligned=True``, which this equals when
    ``offset`` is None.  Returns ``(K, C, pooled_height, pooled_width)`` in
    ``input``'s dtype (half types compute in float32).  Differentiable with
    respect to ``input`` and ``offset``; the offset's gradient is the exact
    derivative of the forward (zero along an axis where a sample is clamped
    to the edge pixels; mmcv's differs there).  The CUDA backward picks
    ``input``'s gradient kernel as :func:`roi_align` does: sort-and-gather
    (bitwise deterministic) with a fixed ``sampling_ratio`` and under
    ``torch.use_deterministic_algorithms(True)``, atomics otherwise; the
    offset's gradient is always deterministic.  Autocast and invalid batch indices behave as in
    :func:`roi_align`.  Raises RuntimeError naming the argument for bad
    shapes (``offset`` not ``(K, 2, pooled_height, pooled_width)``, ``rois``
    not ``(K, 5)``), dtypes or devices.
    """
    ph, pw = _pair("deform_roi_pool", output_size)
    rows = _roi_rows("deform_roi_pool", rois, "rois")
    return torch.ops.torchops.deform_roi_pool.default(input, rows, offset, spatial_scale, ph, pw,
                                                      sampling_ratio, gamma)


def _check_deform_roi_pool_args(op: str, input: Tensor, rois: Tensor, offset: Tensor | None,
                                pooled_height, pooled_width, sampling_ratio: int) -> None:
    """csrc/common/deform_roi_pool.h check_deform_roi_pool, in its order."""
    _check_roi_args(op, input, rois, pooled_height, pooled_width)
    _check_sampling_ratio(op, sampling_ratio)
    if offset is not None:
        _check_same_device(op, input=input, offset=offset)
        _check_same_dtype(op, input=input, offset=offset)
        shape = tuple(offset.shape)
        torch._check(offset.dim() == 4 and offset.shape[0] == rois.shape[0]
                     and offset.shape[1] == 2 and offset.shape[2] == pooled_height
                     and offset.shape[3] == pooled_width,
                     lambda: f"torchops.{op}: expected 'offset' to have shape (K, 2, "
                     f"pooled_height, pooled_width), but got {shape}")


@torch.library.register_fake("torchops::deform_roi_pool")
def _deform_roi_pool_fake(input: Tensor, rois: Tensor, offset: Tensor | None,
                          spatial_scale: float, pooled_height, pooled_width,
                          sampling_ratio: int, gamma: float) -> Tensor:
    _check_deform_roi_pool_args("deform_roi_pool", input, rois, offset, pooled_height,
                                pooled_width, sampling_ratio)
    shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
    _check_output_size("deform_roi_pool", shape, input.dtype)
    return input.new_empty(shape)


def _deform_roi_pool_slopes_shape(rois: Tensor, input: Tensor, pooled_height, pooled_width):
    return (2, rois.shape[0], input.shape[1], pooled_height, pooled_width)


def _slopes_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute type of the RoI kernels (csrc/common/accumulate.h)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("torchops::_deform_roi_pool_forward")
def _deform_roi_pool_forward_fake(input: Tensor, rois: Tensor, offset: Tensor,
                                  spatial_scale: float, pooled_height, pooled_width,
                                  sampling_ratio: int, gamma: float) -> tuple[Tensor, Tensor]:
    """The forward when the offset needs a gradient: (output, slopes), the
    slopes (2, K, C, PH, PW) in the compute type, d output / d shift of its
    bin along x and y in input pixels, which the backward sums over
    channels into the offset's gradient."""
    op = "_deform_roi_pool_forward"
    _check_deform_roi_pool_args(op, input, rois, offset, pooled_height, pooled_width,
                                sampling_ratio)
    shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
    _check_output_size(op, shape, input.dtype)
    slopes = _deform_roi_pool_slopes_shape(rois, input, pooled_height, pooled_width)
    _check_output_size(op, slopes, _slopes_dtype(input.dtype))
    return input.new_empty(shape), input.new_empty(slopes, dtype=_slopes_dtype(input.dtype))


@torch.library.register_fake("torchops::_deform_roi_pool_backward")
def _deform_roi_pool_backward_fake(grad: Tensor, input: Tensor, rois: Tensor,
                                   offset: Tensor | None, slopes: Tensor | None,
                                   spatial_scale: float, pooled_height, pooled_width,
                                   sampling_ratio: int, gamma: float) -> tuple[Tensor, Tensor]:
    op = "_deform_roi_pool_backward"
    _check_deform_roi_pool_args(op, input, rois, offset, pooled_height, pooled_width,
                                sampling_ratio)
    _check_same_device(op, input=input, grad=grad)
    _check_same_dtype(op, input=input, grad=grad)
    grad_shape = tuple(grad.shape)
    torch._check(grad.dim() == 4 and grad.shape[0] == rois.shape[0]
                 and grad.shape[1] == input.shape[1] and grad.shape[2] == pooled_height
                 and grad.shape[3] == pooled_width,
                 lambda: f"torchops.{op}: expected 'grad' to have shape (K, C, pooled_height, "
                 f"pooled_width), but got {grad_shape}")
    if slopes is not None:
        _check_same_device(op, input=input, slopes=slopes)
        want = _slopes_dtype(input.dtype)
        torch._check(slopes.dtype == want,
                     lambda: f"torchops.{op}: expected 'slopes' to have dtype {want}, but got "
                     f"{slopes.dtype}")
        expect = _deform_roi_pool_slopes_shape(rois, input, pooled_height, pooled_width)
        got = tuple(slopes.shape)
        torch._check(slopes.dim() == 5 and all(a == b for a, b in zip(got, expect)),
                     lambda: f"torchops.{op}: expected 'slopes' to have shape (2, K, C, "
                     f"pooled_height, pooled_width), but got {got}")
    return (input.new_empty(input.shape),
            grad.new_empty((rois.shape[0], 2, pooled_height, pooled_width)))


# --- detection: deformable convolution ------------------------------------------------------

__all__ += ["deform_conv2d"]


def deform_conv2d(input: Tensor, offset: Tensor, weight: Tensor, bias: Tensor | None = None,
                  stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                  dilation: int | tuple[int, int] = 1, mask: Tensor | None = None) -> Tensor:
    """Deformable convolution: DCNv1 (``mask=None``) or DCNv2 (modulated,
    with ``mask``).  A drop-in for ``torchvision.ops.deform_conv2d``: same
    arguments, same inference of the groups, same results (within float
    rounding).

    Args:
        input: ``(N, C, H, W)``, float32/float64/float16/bfloat16 (the half
            types compute in float32 on the CPU), any strides.
        offset: ``(N, 2 * offset_groups * kh * kw, out_h, out_w)``: for
            offset group ``g`` and kernel tap ``k = i * kw + j``, channel
            ``2 * (g * kh * kw + k)`` shifts the sample along y and the next
            one along x.  ``offset_groups`` is inferred from its channels.
        weight: ``(O, C / groups, kh, kw)``; ``groups = C // weight.shape[1]``.
        bias: ``(O,)`` or None (zeros).
        stride, padding, dilation: ints or ``(h, w)`` pairs.
        mask: ``(N, offset_groups * kh * kw, out_h, out_w)`` modulation
            scalars, or None.

    Samples are bilinear; one with ``y <= -1``, ``y >= H``, ``x <= -1`` or
    ``x >= W`` reads 0, and inside that range each of its four corners
    outside the image reads 0 (torchvision's rule).  Returns
    ``(N, O, out_h, out_w)`` in ``input``'s dtype, differentiable with
    respect to input, offset, mask, weight and bias.  The CPU backward is
    deterministic; the CUDA backward adds the input gradient with atomics,
    except under ``torch.use_deterministic_algorithms(True)``, where it is
    bitwise reproducible (its GEMMs are then :func:`matmul`'s, which needs
    no ``CUBLAS_WORKSPACE_CONFIG``; float32 follows torch's matmul
    precision).  On
    CUDA, float16/bfloat16 inputs keep their dtype (GEMMs accumulate in
    float32).  Under ``torch.autocast`` it computes in float32 and
    returns the input's dtype.  Raises RuntimeError naming the argument for
    shapes that do not fit (offset or mask channels, groups that do not
    divide the channels, ...).
    """
    stride_h, stride_w = _pair("deform_conv2d", stride, "stride")
    pad_h, pad_w = _pair("deform_conv2d", padding, "padding")
    dil_h, dil_w = _pair("deform_conv2d", dilation, "dilation")
    kh, kw = weight.shape[-2], weight.shape[-1]
    offset_groups = offset.shape[1] // (2 * kh * kw)
    if offset_groups == 0:
        raise RuntimeError(f"torchops.deform_conv2d: expected 'offset' to have a multiple of "
                           f"2 * kh * kw = {2 * kh * kw} channels, but got {offset.shape[1]}")
    # torchvision divides by weight.shape[1]; with no input channels any
    # group count fits, so take 1.
    groups = input.shape[1] // weight.shape[1] if weight.shape[1] != 0 else 1
    use_mask = mask is not None
    if mask is None:
        # Never read without use_mask (the kernels take 1 for every sample),
        # so left uninitialised: new_zeros would cost a fill kernel per call.
        mask = input.new_empty((input.shape[0], 1))
    if bias is None:
        bias = input.new_zeros((weight.shape[0],))
    return torch.ops.torchops.deform_conv2d.default(
        input, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
        groups, offset_groups, use_mask)


def _check_deform_args(op: str, input: Tensor, weight: Tensor, offset: Tensor, mask: Tensor,
                       bias: Tensor, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                       groups, offset_groups, use_mask: bool) -> tuple:
    """csrc/common/deform_conv2d.h check_deform_conv2d, in its order and
    with its messages; returns the output shape."""
    _check_same_device(op, input=input, weight=weight, offset=offset, mask=mask, bias=bias)
    _check_floating(op, "input", input)
    _check_same_dtype(op, input=input, weight=weight)
    _check_same_dtype(op, input=input, offset=offset)
    _check_same_dtype(op, input=input, mask=mask)
    _check_same_dtype(op, input=input, bias=bias)
    for name, t, nd in (("input", input, 4), ("weight", weight, 4), ("offset", offset, 4),
                        ("bias", bias, 1)):
        d = t.dim()
        torch._check(d == nd, lambda: f"torchops.{op}: expected '{name}' to have {nd} "
                     f"dimensions, but got {d}")
    torch._check(stride_h > 0 and stride_w > 0,
                 lambda: f"torchops.{op}: expected 'stride_h' and 'stride_w' to be positive")
    torch._check(pad_h >= 0 and pad_w >= 0,
                 lambda: f"torchops.{op}: expected 'pad_h' and 'pad_w' to be non-negative")
    torch._check(dilation_h > 0 and dilation_w > 0,
                 lambda: f"torchops.{op}: expected 'dilation_h' and 'dilation_w' to be positive")
    torch._check(groups > 0, lambda: f"torchops.{op}: expected 'groups' to be positive")
    torch._check(offset_groups > 0,
                 lambda: f"torchops.{op}: expected 'offset_groups' to be positive")
    _check_conv_arguments(op, stride_h=stride_h, stride_w=stride_w, pad_h=pad_h, pad_w=pad_w,
                          dilation_h=dilation_h, dilation_w=dilation_w)
    n, c, h, w = input.shape
    o, cg, kh, kw = weight.shape
    torch._check(kh > 0 and kw > 0,
                 lambda: f"torchops.{op}: expected 'weight' to have a non-empty kernel")
    torch._check(c % groups == 0,
                 lambda: f"torchops.{op}: 'groups' does not divide the input channels")
    torch._check(o % groups == 0,
                 lambda: f"torchops.{op}: 'groups' does not divide the output channels")
    torch._check(cg * groups == c, lambda: f"torchops.{op}: expected 'weight' to have input "
                 f"channels / groups in dimension 1")
    torch._check(c % offset_groups == 0,
                 lambda: f"torchops.{op}: 'offset_groups' does not divide the input channels")
    out_h = (h + 2 * pad_h - (dilation_h * (kh - 1) + 1)) // stride_h + 1
    out_w = (w + 2 * pad_w - (dilation_w * (kw - 1) + 1)) // stride_w + 1
    torch._check(out_h > 0 and out_w > 0, lambda: f"torchops.{op}: 'input' is too small for "
                 f"the dilated kernel")
    taps = offset_groups * kh * kw
    torch._check(offset.shape[0] == n and offset.shape[1] == 2 * taps
                 and offset.shape[2] == out_h and offset.shape[3] == out_w,
                 lambda: f"torchops.{op}: expected 'offset' to have shape (batch, "
                 f"2 * offset_groups * kh * kw, out_h, out_w)")
    if use_mask:
        d = mask.dim()
        torch._check(d == 4, lambda: f"torchops.{op}: expected 'mask' to have 4 dimensions, "
                     f"but got {d}")
        torch._check(mask.shape[0] == n and mask.shape[1] == taps
                     and mask.shape[2] == out_h and mask.shape[3] == out_w,
                     lambda: f"torchops.{op}: expected 'mask' to have shape (batch, "
                     f"offset_groups * kh * kw, out_h, out_w)")
    torch._check(bias.shape[0] == o,
                 lambda: f"torchops.{op}: expected 'bias' to have shape (out_channels,)")
    return (n, o, out_h, out_w)


@torch.library.register_fake("torchops::deform_conv2d")
def _deform_conv2d_fake(input, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w,
                        dilation_h, dilation_w, groups, offset_groups, use_mask):
    shape = _check_deform_args("deform_conv2d", input, weight, offset, mask, bias, stride_h,
                               stride_w, pad_h, pad_w, dilation_h, dilation_w, groups,
                               offset_groups, use_mask)
    _check_output_size("deform_conv2d", shape, input.dtype)
    return input.new_empty(shape)


@torch.library.register_fake("torchops::_deform_conv2d_backward")
def _deform_conv2d_backward_fake(grad, input, weight, offset, mask, bias, stride_h, stride_w,
                                 pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups,
                                 use_mask):
    op = "_deform_conv2d_backward"
    shape = _check_deform_args(op, input, weight, offset, mask, bias, stride_h, stride_w, pad_h,
                               pad_w, dilation_h, dilation_w, groups, offset_groups, use_mask)
    _check_same_device(op, input=input, grad=grad)
    _check_same_dtype(op, input=input, grad=grad)
    torch._check(grad.dim() == 4 and all(grad.shape[i] == shape[i] for i in range(4)),
                 lambda: f"torchops.{op}: expected 'grad' to have shape (batch, out_channels, "
                 f"out_h, out_w)")
    return (input.new_empty(input.shape), input.new_empty(weight.shape),
            input.new_empty(offset.shape), input.new_empty(mask.shape),
            input.new_empty(bias.shape))

# --- losses -----------------------------------------------------------------------------

__all__ += ["sigmoid_focal_loss"]

_FOCAL_REDUCTIONS = ("none", "mean", "sum")


def sigmoid_focal_loss(inputs: Tensor, targets: Tensor, alpha: float = 0.25,
                       gamma: float = 2.0, reduction: str = "none") -> Tensor:
    """Focal loss of RetinaNet (https://arxiv.org/abs/1708.02002), fused: the
    same values as ``torchvision.ops.sigmoid_focal_loss``, in one pass forward
    and one pass backward.

    With ``p = sigmoid(inputs)`` and ``p_t = p * targets + (1 - p) * (1 - targets)``
    the element-wise loss is ``BCE-with-logits(inputs, targets) * (1 - p_t) ** gamma``,
    times ``alpha * targets + (1 - alpha) * (1 - targets)`` when ``alpha >= 0``.

    Args:
        inputs: logits, any shape; float32, float64, float16 or bfloat16 (the
            half types are computed in float32) on CPU or CUDA.
        targets: same shape, dtype and device as ``inputs``; values in [0, 1]
            (soft targets are fine).  Not broadcast.
        alpha: class weight of positives; negative disables the weighting.
        gamma: focusing exponent, >= 0 (0 gives weighted BCE).
        reduction: ``"none"`` (loss per element, shape of ``inputs``),
            ``"mean"`` or ``"sum"`` (0-dim tensors; the mean of an empty input is
            nan, its sum 0).  Reductions are deterministic: the same on every
            run and, on CPU, for any number of threads.

    Differentiable with respect to ``inputs`` only: a backward that needs the
    gradient of ``targets`` raises (detach them).  For ``0 < gamma < 1`` the
    gradient is inf/nan where the prediction has saturated (``1 - p_t == 0``),
    as in the reference formula.  Under ``torch.autocast`` it computes in
    float32 and returns the dtype of ``inputs``.

    Raises ValueError for an unknown ``reduction`` (as torchvision does); the
    operator ``torch.ops.torchops.sigmoid_focal_loss`` itself raises
    RuntimeError.
    """
    _check_reduction("sigmoid_focal_loss", reduction, ValueError)
    return torch.ops.torchops.sigmoid_focal_loss.default(inputs, targets, alpha, gamma, reduction)


def _check_reduction(op: str, reduction: str, error: type[Exception] = RuntimeError) -> None:
    """The wrapper's check (ValueError, as torchvision raises) and the fakes'
    (RuntimeError, as the kernels raise).  A plain raise rather than
    torch._check: `reduction` is a constant string wherever dynamo traces the
    wrapper, so this costs no guard and no graph break."""
    if reduction not in _FOCAL_REDUCTIONS:
        raise error(f"torchops.{op}: expected 'reduction' to be 'none', 'mean' or 'sum', "
                    f"but got '{reduction}'")


def _check_focal(op: str, inputs: Tensor, targets: Tensor, gamma: float, reduction: str) -> None:
    _check_same_device(op, inputs=inputs, targets=targets)
    _check_floating(op, "inputs", inputs)
    torch._check(gamma >= 0, lambda: f"torchops.{op}: expected 'gamma' to be >= 0, but got {gamma}")
    _check_same_dtype(op, inputs=inputs, targets=targets)
    shape, t_shape = tuple(inputs.shape), tuple(targets.shape)
    torch._check(targets.shape == inputs.shape,
                 lambda: f"torchops.{op}: expected 'targets' to have the shape of 'inputs' "
                 f"({shape}), but got {t_shape}")
    _check_reduction(op, reduction)


@torch.library.register_fake("torchops::sigmoid_focal_loss")
def _sigmoid_focal_loss_fake(inputs: Tensor, targets: Tensor, alpha: float = 0.25,
                             gamma: float = 2.0, reduction: str = "none") -> Tensor:
    _check_focal("sigmoid_focal_loss", inputs, targets, gamma, reduction)
    shape = inputs.shape if reduction == "none" else ()
    return torch.empty(shape, dtype=inputs.dtype, device=inputs.device)


@torch.library.register_fake("torchops::_sigmoid_focal_loss_backward")
def _sigmoid_focal_loss_backward_fake(grad: Tensor, inputs: Tensor, targets: Tensor,
                                      alpha: float, gamma: float, reduction: str) -> Tensor:
    _check_focal("_sigmoid_focal_loss_backward", inputs, targets, gamma, reduction)
    _check_same_device("_sigmoid_focal_loss_backward", inputs=inputs, grad=grad)
    _check_same_dtype("_sigmoid_focal_loss_backward", inputs=inputs, grad=grad)
    shape, grad_shape = tuple(inputs.shape), tuple(grad.shape)
    if reduction == "none":
        torch._check(grad.shape == inputs.shape,
                     lambda: f"torchops._sigmoid_focal_loss_backward: expected 'grad' to have "
                     f"the shape of 'inputs' ({shape}) for reduction 'none', but got {grad_shape}")
    else:
        torch._check(grad.dim() == 0,
                     lambda: f"torchops._sigmoid_focal_loss_backward: expected 'grad' to be a "
                     f"0-dim tensor for reduction '{reduction}', but got shape {grad_shape}")
    return torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)


# --- convolution: masked ------------------------------------------------------------------

__all__ += ["masked_conv2d"]


def masked_conv2d(input: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None = None,
                  padding: int | tuple[int, int] = 0, stride: int | tuple[int, int] = 1,
                  dilation: int | tuple[int, int] = 1, groups: int = 1) -> Tensor:
    """2-D convolution computed only where ``mask > 0`` (mmcv's
    ``masked_conv2d``, with stride, dilation, groups, batches and a backward).

    Returns ``torch.where(mask > 0, conv2d(input, weight, bias, stride,
    padding, dilation, groups), 0)``: the convolution at the selected output
    positions and exactly 0 elsewhere (no bias there, and nothing computed
    there: an inf or NaN input only reaches the positions that read it).

    Args:
        input: ``(N, C_in, H, W)``, float32/float64/float16/bfloat16, any
            strides.
        mask: ``(N, H_out, W_out)``, or ``(1, H_out, W_out)`` shared by the
            batch; bool or floating (a position is selected where ``mask >
            0``; NaN selects nothing).  Not differentiated.
        weight: ``(C_out, C_in / groups, kh, kw)``, ``input``'s dtype.
        bias: ``(C_out,)`` or None.
        padding, stride, dilation: an int or ``(height, width)``; zero
            padding.
        groups: divides ``C_in`` and ``C_out``.

    The work is proportional to the selected positions: their im2col columns
    are gathered, multiplied by the weight in one GEMM per group (the half
    types accumulate in float32), and the products written to the output,
    whose other positions get 0.  float32 follows the convolution precision
    rule, as ``conv2d`` does: on CUDA, TF32 tensor cores exactly where
    ``torch.backends.cudnn.allow_tf32`` (``torch.backends.cudnn.conv.
    fp32_precision``) allows them, which is the default, and exact float32
    otherwise, whatever the matmul precision says; on CPU, exact float32.
    On CUDA, where tensor cores are used (the half types, or float32 under
    TF32) and at least 40% of the positions are selected, the forward is
    instead cuDNN's convolution of every position followed by
    ``torch.where`` (faster from there on; same precision rule, same result
    at the unselected positions).  An input
    without elements (no channels, or a zero height or width that the
    padding makes room for) gives the bias, or 0, at the selected
    positions.
    Differentiable with respect to ``input``, ``weight`` and ``bias``; the
    backward is deterministic on CPU and CUDA alike (every input pixel
    gathers its taps; no atomics), so it needs nothing under
    ``torch.use_deterministic_algorithms(True)``.  Under ``torch.autocast``
    it runs like ``conv2d``: in the autocast dtype.

    On CUDA, counting the selected positions is one device-to-host sync per
    call (forward, and again in the backward).  Inside CUDA graph capture,
    where a sync is not allowed, the op sizes its work for every position
    instead (the cost of a dense convolution, and the dense hand-off where
    tensor cores may be used), so captured graphs stay correct for any mask
    they are replayed with.

    Raises RuntimeError naming the argument for a mask of the wrong shape or
    dtype, channels that ``groups`` does not divide, a weight that does not
    match the input's channels, a kernel larger than the padded input, and
    tensors on different devices or of different dtypes; ValueError for a
    ``padding``/``stride``/``dilation`` that is neither an int nor a pair.
    """
    op = "masked_conv2d"
    return torch.ops.torchops.masked_conv2d.default(
        input, mask, weight, bias, _pair(op, padding, "padding"),
        _pair(op, stride, "stride"), _pair(op, dilation, "dilation"), groups)


# csrc/common/checks.h kConvArgumentMax: the largest padding, stride or
# dilation of a convolution-like op.
MAX_CONV_ARGUMENT = 2**31 - 1


def _check_conv_arguments(op: str, **args) -> None:
    """The kernels' check_conv_arguments: each value at most MAX_CONV_ARGUMENT."""
    for name, v in args.items():
        torch._check(v <= MAX_CONV_ARGUMENT, lambda: f"torchops.{op}: expected '{name}' to be "
                     f"at most {MAX_CONV_ARGUMENT} (int32), but got {v}")


def _check_conv_list(op: str, name: str, value, low: int) -> None:
    torch._check(len(value) == 2, lambda: f"torchops.{op}: expected '{name}' to have 2 values "
                 "(height, width)")
    v0, v1 = value[0], value[1]
    what = "non-negative" if low == 0 else "positive"
    torch._check(v0 >= low and v1 >= low,
                 lambda: f"torchops.{op}: expected '{name}' to be {what}, but got {[v0, v1]}")


def _check_masked_conv2d(op: str, input: Tensor, mask: Tensor, weight: Tensor,
                         bias: Tensor | None, padding, stride, dilation, groups):
    """The kernels' check_masked_conv2d (csrc/common/masked_conv2d.h), in its
    order; returns the output's (N, C_out, H_out, W_out)."""
    if bias is None:
        _check_same_device(op, input=input, mask=mask, weight=weight)
    else:
        _check_same_device(op, input=input, mask=mask, weight=weight, bias=bias)
    _check_floating(op, "input", input)
    _check_same_dtype(op, input=input, weight=weight)
    if bias is not None:
        _check_same_dtype(op, input=input, bias=bias)
    mdtype = mask.dtype
    torch._check(mdtype == torch.bool or mdtype in _FLOATING,
                 lambda: f"torchops.{op}: expected 'mask' to be a bool or floating-point "
                 f"tensor, but got {mdtype}")
    for name, t, dim in (("input", input, 4), ("weight", weight, 4), ("mask", mask, 3)):
        ndim, shape = t.dim(), tuple(t.shape)
        torch._check(ndim == dim, lambda: f"torchops.{op}: expected '{name}' to have {dim} "
                     f"dimensions, but got {ndim} (shape {shape})")
    _check_conv_list(op, "padding", padding, 0)
    _check_conv_list(op, "stride", stride, 1)
    _check_conv_list(op, "dilation", dilation, 1)
    torch._check(groups > 0, lambda: f"torchops.{op}: expected 'groups' to be positive, but got "
                 f"{groups}")
    n, c_in, h, w = input.shape
    c_out, kh, kw = weight.shape[0], weight.shape[2], weight.shape[3]
    w_shape = tuple(weight.shape)
    torch._check(c_in % groups == 0 and weight.shape[1] * groups == c_in,
                 lambda: f"torchops.{op}: expected 'weight' to have input channels / groups in "
                 f"dim 1 (and 'groups' to divide the channels of 'input'), but got 'weight' of "
                 f"shape {w_shape}")
    torch._check(c_out % groups == 0, lambda: f"torchops.{op}: expected 'groups' ({groups}) to "
                 "divide the output channels of 'weight'")
    torch._check(kh > 0 and kw > 0, lambda: f"torchops.{op}: expected 'weight' to have a "
                 f"non-empty kernel, but got shape {w_shape}")
    if bias is not None:
        b_shape = tuple(bias.shape)
        torch._check(bias.dim() == 1 and bias.shape[0] == c_out,
                     lambda: f"torchops.{op}: expected 'bias' to have shape (C_out,), but got "
                     f"{b_shape}")
    _check_conv_arguments(op, padding=max(padding), stride=max(stride),
                          dilation=max(dilation))
    span_h = dilation[0] * (kh - 1) + 1
    span_w = dilation[1] * (kw - 1) + 1
    torch._check(h + 2 * padding[0] >= span_h and w + 2 * padding[1] >= span_w,
                 lambda: f"torchops.{op}: the dilated kernel of 'weight' is larger than the "
                 "padded 'input'")
    out_h = (h + 2 * padding[0] - span_h) // stride[0] + 1
    out_w = (w + 2 * padding[1] - span_w) // stride[1] + 1
    m_shape = tuple(mask.shape)
    torch._check((mask.shape[0] == 1 or mask.shape[0] == n) and mask.shape[1] == out_h
                 and mask.shape[2] == out_w,
                 lambda: f"torchops.{op}: expected 'mask' to have shape (N or 1, H_out, W_out) "
                 f"(batch, output height, output width), but got {m_shape}")
    return n, c_out, out_h, out_w


@torch.library.register_fake("torchops::masked_conv2d")
def _masked_conv2d_fake(input: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None = None,
                        padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups: int = 1) -> Tensor:
    shape = _check_masked_conv2d("masked_conv2d", input, mask, weight, bias, padding, stride,
                                 dilation, groups)
    _check_output_size("masked_conv2d", shape, input.dtype)
    return input.new_empty(shape)


@torch.library.register_fake("torchops::_masked_conv2d_backward")
def _masked_conv2d_backward_fake(grad: Tensor, input: Tensor, mask: Tensor, weight: Tensor,
                                 padding, stride, dilation, groups: int,
                                 output_mask) -> tuple[Tensor, Tensor, Tensor]:
    op = "_masked_conv2d_backward"
    shape = _check_masked_conv2d(op, input, mask, weight, None, padding, stride, dilation, groups)
    _check_same_device(op, input=input, grad=grad)
    _check_same_dtype(op, input=input, grad=grad)
    g_shape = tuple(grad.shape)
    torch._check(grad.dim() == 4 and all(a == b for a, b in zip(grad.shape, shape)),
                 lambda: f"torchops.{op}: expected 'grad' to have the output's shape, but got "
                 f"{g_shape}")
    none = input.new_empty((0,))
    return (input.new_empty(input.shape) if output_mask[0] else none,
            weight.new_empty(weight.shape) if output_mask[1] else none,
            weight.new_empty((weight.shape[0],)) if output_mask[2] else none)


# --- upsampling -------------------------------------------------------------------------

__all__ += ["carafe"]


def carafe(features: Tensor, masks: Tensor, kernel_size: int, group_size: int,
           scale_factor: int) -> Tensor:
    """CARAFE, content-aware reassembly of features (Wang et al., ICCV 2019;
    mmcv's ``carafe``, same arguments and semantics): upsamples ``features``
    by ``scale_factor`` with a ``kernel_size x kernel_size`` kernel predicted
    per output pixel.

    ``out[n, c, oh, ow]`` is the sum over ``ky, kx < kernel_size`` of
    ``features[n, c, oh // s + ky - r, ow // s + kx - r]`` (zero outside the
    map; ``r = (kernel_size - 1) // 2``, ``s = scale_factor``) times
    ``masks[n, (g * kernel_size + ky) * kernel_size + kx, oh, ow]``, where
    ``g = c // (C // group_size)`` is the channel's group.

    Args:
        features: ``(N, C, H, W)``, float32/float64/float16/bfloat16 on CPU or
            CUDA (half types accumulate in float32), any strides.
        masks: ``(N, group_size * kernel_size**2, H * s, W * s)``, same dtype
            and device; usually softmax-normalised over each group's taps
            (:class:`torchops.CARAFEPack` does that).
        kernel_size: odd, >= 1.
        group_size: divides ``C``; channel group ``g`` uses mask channels
            ``g * kernel_size**2`` to ``(g + 1) * kernel_size**2 - 1``.
        scale_factor: integer >= 1.

    Returns ``(N, C, H * s, W * s)`` in ``features``' dtype, contiguous.
    Differentiable with respect to ``features`` and ``masks``; the backward is
    a gather on every device (no atomics), so it is deterministic, with or
    without ``torch.use_deterministic_algorithms``.  Under ``torch.autocast``
    it computes in float32 and returns the dtype of ``features``.  Invalid
    shapes, an even kernel size, a group size that does not divide the
    channels, and mixed devices or dtypes raise RuntimeError naming the
    argument.
    """
    return torch.ops.torchops.carafe.default(features, masks, kernel_size, group_size,
                                             scale_factor)


def _check_carafe(op: str, features: Tensor, masks: Tensor, kernel_size: int,
                  group_size: int, scale_factor: int) -> tuple:
    """csrc/common/carafe.h's check_carafe, in the same order, with the same
    messages.  Returns the output's shape."""
    _check_same_device(op, features=features, masks=masks)
    _check_floating(op, "features", features)
    fdim, mdim = features.dim(), masks.dim()
    fshape, mshape = tuple(features.shape), tuple(masks.shape)
    torch._check(fdim == 4, lambda: f"torchops.{op}: expected 'features' to have 4 dimensions, "
                 f"but got {fdim} (shape {fshape})")
    torch._check(mdim == 4, lambda: f"torchops.{op}: expected 'masks' to have 4 dimensions, "
                 f"but got {mdim} (shape {mshape})")
    _check_same_dtype(op, features=features, masks=masks)
    torch._check(kernel_size >= 1 and kernel_size % 2 == 1,
                 lambda: f"torchops.{op}: expected 'kernel_size' to be a positive odd number, "
                 f"but got {kernel_size}")
    torch._check(group_size >= 1, lambda: f"torchops.{op}: expected 'group_size' to be "
                 f"positive, but got {group_size}")
    torch._check(scale_factor >= 1, lambda: f"torchops.{op}: expected 'scale_factor' to be "
                 f"positive, but got {scale_factor}")
    n, c, h, w = features.shape
    torch._check(c % group_size == 0, lambda: f"torchops.{op}: expected 'group_size' "
                 f"({group_size}) to divide the channels of 'features' ({fshape[1]})")
    mask_channels = kernel_size * kernel_size * group_size
    # Sizes past int64 (the kernels' overflow check), where they are known.
    too_large = mask_channels >= 2**63 or (
        isinstance(h, int) and isinstance(w, int) and max(h, w) * scale_factor >= 2**63)
    torch._check(not too_large,
                 lambda: f"torchops.{op}: 'kernel_size' ({kernel_size}), 'group_size' "
                 f"({group_size}) or 'scale_factor' ({scale_factor}) is too large for "
                 f"'features' of shape {fshape}")
    torch._check(masks.shape[0] == n, lambda: f"torchops.{op}: expected 'masks' to have the "
                 f"batch size of 'features' ({fshape[0]}), but got shape {mshape}")
    torch._check(masks.shape[1] == mask_channels,
                 lambda: f"torchops.{op}: expected 'masks' to have kernel_size^2 * group_size "
                 f"= {mask_channels} channels, but got shape {mshape}")
    ho, wo = h * scale_factor, w * scale_factor
    torch._check(masks.shape[2] == ho and masks.shape[3] == wo,
                 lambda: f"torchops.{op}: expected 'masks' to have the spatial size of "
                 f"'features' times 'scale_factor' ({fshape[2] * scale_factor}, "
                 f"{fshape[3] * scale_factor}), but got shape {mshape}")
    return (n, c, ho, wo)


@torch.library.register_fake("torchops::carafe")
def _carafe_fake(features: Tensor, masks: Tensor, kernel_size: int, group_size: int,
                 scale_factor: int) -> Tensor:
    shape = _check_carafe("carafe", features, masks, kernel_size, group_size, scale_factor)
    _check_output_size("carafe", shape, features.dtype)
    return features.new_empty(shape)


@torch.library.register_fake("torchops::_carafe_backward")
def _carafe_backward_fake(grad: Tensor, features: Tensor, masks: Tensor, kernel_size: int,
                          group_size: int, scale_factor: int) -> tuple[Tensor, Tensor]:
    op = "_carafe_backward"
    _check_same_device(op, grad=grad, features=features, masks=masks)
    shape = _check_carafe(op, features, masks, kernel_size, group_size, scale_factor)
    _check_same_dtype(op, features=features, grad=grad)
    grad_shape = tuple(grad.shape)
    torch._check(grad.dim() == 4 and all(a == b for a, b in zip(grad.shape, shape)),
                 lambda: f"torchops.{op}: expected 'grad' to have the output's shape "
                 f"{tuple(shape)}, but got {grad_shape}")
    return features.new_empty(features.shape), masks.new_empty(masks.shape)


# --- norms ------------------------------------------------------------------------------------

__all__ += ["rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm"]

_HALF = (torch.float16, torch.bfloat16)


def _shape_list(normalized_shape) -> list:
    """An int or a sequence of ints, as torch.nn.functional takes it."""
    if isinstance(normalized_shape, (int, torch.SymInt)):
        return [normalized_shape]
    return list(normalized_shape)


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """Root-mean-square normalisation over the trailing dims ``normalized_shape``:
    ``input / sqrt(mean(input^2) + eps) * weight``, a drop-in for
    ``torch.nn.functional.rms_norm`` (``eps=None``: ``torch.finfo(input.dtype).eps``).

    float32, float64, float16, bfloat16 on CPU and CUDA.  Half inputs are
    computed in float32 (float64 inputs in float64) and the result has the
    input's dtype.  ``weight`` (shape ``normalized_shape``) has the input's
    dtype, or float32 beside a float16/bfloat16 input (mixed precision).
    Differentiable in input and weight; the weight gradient is summed in a
    fixed order (deterministic).  Under ``torch.autocast`` a weight of another
    dtype is cast to float32 and the result keeps the input's dtype.  Raises
    RuntimeError naming the argument for a shape, dtype or device mismatch.
    """
    return torch.ops.torchops.rms_norm.default(input, _shape_list(normalized_shape), weight, eps)


def fused_add_rms_norm(input: Tensor, residual: Tensor, normalized_shape,
                       weight: Tensor | None = None,
                       eps: float | None = None) -> tuple[Tensor, Tensor]:
    """``(rms_norm(input + residual), input + residual)`` in one pass: the
    pre-norm residual pattern of transformer layers.

    ``residual`` has the shape and dtype of ``input``.  The sum is rounded to
    the input's dtype before it is normalised, as the unfused formula in that
    dtype computes it; the returned sum is that rounded value.  Dtypes,
    devices, weight, eps, autocast and errors as :func:`rms_norm`;
    differentiable in input, residual and weight (deterministic).
    """
    return torch.ops.torchops.fused_add_rms_norm.default(
        input, residual, _shape_list(normalized_shape), weight, eps)


def fused_add_rms_norm_(input: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In-place inference variant of :func:`fused_add_rms_norm` over the last
    dim, with vLLM's semantics: ``residual`` becomes ``input + residual``
    (rounded to the input's dtype) and ``input`` becomes its RMS norm times
    ``weight`` (shape ``(input.shape[-1],)``).  Returns None.

    No autograd: call it under ``torch.no_grad()``/``inference_mode``.  The
    two tensors must not share memory, nor be expanded.  Dtypes and devices as
    :func:`rms_norm`.
    """
    torch.ops.torchops.fused_add_rms_norm_.default(input, residual, weight, eps)


def layer_norm(input: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the trailing dims ``normalized_shape``:
    ``(input - mean) / sqrt(var + eps) * weight + bias`` (biased variance), a
    drop-in for ``torch.nn.functional.layer_norm``.

    Dtypes, devices, the mixed-precision rule for weight and bias (the two of
    one dtype), autocast and errors as :func:`rms_norm`.  Differentiable in
    input, weight and bias; their gradients are summed in a fixed order
    (deterministic).
    """
    return torch.ops.torchops.layer_norm.default(input, _shape_list(normalized_shape), weight,
                                                 bias, eps)


def _check_norm_param(op: str, input: Tensor, p: Tensor | None, name: str, shape) -> None:
    if p is None:
        return
    _check_floating(op, name, p)
    dtype, pdtype = input.dtype, p.dtype
    half = dtype in _HALF
    torch._check(pdtype == dtype or (half and pdtype == torch.float32),
                 lambda: f"torchops.{op}: expected '{name}' to have the dtype of 'input' "
                 f"({dtype}){' or float32' if half else ''}, but got {pdtype}")
    pshape, want = tuple(p.shape), tuple(shape)
    torch._check(pshape == want, lambda: f"torchops.{op}: expected '{name}' to have shape "
                 f"'normalized_shape' {list(want)}, but got {pshape}")


def _check_norm(op: str, input: Tensor, residual: Tensor | None, normalized_shape,
                weight: Tensor | None, bias: Tensor | None) -> tuple:
    """The kernels' check_norm_forward; returns the statistics' shape."""
    others = {k: v for k, v in (("residual", residual), ("weight", weight), ("bias", bias))
              if v is not None}
    _check_same_device(op, input=input, **others)
    _check_floating(op, "input", input)
    if residual is not None:
        _check_same_dtype(op, input=input, residual=residual)
        ishape, rshape = tuple(input.shape), tuple(residual.shape)
        torch._check(ishape == rshape, lambda: f"torchops.{op}: expected 'residual' to have "
                     f"the shape of 'input' ({ishape}), but got {rshape}")
    nd = len(normalized_shape)
    torch._check(nd >= 1, lambda: f"torchops.{op}: expected 'normalized_shape' to have at "
                 f"least one dimension")
    axis = input.dim() - nd
    ishape, want = tuple(input.shape), tuple(normalized_shape)
    torch._check(axis >= 0 and ishape[axis:] == want,
                 lambda: f"torchops.{op}: expected the trailing dims of 'input' (shape "
                 f"{ishape}) to equal 'normalized_shape' {list(want)}")
    _check_norm_param(op, input, weight, "weight", normalized_shape)
    _check_norm_param(op, input, bias, "bias", normalized_shape)
    if weight is not None and bias is not None:
        _check_same_dtype(op, weight=weight, bias=bias)
    return tuple(input.shape[:axis])


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_norm_stat(op: str, input: Tensor, stat: Tensor, name: str, shape: tuple) -> None:
    _check_same_device(op, input=input, **{name: stat})
    want, dtype = _stat_dtype(input.dtype), stat.dtype
    torch._check(dtype == want, lambda: f"torchops.{op}: expected '{name}' to be {want}, "
                 f"but got {dtype}")
    sshape = tuple(stat.shape)
    torch._check(sshape == shape, lambda: f"torchops.{op}: expected '{name}' to have the row "
                 f"dims of 'input' {list(shape)}, but got {sshape}")


def _check_norm_backward(op: str, grad: Tensor, input: Tensor, mean: Tensor | None,
                         rstd: Tensor, normalized_shape, weight, bias) -> None:
    _check_same_device(op, input=input, grad=grad)
    stat_shape = _check_norm(op, input, None, normalized_shape, weight, bias)
    _check_same_dtype(op, input=input, grad=grad)
    ishape, gshape = tuple(input.shape), tuple(grad.shape)
    torch._check(ishape == gshape, lambda: f"torchops.{op}: expected 'grad' to have the shape "
                 f"of 'input' ({ishape}), but got {gshape}")
    if mean is not None:
        _check_norm_stat(op, input, mean, "mean", stat_shape)
    _check_norm_stat(op, input, rstd, "rstd", stat_shape)


def _param_grad(p: Tensor | None, input: Tensor, wanted: bool) -> Tensor:
    """A parameter's gradient, or the (0,)-shaped placeholder the kernels return."""
    if wanted and p is not None:
        return p.new_empty(p.shape)
    return (p if p is not None else input).new_empty((0,))


@torch.library.register_fake("torchops::rms_norm")
def _rms_norm_fake(input, normalized_shape, weight=None, eps=None):
    _check_norm("rms_norm", input, None, normalized_shape, weight, None)
    return input.new_empty(input.shape)


@torch.library.register_fake("torchops::_rms_norm_forward")
def _rms_norm_forward_fake(input, normalized_shape, weight, eps):
    stat = _check_norm("_rms_norm_forward", input, None, normalized_shape, weight, None)
    return input.new_empty(input.shape), input.new_empty(stat, dtype=_stat_dtype(input.dtype))


@torch.library.register_fake("torchops::_rms_norm_backward")
def _rms_norm_backward_fake(grad, input, rstd, normalized_shape, weight, output_mask):
    _check_norm_backward("_rms_norm_backward", grad, input, None, rstd, normalized_shape,
                         weight, None)
    dx = input.new_empty(input.shape if output_mask[0] else (0,))
    return dx, _param_grad(weight, input, output_mask[1])


@torch.library.register_fake("torchops::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, normalized_shape, weight=None, eps=None):
    _check_norm("fused_add_rms_norm", input, residual, normalized_shape, weight, None)
    return input.new_empty(input.shape), input.new_empty(input.shape)


@torch.library.register_fake("torchops::_fused_add_rms_norm_forward")
def _fused_add_rms_norm_forward_fake(input, residual, normalized_shape, weight, eps):
    stat = _check_norm("_fused_add_rms_norm_forward", input, residual, normalized_shape, weight,
                       None)
    return (input.new_empty(input.shape), input.new_empty(input.shape),
            input.new_empty(stat, dtype=_stat_dtype(input.dtype)))


@torch.library.register_fake("torchops::fused_add_rms_norm_")
def _fused_add_rms_norm_inplace_fake(input, residual, weight, eps):
    op = "fused_add_rms_norm_"
    _check_same_device(op, input=input, residual=residual, weight=weight)
    torch._check(input.dim() >= 1, lambda: f"torchops.{op}: expected 'input' to have at least "
                 f"one dimension")
    _check_norm(op, input, residual, input.shape[-1:], weight, None)
    return None


@torch.library.register_fake("torchops::layer_norm")
def _layer_norm_fake(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    _check_norm("layer_norm", input, None, normalized_shape, weight, bias)
    return input.new_empty(input.shape)


@torch.library.register_fake("torchops::_layer_norm_forward")
def _layer_norm_forward_fake(input, normalized_shape, weight, bias, eps):
    stat = _check_norm("_layer_norm_forward", input, None, normalized_shape, weight, bias)
    sdtype = _stat_dtype(input.dtype)
    return (input.new_empty(input.shape), input.new_empty(stat, dtype=sdtype),
            input.new_empty(stat, dtype=sdtype))


@torch.library.register_fake("torchops::_layer_norm_backward")
def _layer_norm_backward_fake(grad, input, mean, rstd, normalized_shape, weight, bias,
                              output_mask):
    _check_norm_backward("_layer_norm_backward", grad, input, mean, rstd, normalized_shape,
                         weight, bias)
    dx = input.new_empty(input.shape if output_mask[0] else (0,))
    return (dx, _param_grad(weight, input, output_mask[1]),
            _param_grad(bias, input, output_mask[2]))


# --- softmax ------------------------------------------------------------------------

__all__ += ["scaled_masked_softmax", "scaled_upper_triang_masked_softmax"]


def scaled_masked_softmax(input: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Fused ``softmax(input * scale)`` over the last dim, masked keys left out.

    ``input`` is ``(B, H, Sq, Sk)`` attention scores; ``mask`` a bool tensor of
    shape ``(B, 1, Sq, Sk)`` or ``(1, 1, Sq, Sk)`` whose True entries are
    masked (Megatron's and ColossalAI's layout): they get probability 0.  A
    row with every key masked is all zeros, not NaN (Megatron fills masked
    scores with -10000 instead, which makes such a row uniform).  Scores of
    -inf count as masked; a NaN or +inf score makes the unmasked keys of its
    row NaN, as in :func:`torch.softmax`.  ``scale`` is a float.  Any ``Sk``; float32, float64, float16, bfloat16 on CPU and
    CUDA, computed in float32 (float64 for float64), returned in the input's
    dtype as a new contiguous tensor.  Differentiable in ``input`` (once):
    ``dx = scale * y * (dy - sum(dy * y))``, zero at masked keys.  No autocast
    policy: the input's dtype is kept under ``torch.autocast``.
    Deterministic.  Raises RuntimeError on wrong shapes, dtypes or devices.
    """
    return torch.ops.torchops.scaled_masked_softmax.default(input, mask, scale)


def scaled_upper_triang_masked_softmax(input: Tensor, scale: float) -> Tensor:
    """Fused causal ``softmax(input * scale)`` over the last dim.

    ``input`` is ``(B, Sq, Sk)`` or ``(B, H, Sq, Sk)`` with ``Sq == Sk``
    (self-attention, as Megatron requires); key ``j`` of query ``i`` is
    masked for ``j > i``.  Only the lower triangle is read and computed;
    the output has zeros above the diagonal.  Any ``Sk``; float32, float64,
    float16, bfloat16 on CPU and CUDA, computed in float32 (float64 for
    float64), returned in the input's dtype as a new contiguous tensor.
    Differentiable in ``input`` (once; the backward also reads only the
    triangle).  No autocast policy.  Deterministic.  Raises RuntimeError on
    wrong shapes, dtypes or devices.
    """
    return torch.ops.torchops.scaled_upper_triang_masked_softmax.default(input, scale)


def _check_softmax_dim(op: str, name: str, t: Tensor, dims: tuple[int, ...]) -> None:
    ndim, shape = t.dim(), tuple(t.shape)
    want = " or ".join(str(d) for d in dims)
    torch._check(ndim in dims, lambda: f"torchops.{op}: expected '{name}' to have {want} "
                 f"dimensions, but got {ndim} (shape {shape})")


def _check_upper_triang(op: str, name: str, t: Tensor) -> None:
    shape = tuple(t.shape)
    torch._check(t.dim() in (3, 4), lambda: f"torchops.{op}: expected '{name}' to have 3 "
                 f"dimensions (B, Sq, Sk) or 4 (B, H, Sq, Sk), but got {len(shape)} "
                 f"(shape {shape})")
    torch._check(t.shape[-1] == t.shape[-2], lambda: f"torchops.{op}: expected '{name}' to be "
                 f"square in its last two dimensions (Sq == Sk, the causal mask of "
                 f"self-attention), but got shape {shape}")


def _check_softmax_backward(op: str, grad: Tensor, output: Tensor, causal: bool) -> None:
    _check_same_device(op, output=output, grad=grad)
    _check_floating(op, "output", output)
    _check_same_dtype(op, output=output, grad=grad)
    oshape, gshape = tuple(output.shape), tuple(grad.shape)
    torch._check(grad.shape == output.shape, lambda: f"torchops.{op}: expected 'grad' to have "
                 f"the shape of 'output' ({oshape}), but got {gshape}")
    if causal:
        _check_upper_triang(op, "output", output)
    else:
        _check_softmax_dim(op, "output", output, (4,))


@torch.library.register_fake("torchops::scaled_masked_softmax")
def _scaled_masked_softmax_fake(input: Tensor, mask: Tensor, scale: float) -> Tensor:
    op = "scaled_masked_softmax"
    _check_same_device(op, input=input, mask=mask)
    _check_floating(op, "input", input)
    _check_softmax_dim(op, "input", input, (4,))
    mdtype = mask.dtype
    torch._check(mdtype == torch.bool, lambda: f"torchops.{op}: expected 'mask' to be a bool "
                 f"tensor, but got {mdtype}")
    _check_softmax_dim(op, "mask", mask, (4,))
    ishape, mshape = tuple(input.shape), tuple(mask.shape)
    torch._check(
        (mask.shape[0] == 1 or mask.shape[0] == input.shape[0]) and mask.shape[1] == 1
        and mask.shape[2] == input.shape[2] and mask.shape[3] == input.shape[3],
        lambda: f"torchops.{op}: expected 'mask' to have shape ({ishape[0]} or 1, 1, "
        f"{ishape[2]}, {ishape[3]}) for 'input' of shape {ishape}, but got {mshape}")
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("torchops::_scaled_masked_softmax_backward")
def _scaled_masked_softmax_backward_fake(grad: Tensor, output: Tensor, scale: float) -> Tensor:
    _check_softmax_backward("_scaled_masked_softmax_backward", grad, output, causal=False)
    return torch.empty(output.shape, dtype=output.dtype, device=output.device)


@torch.library.register_fake("torchops::scaled_upper_triang_masked_softmax")
def _scaled_upper_triang_masked_softmax_fake(input: Tensor, scale: float) -> Tensor:
    op = "scaled_upper_triang_masked_softmax"
    _check_floating(op, "input", input)
    _check_upper_triang(op, "input", input)
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("torchops::_scaled_upper_triang_masked_softmax_backward")
def _scaled_upper_triang_masked_softmax_backward_fake(grad: Tensor, output: Tensor,
                                                      scale: float) -> Tensor:
    _check_softmax_backward("_scaled_upper_triang_masked_softmax_backward", grad, output,
                            causal=True)
    return torch.empty(output.shape, dtype=output.dtype, device=output.device)


# --- activations ------------------------------------------------------------------------

__all__ += ["silu_and_mul", "gelu_and_mul"]

_GATED_ACTIVATION_DOC = """

    ``x`` holds the activation's input ``a`` and the gate ``b`` side by side
    in its last dimension (vLLM's and ColossalAI's layout): with
    ``d = x.shape[-1] // 2``, ``a = x[..., :d]`` and ``b = x[..., d:]``.  The
    result has shape ``(..., d)``, x's dtype, and is a new contiguous tensor.

    Any leading dimensions, strides and empty inputs are accepted; rows whose
    last dimension is contiguous (a slice along it, rows picked with a step)
    are read in place, anything else is copied first.  float32, float64,
    float16 and bfloat16 (the half types computed in float32, rounded once)
    on CPU and CUDA.  Differentiable once with respect to ``x`` (one fused
    backward pass writes both halves of its gradient); deterministic.  No
    autocast policy, like :func:`torch.nn.functional.silu` and
    :func:`~torch.nn.functional.gelu`: inside ``torch.autocast`` it runs in
    x's dtype.

    Raises RuntimeError naming the op and ``'x'`` when the last dimension of
    ``x`` is odd, ``x`` is 0-dim, or not floating point.
    """


def silu_and_mul(x: Tensor) -> Tensor:
    return torch.ops.torchops.silu_and_mul.default(x)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    return torch.ops.torchops.gelu_and_mul.default(x, approximate)


silu_and_mul.__doc__ = ("``F.silu(a) * b``: the gated SiLU (SwiGLU) of a LLaMA-style MLP, "
                        "in one pass." + _GATED_ACTIVATION_DOC)
gelu_and_mul.__doc__ = ("``F.gelu(a, approximate=approximate) * b``: the gated GELU (GeGLU), "
                        "in one pass; ``approximate`` is ``\"none\"`` (erf) or ``\"tanh\"``, "
                        "as for :func:`torch.nn.functional.gelu` (anything else raises "
                        "RuntimeError naming ``'approximate'``)." + _GATED_ACTIVATION_DOC)


def _check_act_and_mul(op: str, x: Tensor) -> list:
    """The kernels' checks (csrc/common/act_and_mul.h); the output's shape."""
    _check_floating(op, "x", x)
    torch._check(x.dim() >= 1, lambda: f"torchops.{op}: expected 'x' to have at least 1 "
                 "dimension, but got a 0-dim tensor")
    shape = tuple(x.shape)
    torch._check(x.shape[-1] % 2 == 0,
                 lambda: f"torchops.{op}: expected the last dimension of 'x' to be even (the "
                 f"activation's input and the gate, side by side), but got shape {shape}")
    return [*x.shape[:-1], x.shape[-1] // 2]


def _check_gelu_approximate(op: str, approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise RuntimeError(f"torchops.{op}: expected 'approximate' to be 'none' or 'tanh', "
                           f"but got '{approximate}'")


def _check_act_and_mul_backward(op: str, grad: Tensor, x: Tensor) -> None:
    _check_same_device(op, x=x, grad=grad)
    out_shape = _check_act_and_mul(op, x)
    _check_same_dtype(op, x=x, grad=grad)
    grad_shape = tuple(grad.shape)
    torch._check(grad.dim() == len(out_shape) and all(a == b for a, b in zip(grad.shape, out_shape)),
                 lambda: f"torchops.{op}: expected 'grad' to have the output's shape "
                 f"{tuple(out_shape)}, but got {grad_shape}")


@torch.library.register_fake("torchops::silu_and_mul")
def _silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty(_check_act_and_mul("silu_and_mul", x))


@torch.library.register_fake("torchops::gelu_and_mul")
def _gelu_and_mul_fake(x: Tensor, approximate: str = "none") -> Tensor:
    shape = _check_act_and_mul("gelu_and_mul", x)
    _check_gelu_approximate("gelu_and_mul", approximate)
    return x.new_empty(shape)


@torch.library.register_fake("torchops::_silu_and_mul_backward")
def _silu_and_mul_backward_fake(grad: Tensor, x: Tensor) -> Tensor:
    _check_act_and_mul_backward("_silu_and_mul_backward", grad, x)
    return x.new_empty(x.shape)


@torch.library.register_fake("torchops::_gelu_and_mul_backward")
def _gelu_and_mul_backward_fake(grad: Tensor, x: Tensor, approximate: str) -> Tensor:
    _check_act_and_mul_backward("_gelu_and_mul_backward", grad, x)
    _check_gelu_approximate("_gelu_and_mul_backward", approximate)
    return x.new_empty(x.shape)


# --- rotary ----------------------------------------------------------------------------

__all__ += ["rotary_embedding", "rotary_embedding_"]


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1,
                     interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k``: a drop-in for Hugging
    Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.

    ``q`` and ``k`` are ``(B, H, S, D)`` with ``unsqueeze_dim=1`` or ``(B, S,
    H, D)`` with ``unsqueeze_dim=2`` (-3 and -2 mean the same), any strides;
    their head counts may differ (GQA).  ``cos`` and ``sin`` are ``(B, S,
    rotary_dim)``, ``(1, S, rotary_dim)`` or ``(S, rotary_dim)`` (shared by
    every batch).  The first ``rotary_dim`` (even, at most ``D``) entries of
    each head become ``x * cos + rotate(x) * sin``, each entry with its own
    cos and sin value; the rest pass through.  ``interleaved=False`` rotates
    halves (NeoX, Llama: ``rotate_half``); ``True`` rotates adjacent pairs
    (GPT-J): ``out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i]``, ``out[2i+1] =
    x[2i+1] cos[2i+1] + x[2i] sin[2i+1]``.

    All four tensors share one dtype: float32, float64, float16 or bfloat16
    (half types computed in float32), on CPU or CUDA.  Returns new
    contiguous ``(q_out, k_out)`` of ``q``'s and ``k``'s shapes.
    Differentiable in ``q``, ``k``, ``cos`` and ``sin``; cos's and sin's
    gradients sum over heads (and batches when shared) in a fixed order, so
    the backward is deterministic.  Wrong shapes, dtypes or devices raise
    RuntimeError naming the argument.
    """
    if unsqueeze_dim < 0:
        unsqueeze_dim += 4  # the dim of the unsqueezed 4-D cos
    return torch.ops.torchops.rotary_embedding.default(q, k, cos, sin, unsqueeze_dim, interleaved)


def rotary_embedding_(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                      interleaved: bool = False) -> None:
    """In-place rotary embedding with vLLM's semantics (its
    ``rotary_embedding(positions, query, key, head_size, cos_sin_cache,
    is_neox)`` with ``is_neox = not interleaved``), for inference.

    ``positions`` is int64, ``(T,)`` or ``(B, S)``; ``q`` and ``k`` are
    ``(*positions.shape, heads, head_size)`` (head counts may differ), any
    strides, rotated in place; ``cos_sin_cache`` is ``(max_position,
    rotary_dim)``, each row ``[cos | sin]`` of ``rotary_dim / 2`` values
    (``rotary_dim`` even, at most ``head_size``).  Pair ``i`` of a head --
    entries ``(i, i + rotary_dim / 2)``, or ``(2i, 2i + 1)`` interleaved --
    rotates by ``cache[positions[...], i]`` and ``cache[..., rotary_dim / 2 +
    i]``; the entries past ``rotary_dim`` are left as they are.  One dtype for
    q, k and the cache (float32, float64, float16, bfloat16; half types
    computed in float32).  No autograd.  A position outside ``[0,
    max_position)`` raises RuntimeError on CPU before anything is written; on
    CUDA it fails a device-side assertion (as ``torch.index_select`` does,
    without a host sync) and leaves its row untouched.  Returns None.
    """
    torch.ops.torchops.rotary_embedding_.default(positions, q, k, cos_sin_cache, interleaved)


def _check_rotary_qk(op: str, q: Tensor, k: Tensor, s_dim: int, h_dim: int):
    qshape, kshape = tuple(q.shape), tuple(k.shape)
    for name, t, shape in (("q", q, qshape), ("k", k, kshape)):
        torch._check(t.dim() == 4, lambda: f"torchops.{op}: expected '{name}' to have 4 "
                     f"dimensions, but got {len(shape)} (shape {shape})")
    _check_floating(op, "q", q)
    _check_same_dtype(op, q=q, k=k)
    b, s = qshape[0], qshape[s_dim]
    torch._check(k.shape[0] == b and k.shape[s_dim] == s,
                 lambda: f"torchops.{op}: expected 'k' to have the batch and sequence sizes of "
                 f"'q' ({b}, {s}), but got shape {kshape}")
    return b, s


def _check_rotary_dim(op: str, rd, dq, dk, name: str) -> None:
    torch._check(rd % 2 == 0, lambda: f"torchops.{op}: expected the rotary dim (the last size "
                 f"of '{name}') to be even, but got {rd}")
    torch._check(rd <= dq and rd <= dk, lambda: f"torchops.{op}: expected the rotary dim (the "
                 f"last size of '{name}', {rd}) to be at most the head size of 'q' ({dq}) and "
                 f"of 'k' ({dk})")


def _check_rotary_embedding(op: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                            unsqueeze_dim: int) -> None:
    _check_same_device(op, q=q, k=k, cos=cos, sin=sin)
    torch._check(unsqueeze_dim in (1, 2), lambda: f"torchops.{op}: expected 'unsqueeze_dim' to "
                 f"be 1 (q, k of shape (B, H, S, D)) or 2 (shape (B, S, H, D)), but got "
                 f"{unsqueeze_dim}")
    s_dim, h_dim = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    b, s = _check_rotary_qk(op, q, k, s_dim, h_dim)
    _check_same_dtype(op, q=q, cos=cos)
    _check_same_dtype(op, q=q, sin=sin)
    cshape, sshape = tuple(cos.shape), tuple(sin.shape)
    torch._check(cos.dim() in (2, 3), lambda: f"torchops.{op}: expected 'cos' to have shape "
                 f"(B, S, rotary_dim) or (S, rotary_dim), but got {cshape}")
    torch._check(sshape == cshape, lambda: f"torchops.{op}: expected 'sin' to have the shape of "
                 f"'cos' ({cshape}), but got {sshape}")
    bc = cshape[0] if len(cshape) == 3 else 1
    torch._check(cshape[-2] == s and (bc == 1 or bc == b),
                 lambda: f"torchops.{op}: expected 'cos' to have shape ({b} or 1, {s}, "
                 f"rotary_dim) or ({s}, rotary_dim) to match 'q' (batch {b}, sequence {s}), "
                 f"but got {cshape}")
    _check_rotary_dim(op, cshape[-1], q.shape[3], k.shape[3], "cos")


@torch.library.register_fake("torchops::rotary_embedding")
def _rotary_embedding_fake(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1,
                           interleaved: bool = False) -> tuple[Tensor, Tensor]:
    _check_rotary_embedding("rotary_embedding", q, k, cos, sin, unsqueeze_dim)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("torchops::_rotary_embedding_backward")
def _rotary_embedding_backward_fake(grad_q: Tensor, grad_k: Tensor, q: Tensor, k: Tensor,
                                    cos: Tensor, sin: Tensor, unsqueeze_dim: int,
                                    interleaved: bool, cos_sin_grad: bool):
    op = "_rotary_embedding_backward"
    _check_rotary_embedding(op, q, k, cos, sin, unsqueeze_dim)
    _check_same_device(op, q=q, grad_q=grad_q, grad_k=grad_k)
    _check_same_dtype(op, q=q, grad_q=grad_q)
    _check_same_dtype(op, q=q, grad_k=grad_k)
    for name, g, x in (("grad_q", grad_q, "q"), ("grad_k", grad_k, "k")):
        t = q if x == "q" else k
        gshape, xshape = tuple(g.shape), tuple(t.shape)
        torch._check(gshape == xshape, lambda: f"torchops.{op}: expected '{name}' to have the "
                     f"shape of '{x}' ({xshape}), but got {gshape}")
    cs_shape = cos.shape if cos_sin_grad else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), cos.new_empty(cs_shape),
            sin.new_empty(cs_shape))


@torch.library.register_fake("torchops::rotary_embedding_")
def _rotary_embedding_inplace_fake(positions: Tensor, q: Tensor, k: Tensor,
                                   cos_sin_cache: Tensor, interleaved: bool = False) -> None:
    op = "rotary_embedding_"
    _check_same_device(op, q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    pdtype = positions.dtype
    torch._check(pdtype == torch.int64, lambda: f"torchops.{op}: expected 'positions' to be an "
                 f"int64 tensor, but got {pdtype}")
    pshape, qshape, kshape = tuple(positions.shape), tuple(q.shape), tuple(k.shape)
    pd = len(pshape)
    torch._check(pd in (1, 2), lambda: f"torchops.{op}: expected 'positions' to be 1-D "
                 f"(tokens) or 2-D (batch, sequence), but got shape {pshape}")
    torch._check(len(qshape) == pd + 2 and len(kshape) == pd + 2 and qshape[:pd] == pshape
                 and kshape[:pd] == pshape,
                 lambda: f"torchops.{op}: expected 'q' and 'k' to have shape "
                 f"(*positions.shape, heads, head_size) with positions of shape {pshape}, but "
                 f"got {qshape} and {kshape}")
    _check_floating(op, "q", q)
    _check_same_dtype(op, q=q, k=k)
    _check_same_dtype(op, q=q, cos_sin_cache=cos_sin_cache)
    cshape = tuple(cos_sin_cache.shape)
    torch._check(len(cshape) == 2, lambda: f"torchops.{op}: expected 'cos_sin_cache' to have 2 "
                 f"dimensions, but got {len(cshape)} (shape {cshape})")
    _check_rotary_dim(op, cshape[1], qshape[-1], kshape[-1], "cos_sin_cache")
    return None


# --- losses: fused linear cross-entropy ------------------------------------------------

__all__ += ["fused_linear_cross_entropy"]


def fused_linear_cross_entropy(input: Tensor, weight: Tensor, target: Tensor,
                               bias: Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               lse_square_scale: float = 0.0,
                               softcap: float | None = None) -> Tensor:
    """The cross-entropy of a linear layer's logits without materialising them:
    ``F.cross_entropy((input @ weight.T + bias).float(), target, ignore_index=...,
    label_smoothing=..., reduction=...)``, the language-model head and its loss.

    Args:
        input: ``(..., H)``; its leading dims flatten into N tokens.  float32,
            float16, bfloat16 (CPU and CUDA) or float64 (CPU and CUDA).
        weight: ``(V, H)``, the input's dtype and device.  A DTensor sharded over
            the vocabulary (``Shard(0)``, a vocabulary-parallel head) takes the
            tensor-parallel path: each rank computes its slice's logsumexp and
            one all-reduce combines them.
        target: int64 class indices with one value per token (any shape with N
            elements); ``ignore_index`` marks tokens left out of the loss.
        bias: ``(V,)`` or None.
        label_smoothing: in [0, 1], as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over the tokens not ignored: nan when all are),
            ``"sum"`` or ``"none"`` (one value per token, the target's shape).
        lse_square_scale: adds the z-loss ``lse_square_scale * logsumexp(logits)**2``
            of every token not ignored (PaLM).
        softcap: caps the logits first, ``softcap * tanh(logits / softcap)`` (Gemma 2).

    Returns the loss in float32 (float64 for float64 inputs).  The logits of a
    chunk of tokens at a time are all that is ever stored (the chunk's memory
    budget: ``TORCHOPS_LCE_CHUNK_MIB``).  Differentiable in input, weight and
    bias: for ``"mean"``/``"sum"`` the gradients come out of the forward's
    pass (no second pass over the vocabulary), for ``"none"`` the backward
    recomputes the logits.  Deterministic.  Under ``torch.autocast`` input,
    weight and bias are cast as ``F.linear`` casts them.  A target outside
    ``[0, V)`` that is not ``ignore_index`` raises RuntimeError (on CUDA after
    one host sync; see ``TORCHOPS_LCE_TARGET_CHECK``).  Raises ValueError for
    an unknown ``reduction``, as ``F.cross_entropy`` does.
    """
    _check_reduction("fused_linear_cross_entropy", reduction, ValueError)
    if _is_vocab_sharded(weight):
        from torchops import tensor_parallel
        return tensor_parallel.vocab_parallel_cross_entropy(
            input, weight, target, bias, ignore_index, label_smoothing, reduction,
            lse_square_scale, softcap)
    return torch.ops.torchops.fused_linear_cross_entropy.default(
        input, weight, target, bias, ignore_index, label_smoothing, reduction,
        lse_square_scale, softcap)


def _is_vocab_sharded(weight: Tensor) -> bool:
    """Whether `weight` is a DTensor (checked without importing DTensor when
    torch.distributed.tensor was never imported: then it cannot be one)."""
    import sys
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(weight, dt.DTensor)


def _lce_acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_lce(op: str, input: Tensor, weight: Tensor, target: Tensor,
               bias: Tensor | None) -> int:
    """The kernels' operand checks; returns N, the number of tokens."""
    if bias is not None:
        _check_same_device(op, input=input, weight=weight, target=target, bias=bias)
    else:
        _check_same_device(op, input=input, weight=weight, target=target)
    _check_floating(op, "input", input)
    _check_same_dtype(op, input=input, weight=weight)
    torch._check(input.dim() >= 1, lambda: f"torchops.{op}: expected 'input' to have at "
                 "least 1 dimension (..., H), but got a 0-dim tensor")
    w_shape = tuple(weight.shape)
    torch._check(weight.dim() == 2, lambda: f"torchops.{op}: expected 'weight' to be 2-D "
                 f"(V, H), but got shape {w_shape}")
    h = input.shape[-1]
    torch._check(weight.shape[1] == h, lambda: f"torchops.{op}: expected 'weight' to have "
                 f"{h} columns like the last dimension of 'input' (shape "
                 f"{tuple(input.shape)}), but got shape {w_shape}")
    torch._check(weight.shape[0] > 0, lambda: f"torchops.{op}: expected 'weight' to have "
                 f"at least one row (class), but got shape {w_shape}")
    rows = 1
    for s in input.shape[:-1]:
        rows = rows * s
    torch._check(target.dtype == torch.int64, lambda: f"torchops.{op}: expected 'target' "
                 f"to be int64 class indices, but got {target.dtype}")
    torch._check(target.numel() == rows, lambda: f"torchops.{op}: expected 'target' to have "
                 f"one class index per row of 'input' ({rows} rows of shape "
                 f"{tuple(input.shape)}), but got shape {tuple(target.shape)}")
    if bias is not None:
        _check_same_dtype(op, input=input, bias=bias)
        v = weight.shape[0]
        torch._check(bias.dim() == 1 and bias.shape[0] == v, lambda: f"torchops.{op}: "
                     f"expected 'bias' to have shape ({v}), but got {tuple(bias.shape)}")
    return rows


def _check_lce_options(op: str, label_smoothing: float, reduction: str,
                       lse_square_scale: float, softcap: float | None) -> None:
    torch._check(0.0 <= label_smoothing <= 1.0, lambda: f"torchops.{op}: expected "
                 f"'label_smoothing' to be in [0, 1], but got {label_smoothing}")
    torch._check(math.isfinite(lse_square_scale) and lse_square_scale >= 0.0,
                 lambda: f"torchops.{op}: expected 'lse_square_scale' to be a finite number "
                 f">= 0, but got {lse_square_scale}")
    if softcap is not None:
        torch._check(math.isfinite(softcap) and softcap > 0.0, lambda: f"torchops.{op}: "
                     f"expected 'softcap' to be None or a finite number > 0, but got {softcap}")
    _check_reduction(op, reduction)


def _lce_grads_fake(input: Tensor, weight: Tensor, bias: Tensor | None,
                    mask) -> tuple[Tensor, Tensor, Tensor]:
    def placeholder():
        return input.new_empty((0,))
    gi = torch.empty_like(input, memory_format=torch.contiguous_format) if mask[0] \
        else placeholder()
    gw = weight.new_empty(weight.shape) if mask[1] else placeholder()
    gb = input.new_empty((weight.shape[0],)) if mask[2] and bias is not None \
        else placeholder()
    return gi, gw, gb


@torch.library.register_fake("torchops::fused_linear_cross_entropy")
def _fused_linear_cross_entropy_fake(input, weight, target, bias=None, ignore_index=-100,
                                     label_smoothing=0.0, reduction="mean",
                                     lse_square_scale=0.0, softcap=None):
    op = "fused_linear_cross_entropy"
    _check_lce_options(op, label_smoothing, reduction, lse_square_scale, softcap)
    _check_lce(op, input, weight, target, bias)
    shape = target.shape if reduction == "none" else ()
    return input.new_empty(shape, dtype=_lce_acc_dtype(input.dtype))


@torch.library.register_fake("torchops::_fused_linear_cross_entropy_forward")
def _fused_linear_cross_entropy_forward_fake(input, weight, target, bias, ignore_index,
                                             label_smoothing, reduction, lse_square_scale,
                                             softcap, output_mask):
    op = "_fused_linear_cross_entropy_forward"
    _check_lce_options(op, label_smoothing, reduction, lse_square_scale, softcap)
    torch._check(not any(output_mask) or reduction != "none", lambda: f"torchops.{op}: "
                 "gradients are computed in the forward only for a scalar loss (reduction "
                 "'mean' or 'sum'), but got reduction 'none'")
    n = _check_lce(op, input, weight, target, bias)
    acc = _lce_acc_dtype(input.dtype)
    shape = target.shape if reduction == "none" else ()
    loss = input.new_empty(shape, dtype=acc)
    lse = input.new_empty((n,), dtype=acc)
    return (loss, lse, *_lce_grads_fake(input, weight, bias, output_mask))


@torch.library.register_fake("torchops::_fused_linear_cross_entropy_backward")
def _fused_linear_cross_entropy_backward_fake(grad, input, weight, target, bias, lse,
                                              ignore_index, label_smoothing, reduction,
                                              lse_square_scale, softcap, vocab_start,
                                              vocab_size, output_mask):
    op = "_fused_linear_cross_entropy_backward"
    _check_lce_options(op, label_smoothing, reduction, lse_square_scale, softcap)
    torch._check(vocab_size > 0, lambda: f"torchops.{op}: expected 'vocab_size' > 0, but "
                 f"got {vocab_size}")
    n = _check_lce(op, input, weight, target, bias)
    _check_lce_vocab(op, vocab_start, vocab_size, weight.shape[0])
    _check_same_device(op, input=input, grad=grad, lse=lse)
    acc = _lce_acc_dtype(input.dtype)
    torch._check(lse.dim() == 1 and lse.shape[0] == n and lse.dtype == acc,
                 lambda: f"torchops.{op}: expected 'lse' of shape ({n}) and dtype {acc}, but "
                 f"got shape {tuple(lse.shape)} and dtype {lse.dtype}")
    torch._check(grad.dtype == acc, lambda: f"torchops.{op}: expected 'grad' of dtype {acc} "
                 f"(the loss's), but got {grad.dtype}")
    if reduction == "none":
        torch._check(grad.numel() == n, lambda: f"torchops.{op}: expected 'grad' to have one "
                     f"value per token ({n}) for reduction 'none', but got shape "
                     f"{tuple(grad.shape)}")
    else:
        torch._check(grad.dim() == 0, lambda: f"torchops.{op}: expected 'grad' to be a 0-dim "
                     f"tensor for reduction '{reduction}', but got shape {tuple(grad.shape)}")
    return _lce_grads_fake(input, weight, bias, output_mask)


def _check_lce_vocab(op: str, start: int, total: int, v: int) -> None:
    torch._check(start >= 0 and total >= v and start <= total - v, lambda: f"torchops.{op}: "
                 f"expected the weight's {v} rows to be classes [vocab_start, vocab_start + {v})"
                 f" of vocab_size, but got vocab_start {start} and vocab_size {total}")


@torch.library.register_fake("torchops::_fused_linear_cross_entropy_stats")
def _fused_linear_cross_entropy_stats_fake(input, weight, target, bias, ignore_index, softcap,
                                           vocab_start, vocab_size):
    op = "_fused_linear_cross_entropy_stats"
    _check_lce_options(op, 0.0, "none", 0.0, softcap)
    torch._check(vocab_size > 0, lambda: f"torchops.{op}: expected 'vocab_size' > 0, but "
                 f"got {vocab_size}")
    n = _check_lce(op, input, weight, target, bias)
    _check_lce_vocab(op, vocab_start, vocab_size, weight.shape[0])
    return input.new_empty((n, 3), dtype=_lce_acc_dtype(input.dtype))


@torch.library.register_fake("torchops::_fused_linear_cross_entropy_scale_")
def _fused_linear_cross_entropy_scale__fake(grads, scale) -> None:
    op = "_fused_linear_cross_entropy_scale_"
    for i, t in enumerate(grads):
        _check_same_device(op, grads=t, scale=scale)
        _check_floating(op, "grads", t)
        dt, st, shape, s_shape = t.dtype, scale.dtype, tuple(t.shape), tuple(scale.shape)
        torch._check(t.is_contiguous() and scale.dim() == 0 and st == _lce_acc_dtype(dt),
                     lambda: f"torchops.{op}: expected contiguous grads and a 0-dim scale of "
                     f"their accumulation type, but grads[{i}] is {dt} of shape {shape} and "
                     f"scale {st} of shape {s_shape}")


# --- optim: fused_adam_ ----------------------------------------------------------------

__all__ += ["fused_adam_"]


def fused_adam_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                state_steps: list[Tensor], *, lr: float | Tensor, beta1: float, beta2: float,
                eps: float, weight_decay: float, amsgrad: bool, maximize: bool, adamw: bool,
                master_params: list[Tensor] | None = None, grad_scale: Tensor | None = None,
                found_inf: Tensor | None = None) -> None:
    """One Adam (``adamw=False``) or AdamW step over lists of parameters, in
    place, in ``torch.optim.Adam``/``AdamW``'s order of operations (the
    update torchops.optim's optimizers call once per device and dtype).

    ``params[i]`` is updated with ``grads[i]`` and its moments
    ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (and ``max_exp_avg_sqs[i]`` with
    ``amsgrad``; an empty list without).  ``state_steps[i]`` is a float32
    one-element tensor holding the step number *after* this step (increment
    it before the call, as torch.optim's fused path does); bias correction
    reads it.  ``lr`` is a float or a float32 one-element tensor on the
    parameters' device (read by the kernel: changing it recompiles nothing).
    ``grad_scale``/``found_inf`` (float32, one element) follow
    ``torch._fused_adamw_``: grads are divided by ``grad_scale`` and written
    back unscaled; ``found_inf == 1`` skips the step (nothing is written).

    Without ``master_params`` every list has the parameters' dtype (float32,
    float64, float16, bfloat16; half types computed in float32).  With them,
    ``params`` are float16/bfloat16, ``master_params`` (float32) are updated
    and rounded into ``params`` in the same pass, the moments are float32 and
    the grads the parameters' dtype or float32.  All tensors of one call are
    on one device, and ``*[i]`` have ``params[i]``'s shape and strides.  A
    mismatch, a sparse gradient, or a parameter given twice raises a
    RuntimeError naming the list and index.  CPU and CUDA (one launch over
    many tensors).  No autograd.  Returns None.
    """
    kw = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
              maximize=maximize, adamw=adamw, master_params=master_params,
              grad_scale=grad_scale, found_inf=found_inf)
    if isinstance(lr, Tensor):
        torch.ops.torchops.fused_adam_.tensor_lr(params, grads, exp_avgs, exp_avg_sqs,
                                                 max_exp_avg_sqs, state_steps, lr=lr, **kw)
    else:
        torch.ops.torchops.fused_adam_.default(params, grads, exp_avgs, exp_avg_sqs,
                                               max_exp_avg_sqs, state_steps, lr=float(lr), **kw)


def _check_fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                      beta1, beta2, amsgrad, master_params, lr, grad_scale, found_inf) -> None:
    """The kernels' checks (csrc/common/fused_adam.h), for the fakes."""
    import torch._prims_common as prims

    # Contiguous (what parameters are) decides without inspecting symbolic strides.
    dense_check = (getattr(prims, "is_non_overlapping_and_dense", None)
                   or prims.is_non_overlapping_and_dense_or_false)

    def is_non_overlapping_and_dense(t) -> bool:
        return t.is_contiguous() or dense_check(t)

    def fail(msg: str):
        raise RuntimeError(f"torchops.fused_adam_: {msg}")

    n = len(params)
    lists = [("grads", grads, n), ("exp_avgs", exp_avgs, n), ("exp_avg_sqs", exp_avg_sqs, n),
             ("max_exp_avg_sqs", max_exp_avg_sqs, n if amsgrad else 0),
             ("state_steps", state_steps, n)]
    if master_params is not None:
        lists.append(("master_params", master_params, n))
    for name, lst, want in lists:
        if len(lst) != want:
            fail(f"expected '{name}' to have {want} tensors (one per parameter"
                 f"{', none without amsgrad' if want == 0 else ''}), but got {len(lst)}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        fail(f"expected 'beta1' and 'beta2' in [0, 1), but got {beta1} and {beta2}")
    if n == 0:
        return
    p0 = params[0]
    if not p0.is_floating_point():
        fail(f"expected 'params[0]' to be a floating-point tensor, but got {p0.dtype}")
    pt = p0.dtype
    master = master_params is not None
    if master and pt not in (torch.float16, torch.bfloat16):
        fail(f"with 'master_params', expected 'params' to be float16 or bfloat16, but got {pt}")
    st = torch.float32 if master else pt
    gt = grads[0].dtype
    if not (gt == pt or (master and gt == torch.float32)):
        fail(f"expected 'grads[0]' to have dtype {pt}{' or float32' if master else ''}, but got "
             f"{gt}")

    def like(p, ref, name, i, t, dtype):
        where = f"{name}[{i}]"
        if t.layout != torch.strided:
            fail(f"'{where}' must be a dense (strided) tensor, but got layout {t.layout} "
                 f"(sparse gradients are not supported)")
        if t.device != p.device:
            fail(f"'{where}' is on {t.device} but '{ref}' is on {p.device}")
        if t.dtype != dtype:
            fail(f"expected '{where}' to have dtype {dtype}, but got {t.dtype}")
        if t.shape != p.shape:
            fail(f"'{where}' has shape {list(t.shape)} but '{ref}' has shape {list(p.shape)}")
        if not is_non_overlapping_and_dense(t) or t.stride() != p.stride():
            fail(f"'{where}' must be dense with the strides of '{ref}' ({list(p.stride())}), "
                 f"but got strides {list(t.stride())}")

    def scalar(t, name):
        if t.layout != torch.strided or t.numel() != 1 or t.dtype != torch.float32:
            fail(f"expected '{name}' to be a float32 tensor of one element, but got {t.dtype} "
                 f"of shape {list(t.shape)}")
        if t.device != p0.device:
            fail(f"'{name}' is on {t.device} but 'params[0]' is on {p0.device}")

    seen: set[int] = set()
    for i, p in enumerate(params):
        ref = f"params[{i}]"
        if p.device != p0.device:
            fail(f"'{ref}' is on {p.device} but 'params[0]' is on {p0.device}")
        if p.dtype != pt:
            fail(f"expected '{ref}' to have dtype {pt} (that of 'params[0]'), but got {p.dtype}")
        if p.layout != torch.strided or not is_non_overlapping_and_dense(p):
            fail(f"'{ref}' must be a dense tensor")
        if id(p) in seen:
            fail(f"'{ref}' appears twice (or shares memory with another parameter)")
        seen.add(id(p))
        like(p, ref, "grads", i, grads[i], gt)
        like(p, ref, "exp_avgs", i, exp_avgs[i], st)
        like(p, ref, "exp_avg_sqs", i, exp_avg_sqs[i], st)
        if amsgrad:
            like(p, ref, "max_exp_avg_sqs", i, max_exp_avg_sqs[i], st)
        if master:
            like(p, ref, "master_params", i, master_params[i], torch.float32)
        scalar(state_steps[i], f"state_steps[{i}]")
    for name, t in (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None:
            scalar(t, name)


@torch.library.register_fake("torchops::fused_adam_")
def _fused_adam_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr,
                     beta1, beta2, eps, weight_decay, amsgrad, maximize, adamw,
                     master_params=None, grad_scale=None, found_inf=None) -> None:
    _check_fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                      beta1, beta2, amsgrad, master_params, None, grad_scale, found_inf)
    return None


@torch.library.register_fake("torchops::fused_adam_.tensor_lr")
def _fused_adam_tensor_lr_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                               state_steps, *, lr, beta1, beta2, eps, weight_decay, amsgrad,
                               maximize, adamw, master_params=None, grad_scale=None,
                               found_inf=None) -> None:
    _check_fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                      beta1, beta2, amsgrad, master_params, lr, grad_scale, found_inf)
    return None


# --- detection: multi-scale deformable attention ---------------------------------------------

__all__ += ["ms_deform_attn"]


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                   sampling_locations: Tensor, attention_weights: Tensor, *,
                   validate: bool = True) -> Tensor:
    """Multi-scale deformable attention's sampling (Deformable DETR; mmcv's
    ``multi_scale_deformable_attn``, same arguments and semantics).

    Args:
        value: ``(B, S, heads, C)``, the flattened feature maps of all levels,
            float32/float64/float16/bfloat16.
        spatial_shapes: ``(L, 2)`` int64 rows ``(H_l, W_l)``; stays a tensor
            (on value's device), read by the kernels where it lives.
        level_start_index: ``(L,)`` int64, where each level starts in ``S``
            (``0, H_0 W_0, H_0 W_0 + H_1 W_1, ...``).
        sampling_locations: ``(B, Q, heads, L, P, 2)`` of value's dtype,
            ``(x, y)`` in ``[0, 1]`` over each level (outside allowed).
        attention_weights: ``(B, Q, heads, L, P)`` of value's dtype.
        validate: check the values of ``spatial_shapes`` and
            ``level_start_index`` (below).

    For each level, location ``(x, y)`` is pixel ``(x W_l - 0.5, y H_l -
    0.5)`` (``align_corners=False``), sampled bilinearly with zeros outside
    the level; the samples are weighted by ``attention_weights`` and summed
    over levels and points.  Returns ``(B, Q, heads * C)`` in value's dtype
    (half types computed in float32); the same as
    ``F.grid_sample``'s formulation (mmcv's
    ``multi_scale_deformable_attn_pytorch``).  Under ``torch.autocast``
    the op computes in float32 and returns value's dtype (so float32
    locations and weights beside a half ``value`` work).

    Differentiable with respect to ``value``, ``sampling_locations`` and
    ``attention_weights`` (not twice).  On CUDA value's gradient is added with
    atomics (run-to-run differences in the last bits), except under
    ``torch.use_deterministic_algorithms(True)``, where a sorted gather makes
    it bitwise reproducible; the other gradients, and every gradient on CPU,
    are always deterministic.

    Raises RuntimeError naming the argument for wrong shapes, dtypes or
    devices, and for ``spatial_shapes`` with negative sizes, levels not
    starting at ``level_start_index`` or not covering ``S`` exactly.  CPU
    inputs are always checked.  Device inputs are checked here, in eager
    calls with ``validate=True`` (reading the ``3 L`` integers costs one host
    sync); not while torch.compile traces or a CUDA graph is captured, where
    nothing may sync.  Unchecked, a wrong ``spatial_shapes`` gives wrong
    values but never reads outside ``value``: the kernels bound every read.
    """
    out = torch.ops.torchops.ms_deform_attn.default(value, spatial_shapes, level_start_index,
                                                     sampling_locations, attention_weights)
    if validate and _eager_device_call(spatial_shapes):
        # After the launch: the shapes' errors come first, and the (bounded)
        # kernel runs while the values are read.
        _check_ms_deform_attn_levels(spatial_shapes, level_start_index, value.shape[1])
    return out


def _eager_device_call(t: Tensor) -> bool:
    """Whether an eager call may read `t`'s values from a device: not traced
    (compile, export, fake tensors), not during CUDA-graph capture."""
    if t.device.type in ("cpu", "meta") or torch.compiler.is_compiling():
        return False
    if torch._subclasses.fake_tensor.is_fake(t):
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_ms_deform_attn_levels(spatial_shapes: Tensor, level_start_index: Tensor,
                                spatial: int, op: str = "ms_deform_attn") -> None:
    """The kernels' check of spatial_shapes' and level_start_index's values
    (csrc/common/ms_deform_attn.h check_ms_deform_attn_levels), for tensors
    on any device: one host sync on a GPU."""
    levels = spatial_shapes.shape[0]
    flat = torch.cat([spatial_shapes.reshape(-1), level_start_index.reshape(-1)]).tolist()
    shapes, starts = flat[:2 * levels], flat[2 * levels:]
    total = 0
    for lvl in range(levels):
        h, w = shapes[2 * lvl], shapes[2 * lvl + 1]
        if h < 0 or w < 0:
            raise RuntimeError(f"torchops.{op}: expected 'spatial_shapes' to hold sizes >= 0, "
                               f"but level {lvl} is ({h}, {w})")
        if starts[lvl] != total:
            raise RuntimeError(f"torchops.{op}: expected 'level_start_index[{lvl}]' to be "
                               f"{total} (the sum of the earlier levels' H * W), but got "
                               f"{starts[lvl]}")
        total += h * w
        if total > spatial:
            raise RuntimeError(f"torchops.{op}: expected 'spatial_shapes' to sum (H * W over "
                               f"levels) to value's S = {spatial}, but the levels up to {lvl} "
                               "already cover more")
    if total != spatial:
        raise RuntimeError(f"torchops.{op}: expected 'spatial_shapes' to sum (H * W over "
                           f"levels) to value's S = {spatial}, but they sum to {total}")


def _check_ms_deform_attn(op: str, value: Tensor, spatial_shapes: Tensor,
                          level_start_index: Tensor, loc: Tensor, attn: Tensor) -> None:
    """csrc/common/ms_deform_attn.h check_ms_deform_attn, in its order."""
    _check_same_device(op, value=value, spatial_shapes=spatial_shapes,
                       level_start_index=level_start_index, sampling_locations=loc,
                       attention_weights=attn)
    _check_floating(op, "value", value)
    _check_same_dtype(op, value=value, sampling_locations=loc)
    _check_same_dtype(op, value=value, attention_weights=attn)
    for name, t in (("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        dtype = t.dtype
        torch._check(dtype == torch.int64, lambda: f"torchops.{op}: expected '{name}' to be an "
                     f"int64 tensor, but got {dtype}")
    vshape = tuple(value.shape)
    torch._check(value.dim() == 4, lambda: f"torchops.{op}: expected 'value' to have 4 "
                 f"dimensions, but got {len(vshape)} (shape {vshape})")
    sshape = tuple(spatial_shapes.shape)
    torch._check(spatial_shapes.dim() == 2 and spatial_shapes.shape[1] == 2,
                 lambda: f"torchops.{op}: expected 'spatial_shapes' to have shape (L, 2), but "
                 f"got {sshape}")
    levels = spatial_shapes.shape[0]
    ishape = tuple(level_start_index.shape)
    torch._check(level_start_index.dim() == 1 and level_start_index.shape[0] == levels,
                 lambda: f"torchops.{op}: expected 'level_start_index' to have shape (L,) with "
                 f"L = {levels} (spatial_shapes' rows), but got {ishape}")
    batch, heads = value.shape[0], value.shape[2]
    lshape = tuple(loc.shape)
    torch._check(loc.dim() == 6 and loc.shape[0] == batch and loc.shape[2] == heads
                 and loc.shape[3] == levels and loc.shape[5] == 2,
                 lambda: f"torchops.{op}: expected 'sampling_locations' to have shape (B, Q, "
                 f"heads, L, P, 2) = ({batch}, Q, {heads}, {levels}, P, 2), but got {lshape}")
    ashape = tuple(attn.shape)
    torch._check(attn.dim() == 5 and all(a == b for a, b in zip(attn.shape, loc.shape[:5])),
                 lambda: f"torchops.{op}: expected 'attention_weights' to have shape (B, Q, "
                 f"heads, L, P) = {lshape[:5]}, but got {ashape}")


@torch.library.register_fake("torchops::ms_deform_attn")
def _ms_deform_attn_fake(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                         sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    _check_ms_deform_attn("ms_deform_attn", value, spatial_shapes, level_start_index,
                          sampling_locations, attention_weights)
    shape = (value.shape[0], sampling_locations.shape[1], value.shape[2] * value.shape[3])
    _check_output_size("ms_deform_attn", shape, value.dtype)
    return value.new_empty(shape)


@torch.library.register_fake("torchops::_ms_deform_attn_backward")
def _ms_deform_attn_backward_fake(grad: Tensor, value: Tensor, spatial_shapes: Tensor,
                                  level_start_index: Tensor, sampling_locations: Tensor,
                                  attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    op = "_ms_deform_attn_backward"
    _check_ms_deform_attn(op, value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights)
    _check_same_device(op, value=value, grad=grad)
    _check_same_dtype(op, value=value, grad=grad)
    want = (value.shape[0], sampling_locations.shape[1], value.shape[2] * value.shape[3])
    gshape = tuple(grad.shape)
    torch._check(grad.dim() == 3 and all(a == b for a, b in zip(grad.shape, want)),
                 lambda: f"torchops.{op}: expected 'grad' to have shape (B, Q, heads * C) = "
                 f"{tuple(want)}, but got {gshape}")
    return (value.new_empty(value.shape), sampling_locations.new_empty(sampling_locations.shape),
            attention_weights.new_empty(attention_weights.shape))


# --- optim: fused_sgd_ -----------------------------------------------------------------

__all__ += ["fused_sgd_"]


def fused_sgd_(params: list[Tensor], grads: list[Tensor], momentum_buffer_list: list[Tensor], *,
               weight_decay: float, momentum: float, lr: float | Tensor, dampening: float,
               nesterov: bool, maximize: bool, is_first_step: bool,
               master_params: list[Tensor] | None = None, grad_scale: Tensor | None = None,
               found_inf: Tensor | None = None) -> None:
    """One SGD step over lists of parameters, in place, with
    ``torch._fused_sgd_``'s arguments and ``torch.optim.SGD``'s order of
    operations (the update torchops.optim.SGD calls once per device and
    dtype).

    ``params[i]`` is updated with ``grads[i]`` (plus ``weight_decay *
    params[i]``, negated with ``maximize``) and, when ``momentum != 0``, its
    buffer ``momentum_buffer_list[i]``: ``buf = momentum * buf + (1 -
    dampening) * grad``, or ``buf = grad`` with ``is_first_step`` (the
    buffers are then written, not read: ``torch.empty_like`` ones will do);
    ``nesterov`` steps along ``grad + momentum * buf``.  Without momentum
    ``momentum_buffer_list`` is empty.  ``lr`` is a float or a float32
    one-element tensor on the parameters' device (read by the kernel:
    changing it recompiles nothing).  ``grad_scale``/``found_inf`` (float32,
    one element) follow ``torch._fused_sgd_``: grads are divided by
    ``grad_scale`` and written back unscaled; ``found_inf == 1`` skips the
    step (nothing is written).

    Dtypes, devices, ``master_params`` and errors follow
    ``torchops.fused_adam_``: every list in the parameters' dtype (float32,
    float64, float16, bfloat16; half types computed in float32), or, with
    float32 ``master_params`` for float16/bfloat16 parameters, float32
    buffers and masters (updated, then rounded into ``params`` in the same
    pass) and grads in the parameters' dtype or float32.  A mismatch, a
    sparse gradient, or a parameter given twice raises a RuntimeError naming
    the list and index.  CPU and CUDA (one launch over many tensors).  No
    autograd.  Returns None.
    """
    kw = dict(weight_decay=weight_decay, momentum=momentum, dampening=dampening,
              nesterov=nesterov, maximize=maximize, is_first_step=is_first_step,
              master_params=master_params, grad_scale=grad_scale, found_inf=found_inf)
    if isinstance(lr, Tensor):
        torch.ops.torchops.fused_sgd_.tensor_lr(params, grads, momentum_buffer_list, lr=lr, **kw)
    else:
        torch.ops.torchops.fused_sgd_.default(params, grads, momentum_buffer_list, lr=float(lr),
                                              **kw)


def _check_optimizer_step(op: str, params, grads, states, master_params, scalars) -> None:
    """The checks of csrc/common/multi_tensor.h over one optimizer step, in
    its order, for the fakes: every list's length, then check_params, the
    per-parameter ``states`` and masters (check_like) and the one-element
    ``scalars``.  ``states``: (name, tensors, wanted count, why the count);
    ``scalars``: (name, tensor or None)."""
    import torch._prims_common as prims

    # Contiguous (what parameters are) decides without inspecting symbolic strides.
    dense_check = (getattr(prims, "is_non_overlapping_and_dense", None)
                   or prims.is_non_overlapping_and_dense_or_false)

    def dense(t) -> bool:
        return t.is_contiguous() or dense_check(t)

    def fail(msg: str):
        raise RuntimeError(f"torchops.{op}: {msg}")

    n = len(params)
    lengths = [("grads", grads, n, "one per parameter"), *states]
    if master_params is not None:
        lengths.append(("master_params", master_params, n, "one per parameter"))
    for name, lst, want, why in lengths:
        if len(lst) != want:
            fail(f"expected '{name}' to have {want} tensors ({why}), but got {len(lst)}")
    if n == 0:
        return
    p0 = params[0]
    pt = p0.dtype
    if not p0.is_floating_point():
        fail(f"expected 'params[0]' to be a floating-point tensor, but got {pt}")
    master = master_params is not None
    if master and pt not in (torch.float16, torch.bfloat16):
        fail(f"with 'master_params', expected 'params' to be float16 or bfloat16, but got {pt}")
    gt = grads[0].dtype
    if not (gt == pt or (master and gt == torch.float32)):
        fail(f"expected 'grads[0]' to have dtype {pt}{' or float32' if master else ''}, but got "
             f"{gt}")
    st = torch.float32 if master else pt

    def like(p, ref, name, i, t, dtype):
        where = f"{name}[{i}]"
        if t.layout != torch.strided:
            fail(f"'{where}' must be a dense (strided) tensor, but got layout {t.layout} "
                 f"(sparse gradients are not supported)")
        if t.device != p.device:
            fail(f"'{where}' is on {t.device} but '{ref}' is on {p.device}")
        if t.dtype != dtype:
            fail(f"expected '{where}' to have dtype {dtype}, but got {t.dtype}")
        if t.shape != p.shape:
            fail(f"'{where}' has shape {list(t.shape)} but '{ref}' has shape {list(p.shape)}")
        if not dense(t) or t.stride() != p.stride():
            fail(f"'{where}' must be dense with the strides of '{ref}' ({list(p.stride())}), "
                 f"but got strides {list(t.stride())}")

    seen: set[int] = set()
    for i, p in enumerate(params):
        ref = f"params[{i}]"
        if p.device != p0.device:
            fail(f"'{ref}' is on {p.device} but 'params[0]' is on {p0.device}")
        if p.dtype != pt:
            fail(f"expected '{ref}' to have dtype {pt} (that of 'params[0]'), but got {p.dtype}")
        if p.layout != torch.strided or not dense(p):
            fail(f"'{ref}' must be a dense tensor")
        if id(p) in seen:
            fail(f"'{ref}' appears twice (or shares memory with another parameter)")
        seen.add(id(p))
        like(p, ref, "grads", i, grads[i], gt)
    for i, p in enumerate(params):
        ref = f"params[{i}]"
        for name, lst, want, _ in states:
            if want:
                like(p, ref, name, i, lst[i], st)
        if master:
            like(p, ref, "master_params", i, master_params[i], torch.float32)
    for name, t in scalars:
        if t is None:
            continue
        if t.layout != torch.strided or t.numel() != 1 or t.dtype != torch.float32:
            fail(f"expected '{name}' to be a float32 tensor of one element, but got {t.dtype} "
                 f"of shape {list(t.shape)}")
        if t.device != p0.device:
            fail(f"'{name}' is on {t.device} but 'params[0]' is on {p0.device}")


def _check_fused_sgd(params, grads, momentum_buffer_list, momentum, master_params, lr,
                     grad_scale, found_inf) -> None:
    """The kernels' checks (csrc/common/fused_sgd.h), for the fakes."""
    has = momentum != 0
    bufs = ("momentum_buffer_list", momentum_buffer_list, len(params) if has else 0,
            "one per parameter" if has else "none without momentum")
    _check_optimizer_step("fused_sgd_", params, grads, [bufs], master_params,
                          [("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)])


@torch.library.register_fake("torchops::fused_sgd_")
def _fused_sgd_fake(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr,
                    dampening, nesterov, maximize, is_first_step, master_params=None,
                    grad_scale=None, found_inf=None) -> None:
    _check_fused_sgd(params, grads, momentum_buffer_list, momentum, master_params, None,
                     grad_scale, found_inf)
    return None


@torch.library.register_fake("torchops::fused_sgd_.tensor_lr")
def _fused_sgd_tensor_lr_fake(params, grads, momentum_buffer_list, *, weight_decay, momentum,
                              lr, dampening, nesterov, maximize, is_first_step,
                              master_params=None, grad_scale=None, found_inf=None) -> None:
    _check_fused_sgd(params, grads, momentum_buffer_list, momentum, master_params, lr,
                     grad_scale, found_inf)
    return None


# --- detection: rotated boxes and soft-NMS ----------------------------------------------

__all__ += ["box_iou_rotated", "nms_rotated", "batched_nms_rotated", "soft_nms"]


def _check_rotated_boxes(op: str, name: str, t: Tensor) -> None:
    _check_floating(op, name, t)
    shape = tuple(t.shape)
    torch._check(
        t.dim() == 2 and t.shape[1] == 5,
        lambda: f"torchops.{op}: expected '{name}' to have shape (N, 5), but got shape {shape}")


def box_iou_rotated(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise IoU of rotated boxes ``boxes1`` ``(N, 5)`` and ``boxes2``
    ``(M, 5)``: an ``(N, M)`` tensor.

    A box is ``(x_ctr, y_ctr, width, height, angle)`` with the angle in
    degrees, counter-clockwise in image coordinates (y down) -- detectron2's
    convention (IoU does not depend on the direction, so clockwise boxes give
    the same values).  The intersection is the exact convex polygon (the
    first box clipped by the second's edges), computed in float64 for every
    dtype with coordinates centred on the first box, so large coordinates
    lose no precision.  Boxes whose width or height is not positive have
    IoU 0 with every box (never NaN).

    float32, float64, float16, bfloat16 on CPU and CUDA; the result has the
    inputs' dtype and is a new contiguous tensor.  Not differentiable.
    """
    return torch.ops.torchops.box_iou_rotated.default(boxes1, boxes2)


@torch.library.register_fake("torchops::box_iou_rotated")
def _box_iou_rotated_fake(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    op = "box_iou_rotated"
    _check_same_device(op, boxes1=boxes1, boxes2=boxes2)
    _check_rotated_boxes(op, "boxes1", boxes1)
    _check_rotated_boxes(op, "boxes2", boxes2)
    _check_same_dtype(op, boxes1=boxes1, boxes2=boxes2)
    shape = (boxes1.shape[0], boxes2.shape[0])
    _check_output_size(op, shape, boxes1.dtype)
    return boxes1.new_empty(shape)


def nms_rotated(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Non-maximum suppression of rotated boxes ``(N, 5)``
    (``x_ctr, y_ctr, width, height, angle``; angle in degrees,
    counter-clockwise, detectron2's convention) with :func:`box_iou_rotated`'s
    IoU.

    Same rules as :func:`nms`: boxes are visited by decreasing ``scores``
    (equal scores in input order) and a box is kept unless a kept box
    overlaps it with IoU ``> iou_threshold``.  Returns the kept boxes' int64
    indices in that order.  IoUs are computed and compared with the
    threshold in float64, whatever the dtype (float32, float64, float16,
    bfloat16; CPU and CUDA).  Zero-area boxes overlap nothing.  Under
    ``torch.autocast`` the inputs are upcast to float32, as for :func:`nms`.
    Not differentiable; the output length depends on the data (compile and
    export as for :func:`nms`).
    """
    return torch.ops.torchops.nms_rotated.default(boxes, scores, iou_threshold)


@torch.library.register_fake("torchops::nms_rotated")
def _nms_rotated_fake(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    _check_nms_args("nms_rotated", boxes, scores, None, iou_threshold, _check_rotated_boxes)
    return _kept_indices_fake(boxes)


def batched_nms_rotated(boxes: Tensor, scores: Tensor, idxs: Tensor,
                        iou_threshold: float) -> Tensor:
    """:func:`nms_rotated` within each category, in one call.

    ``idxs`` ``(N,)`` int64 holds each box's category; boxes of different
    categories never suppress each other.  The categories are compared in
    the kernel (as :func:`batched_nms` does) rather than by detectron2's
    shift of each category's boxes, which would cost float32 boxes their
    precision; any category values work.  Returns the kept indices by
    decreasing score (equal scores: input order).  Dtypes, devices and
    compile as for :func:`nms_rotated`.
    """
    return torch.ops.torchops.batched_nms_rotated.default(boxes, scores, idxs, iou_threshold)


@torch.library.register_fake("torchops::batched_nms_rotated")
def _batched_nms_rotated_fake(boxes: Tensor, scores: Tensor, idxs: Tensor,
                              iou_threshold: float) -> Tensor:
    _check_nms_args("batched_nms_rotated", boxes, scores, idxs, iou_threshold,
                    _check_rotated_boxes)
    return _kept_indices_fake(boxes)


_SOFT_NMS_METHODS = ("linear", "gaussian")


def soft_nms(boxes: Tensor, scores: Tensor, iou_threshold: float = 0.3, sigma: float = 0.5,
             min_score: float = 1e-3, method: str = "gaussian") -> tuple[Tensor, Tensor]:
    """Soft-NMS (Bodla et al. 2017; mmcv's ``soft_nms`` semantics) of boxes
    ``(N, 4)`` (``x1, y1, x2, y2``) with ``scores`` ``(N,)``.

    Repeatedly selects the remaining box of highest score (equal scores: the
    lower index first) and multiplies every other remaining box's score by
    ``1 - iou`` where ``iou > iou_threshold`` (``method="linear"``) or by
    ``exp(-iou**2 / sigma)`` (``"gaussian"``, the default; ``iou_threshold``
    unused).  Boxes whose score is below ``min_score`` -- initially or after a
    decay -- are dropped (mmcv keeps its first box even then).  Returns
    ``(keep, new_scores)``: the int64 indices in selection order and each
    one's score when it was selected, in the scores' dtype.

    float32, float64, float16, bfloat16 on CPU and CUDA (IoUs and scores in
    float32 for the half types); boxes that do not overlap, empty ones
    included, have IoU 0.  ``sigma`` must be positive.  Under
    ``torch.autocast`` the inputs are upcast to float32 and the scores
    returned in the boxes' dtype.  Not differentiable; the output length
    depends on the data (compile and export as for :func:`nms`).  Raises
    RuntimeError for a ``method`` other than ``"linear"``/``"gaussian"``.
    """
    return torch.ops.torchops.soft_nms.default(boxes, scores, iou_threshold, sigma, min_score,
                                               method)


@torch.library.register_fake("torchops::soft_nms")
def _soft_nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float = 0.3, sigma: float = 0.5,
                   min_score: float = 1e-3, method: str = "gaussian") -> tuple[Tensor, Tensor]:
    op = "soft_nms"
    _check_same_device(op, boxes=boxes, scores=scores)
    _check_boxes(op, "boxes", boxes)
    _check_floating(op, "scores", scores)
    _check_same_dtype(op, boxes=boxes, scores=scores)
    n = boxes.shape[0]
    torch._check(scores.dim() == 1 and scores.shape[0] == n,
                 lambda: f"torchops.{op}: expected 'scores' to have shape (N,) with N = {n}")
    torch._check(iou_threshold == iou_threshold,
                 lambda: f"torchops.{op}: expected 'iou_threshold' to be a number, but got nan")
    torch._check(0 < sigma < math.inf,
                 lambda: f"torchops.{op}: expected 'sigma' to be positive and finite, but got "
                 f"{sigma}")
    torch._check(min_score == min_score,
                 lambda: f"torchops.{op}: expected 'min_score' to be a number, but got nan")
    torch._check(method in _SOFT_NMS_METHODS,
                 lambda: f'torchops.{op}: expected \'method\' to be "linear" or "gaussian", '
                 f'but got "{method}"')
    keep = _kept_indices_fake(boxes)
    return keep, scores.new_empty(keep.shape)


# --- optim: multi_tensor_l2norm, multi_tensor_scale_ -----------------------------------

__all__ += ["multi_tensor_l2norm", "multi_tensor_scale_"]


def multi_tensor_l2norm(tensors: list[Tensor], per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """The 2-norm of a list of tensors, as if they were one vector
    (``torch.nn.utils.get_total_norm(tensors)``), in one pass over them.

    Returns ``(total, norms)``: ``total`` a 0-dim tensor, ``norms`` the
    norm of each tensor (shape ``(len(tensors),)``) with ``per_tensor``,
    else an empty ``(0,)`` tensor.  Both are float32 (float64 for float64
    tensors), on the tensors' device; squares are summed in that type
    (float16/bfloat16 read as float32), as torch's float32 norms do, so a
    float32 total overflows to inf past about 1.8e19; an inf element gives
    an inf total, a NaN a NaN.  An empty list gives ``(tensor(0.), empty)``
    (float32, CPU).

    The tensors share one floating dtype and one device (CPU or CUDA; group
    mixed lists by (device, dtype), as ``torchops.clip_grad_norm_`` does),
    and each is dense: contiguous or a permutation of it (a sliced or
    expanded tensor raises; ``.contiguous()`` it).  Deterministic on both
    devices: fixed chunks whose partial sums are added in a fixed order,
    whatever the thread count (no atomics).  CUDA: one launch per ~115
    tensors / 256 chunks of 65536 elements, then one small reduction; no
    host synchronisation.  No autograd.  A mismatch raises a RuntimeError
    naming the list index.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(()), torch.zeros((0,))
    return torch.ops.torchops.multi_tensor_l2norm.default(tensors, per_tensor)


def multi_tensor_scale_(tensors: list[Tensor], scale: float | Tensor) -> None:
    """Multiplies every tensor of the list by ``scale``, in place, in one
    pass (``torch._foreach_mul_(tensors, scale)``).

    ``scale`` is a float, or a float32 or float64 tensor of one element on
    the tensors' device, which the kernel reads (a clip coefficient computed
    on the GPU needs no host synchronisation).  Each element is multiplied
    in float32 (float64 for float64 tensors) and rounded to its dtype.  The
    tensors share one floating dtype and one device (CPU or CUDA), are
    dense (contiguous or a permutation of it) and distinct (no tensor twice,
    no two sharing memory).  inf and NaN propagate as in ``torch.mul``.
    No autograd.  A mismatch raises a RuntimeError naming the list index.
    Returns None.
    """
    tensors = list(tensors)
    if isinstance(scale, Tensor):
        torch.ops.torchops.multi_tensor_scale_.tensor(tensors, scale)
    elif tensors:
        torch.ops.torchops.multi_tensor_scale_.default(tensors, float(scale))


def _check_tensor_list(op: str, tensors, distinct: bool) -> None:
    """The kernels' check_tensor_list (csrc/common/multi_tensor_norm.h), for
    the fakes."""
    import torch._prims_common as prims

    dense_check = (getattr(prims, "is_non_overlapping_and_dense", None)
                   or prims.is_non_overlapping_and_dense_or_false)

    def fail(msg: str):
        raise RuntimeError(f"torchops.{op}: {msg}")

    t0 = tensors[0]
    if not t0.is_floating_point():
        fail(f"expected 'tensors[0]' to be a floating-point tensor, but got {t0.dtype}")
    seen: set[int] = set()
    for i, t in enumerate(tensors):
        name = f"tensors[{i}]"
        if t.layout != torch.strided:
            fail(f"'{name}' must be a dense (strided) tensor, but got layout {t.layout}")
        if t.device != t0.device:
            fail(f"'{name}' is on {t.device} but 'tensors[0]' is on {t0.device} "
                 f"(one device per call)")
        if t.dtype != t0.dtype:
            fail(f"expected '{name}' to have dtype {t0.dtype} (that of 'tensors[0]'; one dtype "
                 f"per call), but got {t.dtype}")
        if not (t.is_contiguous() or dense_check(t)):
            fail(f"'{name}' must be dense (contiguous or a permutation of contiguous), but got "
                 f"shape {list(t.shape)} and strides {list(t.stride())}")
        if distinct:
            if id(t) in seen:
                fail(f"'{name}' appears twice (or shares memory with another tensor of the "
                     f"list)")
            seen.add(id(t))


def _norm_acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("torchops::multi_tensor_l2norm")
def _multi_tensor_l2norm_fake(tensors, per_tensor=False):
    op = "multi_tensor_l2norm"
    if len(tensors) == 0:
        raise RuntimeError(f"torchops.{op}: 'tensors' is empty (the wrapper "
                           f"torchops.{op} returns 0 for an empty list)")
    _check_tensor_list(op, tensors, distinct=False)
    t0 = tensors[0]
    dtype = _norm_acc_dtype(t0.dtype)
    return (t0.new_empty((), dtype=dtype),
            t0.new_empty((len(tensors) if per_tensor else 0,), dtype=dtype))


def _check_scale_tensor(tensors, scale: Tensor) -> None:
    op = "multi_tensor_scale_"
    if (scale.layout != torch.strided or scale.numel() != 1
            or scale.dtype not in (torch.float32, torch.float64)):
        raise RuntimeError(f"torchops.{op}: expected 'scale' to be a float32 or float64 tensor "
                           f"of one element, but got {scale.dtype} of shape {list(scale.shape)}")
    if tensors and scale.device != tensors[0].device:
        raise RuntimeError(f"torchops.{op}: 'scale' is on {scale.device} but 'tensors[0]' is on "
                           f"{tensors[0].device}")


@torch.library.register_fake("torchops::multi_tensor_scale_")
def _multi_tensor_scale_fake(tensors, scale) -> None:
    if len(tensors) > 0:
        _check_tensor_list("multi_tensor_scale_", tensors, distinct=True)
    return None


@torch.library.register_fake("torchops::multi_tensor_scale_.tensor")
def _multi_tensor_scale_tensor_fake(tensors, scale) -> None:
    if len(tensors) > 0:
        _check_tensor_list("multi_tensor_scale_", tensors, distinct=True)
        _check_scale_tensor(tensors, scale)
    return None
