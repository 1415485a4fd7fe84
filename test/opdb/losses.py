"""Entries of the losses: sigmoid_focal_loss, fused_linear_cross_entropy."""

from __future__ import annotations

import torch

import torchops

from .core import ErrorInput, OpInfo, Sample, Tol, make, make_transposed


def _focal_targets(shape, device, dtype, hard: bool) -> torch.Tensor:
    if hard:
        return torch.randint(0, 2, shape, device=device).to(dtype)
    return make(shape, device, dtype, low=0.0, high=1.0)


def _focal_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    reductions = ("none", "mean", "sum")

    def sample(shape, alpha=0.25, gamma=2.0, reduction="none", hard=True, low=-4.0, high=4.0,
               name=""):
        x = make(shape, device, dtype, rg, low=low, high=high)
        t = _focal_targets(shape, device, dtype, hard)
        return Sample((x, t, alpha, gamma, reduction), name=name or f"focal{shape}_{reduction}")

    # Same structure, three sizes: what the compile tests take.
    for shape in [(3, 5), (16, 7), (9, 80)]:
        yield sample(shape, reduction="mean")
    for r in reductions:
        for shape in [(7,), (0,), (1,), (2, 0, 3), (4, 33, 5)]:
            # The mean of nothing is nan, which the generic value comparison
            # does not accept; test_losses.py covers it.
            if r != "mean" or 0 not in shape:
                yield sample(shape, reduction=r)
        for alpha, gamma in [(0.25, 0.0), (-1.0, 1.5), (0.5, 1.0), (-1.0, 2.0)]:
            yield sample((6, 11), alpha, gamma, r, hard=False, name=f"focal_a{alpha}_g{gamma}_{r}")
        # Both inputs transposed in memory.
        x = make_transposed((6, 9), device, dtype, rg)
        t = _focal_targets((9, 6), device, dtype, hard=True).t()
        yield Sample((x, t, 0.25, 2.0, r), name=f"focal_transposed_{r}")
    # Saturated logits: 1 - p_t underflows for confident right answers.
    yield sample((5, 40), reduction="none", low=-30.0, high=30.0, name="focal_saturated")
    yield sample((5, 40), gamma=1.5, reduction="sum", low=-30.0, high=30.0,
                 name="focal_saturated_g1.5")
    # Targets expanded along a dim (stride 0), soft.
    t = make((5, 1), device, dtype, low=0.0, high=1.0).expand(5, 7)
    yield Sample((make((5, 7), device, dtype, rg), t, 0.25, 2.0, "mean"), name="focal_expanded_t")
    yield Sample((make((61,), device, dtype, rg), _focal_targets((61,), device, dtype, False)),
                 {"alpha": 0.3, "gamma": 2.5, "reduction": "sum"}, name="focal_kwargs")


def _focal_large(device, dtype, requires_grad=False):
    # RetinaNet's classification head on one image batch (anchors x classes).
    for r in ("none", "mean"):
        x = make((8192, 80), device, dtype, requires_grad, low=-8.0, high=8.0)
        t = _focal_targets((8192, 80), device, dtype, hard=True)
        yield Sample((x, t, 0.25, 2.0, r), name=f"focal_retinanet_{r}")


def _focal_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    op = r"torchops\.sigmoid_focal_loss"
    yield ErrorInput(Sample((f(3, 4), f(3, 4), 0.25, 2.0, "avg")), op + r".*'reduction'")
    yield ErrorInput(Sample((f(3, 4), f(4, 3), 0.25, 2.0, "none")), op + r".*'targets'.*shape")
    yield ErrorInput(Sample((f(3, 4), f(3, 1), 0.25, 2.0, "mean")), op + r".*'targets'.*shape")
    yield ErrorInput(Sample((f(3, 4), f(3, 4, dt=torch.float64), 0.25, 2.0, "none")),
                     op + r".*'targets'.*dtype")
    for gamma in (-0.5, float("nan")):
        yield ErrorInput(Sample((f(3, 4), f(3, 4), 0.25, gamma, "none")), op + r".*'gamma'.*>= 0")
    yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device),
                             torch.ones(3, 4, dtype=torch.int64, device=device), 0.25, 2.0, "sum")),
                     op + r".*'inputs'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((f(3, 4), f(3, 4, dev="cpu"), 0.25, 2.0, "none")),
                         op + r".*'targets'")
    # torchvision raises ValueError for an unknown reduction: so does the wrapper.
    yield ErrorInput(Sample((f(3, 4), f(3, 4)), {"reduction": "avg"}), op + r".*'reduction'",
                     ValueError, via_wrapper=True)
    # The internal backward op validates its arguments too, and its fake must
    # reject what it rejects (a compiled backward is traced through it).
    backward = torch.ops.torchops._sigmoid_focal_loss_backward.default
    name = r"torchops\._sigmoid_focal_loss_backward"
    x, t, scalar = f(3, 4), f(3, 4), f()
    for args, match in [
            ((f(3, 4), x, t, 0.25, 2.0, "mean"), r"'grad'.*0-dim"),
            ((scalar, x, t, 0.25, 2.0, "none"), r"'grad'.*shape of 'inputs'"),
            ((scalar.double(), x, t, 0.25, 2.0, "sum"), r"'grad'.*same dtype"),
            ((scalar, x, t, 0.25, 2.0, "Mean"), r"'reduction'"),
            ((scalar, x, t, 0.25, -1.0, "sum"), r"'gamma'.*>= 0"),
            ((scalar, x, t.t(), 0.25, 2.0, "sum"), r"'targets'.*shape")]:
        yield ErrorInput(Sample(args), rf"{name}.*{match}", op=backward)
    if device != "cpu":
        yield ErrorInput(Sample((scalar.cpu(), x, t, 0.25, 2.0, "sum")), rf"{name}.*'grad'",
                         op=backward)


SIGMOID_FOCAL_LOSS = OpInfo(
    name="sigmoid_focal_loss",
    sample_inputs=_focal_samples,
    error_inputs=_focal_errors,
    internal_ops=("_sigmoid_focal_loss_backward",),
    # Sums of a few hundred half-precision terms: rounding of the result.
    tols={torch.float16: Tol(2e-3, 2e-3), torch.bfloat16: Tol(2e-2, 2e-2)},
    autocast=True,
    sample_inputs_large=_focal_large,
)


LOSS_OPS: list[OpInfo] = [SIGMOID_FOCAL_LOSS]


# --- fused_linear_cross_entropy ----------------------------------------------------------

LCE_IGNORE = -100


def lce_targets(shape, v, device, ignored=(), ignore_index=LCE_IGNORE) -> torch.Tensor:
    """int64 class indices in [0, v), `ignore_index` at the flat positions
    `ignored` (negative positions count from the end)."""
    t = torch.randint(0, v, tuple(shape), device=device)
    flat = t.view(-1)
    for i in ignored:
        if flat.numel():
            flat[i] = ignore_index
    return t


def lce_inputs(n_shape, h, v, device, dtype, requires_grad=False, bias=True, layout="",
               ignored=(1,), ignore_index=LCE_IGNORE, scale=1.0):
    """(input, weight, target, bias) of one head: input (*n_shape, h) and
    weight (v, h) uniform in [-scale, scale] (logits of about unit size for
    scale 1 at these widths), targets with `ignored` rows.  `layout` names
    what is not contiguous: "input_t" (input transposed in memory), "weight_t"
    (weight transposed), "weight_sliced" (every other row of a larger
    weight), "bias_expanded" (stride 0), "target_t" (target transposed)."""
    rg = requires_grad
    kw = dict(low=-scale, high=scale)
    if layout == "input_t":
        x = make_transposed((*n_shape, h), device, dtype, rg, **kw)
    else:
        x = make((*n_shape, h), device, dtype, rg, **kw)
    if layout == "weight_t":
        w = make_transposed((v, h), device, dtype, rg, **kw)
    elif layout == "weight_sliced":
        w = make((2 * v, h), device, dtype, **kw)[::2].detach().requires_grad_(rg)
    else:
        w = make((v, h), device, dtype, rg, **kw)
    b = None
    if bias:
        if layout == "bias_expanded":
            b = make((1,), device, dtype, **kw).expand(v).detach().requires_grad_(rg)
        else:
            b = make((v,), device, dtype, rg, **kw)
    if layout == "target_t":
        t = lce_targets(tuple(reversed(n_shape)), v, device, ignored, ignore_index).t()
    else:
        t = lce_targets(n_shape, v, device, ignored, ignore_index)
    return x, w, t, b


def _lce_samples(device, dtype, requires_grad=False):
    rg = requires_grad

    def sample(n_shape, h, v, reduction="mean", ignore_index=LCE_IGNORE, smoothing=0.0,
               z=0.0, softcap=None, name="", **kw):
        x, w, t, b = lce_inputs(n_shape, h, v, device, dtype, rg, ignore_index=ignore_index,
                                **kw)
        return Sample((x, w, t, b, ignore_index, smoothing, reduction, z, softcap),
                      name=name or f"lce{tuple(n_shape)}x{h}->{v}_{reduction}")

    # Same structure, three sizes (an ignored row in each): the compile and
    # export tests take them.
    for n, h, v in [(4, 8, 12), (6, 10, 17), (9, 12, 23)]:
        yield sample((n,), h, v, name=f"lce_c{n}")
    for r in ("mean", "sum", "none"):
        yield sample((7,), 8, 13, r)
        # Every option at once, large logits.
        yield sample((6,), 8, 19, r, smoothing=0.1, z=1e-2, softcap=5.0, scale=2.0,
                     name=f"lce_all_options_{r}")
    for r in ("mean", "none"):
        yield sample((7,), 8, 13, r, bias=False, name=f"lce_no_bias_{r}")
        # Leading dims flatten into the tokens; "none" keeps the target's shape.
        yield sample((2, 3), 8, 11, r, ignored=(0, -1), name=f"lce_leading_{r}")
    # Empty: no tokens, no features.  (A mean of nothing is nan, as torch's,
    # which opcheck's comparison does not accept: test_linear_cross_entropy.py
    # covers it.)
    for r in ("sum", "none"):
        yield sample((0,), 8, 5, r, name=f"lce_no_tokens_{r}")
    yield sample((3,), 0, 5, "mean", ignored=(), name="lce_no_features")
    for layout in ("input_t", "weight_t", "weight_sliced", "bias_expanded", "target_t"):
        yield sample((5,), 7, 9, "mean" if layout != "target_t" else "none", layout=layout,
                     name=f"lce_{layout}")
    # Size 1: one token, one feature, one class (loss 0 unless smoothed).
    yield sample((1,), 1, 1, "sum", ignored=(), name="lce_one_class")
    yield sample((1,), 5, 7, "mean", ignored=(), name="lce_one_token")
    # Options one at a time, at their far ends (an ignored row in each; the
    # combinations, with gradients: test_linear_cross_entropy.py).
    yield sample((6,), 8, 13, "mean", smoothing=1.0, name="lce_smoothing1")
    yield sample((6,), 8, 13, "sum", z=0.5, name="lce_z0.5")
    yield sample((6,), 8, 13, "mean", softcap=1.0, scale=3.0, name="lce_softcap1")
    # ignore_index inside [0, V): that class is left out wherever it is the
    # target; every token ignored ("sum": 0; "mean" is nan:
    # test_linear_cross_entropy.py).
    yield sample((8,), 6, 4, "mean", ignore_index=2, ignored=(0,), name="lce_ignore_class")
    yield sample((4,), 6, 5, "sum", ignored=(0, 1, 2, 3), name="lce_all_ignored_sum")
    # Keyword options (tensors stay positional: the tests convert those), the
    # defaults elsewhere.
    yield Sample(lce_inputs((5,), 6, 10, device, dtype, rg),
                 {"reduction": "sum", "label_smoothing": 0.2}, name="lce_kwargs")


def _lce_large(device, dtype, requires_grad=False):
    # A small language-model head: 512 tokens, 256 features, 4096 classes
    # (several chunks at a small TORCHOPS_LCE_CHUNK_MIB).
    for r, opts in (("mean", {}), ("none", {"label_smoothing": 0.1, "softcap": 30.0})):
        x, w, t, b = lce_inputs((512,), 256, 4096, device, dtype, requires_grad,
                                ignored=range(0, 512, 7), scale=0.5)
        yield Sample((x, w, t, b), {"reduction": r, **opts}, name=f"lce_head_{r}")


def _lce_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731

    def tgt(*shape, v=5, dt=torch.int64, dev=device):
        return torch.randint(0, v, shape, device=dev).to(dt)

    name = "fused_linear_cross_entropy"
    op = rf"torchops\.{name}"
    x, w, t, b = f(4, 6), f(5, 6), tgt(4), f(5)

    def call(*args, **kw):
        full = dict(zip(("input", "weight", "target", "bias"), args))
        return Sample((full.get("input", x), full.get("weight", w), full.get("target", t),
                       full.get("bias", b)), kw)

    for sample, match in [
            (call(tgt(4, 6)), r"'input'.*floating"),
            (call(f()), r"'input'.*at least 1 dimension"),
            (call(x, f(5, 6, dt=torch.float64)), r"'weight'.*same dtype"),
            (call(x, f(30)), r"'weight'.*2-D"),
            (call(x, f(5, 7)), r"'weight'.*6 columns"),
            (call(x, f(0, 6), t, f(0)), r"'weight'.*at least one row"),
            (call(x, w, t.float()), r"'target'.*int64"),
            (call(x, w, t.int()), r"'target'.*int64"),
            (call(x, w, tgt(5)), r"'target'.*one class index per row"),
            (call(x, w, tgt(4, 2)), r"'target'.*one class index per row"),
            (call(x, w, t, f(4)), r"'bias'.*shape"),
            (call(x, w, t, f(5, 1)), r"'bias'.*shape"),
            (call(x, w, t, f(5, dt=torch.float64)), r"'bias'.*same dtype"),
            (call(label_smoothing=-0.1), r"'label_smoothing'"),
            (call(label_smoothing=1.5), r"'label_smoothing'"),
            (call(label_smoothing=float("nan")), r"'label_smoothing'"),
            (call(lse_square_scale=-1.0), r"'lse_square_scale'"),
            (call(lse_square_scale=float("inf")), r"'lse_square_scale'"),
            (call(softcap=0.0), r"'softcap'"),
            (call(softcap=-2.0), r"'softcap'"),
            (call(softcap=float("inf")), r"'softcap'"),
            (call(reduction="avg"), r"'reduction'")]:
        yield ErrorInput(sample, rf"{op}.*{match}")
    # Targets outside [0, V) that are not ignore_index: values in a tensor.
    why = "the target values are data, which a fake does not see"
    for bad, pos in ((5, 2), (-1, 0), (-100, 3)):
        tb = tgt(4)
        tb[pos] = bad
        kw = {"ignore_index": -1} if bad == -100 else {}
        yield ErrorInput(call(x, w, tb, **kw), rf"{op}.*'target'.*target\[{pos}\] is {bad}",
                         kernel_only=why)
    if device != "cpu":
        yield ErrorInput(call(x, w, tgt(4, dev="cpu")), rf"{op}.*'target'")
        yield ErrorInput(call(x, w, t, f(5, dev="cpu")), rf"{op}.*'bias'")
    # The wrapper raises ValueError for an unknown reduction, as F.cross_entropy.
    yield ErrorInput(call(reduction="Mean"), rf"{op}.*'reduction'", ValueError,
                     via_wrapper=True)
    # The internal ops check their arguments too (their fakes as well: a
    # compiled backward is traced through them).
    fwd = torch.ops.torchops._fused_linear_cross_entropy_forward.default
    bwd = torch.ops.torchops._fused_linear_cross_entropy_backward.default
    stats = torch.ops.torchops._fused_linear_cross_entropy_stats.default
    mask = [True, True, True]
    fname = r"torchops\._fused_linear_cross_entropy_forward"
    for args, match in [
            ((x, w, t, b, -100, 0.0, "none", 0.0, None, mask), r"scalar loss"),
            ((x, w, t, b, -100, 0.0, "mean", 0.0, -1.0, mask), r"'softcap'"),
            ((x, w, tgt(3), b, -100, 0.0, "sum", 0.0, None, mask), r"'target'")]:
        yield ErrorInput(Sample(args), rf"{fname}.*{match}", op=fwd)
    bname = r"torchops\._fused_linear_cross_entropy_backward"
    g0, lse = f(), f(4)
    for args, match in [
            ((f(4), x, w, t, b, lse, -100, 0.0, "mean", 0.0, None, 0, 5, mask), r"'grad'.*0-dim"),
            ((f(3), x, w, t, b, lse, -100, 0.0, "none", 0.0, None, 0, 5, mask),
             r"'grad'.*one value per token"),
            ((g0.double(), x, w, t, b, lse, -100, 0.0, "sum", 0.0, None, 0, 5, mask),
             r"'grad' of dtype"),
            ((g0, x, w, t, b, f(3), -100, 0.0, "sum", 0.0, None, 0, 5, mask), r"'lse'"),
            ((g0, x, w, t, b, lse.double(), -100, 0.0, "sum", 0.0, None, 0, 5, mask), r"'lse'"),
            ((g0, x, w, t, b, lse, -100, 0.0, "Sum", 0.0, None, 0, 5, mask), r"'reduction'"),
            ((g0, x, w, t, b, lse, -100, 2.0, "sum", 0.0, None, 0, 5, mask),
             r"'label_smoothing'"),
            ((g0, x, w, t, b, lse, -100, 0.0, "sum", 0.0, None, 0, 0, mask), r"'vocab_size'"),
            ((g0, x, w, t, b, lse, -100, 0.0, "sum", 0.0, None, 1, 5, mask), r"vocab_start"),
            ((g0, x, w, t, b, lse, -100, 0.0, "sum", 0.0, None, -1, 8, mask), r"vocab_start")]:
        yield ErrorInput(Sample(args), rf"{bname}.*{match}", op=bwd)
    sname = r"torchops\._fused_linear_cross_entropy_stats"
    for args, match in [
            ((x, w, t, b, -100, None, 0, 0), r"'vocab_size'"),
            ((x, w, t, b, -100, None, 4, 8), r"vocab_start"),
            ((x, w, t, b, -100, 0.0, 0, 5), r"'softcap'"),
            ((x, f(5, 3), t, b, -100, None, 0, 5), r"'weight'")]:
        yield ErrorInput(Sample(args), rf"{sname}.*{match}", op=stats)


def _lce_output_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


FUSED_LINEAR_CROSS_ENTROPY = OpInfo(
    name="fused_linear_cross_entropy",
    sample_inputs=_lce_samples,
    error_inputs=_lce_errors,
    internal_ops=("_fused_linear_cross_entropy_forward", "_fused_linear_cross_entropy_backward",
                  "_fused_linear_cross_entropy_stats", "_fused_linear_cross_entropy_scale_"),
    # The loss is float32 for half inputs, as F.cross_entropy(logits.float()).
    output_dtype=_lce_output_dtype,
    # Half inputs: the logits are rounded to the input's dtype (as F.linear's
    # output is) before the float32 loss; the reference's are float64.
    tols={torch.float16: Tol(2e-3, 2e-3), torch.bfloat16: Tol(2e-2, 2e-2)},
    autocast=True,
    no_benchmark={"_fused_linear_cross_entropy_stats": "the vocabulary-parallel path's "
                  "statistics, timed inside that path (torchops/tensor_parallel.py), not alone"},
    sample_inputs_large=_lce_large,
)
LOSS_OPS.append(FUSED_LINEAR_CROSS_ENTROPY)
