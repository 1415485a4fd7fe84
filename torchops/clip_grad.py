"""``torchops.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` on the
multi-tensor ops (one ``multi_tensor_l2norm`` and one ``multi_tensor_scale_``
per device and dtype of the gradients)."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import Tensor

from . import ops

__all__ = ["clip_grad_norm_"]

_DEVICES = ("cpu", "cuda")


def _dense(t: Tensor) -> bool:
    """Contiguous up to a permutation of its dims (channels_last ...)."""
    import torch._prims_common as prims

    check = (getattr(prims, "is_non_overlapping_and_dense", None)
             or prims.is_non_overlapping_and_dense_or_false)
    return check(t)


def _fast_path(grads: list[Tensor], norm_type: float) -> bool:
    """Whether the fused ops take these gradients: the 2-norm of plain dense
    CPU/CUDA tensors (a DTensor, a sparse or sliced gradient, another device
    goes to torch's implementation)."""
    if norm_type != 2.0:
        return False
    for g in grads:
        if (type(g) is not Tensor or g.layout != torch.strided
                or g.device.type not in _DEVICES or not g.is_floating_point()
                or not (g.is_contiguous() or _dense(g))):
            return False
    return True


@torch.no_grad()
def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> Tensor:
    """Clips the gradients of ``parameters`` in place so that their total
    2-norm is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``
    does, and returns the total norm before clipping.

    Same arguments and results: the gradients (``p.grad``, those that are
    not None) are multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``;
    the returned norm is a 0-dim tensor on the first gradient's device in
    the gradients' (promoted) dtype; no gradient gives ``tensor(0.)``.  The
    gradients are grouped by (device, dtype); each group takes one
    ``torchops.multi_tensor_l2norm`` and one ``torchops.multi_tensor_scale_``
    (one launch each on CUDA, deterministic).  The coefficient stays a
    device tensor: nothing waits for the GPU, unless ``error_if_nonfinite``,
    which reads the norm (as torch's does) and raises its RuntimeError on an
    inf or NaN norm.

    Differences from torch: the norm is summed in float32 (float64 for
    float64 gradients) over all gradients at once, so float32 results agree
    with torch's to float32 rounding, and float16/bfloat16 gradients get a
    more accurate norm (torch rounds each gradient's norm to its dtype), from
    which the coefficient is formed before the returned norm is rounded.

    Falls back to ``torch.nn.utils.clip_grad_norm_`` itself (its
    ``foreach`` argument then applies) for ``norm_type`` other than 2 (inf,
    1, ...), and for gradients that are not plain dense tensors on a CPU or
    CUDA device (DTensors, sparse or non-dense gradients).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    if not _fast_path(grads, norm_type):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
    if not grads:
        return torch.tensor(0.0)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    first = grads[0].device
    totals = [ops.multi_tensor_l2norm(group)[0] for group in groups.values()]
    if len(totals) == 1:
        total = totals[0]
    else:
        acc = functools.reduce(torch.promote_types, [t.dtype for t in totals])
        total = torch.linalg.vector_norm(torch.stack([t.to(first, acc) for t in totals]))
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, _), group in groups.items():
        ops.multi_tensor_scale_(group, coef.to(device))
    # torch's norm is a vector_norm of the gradients' norms in their dtypes.
    return total.to(functools.reduce(torch.promote_types, [dtype for _, dtype in groups]))
