"""One rank of test_sharding.py's two-process DTensor run.

    python test/sharding_worker.py --rank R --world 2 --init FILE --device cpu --out DIR [--ops a,b]

Runs every ``sharding_samples`` record of the op database (or of the listed
ops) on a 1-D mesh of all ranks and writes ``DIR/rank<R>.json``: case id ->
"ok" or the failure.  Each case makes its full tensors from the same seed on
every rank, computes the single-process result from them, then calls the
public wrapper on DTensors distributed with the record's placements and
checks: the forward made no collective call, each output is a DTensor with
the expected placement, its full tensor equals the single-process output, and
(when an input requires grad) each input's gradient does too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def placement(spec: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    if spec == "R":
        return Replicate()
    if spec == "P":
        return Partial()
    if spec.startswith("S"):
        return Shard(int(spec[1:]))
    raise ValueError(f"sharding sample: unknown placement {spec!r}")


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def run_case(entry, record, mesh, seed: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from opdb import DEFAULT_TOLS

    sample = record.sample
    assert len(record.inputs) == len(sample.args), "one placement per positional argument"
    tensors = [a for a in sample.args if isinstance(a, torch.Tensor)]
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    tol = DEFAULT_TOLS[dtype]

    def clone(a):
        return a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a

    ref_args = [clone(a) for a in sample.args]
    ref_out = as_tuple(entry.wrapper(*ref_args, **sample.kwargs))

    dist_args = []
    for a, spec in zip(sample.args, record.inputs):
        if isinstance(a, torch.Tensor):
            assert spec is not None, "a tensor argument needs a placement"
            d = distribute_tensor(a.detach(), mesh, [placement(spec)])
            dist_args.append(d.requires_grad_(a.requires_grad))
        else:
            assert spec is None, "a placement for an argument that is not a tensor"
            dist_args.append(a)
    with CommDebugMode() as comm:
        out = as_tuple(entry.wrapper(*dist_args, **sample.kwargs))
    assert comm.get_total_counts() == 0, f"the forward communicated: {comm.get_comm_counts()}"
    assert len(out) == len(record.outputs) == len(ref_out), "one expected placement per output"
    for i, (o, r, spec) in enumerate(zip(out, ref_out, record.outputs)):
        assert isinstance(o, DTensor), f"output {i} is not a DTensor"
        assert tuple(o.placements) == (placement(spec),), \
            f"output {i}: placements {tuple(o.placements)}, expected ({spec},)"
        torch.testing.assert_close(o.full_tensor(), r, atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m: f"output {i}: {m}")

    wanted = [i for i, a in enumerate(ref_args) if isinstance(a, torch.Tensor) and a.requires_grad]
    diff_out = [i for i, r in enumerate(ref_out) if r.requires_grad]
    if not wanted or not diff_out:
        return
    torch.manual_seed(seed + 1)
    grads = [torch.randn_like(ref_out[i]) for i in diff_out]
    ref_grads = torch.autograd.grad([ref_out[i] for i in diff_out], [ref_args[i] for i in wanted],
                                    grads, allow_unused=True)
    dist_grads = [distribute_tensor(g, mesh, out[i].placements) for g, i in zip(grads, diff_out)]
    got = torch.autograd.grad([out[i] for i in diff_out], [dist_args[i] for i in wanted],
                              dist_grads, allow_unused=True)
    for arg, g, r in zip(wanted, got, ref_grads):
        if r is None:
            assert g is None, f"argument {arg}: a gradient where the single-process run has none"
            continue
        assert isinstance(g, DTensor), f"argument {arg}: the gradient is not a DTensor"
        torch.testing.assert_close(g.full_tensor(), r, atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m: f"gradient of argument {arg}: {m}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--ops", default="")
    a = p.parse_args()

    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            init_method=f"file://{a.init}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh

    import torchops  # noqa: F401  (loads the ops and their sharding rules)
    from opdb import OP_DB

    mesh = init_device_mesh(a.device, (a.world,))
    only = {n for n in a.ops.split(",") if n}
    results: dict[str, str] = {}
    for n, entry in enumerate(OP_DB):
        if entry.sharding_samples is None or (only and entry.name not in only):
            continue
        seed = 1000 * (n + 1)
        torch.manual_seed(seed)
        for i, record in enumerate(entry.sharding_samples(a.device)):
            key = f"{entry.name}[{i}] {record.sample!r} {record.inputs}"
            try:
                run_case(entry, record, mesh, seed + i)
                results[key] = "ok"
            except Exception:
                results[key] = traceback.format_exc(limit=6)
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
