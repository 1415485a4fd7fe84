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
