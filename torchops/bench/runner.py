"""Runs benchmark cases: one :class:`Row` per (case, device, size, CPU threads).

Per variant: a first, untimed call on a copy of the first input set (it
compiles; its output is kept for the cross-check against torchops's, and a
variant that writes into its inputs, as Liger's rotary does, changes no
other's); then all variants are timed together by
:func:`torchops.bench.timing.measure_interleaved`.
A variant's failure becomes a note in the row; it never stops the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, TextIO

import torch

from torchops.bench.cases import Case, Size
from torchops.bench.inputs import Call
from torchops.bench.timing import Measurement, Roofline, input_sets, measure_interleaved

# torch's default intra-op thread count, captured before any row changes it.
ALL_THREADS = torch.get_num_threads()


@dataclass
class Options:
    quick: bool = False
    slow: bool = False
    compile: bool = True
    min_time: float | None = None        # seconds of timed calls per variant
    time_budget: float | None = None     # seconds for the whole run
    threads: tuple[int | str, ...] | None = None  # CPU thread counts for every row
    compile_only: bool = False           # only call every row's compiled variant once
    progress: TextIO = field(default_factory=lambda: sys.stderr)

    def timing(self, device: str) -> dict:
        t = self.min_time or (0.02 if self.quick else 0.1 if device == "cuda" else 0.15)
        return dict(min_time=t, max_time=max(10 * t, 0.5 if self.quick else 1.5))


@dataclass
class Row:
    case: str
    op: str
    device: str
    size: str
    dtype: str
    threads: int                    # CPU threads; 0 for GPU rows
    backward: bool
    deterministic: bool
    requires_grad: bool = False     # forward only, inputs requiring gradients
    # variant -> what was timed; in column order: torchops, eager, compiled, peers
    names: dict[str, str] = field(default_factory=dict)
    bounds: list[str] = field(default_factory=list)       # peers that are bounds
    results: dict[str, Measurement] = field(default_factory=dict)
    metric: str | None = None       # "TFLOP/s" or "GB/s"
    work: float | None = None       # FLOPs or bytes per call
    peak: float | None = None       # roofline, in work per second
    check: str = "-"
    notes: list[str] = field(default_factory=list)
    skipped: bool = False
    # Cases with `memory`: per variant, the peak bytes one call allocated
    # beyond what was allocated before it (the inputs), and the bytes of what
    # it returned (its outputs; the gradients, for fwd+bwd rows).
    peak_bytes: dict[str, int] = field(default_factory=dict)
    returned_bytes: dict[str, int] = field(default_factory=dict)

    def extra_bytes(self, variant: str) -> int | None:
        """The peak beyond the inputs and what the call returned: the
        working memory the variant needs (for a training step, beyond its
        gradients)."""
        if variant not in self.peak_bytes:
            return None
        return self.peak_bytes[variant] - self.returned_bytes.get(variant, 0)

    def seconds(self, variant: str | None) -> float | None:
        return self.results[variant].median if variant in self.results else None

    def speedup(self, variant: str | None) -> float | None:
        """How many times faster torchops is than `variant` (>1: torchops wins)."""
        ours, theirs = self.seconds("torchops"), self.seconds(variant)
        return theirs / ours if ours and theirs else None

    def alternatives(self) -> list[str]:
        """Every variant but torchops, timed or not, in column order."""
        return [v for v in dict.fromkeys([*self.names, *self.results]) if v != "torchops"]

    def best(self) -> str | None:
        """The strongest alternative: the fastest one timed in this row
        (eager, compiled or any peer; never a bound)."""
        return min((v for v in self.alternatives() if v in self.results and v not in self.bounds),
                   key=self.seconds, default=None)

    def throughput(self, variant: str = "torchops") -> float | None:
        """Work per second, in the unit of `metric`."""
        t = self.seconds(variant)
        scale = 1e12 if self.metric == "TFLOP/s" else 1e9
        return self.work / t / scale if t and self.work else None

    def roofline_pct(self, variant: str = "torchops") -> float | None:
        t = self.seconds(variant)
        return 100.0 * self.work / t / self.peak if t and self.work and self.peak else None

    def to_dict(self) -> dict:
        return {**asdict(self), "best": self.best(), "results": {
            v: {**asdict(m), "throughput": self.throughput(v), "roofline_pct": self.roofline_pct(v),
                "torchops_speedup": self.speedup(v) if v != "torchops" else None}
            for v, m in self.results.items()}}


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    unit, scale = next(((u, s) for u, s in (("s", 1), ("ms", 1e-3)) if seconds >= s), ("us", 1e-6))
    return f"{seconds / scale:.3g} {unit}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    unit, scale = next(((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if abs(n) >= s), ("B", 1))
    return f"{n / scale:.3g} {unit}"


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _cpu_peak(call: Callable[[], object]) -> tuple[object, int]:
    """call()'s result and the peak of torch's CPU allocations during it,
    beyond those alive before it, from the profiler's allocation events (the
    CPU allocator reports each allocation and free to it; the event tree is
    the profiler's experimental API).  Memory that bypasses torch's
    allocator (a kernel's std::vector, a BLAS's scratch) is not seen."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = call()
    sizes, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        todo.extend(node.children)
    level = peak = 0
    for _, size in sorted(sizes):
        level += size
        peak = max(peak, level)
    return out, peak


def peak_memory(call: Callable[[], object], device: str) -> tuple[int, int]:
    """(peak bytes allocated during call() beyond those allocated before it,
    bytes of the tensors it returned).  CUDA: torch.cuda.max_memory_allocated
    around the call; CPU: :func:`_cpu_peak`."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        out, peak = _cpu_peak(call)
    returned = _storage_bytes(_tensors(out))
    del out
    return peak, returned


def plan(cases: list[Case], devices: list[str], quick: bool,
         threads: tuple[int | str, ...] | None = None) -> list[tuple[Case, str, Size, int]]:
    """Every row to run, in order: case, device, size, thread count (0 on GPUs)."""
    counts = lambda size: sorted({ALL_THREADS if t == "all" else int(t)  # noqa: E731
                                  for t in threads or size.threads})
    return [(case, device, size, t) for device in devices for case in cases
            for size in case.sizes_for(device, quick)
            for t in (counts(size) if device == "cpu" else [0])]


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of `out`, lists and an inputs.Call's keyword arguments included."""
    if isinstance(out, (tuple, list)):
        more = list(out.kwargs.values()) if isinstance(out, Call) else []
        return [t for o in [*out, *more] for t in _tensors(o)]
    return [out] if isinstance(out, torch.Tensor) else []


def _call(fn: Callable, args: tuple):
    """fn on an input set: its positional arguments and an inputs.Call's keywords."""
    return fn(*args, **getattr(args, "kwargs", {}))


def _write_back(case: Case, reference: Callable) -> Callable:
    """An in-place case's reference that writes the new values it returns
    into the arguments the op writes, as the op does (one that returns None
    has written them itself).  The values pair with the written arguments'
    tensors in order (the schema's, lists flattened; arguments not given
    have none), so one written list may come back as a bare list."""
    def call(*args, **kwargs):
        out = reference(*args, **kwargs)
        if out is None:
            return None
        dst, src = _tensors(case.written(Call(args, kwargs))), _tensors(out)
        if len(dst) != len(src):
            raise RuntimeError(f"the reference returned {len(src)} tensors for the {len(dst)} "
                               f"that torchops.{case.op} writes")
        with torch.no_grad():
            for t, v in zip(dst, src):
                t.copy_(v)
        return None
    return call


def _checked(case: Case, args: tuple, out) -> list[torch.Tensor]:
    """What the check compares of a call on `args` that returned `out`: the
    outputs, or for an in-place case the arguments the op writes."""
    return _tensors(case.written(args)) if case.in_place else [t.detach() for t in _tensors(out)]


def check_outputs(case: Case, fn: Callable, args: tuple) -> list[torch.Tensor]:
    """:func:`_checked` of one call of `fn` on a copy of `args` (for an
    in-place case whose reference returns the new values: `fn` the
    reference, written back)."""
    if case.in_place and fn is case.reference:
        fn = _write_back(case, fn)
    first = _copy(args)
    return _checked(case, first, _call(fn, first))


@contextlib.contextmanager
def _deterministic(on: bool):
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on or prev, warn_only=warn_only and not on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn_only)


def _compare(ours: list, theirs: list, dtype: torch.dtype,
             own_dtype: bool = False) -> str | None:
    """None when the outputs agree, else what differs.  Integer outputs (kept
    indices) must be equal; floating ones within a tolerance relative to the
    largest value, loose enough for another summation order or cuBLAS's
    reduced-precision accumulation (a wrong kernel is off by O(1)): the
    row's dtype's, or with `own_dtype` each tensor's (an optimizer's float32
    states and masters beside bf16 parameters: a step moves them by about
    lr, which the bf16 tolerance would not see)."""
    for a, b in zip(ours, theirs):
        if own_dtype:
            dtype = a.dtype
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not a.is_floating_point():
            if not torch.equal(a, b.to(a.dtype)):
                return "different values"
        elif a.numel():
            a, b = a.double(), b.double()
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
            if not err <= {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-3):
                return f"relative error {err:.2g}"
    return None


LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOAT32_CHECK = "reference (float32)"


def _in_float32(fn: Callable, dtype: torch.dtype) -> Callable:
    """fn with its float16 and bfloat16 tensor arguments widened to float32
    and its floating outputs rounded to `dtype` (differentiable both ways)."""
    def up(a):
        if isinstance(a, (tuple, list)):
            return type(a)(up(t) for t in a)
        return a.float() if isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION else a

    def down(o):
        if isinstance(o, (tuple, list)):
            return type(o)(down(t) for t in o)
        return o.to(dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o

    return lambda *args, **kwargs: down(fn(*[up(a) for a in args],
                                           **{k: up(v) for k, v in kwargs.items()}))


def _variants(case: Case, row: Row, opts: Options) -> dict[str, Callable]:
    out: dict[str, Callable] = {"torchops": case.torchops_fn()}
    row.names["torchops"] = f"torch.ops.torchops.{case.op}"
    reference = case.reference
    if reference is not None and case.in_place:
        reference = _write_back(case, reference)
    if reference is not None and case.eager:
        out["eager"], row.names["eager"] = reference, case.reference_name
        if case.compile and opts.compile:
            # One compilation per row: resetting dynamo compiles each size
            # statically, as a user with that one shape would, and never hits
            # the recompile limit.  The lambda gives dynamo a Python frame to
            # trace, also where the reference is a builtin (torch.matmul).
            torch._dynamo.reset()
            out["compiled"] = torch.compile(lambda *a, ref=reference, **kw: ref(*a, **kw))
            row.names["compiled"] = f"torch.compile({case.reference_name})"
    for peer in case.all_peers(row.device) if not opts.compile_only else ():
        row.names[peer.label] = peer.name
        if peer.bound:
            row.bounds.append(peer.label)
        try:
            if peer.slow and not opts.slow:
                row.notes.append(f"peer {peer.name}: not timed (slow; use --slow)")
            else:
                out[peer.label] = peer.load()
        except ImportError as e:
            row.notes.append(f"peer {peer.name}: not installed ({e})")
        except Exception as e:  # noqa: BLE001  (a broken install is a note, not the run's end)
            row.notes.append(_failure_note(f"peer {peer.name} (loading)", e))
    return {k: v for k, v in out.items() if k == "compiled" or not opts.compile_only}


def _copy(args: tuple) -> tuple:
    """The arguments with every tensor copied (same strides, same
    requires_grad; in lists and an inputs.Call's keywords too), so a call
    that writes into its inputs leaves them be."""
    def one(a):
        if isinstance(a, list):
            return [one(t) for t in a]
        # A broadcast (a stride 0 over several elements) cannot be copied
        # stride for stride; it is read-only in practice: shared.
        if not isinstance(a, torch.Tensor) or any(st == 0 and n > 1
                                                  for n, st in zip(a.shape, a.stride())):
            return a
        c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        with torch.no_grad():
            c.copy_(a)
        return c.requires_grad_(a.requires_grad)
    if isinstance(args, Call):
        return Call([one(a) for a in args], {k: one(v) for k, v in args.kwargs.items()},
                    args.keep)
    return tuple(one(a) for a in args)


def _run_row(case: Case, device: str, size: Size, row: Row, opts: Options,
             rooflines: dict[str, Roofline]) -> None:
    torch.manual_seed(0)
    variants = _variants(case, row, opts)
    if opts.compile_only and not variants:  # no inputs made (an optimizer's take GBs)
        row.notes.append("nothing to compile")
        return
    sets = [case.make_inputs(size, device)]
    if not opts.compile_only:
        if case.flops or case.bytes:
            roof = rooflines.setdefault(device, Roofline(device, opts.quick))
            row.metric = "TFLOP/s" if case.flops else "GB/s"
            row.work = float((case.flops or case.bytes)(sets[0]))
            tf32 = (device == "cuda" and torch.backends.cudnn.allow_tf32
                    if case.conv_precision else None)
            row.peak = (roof.flops(size.dtype, row.threads, tf32) if case.flops
                        else roof.bandwidth(row.threads))
        set_bytes = sum(t.numel() * t.element_size() for t in _tensors(sets[0]))
        sets += [case.make_inputs(size, device) for _ in range(input_sets(device, set_bytes) - 1)]
    diff_inputs = [[t for t in _tensors(s) if t.requires_grad] for s in sets]
    grads, ours, steps, compared, bad = None, None, {}, 0, []
    # A reference that is not a timed variant (Case.eager False) still
    # checks torchops's result: one untimed call, after torchops's.
    checks = dict(variants)
    if case.reference is not None and not case.eager and not opts.compile_only:
        checks["reference"] = _write_back(case, case.reference) if case.in_place \
            else case.reference
    # A float32 check runs first: torchops is compared with it, the
    # low-precision eager and compiled variants are measured against it.
    exact = None
    if (case.check_in_float32 and size.dtype in LOW_PRECISION and case.reference is not None
            and not opts.compile_only):
        checks = {FLOAT32_CHECK: _in_float32(case.reference, size.dtype), **checks}
    with _deterministic(case.deterministic):
        for name, fn in checks.items():
            try:
                t0 = time.perf_counter()
                first = _copy(sets[0])
                out = _call(fn, first)  # the first call compiles: never timed
                if case.backward:
                    diff_out = [t for t in _tensors(out) if t.requires_grad]
                    grads = grads or [torch.randn_like(t) for t in diff_out]
                    torch.autograd.grad(diff_out, [t for t in _tensors(first) if t.requires_grad],
                                        grads)
                if opts.compile_only:  # the call filled torch.compile's on-disk caches
                    row.notes.append(f"compiled in {time.perf_counter() - t0:.1f} s")
                    continue
                got = _checked(case, first, out)
                del first, out
                # Compared at once and dropped (only torchops's result is
                # kept): an optimizer step's states take tens of GB.
                if name == FLOAT32_CHECK:
                    exact = got
                elif name == "torchops":
                    ours = got
                    if exact is not None:
                        compared += 1
                        if d := _compare(ours, exact, size.dtype):
                            bad.append(f"vs {FLOAT32_CHECK}: {d}")
                elif exact is not None and name in ("eager", "compiled"):
                    d = _compare(got, exact, size.dtype)
                    row.notes.append(f"{name} ({str(size.dtype).removeprefix('torch.')}) vs "
                                     f"{FLOAT32_CHECK}: {d or 'within tolerance'}")
                elif name not in row.bounds and ours is not None:
                    compared += 1
                    if d := _compare(ours, got, size.dtype, case.in_place):
                        bad.append(f"vs {name}: {d}")
                del got
                if name not in variants:
                    continue
                # fn and grads bound now: the steps are called after the loop.
                steps[name] = (lambda i, fn=fn: _call(fn, sets[i])) if grads is None else (
                    lambda i, fn=fn, g=grads: torch.autograd.grad(
                        [t for t in _tensors(_call(fn, sets[i])) if t.requires_grad],
                        diff_inputs[i], g))
            except Exception as e:  # noqa: BLE001  (one variant's failure is a note)
                row.notes.append(_failure_note(name, e))
        ours = None
        if steps:
            results, failed = measure_interleaved(steps, device, len(sets),
                                                  **opts.timing(device))
            row.results.update(results)
            row.notes += [_failure_note(name, e) for name, e in failed.items()]
            if case.memory:
                _measure_memory(steps, results, device, row)
    if compared:
        row.check = "MISMATCH " + "; ".join(bad) if bad else "ok"


def _measure_memory(steps: dict[str, Callable[[int], object]], timed: dict, device: str,
                    row: Row) -> None:
    """Each timed variant's peak memory over one more call on the first
    input set (its result, the gradients of a fwd+bwd row, kept until the
    peak is read)."""
    for name, step in steps.items():
        if name not in timed:
            continue
        try:
            row.peak_bytes[name], row.returned_bytes[name] = peak_memory(
                lambda step=step: step(0), device)
        except Exception as e:  # noqa: BLE001  (a note, as a failed variant)
            row.notes.append(_failure_note(f"{name} (memory)", e))
    if row.backward and "torchops" in row.returned_bytes:
        row.notes.append(f"gradients: {fmt_bytes(row.returned_bytes['torchops'])}")


def _failure_note(name: str, e: Exception) -> str:
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{name}: {type(e).__name__}: {msg}"


@contextlib.contextmanager
def _row_setting(size: Size):
    """The size's float32 matmul precision and environment, for the row only."""
    old_prec = torch.get_float32_matmul_precision()
    old_env = {k: os.environ.get(k) for k in size.env}
    if size.fp32_precision:
        torch.set_float32_matmul_precision(size.fp32_precision)
    os.environ.update(size.env)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_prec)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _progress_line(i: int, n: int, row: Row, secs: float | None = None) -> str:
    # The row's wall time (compilation, checks and timing): what the GPU
    # check's time budget has to cover.
    took = f" [{secs:.1f} s]" if secs is not None else ""
    head = f"[{i}/{n}]{took} {row.device}{f' {row.threads}thr' if row.threads else ''} " \
           f"{row.case} {row.size} {row.dtype}:"
    if not row.results:
        return f"{head} {'skipped: ' * row.skipped}{'; '.join(row.notes) or 'nothing timed'}"
    times = [f"{v} {fmt_time(row.seconds(v))}" + (f" ({row.speedup(v):.2f}x)" if v != "torchops"
                                                   else "") for v in row.results]
    return f"{head} {' | '.join(times)}" + f"  [{row.check}]" * row.check.startswith("MISMATCH")


def _deadlines(todo: list, budget: float | None) -> list[float]:
    """Seconds from the start by which each row must have started.  With
    several devices the budget is shared in proportion to their row counts
    (time one leaves unused passes to the next), so a slow GPU run cannot
    starve the CPU rows."""
    devices = [d for _, d, _, _ in todo]
    ends = {d: math.inf if budget is None else
            budget * (len(devices) - devices[::-1].index(d)) / len(devices) for d in devices}
    return [ends[d] for d in devices]


def run(cases: list[Case], devices: list[str], opts: Options) -> tuple[list[Row], dict]:
    """Run every row of `cases` on `devices`; returns the rows and the rooflines."""
    todo = plan(cases, devices, opts.quick, opts.threads)
    rows, rooflines, start = [], {}, time.monotonic()
    for i, ((case, device, size, threads), deadline) in enumerate(
            zip(todo, _deadlines(todo, opts.time_budget)), 1):
        if i == 1 or device != todo[i - 2][1]:
            what = torch.cuda.get_device_name() if device == "cuda" else f"{ALL_THREADS} threads"
            print(f"bench: {device} ({what}): {sum(d == device for _, d, _, _ in todo)} rows",
                  file=opts.progress, flush=True)
        rows.append(row := Row(case.name, case.op, device, size.label,
                               str(size.dtype).removeprefix("torch."), threads, case.backward,
                               case.deterministic, bool(case.grad_args()) and not case.backward))
        row_start = time.monotonic()
        if case.missing() or row_start - start > deadline:
            row.skipped = True
            row.notes.append(case.missing() or f"not run: its share of the "
                             f"{opts.time_budget:.0f} s time budget was spent")
        else:
            torch.set_num_threads(threads or ALL_THREADS)
            setting = _row_setting(size)
            # Inductor generates CPU code for (and keys its on-disk cache by)
            # the thread count at compile time: pin it to the row's, so a
            # compiled CPU variant runs on the row's threads and no other
            # count's compilation is reused.
            pin = contextlib.nullcontext()
            if device == "cpu" and threads and opts.compile:
                import torch._inductor.config as inductor_config

                pin = inductor_config.patch({"cpp.threads": threads})
            try:
                with pin, setting:
                    _run_row(case, device, size, row, opts, rooflines)
            finally:
                torch.set_num_threads(ALL_THREADS)
                if device == "cuda":
                    torch.cuda.empty_cache()
        print(_progress_line(i, len(todo), row, None if row.skipped else
                             time.monotonic() - row_start), file=opts.progress, flush=True)
    return rows, {d: r.to_dict() for d, r in rooflines.items()}
