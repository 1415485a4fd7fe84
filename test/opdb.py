"""The op database: one entry per public torchops operator.

Every generic test (test_ops.py, test_export.py, test_properties.py,
test_gates.py) is generated from these entries, in the spirit of PyTorch's
OpInfo: adding an op means adding an entry here, not writing a new test file.
An entry says how to call the op, how to make sample inputs for a device and
dtype, what the float64 pure-PyTorch reference is, which tolerances apply, and
which invalid inputs must raise what.

Adding an op
------------
Write an ``OpInfo`` in your group's section below and add it to that
section's list (BOX_OPS, ROI_OPS, LOSS_OPS).  Required fields:

``name``            public name (``torchops.<name>``).
``op``              the overload, ``torch.ops.torchops.<name>.default``.
``wrapper``         the typed Python wrapper in torchops.ops.
``reference``       pure PyTorch, called with every floating tensor of a sample
                    converted to float64 (integer tensors and scalars as they
                    are); returns what the op returns (a tensor or a tuple).
                    Integer outputs are compared exactly, dtype included.
``sample_inputs``   ``(device, dtype, requires_grad=False) -> iterable of
                    Sample``.  Tensors go in ``Sample.args`` (positionally);
                    scalars (float/int/bool/str) may go in args or kwargs.
                    Cover: an empty dim, a size-1 dim, odd sizes, transposed or
                    sliced (non-contiguous) and expanded (stride 0) inputs, and,
                    when ``requires_grad`` is true, set it on the floating
                    inputs that are differentiable (never on integer ones).
                    ``dtype`` is the floating dtype under test; integer inputs
                    (indices, ...) keep their own dtype.  Also list >= 3
                    samples that differ only in their sizes (those >= 2): the
                    compile and export tests take them (or give
                    ``sample_inputs_compile``); dims of size 1 are fine when
                    they are 1 in all three.  test_gates checks the variety.
``error_inputs``    ``(device) -> iterable of ErrorInput``: invalid calls, the
                    exception type and a regex that names the op and the
                    argument ("torchops\\.<name>.*'boxes'").

Optional fields (defaults in brackets): ``dtypes`` [all four float dtypes on
cpu and cuda], ``tols`` [DEFAULT_TOLS] per dtype, ``differentiable`` [True],
``supports_gradgrad`` [False], ``data_dependent_output`` [False: the output
size depends on the values, like nms], ``internal_ops`` [()] (``_<op>_backward``
ops this entry exercises), ``autocast`` [False: the op has Autocast kernels],
``contiguous_outputs`` [True], ``sample_inputs_large`` [None: extra, bigger
samples for the ``--full`` profile], ``sample_inputs_compile`` [None: derived],
``hypothesis_sample`` [None: derived from ``sample_inputs``; ``(draw, device,
dtype) -> Sample`` for a real property test, see hyp_tensor], ``gradcheck_kwargs``
[{}: e.g. nondet_tol for atomics], ``wrapper_sample`` and ``wrapper_outputs``
[None: the wrapper takes the op's arguments and returns its outputs], ``skips`` [{}: generic test name -> written
reason] and ``opcheck_skips`` [{}: opcheck test_util name -> written reason].
test_gates rejects empty reasons and unknown names.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

import torchops

# ----------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Generic tests an entry may skip (with a reason), and opcheck's test_utils.
GENERIC_TESTS = (
    "correctness", "wrapper", "opcheck", "gradcheck", "gradgradcheck", "grad_vs_reference",
    "compile", "export", "autocast", "cuda_graph", "cpu_vs_cuda", "error_inputs", "property",
    "sample_variety",
)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def full_profile() -> bool:
    """True for the long GPU/nightly runs (``pytest --full`` or
    TORCHOPS_TEST_PROFILE=full): larger samples, more examples."""
    return os.environ.get("TORCHOPS_TEST_PROFILE", "ci") == "full"


@dataclass
class Sample:
    """One call: positional args (tensors and scalars) and kwargs."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""

    def tensors(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def __repr__(self) -> str:
        def fmt(a):
            if isinstance(a, torch.Tensor):
                return (f"T{tuple(a.shape)}{'' if a.is_contiguous() else '[nc]'}"
                        f"{'[rg]' if a.requires_grad else ''}")
            return repr(a)
        return f"{self.name}({', '.join(map(fmt, self.args))})"


@dataclass
class ErrorInput:
    """An invalid call and the error it must raise; `match` is a regex that
    must name the op (and, in the kernels, the offending argument)."""

    sample: Sample
    match: str
    error: type = RuntimeError
    # Call the Python wrapper instead of the dispatcher op (for the
    # ValueError/TypeError checks that live in the wrapper).
    via_wrapper: bool = False


@dataclass
class Tol:
    atol: float
    rtol: float


DEFAULT_TOLS = {
    torch.float64: Tol(1e-9, 1e-7),
    torch.float32: Tol(1e-5, 1.3e-5),
    torch.float16: Tol(1e-3, 1e-3),
    torch.bfloat16: Tol(1e-2, 1.6e-2),
}


@dataclass
class OpInfo:
    """One operator; see the module docstring for what each field means."""

    name: str                                   # public name: torchops.<name>
    op: torch._ops.OpOverload                   # torch.ops.torchops.<name>.default
    wrapper: Callable                           # typed Python wrapper
    reference: Callable                         # pure PyTorch; called on float64 copies
    sample_inputs: Callable[..., Iterable[Sample]]   # (device, dtype, requires_grad) -> samples
    error_inputs: Callable[..., Iterable[ErrorInput]]  # (device) -> invalid calls
    dtypes: dict[str, tuple] = field(default_factory=lambda: {
        "cpu": FLOAT_DTYPES, "cuda": FLOAT_DTYPES})
    tols: dict = field(default_factory=dict)    # per-dtype overrides of DEFAULT_TOLS
    differentiable: bool = True
    supports_gradgrad: bool = False
    data_dependent_output: bool = False
    # Internal ops (backward kernels) that this entry exercises; the coverage
    # gate accepts them as covered.
    internal_ops: tuple[str, ...] = ()
    # Test name (GENERIC_TESTS) -> written reason for not running it on this op.
    skips: dict[str, str] = field(default_factory=dict)
    # opcheck test_util (OPCHECK_UTILS) -> written reason for turning it off.
    opcheck_skips: dict[str, str] = field(default_factory=dict)
    # The op has AutocastCPU/AutocastCUDA kernels: compute in float32, return
    # the first floating input's dtype.  The autocast test runs for every op;
    # with this set it also calls the op with mixed float32/half inputs.
    autocast: bool = False
    # Kernels return contiguous outputs (the project rule); the correctness
    # test checks the strides unless this is False.
    contiguous_outputs: bool = True
    # (device, dtype, requires_grad) -> extra, larger samples for --full.
    sample_inputs_large: Callable[..., Iterable[Sample]] | None = None
    # (device, dtype, requires_grad) -> >= 3 samples differing only in sizes,
    # for the compile and export tests; derived from the samples when None.
    sample_inputs_compile: Callable[..., Iterable[Sample]] | None = None
    # (draw, device, dtype) -> Sample: a hypothesis-driven sample (see
    # hyp_tensor); when None the property test draws among sample_inputs.
    hypothesis_sample: Callable[..., Sample] | None = None
    # Extra arguments to gradcheck/gradgradcheck (e.g. nondet_tol, atol).
    gradcheck_kwargs: dict = field(default_factory=dict)
    # Where the public wrapper's arguments differ from the op's (the
    # torchvision-style roi_align takes boxes and output_size): a sample of
    # the op -> the same call through the wrapper.  The generic wrapper,
    # compile and export tests call both.  None: same arguments.
    wrapper_sample: Callable[[Sample], Sample] | None = None
    # The op's outputs -> what the wrapper returns (roi_pool's wrapper drops
    # argmax).  None: the same outputs.
    wrapper_outputs: Callable[[tuple], tuple] | None = None

    def tol(self, dtype: torch.dtype) -> Tol:
        return self.tols.get(dtype, DEFAULT_TOLS[dtype])

    def qualname(self) -> str:
        return f"torchops::{self.name}"

    def samples(self, device, dtype, requires_grad=False) -> Iterable[Sample]:
        """The entry's samples, plus the large ones in the full profile."""
        yield from self.sample_inputs(device, dtype, requires_grad=requires_grad)
        if self.sample_inputs_large is not None and full_profile():
            yield from self.sample_inputs_large(device, dtype, requires_grad=requires_grad)

    def compile_samples(self, device, dtype, requires_grad=False) -> list[Sample]:
        """Up to three non-empty samples of one structure (ranks, dtypes,
        layouts, scalars, and which dims are 0 or 1: dynamo specialises
        those) and different sizes, for the compile and export tests."""
        if self.sample_inputs_compile is not None:
            return list(self.sample_inputs_compile(device, dtype, requires_grad=requires_grad))
        groups: dict[Any, dict[tuple, Sample]] = {}
        for s in self.sample_inputs(device, dtype, requires_grad=requires_grad):
            ts = s.tensors()
            if not ts or any(t.numel() == 0 for t in ts):
                continue
            key = (tuple(_structure(a) for a in s.args),
                   tuple(sorted((k, repr(v)) for k, v in s.kwargs.items())))
            groups.setdefault(key, {}).setdefault(tuple(t.shape for t in ts), s)
        best = max(groups.values(), key=len, default={})
        return list(best.values())[:3]


def _structure(a) -> Any:
    if not isinstance(a, torch.Tensor):
        return ("scalar", repr(a))
    order = tuple(sorted(range(a.dim()), key=lambda d: -a.stride(d)))
    return ("tensor", a.dtype, a.requires_grad, a.is_contiguous(), order,
            tuple(st == 0 for st in a.stride()), tuple(d if d < 2 else None for d in a.shape))


def make(shape, device, dtype, requires_grad=False, low=-3.0, high=3.0) -> torch.Tensor:
    """Fresh uniform random values (never zeros), as a leaf tensor."""
    t = torch.empty(shape, device=device, dtype=torch.float64).uniform_(low, high).to(dtype)
    return t.requires_grad_(requires_grad)


def make_transposed(shape, device, dtype, requires_grad=False, **kw) -> torch.Tensor:
    """A tensor of `shape` whose last two dimensions are transposed in memory."""
    s = list(shape)
    s[-1], s[-2] = s[-2], s[-1]
    base = make(s, device, dtype, **kw).transpose(-1, -2)
    return base.detach().requires_grad_(requires_grad)


def convert(s: Sample, dtype: torch.dtype | None = None, requires_grad: bool | None = None) -> Sample:
    """Detached copy of a sample, floating tensors optionally converted to
    `dtype`; requires_grad kept unless given."""
    def conv(a):
        if not isinstance(a, torch.Tensor):
            return a
        t = a.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        rg = a.requires_grad if requires_grad is None else requires_grad
        return t.requires_grad_(rg and t.is_floating_point())
    return Sample(tuple(conv(a) for a in s.args), dict(s.kwargs), s.name)


def hyp_tensor(draw, shape, device, dtype, low=-3.0, high=3.0, requires_grad=False) -> torch.Tensor:
    """For ``hypothesis_sample``: a floating tensor of ``shape`` with drawn
    values (uniform in [low, high]) and a drawn memory layout: contiguous,
    permuted, sliced (strided), offset into its storage, or expanded."""
    from hypothesis import strategies as st

    shape = tuple(int(d) for d in shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))

    def values(sh):
        t = torch.empty(tuple(sh), dtype=torch.float64).uniform_(low, high, generator=g)
        return t.to(dtype).to(device)

    layouts = ["contiguous", "offset"]
    if shape:
        layouts += ["sliced", "expanded"]
    if len(shape) >= 2:
        layouts.append("permuted")
    layout = draw(st.sampled_from(layouts), label="layout")
    if layout == "permuted":
        perm = draw(st.permutations(range(len(shape))))
        t = values([shape[p] for p in perm]).permute([perm.index(i) for i in range(len(shape))])
    elif layout == "sliced":
        d, step = draw(st.integers(0, len(shape) - 1)), draw(st.integers(2, 3))
        big = list(shape)
        big[d] *= step
        index = [slice(None)] * len(shape)
        index[d] = slice(None, None, step)
        t = values(big)[tuple(index)]
    elif layout == "offset":
        n = 1
        for d in shape:
            n *= d
        t = values([n + 3])[3:].view(shape)
    elif layout == "expanded":
        d = draw(st.integers(0, len(shape) - 1))
        small = list(shape)
        small[d] = 1
        t = values(small).expand(shape)
    else:
        t = values(shape)
    assert t.shape == shape
    return t.detach().requires_grad_(requires_grad)


def hyp_size(draw, high=40) -> int:
    """A dimension size, 0 and 1 drawn often (they are the edge cases)."""
    from hypothesis import strategies as st
    return draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, high)))


# ----------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------

def _matmul_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    shapes = [  # (batch or None, M, K, N)
        (None, 3, 5, 4), (None, 1, 1, 1), (None, 17, 33, 9), (None, 0, 3, 4),
        (None, 3, 0, 4), (None, 65, 70, 66), (2, 5, 3, 4), (3, 1, 7, 1), (0, 2, 3, 4),
        (2, 64, 17, 65),
    ]
    for batch, m, k, n in shapes:
        pre = () if batch is None else (batch,)
        a_shape, b_shape = (*pre, m, k), (*pre, k, n)
        tag = f"{'b' if batch is not None else ''}mm{m}x{k}x{n}"
        yield Sample((make(a_shape, device, dtype, rg), make(b_shape, device, dtype, rg)), name=tag)
        if m and k and n:
            yield Sample((make_transposed(a_shape, device, dtype, rg),
                          make_transposed(b_shape, device, dtype, rg)), name=tag + "_T")
    # Broadcast: one right-hand matrix expanded (stride 0) over the batch.
    w = make((1, 6, 5), device, dtype).expand(4, 6, 5)
    yield Sample((make((4, 3, 6), device, dtype, rg), w.detach().requires_grad_(rg)), name="expanded_b")
    # Non-contiguous by slicing.
    a = make((8, 10), device, dtype)[::2, 1:8]
    yield Sample((a.detach().requires_grad_(rg), make((7, 3), device, dtype, rg)), name="sliced_a")


def _matmul_errors(device):
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3), f(3, 4))), r"torchops\.matmul.*'a'.*2-D")
    yield ErrorInput(Sample((f(2, 3, 4, 5), f(5, 4))), r"torchops\.matmul.*'a'")
    yield ErrorInput(Sample((f(3, 4), f(2, 4, 5))), r"torchops\.matmul.*'b'")
    yield ErrorInput(Sample((f(3, 4), f(5, 6))), r"torchops\.matmul: inner dimensions")
    yield ErrorInput(Sample((f(2, 3, 4), f(3, 4, 5))), r"torchops\.matmul: batch dimensions")
    yield ErrorInput(Sample((f(3, 4), f(4, 5, dt=torch.float64))), r"torchops\.matmul.*'b'.*dtype")
    yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device),
                             torch.ones(4, 5, dtype=torch.int64, device=device))),
                     r"torchops\.matmul.*'a'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((f(3, 4), f(4, 5, dev="cpu"))), r"torchops\.matmul.*'b'")


def _matmul_large(device, dtype, requires_grad=False):
    rg = requires_grad
    for pre, m, k, n in [((), 300, 257, 129), ((4,), 128, 65, 97), ((), 1, 1000, 513)]:
        yield Sample((make((*pre, m, k), device, dtype, rg), make((*pre, k, n), device, dtype, rg)),
                     name=f"large{m}x{k}x{n}")
    yield Sample((make_transposed((3, 200, 300), device, dtype, rg),
                  make_transposed((3, 300, 100), device, dtype, rg)), name="large_T")


def _matmul_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    batch = draw(st.one_of(st.none(), st.integers(0, 3)))
    m, k, n = hyp_size(draw), hyp_size(draw), hyp_size(draw)
    pre = () if batch is None else (batch,)
    # Magnitudes stay where float16 cannot overflow (8 * 8 * 40 < 65504).
    mag = draw(st.sampled_from([1e-2, 1.0, 8.0]))
    a = hyp_tensor(draw, (*pre, m, k), device, dtype, -mag, mag)
    b = hyp_tensor(draw, (*pre, k, n), device, dtype, -mag, mag)
    return Sample((a, b), name=f"hyp{tuple(a.shape)}@{tuple(b.shape)}")


MATMUL = OpInfo(
    name="matmul",
    op=torch.ops.torchops.matmul.default,
    wrapper=torchops.matmul,
    reference=lambda a, b: torch.matmul(a, b),
    sample_inputs=_matmul_samples,
    error_inputs=_matmul_errors,
    tols={
        torch.float32: Tol(1e-4, 1e-4),
        torch.float16: Tol(1e-2, 2e-3),
        torch.bfloat16: Tol(5e-2, 2e-2),
    },
    supports_gradgrad=True,
    sample_inputs_large=_matmul_large,
    hypothesis_sample=_matmul_hypothesis,
)


# ----------------------------------------------------------------------------------
# d_sigmoid
# ----------------------------------------------------------------------------------

def _d_sigmoid_ref(z):
    s = torch.sigmoid(z)
    return s * (1 - s)


def _d_sigmoid_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for shape in [(7,), (0,), (1,), (3, 5), (2, 0, 3), (4, 33, 5), (61,), (1000,)]:
        yield Sample((make(shape, device, dtype, rg, low=-8, high=8),), name=f"z{shape}")
    yield Sample((make_transposed((6, 9), device, dtype, rg),), name="transposed")
    z = make((5, 1), device, dtype).expand(5, 7)
    yield Sample((z.detach().requires_grad_(rg),), name="expanded")
    yield Sample((make((0, 4), device, dtype, rg),), name="empty2d")
    # Contiguous but not 16-byte aligned: the kernels' unvectorised path.
    z = make((67,), device, dtype, low=-8, high=8)[3:]
    yield Sample((z.detach().requires_grad_(rg),), name="offset")


def _d_sigmoid_errors(device):
    yield ErrorInput(Sample((torch.arange(5, device=device),)), r"torchops\.d_sigmoid.*'z'.*floating")
    yield ErrorInput(Sample((torch.ones(3, dtype=torch.bool, device=device),)),
                     r"torchops\.d_sigmoid.*'z'")


def _d_sigmoid_large(device, dtype, requires_grad=False):
    yield Sample((make((1 << 20,), device, dtype, requires_grad, low=-20, high=20),), name="z1M")
    yield Sample((make_transposed((513, 1025), device, dtype, requires_grad),), name="large_T")


def _d_sigmoid_hypothesis(draw, device, dtype):
    from hypothesis import strategies as st
    shape = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(2, 9)), max_size=4))
    # Up to 1e3: deep in both tails, where s * (1 - s) underflows.
    mag = draw(st.sampled_from([0.5, 4.0, 30.0, 1e3]))
    return Sample((hyp_tensor(draw, shape, device, dtype, -mag, mag),), name=f"hyp{tuple(shape)}")


D_SIGMOID = OpInfo(
    name="d_sigmoid",
    op=torch.ops.torchops.d_sigmoid.default,
    wrapper=torchops.d_sigmoid,
    reference=_d_sigmoid_ref,
    sample_inputs=_d_sigmoid_samples,
    error_inputs=_d_sigmoid_errors,
    internal_ops=("_d_sigmoid_backward",),
    tols={torch.float16: Tol(2e-3, 2e-3)},
    sample_inputs_large=_d_sigmoid_large,
    hypothesis_sample=_d_sigmoid_hypothesis,
)


# --- detection: boxes -------------------------------------------------------------------
#
# Box samples use coordinates on a coarse grid, exact in every dtype
# (bfloat16 included), so IoUs -- and hence which boxes nms keeps -- are the
# same in the kernels' op math and in the float64 references.  For box_iou,
# boxes1 and boxes2 sit on two grids offset by half a step: no coordinate of
# one equals one of the other and no overlap is exactly zero wide, so
# gradients are evaluated away from the formula's kinks (gradcheck perturbs by
# 1e-6; the grids are 1/8 apart).  Ties at the kinks are tested in
# test_boxes.py.

def make_boxes(n, device, dtype, requires_grad=False, *, cells=16, step=1.0, offset=0.0,
               max_size=6, transposed=False):
    """n boxes with corners on the grid offset + step * k, k in [0, cells + max_size]."""
    xy = torch.randint(0, cells, (n, 2), device=device)
    wh = torch.randint(1, max_size + 1, (n, 2), device=device)
    b = (torch.cat([xy, xy + wh], 1).to(torch.float64) * step + offset).to(dtype)
    if transposed:
        b = b.t().contiguous().t()
    return b.detach().requires_grad_(requires_grad)


def make_scores(n, device, dtype):
    return torch.rand(n, device=device, dtype=torch.float64).to(dtype)


def _iou_matrix_ref(b1, b2):
    """torchvision.ops.box_iou's formula, in plain PyTorch."""
    area1 = (b1[:, 2] - b1[:, 0]) * (b1[:, 3] - b1[:, 1])
    area2 = (b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])
    lt = torch.max(b1[:, None, :2], b2[:, :2])
    rb = torch.min(b1[:, None, 2:], b2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2 - inter)


def nms_ref(boxes, scores, iou_threshold, idxs=None):
    """Greedy NMS in float64, the textbook loop (torchvision's semantics)."""
    boxes, scores = boxes.detach().double(), scores.detach().double()
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    iou = _iou_matrix_ref(boxes, boxes)
    if idxs is not None:
        iou = torch.where(idxs[:, None] == idxs[None, :], iou, torch.zeros_like(iou))
    suppressed = [False] * len(order)
    keep = []
    for i in order:
        if suppressed[i]:
            continue
        keep.append(i)
        for j in torch.nonzero(iou[i] > iou_threshold).flatten().tolist():
            suppressed[j] = True
    return torch.tensor(keep, dtype=torch.int64, device=boxes.device)


def _nms_sample_boxes(device, dtype, requires_grad):
    """(name, boxes, scores) cases shared by nms and batched_nms."""
    rg = requires_grad
    for n in (0, 1, 2, 7, 64, 65, 150):
        yield f"n{n}", make_boxes(n, device, dtype, rg), make_scores(n, device, dtype)
    # Crowded: few grid cells, heavy suppression, chains across 64-box blocks.
    yield "crowded", make_boxes(200, device, dtype, rg, cells=6), make_scores(200, device, dtype)
    # Sparse: large grid, almost everything kept.
    yield "sparse", make_boxes(130, device, dtype, rg, cells=200, max_size=8), make_scores(130, device, dtype)
    # Identical boxes and equal scores: input order breaks the ties.
    b = make_boxes(1, device, dtype).expand(9, 4).contiguous().requires_grad_(rg)
    yield "identical", b, torch.full((9,), 0.5, device=device, dtype=dtype)
    # Non-contiguous inputs: boxes stored column-major, every other score.
    yield ("strided", make_boxes(70, device, dtype, rg, transposed=True),
           make_scores(140, device, dtype)[::2])


def _nms_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_sample_boxes(device, dtype, requires_grad)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        yield Sample((boxes, scores, thr), name=f"{name}_t{thr}")
    b = make_boxes(40, device, dtype, requires_grad)
    s = make_scores(40, device, dtype)
    for thr in (0.0, 1.0, -0.5):  # 0: any overlap suppresses; 1: nothing; <0: everything later
        yield Sample((b, s, thr), name=f"t{thr}")


def _nms_errors_common(op, device, extra):
    """Invalid calls for nms / batched_nms; `extra` = arguments after scores."""
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    name = rf"torchops\.{op}"
    yield ErrorInput(Sample((b(5), b(5), *extra(5))), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 5), b(5), *extra(5))), rf"{name}.*'boxes'.*\(N, 4\)")
    yield ErrorInput(Sample((b(5, 4), b(5, 1), *extra(5))), rf"{name}.*'scores'.*\(N,\)")
    yield ErrorInput(Sample((b(5, 4), b(4), *extra(5))), rf"{name}.*'scores'.*N = 5")
    yield ErrorInput(Sample((b(5, 4, dt=torch.int64), b(5, dt=torch.int64), *extra(5))),
                     rf"{name}.*'boxes'.*floating")
    yield ErrorInput(Sample((b(5, 4), b(5, dt=torch.float64), *extra(5))),
                     rf"{name}.*'scores'.*same dtype")
    yield ErrorInput(Sample((b(5, 4), b(5), *extra(5)[:-1], float("nan"))),
                     rf"{name}.*'iou_threshold'")
    if device != "cpu":
        yield ErrorInput(Sample((b(5, 4), b(5, dev="cpu"), *extra(5))), rf"{name}.*'scores'")


def _nms_errors(device):
    yield from _nms_errors_common("nms", device, lambda n: (0.5,))


NMS = OpInfo(
    name="nms",
    op=torch.ops.torchops.nms.default,
    wrapper=torchops.nms,
    reference=nms_ref,
    sample_inputs=_nms_samples,
    error_inputs=_nms_errors,
    differentiable=False,
    data_dependent_output=True,
)


def _batched_nms_ref(boxes, scores, idxs, iou_threshold):
    return nms_ref(boxes, scores, iou_threshold, idxs)


def _batched_nms_samples(device, dtype, requires_grad=False):
    for i, (name, boxes, scores) in enumerate(_nms_sample_boxes(device, dtype, requires_grad)):
        thr = (0.3, 0.5, 0.7)[i % 3]
        n = boxes.shape[0]
        idxs = torch.randint(0, 3, (n,), device=device)
        yield Sample((boxes, scores, idxs, thr), name=f"{name}_t{thr}")
    n = 100
    boxes, scores = make_boxes(n, device, dtype, requires_grad, cells=6), make_scores(n, device, dtype)
    # Categories far apart, negative, beyond int32; and one category for all.
    wide = torch.tensor([-(2**40), -3, 0, 7, 2**40], device=device)[torch.randint(0, 5, (n,), device=device)]
    yield Sample((boxes, scores, wide, 0.5), name="wide_idxs")
    yield Sample((boxes, scores, torch.zeros(n, dtype=torch.int64, device=device), 0.5), name="one_category")
    yield Sample((boxes, scores, torch.arange(n, device=device).flip(0), 0.0), name="all_distinct")
    yield Sample((boxes, scores, torch.randint(0, 4, (2 * n,), device=device)[::2], 0.4), name="strided_idxs")


def _batched_nms_errors(device):
    idx = lambda n: (torch.zeros(n, dtype=torch.int64, device=device), 0.5)  # noqa: E731
    yield from _nms_errors_common("batched_nms", device, idx)
    b, s = torch.zeros(5, 4, device=device), torch.zeros(5, device=device)
    yield ErrorInput(Sample((b, s, torch.zeros(5, dtype=torch.int32, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, torch.zeros(5, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*int64")
    yield ErrorInput(Sample((b, s, torch.zeros(4, dtype=torch.int64, device=device), 0.5)),
                     r"torchops\.batched_nms.*'idxs'.*N = 5")
    if device != "cpu":
        yield ErrorInput(Sample((b, s, torch.zeros(5, dtype=torch.int64), 0.5)),
                         r"torchops\.batched_nms.*'idxs'")


BATCHED_NMS = OpInfo(
    name="batched_nms",
    op=torch.ops.torchops.batched_nms.default,
    wrapper=torchops.batched_nms,
    reference=_batched_nms_ref,
    sample_inputs=_batched_nms_samples,
    error_inputs=_batched_nms_errors,
    differentiable=False,
    data_dependent_output=True,
)


def _box_iou_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    # Two grids a half step apart (see the section comment); coordinates < 8
    # so that bfloat16 holds them exactly.
    b1 = lambda n, **kw: make_boxes(n, device, dtype, rg, cells=12, step=0.25,  # noqa: E731
                                    offset=1 / 16, max_size=16, **kw)
    b2 = lambda n, **kw: make_boxes(n, device, dtype, rg, cells=12, step=0.25,  # noqa: E731
                                    offset=3 / 16, max_size=16, **kw)
    for n, m in ((3, 5), (1, 1), (0, 4), (4, 0), (0, 0), (17, 33), (64, 65), (2, 300)):
        yield Sample((b1(n), b2(m)), name=f"iou{n}x{m}")
    yield Sample((b1(9, transposed=True), b2(11, transposed=True)), name="transposed")
    yield Sample((b1(20, transposed=True)[::2].detach().requires_grad_(rg), b2(6)), name="strided_rows")


def _box_iou_errors(device):
    b = lambda *s, dt=torch.float32, dev=device: torch.zeros(s, device=dev, dtype=dt)  # noqa: E731
    yield ErrorInput(Sample((b(4), b(3, 4))), r"torchops\.box_iou.*'boxes1'.*\(N, 4\)")
    yield ErrorInput(Sample((b(3, 4), b(3, 3))), r"torchops\.box_iou.*'boxes2'.*\(N, 4\)")
    yield ErrorInput(Sample((b(3, 4), b(2, 3, 4))), r"torchops\.box_iou.*'boxes2'")
    yield ErrorInput(Sample((b(3, 4), b(3, 4, dt=torch.float64))), r"torchops\.box_iou.*'boxes2'.*dtype")
    yield ErrorInput(Sample((b(3, 4, dt=torch.int32), b(3, 4, dt=torch.int32))),
                     r"torchops\.box_iou.*'boxes1'.*floating")
    if device != "cpu":
        yield ErrorInput(Sample((b(3, 4), b(3, 4, dev="cpu"))), r"torchops\.box_iou.*'boxes2'")


BOX_IOU = OpInfo(
    name="box_iou",
    op=torch.ops.torchops.box_iou.default,
    wrapper=torchops.box_iou,
    reference=_iou_matrix_ref,
    sample_inputs=_box_iou_samples,
    error_inputs=_box_iou_errors,
    internal_ops=("_box_iou_backward",),
)


BOX_OPS: list[OpInfo] = [NMS, BATCHED_NMS, BOX_IOU]


# --- detection: RoI pooling -------------------------------------------------------------
# References follow torchvision's C++ semantics line by line, in float64, one
# RoI at a time (tests use few RoIs); everything inside a RoI is tensor math.

def _roi_align_axis_weights(v: torch.Tensor, size: int) -> torch.Tensor:
    """(n, size) matrix: row i interpolates linearly at coordinate v[i] with
    torchvision's boundary rules (0 outside [-1, size], clamped inside)."""
    valid = (v >= -1) & (v <= size)
    v = v.clamp(min=0)
    lo = v.floor().long()
    edge = lo >= size - 1
    lo = torch.where(edge, torch.full_like(lo, size - 1), lo)
    hi = torch.where(edge, lo, lo + 1)
    v = torch.where(edge, lo.to(v.dtype), v)
    frac = v - lo.to(v.dtype)
    m = torch.zeros(v.shape[0], size, dtype=v.dtype, device=v.device)
    if size == 0:
        return m
    rows = torch.arange(v.shape[0], device=v.device)
    keep = valid.to(v.dtype)
    m.index_put_((rows, lo.clamp(0, size - 1)), (1 - frac) * keep, accumulate=True)
    m.index_put_((rows, hi.clamp(0, size - 1)), frac * keep, accumulate=True)
    return m


def _roi_align_ref(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                   aligned):
    n, c, h, w = input.shape
    out = input.new_zeros((rois.shape[0], c, pooled_height, pooled_width))
    offset = 0.5 if aligned else 0.0
    for k, roi in enumerate(rois.tolist()):
        b = int(roi[0])
        x1, y1, x2, y2 = (v * spatial_scale - offset for v in roi[1:])
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
        grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_h)
        grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_w)
        if grid_h <= 0 or grid_w <= 0:
            continue

        def coords(start, bin_size, pooled, grid):
            p = torch.arange(pooled, dtype=input.dtype, device=input.device)[:, None]
            i = torch.arange(grid, dtype=input.dtype, device=input.device)[None, :]
            return (start + p * bin_size + (i + 0.5) * bin_size / grid).reshape(-1)

        wy = _roi_align_axis_weights(coords(y1, bin_h, pooled_height, grid_h), h)
        wx = _roi_align_axis_weights(coords(x1, bin_w, pooled_width, grid_w), w)
        samples = torch.einsum("yh,chw,xw->cyx", wy, input[b], wx)
        out[k] = samples.reshape(c, pooled_height, grid_h, pooled_width, grid_w).mean((2, 4))
    return out


def _round_half_away(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _roi_pool_ref(input, rois, spatial_scale, pooled_height, pooled_width):
    n, c, h, w = input.shape
    shape = (rois.shape[0], c, pooled_height, pooled_width)
    out = input.new_zeros(shape)
    argmax = torch.full(shape, -1, dtype=torch.int64, device=input.device)
    for k, roi in enumerate(rois.tolist()):
        b = int(roi[0])
        x1, y1, x2, y2 = (_round_half_away(v * spatial_scale) for v in roi[1:])
        bin_h = max(y2 - y1 + 1, 1) / pooled_height
        bin_w = max(x2 - x1 + 1, 1) / pooled_width
        for ph in range(pooled_height):
            hs = min(max(math.floor(ph * bin_h) + y1, 0), h)
            he = min(max(math.ceil((ph + 1) * bin_h) + y1, 0), h)
            for pw in range(pooled_width):
                ws = min(max(math.floor(pw * bin_w) + x1, 0), w)
                we = min(max(math.ceil((pw + 1) * bin_w) + x1, 0), w)
                if he <= hs or we <= ws or c == 0:
                    continue
                region = input[b, :, hs:he, ws:we].reshape(c, -1)
                value, idx = region.max(dim=1)  # first maximum wins, like the kernels
                out[k, :, ph, pw] = value
                argmax[k, :, ph, pw] = (hs + idx // (we - ws)) * w + ws + idx % (we - ws)
    return out, argmax


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


def _random_rois(n_images: int, k: int, height: int, width: int, scale: float, dtype, device,
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
                a, b = (_round_half_away(float(v) * scale) for v in (row[lo], row[hi]))
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


def _roi_features(shape, layout, device, dtype, requires_grad):
    if layout == "channels_last":
        t = make(shape, device, dtype).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        n, c, h, w = shape
        t = make((n, 2 * c, h, w + 3), device, dtype)[:, ::2, :, 1:w + 1]
    else:
        t = make(shape, device, dtype)
    return t.detach().requires_grad_(requires_grad)


def _roi_samples(device, dtype, requires_grad, extra):
    for seed, (name, shape, k, scale, (ph, pw), layout) in enumerate(_ROI_CASES):
        rois = _random_rois(shape[0], k, shape[2], shape[3], scale, dtype, device, seed,
                            (ph, pw))
        x = _roi_features(shape, layout, device, dtype, requires_grad)
        for tag, rest in extra(name):
            yield Sample((x, rois, scale, ph, pw, *rest), name=f"{name}{tag}")


def _roi_compile_samples(extra):
    """Three calls differing only in sizes (N, C, H, W and K), for the
    compile and export tests."""
    def samples(device, dtype, requires_grad=False):
        for seed, (shape, k) in enumerate([((2, 3, 10, 12), 6), ((3, 4, 13, 9), 5),
                                            ((2, 5, 8, 15), 9)]):
            x = make(shape, device, dtype, requires_grad)
            rois = _random_rois(shape[0], k, shape[2], shape[3], 1.0, dtype, device, 100 + seed,
                                (3, 2))
            yield Sample((x, rois, 1.0, 3, 2, *extra), name=f"compile{shape}x{k}")
    return samples


def _roi_large_samples(*extras):
    """Detection-like sizes for the --full profile: many overlapping boxes."""
    def samples(device, dtype, requires_grad=False):
        for seed, extra in enumerate(extras):
            x = make((2, 32, 48, 40), device, dtype, requires_grad)
            rois = _random_rois(2, 150, 48, 40, 0.25, dtype, device, 200 + seed)
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
        yield ErrorInput(Sample((x, rois, 1.0, 10**9, 10**9, *extra_args)),
                         rf"{name}: .*output of shape")
        if op == "roi_align":  # an explicit grid beyond MAX_SAMPLING_RATIO
            for sr in (65, 2**31 - 1, 2**62):
                yield ErrorInput(Sample((x, rois, 1.0, 2, 2, sr, False)),
                                 rf"{name}.*'sampling_ratio'.*at most 64")
        if device == "cpu":
            bad = rois.clone()
            bad[0, 0] = 1
            yield ErrorInput(Sample((x, bad, 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'.*batch index")
        else:
            yield ErrorInput(Sample((x, rois.cpu(), 1.0, 2, 2, *extra_args)), rf"{name}.*'rois'")
        # The torchvision-style wrapper: input, boxes, output_size.
        for boxes, size, error, what in [
                (rois[:, 1:], 2, RuntimeError, "'boxes'"),
                ([rois], 2, RuntimeError, "'boxes'"),
                ([], 2, ValueError, "'boxes'"),
                ("boxes", 2, TypeError, "'boxes'"),
                (rois, (2, 2, 2), ValueError, "'output_size'")]:
            yield ErrorInput(Sample((x, boxes, size)), rf"{name}.*{what}", error, via_wrapper=True)
    return errors


def _roi_wrapper_sample(s: Sample) -> Sample:
    """The op's (input, rois, spatial_scale, ph, pw, *rest) as the
    torchvision-style wrapper's (input, boxes, output_size, spatial_scale, *rest)."""
    x, rois, scale, ph, pw, *rest = s.args
    return Sample((x, rois, (ph, pw), scale, *rest), dict(s.kwargs), s.name)


ROI_ALIGN = OpInfo(
    name="roi_align",
    op=torch.ops.torchops.roi_align.default,
    wrapper=torchops.roi_align,
    reference=_roi_align_ref,
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
    op=torch.ops.torchops.roi_pool.default,
    wrapper=torchops.roi_pool,
    reference=_roi_pool_ref,
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

ROI_OPS: list[OpInfo] = [ROI_ALIGN, ROI_POOL]


# --- losses -----------------------------------------------------------------------------

def _focal_ref(inputs, targets, alpha=0.25, gamma=2.0, reduction="none"):
    """torchvision.ops.sigmoid_focal_loss, written out in plain PyTorch."""
    p = torch.sigmoid(inputs)
    ce = torch.nn.functional.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return {"none": lambda: loss, "mean": loss.mean, "sum": loss.sum}[reduction]()


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


SIGMOID_FOCAL_LOSS = OpInfo(
    name="sigmoid_focal_loss",
    op=torch.ops.torchops.sigmoid_focal_loss.default,
    wrapper=torchops.sigmoid_focal_loss,
    reference=_focal_ref,
    sample_inputs=_focal_samples,
    error_inputs=_focal_errors,
    internal_ops=("_sigmoid_focal_loss_backward",),
    # Sums of a few hundred half-precision terms: rounding of the result.
    tols={torch.float16: Tol(2e-3, 2e-3), torch.bfloat16: Tol(2e-2, 2e-2)},
    autocast=True,
    sample_inputs_large=_focal_large,
)

LOSS_OPS: list[OpInfo] = [SIGMOID_FOCAL_LOSS]


OP_DB: list[OpInfo] = [MATMUL, D_SIGMOID, *BOX_OPS, *ROI_OPS, *LOSS_OPS]


def ops_by_name() -> dict[str, OpInfo]:
    return {o.name: o for o in OP_DB}


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_dtype_params(op: OpInfo) -> list[tuple[str, torch.dtype]]:
    return [(d, dt) for d in devices() for dt in op.dtypes.get(d, ())]


__all__ = [n for n in dir() if not n.startswith("_")
           and n not in ("itertools", "math", "os", "Any")]
