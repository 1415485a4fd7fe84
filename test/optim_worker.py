"""One rank of test_optim_distributed.py's two-process FSDP2 run.

    python test/optim_worker.py --rank R --world 2 --init FILE --device cpu --out DIR

Writes ``DIR/rank<R>.json``: case id -> "ok" or the failure.  The cases:

- ``fsdp2-<variant>``: a small model sharded with ``fully_shard`` and stepped
  by a torchops optimizer, each rank on its half of every batch, against the
  same model stepped by torch.optim on one process with the whole batches:
  parameters and states (gathered) agree, the states are DTensors with their
  parameter's placements, and the step made no collective call.
- ``dcp-round-trip``: model and optimizer state saved with
  torch.distributed.checkpoint (``get_state_dict``), loaded into a fresh
  sharded model and optimizer (``set_state_dict``); both continue and stay
  bitwise equal.
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

STEPS = 6


def _model(device, seed=0):
    torch.manual_seed(seed)
    # Odd sizes: dim 0 of every weight and bias splits unevenly over 2 ranks.
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5)).to(device)


def _batches(device, n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 7, generator=g).to(device), torch.randn(8, 5, generator=g).to(device))
            for _ in range(n)]


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, opt, batches, rank=None, world=1):
    from torch.distributed.tensor.debug import CommDebugMode

    for x, y in batches:
        if rank is not None:  # this rank's half: FSDP2 averages the gradients
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, f"the step communicated: {comm.get_comm_counts()}"


def _variants():
    from torchops.optim import AdamW, HybridAdam

    return {
        "adamw-amsgrad": (lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
                          lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                       amsgrad=True)),
        "hybrid-adam-l2": (lambda ps: HybridAdam(ps, lr=1e-2, weight_decay=0.1,
                                                 adamw_mode=False),
                           lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
    }


def fsdp2_case(mesh, device, rank, world, ours, theirs) -> None:
    from torch.distributed.tensor import DTensor

    batches = _batches(device, STEPS)
    ref = _model(device)
    ref_opt = theirs(ref.parameters())
    _train(ref, ref_opt, batches)

    model = _shard(_model(device), mesh)
    opt = ours(model.parameters())
    _train(model, opt, batches, rank, world)

    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor), f"{name} is not a DTensor"
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert set(state) == set(ref_state), f"{name}: state keys {sorted(state)}"
        for key, value in ref_state.items():
            got = state[key]
            if key == "step":
                assert float(got) == float(value), f"{name}: step {float(got)}"
                continue
            assert isinstance(got, DTensor) and got.placements == p.placements, \
                f"{name}: {key} is not a DTensor placed as its parameter"
            torch.testing.assert_close(got.full_tensor(), value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}.{key}: {m}")


def dcp_case(mesh, device, rank, world, ckpt_dir) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from torchops.optim import AdamW

    batches = _batches(device, 2 * STEPS)
    model = _shard(_model(device), mesh)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    _train(model, opt, batches[:STEPS], rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)

    # A fresh model and optimizer of another initialisation, then the load.
    model2 = _shard(_model(device, seed=5), mesh)
    opt2 = AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    msd2, osd2 = get_state_dict(model2, opt2)
    loaded = {"model": msd2, "optim": osd2}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    set_state_dict(model2, opt2, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])

    _train(model, opt, batches[STEPS:], rank, world)
    _train(model2, opt2, batches[STEPS:], rank, world)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
        for key, value in opt.state[p].items():
            other = opt2.state[q][key]
            if key == "step":
                assert float(value) == float(other) == 2 * STEPS, f"{name}: step"
            else:
                assert torch.equal(value.to_local(), other.to_local()), f"{name}.{key}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            init_method=f"file://{a.init}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh

    import torchops  # noqa: F401  (loads the ops)

    mesh = init_device_mesh(a.device, (a.world,))
    results: dict[str, str] = {}

    def run(case, fn, *args):
        try:
            fn(mesh, a.device, a.rank, a.world, *args)
            results[case] = "ok"
        except Exception:  # noqa: BLE001  (reported per case)
            results[case] = traceback.format_exc()
        # A rank whose case failed early must not leave the other waiting in
        # a collective of the next case.
        dist.barrier()

    for name, (ours, theirs) in _variants().items():
        run(f"fsdp2-{name}", fsdp2_case, ours, theirs)
    run("dcp-round-trip", dcp_case, os.path.join(a.out, "ckpt"))
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
