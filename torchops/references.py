"""Pure-PyTorch references of the torchops operators: the code a user would
write without torchops.

One function per operator, with the operator's arguments (those of
``torch.ops.torchops.<op>``, not of the torchvision-style wrappers) and its
semantics, which are torchvision's for the detection ops.  The tests use them
as oracles (on float64 copies of their samples), the benchmarks time them
eagerly and under torch.compile, and the demo prints the kernels' results
beside theirs.  So they are written to be plainly right first, and
vectorised where that costs no clarity; none of them has a torchops kernel's
work bounds (roi_align's adaptive sampling is not capped here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.utils import _pair

__all__ = ["matmul", "d_sigmoid", "nms", "batched_nms", "box_iou", "roi_align", "roi_pool",
           "sigmoid_focal_loss", "deform_conv2d"]
__all__ += ["masked_conv2d"]
__all__ += ["carafe"]
__all__ += ["rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm"]


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with torch.matmul's shape rules (vectors, broadcast batch
    dimensions), which torchops.matmul follows: ``torch.matmul``."""
    return torch.matmul(a, b)


def d_sigmoid(z: Tensor) -> Tensor:
    """``s * (1 - s)`` with ``s = sigmoid(z)``, element-wise."""
    s = torch.sigmoid(z)
    return s * (1 - s)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """The ``(N, M)`` matrix of IoUs of ``boxes1`` ``(N, 4)`` and ``boxes2``
    ``(M, 4)``, boxes ``(x1, y1, x2, y2)``: torchvision.ops.box_iou's formula.
    Autograd of it gives the gradient the kernels compute, at the kinks too
    (max/min split a tie's gradient in half; the clamp passes it at 0)."""
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2[None, :] - inter)


def _greedy_nms(boxes: Tensor, scores: Tensor, iou_threshold: float,
                idxs: Tensor | None, pairwise_iou=None) -> Tensor:
    boxes, scores = boxes.detach().double(), scores.detach().double()
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    iou = (pairwise_iou or box_iou)(boxes, boxes)
    if idxs is not None:
        iou = torch.where(idxs[:, None] == idxs[None, :], iou, torch.zeros_like(iou))
    suppressed = [False] * len(order)
    keep = []
    for i in order:
        if suppressed[i]:
            continue
        keep.append(i)
        for j in torch.nonzero(iou[i] > iou_threshold).flatten().tolist():
            suppressed[j] = True
    return torch.tensor(keep, dtype=torch.int64, device=boxes.device)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy non-maximum suppression, torchvision.ops.nms's semantics: visit
    the boxes by decreasing score (equal scores in input order) and keep each
    one that no kept box overlaps with IoU ``> iou_threshold``.  Returns the
    kept indices (int64) in that order.  IoUs are computed in float64: this
    is the textbook loop, one box at a time."""
    return _greedy_nms(boxes, scores, iou_threshold, None)


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """:func:`nms` within each category: boxes whose ``idxs`` differ never
    suppress each other (torchvision.ops.batched_nms's result, without its
    coordinate-offset trick).  Kept indices by decreasing score."""
    return _greedy_nms(boxes, scores, iou_threshold, idxs)


def nms_padded(boxes: Tensor, scores: Tensor, iou_threshold: float,
               idxs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`nms` (:func:`batched_nms` with ``idxs``) as (the kept indices
    followed by -1 up to N, their number as a 0-dim tensor)."""
    kept = _greedy_nms(boxes, scores, iou_threshold, idxs)
    keep = torch.full((boxes.shape[0],), -1, dtype=torch.int64, device=boxes.device)
    keep[:kept.shape[0]] = kept
    return keep, torch.tensor(kept.shape[0], dtype=torch.int64, device=boxes.device)


def _bilinear_axis(c: Tensor, size: int):
    """One axis of RoIAlign's bilinear sampling at coordinates ``c``, with
    torchvision's edge rules: a sample outside ``[-1, size]`` is invalid
    (contributes 0), one below 0 reads pixel 0, and one at or past the last
    pixel reads the last pixel alone.  Returns (valid, low index, high index,
    low weight, high weight)."""
    valid = (c >= -1) & (c <= size)
    # Invalid (and NaN) coordinates get a harmless in-range position; the
    # caller masks their samples.
    c = torch.where(valid, c, torch.zeros_like(c)).clamp(min=0)
    low = c.floor().clamp(max=size - 1)
    c = torch.where(low >= size - 1, low, c)
    frac = c - low
    low_i = low.long()
    high_i = (low_i + 1).clamp(max=size - 1)
    return valid, low_i, high_i, 1 - frac, frac


def _weighted(values: Tensor, weight: Tensor) -> Tensor:
    """``values * weight``, 0 where the weight is 0: bilinear interpolation
    does not read a pixel it gives no weight (a sample on a pixel, clamped to
    the last one, or outside the map), so an inf or nan there does not make
    the sample nan.  torchvision multiplies such taps; for finite features the
    two agree."""
    return torch.where(weight != 0, values * weight, torch.zeros_like(values))


def _roi_align_grid(input: Tensor, batch: Tensor, x1: Tensor, y1: Tensor, roi_w: Tensor,
                    roi_h: Tensor, pooled_height: int, pooled_width: int, grid_h: int,
                    grid_w: int) -> Tensor:
    """RoIAlign of K RoIs that share one sampling grid (grid_h x grid_w
    samples per bin): every sample of every RoI gathers its four neighbours
    from a channels-last copy of the features in one indexing operation.
    Returns (K, C, pooled_height, pooled_width)."""
    n, c, h, w = input.shape
    k = batch.shape[0]
    dev, dt = input.device, input.dtype

    def coords(start, size, pooled, grid):  # (K, pooled * grid), torchvision's expression
        bin_size = (size / pooled)[:, None, None]
        p = torch.arange(pooled, device=dev, dtype=dt)[None, :, None]
        i = torch.arange(grid, device=dev, dtype=dt)[None, None, :]
        return (start[:, None, None] + p * bin_size + (i + 0.5) * bin_size / grid).reshape(k, -1)

    vy, yl, yh, wyl, wyh = _bilinear_axis(coords(y1, roi_h, pooled_height, grid_h), h)
    vx, xl, xh, wxl, wxh = _bilinear_axis(coords(x1, roi_w, pooled_width, grid_w), w)
    flat = input.permute(0, 2, 3, 1).reshape(n * h * w, c)
    base = (batch * (h * w))[:, None, None]
    # Invalid samples get weight 0, and taps of weight 0 are skipped.
    valid = (vy[:, :, None] & vx[:, None, :]).to(dt)
    acc = 0
    for yi, wy in ((yl, wyl), (yh, wyh)):
        for xi, wx in ((xl, wxl), (xh, wxh)):
            idx = base + yi[:, :, None] * w + xi[:, None, :]            # (K, PY, PX)
            weight = wy[:, :, None] * wx[:, None, :] * valid             # (K, PY, PX)
            acc = acc + _weighted(flat[idx], weight[..., None])          # (K, PY, PX, C)
    out = acc.reshape(k, pooled_height, grid_h, pooled_width, grid_w, c).mean(dim=(2, 4))
    return out.permute(0, 3, 1, 2)


def roi_align(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height: int,
              pooled_width: int, sampling_ratio: int, aligned: bool) -> Tensor:
    """RoIAlign with torchvision's semantics: for ``input`` ``(N, C, H, W)``
    and ``rois`` ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)``, the
    ``(K, C, pooled_height, pooled_width)`` averages of bilinear samples on a
    regular grid in each bin.

    Box corners are scaled by ``spatial_scale`` and, when ``aligned``, shifted
    by -0.5 pixel; unaligned boxes are at least 1x1.  Each bin takes
    ``sampling_ratio`` samples per axis, or when ``sampling_ratio <= 0``
    ``ceil(bin size)`` (adaptive: per RoI, and with no cap here; a bin with
    no samples -- a reversed aligned box -- is 0).  Samples outside
    ``[-1, size]`` count as 0.  Differentiable with respect to ``input``.

    A fixed ``sampling_ratio`` is one vectorised gather for all RoIs (no host
    synchronisation, so torch.compile traces it whole); adaptive sampling
    gathers once per distinct grid size.
    """
    n, c, h, w = input.shape
    k = rois.shape[0]
    def zeros() -> Tensor:
        # Zeros that depend on `input` (an empty sum): the result is
        # differentiable, like the kernels', even where no sample reads it.
        return input.new_zeros((k, c, pooled_height, pooled_width)) + input[..., :0].sum()

    if input.numel() == 0 or k == 0:
        return zeros()
    offset = 0.5 if aligned else 0.0
    batch = rois[:, 0].long()
    x1 = rois[:, 1] * spatial_scale - offset
    y1 = rois[:, 2] * spatial_scale - offset
    roi_w = rois[:, 3] * spatial_scale - offset - x1
    roi_h = rois[:, 4] * spatial_scale - offset - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1), roi_h.clamp(min=1)
    if sampling_ratio > 0:
        return _roi_align_grid(input, batch, x1, y1, roi_w, roi_h, pooled_height, pooled_width,
                               sampling_ratio, sampling_ratio).contiguous()
    return _by_adaptive_grid(
        roi_h / pooled_height, roi_w / pooled_width, zeros(),
        lambda rows, grid_h, grid_w: _roi_align_grid(
            input, batch[rows], x1[rows], y1[rows], roi_w[rows], roi_h[rows], pooled_height,
            pooled_width, grid_h, grid_w))


def _by_adaptive_grid(bin_h: Tensor, bin_w: Tensor, out: Tensor, pooled) -> Tensor:
    """RoI-Align-style pooling with sampling_ratio 0: each RoI samples a
    ceil(bin_h) x ceil(bin_w) grid per bin.  RoIs are grouped by grid and
    ``pooled(rows, grid_h, grid_w)`` fills theirs into ``out``; a grid of 0
    (or the ceil of NaN) samples nothing, as in the kernels."""
    grids = torch.nan_to_num(torch.stack([torch.ceil(bin_h), torch.ceil(bin_w)], 1), nan=0.0)
    grids = grids.long()
    for grid_h, grid_w in torch.unique(grids, dim=0).tolist():
        if grid_h <= 0 or grid_w <= 0:
            continue
        rows = torch.nonzero((grids[:, 0] == grid_h) & (grids[:, 1] == grid_w)).flatten()
        out = out.index_copy(0, rows, pooled(rows, grid_h, grid_w))
    return out


def round_half_away(v: float) -> int:
    """C's round(): halves away from zero (Python's round() goes to even).
    roi_pool rounds box corners this way; its tests share it."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def roi_pool(input: Tensor, rois: Tensor, spatial_scale: float, pooled_height: int,
             pooled_width: int) -> tuple[Tensor, Tensor]:
    """RoI max pooling with torchvision's semantics: box corners scaled by
    ``spatial_scale`` and rounded to pixels (halves away from zero), the box
    (at least 1x1) split into ``pooled_height x pooled_width`` bins with edges
    ``floor(p * size / pooled)`` and ``ceil((p + 1) * size / pooled)``
    (clipped to the image), each the maximum over its pixels.

    Returns ``(output, argmax)``, both ``(K, C, pooled_height,
    pooled_width)``: an empty bin is 0 with argmax -1, otherwise argmax is the
    index ``h * W + w`` of the first maximum in its input plane (int64).  Bin
    edges are computed in float64 here; the kernels use the input's
    precision, like torchvision's.  One RoI and one bin at a time.
    """
    n, c, h, w = input.shape
    shape = (rois.shape[0], c, pooled_height, pooled_width)
    out = input.new_zeros(shape)
    argmax = torch.full(shape, -1, dtype=torch.int64, device=input.device)
    for k, roi in enumerate(rois.tolist()):
        b = int(roi[0])
        x1, y1, x2, y2 = (round_half_away(v * spatial_scale) for v in roi[1:])
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
                value, idx = region.max(dim=1)
                out[k, :, ph, pw] = value
                argmax[k, :, ph, pw] = (hs + idx // (we - ws)) * w + ws + idx % (we - ws)
    return out, argmax


def _bin_samples(input: Tensor, batch: Tensor, ys: Tensor, xs: Tensor) -> Tensor:
    """Averages of bilinear samples per bin, bins of any positions: sample
    (i, j) of bin (k, ph, pw) lies at (ys[k, ph, pw, i], xs[k, ph, pw, j]),
    with roi_align's edge rules (_bilinear_axis).  Returns (K, C, PH, PW)."""
    n, c, h, w = input.shape
    vy, yl, yh, wyl, wyh = _bilinear_axis(ys, h)
    vx, xl, xh, wxl, wxh = _bilinear_axis(xs, w)
    flat = input.permute(0, 2, 3, 1).reshape(n * h * w, c)
    base = (batch * (h * w))[:, None, None, None, None]
    valid = (vy[..., :, None] & vx[..., None, :]).to(input.dtype)
    acc = 0
    for yi, wy in ((yl, wyl), (yh, wyh)):
        for xi, wx in ((xl, wxl), (xh, wxh)):
            idx = base + yi[..., :, None] * w + xi[..., None, :]       # (K, PH, PW, GY, GX)
            weight = wy[..., :, None] * wx[..., None, :] * valid
            acc = acc + _weighted(flat[idx], weight[..., None])        # (..., C)
    return acc.mean(dim=(3, 4)).permute(0, 3, 1, 2)


def deform_roi_pool(input: Tensor, rois: Tensor, offset: Tensor | None, spatial_scale: float,
                    pooled_height: int, pooled_width: int, sampling_ratio: int,
                    gamma: float) -> Tensor:
    """Deformable RoI pooling with mmcv's semantics: :func:`roi_align` with
    ``aligned=True`` (corners * spatial_scale - 0.5, bins of a grid of
    ``sampling_ratio`` or, when ``<= 0``, ``ceil(bin size)`` samples per axis,
    uncapped here), except that bin ``(ph, pw)`` of RoI ``k`` moves by
    ``gamma * roi_width * offset[k, 0, ph, pw]`` along x and
    ``gamma * roi_height * offset[k, 1, ph, pw]`` along y.  Differentiable
    with respect to ``input`` and ``offset`` (autograd through the gathers
    and the clamps of _bilinear_axis: zero slope where a sample is clamped).
    """
    n, c, h, w = input.shape
    k = rois.shape[0]
    dev, dt = input.device, input.dtype

    def zeros() -> Tensor:  # depends on input and offset, like the kernels' result
        z = input.new_zeros((k, c, pooled_height, pooled_width)) + input[..., :0].sum()
        return z if offset is None else z + offset[..., :0].sum()

    if input.numel() == 0 or k == 0:
        return zeros()
    batch = rois[:, 0].long()
    x1 = rois[:, 1] * spatial_scale - 0.5
    y1 = rois[:, 2] * spatial_scale - 0.5
    roi_w = rois[:, 3] * spatial_scale - 0.5 - x1
    roi_h = rois[:, 4] * spatial_scale - 0.5 - y1
    bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
    # Each bin's top-left corner, (K, PH, PW).
    start_y = (y1[:, None, None] + torch.arange(pooled_height, device=dev, dtype=dt)[None, :, None]
               * bin_h[:, None, None]).expand(k, pooled_height, pooled_width)
    start_x = (x1[:, None, None] + torch.arange(pooled_width, device=dev, dtype=dt)[None, None, :]
               * bin_w[:, None, None]).expand(k, pooled_height, pooled_width)
    if offset is not None:
        start_y = start_y + gamma * roi_h[:, None, None] * offset[:, 1]
        start_x = start_x + gamma * roi_w[:, None, None] * offset[:, 0]

    def pooled(rows: Tensor, grid_h: int, grid_w: int) -> Tensor:
        i = (torch.arange(grid_h, device=dev, dtype=dt) + 0.5) / grid_h
        j = (torch.arange(grid_w, device=dev, dtype=dt) + 0.5) / grid_w
        ys = start_y[rows][..., None] + i * bin_h[rows][:, None, None, None]
        xs = start_x[rows][..., None] + j * bin_w[rows][:, None, None, None]
        return _bin_samples(input, batch[rows], ys, xs)

    if sampling_ratio > 0:
        every = torch.arange(k, device=dev)
        return pooled(every, sampling_ratio, sampling_ratio).contiguous()
    return _by_adaptive_grid(bin_h, bin_w, zeros(), pooled)


def sigmoid_focal_loss(inputs: Tensor, targets: Tensor, alpha: float = 0.25, gamma: float = 2.0,
                       reduction: str = "none") -> Tensor:
    """The focal loss of Lin et al. (2017) as torchvision.ops.sigmoid_focal_loss
    writes it: with ``p = sigmoid(inputs)`` and ``p_t = p * targets + (1 - p)
    * (1 - targets)``, ``BCE-with-logits * (1 - p_t) ** gamma``, weighted by
    ``alpha * targets + (1 - alpha) * (1 - targets)`` when ``alpha >= 0``;
    then ``reduction`` "none", "mean" (nan for an empty input) or "sum"."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"invalid reduction {reduction!r}: expected 'none', 'mean' or 'sum'")
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


def deform_conv2d(input: Tensor, weight: Tensor, offset: Tensor, mask: Tensor, bias: Tensor,
                  stride_h: int, stride_w: int, pad_h: int, pad_w: int, dilation_h: int,
                  dilation_w: int, groups: int, offset_groups: int, use_mask: bool) -> Tensor:
    """Deformable convolution (DCNv1; DCNv2 with ``use_mask``) with
    torchvision's semantics: kernel tap ``k = i * kw + j`` of output pixel
    ``(oy, ox)`` reads ``input`` by bilinear interpolation at
    ``(oy * stride_h - pad_h + i * dilation_h + offset[:, g, 2k],
    ox * stride_w - pad_w + j * dilation_w + offset[:, g, 2k + 1])`` for the
    offset group ``g`` of its channel, times ``mask[:, g, k]`` when
    ``use_mask``.  A sample with ``y <= -1``, ``y >= H``, ``x <= -1`` or
    ``x >= W`` is 0; inside, each corner outside the image reads 0.  The
    samples form im2col columns, which a grouped matrix product with
    ``weight`` ``(O, C / groups, kh, kw)`` turns into the output, plus
    ``bias``.  Gathers and an einsum: autograd gives all five gradients.
    Half types compute in float32, as the op does (sample positions in a
    half type would be off by up to a pixel)."""
    if input.dtype in (torch.float16, torch.bfloat16):
        up = [t.float() for t in (input, weight, offset, mask, bias)]
        return deform_conv2d(*up, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                             groups, offset_groups, use_mask).to(input.dtype)
    n, c, h, w = input.shape
    o, _, kh, kw = weight.shape
    out_h = (h + 2 * pad_h - (dilation_h * (kh - 1) + 1)) // stride_h + 1
    out_w = (w + 2 * pad_w - (dilation_w * (kw - 1) + 1)) // stride_w + 1
    k, og, p = kh * kw, offset_groups, out_h * out_w
    dev, dt = input.device, input.dtype
    ar = lambda size: torch.arange(size, device=dev, dtype=dt)  # noqa: E731
    base_y = (ar(out_h) * stride_h - pad_h)[None, :, None] + \
        (ar(kh) * dilation_h).repeat_interleave(kw)[:, None, None]      # (K, OH, 1)
    base_x = (ar(out_w) * stride_w - pad_w)[None, None, :] + \
        (ar(kw) * dilation_w).repeat(kh)[:, None, None]                 # (K, 1, OW)
    off = offset.reshape(n, og, k, 2, out_h, out_w)
    y = base_y + off[:, :, :, 0]                                        # (N, G, K, OH, OW)
    x = base_x + off[:, :, :, 1]
    cpg = c // og
    if c == 0 or h * w == 0 or n == 0:
        cols = input.new_zeros((n, og, cpg, k * p)) + input.sum() * 0
    else:
        valid = (y > -1) & (y < h) & (x > -1) & (x < w)
        y0, x0 = torch.floor(y), torch.floor(x)
        ly, lx = y - y0, x - x0
        feats = input.reshape(n, og, cpg, h * w)
        cols = 0
        for dy, wy in ((0, 1 - ly), (1, ly)):
            for dx, wx in ((0, 1 - lx), (1, lx)):
                yi, xi = y0 + dy, x0 + dx
                ok = valid & (yi >= 0) & (yi <= h - 1) & (xi >= 0) & (xi <= w - 1)
                # Integer arithmetic: y * w + x in a half type rounds past 256.
                idx = yi.clamp(0, h - 1).long() * w + xi.clamp(0, w - 1).long()
                idx = torch.where(ok, idx, torch.zeros_like(idx)).reshape(n, og, 1, k * p)
                got = torch.gather(feats, 3, idx.expand(n, og, cpg, k * p))
                # A corner outside the image (or of a sample at a nan or inf
                # position, whose weights are nan) is not read: zero, and
                # zero times its weight.
                ok_ = ok.reshape(n, og, 1, k * p)
                got = torch.where(ok_, got, torch.zeros_like(got))
                cols = cols + torch.where(ok_, got * (wy * wx).reshape(n, og, 1, k * p),
                                          torch.zeros_like(got))
    if use_mask:
        cols = cols * mask.reshape(n, og, 1, k * p)
    cols = cols.reshape(n, groups, (c // groups) * k, p)
    wgt = weight.reshape(groups, o // groups, (c // groups) * k)
    out = torch.einsum("goq,ngqp->ngop", wgt, cols).reshape(n, o, out_h, out_w)
    return (out + bias[None, :, None, None]).contiguous()
def masked_conv2d(input: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None = None,
                  padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups: int = 1) -> Tensor:
    """``conv2d`` where ``mask > 0`` and exactly 0 elsewhere: the dense
    convolution, then ``torch.where``.  ``mask`` is ``(N or 1, H_out,
    W_out)``, bool or floating; the gradient flows to input, weight and bias
    through the selected positions only."""
    n, c, h, w = input.shape
    if c == 0 or h == 0 or w == 0:
        # Every sum is empty: the selected positions hold the bias (or 0).
        # ATen's convolution instead returns no output channels for an input
        # without channels and rejects a zero height or width.
        (ph, pw), (sh, sw), (dh, dw) = _pair(padding), _pair(stride), _pair(dilation)
        kh, kw = weight.shape[-2:]
        oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        # Empty sums keep the result differentiable, like the kernels'.
        out = input.new_zeros((n, weight.shape[0], oh, ow)) + input[:0].sum() + weight[:0].sum()
        if bias is not None:
            out = out + bias.view(1, -1, 1, 1)
    else:
        out = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    return torch.where((mask > 0).unsqueeze(1), out, out.new_zeros(()))


def carafe(features: Tensor, masks: Tensor, kernel_size: int, group_size: int,
           scale_factor: int) -> Tensor:
    """CARAFE with mmcv's semantics: ``out[n, c, oh, ow]`` sums, over the
    ``kernel_size x kernel_size`` neighbourhood of source pixel
    ``(oh // s, ow // s)`` (zero padded), the features times
    ``masks[n, (g * k + ky) * k + kx, oh, ow]``, ``g`` the channel's group;
    a tap outside the map is skipped (mmcv's rule: an inf or nan mask weight
    there does not reach the output).

    The unfold formulation: ``F.unfold`` gathers each source pixel's
    neighbourhood, ``(N, g, C/g, k^2, H, W)``; the masks of the ``s x s``
    output pixels of a source pixel are ``(N, g, k^2, H, s, W, s)``; one
    einsum contracts the taps.  Differentiable with respect to both inputs.
    """
    n, c, h, w = features.shape
    k, g, s = kernel_size, group_size, scale_factor
    if features.numel() == 0 or masks.numel() == 0:
        # Empty sums keep the result differentiable, like the kernels'.
        return (features.new_zeros((n, c, h * s, w * s)) + features[..., :0].sum()
                + masks[..., :0].sum())
    cols = F.unfold(features, k, padding=(k - 1) // 2).view(n, g, c // g, k * k, h, w)
    m = masks.reshape(n, g, k * k, h, s, w, s)
    # A tap outside the map is skipped, its mask weight included (mmcv's
    # rule): an inf or nan weight there must not turn the padding into nan.
    inside = F.unfold(features.new_ones((1, 1, h, w)), k, padding=(k - 1) // 2)
    inside = inside.view(1, 1, k * k, h, 1, w, 1) != 0
    m = torch.where(inside, m, torch.zeros_like(m))
    out = torch.einsum("ngckhw,ngkhiwj->ngchiwj", cols, m)
    return out.reshape(n, c, h * s, w * s)


# --- norms ---------------------------------------------------------------------------------


def _norm_dims(input: Tensor, normalized_shape) -> tuple[int, ...]:
    return tuple(range(input.dim() - len(normalized_shape), input.dim()))


def _compute_dtype(input: Tensor) -> torch.dtype:
    """Half inputs are normalised in float32, the result rounded back."""
    return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    dims = _norm_dims(input, normalized_shape)
    x = input.to(_compute_dtype(input))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(x.dtype)
    return y.to(input.dtype)


def fused_add_rms_norm(input: Tensor, residual: Tensor, normalized_shape,
                       weight: Tensor | None = None,
                       eps: float | None = None) -> tuple[Tensor, Tensor]:
    s = input + residual  # rounded to the input dtype, as the op's sum
    return rms_norm(s, normalized_shape, weight, eps), s


def fused_add_rms_norm_(input: Tensor, residual: Tensor, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """The new values of (input, residual)."""
    return fused_add_rms_norm(input, residual, (input.shape[-1],), weight, eps)


def layer_norm(input: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    dims = _norm_dims(input, normalized_shape)
    x = input.to(_compute_dtype(input))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.to(input.dtype)


# --- softmax ---------------------------------------------------------------------------

__all__ += ["scaled_masked_softmax", "scaled_upper_triang_masked_softmax"]


def _softmax_of_unmasked(scores: Tensor) -> Tensor:
    """softmax over the last dim of scores whose masked entries are -inf,
    those entries exactly 0 (also in a row that a NaN or +inf makes NaN),
    and a row with no score above -inf all zeros, with a zero gradient (its
    scores are replaced before the softmax, which would give NaN)."""
    dropped = scores == float("-inf")
    empty = dropped.all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0), -1).masked_fill(dropped, 0)


def scaled_masked_softmax(input: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``softmax(input * scale)`` over the last dim with the keys where
    ``mask`` (bool, ``(B or 1, 1, Sq, Sk)``) is True, or whose score is -inf,
    at probability 0; a row with every key masked is zeros."""
    return _softmax_of_unmasked((input * scale).masked_fill(mask, float("-inf")))


def scaled_upper_triang_masked_softmax(input: Tensor, scale: float) -> Tensor:
    """Causal ``softmax(input * scale)`` over the last dim of ``(B, Sq, Sk)``
    or ``(B, H, Sq, Sk)`` scores, ``Sq == Sk``: key j of query i masked for
    j > i (probability 0)."""
    sq, sk = input.shape[-2], input.shape[-1]
    above = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(1)
    return _softmax_of_unmasked((input * scale).masked_fill(above, float("-inf")))


# --- activations --------------------------------------------------------------------------

__all__ += ["silu_and_mul", "gelu_and_mul"]


def _act_and_mul(act, x: Tensor) -> Tensor:
    """``act(a) * b`` for ``x = [a, b]`` split in halves along its last
    dimension: the gated activations' layout."""
    d = x.shape[-1] // 2
    return act(x[..., :d]) * x[..., d:]


def silu_and_mul(x: Tensor) -> Tensor:
    """``F.silu(a) * b`` (SwiGLU's gate)."""
    return _act_and_mul(F.silu, x)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(a, approximate=approximate) * b`` (GeGLU's gate)."""
    return _act_and_mul(lambda a: F.gelu(a, approximate=approximate), x)


# --- rotary ----------------------------------------------------------------------------

__all__ += ["rotary_embedding", "rotary_embedding_"]


def _rotate(x: Tensor, interleaved: bool) -> Tensor:
    """Hugging Face's rotate_half (halves) or GPT-J's pair rotation
    (interleaved): the partner of each entry, negated on the pair's first."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, rd: int, interleaved: bool) -> Tensor:
    """``x * cos + rotate(x) * sin`` on the first ``rd`` entries of the last
    dim, the rest passed through (HF's formula itself when ``rd`` is all)."""
    if rd == x.shape[-1]:
        return x * cos + _rotate(x, interleaved) * sin
    xr = x[..., :rd]
    return torch.cat((xr * cos + _rotate(xr, interleaved) * sin, x[..., rd:]), dim=-1)


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1,
                     interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Hugging Face's apply_rotary_pos_emb, ``x * cos + rotate_half(x) *
    sin`` on the first ``cos.shape[-1]`` entries of each head (the rest pass
    through); a 2-D ``(S, rotary_dim)`` cos is shared by every batch."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rd = cos.shape[-1]

    return _apply_rotary(q, cos, sin, rd, interleaved), _apply_rotary(k, cos, sin, rd, interleaved)


def rotary_embedding_(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                      interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """vLLM's rotary embedding; returns the new values of q and k (the op
    writes them in place): pair i of each head rotates by
    ``cache[positions, i]`` (cos) and ``cache[positions, rotary_dim / 2 + i]``
    (sin)."""
    rows = cos_sin_cache[positions]                      # (*P, rotary_dim)
    cos, sin = rows.chunk(2, dim=-1)                     # (*P, rotary_dim / 2) each
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)      # broadcast over heads
    rd = cos_sin_cache.shape[-1]

    return _apply_rotary(q, cos, sin, rd, interleaved), _apply_rotary(k, cos, sin, rd, interleaved)


# --- losses: fused linear cross-entropy ------------------------------------------------


def fused_linear_cross_entropy(input: Tensor, weight: Tensor, target: Tensor,
                               bias: Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               lse_square_scale: float = 0.0,
                               softcap: float | None = None) -> Tensor:
    """The unfused formula: the logits ``F.linear(input, weight, bias)`` in at
    least float32, capped by ``softcap * tanh(logits / softcap)``, then
    ``F.cross_entropy`` per token plus the z-loss ``lse_square_scale *
    logsumexp(logits)**2`` of the tokens not ignored; "mean" divides by their
    count."""
    logits = F.linear(input, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits.reshape(-1, weight.shape[0])
    t = target.reshape(-1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    valid = t != ignore_index
    if lse_square_scale:
        lse = torch.logsumexp(logits, dim=-1)
        per = per + torch.where(valid, lse_square_scale * lse * lse, 0.0)
    if reduction == "none":
        return per.reshape(target.shape)
    if reduction == "sum":
        return per.sum()
    return per.sum() / valid.sum()


# --- optim ------------------------------------------------------------------------------

__all__ += ["fused_adam_"]


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr,
                beta1: float, beta2: float, eps: float, weight_decay: float, amsgrad: bool,
                maximize: bool, adamw: bool, master_params=None, grad_scale=None,
                found_inf=None):
    """The new values of (params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs), each a list, from torch.optim.Adam's for-loop update
    (no argument is written).  With master_params, the last item is the new
    masters; params are the masters rounded to their dtype."""
    lr = float(lr)
    out = ([p.clone() for p in params], [g.clone() for g in grads],
           [m.clone() for m in exp_avgs], [v.clone() for v in exp_avg_sqs],
           [x.clone() for x in max_exp_avg_sqs])
    masters = None if master_params is None else [m.clone() for m in master_params]
    if found_inf is not None and float(found_inf) == 1.0:
        return out if masters is None else (*out, masters)
    for i in range(len(params)):
        p = masters[i] if masters is not None else out[0][i]
        m, v = out[2][i], out[3][i]
        g = out[1][i].to(p.dtype)
        if grad_scale is not None:
            g = g / float(grad_scale)
            out[1][i].copy_(g)
        if maximize:
            g = -g
        step = float(state_steps[i])
        if weight_decay != 0:
            if adamw:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g.to(m.dtype), 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1 ** step
        bc2_sqrt = (1 - beta2 ** step) ** 0.5
        s = v
        if amsgrad:
            torch.maximum(out[4][i], v, out=out[4][i])
            s = out[4][i]
        p.addcdiv_(m, s.sqrt() / bc2_sqrt + eps, value=-lr / bc1)
        if masters is not None:
            out[0][i].copy_(p)
    return out if masters is None else (*out, masters)


# --- detection: multi-scale deformable attention ---------------------------------------------

__all__ += ["ms_deform_attn", "ms_deform_attn_grid_sample"]


def _msda_sizes(value: Tensor, sampling_locations: Tensor):
    b, _, heads, c = value.shape
    return b, sampling_locations.shape[1], heads, c, sampling_locations.shape[4]


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                   sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """Multi-scale deformable attention (Deformable DETR, mmcv), written as
    explicit bilinear gathers: for output row ``(b, q, head)``, each level
    ``l`` of size ``(H_l, W_l)`` starting at ``level_start_index[l]`` and
    point ``p``, location ``(x, y)`` is pixel ``(x W_l - 0.5, y H_l - 0.5)``;
    its four neighbours inside the level (zeros outside; nothing when the
    pixel is not inside ``(-1, H_l) x (-1, W_l)``) are weighted bilinearly
    and by ``attention_weights``, and summed over levels and points.
    Returns ``(B, Q, heads * C)``.  Differentiable (autograd through the
    gathers; the corner indices are constants)."""
    b, q, heads, c, points = _msda_sizes(value, sampling_locations)
    loc, attn = sampling_locations, attention_weights
    # Depends on every differentiable input, as the kernels' result does.
    out = (value.new_zeros((b, q, heads, c)) + value[..., :0].sum() + loc[..., :0].sum()
           + attn[..., :0].sum())
    v = value.permute(0, 2, 1, 3)  # (B, heads, S, C)
    for lvl, ((h, w), start) in enumerate(zip(spatial_shapes.tolist(),
                                              level_start_index.tolist())):
        if h <= 0 or w <= 0 or q == 0 or points == 0:
            continue
        x = loc[:, :, :, lvl, :, 0] * w - 0.5  # (B, Q, heads, P)
        y = loc[:, :, :, lvl, :, 1] * h - 0.5
        inside = (x > -1) & (y > -1) & (x < w) & (y < h)
        x = torch.where(inside, x, torch.zeros_like(x))
        y = torch.where(inside, y, torch.zeros_like(y))
        x0, y0 = torch.floor(x).detach(), torch.floor(y).detach()
        lx, ly = x - x0, y - y0
        a = attn[:, :, :, lvl, :]
        for dy, dx, weight in ((0, 0, (1 - ly) * (1 - lx)), (0, 1, (1 - ly) * lx),
                               (1, 0, ly * (1 - lx)), (1, 1, ly * lx)):
            yy, xx = (y0 + dy).long(), (x0 + dx).long()
            ok = inside & (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            idx = start + yy.clamp(0, h - 1) * w + xx.clamp(0, w - 1)
            idx = torch.where(ok, idx, torch.zeros_like(idx))
            # (B, Q, heads, P) -> (B, heads, Q * P, C) rows of v.
            flat = idx.permute(0, 2, 1, 3).reshape(b, heads, q * points, 1).expand(-1, -1, -1, c)
            rows = torch.gather(v, 2, flat).reshape(b, heads, q, points, c).permute(0, 2, 1, 3, 4)
            # Corners outside contribute nothing, whatever their clamped
            # index reads or the weight holds (inf, nan).
            term = torch.where(ok[..., None], rows * (weight * a)[..., None],
                               torch.zeros_like(rows))
            out = out + term.sum(3)
    return out.reshape(b, q, heads * c)


def ms_deform_attn_grid_sample(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                               sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """The same with ``F.grid_sample`` (``align_corners=False``, zeros
    padding), the formulation of mmcv's
    ``multi_scale_deformable_attn_pytorch``: each level as a ``(B * heads,
    C, H_l, W_l)`` image, locations mapped to ``[-1, 1]``.  Needs levels
    that cover ``value`` (as ``level_start_index`` says) and at least one
    query; the benchmarks' eager and compiled baselines."""
    b, q, heads, c, points = _msda_sizes(value, sampling_locations)
    grids = 2 * sampling_locations - 1
    samples = []
    for lvl, ((h, w), start) in enumerate(zip(spatial_shapes.tolist(),
                                              level_start_index.tolist())):
        level = value[:, start:start + h * w].flatten(2).transpose(1, 2)  # (B, heads*C, H*W)
        level = level.reshape(b * heads, c, h, w)
        grid = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)  # (B*heads, Q, P, 2)
        samples.append(F.grid_sample(level, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))  # (B*heads, C, Q, P)
    weights = attention_weights.transpose(1, 2).reshape(b * heads, 1, q, -1)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1)  # (B*heads, C, Q)
    return out.view(b, heads * c, q).transpose(1, 2).contiguous()


# --- optim: fused_sgd_ ------------------------------------------------------------------

__all__ += ["fused_sgd_"]


def fused_sgd_(params, grads, momentum_buffer_list, *, weight_decay: float, momentum: float,
               lr, dampening: float, nesterov: bool, maximize: bool, is_first_step: bool,
               master_params=None, grad_scale=None, found_inf=None):
    """The new values of (params, grads, momentum_buffer_list), each a list,
    from torch.optim.SGD's for-loop update (no argument is written).  With
    master_params, the last item is the new masters; params are the masters
    rounded to their dtype."""
    lr = float(lr)
    out = ([p.clone() for p in params], [g.clone() for g in grads],
           [b.clone() for b in momentum_buffer_list])
    masters = None if master_params is None else [m.clone() for m in master_params]
    if found_inf is not None and float(found_inf) == 1.0:
        return out if masters is None else (*out, masters)
    for i in range(len(params)):
        p = masters[i] if masters is not None else out[0][i]
        g = out[1][i].to(p.dtype)
        if grad_scale is not None:
            g = g / float(grad_scale)
            out[1][i].copy_(g)
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = out[2][i]
            if is_first_step:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g.to(buf.dtype), alpha=1 - dampening)
            g = g.add(buf.to(g.dtype), alpha=momentum) if nesterov else buf.to(g.dtype)
        p.add_(g, alpha=-lr)
        if masters is not None:
            out[0][i].copy_(p)
    return out if masters is None else (*out, masters)


# --- detection: rotated boxes and soft-NMS ---------------------------------------------------
__all__ += ["box_iou_rotated", "nms_rotated", "batched_nms_rotated", "soft_nms"]


def _rotated_frame(b: Tensor):
    """Centres ``(..., 2)``, half extents ``(...,)`` x2 and unit axes ``(..., 2)`` x2 of
    rotated boxes ``(..., 5)``: corners are ``ctr +- hw u +- hh v`` with
    ``u = (cos a, -sin a)``, ``v = (sin a, cos a)`` (angle in degrees,
    counter-clockwise in image coordinates: detectron2's convention)."""
    a = torch.deg2rad(b[..., 4])
    c, s = torch.cos(a), torch.sin(a)
    return b[..., :2], b[..., 2] / 2, b[..., 3] / 2, torch.stack([c, -s], -1), torch.stack([s, c], -1)


def box_iou_rotated(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """The ``(N, M)`` IoUs of rotated boxes ``(x_ctr, y_ctr, w, h, angle)``.

    A different construction from the kernels' clipping, as an oracle should
    be: the intersection polygon's vertices are the corners of each box
    inside the other plus the crossings of their edges; sorted by angle about
    their mean, they give the area by the shoelace formula.  Coordinates are
    taken relative to the first box's centre.  Eagerly, only pairs whose
    circumscribed circles meet are computed (the others cannot overlap).
    Boxes with a width or height that is not positive have IoU 0."""
    def ok(b):
        return (b[:, 2] > 0) & (b[:, 3] > 0)

    radius1 = torch.hypot(boxes1[:, 2], boxes1[:, 3]) / 2
    radius2 = torch.hypot(boxes2[:, 2], boxes2[:, 3]) / 2
    dist2 = ((boxes1[:, None, :2] - boxes2[None, :, :2]) ** 2).sum(-1)
    near = ((dist2 <= (radius1[:, None] + radius2[None, :]) ** 2)
            & ok(boxes1)[:, None] & ok(boxes2)[None, :])
    if torch.compiler.is_compiling():
        # No data-dependent shapes in a compiled graph: every pair, masked.
        n, m = near.shape
        iou = _rotated_pair_iou(boxes1[:, None].expand(n, m, 5).reshape(-1, 5),
                                boxes2[None].expand(n, m, 5).reshape(-1, 5)).view(n, m)
        return torch.where(near, iou, torch.zeros_like(iou))
    i, j = near.nonzero(as_tuple=True)
    out = boxes1.new_zeros(boxes1.shape[0], boxes2.shape[0])
    out[i, j] = _rotated_pair_iou(boxes1[i], boxes2[j])
    return out


def _rotated_pair_iou(b1: Tensor, b2: Tensor) -> Tensor:
    """IoU of rows ``b1[k]`` and ``b2[k]`` (``(K, 5)`` each, non-empty boxes)."""
    origin = b1[..., :2]
    c1, hw1, hh1, u1, v1 = _rotated_frame(b1)
    c2, hw2, hh2, u2, v2 = _rotated_frame(b2)
    c1, c2 = c1 - origin, c2 - origin
    signs = torch.tensor([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]],
                         dtype=b1.dtype, device=b1.device)  # counter-clockwise

    def corners(c, hw, hh, u, v):  # (K, 4, 2)
        return (c[..., None, :] + signs[:, :1] * (hw[..., None, None] * u[..., None, :])
                + signs[:, 1:] * (hh[..., None, None] * v[..., None, :]))

    def inside(pts, c, hw, hh, u, v):  # pts (K, k, 2) in the box (c, hw, hh, u, v)?
        d = pts - c[..., None, :]
        slack = 1 + 1e-9
        return (((d * u[..., None, :]).sum(-1).abs() <= hw[..., None] * slack)
                & ((d * v[..., None, :]).sum(-1).abs() <= hh[..., None] * slack))

    p = corners(c1, hw1, hh1, u1, v1)
    q = corners(c2, hw2, hh2, u2, v2)
    cross = lambda a, b: a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]  # noqa: E731
    # Edge k of p against edge l of q: a0 + t r = b0 + s e, t and s in [0, 1].
    a0, r = p[..., :, None, :], (p.roll(-1, -2) - p)[..., :, None, :]
    b0, e = q[..., None, :, :], (q.roll(-1, -2) - q)[..., None, :, :]
    den = cross(r, e)
    safe = torch.where(den == 0, torch.ones_like(den), den)
    t = cross(b0 - a0, e) / safe
    s = cross(b0 - a0, r) / safe
    eps = 1e-9
    hit = (den != 0) & (t >= -eps) & (t <= 1 + eps) & (s >= -eps) & (s <= 1 + eps)
    crossings = (a0 + t[..., None] * r).flatten(-3, -2)  # (K, 16, 2)
    pts = torch.cat([p, q, crossings], -2)
    valid = torch.cat([inside(p, c2, hw2, hh2, u2, v2), inside(q, c1, hw1, hh1, u1, v1),
                       hit.flatten(-2)], -1)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    centre = (pts * valid[..., None]).sum(-2) / count
    angle = torch.atan2(pts[..., 1] - centre[..., None, 1], pts[..., 0] - centre[..., None, 0])
    angle = torch.where(valid, angle, torch.full_like(angle, math.inf))
    order = angle.argsort(-1)
    pts = pts.gather(-2, order[..., None].expand_as(pts))
    valid = valid.gather(-1, order)
    # Unused slots repeat the first vertex: their edges add nothing.
    pts = torch.where(valid[..., None], pts, pts[..., :1, :])
    area = cross(pts, pts.roll(-1, -2)).sum(-1) / 2
    area1, area2 = 4 * hw1 * hh1, 4 * hw2 * hh2
    inter = torch.minimum(area.clamp(min=0), torch.minimum(area1, area2))
    return inter / (area1 + area2 - inter)


def nms_rotated(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """:func:`nms` with :func:`box_iou_rotated`'s IoU (float64)."""
    return _greedy_nms(boxes, scores, iou_threshold, None, box_iou_rotated)


def batched_nms_rotated(boxes: Tensor, scores: Tensor, idxs: Tensor,
                        iou_threshold: float) -> Tensor:
    """:func:`batched_nms` with :func:`box_iou_rotated`'s IoU (float64)."""
    return _greedy_nms(boxes, scores, iou_threshold, idxs, box_iou_rotated)


def soft_nms(boxes: Tensor, scores: Tensor, iou_threshold: float = 0.3, sigma: float = 0.5,
             min_score: float = 1e-3, method: str = "gaussian") -> tuple[Tensor, Tensor]:
    """Soft-NMS (mmcv's semantics; boxes below ``min_score`` are dropped, the
    first selection included), vectorised over the boxes: N steps of tensor
    ops with no host sync until the end.  Each step selects the live box of
    highest score (the lowest index among equal ones), then decays the
    others' scores by ``1 - iou`` where ``iou > iou_threshold`` (linear) or
    ``exp(-iou^2 / sigma)`` (gaussian); IoU 0 where boxes do not overlap.
    Returns (indices in selection order, their scores when selected)."""
    if method not in ("linear", "gaussian"):
        raise ValueError(f"soft_nms: unknown method {method!r}")
    n = boxes.shape[0]
    s = scores.detach().clone()
    live = s >= min_score
    positions = torch.arange(n, device=boxes.device)
    keep = torch.zeros(n, dtype=torch.int64, device=boxes.device)
    kept_scores = torch.zeros_like(s)
    selected = torch.zeros(n, dtype=torch.bool, device=boxes.device)
    for step in range(n):
        best = torch.where(live, s, torch.full_like(s, -math.inf)).max()
        first = (live & (s == best)).to(torch.int32)
        pick = first.argmax()  # the first maximal element
        keep[step] = pick
        kept_scores[step] = s[pick]
        selected[step] = first.any()
        live = live & (positions != pick)
        iou = box_iou(boxes[pick][None], boxes)[0].nan_to_num(0.0)
        if method == "linear":
            w = torch.where(iou > iou_threshold, 1 - iou, torch.ones_like(iou))
        else:
            w = torch.exp(-(iou * iou) / sigma)
        s = torch.where(live, s * w, s)
        live = live & (s >= min_score)
    return keep[selected], kept_scores[selected]


# --- optim: multi_tensor_l2norm, multi_tensor_scale_ ----------------------------------------

__all__ += ["multi_tensor_l2norm", "multi_tensor_scale_"]


def multi_tensor_l2norm(tensors, per_tensor: bool = False):
    """(total, per-tensor norms or an empty (0,)) as torch.linalg.vector_norm
    gives them, in float32 (float64 for float64 tensors)."""
    if len(tensors) == 0:
        return torch.zeros(()), torch.zeros((0,))
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in tensors])
    total = torch.linalg.vector_norm(norms)
    return total, norms if per_tensor else norms.new_empty((0,))


def multi_tensor_scale_(tensors, scale):
    """(the new values of the tensors,): a 1-tuple of the list the op
    writes (none is written here), each tensor times scale in float32
    (float64 for float64 tensors), rounded to its dtype."""
    out = []
    for t in tensors:
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        s = scale.to(t.device, acc) if isinstance(scale, Tensor) else float(scale)
        out.append((t.to(acc) * s).to(t.dtype))
    return (out,)
