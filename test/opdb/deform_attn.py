"""Entries of the deformable-attention ops: ms_deform_attn (Deformable DETR's
multi-scale deformable attention sampling), and the sample maker its tests
share (msda_inputs)."""

from __future__ import annotations

import torch

from .core import ErrorInput, OpInfo, Sample, Tol, make


def msda_inputs(shapes, batch, queries, heads, channels, points, device, dtype,
                requires_grad=False, layout="contiguous", low=-0.1, high=1.1, seed=0):
    """(value, spatial_shapes, level_start_index, sampling_locations,
    attention_weights) for levels `shapes` [(H, W), ...]: locations uniform
    in [low, high] (a margin outside every level), weights in [0, 1].
    layout: "contiguous"; "permuted" (value stored (B, heads, S, C), as a
    per-head projection leaves it); "sliced" (locations and weights views
    with gaps); "expanded" (one weight row for every query, stride 0)."""
    gen = torch.Generator().manual_seed(seed)
    levels = len(shapes)
    spatial = sum(h * w for h, w in shapes)
    starts = [0]
    for h, w in shapes[:-1]:
        starts.append(starts[-1] + h * w)
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64, device=device).reshape(levels, 2)
    level_start_index = torch.tensor(starts[:levels], dtype=torch.int64, device=device)

    def rand(shape, lo, hi):
        t = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
        return t.to(device=device, dtype=dtype)

    if layout == "permuted":
        value = rand((batch, heads, spatial, channels), -3, 3).permute(0, 2, 1, 3)
    else:
        value = rand((batch, spatial, heads, channels), -3, 3)
    loc_shape = (batch, queries, heads, levels, points, 2)
    attn_shape = (batch, queries, heads, levels, points)
    if layout == "sliced":
        loc = rand((*loc_shape[:-1], 3), low, high)[..., 1:]
        attn = rand((*attn_shape[:-1], 2 * points), 0, 1)[..., ::2]
    elif layout == "expanded":
        loc = rand(loc_shape, low, high)
        attn = rand((batch, 1, heads, levels, points), 0, 1).expand(attn_shape)
    else:
        loc = rand(loc_shape, low, high)
        attn = rand(attn_shape, 0, 1)
    for t in (value, loc, attn):
        if requires_grad and t.stride() and 0 not in t.stride():
            t.requires_grad_()
    return value, spatial_shapes, level_start_index, loc, attn


# (name, levels, B, Q, heads, C, P, layout)
_CASES = [
    ("basic", [(4, 5), (2, 3)], 2, 5, 2, 4, 3, "contiguous"),
    # Odd channels (the CUDA kernels' one-channel packs), a 1x1 level.
    ("odd", [(3, 7), (1, 1), (5, 2)], 1, 3, 3, 3, 2, "contiguous"),
    # More channel packs than one warp's lanes in the CUDA backward.
    ("wide", [(3, 4)], 1, 2, 1, 136, 1, "contiguous"),
    ("permuted", [(4, 3), (2, 2)], 2, 3, 2, 8, 2, "permuted"),
    ("sliced", [(3, 3), (2, 5)], 1, 4, 2, 6, 2, "sliced"),
    # A level without positions, and one point per level.
    ("empty_level", [(0, 3), (3, 2), (2, 0)], 2, 3, 2, 4, 1, "contiguous"),
    ("no_queries", [(3, 3)], 2, 0, 2, 4, 2, "contiguous"),
    ("no_batch", [(3, 3)], 0, 2, 2, 4, 2, "contiguous"),
    ("no_levels", [], 1, 3, 2, 4, 2, "contiguous"),
]


def _msda_samples(device, dtype, requires_grad=False):
    for seed, (name, shapes, b, q, h, c, p, layout) in enumerate(_CASES):
        args = msda_inputs(shapes, b, q, h, c, p, device, dtype, requires_grad, layout,
                           seed=seed)
        yield Sample(args, name=name)
    # Locations far outside and on the edges: nothing, or one corner, read.
    value, shapes, starts, loc, attn = msda_inputs([(3, 4), (2, 2)], 1, 6, 2, 4, 2, device,
                                                  dtype, seed=20)
    edge = torch.tensor([-3.0, -0.1, 0.0, 1.0, 1.05, 4.0], dtype=dtype, device=device)
    loc = loc.detach().clone()
    loc[0, :, :, :, :, 0] = edge[:, None, None, None]
    loc[0, :, :, :, 0, 1] = edge.flip(0)[:, None, None]
    yield Sample(tuple(t.requires_grad_(requires_grad) if t.is_floating_point() else t
                       for t in (value, shapes, starts, loc, attn)), name="edges")
    if not requires_grad:  # gradcheck cannot perturb a stride-0 input
        yield Sample(msda_inputs([(3, 2), (2, 2)], 2, 3, 2, 4, 2, device, dtype,
                                 layout="expanded", seed=30), name="expanded")


def _msda_compile_samples(device, dtype, requires_grad=False):
    for seed, (shapes, q) in enumerate([([(3, 4), (2, 2)], 3), ([(4, 5), (2, 3)], 5),
                                        ([(5, 3), (3, 2)], 7)]):
        yield Sample(msda_inputs(shapes, 2, q, 2, 4, 2, device, dtype, requires_grad,
                                 seed=40 + seed), name=f"compile_q{q}")


def _msda_errors(device):
    name = r"torchops\.ms_deform_attn"
    base = msda_inputs([(3, 4), (2, 2)], 2, 3, 2, 4, 2, device, torch.float32)
    value, shapes, starts, loc, attn = base

    def call(**over):
        args = dict(zip(("value", "shapes", "starts", "loc", "attn"), base))
        args.update(over)
        return Sample(tuple(args.values()))

    def error(sample, match, **kw):
        return ErrorInput(sample, rf"{name}.*{match}", **kw)

    yield error(call(value=value[0]), "'value'.*4 dimensions")
    yield error(call(value=value.long(), loc=loc.long(), attn=attn.long()), "'value'.*floating")
    yield error(call(loc=loc.double()), "'sampling_locations'.*same dtype as 'value'")
    yield error(call(attn=attn.double()), "'attention_weights'.*same dtype as 'value'")
    yield error(call(shapes=shapes.int()), "'spatial_shapes'.*int64")
    yield error(call(starts=starts.int()), "'level_start_index'.*int64")
    yield error(call(shapes=shapes[:, :1]), r"'spatial_shapes'.*\(L, 2\)")
    yield error(call(starts=starts[:1]), r"'level_start_index'.*\(L,\)")
    yield error(call(loc=loc[..., :1, :, :]), "'sampling_locations'.*shape")
    yield error(call(loc=loc[..., :1]), "'sampling_locations'.*shape")
    yield error(call(loc=loc[:, :, :1]), "'sampling_locations'.*shape")
    yield error(call(attn=attn[..., :1]), "'attention_weights'.*shape")
    yield error(call(attn=attn[:, :2]), "'attention_weights'.*shape")
    if device != "cpu":
        yield error(call(shapes=shapes.cpu()), "'spatial_shapes'")
        yield error(call(attn=attn.cpu()), "'attention_weights'")
    # The values of spatial_shapes and level_start_index: the CPU kernel
    # checks them; on every device the wrapper does (one sync on a GPU).
    bad_values = [
        (call(shapes=torch.tensor([[3, 4], [1, 2]], device=device)), "S = 16.*sum to 14"),
        (call(shapes=torch.tensor([[3, 4], [2, 3]], device=device)), "S = 16.*up to 1"),
        (call(shapes=torch.tensor([[5, 4], [2, 2]], device=device)), "S = 16.*up to 0"),
        (call(shapes=torch.tensor([[-3, 4], [2, 2]], device=device)), "sizes >= 0.*level 0"),
        (call(starts=torch.tensor([0, 11], device=device)), r"'level_start_index\[1\]'.*12"),
        (call(starts=torch.tensor([1, 12], device=device)), r"'level_start_index\[0\]'.*0"),
    ]
    for sample, match in bad_values:
        yield error(sample, match, via_wrapper=True)
        if device == "cpu":
            yield error(sample, match, kernel_only="the values of spatial_shapes and "
                        "level_start_index, read by the CPU kernel")
    # The backward operator: (grad, value, spatial_shapes, level_start_index, loc, attn).
    backward = torch.ops.torchops._ms_deform_attn_backward.default
    bname = r"torchops\._ms_deform_attn_backward"
    grad = make((2, 3, 8), device, torch.float32)
    for g, match in [(grad[:, :2], r"'grad'.*\(B, Q, heads \* C\)"),
                     (grad[..., :4], r"'grad'.*shape"),
                     (grad.double(), "'grad'.*dtype")]:
        yield ErrorInput(Sample((g, *base)), rf"{bname}.*{match}", op=backward)
    yield ErrorInput(Sample((grad, value, shapes, starts, loc[:, :, :1], attn)),
                     rf"{bname}.*'sampling_locations'.*shape", op=backward)


MS_DEFORM_ATTN = OpInfo(
    name="ms_deform_attn",
    sample_inputs=_msda_samples,
    sample_inputs_compile=_msda_compile_samples,
    error_inputs=_msda_errors,
    internal_ops=("_ms_deform_attn_backward",),
    autocast=True,
    # The CUDA backward adds value's gradient with atomics (unless
    # deterministic algorithms are on).
    gradcheck_kwargs={"nondet_tol": 1e-12},
    # Sums of up to L * P * 4 products; locations scaled by the level size.
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(2e-3, 2e-3),
          torch.bfloat16: Tol(2e-2, 2e-2)},
)

DEFORM_ATTN_OPS: list[OpInfo] = [MS_DEFORM_ATTN]
