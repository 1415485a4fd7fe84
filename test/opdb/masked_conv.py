"""Entry of the masked convolution: masked_conv2d; and the mask maker that
op-specific tests share (random_mask)."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample, Tol, make, make_nchw, make_transposed


def conv_out_size(size: int, k: int, pad: int, stride: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def random_mask(shape, device, dtype=torch.bool, density: float = 0.5, seed: int = 0) -> torch.Tensor:
    """A mask of `shape` (N or 1, H_out, W_out) selecting about `density` of
    the positions: bool, or floating with values in {-1, -0.5, 0, 0.5, 1}
    (exact in every dtype; 0 and the negatives select nothing)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) < density
    if dtype == torch.bool:
        return keep.to(device)
    magnitude = torch.randint(1, 3, shape, generator=g).to(torch.float64) / 2
    zero_or_negative = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -magnitude)
    return torch.where(keep, magnitude, zero_or_negative).to(device=device, dtype=dtype)


# (name, (N, C_in, H, W), C_out, (kh, kw), padding, stride, dilation, groups,
#  mask (batch, dtype or "float", density), bias, layout)
_CASES = [
    ("basic", (2, 4, 7, 9), 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, (2, torch.bool, 0.5), True,
     "contiguous"),
    ("float_mask_broadcast", (3, 6, 11, 8), 4, (3, 3), (2, 2), (2, 2), (2, 2), 2,
     (1, "float", 0.6), False, "contiguous"),
    ("rect_grouped", (2, 4, 9, 10), 8, (3, 2), (1, 0), (2, 1), (1, 2), 4, (2, torch.bool, 0.4),
     True, "contiguous"),
    ("pointwise", (2, 5, 6, 5), 3, (1, 1), (0, 0), (1, 1), (1, 1), 1, (2, "float", 0.5), True,
     "contiguous"),
    ("transposed", (2, 3, 8, 6), 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, (2, torch.bool, 0.5), True,
     "transposed"),
    ("channels_last", (2, 4, 6, 7), 4, (2, 3), (0, 1), (1, 2), (1, 1), 2, (2, torch.bool, 0.7),
     True, "channels_last"),
    ("sliced_expanded_mask", (3, 4, 7, 8), 4, (3, 3), (1, 1), (1, 1), (1, 1), 1,
     (-3, torch.bool, 0.5), True, "sliced"),
    ("all_selected", (2, 3, 5, 6), 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, (2, torch.bool, 1.1),
     True, "contiguous"),
    ("none_selected", (2, 3, 5, 6), 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, (2, torch.bool, 0.0),
     True, "contiguous"),
    ("one_row", (1, 3, 1, 9), 2, (1, 3), (0, 1), (1, 2), (1, 1), 1, (1, torch.bool, 0.6), True,
     "contiguous"),
    ("empty_batch", (0, 4, 6, 6), 3, (3, 3), (1, 1), (1, 1), (1, 1), 1, (1, torch.bool, 0.5), True,
     "contiguous"),
]


def _sample(name, shape, c_out, kernel, padding, stride, dilation, groups, mask_spec, bias,
            layout, device, dtype, requires_grad, seed):
    n, c, h, w = shape
    oh = conv_out_size(h, kernel[0], padding[0], stride[0], dilation[0])
    ow = conv_out_size(w, kernel[1], padding[1], stride[1], dilation[1])
    batch, mdtype, density = mask_spec
    mdtype = dtype if mdtype == "float" else mdtype
    if batch < 0:  # a (1, H_out, W_out) mask expanded to the batch: stride 0
        mask = random_mask((1, oh, ow), device, mdtype, density, seed).expand(-batch, oh, ow)
    else:
        mask = random_mask((batch, oh, ow), device, mdtype, density, seed)
    x = make_nchw(shape, layout, device, dtype, requires_grad)
    weight = make((c_out, c // groups, *kernel), device, dtype, requires_grad)
    if layout == "transposed":  # the weight too, in its own memory order
        weight = make_transposed((c_out, c // groups, *kernel), device, dtype, requires_grad)
    b = make((c_out,), device, dtype, requires_grad) if bias else None
    return Sample((x, mask, weight, b, list(padding), list(stride), list(dilation), groups),
                  name=name)


def _samples(device, dtype, requires_grad=False):
    for seed, case in enumerate(_CASES):
        yield _sample(*case, device, dtype, requires_grad, seed)


def _compile_samples(device, dtype, requires_grad=False):
    """Three calls of one structure, differing in N, C_in, C_out, H and W."""
    for seed, (shape, c_out) in enumerate([((2, 3, 8, 9), 4), ((3, 4, 10, 7), 6),
                                           ((2, 6, 9, 12), 5)]):
        yield _sample(f"compile{shape}", shape, c_out, (3, 3), (1, 1), (1, 1), (1, 1), 1,
                      (shape[0], torch.bool, 0.5), True, "contiguous", device, dtype,
                      requires_grad, 100 + seed)


def _large_samples(device, dtype, requires_grad=False):
    """A guided-anchoring-like head, smaller: sparse and dense masks."""
    for seed, density in enumerate((0.05, 0.3, 1.1)):
        yield _sample(f"head_{density}", (2, 32, 40, 48), 32, (3, 3), (1, 1), (1, 1), (1, 1), 1,
                      (2, torch.bool, density), True, "contiguous", device, dtype,
                      requires_grad, 200 + seed)


def _errors(device):
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    x, w, b = f(2, 4, 6, 6), f(6, 4, 3, 3), f(6)
    mask = random_mask((2, 6, 6), device)
    name = r"torchops\.masked_conv2d"

    def err(args, match, **kw):
        full = list(args) + [[1, 1], [1, 1], [1, 1], 1][len(args) - 4:]
        return ErrorInput(Sample(tuple(full)), rf"{name}.*{match}", **kw)

    yield err((x[0], mask, w, b), r"'input'.*4 dimensions")
    yield err((x, mask, w[0], b), r"'weight'.*4 dimensions")
    yield err((x, mask[0], w, b), r"'mask'.*3 dimensions")
    yield err((x, random_mask((2, 5, 6), device), w, b), r"'mask'.*shape")
    yield err((x, random_mask((3, 6, 6), device), w, b), r"'mask'.*shape")
    yield err((x, mask.to(torch.int32), w, b), r"'mask'.*bool or floating")
    yield err((x.long(), mask, w.long(), b), r"'input'.*floating")
    yield err((x, mask, w.double(), b), r"'weight'.*dtype")
    yield err((x, mask, w, b.double()), r"'bias'.*dtype")
    yield err((x, mask, w, f(5)), r"'bias'.*shape")
    yield err((x, mask, f(6, 3, 3, 3), b), r"'weight'.*groups")
    yield err((x, mask, w, b, [1, 1], [1, 1], [1, 1], 3), r"'weight'.*groups")
    yield err((x, mask, f(3, 2, 3, 3), f(3), [1, 1], [1, 1], [1, 1], 2), r"'groups'.*divide")
    yield err((x, mask, w, b, [1, 1], [1, 1], [1, 1], 0), r"'groups'.*positive")
    yield err((x, mask, w, b, [-1, 1]), r"'padding'.*non-negative")
    yield err((x, mask, w, b, [1, 1], [0, 1]), r"'stride'.*positive")
    yield err((x, mask, w, b, [1, 1], [1, 1], [1, 0]), r"'dilation'.*positive")
    yield err((x, mask, w, b, [1, 1, 1]), r"'padding'.*2 values")
    yield err((x, mask, w, b, [2**40, 1]), r"'padding'.*int32")
    yield err((x, random_mask((2, 1, 1), device), f(6, 4, 9, 9), b, [1, 1]),
              r"'weight'.*larger than the padded 'input'")
    if device == "cuda":
        # The kernel's check says "a cuda tensor", the fake's "the same device".
        yield err((x, mask.cpu(), w, b), r"'mask'.*(cuda tensor|same device)")
        yield err((x, mask, w, b.cpu()), r"'bias'.*(cuda tensor|same device)")
    # The wrapper's own argument forms.
    for bad in ((1, 1, 1), [1]):
        yield ErrorInput(Sample((x, mask, w, b), {"padding": bad}), rf"{name}.*'padding'",
                         ValueError, via_wrapper=True)
    yield ErrorInput(Sample((x, mask, w, b), {"stride": (1, 2, 3)}), rf"{name}.*'stride'",
                     ValueError, via_wrapper=True)
    # The backward operator checks its arguments like the forward.
    backward = torch.ops.torchops._masked_conv2d_backward.default
    bname = r"torchops\._masked_conv2d_backward"
    grad = f(2, 6, 6, 6)

    def berr(g, m, match, xx=x):
        return ErrorInput(Sample((g, xx, m, w, [1, 1], [1, 1], [1, 1], 1, [True, True, True])),
                          rf"{bname}.*{match}", op=backward)

    yield berr(grad[:, :5], mask, r"'grad'.*shape")
    yield berr(grad.double(), mask, r"'grad'.*dtype")
    yield berr(grad, mask[:1, :5], r"'mask'.*shape")
    yield berr(grad, mask, r"'input'.*floating", xx=x.long())


MASKED_CONV2D = OpInfo(
    name="masked_conv2d",
    sample_inputs=_samples,
    sample_inputs_compile=_compile_samples,
    sample_inputs_large=_large_samples,
    error_inputs=_errors,
    internal_ops=("_masked_conv2d_backward",),
    autocast=True,
    # A convolution sums K = C_in / groups * kh * kw products (288 in the
    # large samples, of magnitude up to 9): rounding errors grow with that
    # sum, not with the result, which cancellation can make small.
    # float16 and bfloat16: the CPU and CUDA GEMMs round their partial sums
    # differently, and both round the product before the bias is added, so
    # outputs differ by an ulp of the pre-bias value (magnitude 1 to 4) at
    # times: 2^-10 in float16, 2^-6 in bfloat16 (seen: 0.0156 where the bias
    # cancelled the product to 0.17).
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(2e-3, 2e-3),
          torch.bfloat16: Tol(3.2e-2, 1.6e-2)},
)


MASKED_CONV_OPS: list[OpInfo] = [MASKED_CONV2D]
