"""Entries of the RoI pooling ops: roi_align, roi_pool; and the RoI sample
maker that op-specific tests share (random_rois)."""

from __future__ import annotations

import math

import torch

import torchops
from torchops import references

from .core import ErrorInput, OpInfo, Sample, Tol, make, make_nchw


def _pool_bins_agree(size: int, pooled: int) -> bool:
    """roi_pool's bin edges floor(p * size / pooled), ceil((p + 1) * size /
    pooled) come out the same in float32 and float64 arithmetic (they
    differ for ~0.2% of (size, pooled, p), and the kernels compute in the
    input's precision, like torchvision's, while the reference uses float64)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  (float32 rounding)
    b32, b64 = f32(size) / f32(pooled), float(size) / pooled
    return all(math.floor((f32(p) * b32).item()) == math.floor(p * b64)
               and math.ceil((f32(p + 1) * b32).item()) == math.ceil((p + 1) * b64)
               for p in range(pooled))


def random_rois(n_images: int, k: int, height: int, width: int, scale: float, dtype, device,
                seed: int, pooled: tuple[int, int] = (7, 7), spread: float = 0.3) -> torch.Tensor:
    """k boxes in image coordinates (feature map / scale), mostly inside the
    image, some partly outside (by `spread` of its size) and some tiny.
    Seeded: the boxes are fixed, so a sample never lands exactly on a
    rounding boundary by chance in one run and not in the next.  Boxes whose
    roi_pool bins (for `pooled`) depend on the arithmetic's precision are
    widened until they do not."""
    g = torch.Generator().manual_seed(seed)
    ih, iw = height / scale, width / scale
    x1 = torch.rand(k, generator=g, dtype=torch.float64) * iw * (1 + 2 * spread) - spread * iw
    y1 = torch.rand(k, generator=g, dtype=torch.float64) * ih * (1 + 2 * spread) - spread * ih
    bw = torch.rand(k, generator=g, dtype=torch.float64) * iw * 0.8
    bh = torch.rand(k, generator=g, dtype=torch.float64) * ih * 0.8
    tiny = torch.rand(k, generator=g) < 0.2
    bw = torch.where(tiny, bw * 0.02, bw)
    bh = torch.where(tiny, bh * 0.02, bh)
    batch = torch.randint(0, max(n_images, 1), (k,), generator=g).to(torch.float64)
    rois = torch.stack([batch, x1, y1, x1 + bw, y1 + bh], dim=1).to(dtype).to(torch.float64)
    for row in rois:
        for lo, hi, p in ((1, 3, pooled[1]), (2, 4, pooled[0])):
            def size():
                a, b = (references.round_half_away(float(v) * scale) for v in (row[lo], row[hi]))
                return max(b - a + 1, 1)
            while not _pool_bins_agree(size(), p):
                row[hi] = torch.tensor(float(row[hi]) + 1 / scale).to(dtype).double()
    return rois.to(dtype=dtype, device=device)


# (name, (N, C, H, W), K, spatial_scale, pooled (ph, pw), layout)
_ROI_CASES = [
    ("basic", (2, 3, 10, 12), 6, 1.0, (3, 2), "contiguous"),
    ("scaled", (1, 2, 9, 7), 5, 0.5, (2, 3), "contiguous"),
    ("one_bin", (1, 1, 5, 6), 3, 1.0, (1, 1), "contiguous"),
    ("odd", (3, 5, 7, 11), 7, 0.25, (4, 5), "contiguous"),
    ("channels_last", (2, 4, 8, 9), 5, 1.0, (3, 3), "channels_last"),
    ("sliced", (2, 3, 9, 8), 4, 1.0, (2, 2), "sliced"),
    ("no_rois", (2, 3, 6, 6), 0, 1.0, (2, 2), "contiguous"),
    ("no_channels", (1, 0, 6, 6), 3, 1.0, (2, 2), "contiguous"),
    ("one_pixel", (1, 2, 1, 1), 3, 1.0, (2, 2), "contiguous"),
    ("no_rows", (1, 2, 0, 5), 2, 1.0, (2, 2), "contiguous"),
]


def _roi_samples(device, dtype, requires_grad, extra):
    for seed, (name, shape, k, scale, (ph, pw), layout) in enumerate(_ROI_CASES):
        rois = random_rois(shape[0], k, shape[2], shape[3], scale, dtype, device, seed,
                            (ph, pw))
        x = make_nchw(shape, layout, device, dtype, requires_grad)
        for tag, rest in extra(name):
            yield Sample((x, rois, scale, ph, pw, *rest), name=f"{name}{tag}")


def _roi_compile_samples(extra):
    """Three calls differing only in sizes (N, C, H, W and K), for the
    compile and export tests."""
    def samples(device, dtype, requires_grad=False):
        for seed, (shape, k) in enumerate([((2, 3, 10, 12), 6), ((3, 4, 13, 9), 5),
                                            ((2, 5, 8, 15), 9)]):
            x = make(shape, device, dtype, requires_grad)
            rois = random_rois(shape[0], k, shape[2], shape[3], 1.0, dtype, device, 100 + seed,
                                (3, 2))
            yield Sample((x, rois, 1.0, 3, 2, *extra), name=f"compile{shape}x{k}")
    return samples


def _roi_large_samples(*extras):
    """Detection-like sizes for the --full profile: many overlapping boxes."""
    def samples(device, dtype, requires_grad=False):
        for seed, extra in enumerate(extras):
            x = make((2, 32, 48, 40), device, dtype, requires_grad)
            rois = random_rois(2, 150, 48, 40, 0.25, dtype, device, 200 + seed)
            yield Sample((x, rois, 0.25, 7, 7, *extra), name=f"large{extra}")
    return samples


def _roi_align_samples(device, dtype, requires_grad=False):
    def extra(name):
        yield "", (2, False)
        if name in ("basic", "odd", "channels_last"):
            yield "_aligned_adaptive", (0, True)
        if name in ("basic", "scaled"):
            yield "_adaptive", (-1, False)
            yield "_aligned_s3", (3, True)
    yield from _roi_samples(device, dtype, requires_grad, extra)
    # Reversed and degenerate boxes (x2 < x1, zero size): aligned keeps the
    # negative size (no samples when adaptive), unaligned makes them 1x1.
    x = make((1, 2, 6, 7), device, dtype, requires_grad)
    rois = torch.tensor([[0, 4.0, 4.5, 1.0, 2.0], [0, 3.0, 3.0, 3.0, 3.0], [0, -1.0, -1.0, 7.5, 6.5]],
                        dtype=dtype, device=device)
    for sr, aligned in ((2, True), (0, True), (0, False), (2, False)):
        yield Sample((x, rois, 1.0, 2, 3, sr, aligned), name=f"reversed_s{sr}_{aligned}")
    # Adaptive sampling is capped at 2 * (size // pooled + 1) samples per
    # axis (csrc/common/roi.h): boxes covering the whole map, and boxes up to
    # twice its size, must be unaffected (the reference has no cap).
    x = make((1, 2, 9, 13), device, dtype, requires_grad)
    rois = torch.tensor([[0, 0.0, 0.0, 13.0, 9.0], [0, -1.0, -0.5, 14.5, 10.0],
                         [0, -6.0, -4.0, 19.0, 13.0], [0, 0.0, 0.0, 13.0, 1.0]],
                        dtype=dtype, device=device)
    for ph, pw in ((1, 1), (2, 3), (4, 2)):
        for aligned in (False, True):
            yield Sample((x, rois, 1.0, ph, pw, 0, aligned), name=f"whole_map_{ph}x{pw}_{aligned}")


def _roi_pool_samples(device, dtype, requires_grad=False):
    yield from _roi_samples(device, dtype, requires_grad, lambda name: [("", ())])
    x = make((1, 2, 6, 7), device, dtype, requires_grad)
    rois = torch.tensor([[0, 4.0, 4.5, 1.0, 2.0], [0, 3.0, 3.0, 3.0, 3.0], [0, -9.0, -9.0, -3.0, -2.0]],
                        dtype=dtype, device=device)
    yield Sample((x, rois, 1.0, 3, 2), name="reversed_and_outside")


def _roi_errors(op, extra_args):
    def errors(device):
        f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
        rois = torch.tensor([[0, 1.0, 1.0, 4.0, 4.0]], device=device)
        x = f(1, 2, 6, 6)
        name = rf"torchops\.{op}"
        yield ErrorInput(Sample((f(2, 6, 6), rois, 1.0, 2, 2, *extra_args)), rf"{name}.*'input'.*4")
        yield ErrorInput(Sample((x, rois[:, :4], 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*\(K, 5\)")
        yield ErrorInput(Sample((x, rois[0], 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'")
        yield ErrorInput(Sample((x, rois.double(), 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*dtype")
        yield ErrorInput(Sample((x.long(), rois.long(), 1.0, 2, 2, *extra_args)),
                         rf"{name}.*'input'.*floating")
        yield ErrorInput(Sample((x, rois, 1.0, 0, 2, *extra_args)), rf"{name}.*'pooled_height'")
        yield ErrorInput(Sample((x, rois, 1.0, 2, -1, *extra_args)), rf"{name}.*'pooled_width'")
        # Output sizes are checked before allocating, and a failed
        # allocation names the op and the shape.
        yield ErrorInput(Sample((x, rois, 1.0, 10**10, 10**10, *extra_args)),
                         rf"{name}: the output of shape .* too large")
        # roi_pool's int64 argmax of this shape overflows the byte count,
        # which its fake checks; roi_align's float output does not.
        only_allocating = "only allocating the 8e18 bytes for real fails"
        yield ErrorInput(Sample((x, rois, 1.0, 10**9, 10**9, *extra_args)),
                         rf"{name}: .*output of shape",
                         kernel_only=only_allocating if op == "roi_align" else "")
        if op == "roi_align":  # an explicit grid beyond MAX_SAMPLING_RATIO
            for sr in (65, 2**31 - 1, 2**62):
                yield ErrorInput(Sample((x, rois, 1.0, 2, 2, sr, False)),
                                 rf"{name}.*'sampling_ratio'.*at most 64")
        yield from _bad_rois_errors(
            lambda rois: Sample((x, rois, 1.0, 2, 2, *extra_args)), rois, device,
            lambda sample, match, **kw: ErrorInput(sample, rf"{name}.*{match}", **kw))
        # The torchvision-style wrapper: input, boxes, output_size.
        for boxes, size, error, what in [
                (rois[:, 1:], 2, RuntimeError, "'boxes'"),
                ([rois], 2, RuntimeError, "'boxes'"),
                ([], 2, ValueError, "'boxes'"),
                ("boxes", 2, TypeError, "'boxes'"),
                (rois, (2, 2, 2), ValueError, "'output_size'")]:
            yield ErrorInput(Sample((x, boxes, size)), rf"{name}.*{what}", error, via_wrapper=True)
        yield from _roi_backward_errors(op, device, rois)
    return errors


def _bad_rois_errors(call, rois, device, error):
    """The 'rois' the kernel alone can reject: on CPU a batch index past the
    input (a value, which a fake never reads); on CUDA, RoIs on the CPU."""
    if device == "cpu":
        bad = rois.clone()
        bad[0, 0] = 1
        yield error(call(rois=bad), "'rois'.*batch index",
                    kernel_only="the batch index is a value in 'rois', which a fake never reads")
    else:
        yield error(call(rois=rois.cpu()), "'rois'")


def _roi_backward_errors(op, device, rois):
    """Invalid calls of the internal backward op, whose fake must reject
    them too (a compiled backward is traced through it).  Its arguments:
    grad (K, C, PH, PW), rois, [argmax,] spatial_scale, PH, PW, and the
    input's N, C, H, W [, sampling_ratio, aligned]."""
    backward = getattr(torch.ops.torchops, f"_{op}_backward").default
    name = rf"torchops\._{op}_backward"
    grad = make((1, 2, 3, 3), device, torch.float32)

    def call(grad=grad, rois=rois, ph=3, pw=3, sizes=(1, 2, 6, 6), argmax=None, sr=2):
        if op == "roi_align":
            return Sample((grad, rois, 1.0, ph, pw, *sizes, sr, False))
        if argmax is None:
            argmax = torch.zeros(grad.shape, dtype=torch.int64, device=grad.device)
        return Sample((grad, rois, argmax, 1.0, ph, pw, *sizes))

    def error(sample, match, **kw):
        return ErrorInput(sample, rf"{name}.*{match}", op=backward, **kw)

    yield error(call(grad=grad.long()), "'grad'.*floating")
    yield error(call(rois=rois.double()), "'rois'.*same dtype as 'grad'")
    yield error(call(rois=rois[:, :4]), r"'rois'.*\(K, 5\)")
    yield error(call(ph=0, grad=grad[:, :, :0]), "'pooled_height'")
    yield error(call(sizes=(-1, 2, 6, 6)), "'batch_size'")
    yield error(call(grad=grad[:, :1]), "'grad'.*shape")
    yield error(call(sizes=(1, 2, 10**10, 10**10)), "the output of shape .* too large")
    if op == "roi_align":
        yield error(call(sr=65), "'sampling_ratio'.*at most 64")
    else:
        yield error(call(argmax=torch.zeros(grad.shape, dtype=torch.int32, device=device)),
                    "'argmax'.*int64")
    yield from _bad_rois_errors(call, rois, device, error)


def _roi_wrapper_sample(s: Sample) -> Sample:
    """The op's (input, rois, spatial_scale, ph, pw, *rest) as the
    torchvision-style wrapper's (input, boxes, output_size, spatial_scale, *rest)."""
    x, rois, scale, ph, pw, *rest = s.args
    return Sample((x, rois, (ph, pw), scale, *rest), dict(s.kwargs), s.name)


ROI_ALIGN = OpInfo(
    name="roi_align",
    sample_inputs=_roi_align_samples,
    sample_inputs_compile=_roi_compile_samples((2, True)),
    error_inputs=_roi_errors("roi_align", (2, False)),
    internal_ops=("_roi_align_backward",),
    autocast=True,
    wrapper_sample=_roi_wrapper_sample,
    # The CUDA backward adds with atomics (unless deterministic algorithms
    # are on), so two runs may differ in the last bits.
    gradcheck_kwargs={"nondet_tol": 1e-12},
    sample_inputs_large=_roi_large_samples((2, True), (0, False)),
    # Sample coordinates are computed in float32 for the float and half
    # types: an error of ~1 ulp of a coordinate moves the value by up to
    # (coordinate * 2^-24) * (max neighbour difference).
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(2e-3, 2e-3)},
)


ROI_POOL = OpInfo(
    name="roi_pool",
    sample_inputs=_roi_pool_samples,
    sample_inputs_compile=_roi_compile_samples(()),
    error_inputs=_roi_errors("roi_pool", ()),
    internal_ops=("_roi_pool_backward",),
    autocast=True,
    wrapper_sample=_roi_wrapper_sample,
    wrapper_outputs=lambda outs: outs[:1],  # torchvision's roi_pool returns no argmax
    gradcheck_kwargs={"nondet_tol": 1e-12},
    sample_inputs_large=_roi_large_samples(()),
)


# --- deform_roi_pool -------------------------------------------------------------------
# Op arguments: (input, rois, offset, spatial_scale, ph, pw, sampling_ratio, gamma).

def _deform_offset(k, ph, pw, device, dtype, requires_grad, transposed=False, scale=1.0):
    """Offsets in [-scale, scale]: with gamma 0.1 to 0.3 they move bins by up
    to a third of the RoI, so samples leave the RoI and the map."""
    shape = (k, 2, pw, ph) if transposed else (k, 2, ph, pw)
    t = make(shape, device, dtype, low=-scale, high=scale)
    t = t.transpose(2, 3) if transposed else t
    return t.detach().requires_grad_(requires_grad)


def _deform_roi_pool_samples(device, dtype, requires_grad=False):
    for seed, (name, shape, k, scale, (ph, pw), layout) in enumerate(_ROI_CASES):
        rois = random_rois(shape[0], k, shape[2], shape[3], scale, dtype, device, seed, (ph, pw))
        x = make_nchw(shape, layout, device, dtype, requires_grad)
        off = _deform_offset(k, ph, pw, device, dtype, requires_grad,
                             transposed=layout != "contiguous")
        yield Sample((x, rois, off, scale, ph, pw, 2, 0.1), name=name)
        if name in ("basic", "odd", "channels_last"):
            yield Sample((x, rois, off, scale, ph, pw, 0, 0.3), name=f"{name}_adaptive")
        if name in ("basic", "scaled", "no_rois"):
            yield Sample((x, rois, None, scale, ph, pw, 2, 0.1), name=f"{name}_no_offset")
        if name == "odd":
            yield Sample((x, rois, None, scale, ph, pw, -1, 0.1), name="odd_no_offset_adaptive")
    # An empty batch (and so no RoIs).
    yield Sample((make((0, 3, 6, 5), device, dtype, requires_grad),
                  torch.zeros(0, 5, device=device, dtype=dtype),
                  _deform_offset(0, 2, 2, device, dtype, requires_grad), 1.0, 2, 2, 2, 0.1),
                 name="empty_batch")
    # One offset for every RoI (stride 0); gradcheck cannot perturb such an
    # input, so only without gradients.
    if not requires_grad:
        x = make((2, 3, 9, 8), device, dtype)
        rois = random_rois(2, 4, 9, 8, 1.0, dtype, device, 50, (2, 3))
        off = make((1, 2, 2, 3), device, dtype, low=-1, high=1).expand(4, 2, 2, 3)
        yield Sample((x, rois, off, 1.0, 2, 3, 2, 0.2), name="expanded_offset")
    # Reversed and degenerate boxes (negative and zero sizes: the offset's
    # gain is negative or zero), and offsets large enough to push samples
    # off the map and onto its edges, where they clamp.
    x = make((1, 2, 6, 7), device, dtype, requires_grad)
    rois = torch.tensor([[0, 4.0, 4.5, 1.0, 2.0], [0, 3.0, 3.0, 3.0, 3.0],
                         [0, -1.0, -1.0, 7.5, 6.5]], dtype=dtype, device=device)
    for sr in (2, 0):
        off = _deform_offset(3, 2, 3, device, dtype, requires_grad, scale=4.0)
        yield Sample((x, rois, off, 1.0, 2, 3, sr, 0.5), name=f"reversed_far_s{sr}")


def _deform_roi_pool_compile_samples(device, dtype, requires_grad=False):
    for seed, (shape, k) in enumerate([((2, 3, 10, 12), 6), ((3, 4, 13, 9), 5),
                                        ((2, 5, 8, 15), 9)]):
        x = make(shape, device, dtype, requires_grad)
        rois = random_rois(shape[0], k, shape[2], shape[3], 1.0, dtype, device, 100 + seed, (3, 2))
        off = _deform_offset(k, 3, 2, device, dtype, requires_grad)
        yield Sample((x, rois, off, 1.0, 3, 2, 2, 0.1), name=f"compile{shape}x{k}")


def _deform_roi_pool_errors(device):
    f32 = dict(device=device, dtype=torch.float32)
    x = make((1, 2, 6, 6), device, torch.float32)
    rois = torch.tensor([[0, 1.0, 1.0, 4.0, 4.0]], device=device)
    off = torch.zeros(1, 2, 2, 2, **f32)
    name = r"torchops\.deform_roi_pool"

    def call(x=x, rois=rois, off=off, ph=2, pw=2, sr=2):
        return Sample((x, rois, off, 1.0, ph, pw, sr, 0.1))

    def error(sample, match, **kw):
        return ErrorInput(sample, rf"{name}.*{match}", **kw)

    yield error(call(x=make((2, 6, 6), device, torch.float32)), "'input'.*4")
    yield error(call(x=x.long(), rois=rois.long(), off=off.long()), "'input'.*floating")
    yield error(call(rois=rois[:, :4]), r"'rois'.*\(K, 5\)")
    yield error(call(rois=rois.double()), "'rois'.*dtype")
    yield error(call(ph=0, off=off[:, :, :0]), "'pooled_height'")
    yield error(call(sr=65), "'sampling_ratio'.*at most 64")
    yield error(call(off=torch.zeros(1, 2, 3, 2, **f32)), r"'offset'.*\(K, 2, pooled_height")
    yield error(call(off=torch.zeros(1, 3, 2, 2, **f32)), "'offset'.*shape")
    yield error(call(off=torch.zeros(2, 2, 2, 2, **f32)), "'offset'.*shape")
    yield error(call(off=torch.zeros(2, 2, 2, **f32)), "'offset'.*shape")
    yield error(call(off=off.double()), "'offset'.*same dtype as 'input'")
    yield error(Sample((x, rois, None, 1.0, 10**10, 10**10, 2, 0.1)), "output of shape .* too large")
    yield from _bad_rois_errors(call, rois, device, error)
    if device != "cpu":
        yield error(call(off=off.cpu()), "'offset'")
    # The wrapper: (input, rois, offset, output_size, ...).
    for boxes, size, err, what in [
            (rois[:, 1:], 2, RuntimeError, "'rois'"),
            ([rois], 2, RuntimeError, "'rois'"),
            ([], 2, ValueError, "'rois'"),
            ("rois", 2, TypeError, "'rois'"),
            (rois, (2, 2, 2), ValueError, "'output_size'")]:
        yield error(Sample((x, boxes, off, size)), what, error=err, via_wrapper=True)
    # The backward operator: (grad, input, rois, offset, slopes, scale, ph, pw, sr, gamma).
    backward = torch.ops.torchops._deform_roi_pool_backward.default
    bname = r"torchops\._deform_roi_pool_backward"
    grad = make((1, 2, 2, 2), device, torch.float32)
    slopes = make((2, 1, 2, 2, 2), device, torch.float32)

    def bcall(grad=grad, x=x, off=off, slopes=slopes):
        return Sample((grad, x, rois, off, slopes, 1.0, 2, 2, 2, 0.1))

    for sample, match in [(bcall(grad=grad[:, :1]), "'grad'.*shape"),
                          (bcall(grad=grad.double()), "'grad'.*dtype"),
                          (bcall(off=off[:, :1]), "'offset'.*shape"),
                          (bcall(x=x[0]), "'input'.*4"),
                          (bcall(slopes=slopes[:, :, :1]), r"'slopes'.*shape \(2, K, C"),
                          (bcall(slopes=slopes[0]), r"'slopes'.*shape"),
                          (bcall(slopes=slopes.double()), "'slopes'.*dtype")]:
        yield ErrorInput(sample, rf"{bname}.*{match}", op=backward)
    # The forward with slopes: (input, rois, offset, scale, ph, pw, sr, gamma).
    forward = torch.ops.torchops._deform_roi_pool_forward.default
    fname = r"torchops\._deform_roi_pool_forward"
    for sample, match in [(call(off=torch.zeros(1, 3, 2, 2, **f32)), "'offset'.*shape"),
                          (call(sr=65), "'sampling_ratio'"),
                          (call(rois=rois[:, :4]), r"'rois'.*\(K, 5\)")]:
        yield ErrorInput(sample, rf"{fname}.*{match}", op=forward)


def _deform_roi_pool_wrapper_sample(s: Sample) -> Sample:
    """The op's arguments as torchops.deform_roi_pool's (mmcv's order)."""
    x, rois, off, scale, ph, pw, sr, gamma = s.args
    return Sample((x, rois, off, (ph, pw), scale, sr, gamma), dict(s.kwargs), s.name)


DEFORM_ROI_POOL = OpInfo(
    name="deform_roi_pool",
    sample_inputs=_deform_roi_pool_samples,
    sample_inputs_compile=_deform_roi_pool_compile_samples,
    error_inputs=_deform_roi_pool_errors,
    internal_ops=("_deform_roi_pool_forward", "_deform_roi_pool_backward"),
    autocast=True,
    wrapper_sample=_deform_roi_pool_wrapper_sample,
    # The CUDA backward adds into grad_input with atomics (unless
    # deterministic algorithms are on).
    gradcheck_kwargs={"nondet_tol": 1e-12},
    # Coordinates in float32 for the float and half types, as roi_align's.
    tols={torch.float32: Tol(1e-4, 1e-4), torch.float16: Tol(2e-3, 2e-3)},
)


ROI_OPS: list[OpInfo] = [ROI_ALIGN, ROI_POOL, DEFORM_ROI_POOL]
