"""Entries of the deformable ops: deform_conv2d."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample, Tol, make

_BACKWARD = torch.ops.torchops._deform_conv2d_backward.default


def _out_size(size, k, s, p, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _offsets(shape, device, dtype, seed: int) -> torch.Tensor:
    """Offsets of up to +-4 pixels (so samples reach outside the image)
    whose fractional part stays in [0.1, 0.9]: no sample lies on an integer
    coordinate, where the bilinear weights have kinks (finite differences and
    float32-vs-float64 comparisons would straddle them)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(-4, 4, shape, generator=g).to(torch.float64)
    frac = torch.rand(shape, generator=g, dtype=torch.float64) * 0.8 + 0.1
    return (whole + frac).to(dtype).to(device)


# (name, N, C, H, W, O, (kh, kw), stride, pad, dilation, groups, offset_groups, use_mask, layout)
_CASES = [
    ("basic", 2, 4, 7, 8, 3, (3, 3), 1, 1, 1, 1, 1, True, "contiguous"),
    ("no_mask", 2, 4, 7, 8, 3, (3, 3), 1, 1, 1, 1, 1, False, "contiguous"),
    ("groups", 1, 4, 6, 7, 6, (3, 2), 1, 0, 1, 2, 2, True, "contiguous"),
    ("offset_groups", 2, 4, 5, 6, 2, (2, 2), 1, 1, 1, 1, 2, False, "contiguous"),
    ("stride_dilation", 2, 3, 9, 10, 2, (3, 3), 2, 1, 2, 1, 1, True, "contiguous"),
    ("sliced", 2, 3, 6, 7, 4, (3, 3), 1, 1, 1, 1, 1, True, "sliced"),
    ("transposed", 1, 2, 6, 6, 2, (3, 3), (2, 1), (1, 2), (1, 2), 1, 1, True, "transposed"),
    ("empty_batch", 0, 4, 7, 8, 3, (3, 3), 1, 1, 1, 1, 1, True, "contiguous"),
    ("no_channels", 1, 0, 5, 5, 2, (3, 3), 1, 1, 1, 1, 1, True, "contiguous"),
    ("one_pixel", 1, 1, 1, 1, 1, (1, 1), 1, 0, 1, 1, 1, True, "contiguous"),
]


def _pair(v):
    return v if isinstance(v, tuple) else (v, v)


def _sample(name, n, c, h, w, o, kernel, stride, pad, dil, groups, og, use_mask, layout,
            device, dtype, requires_grad, seed=0) -> Sample:
    kh, kw = kernel
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(pad), _pair(dil)
    oh, ow = _out_size(h, kh, sh, ph, dh), _out_size(w, kw, sw, pw, dw)
    if layout == "sliced":
        x = make((n, 2 * c, h, w + 2), device, dtype)[:, ::2, :, 1:w + 1]
    elif layout == "transposed":
        x = make((n, c, w, h), device, dtype).transpose(2, 3)
    else:
        x = make((n, c, h, w), device, dtype)
    weight = make((o, c // groups if groups else 0, kh, kw), device, dtype, low=-1, high=1)
    offset = _offsets((n, 2 * og * kh * kw, oh, ow), device, dtype, seed)
    if layout == "transposed":
        offset = offset.transpose(2, 3).contiguous().transpose(2, 3)
    mask = (make((n, og * kh * kw, oh, ow), device, dtype, low=0, high=1) if use_mask
            else torch.zeros((n, 1), device=device, dtype=dtype))
    bias = make((o,), device, dtype)
    tensors = [t.detach().requires_grad_(requires_grad) for t in (x, weight, offset, mask, bias)]
    if not use_mask:
        tensors[3].requires_grad_(False)
    return Sample((*tensors, sh, sw, ph, pw, dh, dw, groups, og, use_mask), name=name)


def _samples(device, dtype, requires_grad=False):
    for i, case in enumerate(_CASES):
        yield _sample(*case, device=device, dtype=dtype, requires_grad=requires_grad, seed=i)


def _compile_samples(device, dtype, requires_grad=False):
    for i, (n, c, h, w) in enumerate(((2, 4, 7, 8), (3, 6, 9, 6), (2, 2, 8, 11))):
        yield _sample("compile", n, c, h, w, 3, (3, 3), 1, 1, 1, 1, 2, True, "contiguous",
                      device, dtype, requires_grad, seed=100 + i)


def _wrapper_sample(s: Sample) -> Sample:
    """The op's arguments as torchops.deform_conv2d's (torchvision's order)."""
    x, weight, offset, mask, bias, sh, sw, ph, pw, dh, dw, _groups, _og, use_mask = s.args
    return Sample((x, offset, weight, bias, (sh, sw), (ph, pw), (dh, dw),
                   mask if use_mask else None), name=s.name)


def _errors(device):
    def base(**change):
        s = _sample("basic", 2, 4, 7, 8, 3, (3, 3), 1, 1, 1, 1, 1, True, "contiguous",
                    device, torch.float32, False)
        args = list(s.args)
        names = ["input", "weight", "offset", "mask", "bias", "stride_h", "stride_w", "pad_h",
                 "pad_w", "dilation_h", "dilation_w", "groups", "offset_groups", "use_mask"]
        for k, v in change.items():
            args[names.index(k)] = v
        return Sample(tuple(args), name=f"bad_{'_'.join(change)}")

    f32 = dict(device=device, dtype=torch.float32)
    op = r"torchops\.deform_conv2d: "
    yield ErrorInput(base(offset=torch.zeros(2, 17, 7, 8, **f32)), op + r".*'offset'")
    yield ErrorInput(base(offset=torch.zeros(2, 18, 6, 8, **f32)), op + r".*'offset'")
    yield ErrorInput(base(mask=torch.zeros(2, 8, 7, 8, **f32)), op + r".*'mask'")
    yield ErrorInput(base(weight=torch.zeros(3, 4, 3, 3, **f32), groups=3), op + r".*'groups'")
    yield ErrorInput(base(weight=torch.zeros(3, 3, 3, 3, **f32)), op + r".*'weight'")
    yield ErrorInput(base(offset=torch.zeros(2, 54, 7, 8, **f32), mask=torch.zeros(2, 27, 7, 8, **f32),
                          offset_groups=3), op + r".*'offset_groups'")
    yield ErrorInput(base(bias=torch.zeros(4, **f32)), op + r".*'bias'")
    yield ErrorInput(base(offset=torch.zeros(2, 18, 7, 8, device=device, dtype=torch.float64)),
                     op + r".*'offset'")
    yield ErrorInput(base(input=torch.zeros(4, 7, 8, **f32)), op + r".*'input'")
    yield ErrorInput(base(stride_h=0), op + r".*'stride_h'")
    yield ErrorInput(base(input=torch.zeros(2, 4, 1, 1, **f32), pad_h=0, pad_w=0),
                     op + r".*'input'")
    yield ErrorInput(base(input=torch.zeros(2, 4, 7, 8, dtype=torch.int64, device=device)),
                     op + r".*'input'")
    # The wrapper: fewer offset channels than one offset group needs.
    x = make((1, 2, 5, 5), device, torch.float32)
    yield ErrorInput(Sample((x, torch.zeros(1, 4, 3, 3, **f32), torch.zeros(2, 2, 3, 3, **f32)),
                            name="wrapper_offset"), op + r".*'offset'", via_wrapper=True)
    yield ErrorInput(Sample((x, torch.zeros(1, 18, 3, 3, **f32), torch.zeros(2, 2, 3, 3, **f32)),
                            {"stride": (1, 1, 1)}, name="wrapper_stride"),
                     op + r".*'stride'", error=ValueError, via_wrapper=True)
    # The backward operator checks its gradient.
    s = base()
    yield ErrorInput(Sample((torch.zeros(2, 3, 7, 7, **f32), *s.args), name="bad_grad"),
                     r"torchops\._deform_conv2d_backward: .*'grad'", op=_BACKWARD)


DEFORM_CONV2D = OpInfo(
    name="deform_conv2d",
    sample_inputs=_samples,
    sample_inputs_compile=_compile_samples,
    error_inputs=_errors,
    internal_ops=("_deform_conv2d_backward",),
    autocast=True,
    wrapper_sample=_wrapper_sample,
    # Sums of C / groups * kh * kw products of values up to 3.
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(1e-2, 2e-3),
          torch.bfloat16: Tol(5e-2, 1.6e-2)},
    # The default CUDA backward scatters the input gradient with atomics.
    gradcheck_kwargs={"nondet_tol": 1e-12},
)

DEFORM_OPS: list[OpInfo] = [DEFORM_CONV2D]
