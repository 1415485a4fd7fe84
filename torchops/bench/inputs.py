"""Random inputs of realistic shape for the benchmark cases.

Every factory takes a size's params and returns the torchops operator's
positional arguments, drawn on the CPU from torch's global generator (seeded
per row) in float32: Case.make_inputs moves them to the row's device and
dtype, so every device sees the same values.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

P = Mapping[str, Any]


def matrices(p: P) -> tuple:
    """``(B?, M, K) @ (B?, K, N)``: params m, k, n and optional b; with
    ``wt`` B is a transposed (N, K) weight, as ``x @ w.t()`` of a linear layer."""
    pre = (p["b"],) if p.get("b") else ()
    if p.get("wt"):
        return (torch.randn(*pre, p["m"], p["k"]),
                torch.randn(*pre, p["n"], p["k"]).transpose(-1, -2))
    return torch.randn(*pre, p["m"], p["k"]), torch.randn(*pre, p["k"], p["n"])


def vector(p: P) -> tuple:
    return (torch.empty(p["n"]).uniform_(-8, 8),)


def _scattered(n: int, coverage: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """Centres and sizes of n boxes with sides uniform in 16..128 pixels,
    scattered over a square sized so the boxes cover `coverage` of it."""
    wh = torch.empty(n, 2).uniform_(16, 128)
    return torch.rand(n, 2) * math.sqrt(max(n, 1) * 72.0**2 / coverage), wh


def random_boxes(n: int, regime: str = "sparse") -> torch.Tensor:
    """``(n, 4)`` boxes ``(x1, y1, x2, y2)``.  "sparse": scattered, almost none
    overlap (NMS keeps ~99%).  "dense": like a detector's raw output, clusters
    of ~20 copies jittered by 10% around n/20 objects (NMS keeps ~5%)."""
    if regime == "sparse":
        ctr, wh = _scattered(n)
    elif regime == "dense":
        obj_ctr, obj_wh = _scattered(max(1, n // 20))
        pick = torch.randint(0, obj_ctr.shape[0], (n,))
        wh = obj_wh[pick] * torch.empty(n, 2).uniform_(0.85, 1.15)
        ctr = obj_ctr[pick] + obj_wh[pick] * torch.empty(n, 2).uniform_(-0.1, 0.1)
    else:
        raise ValueError(f"unknown box regime {regime!r}; known: sparse, dense")
    return torch.cat([ctr - wh / 2, ctr + wh / 2], dim=1)


def nms_args(p: P) -> tuple:
    boxes = random_boxes(p["n"], p.get("regime", "sparse"))
    # Distinct scores: with ties, torchvision's (unstable) sort may order the
    # kept boxes differently, and the check would flag a non-difference.
    return boxes, (torch.randperm(p["n"]) + torch.rand(p["n"])) / p["n"], float(p.get("iou", 0.5))


def batched_nms_args(p: P) -> tuple:
    boxes, scores, iou = nms_args(p)
    return boxes, scores, torch.randint(0, p.get("classes", 80), (p["n"],)), iou


def box_pairs(p: P) -> tuple:
    return random_boxes(p["n"], "dense"), random_boxes(p["m"], "dense")


def _features_and_rois(p: P):
    """Features ``(N, C, H, W)`` at stride 1/p["scale"] of the image, and
    ``(K, 5)`` RoIs ``(batch index, x1, y1, x2, y2)`` in image pixels with sides
    uniform in 32 .. half the image."""
    n, c, h, w, k = p["n"], p["c"], p["h"], p["w"], p["rois"]
    scale = p.get("scale", 1 / 8)
    feats = torch.randn(n, c, h, w)
    img_w, img_h = w / scale, h / scale
    wh = torch.stack([torch.empty(k).uniform_(32, img_w / 2),
                      torch.empty(k).uniform_(32, img_h / 2)], dim=1)
    x1y1 = torch.rand(k, 2) * (torch.tensor([img_w, img_h]) - wh)
    rois = torch.cat([torch.randint(0, n, (k, 1)).float(), x1y1, x1y1 + wh], dim=1)
    return feats, rois, scale


def roi_align_args(p: P) -> tuple:
    """7x7 bins, sampling_ratio 2, aligned."""
    return (*_features_and_rois(p), 7, 7, 2, True)


def roi_pool_args(p: P) -> tuple:
    return (*_features_and_rois(p), 7, 7)


def deform_roi_pool_args(p: P) -> tuple:
    """roi_align_args' features and RoIs, all-zero offsets (a DeformRoIPoolPack
    at initialisation: the samples of roi_align with aligned=True, so the
    two ops read the same pixels), 7x7 bins, sampling_ratio 2, gamma 0.1."""
    feats, rois, scale = _features_and_rois(p)
    return feats, rois, torch.zeros(rois.shape[0], 2, 7, 7), scale, 7, 7, 2, 0.1


def focal_loss_args(p: P) -> tuple:
    """Logits ``(N, C)`` and one-hot float targets (a quarter of the rows are
    background: all zeros), alpha 0.25, gamma 2, mean."""
    n, c = p["n"], p["c"]
    logits, targets = torch.randn(n, c) * 2, torch.zeros(n, c)
    fg = torch.rand(n) >= 0.25
    targets[fg, torch.randint(0, c, (n,))[fg]] = 1.0
    return logits, targets, 0.25, 2.0, "mean"


def masked_conv_args(p: P) -> tuple:
    """A guided-anchoring head's masked 3x3 convolution: features ``(N, C,
    H, W)``, a bool mask ``(N, H, W)`` selecting ``density`` of the
    positions (uniformly at random), weight ``(C_out, C, 3, 3)`` (scaled
    like a trained layer's), bias, padding 1.  With ``weight_grad`` the
    weight and bias require gradients too (a training step's backward)."""
    n, c, h, w, c_out = p["n"], p["c"], p["h"], p["w"], p.get("c_out", p["c"])
    x = torch.randn(n, c, h, w)
    mask = torch.rand(n, h, w) < p["density"]
    weight = torch.randn(c_out, c, 3, 3) / math.sqrt(c * 9)
    bias = torch.randn(c_out)
    if p.get("weight_grad"):
        weight.requires_grad_()
        bias.requires_grad_()
    return x, mask, weight, bias, [1, 1], [1, 1], [1, 1], 1


def carafe_args(p: P) -> tuple:
    """CARAFE at an FPN level: features ``(N, C, H, W)`` and kernels
    softmax-normalised over each group's taps, as CARAFEPack makes them;
    params n, c, h, w, k, g, s.  With ``train``, the masks require their
    gradient too (CARAFEPack learns them)."""
    n, c, h, w, k, g, s = (p[key] for key in ("n", "c", "h", "w", "k", "g", "s"))
    logits = torch.randn(n, g, k * k, h * s, w * s)
    masks = torch.softmax(logits, dim=2).view(n, g * k * k, h * s, w * s)
    return torch.randn(n, c, h, w), masks.requires_grad_(bool(p.get("train"))), k, g, s


def deform_conv2d_args(p: P) -> tuple:
    """torch.ops.torchops.deform_conv2d's arguments: features ``(N, C, H, W)``,
    a 3x3 kernel at stride 1, padding 1 (one offset group, no weight groups)
    with ``1/sqrt(fan_in)``-scaled weights, offsets of about +-2 pixels (many
    samples reach outside the image) and a mask in [0, 1) when p["mask"].
    p["zero_offsets"]: offsets 0 and mask 1, where the op equals a plain
    convolution.  p["train"]: "all" (weight, offset, mask and bias) or
    "weights" (weight and bias) require their gradients too (the features'
    is Case.make_inputs's)."""
    n, c, o, h, w = p["n"], p["c"], p["o"], p["h"], p["w"]
    use_mask = p.get("mask", True)
    x = torch.randn(n, c, h, w)
    weight = torch.randn(o, c, 3, 3) / math.sqrt(9 * c)
    if p.get("zero_offsets"):
        offset, mask = torch.zeros(n, 18, h, w), torch.ones(n, 9, h, w)
    else:
        offset = torch.randn(n, 18, h, w) * 2
        mask = torch.rand(n, 9, h, w) if use_mask else torch.zeros(n, 1)
    bias = torch.randn(o)
    train = p.get("train")
    if train:
        more = (offset,) + ((mask,) if use_mask else ()) if train == "all" else ()
        for t in (weight, bias) + more:
            t.requires_grad_()
    return x, weight, offset, mask, bias, 1, 1, 1, 1, 1, 1, 1, 1, use_mask


# --- norms ---------------------------------------------------------------------------------


def norm_args(p: P) -> tuple:
    """A (rows, d) activation normalised over d: ``p["kind"]`` "rms" gives
    rms_norm's arguments, "fused" fused_add_rms_norm's (a residual too), "ln"
    layer_norm's.  The weights require their gradient when ``p["train"]``."""
    rows, d, kind = p["rows"], p["d"], p["kind"]
    x = torch.randn(rows, d)
    w = (torch.rand(d) + 0.5).requires_grad_(bool(p.get("train")))
    if kind == "rms":
        return x, [d], w, 1e-6
    if kind == "fused":
        return x, torch.randn(rows, d), [d], w, 1e-6
    b = (torch.rand(d) - 0.5).requires_grad_(bool(p.get("train")))
    return x, [d], w, b, 1e-5


# --- softmax --------------------------------------------------------------------------


def attention_scores(p: P) -> tuple:
    """Attention scores ``(B, H, S, S)`` (``(B, S, S)`` with ``h`` None),
    normal, and a head size's ``scale`` 1/sqrt(128).  With ``mask``, a
    padding mask ``(B, 1, S, S)``: batch entry b keeps its first L_b keys, L_b
    drawn in [S/2, S] (True = masked): the arguments of scaled_masked_softmax;
    without it, those of scaled_upper_triang_masked_softmax."""
    b, h, s = p["b"], p.get("h"), p["s"]
    x = torch.randn(b, h, s, s) if h else torch.randn(b, s, s)
    scale = 1 / math.sqrt(128)
    if not p.get("mask"):
        return x, scale
    lengths = torch.randint(s // 2, s + 1, (b,))
    mask = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, None, :].expand(b, 1, s, s)
    return x, mask.contiguous(), scale


# --- activations ----------------------------------------------------------------------------


def gated_args(p: P) -> tuple:
    """The gated activations' ``x``: ``rows`` rows of ``2 d`` (activation
    input and gate side by side), standard normal; with ``approximate``,
    gelu_and_mul's second argument."""
    x = torch.randn(p["rows"], 2 * p["d"])
    return (x, p["approximate"]) if "approximate" in p else (x,)


# --- rotary ------------------------------------------------------------------------------


def _rotary_angles(positions: torch.Tensor, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos and sin tables (base 10000) at `positions`, (..., rd / 2)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    angles = positions.double()[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def rotary_args(p: P) -> tuple:
    """torch.ops.torchops.rotary_embedding's arguments as a Llama attention
    layer has them: q ``(B, Hq, S, D)`` and k ``(B, Hk, S, D)`` (p["layout"]
    "bshd": ``(B, S, H, D)``), cos and sin ``(B, S, D)`` from Hugging Face's
    rotary module (halves equal)."""
    b, hq, hk, s, d = p["b"], p["hq"], p["hk"], p["s"], p["d"]
    bshd = p.get("layout") == "bshd"
    shape = (lambda h: (b, s, h, d)) if bshd else (lambda h: (b, h, s, d))
    q, k = torch.randn(shape(hq)), torch.randn(shape(hk))
    cos, sin = _rotary_angles(torch.arange(s).expand(b, s), d)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return q, k, cos, sin, 2 if bshd else 1, bool(p.get("interleaved"))


def rotary_cache_args(p: P) -> tuple:
    """torch.ops.torchops.rotary_embedding_'s arguments as vLLM has them: T
    tokens at random positions, q ``(T, Hq, D)`` and k ``(T, Hk, D)``, a
    ``(max_position, D)`` [cos | sin] cache.  The rotation keeps norms, so
    the repeated in-place calls of a benchmark keep the values bounded."""
    t, hq, hk, d, max_pos = p["t"], p["hq"], p["hk"], p["d"], p["max_pos"]
    cos, sin = _rotary_angles(torch.arange(max_pos), d)
    return (torch.randint(0, max_pos, (t,)), torch.randn(t, hq, d), torch.randn(t, hk, d),
            torch.cat((cos, sin), -1), bool(p.get("interleaved")))


# --- losses: fused linear cross-entropy ------------------------------------------------------


def linear_cross_entropy_args(p: P) -> tuple:
    """A language-model head and its loss: hidden states ``(N, H)`` (standard
    normal), a ``(V, H)`` weight scaled like a trained layer's
    (``1/sqrt(H)``: logits of about unit size), no bias, int64 targets
    uniform over the vocabulary with ``p["ignored"]`` of them (default 0)
    set to ignore_index -100 (masked prompt tokens); then
    torch.ops.torchops.fused_linear_cross_entropy's options: label_smoothing
    0, reduction "mean", no z-loss, ``p["softcap"]`` (default None)."""
    n, h, v = p["n"], p["h"], p["v"]
    x = torch.randn(n, h)
    w = torch.randn(v, h) / math.sqrt(h)
    t = torch.randint(0, v, (n,))
    t[torch.rand(n) < p.get("ignored", 0.0)] = -100
    return x, w, t, None, -100, 0.0, "mean", 0.0, p.get("softcap")


# --- optim: multi-tensor ops (lists of tensors, keyword-only arguments) ---------------------


class Call(tuple):
    """An input factory's result for an op with keyword-only arguments: the
    positional arguments (the tuple itself, so ``args[0]`` still works),
    ``kwargs`` (keyword-only hyper-parameters, and tensors or lists of them:
    ``master_params``), and ``keep``: the arguments (positions, keyword
    names) whose floating tensors keep the factory's dtype instead of taking
    the size's (optimizer states and float32 masters of bf16 parameters,
    step counts).  Tensors inside lists are moved like the others."""

    def __new__(cls, args=(), kwargs=None, keep=()):
        self = super().__new__(cls, args)
        self.kwargs = dict(kwargs or {})
        self.keep = frozenset(keep)
        return self


def llama_shapes(p: P) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama-style decoder (a mix of large matrices
    and small vectors): the embedding (``vocab x d``, tied with the head),
    then per layer q, k, v, o (``d x d``), gate and up (``ffn x d``), down
    (``d x ffn``) and two norm weights (``d``), and, unless
    ``p["final_norm"]`` is False, the final norm's weight."""
    d, ffn = p["d"], p["ffn"]
    layer = [(d, d)] * 4 + [(ffn, d)] * 2 + [(d, ffn), (d,), (d,)]
    return [(p["vocab"], d)] + layer * p["layers"] + [(d,)] * p.get("final_norm", True)


def _pool(shapes) -> torch.Tensor:
    """Standard normals for :func:`_pool_slices`: as many as the shapes hold,
    at most 2^24."""
    return torch.randn(min(1 << 24, sum(math.prod(s) for s in shapes)))


def _pool_slices(pool: torch.Tensor, shapes) -> list[torch.Tensor]:
    """One tensor per shape, each a slice of `pool` at a random offset (views:
    Case.make_inputs copies list entries into tensors of their own), or the
    pool repeated where a shape is larger."""
    out = []
    for shape in shapes:
        n = math.prod(shape)
        if n > pool.numel():
            out.append(pool.repeat(-(-n // pool.numel()))[:n].view(shape))
            continue
        off = int(torch.randint(0, pool.numel() - n + 1, (1,)))
        out.append(pool[off:off + n].view(shape))
    return out


def adam_args(p: P) -> Call:
    """torch.ops.torchops.fused_adam_'s arguments for one AdamW step (lr 1e-3,
    betas 0.9 and 0.999, eps 1e-8, weight decay 0.01) over the parameters of
    :func:`llama_shapes`: parameters of about 0.02 (an initialised model's),
    unit-normal gradients, first moments of about 0.1 and second moments of
    about 0.01 (a model some steps in), float32 step counts of 10 (the count
    after this step: bias correction mid-way).  With ``p["master"]`` the
    parameters take the size's dtype (bf16) and ``master_params`` hold them in
    float32, as do the moments; the gradients take the parameters' dtype.

    Drawing billions of normals takes minutes on a CPU, so each list's
    tensors are slices of one pool of at most 2^24 normals, at random
    offsets: the values repeat, which a memory-bound step does not notice."""
    shapes = llama_shapes(p)
    z = _pool(shapes)
    params, grads, exp_avgs, exp_avg_sqs = (
        _pool_slices(pool, shapes) for pool in (0.02 * z, z, 0.1 * z, 0.01 * z * z))
    steps = [torch.tensor(10.0) for _ in shapes]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                  maximize=False, adamw=True)
    keep: tuple = (5,)
    if p.get("master"):
        kwargs["master_params"] = list(params)
        keep = (2, 3, 4, 5, "master_params")
    return Call((params, grads, exp_avgs, exp_avg_sqs, [], steps), kwargs, keep)


def sgd_args(p: P) -> Call:
    """torch.ops.torchops.fused_sgd_'s arguments for one SGD step with momentum
    0.9 (lr 1e-3, no weight decay, dampening or nesterov; the buffers exist:
    not the first step) over the parameters of :func:`llama_shapes`, values
    as :func:`adam_args`'s (buffers of about 0.1).  With ``p["master"]`` the
    parameters and gradients take the size's dtype and ``master_params`` and
    the buffers are float32."""
    shapes = llama_shapes(p)
    z = _pool(shapes)
    params, grads, bufs = (_pool_slices(pool, shapes) for pool in (0.02 * z, z, 0.1 * z))
    kwargs = dict(weight_decay=0.0, momentum=0.9, lr=1e-3, dampening=0.0, nesterov=False,
                  maximize=False, is_first_step=False)
    keep: tuple = ()
    if p.get("master"):
        kwargs["master_params"] = list(params)
        keep = (2, "master_params")
    return Call((params, grads, bufs), kwargs, keep)


def tensor_list_args(p: P) -> tuple:
    """A gradient list of :func:`llama_shapes` (unit normal, pool slices as in
    :func:`adam_args`), then ``p["extra"]``: the op's other positional
    arguments (multi_tensor_l2norm's per_tensor, multi_tensor_scale_'s scale)."""
    shapes = llama_shapes(p)
    return (_pool_slices(_pool(shapes), shapes), *p.get("extra", ()))


# --- detection: multi-scale deformable attention ---------------------------------------------

def ms_deform_attn_args(p: P) -> tuple:
    """A Deformable DETR attention's sampling: value ``(B, S, heads, C)`` over
    the levels ``p["levels"]`` [(H, W), ...]; with ``p["q"]`` that many
    queries at random reference points (a decoder), else one query per
    position, its reference point the pixel's centre (the encoder).  Each
    head's points lie about 2 pixels (normal) around the reference point on
    every level; attention weights are a softmax over levels and points."""
    levels, b, heads, c, points = p["levels"], p["b"], p["heads"], p["c"], p["points"]
    sizes = torch.tensor(levels, dtype=torch.int64)
    n_levels = len(levels)
    areas = sizes[:, 0] * sizes[:, 1]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), areas.cumsum(0)[:-1]])
    spatial = int(areas.sum())
    if p.get("q"):
        ref = torch.rand(b, p["q"], 2)
    else:
        centres = [torch.stack(torch.meshgrid((torch.arange(w) + 0.5) / w,
                                              (torch.arange(h) + 0.5) / h, indexing="xy"),
                               -1).reshape(-1, 2) for h, w in levels]
        ref = torch.cat(centres).expand(b, -1, -1)
    q = ref.shape[1]
    wh = sizes.flip(-1).to(torch.float32)  # (L, 2) as (W, H)
    offsets = torch.randn(b, q, heads, n_levels, points, 2) * 2.0 / wh[:, None, :]
    loc = ref[:, :, None, None, None, :] + offsets
    attn = torch.softmax(torch.randn(b, q, heads, n_levels * points), -1)
    attn = attn.view(b, q, heads, n_levels, points)
    return torch.randn(b, spatial, heads, c), sizes, starts, loc.contiguous(), attn


# --- detection: rotated boxes and soft-NMS ---
def random_rotated_boxes(n: int, regime: str = "sparse") -> torch.Tensor:
    """``(n, 5)`` rotated boxes ``(x_ctr, y_ctr, w, h, angle)``: random_boxes'
    centres and sizes (same regimes), angles uniform in [-90, 90) degrees."""
    b = random_boxes(n, regime)
    return torch.cat([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2],
                      torch.rand(n, 1) * 180 - 90], dim=1)


def _distinct_scores(n: int) -> torch.Tensor:
    return (torch.randperm(n) + torch.rand(n)) / max(n, 1)


def nms_rotated_args(p: P) -> tuple:
    n = p["n"]
    return random_rotated_boxes(n, p.get("regime", "sparse")), _distinct_scores(n), float(p.get("iou", 0.5))


def batched_nms_rotated_args(p: P) -> tuple:
    boxes, scores, iou = nms_rotated_args(p)
    return boxes, scores, torch.randint(0, p.get("classes", 80), (p["n"],)), iou


def rotated_box_pairs(p: P) -> tuple:
    return random_rotated_boxes(p["n"], "dense"), random_rotated_boxes(p["m"], "dense")


def soft_nms_args(p: P) -> tuple:
    n = p["n"]
    return (random_boxes(n, p.get("regime", "dense")), _distinct_scores(n), 0.3, 0.5, 1e-3,
            p.get("method", "gaussian"))
