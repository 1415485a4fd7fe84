"""Runs benchmark cases: one :class:`Row` per (case, device, size, threads).

Per row: seed, make the inputs (enough sets to overflow the last-level cache,
else a flush before every call), set the CPU thread count, then per variant:
a first, untimed call (it compiles, autotunes; its output is kept for the
cross-check), then :func:`torchops.bench.timing.measure`.  Failures of one
variant become a note in the row; they never stop the run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import torch

from torchops.bench.case import VARIANTS, Case, Size
from torchops.bench.roofline import Roofline
from torchops.bench.timing import Measurement, cache_bytes, make_flush, measure

__all__ = ["Options", "Row", "run", "plan", "ALL_THREADS", "fmt_time"]

# torch's default intra-op thread count, captured before any row changes it.
ALL_THREADS = torch.get_num_threads()

MAX_SETS = 64            # input sets rotated through, at most
MAX_SETS_BYTES = 1 << 30  # and at most this much memory for them


@dataclass
class Options:
    quick: bool = False
    slow: bool = False
    compile: bool = True
    min_time: float | None = None        # seconds of timed calls per variant
    time_budget: float | None = None     # seconds for the whole run
    threads: tuple[int | str, ...] | None = None  # CPU thread counts for every row (else the case's)
    compile_only: bool = False           # only compile every row's compiled variant, time nothing
    progress: TextIO = field(default_factory=lambda: sys.stderr)

    def timing(self, device: str) -> dict:
        min_time = self.min_time or (0.02 if self.quick else (0.1 if device == "cuda" else 0.15))
        return dict(min_time=min_time, max_time=max(10 * min_time, 0.5 if self.quick else 1.5),
                    min_samples=3 if self.quick else 7)


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
    names: dict[str, str]           # variant -> what was timed
    results: dict[str, Measurement] = field(default_factory=dict)
    metric: str | None = None       # "TFLOP/s" or "GB/s"
    work: float | None = None       # FLOPs or bytes per call
    peak: float | None = None       # roofline, in work per second
    check: str = "-"
    notes: list[str] = field(default_factory=list)
    skipped: bool = False

    def seconds(self, variant: str) -> float | None:
        m = self.results.get(variant)
        return m.median if m else None

    def throughput(self, variant: str = "torchops") -> float | None:
        """Work per second, in the unit of `metric` (TFLOP/s or GB/s)."""
        t = self.seconds(variant)
        if t is None or self.work is None:
            return None
        return self.work / t / (1e12 if self.metric == "TFLOP/s" else 1e9)

    def roofline_pct(self, variant: str = "torchops") -> float | None:
        t = self.seconds(variant)
        if t is None or self.work is None or not self.peak:
            return None
        return 100.0 * self.work / t / self.peak

    def speedup(self, variant: str) -> float | None:
        """How many times faster torchops is than `variant` (>1: torchops wins)."""
        ours, theirs = self.seconds("torchops"), self.seconds(variant)
        if ours is None or theirs is None or ours <= 0:
            return None
        return theirs / ours

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "case", "op", "device", "size", "dtype", "threads", "backward", "deterministic",
            "names", "metric", "work", "peak", "check", "notes", "skipped")}
        d["results"] = {}
        for v, m in self.results.items():
            d["results"][v] = {**m.to_dict(), "throughput": self.throughput(v),
                               "roofline_pct": self.roofline_pct(v),
                               "torchops_speedup": self.speedup(v) if v != "torchops" else None}
        return d


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            break
    return f"{seconds / scale:.3g} {unit}"


def _threads(spec: int | str) -> int:
    return ALL_THREADS if spec == "all" else int(spec)


def plan(cases: list[Case], devices: list[str], quick: bool,
         threads: tuple[int | str, ...] | None = None) -> list[tuple[Case, str, Size, int]]:
    """Every row to run, in order: device, case, size, thread count (0 on GPUs)."""
    rows = []
    for device in devices:
        for case in cases:
            for size in case.sizes_for(device, quick):
                counts = [0]
                if device == "cpu":
                    counts = sorted({_threads(t) for t in (threads or size.threads)})
                rows += [(case, device, size, t) for t in counts]
    return rows


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _nbytes(args) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(list(args)))


@functools.lru_cache(maxsize=None)
def _flush_for(device: str) -> Callable[[], None]:
    return make_flush(device)


def _cold_plan(device: str, set_bytes: int) -> tuple[int, Callable[[], None] | None]:
    """(input sets to rotate through, flush or None) so calls see a cold cache."""
    target = 2 * cache_bytes(device)
    if set_bytes >= target:
        return 1, None
    need = math.ceil(target / max(set_bytes, 1))
    if need <= MAX_SETS and need * set_bytes <= MAX_SETS_BYTES:
        return need, None
    return 1, _flush_for(device)


@contextlib.contextmanager
def _deterministic(on: bool):
    if not on:
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _tolerance(dtype: torch.dtype) -> float:
    # Loose enough for another summation order or cuBLAS's reduced-precision
    # half accumulation; a wrong kernel is off by O(1).
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-3)


def _compare(ours, theirs, dtype: torch.dtype) -> str | None:
    """None when the outputs agree, else what differs."""
    for a, b in zip(_tensors(ours), _tensors(theirs)):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.numel() == 0:
            continue
        if not a.is_floating_point():
            if not torch.equal(a.cpu(), b.cpu().to(a.dtype)):
                return "different values"
            continue
        a64, b64 = a.double(), b.double().to(a.device)
        err = (a64 - b64).abs().max().item() / max(b64.abs().max().item(), 1e-30)
        if not err <= _tolerance(dtype):
            return f"relative error {err:.2g}"
    return None


class Runner:
    def __init__(self, opts: Options):
        self.opts = opts
        self.rooflines: dict[str, Roofline] = {}
        self._compiled_key = None
        self._compiled_fn = None

    def roofline(self, device: str) -> Roofline:
        if device not in self.rooflines:
            self.rooflines[device] = Roofline(device, quick=self.opts.quick)
        return self.rooflines[device]

    def _compiled(self, case: Case, device: str, size: Size, threads: int) -> Callable:
        # One compilation per row.  Resetting dynamo first compiles each size
        # statically, as a user with that one shape would, and never hits the
        # recompile limit.  CPU rows also differ by thread count: inductor's
        # C++ kernels are generated for the thread count at compile time
        # (see _inductor_threads).
        key = (case.name, device, size.label, threads)
        if key != self._compiled_key:
            torch._dynamo.reset()
            reference = case.reference

            def target(*args):
                return reference(*args)

            self._compiled_key, self._compiled_fn = key, torch.compile(target)
        return self._compiled_fn

    def _variants(self, case: Case, device: str, size: Size, row: Row) -> dict[str, Callable]:
        out: dict[str, Callable] = {"torchops": case.torchops_fn()}
        row.names["torchops"] = f"torch.ops.torchops.{case.op}"
        if case.reference is not None:
            out["eager"] = case.reference
            row.names["eager"] = case.reference_name
            if case.compile and self.opts.compile:
                out["compiled"] = self._compiled(case, device, size, row.threads)
                row.names["compiled"] = f"torch.compile({case.reference_name})"
        if case.peer is not None:
            row.names["peer"] = case.peer.name
            if case.peer.slow and not self.opts.slow:
                row.notes.append(f"peer {case.peer.name}: not timed (slow; use --slow)")
            else:
                try:
                    out["peer"] = case.peer.load()
                except ImportError as e:
                    row.notes.append(f"peer {case.peer.name}: not installed ({e})")
        return out

    def run_row(self, case: Case, device: str, size: Size, threads: int) -> Row:
        row = Row(case=case.name, op=case.op, device=device, size=size.label,
                  dtype=str(size.dtype).removeprefix("torch."), threads=threads,
                  backward=case.backward, deterministic=case.deterministic, names={})
        why = case.missing()
        if why:
            row.skipped = True
            row.notes.append(why)
            return row
        if threads:
            torch.set_num_threads(threads)
        try:
            with self._inductor_threads(device, threads):
                if self.opts.compile_only:
                    self._compile_row(case, device, size, row)
                else:
                    self._run_row(case, device, size, threads, row)
        finally:
            torch.set_num_threads(ALL_THREADS)
            if device == "cuda":
                torch.cuda.empty_cache()
        return row

    def _inductor_threads(self, device: str, threads: int):
        """Pin the thread count inductor generates CPU code for (and keys its
        on-disk cache by) to the row's, so a compiled CPU variant runs on the
        row's threads and a cached compilation for another count is never
        reused."""
        if device != "cpu" or not threads or not self.opts.compile:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config

        return inductor_config.patch({"cpp.threads": threads})

    def _compile_row(self, case: Case, device: str, size: Size, row: Row) -> None:
        """Compile the row's compiled variant (one call, forward and backward
        as timed), which fills torch.compile's on-disk caches for a later run."""
        if case.reference is None or not case.compile:
            row.notes.append("nothing to compile")
            return
        torch.manual_seed(0)
        args = case.inputs(size.params, device, size.dtype, case.backward)
        t0 = time.perf_counter()
        try:
            with _deterministic(case.deterministic):
                out = self._compiled(case, device, size, row.threads)(*args)
                if case.backward:
                    diff = [t for t in _tensors(out) if t.requires_grad]
                    torch.autograd.grad(diff, [t for t in _tensors(list(args)) if t.requires_grad],
                                        [torch.ones_like(t) for t in diff])
        except Exception as e:  # noqa: BLE001
            row.notes.append(f"compiled: {type(e).__name__}: {str(e).strip()[:200]}")
            return
        row.notes.append(f"compiled in {time.perf_counter() - t0:.1f} s")

    def _run_row(self, case: Case, device: str, size: Size, threads: int, row: Row) -> None:
        torch.manual_seed(0)
        make = lambda: case.inputs(size.params, device, size.dtype, case.backward)  # noqa: E731
        sets = [make()]
        if case.flops is not None:
            row.metric, row.work = "TFLOP/s", float(case.flops(sets[0]))
            row.peak = self.roofline(device).flops(size.dtype, threads)
        elif case.bytes is not None:
            row.metric, row.work = "GB/s", float(case.bytes(sets[0]))
            row.peak = self.roofline(device).bandwidth(threads)
        n_sets, flush = _cold_plan(device, _nbytes(sets[0]))
        sets += [make() for _ in range(n_sets - 1)]
        diff_inputs = [[t for t in _tensors(list(s)) if t.requires_grad] for s in sets]
        grads = None
        outputs = {}
        timing = self.opts.timing(device)
        with _deterministic(case.deterministic):
            for name, fn in self._variants(case, device, size, row).items():
                try:
                    out = fn(*sets[0])
                    if case.backward:
                        diff_out = [t for t in _tensors(out) if t.requires_grad]
                        if grads is None:
                            grads = [torch.randn_like(t) for t in diff_out]
                        torch.autograd.grad(diff_out, diff_inputs[0], grads)
                    outputs[name] = [t.detach() for t in _tensors(out)]
                    del out
                    row.results[name] = measure(self._step(fn, sets, diff_inputs, grads),
                                                device=device, n_sets=n_sets, flush=flush,
                                                first_call_done=True, **timing)
                except Exception as e:  # noqa: BLE001  (one variant's failure is a note)
                    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                    row.notes.append(f"{name}: {type(e).__name__}: {msg}")
        mismatches = []
        for name, out in outputs.items():
            if name != "torchops" and "torchops" in outputs:
                diff = _compare(outputs["torchops"], out, size.dtype)
                if diff:
                    mismatches.append(f"vs {name}: {diff}")
        if mismatches:
            row.check = "MISMATCH " + "; ".join(mismatches)
        elif len(outputs) > 1 and "torchops" in outputs:
            row.check = "ok"

    @staticmethod
    def _step(fn: Callable, sets: list[tuple], diff_inputs, grads) -> Callable[[int], object]:
        if grads is None:
            return lambda i: fn(*sets[i])

        def fwd_bwd(i: int):
            out = fn(*sets[i])
            return torch.autograd.grad([t for t in _tensors(out) if t.requires_grad],
                                       diff_inputs[i], grads)
        return fwd_bwd


def _progress_line(i: int, n: int, row: Row) -> str:
    where = f"{row.device}" + (f" {row.threads}thr" if row.threads else "")
    head = f"[{i}/{n}] {where} {row.case} {row.size} {row.dtype}:"
    if row.skipped:
        return f"{head} skipped ({'; '.join(row.notes)})"
    if not row.results:
        return f"{head} {'; '.join(row.notes) or 'nothing timed'}"
    parts = []
    for v in VARIANTS:
        if v in row.results:
            s = row.speedup(v) if v != "torchops" else None
            parts.append(f"{v} {fmt_time(row.seconds(v))}" + (f" ({s:.2f}x)" if s else ""))
    line = f"{head} " + " | ".join(parts or ["nothing timed"])
    if row.check.startswith("MISMATCH"):
        line += f"  [{row.check}]"
    return line


def _deadlines(todo: list, budget: float | None) -> list[float]:
    """Seconds from the start by which each row must have started.  With
    several devices the budget is shared in proportion to their row counts
    (time one leaves unused passes to the next), so a slow GPU run cannot
    starve the CPU rows."""
    if budget is None:
        return [math.inf] * len(todo)
    devices = list(dict.fromkeys(device for _, device, _, _ in todo))
    count = {d: sum(1 for _, dev, _, _ in todo if dev == d) for d in devices}
    ends, acc = {}, 0
    for d in devices:
        acc += count[d]
        ends[d] = budget * acc / len(todo)
    return [ends[device] for _, device, _, _ in todo]


def run(cases: list[Case], devices: list[str], opts: Options) -> tuple[list[Row], dict]:
    """Run every row of `cases` on `devices`; returns the rows and the rooflines."""
    todo = plan(cases, devices, opts.quick, opts.threads)
    deadlines = _deadlines(todo, opts.time_budget)
    runner = Runner(opts)
    rows: list[Row] = []
    start = time.monotonic()
    for i, ((case, device, size, threads), deadline) in enumerate(zip(todo, deadlines), 1):
        if i == 1 or device != todo[i - 2][1]:
            n = sum(1 for _, d, _, _ in todo if d == device)
            what = torch.cuda.get_device_name() if device == "cuda" else f"{ALL_THREADS} threads"
            print(f"bench: {device} ({what}): {n} rows", file=opts.progress, flush=True)
        if time.monotonic() - start > deadline:
            row = Row(case=case.name, op=case.op, device=device, size=size.label,
                      dtype=str(size.dtype).removeprefix("torch."), threads=threads,
                      backward=case.backward, deterministic=case.deterministic, names={},
                      skipped=True, notes=[f"not run: its share of the {opts.time_budget:.0f} s "
                                           "time budget was spent"])
        else:
            row = runner.run_row(case, device, size, threads)
        rows.append(row)
        print(_progress_line(i, len(todo), row), file=opts.progress, flush=True)
    return rows, {d: r.to_dict() for d, r in runner.rooflines.items()}
