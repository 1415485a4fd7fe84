"""Timing one callable with PyTorch's and Triton's own tools, and the roofline.

CUDA with Triton: ``triton.testing.do_bench``, which zeroes a 256 MB buffer
before every call (a cold L2 at any problem size) and times each call alone
with CUDA events.  CPU: blocks of calls with the standard library's timeit,
the blocks of a row's variants interleaved (measure_interleaved), under
``torch.utils.benchmark``'s stop rule.  A lone variant, and CUDA without
Triton: ``torch.utils.benchmark.Timer.adaptive_autorange`` (synchronising
the accelerator around each block).  Neither can flush a cache between
calls, so the calls rotate through enough input sets to overflow the
last-level cache.  The caller makes the first call (compilation,
autotuning), so it is never timed.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils.benchmark import Timer

MAX_SETS, MAX_SETS_BYTES = 256, 1 << 30   # input sets rotated through, at most


@dataclass
class Measurement:
    median: float      # seconds per call
    p25: float
    p75: float
    samples: int       # timed calls (do_bench) or timed blocks of calls (Timer)
    calls: int         # timed calls in all
    method: str        # "do_bench" or "rotate xN"

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25


@functools.lru_cache(maxsize=None)
def _do_bench() -> Callable | None:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return do_bench


def _warm_up(step: Callable[[int], object], n_sets: int, min_time: float) -> float:
    """Untimed calls first (50 ms, or a third of the timing budget if less),
    so that the row's first variant does not alone meet threads and cores
    that the input sets' creation (one thread) left idle.  A precaution, not
    a cure: it narrows the spread of a row's ratio between fresh runs, but
    does not remove it.  Returns the seconds per call."""
    t0, i = time.perf_counter(), 0
    while time.perf_counter() < t0 + min(0.05, min_time / 3) or i == 0:
        step(i % n_sets)
        i += 1
    return (time.perf_counter() - t0) / i


def _time(step: Callable[[int], object], device: str, n_sets: int, min_time: float,
          max_time: float) -> tuple[list[float], int, str]:
    """Seconds per call of each timed call or block of calls, how many calls
    were timed, and the method's name."""
    if device == "cuda" and _do_bench() is not None:
        # Budgets in ms; "all" returns every call's time, for quartiles and counts.
        ms = _do_bench()(lambda: step(0), warmup=250 * min_time, rep=1e3 * min_time,
                         return_mode="all")
        return [float(t) / 1e3 for t in ms], len(ms), "do_bench"
    _warm_up(step, n_sets, min_time)
    sets = itertools.cycle(range(n_sets))
    # num_threads: Timer would otherwise run on one thread.
    m = Timer("step(next(sets))", globals={"step": step, "sets": sets},
              num_threads=torch.get_num_threads()
              ).adaptive_autorange(min_run_time=min_time, max_run_time=max_time)
    return list(m.times), len(m.times) * m.number_per_run, f"rotate x{n_sets}"


def _summary(times: list[float], calls: int, method: str) -> Measurement:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return Measurement(q[1], q[0], q[2], len(times), calls, method)


def measure(step: Callable[[int], object], device: str, n_sets: int = 1, *,
            min_time: float, max_time: float) -> Measurement:
    """Time ``step(i)``, ``i`` the input set, for about ``min_time`` seconds
    (at most ``max_time`` with the Timer)."""
    return _summary(*_time(step, device, n_sets, min_time, max_time))


# Why measure_interleaved alternates: the CPU rows run on shared hosts whose
# speed drifts by tens of percent within a minute, so timed one after the
# other, torchops and torch.mm can meet different speeds (one kernel's
# ratio to torch.mm then moves by a quarter between bench runs, though each
# variant's own IQR stays under 10%).  Blocks of about
# min_time / BLOCKS_PER_MIN seconds; the stop rule is adaptive_autorange's.
BLOCKS_PER_MIN, AGREE = 8, 0.1


def measure_interleaved(steps: dict[str, Callable[[int], object]], device: str,
                        n_sets: int = 1, *, min_time: float, max_time: float,
                        ) -> tuple[dict[str, Measurement], dict[str, Exception]]:
    """:func:`measure` of every step, with their blocks of calls interleaved
    on the Timer's path: one block of each step a pass, in an order that
    reverses from pass to pass (A B, B A, A B, ...), so a drift of the
    machine's speed falls on all of them alike.  A step leaves the passes once
    it has run ``min_time`` seconds in more than three blocks whose IQR is
    within 10% of their median, or has run ``max_time``.  On a GPU
    (do_bench times every call alone; the Timer synchronises around each
    block), or for one step, the steps are measured one after the other.
    Returns the measurements and, apart, the exception of each step that
    raised (not timed further)."""
    failed: dict[str, Exception] = {}
    # timeit does not synchronise a GPU: only CPU rows are interleaved.
    if device != "cpu" or len(steps) < 2:
        got = {}
        for name, step in steps.items():
            try:
                got[name] = measure(step, device, n_sets, min_time=min_time, max_time=max_time)
            except Exception as e:  # noqa: BLE001  (the caller reports it)
                failed[name] = e
        return got, failed
    timers, number = {}, {}
    for name, step in steps.items():
        try:
            per_call = _warm_up(step, n_sets, min_time)  # also sizes the blocks
        except Exception as e:  # noqa: BLE001
            failed[name] = e
            continue
        number[name] = max(1, int(min_time / BLOCKS_PER_MIN / per_call))
        # The standard library's timeit: torch's Timer.timeit would call the
        # step untimed before every block; the row has set torch's threads.
        timers[name] = timeit.Timer("step(next(sets))", globals={
            "step": step, "sets": itertools.cycle(range(n_sets))})
    blocks: dict[str, list[float]] = {n: [] for n in timers}
    spent = dict.fromkeys(timers, 0.0)

    def agreed(ts: list[float]) -> bool:
        if len(ts) < 4:
            return False
        q = statistics.quantiles(ts, n=4, method="inclusive")
        return q[2] - q[0] <= AGREE * q[1]

    order, passes = list(timers), 0
    while order:
        for name in order if passes % 2 == 0 else order[::-1]:
            try:
                t = timers[name].timeit(number[name])
            except Exception as e:  # noqa: BLE001
                failed[name] = e
                continue
            blocks[name].append(t / number[name])
            spent[name] += t
        passes += 1
        # A step leaves the rotation once done (adaptive_autorange's rule, per
        # step, on its own blocks): no more blocks of a step that has agreed
        # while another, noisier or slower, still has to.
        order = [n for n in order if n not in failed and spent[n] < max_time
                 and not (spent[n] >= min_time and agreed(blocks[n]))]
    return {n: _summary(blocks[n], len(blocks[n]) * number[n], f"rotate x{n_sets}")
            for n in timers if n not in failed}, failed


def input_sets(device: str, set_bytes: int) -> int:
    """How many input sets :func:`measure` should rotate through: enough to
    overflow the last-level cache twice, within MAX_SETS and MAX_SETS_BYTES
    (so the smallest problems may stay partly cached); one for do_bench."""
    if device == "cuda" and _do_bench() is not None:
        return 1
    set_bytes = max(set_bytes, 1)
    return max(1, min(math.ceil(2 * cache_bytes(device) / set_bytes), MAX_SETS,
                      MAX_SETS_BYTES // set_bytes))


@functools.lru_cache(maxsize=None)
def cache_bytes(device: str) -> int:
    """The GPU's L2, or the CPU's last level summed over its instances
    (sockets, core complexes) that this process may run on."""
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(), "L2_cache_size", 0) or 50 << 20)
    sizes: dict[tuple[int, str], int] = {}
    for cpu in os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}:
        for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
            try:
                level, shared, size = ((index / f).read_text().strip()
                                       for f in ("level", "shared_cpu_list", "size"))
                unit = {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
                sizes[int(level), shared] = int(size.rstrip("KMG")) << unit
            except (OSError, ValueError, IndexError):
                continue
    top = max((level for level, _ in sizes), default=0)
    return sum(v for (level, _), v in sizes.items() if level == top) or 32 << 20


class Roofline:
    """Peaks measured in the run, lazily, once per (device, dtype, thread
    count), timed like the rows: bandwidth from a large ``copy_`` (bytes read
    plus written), FLOP/s from ``torch.mm`` of square matrices in the row's
    dtype (what cuBLAS / the CPU BLAS reach).  GPU rows pass ``threads=0``."""

    def __init__(self, device: str, quick: bool):
        self.device, self.quick, self.peaks = device, quick, {}

    def _measure(self, key: tuple, work: float, fn: Callable) -> None:
        fn()
        # Longer than a row's timing: every row of the device divides by it.
        timing = dict(min_time=0.05, max_time=0.5) if self.quick else dict(min_time=0.3, max_time=3)
        self.peaks[key] = work / measure(lambda i: fn(), self.device, **timing).median

    def bandwidth(self, threads: int) -> float:
        """Bytes per second."""
        if ("copy", threads) not in self.peaks:
            mib = {"cuda": 1024, "cpu": 256}[self.device] // (4 if self.quick else 1)
            src = torch.ones(mib << 18, device=self.device)  # float32: MiB << 18 values
            dst = torch.empty_like(src)
            self._measure(("copy", threads), 2 * src.nbytes, lambda: dst.copy_(src))
        return self.peaks["copy", threads]

    def flops(self, dtype: torch.dtype, threads: int, tf32: bool | None = None) -> float:
        """float32's peak is TF32's where `tf32` says so (None: where the
        matmul precision setting allows TF32)."""
        if tf32 is None:
            tf32 = torch.get_float32_matmul_precision() != "highest"
        tf32 = tf32 and dtype == torch.float32
        name = str(dtype).removeprefix("torch.") + ("(tf32)" if tf32 else "")
        if (name, threads) not in self.peaks:
            n = ((4096 if self.quick else 8192) if self.device == "cuda"
                 else (512 if self.quick else 2048))
            a, b = (torch.randn(n, n, device=self.device).to(dtype) for _ in range(2))
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            try:
                self._measure((name, threads), 2 * n**3, lambda: torch.mm(a, b))
            finally:
                torch.set_float32_matmul_precision(before)
        return self.peaks[name, threads]

    def to_dict(self) -> dict:
        """Keys: the thread count (CPU) or "gpu"; for FLOP/s, "dtype@threads"."""
        where = lambda t: str(t) if t else "gpu"  # noqa: E731
        return {"bandwidth_GBps": {where(t): round(v / 1e9, 1)
                                   for (k, t), v in self.peaks.items() if k == "copy"},
                "mm_TFLOPs": {f"{k}@{where(t)}": round(v / 1e12, 3)
                              for (k, t), v in self.peaks.items() if k != "copy"}}
