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
