"""torchops.optim with FSDP2 (``fully_shard``) on two processes: gloo on CPU
(CI), NCCL on two GPUs (the GPU check on a 2-GPU host).  One launch per
device runs every case of test/optim_worker.py (its docstring says what each
checks); each test reports its case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("optim_worker.py")
WORLD = 2
CASES = ["fsdp2-adamw-amsgrad", "fsdp2-hybrid-adam-l2", "dcp-round-trip"]
_RESULTS: dict[str, dict[str, str]] = {}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


def _launch(device: str) -> dict[str, str]:
    import torchops

    root = str(Path(torchops.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // WORLD)))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        procs = [subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(r), "--world", str(WORLD),
             "--init", init, "--device", device, "--out", tmp],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for r in range(WORLD)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=600)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("the two-process FSDP2 run timed out:\n" + "\n".join(logs))
        results: dict[str, str] = {}
        for r, (p, log) in enumerate(zip(procs, logs)):
            path = os.path.join(tmp, f"rank{r}.json")
            if p.returncode != 0 or not os.path.exists(path):
                pytest.fail(f"rank {r} exited with {p.returncode}:\n{log[-6000:]}")
            with open(path) as f:
                for case, outcome in json.load(f).items():
                    if outcome != "ok" or case not in results:
                        results[case] = outcome if outcome == "ok" else f"rank {r}: {outcome}"
        return results


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]),
])
@pytest.mark.parametrize("case", CASES)
def test_optim_fsdp2(case, device):
    if device not in _RESULTS:
        _RESULTS[device] = _launch(device)
    outcome = _RESULTS[device].get(case)
    assert outcome is not None, f"case {case} did not run"
    assert outcome == "ok", outcome
