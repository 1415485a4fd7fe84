"""Pure-PyTorch references for the torchops operators: the code a user would
write without torchops, with the operators' arguments.  The benchmarks time
them; the tests use them as oracles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["d_sigmoid", "box_iou", "roi_align", "sigmoid_focal_loss"]


def d_sigmoid(z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2[None, :] - inter)


def _bilinear_axis(c: Tensor, size: int):
    """Per-axis part of RoIAlign's bilinear sampling (the usual edge rules:
    outside [-1, size] contributes 0; below 0 clamps to 0; the last pixel
    interpolates with itself)."""
    valid = (c >= -1) & (c <= size)
    c = c.clamp(min=0)
    low = c.floor().clamp(max=size - 1)
    c = torch.where(low >= size - 1, low, c)
    frac = c - low
    low_i = low.long()
    high_i = (low_i + 1).clamp(max=size - 1)
    return valid, low_i, high_i, 1 - frac, frac


def roi_align(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height: int,
              pooled_width: int, sampling_ratio: int, aligned: bool) -> Tensor:
    """RoIAlign with a fixed sampling grid (``sampling_ratio > 0``): every
    sample point of every RoI gathers its four neighbours from a channels-last
    copy of the features in one indexing operation."""
    if sampling_ratio <= 0:
        raise ValueError("this reference needs sampling_ratio > 0 (a static sampling grid)")
    n, c, h, w = input.shape
    k = rois.shape[0]
    g = sampling_ratio
    offset = 0.5 if aligned else 0.0
    b = rois[:, 0].long()
    x1 = rois[:, 1] * spatial_scale - offset
    y1 = rois[:, 2] * spatial_scale - offset
    rw = rois[:, 3] * spatial_scale - offset - x1
    rh = rois[:, 4] * spatial_scale - offset - y1
    if not aligned:
        rw, rh = rw.clamp(min=1), rh.clamp(min=1)
    dev, dt = input.device, input.dtype
    # Sample coordinates: (K, pooled * g) along each axis.
    fy = ((torch.arange(pooled_height, device=dev, dtype=dt)[:, None]
           + (torch.arange(g, device=dev, dtype=dt)[None, :] + 0.5) / g).reshape(-1))
    fx = ((torch.arange(pooled_width, device=dev, dtype=dt)[:, None]
           + (torch.arange(g, device=dev, dtype=dt)[None, :] + 0.5) / g).reshape(-1))
    ys = y1[:, None] + fy[None, :] * (rh / pooled_height)[:, None]
    xs = x1[:, None] + fx[None, :] * (rw / pooled_width)[:, None]
    vy, yl, yh, wyl, wyh = _bilinear_axis(ys, h)
    vx, xl, xh, wxl, wxh = _bilinear_axis(xs, w)
    valid = (vy[:, :, None] & vx[:, None, :]).to(dt)
    flat = input.permute(0, 2, 3, 1).reshape(n * h * w, c)
    base = (b * (h * w))[:, None, None]
    out = 0
    for yi, wy in ((yl, wyl), (yh, wyh)):
        for xi, wx in ((xl, wxl), (xh, wxh)):
            idx = base + yi[:, :, None] * w + xi[:, None, :]            # (K, PY, PX)
            weight = wy[:, :, None] * wx[:, None, :] * valid             # (K, PY, PX)
            out = out + flat[idx] * weight[..., None]                    # (K, PY, PX, C)
    out = out.reshape(k, pooled_height, g, pooled_width, g, c).mean(dim=(2, 4))
    return out.permute(0, 3, 1, 2).contiguous()


def sigmoid_focal_loss(inputs: Tensor, targets: Tensor, alpha: float, gamma: float,
                       reduction: str) -> Tensor:
    """The focal loss of Lin et al. (2017), as torchvision.ops.sigmoid_focal_loss writes it."""
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss
