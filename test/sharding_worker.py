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
    if VOCAB_PARALLEL in only:
        results.update(vocab_parallel_cases(mesh, a.device))
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


# --- fused_linear_cross_entropy: the vocabulary-parallel head --------------------------
# torchops.tensor_parallel communicates (one all-reduce in the forward, one in
# the backward for the input's gradient), so its cases are not sharding-rule
# samples: they run when --ops names VOCAB_PARALLEL.  Each builds the full
# tensors from the same seed on every rank, computes the single-process op on
# the full weight, then the op on the weight (and bias) distributed Shard(0),
# and checks the loss, the gradients and the collectives counted.

VOCAB_PARALLEL = "fused_linear_cross_entropy_vocab_parallel"


def _vp_tol(dtype):
    from opdb import DEFAULT_TOLS, Tol

    # Both paths run the same kernels; only the combination of the ranks'
    # logsumexps rounds differently: float64 agrees far below its default.
    return Tol(1e-12, 1e-10) if dtype == torch.float64 else DEFAULT_TOLS[dtype]


def _vp_expect_all_reduces(comm, count: int, what: str) -> None:
    counts = {str(k): v for k, v in comm.get_comm_counts().items() if v}
    assert comm.get_total_counts() == count and all("all_reduce" in k for k in counts), \
        f"{what}: expected {count} all-reduce(s), got {counts}"


def _vp_case(mesh, device, *, dtype=torch.float64, shape=(6,), h=8, v=7, bias=True,
             ignored=(1,), input_grad=True, replicated=False, autocast=None, scale=1.0,
             compiled=False, **kw) -> None:
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import torchops

    ignore_index = kw.setdefault("ignore_index", -100)
    x = torch.randn(*shape, h, dtype=dtype, device=device) * scale
    w = torch.randn(v, h, dtype=dtype, device=device)
    b = torch.randn(v, dtype=dtype, device=device) if bias else None
    t = torch.randint(0, v, shape, device=device)
    if t.numel():
        t.view(-1)[list(ignored)] = ignore_index

    def amp():
        return torch.autocast(device, dtype=autocast) if autocast else nullcontext()

    rx = x.clone().requires_grad_(input_grad)
    rw = w.clone().requires_grad_()
    rb = b.clone().requires_grad_() if bias else None
    with amp():
        ref = torchops.fused_linear_cross_entropy(rx, rw, t, rb, **kw)
    g = torch.randn_like(ref)

    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_() if bias else None
    if replicated:
        dx = distribute_tensor(x, mesh, [Replicate()]).requires_grad_(input_grad)
        dt = distribute_tensor(t, mesh, [Replicate()])
    else:
        dx, dt = x.clone().requires_grad_(input_grad), t
    lce = torchops.fused_linear_cross_entropy
    if compiled:
        # aot_eager: dynamo's and AOTAutograd's tracing (the collectives, the
        # autograd.Function, DTensor's to_local) without inductor's build time.
        lce = torch.compile(lce, fullgraph=True, dynamic=True, backend="aot_eager")
    # (torch.compile does not trace under a dispatch mode: a compiled call
    # is not counted.)
    with amp(), nullcontext() if compiled else CommDebugMode() as comm:
        loss = lce(dx, dw, dt, db, **kw)
    if not compiled:
        _vp_expect_all_reduces(comm, 1 if t.numel() else 0, "the forward")
    if replicated:
        assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),), \
            f"the loss of a replicated input: {loss!r}"
        dg, loss_local = distribute_tensor(g, mesh, [Replicate()]), loss.to_local()
    else:
        assert not isinstance(loss, DTensor), "the loss of a plain input is a DTensor"
        dg, loss_local = g, loss
    assert loss_local.dtype == ref.dtype and loss_local.shape == ref.shape, \
        f"loss {loss_local.dtype} {tuple(loss_local.shape)}, expected {ref.dtype} " \
        f"{tuple(ref.shape)}"
    tol = _vp_tol(autocast or dtype)
    torch.testing.assert_close(loss_local, ref.detach(), atol=tol.atol, rtol=tol.rtol,
                               equal_nan=True, msg=lambda m: f"loss: {m}")

    torch.autograd.backward(ref, g)
    with nullcontext() if compiled else CommDebugMode() as comm:
        torch.autograd.backward(loss, dg)
    if not compiled:
        _vp_expect_all_reduces(comm, 1 if input_grad and t.numel() else 0, "the backward")
    pairs = [("weight", dw.grad, rw.grad, Shard(0))]
    if bias:
        pairs.append(("bias", db.grad, rb.grad, Shard(0)))
    if input_grad:
        pairs.append(("input", dx.grad, rx.grad, Replicate() if replicated else None))
    for name, got, want, placement in pairs:
        if placement is None:
            assert not isinstance(got, DTensor), f"{name}'s gradient is a DTensor"
        else:
            assert isinstance(got, DTensor) and tuple(got.placements) == (placement,), \
                f"{name}'s gradient: {type(got).__name__} {getattr(got, 'placements', '')}"
            got = got.full_tensor()
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m: f"gradient of {name}: {m}")


def _vp_raises(exc, match: str, fn) -> None:
    try:
        fn()
    except exc as e:
        assert match in str(e) and "torchops.fused_linear_cross_entropy" in str(e), \
            f"{type(e).__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"no {exc.__name__} raised")


def _vp_errors(mesh, device, cpu: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torchops

    x = torch.randn(4, 8, dtype=torch.float64, device=device)
    w = torch.randn(7, 8, dtype=torch.float64, device=device)
    t = torch.tensor([0, 6, -100, 3], device=device)
    lce = torchops.fused_linear_cross_entropy
    sharded = distribute_tensor(w, mesh, [Shard(0)])
    for placement in (Replicate(), Shard(1)):
        _vp_raises(ValueError, "Shard(0)",
                   lambda: lce(x, distribute_tensor(w, mesh, [placement]), t))
    _vp_raises(ValueError, "'bias'", lambda: lce(x, sharded, t, torch.randn(
        7, dtype=torch.float64, device=device)))
    _vp_raises(ValueError, "'input'",
               lambda: lce(distribute_tensor(x, mesh, [Shard(0)]), sharded, t))
    _vp_raises(RuntimeError, "'weight'", lambda: lce(x[:, :5], sharded, t))
    _vp_raises(ValueError, "'reduction'", lambda: lce(x, sharded, t, reduction="avg"))
    if cpu:
        # Rejected on every rank before any collective, the rank without
        # classes (a weight of one row) included: no rank is left waiting.
        _vp_raises(RuntimeError, "target", lambda: lce(x, sharded, t.clamp(max=7) + 1))
        _vp_raises(RuntimeError, "target",
                   lambda: lce(x, distribute_tensor(w[:1], mesh, [Shard(0)]), t.clamp(0, 1)))


def vocab_parallel_cases(mesh, device: str) -> dict[str, str]:
    """Case id -> "ok" or the failure, for the vocabulary-parallel head."""
    f64, f32 = torch.float64, torch.float32
    cases = []
    for dt in (f64, f32):
        cases += [
            dict(dtype=dt),
            dict(dtype=dt, reduction="sum", bias=False, label_smoothing=0.1, ignore_index=2,
                 shape=(2, 3), ignored=(0, 4)),
            dict(dtype=dt, reduction="none", lse_square_scale=1e-2, softcap=3.0, scale=3.0,
                 ignored=(2, 3)),
            dict(dtype=dt, label_smoothing=0.2, lse_square_scale=1e-3, softcap=4.0,
                 scale=3.0, input_grad=False),
        ]
    cases += [
        dict(v=1, label_smoothing=0.1),                        # rank 1 holds no class
        dict(v=2, reduction="none", label_smoothing=0.3, bias=False),
        dict(replicated=True, reduction="sum", label_smoothing=0.1),
        dict(replicated=True, reduction="none", softcap=2.0, input_grad=False),
        dict(ignored=range(6)),                                # every token ignored: nan
        dict(ignored=range(6), reduction="sum", label_smoothing=0.1),
        dict(shape=(0,), ignored=()),                          # no tokens
        dict(dtype=f32, autocast=torch.bfloat16, label_smoothing=0.1, shape=(3, 4),
             ignored=(5,)),
    ]
    from opdb import full_profile

    if full_profile():  # tracing costs tens of seconds on a CPU: not in CI's run
        cases.append(dict(compiled=True, label_smoothing=0.1, lse_square_scale=1e-3,
                          softcap=4.0))
    results: dict[str, str] = {}
    for i, case in enumerate(cases):
        torch.manual_seed(7000 + i)
        key = f"{VOCAB_PARALLEL}[{i}] " + ", ".join(f"{k}={v}" for k, v in case.items())
        try:
            _vp_case(mesh, device, **case)
            results[key] = "ok"
        except Exception:
            results[key] = traceback.format_exc(limit=6)
    key = f"{VOCAB_PARALLEL}[{len(cases)}] errors"
    try:
        _vp_errors(mesh, device, cpu=device == "cpu")
        results[key] = "ok"
    except Exception:
        results[key] = traceback.format_exc(limit=6)
    return results


if __name__ == "__main__":
    main()
