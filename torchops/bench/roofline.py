"""The machine's roofline, measured in the same run as the benchmarks.

* Peak bandwidth: a large device-to-device copy (``dst.copy_(src)``), counted
  as bytes read plus bytes written.  1 GiB on a GPU, 256 MiB on a CPU.
* Peak FLOP/s: ``torch.mm`` of square matrices in the row's dtype (8192 on a
  GPU, 2048 on a CPU), i.e. what cuBLAS / the CPU BLAS reach.

Both are measured lazily, once per (device, dtype, thread count), so a CPU
row at one thread is compared with the one-thread roofline.  GPU rows pass
``threads=0``.
"""

from __future__ import annotations

import torch

from torchops.bench.timing import measure

__all__ = ["Roofline"]


class Roofline:
    def __init__(self, device: str, quick: bool = False):
        self.device = device
        self.quick = quick
        self._bw: dict[int, float] = {}
        self._flops: dict[tuple[str, int], float] = {}

    def bandwidth(self, threads: int) -> float:
        """Bytes per second."""
        if threads not in self._bw:
            mib = (256 if self.device == "cuda" else 32) if self.quick else \
                (1024 if self.device == "cuda" else 256)
            src = torch.ones(mib << 18, dtype=torch.float32, device=self.device)
            dst = torch.empty_like(src)
            m = measure(lambda i: dst.copy_(src), device=self.device,
                        min_time=0.05 if self.quick else 0.3, min_samples=3)
            self._bw[threads] = 2 * src.nbytes / m.median
            del src, dst
        return self._bw[threads]

    def flops(self, dtype: torch.dtype, threads: int) -> float:
        """Floating-point operations per second of torch.mm in `dtype`."""
        key = (str(dtype).removeprefix("torch."), threads)
        if key not in self._flops:
            n = (4096 if self.device == "cuda" else 512) if self.quick else \
                (8192 if self.device == "cuda" else 2048)
            a = torch.randn(n, n, device=self.device).to(dtype)
            b = torch.randn(n, n, device=self.device).to(dtype)
            m = measure(lambda i: torch.mm(a, b), device=self.device,
                        min_time=0.05 if self.quick else 0.3, min_samples=3)
            self._flops[key] = 2 * n**3 / m.median
            del a, b
        return self._flops[key]

    def to_dict(self) -> dict:
        """Keys: the thread count (CPU) or "gpu"; for FLOP/s, "dtype@threads"."""
        where = lambda t: str(t) if t else "gpu"  # noqa: E731
        return {
            "bandwidth_GBps": {where(t): round(v / 1e9, 1) for t, v in self._bw.items()},
            "mm_TFLOPs": {f"{d}@{where(t)}": round(v / 1e12, 3)
                          for (d, t), v in self._flops.items()},
        }
