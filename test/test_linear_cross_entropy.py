"""Op-specific tests of torchops.fused_linear_cross_entropy: what the generic
opdb tests (opdb/losses.py) do not cover -- every option combination against
the float64 reference with gradients, many chunks against one, every token
ignored, a loss scaled, used twice or backpropagated twice, frozen
parameters, per-token upstream gradients, autocast, determinism, target
checks, and a compiled training step.  The CUDA variants (marker `cuda`) run
on the GPU machine."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import torchops
from op_testing import at_thread_counts
from opdb import lce_inputs, lce_targets
from torchops.references import fused_linear_cross_entropy as lce_ref

OP = torch.ops.torchops.fused_linear_cross_entropy.default
FORWARD = torch.ops.torchops._fused_linear_cross_entropy_forward.default
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
REDUCTIONS = ("mean", "sum", "none")
NAME = r"torchops\.fused_linear_cross_entropy"


def _leaves(tensors, requires_grad=True):
    return [None if t is None else t.detach().clone().requires_grad_(requires_grad)
            for t in tensors]


def _run(fn, x, w, t, b, upstream=None, **opts):
    """fn's loss and the gradients of x, w, b (None where not asked) for
    `upstream` (ones by default), on fresh leaves."""
    leaves = _leaves((x, w, b))
    x, w, b = leaves
    loss = fn(x, w, t, b, **opts)
    g = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
    ins = [v for v in leaves if v is not None]
    grads = torch.autograd.grad(loss, ins, g)
    it = iter(grads)
    return loss.detach(), [None if v is None else next(it) for v in leaves]


def _assert_close_all(got, want, **tol):
    (gl, gg), (wl, wg) = got, want
    torch.testing.assert_close(gl, wl.to(gl.dtype), equal_nan=True, **tol)
    for i, (a, b) in enumerate(zip(gg, wg)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b.to(a.dtype), **tol,
                                       msg=lambda m: f"gradient {i}: {m}")


# --- values and gradients against the reference ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_option_combination_matches_the_float64_reference(device, reduction):
    """label_smoothing x lse_square_scale x softcap x (a bias and the default
    ignore_index, or no bias and an ignore_index inside [0, V)), float64: loss
    and the gradients of input, weight and bias, for a random upstream
    gradient."""
    torch.manual_seed(0)
    for smoothing, z, cap, (bias, ignore) in itertools.product(
            (0.0, 0.1, 1.0), (0.0, 1e-2), (None, 2.0), ((True, -100), (False, 3))):
        x, w, t, b = lce_inputs((2, 5), 6, 11, device, torch.float64, bias=bias,
                                ignored=(1, 7), ignore_index=ignore, scale=2.0)
        opts = dict(ignore_index=ignore, label_smoothing=smoothing, reduction=reduction,
                    lse_square_scale=z, softcap=cap)
        up = torch.randn(t.shape, dtype=torch.float64, device=device) \
            if reduction == "none" else torch.tensor(0.7, dtype=torch.float64, device=device)
        got = _run(torchops.fused_linear_cross_entropy, x, w, t, b, up, **opts)
        want = _run(lce_ref, x, w, t, b, up, **opts)
        assert got[0].dtype == torch.float64 and got[0].shape == want[0].shape
        _assert_close_all(got, want, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
def test_lower_precision_matches_the_reference_of_the_same_inputs(device, dtype, tol):
    """float32 and half inputs: a float32 loss (F.cross_entropy(logits.float())),
    gradients in the input's dtype, against float64 on the same values."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((12,), 16, 37, device, dtype, ignored=(3,))
    for reduction, cap in (("mean", None), ("sum", 30.0), ("none", 5.0)):
        opts = dict(reduction=reduction, softcap=cap, label_smoothing=0.1,
                    lse_square_scale=1e-3)
        up = torch.rand(t.shape, device=device) if reduction == "none" else None
        loss, grads = _run(torchops.fused_linear_cross_entropy, x, w, t, b, up, **opts)
        assert loss.dtype == torch.float32
        assert [g.dtype for g in grads] == [dtype] * 3
        want_loss, want = _run(lce_ref, *(v.double() for v in (x, w)), t, b.double(),
                               None if up is None else up.double(), **opts)
        torch.testing.assert_close(loss.double(), want_loss, atol=tol, rtol=tol)
        for g, wg in zip(grads, want):
            scale = max(1.0, wg.abs().max().item())
            torch.testing.assert_close(g.double(), wg, atol=tol * scale, rtol=tol)


# --- chunks -------------------------------------------------------------------------------


def _chunked(monkeypatch, mib, fn):
    monkeypatch.setenv("TORCHOPS_LCE_CHUNK_MIB", str(mib))
    try:
        return fn()
    finally:
        monkeypatch.delenv("TORCHOPS_LCE_CHUNK_MIB")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_many_chunks_equal_one_chunk(monkeypatch, device, reduction):
    """A 1 MiB budget over rows of 2^16 float32 logits is 4 rows a chunk: 37
    tokens make 10 chunks (the last one short), whose per-token results are
    those of one chunk (the weight's gradient sums the chunks: to rounding).
    "mean" takes the forward's gradient pass, "none" the backward's."""
    torch.manual_seed(0)
    v = 1 << 16
    x, w, t, b = lce_inputs((37,), 8, v, device, torch.float32, ignored=(0, 5, 36))
    up = torch.rand(37, device=device) if reduction == "none" else None
    opts = dict(reduction=reduction, label_smoothing=0.05, softcap=20.0)

    def call():
        loss, grads = _run(torchops.fused_linear_cross_entropy, x, w, t, b, up, **opts)
        lse = FORWARD(x, w, t, b, -100, 0.05, reduction, 0.0, 20.0, [False] * 3)[1]
        return loss, grads, lse

    many = _chunked(monkeypatch, 1, call)
    one = _chunked(monkeypatch, 1024, call)
    if device == "cpu":
        # torchops.matmul's rows do not depend on the others: each row's
        # statistics are the same numbers.  (cuBLAS may pick another kernel
        # for another row count.)
        assert torch.equal(many[2], one[2])
        assert torch.equal(many[0], one[0])
    torch.testing.assert_close(many[2], one[2], atol=1e-5, rtol=1e-6)
    _assert_close_all(many[:2], one[:2], atol=1e-5, rtol=1e-5)


def test_chunk_budget_of_one_row(monkeypatch):
    """A budget below one row of logits still makes one row a chunk."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((5,), 4, 300_000, "cpu", torch.float32, ignored=())
    many = _chunked(monkeypatch, 1, lambda: _run(torchops.fused_linear_cross_entropy, x, w, t, b))
    want = _run(lce_ref, *(v.double() for v in (x, w)), t, b.double())
    _assert_close_all(many, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_beyond_the_gradients_is_one_chunk(monkeypatch, device, reduction):
    """At a 1 MiB budget (64 rows of 4096 float32 logits) a training step
    of 1024 tokens needs about one chunk beyond its inputs and gradients
    (the logits whole would be 16 MiB, grad_weight alone 4 MiB): no
    temporary of grad_weight's size, no second chunk alive."""
    from torchops.bench.runner import peak_memory

    torch.manual_seed(0)
    x, w, t, b = lce_inputs((1024,), 256, 4096, device, torch.float32, ignored=(3,))
    up = torch.rand(1024, device=device) if reduction == "none" else None
    monkeypatch.setenv("TORCHOPS_LCE_CHUNK_MIB", "1")
    leaves = _leaves((x, w, b))

    def step():
        loss = torchops.fused_linear_cross_entropy(leaves[0], leaves[1], t, leaves[2],
                                                   reduction=reduction)
        return torch.autograd.grad(loss, leaves, None if up is None else up)

    step()  # lazy initialisations outside the measured call
    peak, grads = peak_memory(step, device)
    assert grads == sum(v.numel() * 4 for v in leaves)
    assert peak - grads <= 1.5 * (1 << 20), (peak, grads)


# --- ignored tokens -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_every_token_ignored(device):
    """"sum": 0, "mean": nan (0 / 0, as F.cross_entropy), "none": zeros; the
    gradients are zeros in each case (nothing counts)."""
    x, w, _, b = lce_inputs((6,), 5, 9, device, torch.float32)
    t = torch.full((6,), -100, device=device)
    want = {"sum": 0.0, "mean": math.nan}
    for reduction in REDUCTIONS:
        loss, grads = _run(torchops.fused_linear_cross_entropy, x, w, t, b,
                           reduction=reduction)
        if reduction == "none":
            assert torch.equal(loss, torch.zeros(6, device=device))
        else:
            ref = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)
            assert loss.item() == want[reduction] or (math.isnan(want[reduction])
                                                      and math.isnan(loss.item()))
            assert math.isnan(ref.item()) == math.isnan(loss.item())
        for g in grads:
            assert torch.equal(g, torch.zeros_like(g)), reduction


# --- autograd -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_scaled_reused_and_twice_backpropagated_loss(device, reduction):
    """The forward's gradients are scaled by the upstream gradient: a loss
    times 3, a loss used twice (one backward, upstream 2), and a graph
    retained and backpropagated twice (the second backward recomputes from
    the saved lse; .grad accumulates to twice the first)."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((7,), 6, 13, device, torch.float64, ignored=(2,))
    opts = dict(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2,
                softcap=4.0)
    _, base = _run(lce_ref, x, w, t, b, **opts)

    def grads_of(make_loss, backwards=1):
        leaves = _leaves((x, w, b))
        loss = make_loss(torchops.fused_linear_cross_entropy(leaves[0], leaves[1], t,
                                                             leaves[2], **opts))
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
        return [v.grad for v in leaves]

    for factor, make_loss, backwards in ((3.0, lambda l: l * 3, 1),
                                         (2.0, lambda l: l + l, 1),
                                         (-0.5, lambda l: l * -0.5, 1),
                                         (2.0, lambda l: l, 2),
                                         (6.0, lambda l: l * 3, 2)):
        got = grads_of(make_loss, backwards)
        for g, want in zip(got, base):
            torch.testing.assert_close(g, want * factor, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_the_second_backward_equals_the_first(device):
    """With retain_graph, the first backward hands over the forward's
    gradients and the second recomputes them: the same numbers (to rounding)."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((9,), 8, 21, device, torch.float32, ignored=(4,))
    leaves = _leaves((x, w, b))
    loss = torchops.fused_linear_cross_entropy(leaves[0], leaves[1], t, leaves[2])
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, c in zip(first, second):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_only_some_operands_require_grad(device, reduction):
    """A frozen weight (fine-tuning below the head), a frozen body (only the
    head trains), only the bias: each gradient alone equals the reference's."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((3, 4), 6, 10, device, torch.float64, ignored=(5,))
    up = torch.randn(3, 4, dtype=torch.float64, device=device) if reduction == "none" else None
    for which in ((0,), (1,), (2,), (0, 2)):
        got, want = [], []
        for fn, out in ((torchops.fused_linear_cross_entropy, got), (lce_ref, want)):
            leaves = [v.detach().clone().requires_grad_(i in which)
                      for i, v in enumerate((x, w, b))]
            loss = fn(leaves[0], leaves[1], t, leaves[2], reduction=reduction)
            g = torch.ones_like(loss) if up is None else up
            out += torch.autograd.grad(loss, [leaves[i] for i in which], g)
        for a, c in zip(got, want):
            torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_inference_mode_return_the_loss(device):
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((5,), 6, 10, device, torch.float32, requires_grad=True)
    want = torchops.fused_linear_cross_entropy(x, w, t, b).detach()
    with torch.no_grad():
        got = torchops.fused_linear_cross_entropy(x, w, t, b)
    assert not got.requires_grad and torch.equal(got, want)
    with torch.inference_mode():
        assert torch.equal(torchops.fused_linear_cross_entropy(x, w, t, b), want)


# --- autocast -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_f_linear(device, dtype):
    """Under autocast, input, weight and bias are cast as F.linear casts them
    (to the region's dtype), the loss is float32, and the float32 leaves get
    float32 gradients; the values are those of the op on the cast inputs."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((8,), 16, 24, device, torch.float32, ignored=(1,))
    leaves = _leaves((x, w, b))
    with torch.autocast(device_type=device, dtype=dtype):
        assert F.linear(leaves[0], leaves[1], leaves[2]).dtype == dtype
        loss = torchops.fused_linear_cross_entropy(leaves[0], leaves[1], t, leaves[2])
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, leaves)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    cast = _leaves((x.to(dtype), w.to(dtype), b.to(dtype)))
    want = torchops.fused_linear_cross_entropy(cast[0], cast[1], t, cast[2])
    want_grads = torch.autograd.grad(want, cast)
    assert torch.equal(loss, want)
    for g, wg in zip(grads, want_grads):
        assert torch.equal(g, wg.float())
    # And against the eager formula under the same autocast.
    with torch.autocast(device_type=device, dtype=dtype):
        eager = F.cross_entropy(F.linear(x, w, b).float(), t)
    torch.testing.assert_close(loss, eager, atol=1e-2, rtol=1e-2)


# --- determinism --------------------------------------------------------------------------


def _loss_and_grads(device, reduction="mean", n=300, v=700):
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((n,), 64, v, device, torch.float32, ignored=range(0, n, 9))
    up = torch.rand(n, device=device) if reduction == "none" else None
    return lambda: _run(torchops.fused_linear_cross_entropy, x, w, t, b, up,
                        reduction=reduction, label_smoothing=0.1)


def _bitwise_equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_two_runs_are_bitwise_equal(device, reduction):
    run = _loss_and_grads(device, reduction)
    assert _bitwise_equal(run(), run())


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget", ["1", "64"], ids=["3_chunks", "1_chunk"])
def test_cpu_results_do_not_depend_on_the_thread_count(monkeypatch, reduction, budget):
    """Rows are split among threads, never a sum: 1, 2 and 4 threads give the
    same bits, in one chunk or several (the weight's gradient sums the
    chunks in order)."""
    monkeypatch.setenv("TORCHOPS_LCE_CHUNK_MIB", budget)
    first, *rest = at_thread_counts(_loss_and_grads("cpu", reduction, n=700, v=1000),
                                    counts=(1, 2, 4))
    for other in rest:
        assert _bitwise_equal(first, other)


# --- invalid targets and options ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_target_out_of_range_raises_naming_the_op(device):
    x, w, _, b = lce_inputs((4,), 6, 10, device, torch.float32, requires_grad=True)
    for bad in (10, -1, 1 << 40):
        t = lce_targets((4,), 10, device)
        t[2] = bad
        for fn in (torchops.fused_linear_cross_entropy, OP):
            with pytest.raises(RuntimeError, match=rf"{NAME}: .*'target'.*target\[2\] is {bad}"):
                fn(x, w, t, b)
    # On CUDA the device stays usable.
    t = lce_targets((4,), 10, device)
    assert torchops.fused_linear_cross_entropy(x, w, t, b).isfinite()


def test_the_wrapper_raises_value_error_for_an_unknown_reduction():
    x, w, t, b = lce_inputs((4,), 6, 10, "cpu", torch.float32)
    with pytest.raises(ValueError, match=rf"{NAME}: .*'reduction'.*'avg'"):
        torchops.fused_linear_cross_entropy(x, w, t, b, reduction="avg")
    with pytest.raises(RuntimeError, match=rf"{NAME}: .*'reduction'"):
        OP(x, w, t, b, -100, 0.0, "avg", 0.0, None)


@pytest.mark.cuda
def test_cuda_target_check_nan_gives_nan_without_raising(monkeypatch):
    """TORCHOPS_LCE_TARGET_CHECK=nan: no host sync; a bad target's token is
    nan, so a reduced loss is nan, and the device stays usable."""
    torch.manual_seed(0)
    x, w, _, b = lce_inputs((6,), 8, 12, "cuda", torch.float32)
    t = lce_targets((6,), 12, "cuda", ignored=(0,))
    good = torchops.fused_linear_cross_entropy(x, w, t, b, reduction="none")
    bad_t = t.clone()
    bad_t[3] = 12
    monkeypatch.setenv("TORCHOPS_LCE_TARGET_CHECK", "nan")
    for reduction in ("mean", "sum"):
        assert torchops.fused_linear_cross_entropy(x, w, bad_t, b, reduction=reduction).isnan()
    per = torchops.fused_linear_cross_entropy(x, w, bad_t, b, reduction="none")
    torch.cuda.synchronize()
    assert per[3].isnan() and torch.equal(per[[0, 1, 2, 4, 5]], good[[0, 1, 2, 4, 5]])
    monkeypatch.setenv("TORCHOPS_LCE_TARGET_CHECK", "sync")
    with pytest.raises(RuntimeError, match=rf"{NAME}: .*'target'"):
        torchops.fused_linear_cross_entropy(x, w, bad_t, b)
    assert torch.equal(torchops.fused_linear_cross_entropy(x, w, t, b, reduction="none"), good)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_cpu_on_a_vocabulary_of_32000(monkeypatch, dtype):
    """256 tokens x 128 features x 32000 classes, 8 chunks on CUDA (a 2 MiB
    budget in bfloat16, 4 in float32) and one on the CPU: loss and gradients
    agree (the weight's gradient summed over the chunks: to its rounding)."""
    torch.manual_seed(0)
    x, w, t, b = lce_inputs((256,), 128, 32000, "cpu", dtype, ignored=range(0, 256, 11),
                            scale=0.5)
    cpu = _run(torchops.fused_linear_cross_entropy, x, w, t, b, softcap=30.0)
    monkeypatch.setenv("TORCHOPS_LCE_CHUNK_MIB", "2" if dtype == torch.bfloat16 else "4")
    gpu = _run(torchops.fused_linear_cross_entropy, *(v.cuda() for v in (x, w, t, b)),
               softcap=30.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], atol=tol, rtol=tol)
    for g, c in zip(gpu[1], cpu[1]):
        scale = max(1.0, c.abs().max().item())
        torch.testing.assert_close(g.cpu().double(), c.double(), atol=tol * scale, rtol=tol)


# --- torch.compile ------------------------------------------------------------------------


class _TinyLM(torch.nn.Module):
    """A linear body and a language-model head whose loss is the fused op."""

    def __init__(self, h_in=12, h=16, v=40):
        super().__init__()
        self.body = torch.nn.Linear(h_in, h)
        self.head = torch.nn.Linear(h, v)

    def forward(self, x, target):
        hidden = torch.tanh(self.body(x))
        return torchops.fused_linear_cross_entropy(hidden, self.head.weight, target,
                                                   self.head.bias, label_smoothing=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_matches_eager(device):
    """torch.compile(fullgraph=True, dynamic=True) of the model (its backward
    compiled by AOTAutograd): the loss and every parameter's gradient match
    eager, for two batch sizes (one graph) with ignored tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyLM().to(device)
    # Inductor on the GPU; on the CPU AOTAutograd's eager backend (the op's
    # tracing, its forward-computed gradients in the joint graph and the
    # dynamic sizes are the same; the generic test_compile runs the op
    # through inductor), which keeps this test within CI's budget.
    counter = CompileCounterWithBackend("inductor" if device == "cuda" else "aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)

    def step(m, x, target):
        model.zero_grad(set_to_none=True)
        loss = m(x, target)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    for n in (6, 10):
        x = torch.randn(2, n, 12, device=device)
        target = lce_targets((2, n), 40, device, ignored=(0, 3))
        want, want_grads = step(model, x, target)
        got, got_grads = step(compiled, x, target)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, wg in zip(got_grads, want_grads):
            torch.testing.assert_close(g, wg, atol=1e-5, rtol=1e-5)
    # One graph for both sizes (dynamo may also report an empty one of an
    # outer frame of the module's call).
    graphs = [g for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    assert len(graphs) == 1, [g.code for g in graphs]
    torch._dynamo.reset()
