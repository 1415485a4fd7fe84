"""The declaration format of a benchmark: one :class:`Case` per op and mode.

A case says *what* to measure; :mod:`torchops.bench.runner` decides *how*
(warm-up, rotation, threads, compile, roofline).  Every row of the results is
one (case, device, size, thread count), timed for up to four variants:

* ``torchops`` -- the torchops operator, through the dispatcher;
* ``eager``    -- the case's pure-PyTorch reference, eagerly;
* ``compiled`` -- ``torch.compile`` of that same reference;
* ``peer``     -- the library users would otherwise call (torchvision ...).

All four are called with the same arguments, made by the case's input
factory; a peer with another signature is adapted in torchops/bench/peers.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["Size", "Peer", "Case", "VARIANTS"]

VARIANTS = ("torchops", "eager", "compiled", "peer")


@dataclass(frozen=True)
class Size:
    """One problem size: a label for the tables and the factory's parameters."""

    label: str
    params: Mapping[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    quick: bool = False                          # part of `--quick` runs
    threads: tuple[int | str, ...] = ("all",)    # CPU thread counts ("all": torch's default)


@dataclass(frozen=True)
class Peer:
    name: str                          # shown in the tables, e.g. "torchvision.ops.nms"
    load: Callable[[], Callable]       # imports lazily; raises ImportError when absent
    slow: bool = False                 # only timed with `--slow`


@dataclass
class Case:
    name: str                                   # unique, e.g. "roi_align fwd+bwd"
    op: str                                     # torch.ops.torchops.<op>; skipped when absent
    inputs: Callable[[Mapping[str, Any], str, torch.dtype, bool], tuple]
    sizes: Mapping[str, Sequence[Size]]         # device -> sizes
    reference: Callable | None = None           # pure PyTorch, same arguments as the op
    reference_name: str = "eager PyTorch"
    peer: Peer | None = None
    compile: bool = True                        # also time torch.compile(reference)
    backward: bool = False                      # time forward + backward
    deterministic: bool = False                 # under torch.use_deterministic_algorithms(True)
    # Work per call, from the arguments: floating-point operations (compute-
    # bound ops, rows report TFLOP/s) or compulsory bytes moved, every tensor
    # read or written once (memory-bound ops, rows report GB/s).
    flops: Callable[[tuple], float] | None = None
    bytes: Callable[[tuple], float] | None = None
    note: str = ""

    def missing(self) -> str | None:
        """Why this case cannot run in this build, or None."""
        if not hasattr(torch.ops.torchops, self.op):
            return f"torch.ops.torchops.{self.op} is not registered in this build"
        return None

    def torchops_fn(self) -> Callable:
        return getattr(torch.ops.torchops, self.op).default

    def sizes_for(self, device: str, quick: bool) -> list[Size]:
        sizes = list(self.sizes.get(device, ()))
        if quick:
            sizes = [s for s in sizes if s.quick] or sizes[:1]
        return sizes
