"""Peer libraries, imported only when a benchmark needs them, and adapted to
the torchops operators' argument lists."""

from __future__ import annotations

from typing import Callable

from torchops.bench.case import Peer

__all__ = ["torchvision_op", "TORCHVISION"]


def _torchvision_ops():
    import torchvision.ops  # ImportError: the peer is absent

    return torchvision.ops


_ADAPTERS: dict[str, Callable] = {
    "nms": lambda tv: tv.nms,
    "batched_nms": lambda tv: tv.batched_nms,
    "box_iou": lambda tv: tv.box_iou,
    "roi_align": lambda tv: (
        lambda x, rois, scale, ph, pw, sr, aligned:
        tv.roi_align(x, rois, (ph, pw), scale, sr, aligned)),
    "roi_pool": lambda tv: (
        lambda x, rois, scale, ph, pw: tv.roi_pool(x, rois, (ph, pw), scale)),
    "sigmoid_focal_loss": lambda tv: (
        lambda x, t, alpha, gamma, reduction:
        tv.sigmoid_focal_loss(x, t, alpha=alpha, gamma=gamma, reduction=reduction)),
}

TORCHVISION = tuple(_ADAPTERS)


def torchvision_op(op: str, slow: bool = False) -> Peer:
    """torchvision.ops.<op>, called with the torchops operator's arguments."""
    return Peer(name=f"torchvision.ops.{op}", load=lambda: _ADAPTERS[op](_torchvision_ops()),
                slow=slow)
