"""Timing one callable: warm-up, cold caches, median of many repeats.

Rules (the reasons are in docs/benchmarks.md):

* The first call is never timed: it compiles (torch.compile), autotunes
  (cuBLAS, cuDNN) and grows the caching allocator.  Further untimed calls
  follow until the warm-up has lasted a little while.
* Caches are kept cold in one of two ways.  When the caller can afford enough
  input sets to overflow the last-level cache (L2 on a GPU, L3 on a CPU), the
  calls *rotate* through them and are timed in blocks.  When a problem is so
  small that even many sets fit in the cache, each call is timed alone after
  an untimed *flush* (zeroing a buffer twice the cache size).
* CUDA calls are timed with CUDA events (device time, no host
  synchronisation inside a block); CPU calls with ``time.perf_counter``.
* The result is the median over samples and its interquartile range.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Measurement", "measure", "cache_bytes", "make_flush"]


@dataclass
class Measurement:
    median: float      # seconds per call
    p25: float
    p75: float
    samples: int       # timed blocks (rotation) or timed calls (flush)
    calls: int         # timed calls in all
    method: str        # "rotate xN" or "flush"

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_UNITS = {"": 0, "K": 10, "M": 20, "G": 30}


@functools.lru_cache(maxsize=None)
def cache_bytes(device: str) -> int:
    """Size of the last-level cache that a cold-cache measurement must defeat:
    the GPU's L2, or the CPU's last level summed over its distinct instances
    (one per socket or core complex) that the threads may run on."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", 0) or 50 << 20)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}
    instances: dict[tuple[int, str], int] = {}
    for cpu in cpus:
        for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
            try:
                level = int((index / "level").read_text())
                shared = (index / "shared_cpu_list").read_text().strip()
                m = re.fullmatch(r"(\d+)([KMG]?)", (index / "size").read_text().strip())
            except (OSError, ValueError):
                continue
            if m:
                instances[(level, shared)] = int(m.group(1)) << _UNITS[m.group(2)]
    if not instances:
        return 32 << 20
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def make_flush(device: str) -> Callable[[], None]:
    """A function that evicts the last-level cache by writing over it."""
    buf = torch.empty(2 * cache_bytes(device) // 4, dtype=torch.float32, device=device)
    return buf.zero_


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def measure(call: Callable[[int], object], *, device: str, n_sets: int = 1,
            flush: Callable[[], None] | None = None, min_time: float = 0.1,
            max_time: float = 2.0, min_samples: int = 5, first_call_done: bool = False
            ) -> Measurement:
    """Time ``call(i)`` (``i`` picks the input set, ``0 <= i < n_sets``).

    Samples are taken until they add up to ``min_time`` seconds and number at
    least ``min_samples``, or until ``max_time`` seconds of wall time have
    passed (at least one sample is always taken).  With ``flush``, every call
    is a sample and is preceded by an untimed flush; otherwise samples are
    blocks of calls rotating through the input sets.  ``first_call_done``:
    the caller already made the first (compiling, autotuning) call.
    """
    # Warm-up: the first call compiles/autotunes; then a few more calls
    # estimate the cost of one (host-synchronised, so an upper bound).
    if not first_call_done:
        call(0)
    _sync(device)
    warm_until = min_time / 4
    n, start = 0, time.perf_counter()
    while True:
        if flush is not None:
            flush()
        call(n % n_sets)
        n += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if (n >= 2 and elapsed >= warm_until) or elapsed >= max_time / 4:
            break
    per_call = elapsed / n

    samples: list[float] = []   # seconds per call
    calls = 0
    idx = 0
    wall_start = time.perf_counter()

    def done() -> bool:
        if not samples:
            return False
        if time.perf_counter() - wall_start >= max_time:
            return True
        timed = sum(samples) * calls / len(samples)  # every sample covers calls/len(samples) calls
        return timed >= min_time and len(samples) >= min_samples

    if flush is not None:
        # One call per sample.  On CUDA a batch of calls is queued with an
        # event pair around each, and read after one synchronisation.
        batch = 1 if device == "cpu" else max(1, min(20, int(0.02 / max(per_call, 1e-6))))
        while not done():
            if device == "cuda":
                events = []
                for _ in range(batch):
                    flush()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    call(idx % n_sets)
                    b.record()
                    events.append((a, b))
                    idx += 1
                torch.cuda.synchronize()
                samples += [a.elapsed_time(b) / 1e3 for a, b in events]
                calls += batch
            else:
                flush()
                t0 = time.perf_counter()
                call(idx % n_sets)
                samples.append(time.perf_counter() - t0)
                idx += 1
                calls += 1
        method = "flush"
    else:
        # Blocks of `inner` calls, about a tenth of min_time each.
        inner = max(1, min(10_000, round(min_time / 10 / max(per_call, 1e-7))))
        while not done():
            _sync(device)
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    call(idx % n_sets)
                    idx += 1
                b.record()
                b.synchronize()
                block = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    call(idx % n_sets)
                    idx += 1
                block = time.perf_counter() - t0
            samples.append(block / inner)
            calls += inner
        method = f"rotate x{n_sets}"
    p25, med, p75 = _quartiles(samples)
    return Measurement(median=med, p25=p25, p75=p75, samples=len(samples), calls=calls,
                       method=method)
