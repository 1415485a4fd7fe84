"""Entries of the losses: sigmoid_focal_loss."""

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
