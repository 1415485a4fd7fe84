"""DTensor sharding rules (torchops/sharding.py) on two processes.

Every op-database entry with ``sharding_samples`` runs them on a 1-D mesh of
two ranks: gloo on CPU (CI), NCCL on two GPUs (the GPU check on a 2-GPU host).
One launch per device runs every entry (test/sharding_worker.py says what each
case checks); each test reports its op's cases.  The tests' ids name the op,
so ``-k <op>`` selects one op's, as the GPU check's family runs do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from opdb import OP_DB

WORKER = Path(__file__).with_name("sharding_worker.py")
WORLD = 2
SHARDED = [e.name for e in OP_DB if e.sharding_samples is not None]
_RESULTS: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


def _launch(device: str, ops: tuple[str, ...]) -> dict[str, str]:
    """Run the worker on WORLD processes; case id -> "ok" or the failure."""
    import torchops

    root = str(Path(torchops.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Each process takes its share of the cores: two processes with every
    # core's threads would oversubscribe the machine.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // WORLD)))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        procs = [subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(r), "--world", str(WORLD),
             "--init", init, "--device", device, "--out", tmp, "--ops", ",".join(ops)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for r in range(WORLD)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=900)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("the two-process DTensor run timed out:\n" + "\n".join(logs))
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


def _results(device: str, request) -> dict[str, str]:
    # One launch runs the ops this session selected (all of them unless -k
    # narrows the selection), so each test does not pay for a launch.
    params = [getattr(item, "callspec", None) for item in request.session.items
              if item.fspath == request.node.fspath]
    selected = tuple(sorted({c.params["name"] for c in params
                             if c is not None and c.params.get("device") == device}))
    key = (device, selected)
    if key not in _RESULTS:
        _RESULTS[key] = _launch(device, selected)
    return _RESULTS[key]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]),
])
@pytest.mark.parametrize("name", SHARDED)
def test_sharding(name, device, request):
    results = _results(device, request)
    mine = {case: outcome for case, outcome in results.items() if case.startswith(f"{name}[")}
    assert mine, f"no sharding case of {name} ran"
    failed = {case: outcome for case, outcome in mine.items() if outcome != "ok"}
    assert not failed, "\n\n".join(f"{case}:\n{outcome}" for case, outcome in failed.items())


def test_rules_register_when_dtensor_is_imported():
    """`import torchops` does not import DTensor; importing it later registers
    every rule (the import hook), and a DTensor call then finds them."""
    code = (
        "import sys, torch, torchops\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'import torchops imported DTensor'\n"
        "import torch.distributed.tensor\n"
        "from torch.distributed.tensor import DTensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "missing = [n for n in torchops.sharding._rule_names() if\n"
        "           getattr(torch.ops.torchops, n).default not in funcs]\n"
        "assert not missing, missing\n"
        "print('OK', len(torchops.sharding.registered()))\n")
    import torchops

    root = str(Path(torchops.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


def test_every_rule_has_a_sharding_sample():
    """A rule nobody runs is a rule nobody tested: each op with a rule (its
    backward ops through the entry's internal_ops) has sharding samples."""
    import torchops

    covered = set()
    for e in OP_DB:
        if e.sharding_samples is not None:
            covered |= {e.name, *e.internal_ops}
    untested = sorted(set(torchops.sharding._rule_names()) - covered)
    assert not untested, f"rules without a sharding sample in the op database: {untested}"


# --- fused_linear_cross_entropy: the vocabulary-parallel head --------------------------
# Not a sharding rule (it communicates), so no op-database sample: the worker
# runs its own cases when the launch names VOCAB_PARALLEL, in the same launch
# as the rules' samples (the parameters test_sharding's are named alike).
from sharding_worker import VOCAB_PARALLEL  # noqa: E402


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]),
])
@pytest.mark.parametrize("name", [VOCAB_PARALLEL])
def test_fused_linear_cross_entropy_vocab_parallel(name, device, request):
    """torchops.fused_linear_cross_entropy with its weight (and bias) a Shard(0)
    DTensor (torchops.tensor_parallel) against the single-process op on the
    full weight: test/sharding_worker.py's vocab_parallel_cases (reductions,
    options, uneven and empty shards, replicated DTensor inputs, autocast,
    errors), each also checking that the forward makes one all-reduce and
    the backward one more only when the input needs its gradient."""
    test_sharding(name, device, request)
