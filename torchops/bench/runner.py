"""Runs benchmark cases: one :class:`Row` per (case, device, size, threads).

Per variant: a first, untimed call (it compiles; its output is kept for the
cross-check against torchops's), then :func:`torchops.bench.timing.measure`.
A variant's failure becomes a note in the row; it never stops the run.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, TextIO

import torch

from torchops.bench.cases import VARIANTS, Case, Size
from torchops.bench.timing import Measurement, Roofline, input_sets, measure

__all__ = ["Options", "Row", "run", "plan", "ALL_THREADS", "fmt_time"]

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
    compile_only: bool = False           # only compile every row's compiled variant
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
    names: dict[str, str] = field(default_factory=dict)   # variant -> what was timed
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

    def speedup(self, variant: str | None) -> float | None:
        """How many times faster torchops is than `variant` (>1: torchops wins)."""
        ours, theirs = self.seconds("torchops"), self.seconds(variant) if variant else None
        return theirs / ours if ours and theirs else None

    def best(self) -> str | None:
        """The strongest alternative: the fastest one timed in this row."""
        return min((v for v in VARIANTS[1:] if v in self.results), key=self.seconds, default=None)

    def throughput(self, variant: str = "torchops") -> float | None:
        """Work per second, in the unit of `metric`."""
        t = self.seconds(variant)
        return self.work / t / (1e12 if self.metric == "TFLOP/s" else 1e9) if t and self.work else None

    def roofline_pct(self, variant: str = "torchops") -> float | None:
        t = self.seconds(variant)
        return 100.0 * self.work / t / self.peak if t and self.work and self.peak else None

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "results"}
        d["best"] = self.best()
        d["results"] = {v: {**asdict(m), "throughput": self.throughput(v),
                            "roofline_pct": self.roofline_pct(v),
                            "torchops_speedup": self.speedup(v) if v != "torchops" else None}
                        for v, m in self.results.items()}
        return d


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            break
    return f"{seconds / scale:.3g} {unit}"


def plan(cases: list[Case], devices: list[str], quick: bool,
         threads: tuple[int | str, ...] | None = None) -> list[tuple[Case, str, Size, int]]:
    """Every row to run, in order: case, device, size, thread count (0 on GPUs)."""
    rows = []
    for device in devices:
        for case in cases:
            for size in case.sizes_for(device, quick):
                counts = sorted({ALL_THREADS if t == "all" else int(t)
                                 for t in threads or size.threads}) if device == "cpu" else [0]
                rows += [(case, device, size, t) for t in counts]
    return rows


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


@contextlib.contextmanager
def _deterministic(on: bool):
    prev = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on or prev[0], warn_only=prev[1] and not on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


def _compare(ours, theirs, dtype: torch.dtype) -> str | None:
    """None when the outputs agree, else what differs."""
    # Loose enough for another summation order or cuBLAS's reduced-precision
    # half accumulation; a wrong kernel is off by O(1).
    tolerance = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-3)
    for a, b in zip(ours, theirs):
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
        if not err <= tolerance:
            return f"relative error {err:.2g}"
    return None


def _step(fn: Callable, sets: list[tuple], diff_inputs: list, grads) -> Callable[[int], object]:
    if grads is None:
        return lambda i: fn(*sets[i])
    return lambda i: torch.autograd.grad(
        [t for t in _tensors(fn(*sets[i])) if t.requires_grad], diff_inputs[i], grads)


def _row(case: Case, device: str, size: Size, threads: int, **kw) -> Row:
    return Row(case=case.name, op=case.op, device=device, size=size.label,
               dtype=str(size.dtype).removeprefix("torch."), threads=threads,
               backward=case.backward, deterministic=case.deterministic, **kw)


def _variants(case: Case, row: Row, opts: Options) -> dict[str, Callable]:
    out: dict[str, Callable] = {"torchops": case.torchops_fn()}
    row.names["torchops"] = f"torch.ops.torchops.{case.op}"
    if case.reference is not None:
        out["eager"], row.names["eager"] = case.reference, case.reference_name
        if case.compile and opts.compile:
            # One compilation per row.  Resetting dynamo first compiles each
            # size statically, as a user with that one shape would, and never
            # hits the recompile limit.  The lambda gives dynamo a Python frame
            # to trace, also where the reference is a builtin (torch.matmul).
            torch._dynamo.reset()
            out["compiled"] = torch.compile(lambda *a, ref=case.reference: ref(*a))
            row.names["compiled"] = f"torch.compile({case.reference_name})"
    if case.peer is not None and not opts.compile_only:
        row.names["peer"] = case.peer.name
        if case.peer.slow and not opts.slow:
            row.notes.append(f"peer {case.peer.name}: not timed (slow; use --slow)")
        else:
            try:
                out["peer"] = case.peer.load()
            except ImportError as e:
                row.notes.append(f"peer {case.peer.name}: not installed ({e})")
    return out


def _run_row(case: Case, device: str, size: Size, row: Row, opts: Options,
             rooflines: dict[str, Roofline]) -> None:
    torch.manual_seed(0)
    make = lambda: case.inputs(size.params, device, size.dtype, case.backward)  # noqa: E731
    sets, variants = [make()], _variants(case, row, opts)
    if opts.compile_only:
        variants = {k: v for k, v in variants.items() if k == "compiled"}
        if not variants:
            row.notes.append("nothing to compile")
    else:
        if case.flops or case.bytes:
            roof = rooflines.setdefault(device, Roofline(device, opts.quick))
            row.metric = "TFLOP/s" if case.flops else "GB/s"
            row.work = float((case.flops or case.bytes)(sets[0]))
            row.peak = (roof.flops(size.dtype, row.threads) if case.flops
                        else roof.bandwidth(row.threads))
        sets += [make() for _ in range(input_sets(device, sum(
            t.numel() * t.element_size() for t in _tensors(sets[0]))) - 1)]
    diff_inputs = [[t for t in _tensors(s) if t.requires_grad] for s in sets]
    grads, outputs = None, {}
    with _deterministic(case.deterministic):
        for name, fn in variants.items():
            try:
                t0 = time.perf_counter()
                out = fn(*sets[0])  # the first call compiles: never timed
                if case.backward:
                    diff_out = [t for t in _tensors(out) if t.requires_grad]
                    if grads is None:
                        grads = [torch.randn_like(t) for t in diff_out]
                    torch.autograd.grad(diff_out, diff_inputs[0], grads)
                if opts.compile_only:  # the call filled torch.compile's on-disk caches
                    row.notes.append(f"compiled in {time.perf_counter() - t0:.1f} s")
                    continue
                outputs[name] = [t.detach() for t in _tensors(out)]
                del out
                row.results[name] = measure(_step(fn, sets, diff_inputs, grads), device,
                                            len(sets), **opts.timing(device))
            except Exception as e:  # noqa: BLE001  (one variant's failure is a note)
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                row.notes.append(f"{name}: {type(e).__name__}: {msg}")
    if "torchops" in outputs and len(outputs) > 1:
        bad = [f"vs {n}: {d}" for n, o in outputs.items()
               if n != "torchops" and (d := _compare(outputs["torchops"], o, size.dtype))]
        row.check = "MISMATCH " + "; ".join(bad) if bad else "ok"


def _progress_line(i: int, n: int, row: Row) -> str:
    where = row.device + (f" {row.threads}thr" if row.threads else "")
    head = f"[{i}/{n}] {where} {row.case} {row.size} {row.dtype}:"
    if not row.results:
        return f"{head} {'skipped: ' if row.skipped else ''}{'; '.join(row.notes) or 'nothing timed'}"
    parts = [f"{v} {fmt_time(row.seconds(v))}" + (f" ({row.speedup(v):.2f}x)" if v != "torchops"
                                                   else "") for v in VARIANTS if v in row.results]
    return f"{head} " + " | ".join(parts) + (f"  [{row.check}]" if row.check.startswith("MISMATCH") else "")


def _deadlines(todo: list, budget: float | None) -> list[float]:
    """Seconds from the start by which each row must have started.  With
    several devices the budget is shared in proportion to their row counts
    (time one leaves unused passes to the next), so a slow GPU run cannot
    starve the CPU rows."""
    devices = [d for _, d, _, _ in todo]
    ends = {d: budget * (len(devices) - devices[::-1].index(d)) / len(todo) if budget is not None else math.inf
            for d in devices}
    return [ends[d] for d in devices]


def run(cases: list[Case], devices: list[str], opts: Options) -> tuple[list[Row], dict]:
    """Run every row of `cases` on `devices`; returns the rows and the rooflines."""
    todo = plan(cases, devices, opts.quick, opts.threads)
    rows: list[Row] = []
    rooflines: dict[str, Roofline] = {}
    start = time.monotonic()
    for i, ((case, device, size, threads), deadline) in enumerate(
            zip(todo, _deadlines(todo, opts.time_budget)), 1):
        if i == 1 or device != todo[i - 2][1]:
            what = torch.cuda.get_device_name() if device == "cuda" else f"{ALL_THREADS} threads"
            print(f"bench: {device} ({what}): {sum(d == device for _, d, _, _ in todo)} rows",
                  file=opts.progress, flush=True)
        row = _row(case, device, size, threads)
        rows.append(row)
        if case.missing() or time.monotonic() - start > deadline:
            row.skipped = True
            row.notes.append(case.missing() or f"not run: its share of the "
                             f"{opts.time_budget:.0f} s time budget was spent")
        else:
            if threads:
                torch.set_num_threads(threads)
            # Inductor generates CPU code for (and keys its on-disk cache by)
            # the thread count at compile time: pin it to the row's, so a
            # compiled CPU variant runs on the row's threads and no other
            # count's compilation is reused.
            pin = contextlib.nullcontext()
            if device == "cpu" and threads and opts.compile:
                import torch._inductor.config as inductor_config

                pin = inductor_config.patch({"cpp.threads": threads})
            try:
                with pin:
                    _run_row(case, device, size, row, opts, rooflines)
            finally:
                torch.set_num_threads(ALL_THREADS)
                if device == "cuda":
                    torch.cuda.empty_cache()
        print(_progress_line(i, len(todo), row), file=opts.progress, flush=True)
    return rows, {d: r.to_dict() for d, r in rooflines.items()}
