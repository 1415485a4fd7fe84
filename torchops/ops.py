"""Typed Python wrappers of the torchops operators, each beside its fake.

This is the module that ``csrc/schema.cpp`` names with ``set_python_module``:
PyTorch requires every fake (meta) kernel of a C++-defined op to be
registered from here.  A fake allocates its output exactly as the real kernel
does -- same shape, dtype, device and strides -- which is what lets
torch.compile and torch.export trace the ops without running them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchops import _loader

_loader.load()

__all__ = ["matmul", "d_sigmoid"]  # each section below adds its ops

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_floating(op: str, name: str, t: Tensor) -> None:
    torch._check(
        t.dtype in _FLOATING,
        lambda: f"torchops.{op}: expected '{name}' to be a floating-point tensor "
        f"(float32, float64, float16 or bfloat16), but got {t.dtype}")


# --- matmul ---------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product ``a @ b`` of 2-D ``(M, K) @ (K, N)`` or batched 3-D
    ``(B, M, K) @ (B, K, N)`` tensors.

    Supports float32, float64, float16 and bfloat16 (the half types
    accumulate in float32) on CPU and CUDA, any strides (transposed and
    expanded inputs are read in place), and autograd to both inputs.  Batch
    dimensions are not broadcast: both inputs have the same rank and batch.
    Returns a new contiguous tensor of ``a``'s dtype.
    """
    return torch.ops.torchops.matmul.default(a, b)


@torch.library.register_fake("torchops::matmul")
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() in (2, 3), lambda: f"torchops.matmul: expected 'a' to be 2-D or 3-D, got {a.dim()}-D")
    torch._check(b.dim() == a.dim(), lambda: f"torchops.matmul: expected 'b' to have {a.dim()} dimensions like 'a'")
    _check_floating("matmul", "a", a)
    torch._check(b.dtype == a.dtype, lambda: f"torchops.matmul: expected 'b' to have the same dtype as 'a' ({a.dtype})")
    torch._check(a.shape[-1] == b.shape[-2], lambda: "torchops.matmul: inner dimensions differ")
    if a.dim() == 3:
        torch._check(a.shape[0] == b.shape[0], lambda: "torchops.matmul: batch dimensions differ")
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


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
    _check_floating("_d_sigmoid_backward", "z", z)
    torch._check(grad.shape == z.shape, lambda: "torchops._d_sigmoid_backward: 'grad' and 'z' differ in shape")
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)


# --- detection: boxes -------------------------------------------------------------------

__all__ += ["nms", "batched_nms", "box_iou"]


def _check_boxes(op: str, name: str, t: Tensor) -> None:
    _check_floating(op, name, t)
    torch._check(
        t.dim() == 2 and t.shape[1] == 4,
        lambda: f"torchops.{op}: expected '{name}' to have shape (N, 4), but got shape {tuple(t.shape)}")


def _check_nms_args(op: str, boxes: Tensor, scores: Tensor, idxs: Tensor | None) -> None:
    _check_boxes(op, "boxes", boxes)
    _check_floating(op, "scores", scores)
    torch._check(scores.dtype == boxes.dtype,
                 lambda: f"torchops.{op}: expected 'scores' to have the same dtype as 'boxes' ({boxes.dtype})")
    torch._check(scores.dim() == 1 and scores.shape[0] == boxes.shape[0],
                 lambda: f"torchops.{op}: expected 'scores' to have shape (N,) with N = {boxes.shape[0]}")
    if idxs is not None:
        torch._check(idxs.dtype == torch.int64,
                     lambda: f"torchops.{op}: expected 'idxs' to be an int64 tensor, but got {idxs.dtype}")
        torch._check(idxs.dim() == 1 and idxs.shape[0] == boxes.shape[0],
                     lambda: f"torchops.{op}: expected 'idxs' to have shape (N,) with N = {boxes.shape[0]}")


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
    _check_nms_args("nms", boxes, scores, None)
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
    _check_nms_args("batched_nms", boxes, scores, idxs)
    return _kept_indices_fake(boxes)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise IoU of ``boxes1`` ``(N, 4)`` and ``boxes2`` ``(M, 4)``
    (``x1, y1, x2, y2``): an ``(N, M)`` tensor (torchvision.ops.box_iou
    semantics).

    float32, float64, float16, bfloat16 on CPU and CUDA (half types computed
    in float32; unlike torchvision, which returns float32 for half inputs,
    the result has the inputs' dtype).  Differentiable with respect to both
    inputs, with the gradient autograd gives torchvision's formula.  Returns
    a new contiguous tensor.
    """
    return torch.ops.torchops.box_iou.default(boxes1, boxes2)


@torch.library.register_fake("torchops::box_iou")
def _box_iou_fake(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    _check_boxes("box_iou", "boxes1", boxes1)
    _check_boxes("box_iou", "boxes2", boxes2)
    torch._check(boxes2.dtype == boxes1.dtype,
                 lambda: f"torchops.box_iou: expected 'boxes2' to have the same dtype as 'boxes1' ({boxes1.dtype})")
    return boxes1.new_empty((boxes1.shape[0], boxes2.shape[0]))


@torch.library.register_fake("torchops::_box_iou_backward")
def _box_iou_backward_fake(grad: Tensor, boxes1: Tensor, boxes2: Tensor) -> tuple[Tensor, Tensor]:
    _check_boxes("_box_iou_backward", "boxes1", boxes1)
    _check_boxes("_box_iou_backward", "boxes2", boxes2)
    torch._check(grad.dim() == 2 and grad.shape[0] == boxes1.shape[0] and grad.shape[1] == boxes2.shape[0],
                 lambda: "torchops._box_iou_backward: expected 'grad' to have shape (N, M)")
    return boxes1.new_empty((boxes1.shape[0], 4)), boxes2.new_empty((boxes2.shape[0], 4))



# --- detection: RoI pooling -------------------------------------------------------------


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
    if reduction not in _FOCAL_REDUCTIONS:
        raise ValueError(f"torchops.sigmoid_focal_loss: invalid value for 'reduction': "
                         f"{reduction!r}; supported: 'none', 'mean', 'sum'")
    return torch.ops.torchops.sigmoid_focal_loss.default(inputs, targets, alpha, gamma, reduction)


def _check_focal(op: str, inputs: Tensor, targets: Tensor, reduction: str) -> None:
    _check_floating(op, "inputs", inputs)
    torch._check(targets.dtype == inputs.dtype,
                 lambda: f"torchops.{op}: expected 'targets' to have the same dtype as "
                 f"'inputs' ({inputs.dtype}), but got {targets.dtype}")
    torch._check(targets.shape == inputs.shape,
                 lambda: f"torchops.{op}: expected 'targets' to have the shape of 'inputs' "
                 f"({tuple(inputs.shape)}), but got {tuple(targets.shape)}")
    torch._check(reduction in _FOCAL_REDUCTIONS,
                 lambda: f"torchops.{op}: expected 'reduction' to be 'none', 'mean' or "
                 f"'sum', but got '{reduction}'")


@torch.library.register_fake("torchops::sigmoid_focal_loss")
def _sigmoid_focal_loss_fake(inputs: Tensor, targets: Tensor, alpha: float = 0.25,
                             gamma: float = 2.0, reduction: str = "none") -> Tensor:
    _check_focal("sigmoid_focal_loss", inputs, targets, reduction)
    shape = inputs.shape if reduction == "none" else ()
    return torch.empty(shape, dtype=inputs.dtype, device=inputs.device)


@torch.library.register_fake("torchops::_sigmoid_focal_loss_backward")
def _sigmoid_focal_loss_backward_fake(grad: Tensor, inputs: Tensor, targets: Tensor,
                                      alpha: float, gamma: float, reduction: str) -> Tensor:
    _check_focal("_sigmoid_focal_loss_backward", inputs, targets, reduction)
    torch._check(grad.dtype == inputs.dtype,
                 lambda: "torchops._sigmoid_focal_loss_backward: expected 'grad' to have the "
                 "same dtype as 'inputs'")
    want = inputs.shape if reduction == "none" else ()
    torch._check(grad.shape == want,
                 lambda: f"torchops._sigmoid_focal_loss_backward: expected 'grad' of shape "
                 f"{tuple(want)}, but got {tuple(grad.shape)}")
    return torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)
