"""Entries of the upsampling ops: carafe; and its sample maker
(carafe_inputs), which test_upsample.py and test_modules.py share."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample, Tol, hyp_size, hyp_tensor, make, make_transposed


def carafe_inputs(shape, kernel_size, group_size, scale_factor, device, dtype,
                  requires_grad=False, features_layout="contiguous", masks_layout="contiguous"):
    """(features, masks) for carafe: features of `shape` (N, C, H, W) in
    [-3, 3], masks (N, g k^2, H s, W s) in [-1, 1] (raw, not normalised:
    every tap weighs differently), each in a layout: "contiguous",
    "channels_last", "transposed" (last two dims), "sliced" (columns of a
    wider tensor) or "expanded" (one image broadcast over the batch)."""
    n, c, h, w = shape
    mshape = (n, group_size * kernel_size**2, h * scale_factor, w * scale_factor)

    def tensor(shape, layout, low, high):
        if layout == "channels_last":
            t = make(shape, device, dtype, low=low, high=high).contiguous(
                memory_format=torch.channels_last)
        elif layout == "transposed":
            t = make_transposed(shape, device, dtype, low=low, high=high)
        elif layout == "sliced":
            *lead, last = shape
            t = make((*lead, last + 3), device, dtype, low=low, high=high)[..., 1:last + 1]
        elif layout == "expanded":
            t = make((1, *shape[1:]), device, dtype, low=low, high=high).expand(shape)
        else:
            t = make(shape, device, dtype, low=low, high=high)
        return t.detach().requires_grad_(requires_grad)

    return tensor(shape, features_layout, -3.0, 3.0), tensor(mshape, masks_layout, -1.0, 1.0)


# (name, features (N, C, H, W), kernel_size, group_size, scale_factor,
#  features layout, masks layout).  The CUDA kernels have fast paths for
# kernel sizes 1, 3, 5, 7 and a generic one (k = 9); tiles of 32 source
# columns and several source rows, channel chunks of 16 (the 40-channel
# samples), spans of 128 output columns on the CPU (the 70-column one).
_CARAFE_CASES = [
    ("basic", (2, 4, 5, 7), 3, 1, 2, "contiguous", "contiguous"),
    ("groups", (1, 6, 4, 5), 5, 2, 2, "contiguous", "contiguous"),
    ("k1_g4", (2, 8, 3, 4), 1, 4, 2, "contiguous", "contiguous"),
    ("s1", (1, 3, 6, 5), 3, 1, 1, "contiguous", "contiguous"),
    ("s3_g2", (1, 2, 3, 4), 3, 2, 3, "contiguous", "contiguous"),
    ("s4_k7", (1, 2, 3, 3), 7, 1, 4, "contiguous", "contiguous"),
    ("k7_s2", (1, 3, 4, 6), 7, 1, 2, "contiguous", "contiguous"),
    ("k5_s1", (1, 2, 6, 7), 5, 1, 1, "contiguous", "contiguous"),
    ("k9_generic", (1, 2, 4, 5), 9, 1, 2, "contiguous", "contiguous"),
    ("many_channels", (1, 40, 4, 6), 5, 1, 2, "contiguous", "contiguous"),
    ("many_channels_g2", (1, 40, 3, 5), 3, 2, 2, "contiguous", "contiguous"),
    ("wide", (1, 2, 3, 70), 5, 1, 2, "contiguous", "contiguous"),
    ("tall", (1, 2, 11, 3), 3, 1, 2, "contiguous", "contiguous"),
    ("channels_last", (2, 4, 5, 6), 3, 2, 2, "channels_last", "channels_last"),
    ("transposed", (1, 3, 5, 4), 5, 1, 2, "transposed", "transposed"),
    ("sliced", (2, 2, 4, 5), 3, 1, 2, "sliced", "sliced"),
    ("expanded", (2, 2, 3, 4), 3, 1, 2, "expanded", "expanded"),
    ("one_pixel", (1, 1, 1, 1), 3, 1, 2, "contiguous", "contiguous"),
    ("empty_batch", (0, 4, 5, 7), 3, 1, 2, "contiguous", "contiguous"),
    ("no_channels", (2, 0, 3, 3), 3, 1, 2, "contiguous", "contiguous"),
    ("no_rows", (1, 2, 0, 4), 3, 1, 2, "contiguous", "contiguous"),
]


def _carafe_samples(device, dtype, requires_grad=False):
    for name, shape, k, g, s, fl, ml in _CARAFE_CASES:
        f, m = carafe_inputs(shape, k, g, s, device, dtype, requires_grad, fl, ml)
        yield Sample((f, m, k, g, s), name=f"carafe_{name}")
    yield from _carafe_compile_samples(device, dtype, requires_grad)


def _carafe_compile_samples(device, dtype, requires_grad=False):
    """Three calls differing only in sizes, for the compile and export tests."""
    for shape in [(2, 4, 5, 7), (2, 6, 8, 5), (2, 8, 6, 9)]:
        f, m = carafe_inputs(shape, 3, 2, 2, device, dtype, requires_grad)
        yield Sample((f, m, 3, 2, 2), name=f"carafe_compile{shape}")


def _carafe_large(device, dtype, requires_grad=False):
    """An FPN level (for --full): 64 channels at 50x76 -> 100x152, mmcv's
    defaults (k 5, one group, scale 2), and k 3 with 4 groups."""
    for k, g in ((5, 1), (3, 4)):
        f, m = carafe_inputs((2, 64, 50, 76), k, g, 2, device, dtype, requires_grad)
        yield Sample((f, m, k, g, 2), name=f"carafe_fpn_k{k}_g{g}")


def _carafe_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    k = draw(st.sampled_from([1, 3, 5, 7]), label="kernel_size")
    g = draw(st.sampled_from([1, 2, 3]), label="group_size")
    s = draw(st.integers(1, 4), label="scale_factor")
    shape = (draw(st.integers(0, 2), label="N"), g * draw(st.integers(0, 3), label="C/g"),
             hyp_size(draw, 9), hyp_size(draw, 9))
    mshape = (shape[0], g * k * k, shape[2] * s, shape[3] * s)
    f = hyp_tensor(draw, shape, device, dtype)
    m = hyp_tensor(draw, mshape, device, dtype, low=-1.0, high=1.0)
    return Sample((f, m, k, g, s), name="carafe_drawn")


def _carafe_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    name = r"torchops\.carafe"
    x, m = f(2, 4, 3, 5), f(2, 9, 6, 10)  # k 3, one group, scale 2

    def error(args, match, **kw):
        return ErrorInput(Sample(args), rf"{name}: .*{match}", **kw)

    yield error((f(4, 3, 5), m, 3, 1, 2), "'features'.*4 dimensions")
    yield error((x, f(9, 6, 10), 3, 1, 2), "'masks'.*4 dimensions")
    yield error((x.long(), m.long(), 3, 1, 2), "'features'.*floating")
    yield error((x, m.double(), 3, 1, 2), "'masks'.*same dtype")
    yield error((x, f(2, 4, 6, 10), 2, 1, 2), "'kernel_size'.*odd")
    for k in (0, -3):
        yield error((x, m, k, 1, 2), "'kernel_size'.*positive odd")
    yield error((x, m, 3, 0, 2), "'group_size'.*positive")
    yield error((x, f(2, 27, 6, 10), 3, 3, 2), r"'group_size' \(3\) to divide .* \(4\)")
    for s in (0, -1):
        yield error((x, m, 3, 1, s), "'scale_factor'.*positive")
    yield error((x, f(2, 18, 6, 10), 3, 1, 2), "'masks'.*= 9 channels")
    yield error((x, f(2, 9, 6, 10), 3, 2, 2), "'masks'.*= 18 channels")
    yield error((x, f(2, 9, 6, 9), 3, 1, 2), r"'masks'.*spatial size .* \(6, 10\)")
    yield error((x, f(2, 9, 3, 5), 3, 1, 2), "'masks'.*spatial size")
    yield error((x, f(1, 9, 6, 10), 3, 1, 2), "'masks'.*batch size")
    yield error((x, m, 2**33 + 1, 1, 2), "'kernel_size'.*too large")
    yield error((x, m, 3, 1, 2**62), "'scale_factor'.*too large")
    if device != "cpu":
        yield error((x, m.cpu(), 3, 1, 2), "'masks'")
        yield error((x.cpu(), m, 3, 1, 2), "'features'|'masks'")
    # The internal backward op checks the same, and grad.
    backward = torch.ops.torchops._carafe_backward.default
    bname = r"torchops\._carafe_backward"
    grad = f(2, 4, 6, 10)
    for args, match in [
            ((f(2, 4, 6, 9), x, m, 3, 1, 2), r"'grad'.*output's shape \(2, 4, 6, 10\)"),
            ((f(2, 4, 6), x, m, 3, 1, 2), r"'grad'.*output's shape"),
            ((grad.double(), x, m, 3, 1, 2), "'grad'.*same dtype"),
            ((grad, x, f(2, 18, 6, 10), 3, 1, 2), "'masks'.*= 9 channels"),
            ((grad, x, m, 4, 1, 2), "'kernel_size'.*odd"),
            ((grad, x, m, 3, 3, 2), "'group_size'.*divide")]:
        yield ErrorInput(Sample(args), rf"{bname}: .*{match}", op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((grad.cpu(), x, m, 3, 1, 2)), rf"{bname}: .*'grad'", op=backward)


CARAFE = OpInfo(
    name="carafe",
    sample_inputs=_carafe_samples,
    sample_inputs_compile=_carafe_compile_samples,
    error_inputs=_carafe_errors,
    internal_ops=("_carafe_backward",),
    autocast=True,
    sample_inputs_large=_carafe_large,
    hypothesis_sample=_carafe_hypothesis,
)


UPSAMPLE_OPS: list[OpInfo] = [CARAFE]
