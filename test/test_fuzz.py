"""Hostile-input fuzzing of the newest op families, and the regression tests
of the faults it found.

The sweep (test_fuzz_sweep) draws, per op family, a bounded number of
seeded random calls of ``torch.ops.torchops.<op>``: plausible shapes with
odd layouts (channels-last, transposed, strided slices), zero-size
dimensions, hyper-parameters that are zero, negative or huge, inf and nan
values, and every floating dtype.  Each call must either

* raise RuntimeError or ValueError naming the op (``torchops.<op>``), with
  the fake (under FakeTensorMode) raising too -- except for what a fake
  cannot know (an allocation that fails); or
* return what the fake returns (shape, dtype, strides) with the values of
  the float64 reference of torchops/references.py, non-finite positions
  included.

The size is ``--fuzz-count N`` calls per family and device (default 24,
well under a minute on two cores for the file).  A failure prints the case
and a command that replays it alone:

    python test/test_fuzz.py <family> <case seed> <device>
"""

from __future__ import annotations

import math
import random
import re
import sys
import zlib
from dataclasses import dataclass, field

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchops import modules, references
from torchops import ops as ops_module

OPS = torch.ops.torchops
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


# --- generating inputs ------------------------------------------------------------


def _layout_tensor(rng: random.Random, shape, dtype, device, layout: str) -> torch.Tensor:
    """A tensor of `shape` whose strides follow `layout`; values set later."""
    if layout == "channels_last" and len(shape) == 4:
        return torch.empty(shape, dtype=dtype, device=device).contiguous(
            memory_format=torch.channels_last)
    if layout == "transposed" and len(shape) >= 2:
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return torch.empty(swapped, dtype=dtype, device=device).transpose(-1, -2)
    if layout == "strided" and len(shape) >= 1:
        big = (*shape[:-1], shape[-1] * 2)
        return torch.empty(big, dtype=dtype, device=device)[..., ::2]
    return torch.empty(shape, dtype=dtype, device=device)


def make(rng: random.Random, shape, dtype, device, *, layouts=True, nonfinite=0.0,
         scale=1.0, low=None, high=None) -> torch.Tensor:
    """Random values (normal times `scale`, or uniform in [low, high]) in a
    random layout; with probability `nonfinite` a few entries become inf,
    -inf or nan."""
    layout = rng.choice(("contiguous", "contiguous", "channels_last", "transposed", "strided")) \
        if layouts else "contiguous"
    t = _layout_tensor(rng, tuple(shape), dtype, device, layout)
    if t.numel() == 0:
        return t
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    if low is not None:
        v = torch.rand(t.shape, generator=g, dtype=torch.float64) * (high - low) + low
    else:
        v = torch.randn(t.shape, generator=g, dtype=torch.float64) * scale
    if rng.random() < nonfinite:
        flat = v.view(-1)
        for _ in range(rng.randint(1, 3)):
            flat[rng.randrange(flat.numel())] = rng.choice((math.inf, -math.inf, math.nan))
    t.copy_(v)
    return t


def _size(rng: random.Random, lo: int = 1, hi: int = 5, zero: float = 0.08) -> int:
    return 0 if rng.random() < zero else rng.randint(lo, hi)


def _hyper(rng: random.Random, good: int, *, low: int, past_int32: bool = True) -> int:
    """Usually `good`; sometimes zero, negative, just past int32 (where the
    op bounds the argument there) or huge (an output too large to allocate)."""
    if rng.random() < 0.9:
        return good
    return rng.choice((0, low - 1, -1, 2**62, 2**63 - 1) + ((2**31,) if past_int32 else ()))


@dataclass
class Case:
    family: str
    op: str  # torch.ops.torchops.<op>.default
    args: list
    kwargs: dict = field(default_factory=dict)
    # Tolerance of float32 relative to the largest finite reference value.
    tol32: float = 1e-4


def _roi_rows(rng, k, n, h, w, dtype, device, nonfinite: bool) -> torch.Tensor:
    rows = []
    for _ in range(k):
        b = rng.randrange(n) if n > 0 else 0
        x1, x2 = sorted(rng.uniform(-0.5 * w - 1, 1.5 * w + 1) for _ in range(2))
        y1, y2 = sorted(rng.uniform(-0.5 * h - 1, 1.5 * h + 1) for _ in range(2))
        if rng.random() < 0.15:  # a reversed box
            x1, x2 = x2, x1
        if rng.random() < 0.15:  # corners on pixels: samples on integer coordinates
            x1, y1, x2, y2 = (float(round(v)) for v in (x1, y1, x2, y2))
        rows.append([float(b), x1, y1, x2, y2])
    t = torch.tensor(rows, dtype=torch.float64).reshape(k, 5)
    if nonfinite and k > 0:
        t[rng.randrange(k), rng.randint(1, 4)] = rng.choice((math.inf, -math.inf, math.nan))
    return t.to(dtype=dtype, device=device)


def gen_roi_align(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    n, c, h, w = rng.randint(1, 2), _size(rng, 1, 3), _size(rng, 1, 7), _size(rng, 1, 7)
    x = make(rng, (n, c, h, w), dtype, device, nonfinite=0.5)
    sr = rng.choice((1, 2, 3, -1, 0)) if rng.random() > 0.05 else rng.choice((65, 2**31))
    rois = _roi_rows(rng, _size(rng, 1, 4), n, h, w, dtype, device,
                     nonfinite=sr > 0 and rng.random() < 0.2)
    ph = _hyper(rng, rng.randint(1, 3), low=1, past_int32=False)
    pw = _hyper(rng, rng.randint(1, 3), low=1, past_int32=False)
    scale = rng.choice((1.0, 0.5))  # boxes within the adaptive grid's cap
    return Case("roi_align", "roi_align", [x, rois, scale, ph, pw, sr, rng.random() < 0.5])


def gen_deform_roi_pool(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    n, c, h, w = rng.randint(1, 2), _size(rng, 1, 3), _size(rng, 1, 7), _size(rng, 1, 7)
    x = make(rng, (n, c, h, w), dtype, device, nonfinite=0.5)
    sr = rng.choice((1, 2, -1, 0)) if rng.random() > 0.05 else rng.choice((65, 2**31))
    k = _size(rng, 1, 3)
    rois = _roi_rows(rng, k, n, h, w, dtype, device, nonfinite=sr > 0 and rng.random() < 0.2)
    ph = _hyper(rng, rng.randint(1, 3), low=1, past_int32=False)
    pw = _hyper(rng, rng.randint(1, 3), low=1, past_int32=False)
    offset = None
    if rng.random() < 0.6 and ph < 64 and pw < 64 and ph > 0 and pw > 0:
        offset = make(rng, (k, 2, ph, pw), dtype, device, scale=0.3,
                      nonfinite=0.2 if sr > 0 else 0.0)
        if rng.random() < 0.3 and offset.numel() > 0:
            # A bin moved by a whole pixel fraction: samples on pixels.
            offset = offset.detach().clone()
            offset.zero_()
        offset.requires_grad_(rng.random() < 0.5)  # the forward that keeps slopes
    return Case("deform_roi_pool", "deform_roi_pool",
                [x, rois, offset, rng.choice((1.0, 0.5)), ph, pw, sr,
                 rng.choice((0.1, 1.0, 0.0))])


def gen_deform_conv2d(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    og = rng.choice((1, 1, 2))
    groups = rng.choice((1, 1, 2))
    cin = _size(rng, 1, 2) * og * groups
    cout = rng.randint(1, 2) * groups
    kh, kw = rng.randint(1, 3), rng.randint(1, 3)
    n, h, w = _size(rng, 1, 2), rng.randint(1, 6), rng.randint(1, 6)
    sh, sw = _hyper(rng, rng.randint(1, 2), low=1), _hyper(rng, rng.randint(1, 2), low=1)
    ph, pw = _hyper(rng, rng.randint(0, 1), low=0), _hyper(rng, rng.randint(0, 1), low=0)
    dh, dw = _hyper(rng, rng.randint(1, 2), low=1), _hyper(rng, rng.randint(1, 2), low=1)
    g_arg = _hyper(rng, groups, low=1)
    og_arg = _hyper(rng, og, low=1)

    def out(size, pad, dil, k, stride):
        if stride <= 0 or abs(pad) > 64 or abs(dil) > 64 or abs(stride) > 64:
            return 1
        return max((size + 2 * pad - (dil * (k - 1) + 1)) // stride + 1, 1)

    oh, ow = out(h, ph, dh, kh, sh), out(w, pw, dw, kw, sw)
    x = make(rng, (n, cin, h, w), dtype, device, nonfinite=0.3)
    weight = make(rng, (cout, cin // groups, kh, kw), dtype, device, nonfinite=0.1)
    offset = make(rng, (n, 2 * og * kh * kw, oh, ow), dtype, device, scale=1.5, nonfinite=0.2)
    if rng.random() < 0.3:
        offset = offset.round()  # samples on pixels
    use_mask = rng.random() < 0.7
    mask = make(rng, (n, og * kh * kw, oh, ow), dtype, device, nonfinite=0.4) if use_mask \
        else torch.empty((n, 1), dtype=dtype, device=device)
    bias = make(rng, (cout,), dtype, device)
    return Case("deform_conv2d", "deform_conv2d",
                [x, weight, offset, mask, bias, sh, sw, ph, pw, dh, dw, g_arg, og_arg,
                 use_mask], tol32=1e-3)


def gen_masked_conv2d(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    groups = rng.choice((1, 1, 2))
    cin, cout = _size(rng, 1, 2) * groups, rng.randint(1, 2) * groups
    kh, kw = rng.randint(1, 3), rng.randint(1, 3)
    n, h, w = _size(rng, 1, 2), _size(rng, 1, 6), _size(rng, 1, 6)
    pad = [_hyper(rng, rng.randint(0, 2), low=0) for _ in range(2)]
    stride = [_hyper(rng, rng.randint(1, 2), low=1) for _ in range(2)]
    dil = [_hyper(rng, rng.randint(1, 3), low=1) for _ in range(2)]
    g_arg = _hyper(rng, groups, low=1)

    def out(size, p, d, k, s):
        if s <= 0 or abs(p) > 64 or abs(d) > 64 or abs(s) > 64:
            return 1
        return max((size + 2 * p - (d * (k - 1) + 1)) // s + 1, 1)

    oh, ow = out(h, pad[0], dil[0], kh, stride[0]), out(w, pad[1], dil[1], kw, stride[1])
    x = make(rng, (n, cin, h, w), dtype, device, nonfinite=0.3)
    weight = make(rng, (cout, cin // groups, kh, kw), dtype, device)
    bias = make(rng, (cout,), dtype, device) if rng.random() < 0.6 else None
    mdtype = rng.choice((torch.bool, dtype, torch.float32))
    density = rng.choice((0.0, 0.1, 0.5, 1.0))
    m = make(rng, (rng.choice((1, n)) if n else 1, oh, ow), torch.float32, device,
             low=-density, high=1 - density, nonfinite=0.2)
    mask = (m > 0) if mdtype == torch.bool else m.to(mdtype)
    return Case("masked_conv2d", "masked_conv2d",
                [x, mask, weight, bias, pad, stride, dil, g_arg], tol32=1e-3)


def gen_carafe(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    k = rng.choice((1, 3, 5))
    g = rng.choice((1, 1, 2))
    s = rng.choice((1, 2, 3))
    n, c, h, w = _size(rng, 1, 2), _size(rng, 1, 2) * g, _size(rng, 1, 5), _size(rng, 1, 5)
    k_arg = k if rng.random() > 0.1 else rng.choice((0, 2, -1, 2**31 + 1))
    g_arg = _hyper(rng, g, low=1)
    s_arg = _hyper(rng, s, low=1)
    f = make(rng, (n, c, h, w), dtype, device, nonfinite=0.3)
    masks = make(rng, (n, g * k * k, h * s, w * s), dtype, device, low=0.0, high=1.0,
                 nonfinite=0.4)
    return Case("carafe", "carafe", [f, masks, k_arg, g_arg, s_arg])


FAMILIES = {
    "roi_align": gen_roi_align,
    "deform_roi_pool": gen_deform_roi_pool,
    "deform_conv2d": gen_deform_conv2d,
    "masked_conv2d": gen_masked_conv2d,
    "carafe": gen_carafe,
}


# softmax
def _softmax_scale(rng: random.Random) -> float:
    return rng.choice((1.0, 0.125, -2.0, 0.0))


def gen_scaled_masked_softmax(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    b, h, sq, sk = _size(rng, 1, 3), _size(rng, 1, 3), _size(rng, 1, 5), _size(rng, 1, 40)
    x = make(rng, (b, h, sq, sk), dtype, device, nonfinite=0.3, scale=rng.choice((1.0, 30.0)))
    shape = [rng.choice((1, b)), 1, sq, sk]
    if rng.random() < 0.1:  # a wrong mask shape
        shape[rng.randrange(4)] += rng.choice((1, 2))
    density = rng.choice((0.0, 0.3, 0.9, 1.0))
    mask = make(rng, shape, torch.float32, device, low=0.0, high=1.0) < density
    if rng.random() < 0.05:
        mask = mask.to(dtype)
    return Case("scaled_masked_softmax", "scaled_masked_softmax", [x, mask, _softmax_scale(rng)])


def gen_scaled_upper_triang_masked_softmax(rng: random.Random, device: str) -> Case:
    dtype = rng.choice(DTYPES)
    s = _size(rng, 1, 40)
    pre = (_size(rng, 1, 3),) + ((_size(rng, 1, 3),) if rng.random() < 0.6 else ())
    shape = (*pre, s, s if rng.random() < 0.9 else s + 1)
    x = make(rng, shape, dtype, device, nonfinite=0.3, scale=rng.choice((1.0, 30.0)))
    return Case("scaled_upper_triang_masked_softmax", "scaled_upper_triang_masked_softmax",
                [x, _softmax_scale(rng)])


FAMILIES["scaled_masked_softmax"] = gen_scaled_masked_softmax
FAMILIES["scaled_upper_triang_masked_softmax"] = gen_scaled_upper_triang_masked_softmax


# detection: multi-scale deformable attention
def gen_ms_deform_attn(rng: random.Random, device: str) -> Case:
    """Consistent levels (some empty), any channel count (the CUDA packs and
    their fallback), locations inside, outside, huge or non-finite, and
    non-finite values and weights."""
    dtype = rng.choice(DTYPES)
    levels = [(_size(rng, 1, 6), _size(rng, 1, 6)) for _ in range(rng.randint(0, 3))]
    b, q = _size(rng, 1, 2), _size(rng, 1, 5)
    heads, c, points = rng.randint(1, 3), rng.choice((1, 3, 4, 8, 16, 36)), rng.randint(1, 3)
    areas = [h * w for h, w in levels]
    starts = [sum(areas[:i]) for i in range(len(levels))]
    value = make(rng, (b, sum(areas), heads, c), dtype, device, nonfinite=0.2)
    far = rng.random() < 0.2
    loc = make(rng, (b, q, heads, len(levels), points, 2), dtype, device, nonfinite=0.2,
               **(dict(scale=1e6) if far else dict(low=-0.3, high=1.3)))
    attn = make(rng, (b, q, heads, len(levels), points), dtype, device, nonfinite=0.1,
                low=0.0, high=1.0)
    shapes = torch.tensor(levels, dtype=torch.int64).reshape(-1, 2).to(device)
    return Case("ms_deform_attn", "ms_deform_attn",
                [value, shapes, torch.tensor(starts, dtype=torch.int64, device=device), loc,
                 attn])


FAMILIES["ms_deform_attn"] = gen_ms_deform_attn

# --- checking one call ------------------------------------------------------------


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return (f"Tensor(shape={tuple(v.shape)}, dtype={v.dtype}, stride={v.stride()}, "
                f"device={v.device}, nonfinite={int((~torch.isfinite(v)).sum()) if v.is_floating_point() else 0})")
    return repr(v)


def describe(case: Case) -> str:
    return f"torch.ops.torchops.{case.op}(" + ", ".join(_describe(a) for a in case.args) + ")"


def _as(v, dtype: torch.dtype):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().to(dtype)
    return v


def _f64(v):
    return _as(v, torch.float64)


def _tolerance(case: Case, dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: case.tol32}.get(dtype, 3e-2)


def _accepted_without_fake(msg: str) -> bool:
    """Errors a fake cannot foresee: the allocation of a valid shape failing."""
    return "out of memory" in msg or "cannot allocate" in msg


def check_case(case: Case) -> None:
    # The op, or an internal op it calls (torchops._deform_roi_pool_forward).
    name = re.compile(rf"torchops\._?{case.op}\b|torchops\._{case.op}_\w+")
    overload = getattr(OPS, case.op).default
    fake_exc = fake_out = None
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args]
        try:
            fake_out = overload(*fargs)
        except Exception as e:  # noqa: BLE001 -- compared with the kernel's below
            fake_exc = e
    try:
        out = overload(*case.args)
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        assert name.search(msg), f"the error does not name torchops.{case.op}: " \
            f"{type(e).__name__}: {msg}"
        assert fake_exc is not None or _accepted_without_fake(msg), \
            f"the kernel raised but the fake returned {fake_out}: {msg}"
        return
    assert fake_exc is None, f"the fake raised but the kernel returned: {fake_exc}"
    assert out.shape == fake_out.shape and out.dtype == fake_out.dtype, \
        f"kernel {tuple(out.shape)} {out.dtype} vs fake {tuple(fake_out.shape)} {fake_out.dtype}"
    if out.numel() > 0:
        for d in range(out.dim()):
            assert out.shape[d] <= 1 or out.stride(d) == fake_out.stride(d), \
                f"strides: kernel {out.stride()} vs fake {fake_out.stride()}"
    reference = getattr(references, case.op)
    ref = reference(*[_f64(a) for a in case.args]).detach()
    got = out.detach().to(torch.float64)
    assert got.shape == ref.shape
    tol = _tolerance(case, out.dtype)
    finite = ref[torch.isfinite(ref)]
    atol = tol * max(finite.abs().max().item() if finite.numel() else 1.0, 1.0)
    ok = _agrees(got, ref, tol, atol)
    if out.dtype != torch.float64 and not ok.all():
        # A sample exactly on a pixel or on the border gives a tap of weight
        # 0, or none, by a rounding: which way it falls (whether an inf
        # reaches the output, whether a border pixel counts) is the
        # arithmetic's precision.  There the same formula in float32, the
        # kernels' compute type, is as right as the float64 one.
        ref32 = reference(*[_as(a, torch.float32) for a in case.args]).detach().double()
        ok |= _agrees(got, ref32, tol, atol)
    bad = (~ok).nonzero()[:5].tolist()
    assert ok.all(), (f"{int((~ok).sum())} of {ok.numel()} outputs differ from the reference, "
                      f"e.g. at {bad}: kernel {[got[tuple(i)].item() for i in bad]} vs reference "
                      f"{[ref[tuple(i)].item() for i in bad]}")


def _agrees(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Elementwise: NaN where the reference has NaN, the same inf where it has
    inf, and within atol + rtol * |ref| elsewhere."""
    both_nan = torch.isnan(got) & torch.isnan(ref)
    same_inf = torch.isinf(ref) & (got == ref)
    near = (torch.isfinite(got) & torch.isfinite(ref)
            & ((got - ref).abs() <= atol + rtol * ref.abs()))
    return both_nan | same_inf | near


def case_seed(family: str, base: int, i: int) -> int:
    return zlib.crc32(f"{family}:{base}:{i}".encode())


def run_case(family: str, seed: int, device: str) -> Case:
    case = FAMILIES[family](random.Random(seed), device)
    check_case(case)
    return case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_sweep(family, device, request):
    count = request.config.getoption("--fuzz-count")
    base = request.config.getoption("--fuzz-seed")
    for i in range(count):
        seed = case_seed(family, base, i)
        case = None
        try:
            case = FAMILIES[family](random.Random(seed), device)
            check_case(case)
        except Exception as e:
            what = describe(case) if case is not None else "(generating the case)"
            pytest.fail(f"fuzz case {i} of {family} on {device} failed: {type(e).__name__}: {e}\n"
                        f"  call: {what}\n"
                        f"  replay: python test/test_fuzz.py {family} {seed} {device}",
                        pytrace=False)


def test_fuzz_cases_are_reproducible():
    """The same seed draws the same call: the replay command reproduces a failure."""
    for family, gen in FAMILIES.items():
        a, b = gen(random.Random(7), "cpu"), gen(random.Random(7), "cpu")
        for x, y in zip(a.args, b.args):
            if isinstance(x, torch.Tensor):
                assert x.stride() == y.stride() and torch.equal(x.nan_to_num(), y.nan_to_num())
            else:
                assert x == y or (x != x and y != y)


# --- regressions: hyper-parameters bounded like masked_conv2d's ---------------------


def _deform_args(**over):
    x = torch.randn(1, 1, 3, 3)
    a = dict(input=x, weight=torch.randn(1, 1, 3, 3), offset=torch.zeros(1, 18, 1, 1),
             mask=torch.ones(1, 9, 1, 1), bias=torch.zeros(1), stride_h=1, stride_w=1,
             pad_h=0, pad_w=0, dilation_h=1, dilation_w=1, groups=1, offset_groups=1,
             use_mask=True)
    a.update(over)
    return list(a.values())


@pytest.mark.parametrize("arg", ["stride_h", "stride_w", "pad_h", "pad_w", "dilation_h",
                                 "dilation_w"])
@pytest.mark.parametrize("value", [2**31, 2**62, 2**63 - 1])
def test_deform_conv2d_bounds_its_hyper_parameters(arg, value):
    """Values past int32 overflowed the output-size arithmetic (dilation
    2**63 - 1 returned a tensor); kernel and fake now reject them alike."""
    args = _deform_args(**{arg: value})
    want = f"torchops.deform_conv2d: expected '{arg}' to be at most {2**31 - 1}"
    with pytest.raises(RuntimeError, match=want):
        OPS.deform_conv2d(*args)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=want):
        OPS.deform_conv2d(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                            for a in args])


def test_deform_conv2d_rejects_a_kernel_wider_than_the_input_at_any_stride():
    """Width 2, kernel 3, stride 2: (2 - 3) / 2 + 1 truncated to one output
    column in C++ while the fake (floor division) rejected the call."""
    x = torch.randn(1, 1, 3, 2)
    args = [x, torch.randn(1, 1, 3, 3), torch.zeros(1, 18, 1, 1), torch.ones(1, 9, 1, 1),
            torch.zeros(1), 1, 2, 0, 0, 1, 1, 1, 1, True]
    with pytest.raises(RuntimeError, match="torchops.deform_conv2d: 'input' .*too small"):
        OPS.deform_conv2d(*args)


def test_conv_argument_bound_is_the_same_in_kernels_and_fakes():
    """ops.MAX_CONV_ARGUMENT mirrors kConvArgumentMax: the bound itself
    passes the check in both deform_conv2d and masked_conv2d, one more fails
    in both, kernel and fake."""
    top = ops_module.MAX_CONV_ARGUMENT
    assert top == 2**31 - 1
    ok = _deform_args(stride_h=top, stride_w=top)  # a 1 x 1 output
    assert OPS.deform_conv2d(*ok).shape == (1, 1, 1, 1)
    x, w = torch.randn(1, 1, 3, 3), torch.randn(1, 1, 3, 3)
    m = torch.ones(1, 1, 1, dtype=torch.bool)
    assert OPS.masked_conv2d(x, m, w, None, [0, 0], [top, top], [1, 1], 1).shape == (1, 1, 1, 1)
    for fn, args, name in (
            (OPS.deform_conv2d, _deform_args(stride_h=top + 1), "stride_h"),
            (OPS.masked_conv2d, [x, m, w, None, [0, 0], [top + 1, 1], [1, 1], 1], "stride")):
        for fake in (False, True):
            with pytest.raises(RuntimeError, match=f"'{name}' to be at most {top}"):
                if fake:
                    with FakeTensorMode() as mode:
                        fn(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                             for a in args])
                else:
                    fn(*args)


# --- regressions: non-finite values propagate as the formula says -------------------


def _assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.double(), want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)


ROI_WALKS = [None, "sparse", "four", "dense"]


def _walk_params():
    out = []
    for device in ("cpu", "cuda"):
        for walk in ROI_WALKS if device == "cpu" else [None]:
            marks = [pytest.mark.cuda] if device == "cuda" else []
            out.append(pytest.param(device, walk, marks=marks, id=f"{device}-{walk or 'auto'}"))
    return out


def _inf_pixel_input(device, dtype=torch.float32):
    """A 4 x 4 map of ones with +inf at (1, 1) and at the last pixel (3, 3)."""
    x = torch.ones(1, 2, 4, 4, dtype=dtype, device=device)
    x[:, :, 1, 1] = math.inf
    x[:, :, 3, 3] = math.inf
    return x


# RoIs whose samples land exactly on pixel (1, 1) (bilinear weight 0 for its
# right and lower neighbours) and past the last pixel (clamped to (3, 3)).
_ON_PIXEL_ROIS = [[0, 0.0, 0.0, 2.0, 2.0], [0, 3.0, 3.0, 5.0, 5.0], [0, 0.0, 0.0, 4.0, 4.0]]


@pytest.mark.parametrize("device,walk", _walk_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_roi_align_inf_pixel_with_positive_weight_gives_inf(device, walk, dtype, monkeypatch):
    """Interpolation reads only the taps it weighs: an inf pixel with a
    positive weight gives inf (the walks' zero-weight padding taps gave
    0 * inf = nan)."""
    if walk is not None:
        monkeypatch.setenv("TORCHOPS_TESTING_ROI_ALIGN_WALK", walk)
    x = _inf_pixel_input(device, dtype)
    rois = torch.tensor(_ON_PIXEL_ROIS, dtype=dtype, device=device)
    for sr in (1, 2):
        got = OPS.roi_align(x, rois, 1.0, 1, 1, sr, False)
        want = references.roi_align(x.double(), rois.double(), 1.0, 1, 1, sr, False)
        assert torch.isinf(want[:2]).all() and not torch.isnan(want).any()
        _assert_same_nonfinite(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("offset_grad", [False, True])
def test_deform_roi_pool_inf_pixel_with_positive_weight_gives_inf(device, offset_grad):
    x = _inf_pixel_input(device)
    # aligned boxes (-0.5 shift): corners at +0.5 put samples on pixels.
    rois = torch.tensor([[0, 0.5, 0.5, 2.5, 2.5], [0, 3.5, 3.5, 5.5, 5.5]], device=device)
    for offset in (None, torch.zeros(2, 2, 1, 1, device=device)):
        if offset is not None:
            offset.requires_grad_(offset_grad)
        got = OPS.deform_roi_pool(x, rois, offset, 1.0, 1, 1, 1, 0.1)
        want = references.deform_roi_pool(x.double(), rois.double(),
                                          None if offset is None else offset.double(),
                                          1.0, 1, 1, 1, 0.1)
        assert torch.isinf(want).all()
        _assert_same_nonfinite(got.detach(), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deform_conv2d_inf_mask_gives_inf(device, dtype):
    """The mask multiplies the interpolated sample (torchvision): inf times
    a positive sample is inf, not the nan of 0 * inf on an unread corner."""
    x = torch.rand(1, 2, 4, 4, dtype=dtype, device=device) + 0.5
    weight = torch.rand(3, 2, 3, 3, dtype=dtype, device=device) + 0.5
    offset = torch.zeros(1, 18, 2, 2, dtype=dtype, device=device)
    offset[:, 1::2] = 0.25  # x off the pixels, y on them: corners of weight 0
    mask = torch.ones(1, 9, 2, 2, dtype=dtype, device=device)
    mask[0, 4, 1, 0] = math.inf
    bias = torch.zeros(3, dtype=dtype, device=device)
    args = [1, 1, 0, 0, 1, 1, 1, 1, True]
    got = OPS.deform_conv2d(x, weight, offset, mask, bias, *args)
    want = references.deform_conv2d(x.double(), weight.double(), offset.double(),
                                    mask.double(), bias.double(), *args)
    assert torch.isinf(want[0, :, 1, 0]).all() and torch.isfinite(want.sum((0, 1))[0]).all()
    _assert_same_nonfinite(got, want)


def _carafe_paths():
    out = [pytest.param("cpu", None, id="cpu")]
    for path in (None, "tiled", "generic"):
        out.append(pytest.param("cuda", path, marks=pytest.mark.cuda, id=f"cuda-{path or 'auto'}"))
    return out


@pytest.mark.parametrize("device,path", _carafe_paths())
@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("k,s", [(3, 1), (5, 2)])
def test_carafe_skips_taps_outside_the_map(device, path, bad, k, s, monkeypatch):
    """A mask weight on a tap outside the feature map is skipped (mmcv), so
    an inf or nan there does not poison the output."""
    if path is not None:
        monkeypatch.setenv("TORCHOPS_TESTING_CARAFE_PATH", path)
    f = torch.rand(1, 2, 3, 4, device=device) + 0.5
    masks = torch.rand(1, k * k, 3 * s, 4 * s, device=device)
    masks[0, 0, 0, 0] = bad  # tap (0, 0) of output (0, 0) reads source (-r, -r)
    masks[0, k * k - 1, -1, -1] = bad  # the last tap of the last output, past the map
    got = OPS.carafe(f, masks, k, 1, s)
    want = references.carafe(f.double(), masks.double(), k, 1, s)
    assert torch.isfinite(want).all()
    _assert_same_nonfinite(got, want)


# --- regressions: module constructors validate ------------------------------------

_BAD_MODULES = [
    (modules.DeformConv2d, (2, 3, 3), dict(groups=0), "groups"),
    (modules.DeformConv2d, (2, 3, 3), dict(groups=-1), "groups"),
    (modules.DeformConv2d, (2, 3, 0), {}, "kernel_size"),
    (modules.DeformConv2d, (2, 3, 3), dict(stride=0), "stride"),
    (modules.DeformConv2d, (2, 3, 3), dict(padding=-1), "padding"),
    (modules.DeformConv2d, (2, 3, 3), dict(dilation=(1, 0)), "dilation"),
    (modules.DeformConv2d, (2, 3, 3), dict(dilation=2**31), "dilation"),
    (modules.DeformConv2d, (-2, 3, 3), {}, "in_channels"),
    (modules.DeformConv2d, (3, 4, 3), dict(groups=2), "groups"),
    (modules.ModulatedDeformConv2dPack, (2, 2, 3), dict(deform_groups=0), "deform_groups"),
    (modules.ModulatedDeformConv2dPack, (2, 2, 3), dict(deform_groups=4), "deform_groups"),
    (modules.ModulatedDeformConv2dPack, (2, 2, 3), dict(groups=0), "groups"),
    (modules.MaskedConv2d, (2, 2, 3), dict(stride=0), "stride"),
    (modules.MaskedConv2d, (2, 2, 3), dict(padding=-1), "padding"),
    (modules.MaskedConv2d, (2, 2, 3), dict(dilation=0), "dilation"),
    (modules.RoIAlign, (0, 1.0, 2), {}, "output_size"),
    (modules.RoIAlign, ((7, -1), 1.0, 2), {}, "output_size"),
    (modules.RoIAlign, (7, math.nan, 2), {}, "spatial_scale"),
    (modules.RoIAlign, (7, 1.0, 65), {}, "sampling_ratio"),
    (modules.RoIPool, (0, 1.0), {}, "output_size"),
    (modules.DeformRoIPool, ((2, 0),), {}, "output_size"),
    (modules.DeformRoIPool, (2,), dict(sampling_ratio=100), "sampling_ratio"),
    (modules.DeformRoIPool, (2,), dict(gamma=math.inf), "gamma"),
    (modules.DeformRoIPoolPack, (2, 0), {}, "output_channels"),
    (modules.DeformRoIPoolPack, (2, 4), dict(deform_fc_channels=0), "deform_fc_channels"),
    (modules.ModulatedDeformRoIPoolPack, (2, -4), {}, "output_channels"),
    (modules.CARAFEPack, (4, 0), {}, "scale_factor"),
    (modules.CARAFEPack, (0, 2), {}, "channels"),
    (modules.CARAFEPack, (4, 2), dict(up_kernel=4), "up_kernel"),
    (modules.CARAFEPack, (4, 2), dict(up_group=3), "up_group"),
    (modules.CARAFEPack, (4, 2), dict(encoder_kernel=0), "encoder_kernel"),
    (modules.CARAFEPack, (4, 2), dict(encoder_dilation=0), "encoder_dilation"),
    (modules.CARAFEPack, (4, 2), dict(compressed_channels=0), "compressed_channels"),
]


@pytest.mark.parametrize("cls,args,kwargs,arg", _BAD_MODULES,
                         ids=[f"{c.__name__}-{a}-{i}" for i, (c, _, _, a) in
                              enumerate(_BAD_MODULES)])
def test_module_constructors_reject_bad_hyper_parameters(cls, args, kwargs, arg):
    with pytest.raises(ValueError, match=f"torchops.{cls.__name__}: .*'{arg}'"):
        cls(*args, **kwargs)


def test_module_constructors_accept_their_defaults():
    modules.DeformConv2d(2, 4, (3, 1), stride=(1, 2), padding=(0, 1), dilation=2, groups=2)
    modules.ModulatedDeformConv2dPack(4, 4, 3, deform_groups=2, groups=2)
    modules.MaskedConv2d(2, 2, 3, padding="same")
    modules.MaskedConv2d(2, 2, 3, padding=1)
    modules.RoIAlign((7, 7), 0.25, -1, aligned=True)
    modules.RoIPool(7, 1 / 16)
    modules.DeformRoIPool(7)
    modules.DeformRoIPoolPack(2, 4, deform_fc_channels=8)
    modules.ModulatedDeformRoIPoolPack(2, 4, deform_fc_channels=8)
    modules.CARAFEPack(4, 2, up_group=2, compressed_channels=8)


# --- regressions: run.sh reuses an up-to-date editable build ------------------------


def test_stale_prebuilt_tells_current_from_changed_sources(tmp_path):
    """run.sh skips `pip install -e` when the libraries in the package match
    the sources (stale_prebuilt is None), and reinstalls otherwise."""
    import json
    from pathlib import Path

    from torchops import _build

    csrc = Path(_build.find_csrc())
    pkg = tmp_path / "torchops"
    pkg.mkdir()
    assert "0 libraries" in _build.stale_prebuilt(pkg, csrc)
    lib = _build.CPU
    so = pkg / f"_{lib.name}.abi3.so"
    so.write_bytes(b"\0")
    manifest = lib.manifest(csrc, built_by="aot", library_file=so)
    _build.Library.manifest_path(so).write_text(json.dumps(manifest))
    cuda_builds = _build.CUDA.unavailable_reason() is None and _build.nvcc_path() is not None
    if not cuda_builds:
        assert _build.stale_prebuilt(pkg, csrc) is None
    manifest["sources_hash"] = "0" * 64
    _build.Library.manifest_path(so).write_text(json.dumps(manifest))
    assert "changed" in _build.stale_prebuilt(pkg, csrc)
    manifest = lib.manifest(csrc, built_by="aot", library_file=so)
    manifest["flags"] = ["-O0"]
    _build.Library.manifest_path(so).write_text(json.dumps(manifest))
    assert "flags" in _build.stale_prebuilt(pkg, csrc)


# --- replay --------------------------------------------------------------------------

if __name__ == "__main__":
    family, seed, device = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cpu"
    case = FAMILIES[family](random.Random(seed), device)
    print(describe(case))
    check_case(case)
    print("passed")
