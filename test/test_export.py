"""torch.export round trip for every op of the database: export a module that
calls the op -- the dispatcher op, and separately the public wrapper users
call -- (every tensor dimension Dim.AUTO), save it, load it in a fresh
Python process that imports only torch and torchops, run it on the export
sample and on a sample of other sizes, and compare with eager.

One subprocess per device serves every op (process start-up and the torchops
load dominate its cost); each op still passes or fails on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch

from op_testing import (DEVICES, VIAS, assert_same_outputs, call_via, generic_param, nonempty,
                        outputs)
from opdb import OP_DB, OpInfo, Sample, Tol

# Runs in the fresh process: torch and torchops only.
_LOAD_AND_RUN = r"""
import sys, traceback
import torch, torchops
cases = torch.load(sys.argv[1])
results = {}
for name, case in cases.items():
    try:
        module = torch.export.load(case["program"]).module()
        results[name] = {"outputs": [module(*inputs) for inputs in case["inputs"]]}
    except Exception:
        results[name] = {"error": traceback.format_exc()}
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("opdb", "op_testing", "conftest"))
torch.save({"results": results, "leaked": leaked}, sys.argv[2])
"""


class _OpModule(torch.nn.Module):
    """Calls the op (via "op" or "wrapper") with the exported tensors in the
    template's tensor slots and the template's scalars everywhere else."""

    def __init__(self, op: OpInfo, template: Sample, via: str):
        super().__init__()
        self.info, self.via = op, via
        self.slots = [None if isinstance(a, torch.Tensor) else a for a in template.args]
        self.is_tensor = [isinstance(a, torch.Tensor) for a in template.args]
        self.kwargs = dict(template.kwargs)

    def forward(self, *tensors):
        it = iter(tensors)
        args = [next(it) if t else a for t, a in zip(self.is_tensor, self.slots)]
        return call_via(self.info, Sample(tuple(args), self.kwargs), self.via)


@dataclass
class _Prepared:
    samples: list[Sample]
    eager: list[tuple]
    program: str


def _prepare(op: OpInfo, device: str, via: str, folder) -> _Prepared:
    samples = op.compile_samples(device, torch.float32)[:2]
    if not samples:  # no varied sizes: at least the static round trip
        samples = [next(filter(nonempty, op.sample_inputs(device, torch.float32)))]
    template = samples[0]
    auto = torch.export.Dim.AUTO
    dynamic = tuple({d: auto for d in range(t.dim())} for t in template.tensors())
    program = torch.export.export(_OpModule(op, template, via), tuple(template.tensors()),
                                  dynamic_shapes=(dynamic,))  # forward(*tensors)
    path = str(folder / f"{op.name}-{via}.pt2")
    torch.export.save(program, path)
    return _Prepared(samples, [outputs(call_via(op, s, via)) for s in samples], path)


_RUNS: dict[str, tuple] = {}

# Under pytest-xdist (the GPU check), every export test goes to one worker, so
# the per-process _RUNS cache exports each program once, not once per worker.
pytestmark = pytest.mark.xdist_group("export")


def _run(device: str, tmp_path_factory) -> tuple[dict, dict, list]:
    if device in _RUNS:
        return _RUNS[device]
    folder = tmp_path_factory.mktemp(f"export-{device}")
    prepared: dict[str, _Prepared | str] = {}
    for op in OP_DB:
        if op.skip_for("export", device, torch.float32):
            continue
        for via in VIAS:
            key = f"{op.name}:{via}"
            try:
                prepared[key] = _prepare(op, device, via, folder)
            except Exception:
                prepared[key] = traceback.format_exc()
    cases = {name: {"program": p.program, "inputs": [tuple(s.tensors()) for s in p.samples]}
             for name, p in prepared.items() if isinstance(p, _Prepared)}
    torch.save(cases, folder / "cases.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN, str(folder / "cases.pt"), str(folder / "results.pt")],
        cwd=folder, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the fresh process failed:\n{proc.stdout}\n{proc.stderr}"
    saved = torch.load(folder / "results.pt")
    _RUNS[device] = (prepared, saved["results"], saved["leaked"])
    return _RUNS[device]


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("op,device", [
    generic_param("export", op, d, values=(op, d), id=f"{op.name}-{d}")
    for op in OP_DB for d in DEVICES])
def test_export(op: OpInfo, device: str, via: str, tmp_path_factory):
    prepared, results, leaked = _run(device, tmp_path_factory)
    key = f"{op.name}:{via}"
    p = prepared[key]
    if isinstance(p, str):
        pytest.fail(f"torch.export.export/save of {key} failed:\n{p}")
    assert not leaked, f"the fresh process imported test modules: {leaked}"
    r = results[key]
    if "error" in r:
        pytest.fail(f"loading/running the exported {op.name} in a fresh process failed:\n{r['error']}")
    assert len(r["outputs"]) == len(p.samples)
    for s, eager, got in zip(p.samples, p.eager, r["outputs"]):
        assert_same_outputs(outputs(got), eager, Tol(1e-5, 1.3e-6), f"{s} exported vs eager")
