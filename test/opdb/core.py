"""The op database's building blocks: OpInfo and its records (Sample,
ErrorInput, Tol, Skip), and the helpers that make sample tensors.  The
entries themselves live in one module per family (basic, boxes, roi, losses,
deform, masked_conv, upsample); the package docstring says how to write one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
DEVICE_TYPES = ("cpu", "cuda")

# The generic tests an entry's Skip records may name, each with the dtypes it
# runs at: ENTRY_DTYPES for every dtype of the entry (a parameter of the
# test), a tuple for the fixed ones, None for a test without a dtype.  A Skip
# may name a dtype only where the test runs at it.
ENTRY_DTYPES = "entry"
GENERIC_TESTS: dict[str, Any] = {
    "correctness": ENTRY_DTYPES,
    "wrapper": (torch.float64,),
    "cpu_vs_cuda": ENTRY_DTYPES,
    "autocast": HALF_DTYPES,
    "opcheck": (torch.float32,),
    "gradcheck": (torch.float64,),
    "gradgradcheck": (torch.float64,),
    "grad_vs_reference": (torch.float32, torch.bfloat16),
    "compile": (torch.float32,),
    "cuda_graph": (torch.float32,),
    "error_inputs": None,
    "fake_error_inputs": None,
    "export": (torch.float32,),
    "property": ENTRY_DTYPES,
    "sample_variety": None,
}
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def full_profile() -> bool:
    """True for the long GPU/nightly runs (``pytest --full`` or
    TORCHOPS_TEST_PROFILE=full): larger samples, more examples."""
    from torchops import envs

    return envs.get("TORCHOPS_TEST_PROFILE") == "full"


def devices() -> list[str]:
    """The device types of this machine."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
    # The overload to call when it is not the entry's own: one of its
    # internal (backward) ops, whose checks must hold like the forward's.
    op: torch._ops.OpOverload | None = None
    # Why only the real kernel can raise this (the check reads tensor values,
    # or only a real allocation fails), so the fake need not: the fake-error
    # test leaves such inputs out.  Empty: the fake raises it too.
    kernel_only: str = ""


@dataclass
class ShardingSample:
    """A call on DTensors over a 1-D mesh of two ranks (test_sharding.py).

    ``sample`` holds the full tensors, as the wrapper takes them; each rank
    makes the same ones (same seed).  ``inputs`` gives each positional
    argument's placement: "R" (Replicate), "S<d>" (Shard(d)) or None (not a
    tensor).  ``outputs`` gives the placement expected of each output ("P":
    Partial): the rule must run the op on the local shards, so the forward
    makes no collective call.  When a tensor requires grad, the backward runs
    too and each gradient's full tensor must equal the single-process one."""

    sample: Sample
    inputs: tuple
    outputs: tuple


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


@dataclass(frozen=True)
class Skip:
    """Do not run generic test `test` (a GENERIC_TESTS name) of an entry on
    `device` ("cpu", "cuda"; None: both) at `dtype` (None: every dtype), for
    the written `reason`.  With ``xfail`` the test runs and must fail
    (strict): a known bug, which shows when it is fixed."""

    test: str
    reason: str
    device: str | None = None
    dtype: torch.dtype | None = None
    xfail: bool = False

    def applies(self, test: str, device: str | None, dtype: torch.dtype | None) -> bool:
        """Whether this record covers `test` run on `device` at `dtype`
        (None: the run has no such parameter, so only records that leave it
        open apply)."""
        return (self.test == test and self.device in (None, device)
                and self.dtype in (None, dtype))


@dataclass
class OpInfo:
    """One operator; see the package docstring for what each field means."""

    name: str                                   # public name: torchops.<name>
    sample_inputs: Callable[..., Iterable[Sample]]   # (device, dtype, requires_grad) -> samples
    error_inputs: Callable[..., Iterable[ErrorInput]]  # (device) -> invalid calls
    dtypes: dict[str, tuple] = field(default_factory=lambda: {
        "cpu": FLOAT_DTYPES, "cuda": FLOAT_DTYPES})
    tols: dict = field(default_factory=dict)    # per-dtype overrides of DEFAULT_TOLS
    # None: derived, True unless the op writes its arguments (mutated_args).
    differentiable: bool | None = None
    supports_gradgrad: bool = False
    data_dependent_output: bool = False
    # Internal ops (backward kernels) that this entry exercises; the coverage
    # gate accepts them as covered.
    internal_ops: tuple[str, ...] = ()
    # Generic tests not run (or expected to fail) on some device/dtype, each
    # with its written reason.
    skips: list[Skip] = field(default_factory=list)
    # opcheck test_util (OPCHECK_UTILS) -> written reason for turning it off.
    opcheck_skips: dict[str, str] = field(default_factory=dict)
    # The op has AutocastCPU/AutocastCUDA kernels: the detection ops compute
    # in float32 and return the first floating input's dtype; matmul casts
    # its inputs to the region's dtype, as torch.matmul does.  The generic
    # test (region dtype = the first input's) holds for both.  The autocast
    # test runs for every op; with this set it also calls the op with mixed
    # float32/half inputs.
    autocast: bool = False
    # Op name (this entry's or one of its internal_ops) -> written reason why
    # torchops/bench/cases.py has no case timing it.
    no_benchmark: dict[str, str] = field(default_factory=dict)
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
    # Indices of the positional args the op writes in place (an inference op
    # such as fused_add_rms_norm_, whose schema marks them Tensor(a!)).  The
    # generic tests then call it on copies of those args (same strides) and
    # treat their new values, in order, as its outputs; the reference returns
    # them as a tuple.  Such an op has no gradients: differentiable is False.
    mutated_args: tuple[int, ...] = ()
    # Named after the op, so never given: torch.ops.torchops.<name>.default,
    # the typed Python wrapper torchops.<name>, and the pure-PyTorch
    # torchops.references.<name> (called on float64 copies).
    # (device) -> ShardingSample records: DTensor calls that the op's
    # sharding rules (torchops/sharding.py) must run shard-locally.
    sharding_samples: Callable[..., Iterable[ShardingSample]] | None = None
    # The dtype of the floating outputs for inputs of a dtype (a loss kept in
    # float32 for half inputs); None: the inputs' dtype.
    output_dtype: Callable[[torch.dtype], torch.dtype] | None = None
    op: torch._ops.OpOverload = field(init=False)
    wrapper: Callable = field(init=False)
    reference: Callable = field(init=False)

    def __post_init__(self):
        if self.differentiable is None:
            self.differentiable = not self.mutated_args
        if self.mutated_args:
            # The written args are the outputs: they keep the caller's layout.
            self.contiguous_outputs = False
        if self.mutated_args and self.differentiable:
            raise ValueError(f"{self.name}: an op that writes its arguments (mutated_args) "
                             f"has no gradients; leave differentiable unset")
        import torchops
        from torchops import references
        self.op = getattr(torch.ops.torchops, self.name).default
        self.wrapper = getattr(torchops, self.name)
        self.reference = getattr(references, self.name)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the floating outputs for floating inputs of `dtype`."""
        return dtype if self.output_dtype is None else self.output_dtype(dtype)

    def tol(self, dtype: torch.dtype) -> Tol:
        return self.tols.get(dtype, DEFAULT_TOLS[dtype])

    def qualname(self) -> str:
        return f"torchops::{self.name}"

    def skip_for(self, test: str, device: str | None = None,
                 dtype: torch.dtype | None = None) -> Skip | None:
        """The entry's Skip record for this run of a generic test, if any."""
        return next((s for s in self.skips if s.applies(test, device, dtype)), None)

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


def make_nchw(shape, layout, device, dtype, requires_grad=False) -> torch.Tensor:
    """An (N, C, H, W) tensor of `shape` in a memory layout: "contiguous",
    "channels_last", "transposed" (H and W swapped in memory) or "sliced"
    (every other channel, and columns 1..W, of a larger tensor)."""
    if layout == "transposed":
        return make_transposed(shape, device, dtype, requires_grad)
    if layout == "channels_last":
        t = make(shape, device, dtype).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        n, c, h, w = shape
        t = make((n, 2 * c, h, w + 2), device, dtype)[:, ::2, :, 1:w + 1]
    else:
        t = make(shape, device, dtype)
    return t.detach().requires_grad_(requires_grad)


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
