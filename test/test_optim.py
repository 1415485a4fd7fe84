"""Tests of torchops.fused_adam_ and the optimizers on it (torchops.optim):
50 steps of a small model against torch.optim.Adam/AdamW, state dicts
loaded both ways, float16/bfloat16 parameters with float32 masters,
GradScaler's grad_scale/found_inf, lr as a tensor, the op against its
reference in every dtype (several chunks, unaligned tensors, and on a GPU
more tensors and chunks than one launch takes), and the errors; HybridAdam
(ColossalAI's arguments, one call per device, CPU and CUDA parameters in one
optimizer), torch.compile of the step, and the optimizers' own errors.
test_optim_distributed.py runs the optimizers under FSDP2."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchops
from torchops import references
from torchops.optim import Adam, AdamW

OP = torch.ops.torchops.fused_adam_.default


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _model(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5)).to(device=device, dtype=dtype)


def _batches(device, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 7, generator=g).to(device, dtype),
             torch.randn(8, 5, generator=g).to(device, dtype)) for _ in range(n)]


def _train(model, opt, batches, scaler=None):
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _assert_states_close(ours, theirs, rtol=1e-6, atol=1e-7):
    for pa, pb in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)
        sa, sb = ours.state[pa], theirs.state[pb]
        for key in sb:
            torch.testing.assert_close(sa[key].to(sb[key].device, sb[key].dtype), sb[key],
                                       rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


VARIANTS = [
    (AdamW, torch.optim.AdamW, {}),
    (AdamW, torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
    (AdamW, torch.optim.AdamW, {"maximize": True, "betas": (0.5, 0.9)}),
    (Adam, torch.optim.Adam, {}),
    (Adam, torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("ours,theirs,kw", VARIANTS,
                         ids=["adamw", "adamw-amsgrad-wd", "adamw-maximize-beta1.5",
                              "adam", "adam-wd-amsgrad-maximize"])
def test_matches_torch_optim_for_50_steps(device, ours, theirs, kw):
    batches = _batches(device, 50)
    ma, mb = _model(device), _model(device)
    oa = ours(ma.parameters(), lr=1e-2, **kw)
    ob = theirs(mb.parameters(), lr=1e-2, **kw)
    _train(ma, oa, batches)
    _train(mb, ob, batches)
    # CUDA: torch's foreach step orders (and partly widens) the update's
    # arithmetic differently from the for-loop order ours follows, so 50
    # steps drift apart by a few float32 roundings of the parameters.
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cuda" else {}
    _assert_states_close(oa, ob, **tol)
    assert set(oa.state_dict()["param_groups"][0]) == set(ob.state_dict()["param_groups"][0])


@pytest.mark.parametrize("device", _devices())
def test_lr_as_tensor(device):
    batches = _batches(device, 20)
    ma, mb = _model(device), _model(device)
    oa = AdamW(ma.parameters(), lr=torch.tensor(3e-3), weight_decay=0.1)
    ob = torch.optim.AdamW(mb.parameters(), lr=3e-3, weight_decay=0.1)
    _train(ma, oa, batches)
    _train(mb, ob, batches)
    _assert_states_close(oa, ob)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("direction", ["ours-to-torch", "torch-to-ours"])
def test_state_dict_round_trip(device, direction):
    batches = _batches(device, 20)
    ours_first = direction == "ours-to-torch"
    kw = {"lr": 1e-2, "amsgrad": True}
    m1 = _model(device)
    o1 = AdamW(m1.parameters(), **kw) if ours_first else torch.optim.AdamW(m1.parameters(), **kw)
    _train(m1, o1, batches[:10])
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.AdamW(m2.parameters(), **kw) if ours_first else AdamW(m2.parameters(), **kw)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    assert set(o2.state_dict()["state"][0]) == set(o1.state_dict()["state"][0])
    _train(m1, o1, batches[10:])
    _train(m2, o2, batches[10:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert int(o2.state[next(m2.parameters())]["step"]) == 20


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_a_float32_run(device, dtype):
    g = torch.Generator().manual_seed(2)
    p32 = [torch.randn(shape, generator=g).to(device) for shape in ((33, 5), (17,), (1,))]
    plow = [torch.nn.Parameter(p.to(dtype)) for p in p32]
    p32 = [torch.nn.Parameter(p.to(dtype).float()) for p in p32]
    oa = AdamW(plow, lr=1e-2, weight_decay=0.1, master_weights=True)
    ob = torch.optim.AdamW(p32, lr=1e-2, weight_decay=0.1)
    for _ in range(20):
        for a, b in zip(plow, p32):
            grad = torch.randn(b.shape, generator=g).to(device)
            b.grad = grad
            a.grad = grad.to(dtype)
        oa.step()
        ob.step()
    for a, b in zip(plow, p32):
        state = oa.state[a]
        assert a.dtype == dtype and state["exp_avg"].dtype == torch.float32
        # The parameter is its master rounded, and the master follows the
        # float32 run up to the gradients' rounding.
        assert torch.equal(a, state["master_param"].to(dtype))
        torch.testing.assert_close(state["master_param"], b.detach(), rtol=0, atol=2e-3)
    # Saved and loaded, the float32 states stay float32.
    oc = AdamW(plow, lr=1e-2, master_weights=True)
    oc.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert oc.state[plow[0]]["master_param"].dtype == torch.float32
    assert torch.equal(oc.state[plow[0]]["exp_avg_sq"], oa.state[plow[0]]["exp_avg_sq"])


@pytest.mark.parametrize("device", _devices())
def test_master_update_equals_the_float32_update(device):
    """The op with masters does the float32 op's arithmetic on the master,
    bit for bit, and rounds it into the parameter."""
    n = 1000
    g = torch.Generator().manual_seed(3)
    master = [torch.randn(n, generator=g).to(device)]
    grad = [torch.randn(n, generator=g).to(device)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True,
              maximize=False, adamw=True)
    states32 = [[torch.zeros(n, device=device)] for _ in range(3)]
    states16 = [[torch.zeros(n, device=device)] for _ in range(3)]
    p32 = [master[0].clone()]
    p16 = [master[0].to(torch.bfloat16)]
    m16 = [master[0].clone()]
    for step in range(1, 4):
        steps = [torch.tensor(float(step), device=device)]
        OP(p32, grad, *states32, steps, **kw)
        OP(p16, grad, *states16, steps, master_params=m16, **kw)
    assert torch.equal(m16[0], p32[0])
    assert torch.equal(p16[0], p32[0].to(torch.bfloat16))
    for a, b in zip(states16, states32):
        assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("device", _devices())
def test_grad_scaler(device):
    """GradScaler hands the fused step its scale and inf flag, as it does to
    torch's fused AdamW; a step with an inf gradient is skipped whole."""
    batches = _batches(device, 10)
    ma, mb = _model(device), _model(device)
    oa = AdamW(ma.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(mb.parameters(), lr=1e-2, fused=True)
    sa = torch.amp.GradScaler(device, init_scale=1024.0)
    sb = torch.amp.GradScaler(device, init_scale=1024.0)
    _train(ma, oa, batches, sa)
    _train(mb, ob, batches, sb)
    _assert_states_close(oa, ob)
    # An inf gradient: nothing moves, the step counts stay.
    before = copy.deepcopy(oa.state_dict())
    params = [p.detach().clone() for p in ma.parameters()]
    x, y = batches[0]
    oa.zero_grad()
    sa.scale(torch.nn.functional.mse_loss(ma(x), y)).backward()
    next(ma.parameters()).grad.view(-1)[0] = float("inf")
    sa.step(oa)
    for p, q in zip(ma.parameters(), params):
        assert torch.equal(p, q)
    for i, s in before["state"].items():
        for key, value in s.items():
            assert torch.equal(oa.state_dict()["state"][i][key], value), key


def _op_inputs(device, dtype, sizes, amsgrad=True, offset=0, master=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(n, dt, low=-1.0, high=1.0):
        base = torch.empty(n + offset, dtype=torch.float64).uniform_(low, high, generator=g)
        return base.to(device=device, dtype=dt)[offset:]

    sdtype = torch.float32 if master else dtype
    params = [rand(n, dtype) for n in sizes]
    grads = [rand(n, dtype) for n in sizes]
    exp_avgs = [rand(n, sdtype) for n in sizes]
    exp_avg_sqs = [rand(n, sdtype, 0.0, 1.0) for n in sizes]
    maxes = [rand(n, sdtype, 0.0, 1.0) for n in sizes] if amsgrad else []
    steps = [torch.tensor(float(3 + i % 4), device=device) for i in range(len(sizes))]
    masters = [p.float() for p in params] if master else None
    return params, grads, exp_avgs, exp_avg_sqs, maxes, steps, masters


_TOLS = {torch.float64: (1e-12, 1e-10), torch.float32: (2e-6, 1e-6),
         torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


def _check_op_against_reference(device, dtype, sizes, offset=0, master=False, scaled=False,
                                adamw=True, tensor_lr=False):
    params, grads, m, v, x, steps, masters = _op_inputs(device, dtype, sizes, offset=offset,
                                                        master=master)
    scale = torch.tensor([4.0], device=device) if scaled else None
    lr = torch.tensor(1e-2, device=device) if tensor_lr else 1e-2
    kw = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, amsgrad=True,
              maximize=False, adamw=adamw, grad_scale=scale)
    f64 = lambda ts: None if ts is None else [t.double() for t in ts]  # noqa: E731
    want = references.fused_adam_(f64(params), f64(grads), f64(m), f64(v), f64(x), steps,
                                  master_params=f64(masters), **kw)
    torchops.fused_adam_(params, grads, m, v, x, steps, master_params=masters, **kw)
    rtol, atol = _TOLS[torch.float32 if master else dtype]
    got = (params, grads, m, v, x) + ((masters,) if master else ())
    for name, g_list, w_list in zip(("params", "grads", "exp_avgs", "exp_avg_sqs",
                                     "max_exp_avg_sqs", "master_params"), got, want):
        for i, (a, b) in enumerate(zip(g_list, w_list)):
            if name == "params" and master:
                # The float32 master, rounded (the reference rounds its float64 one).
                assert torch.equal(a, masters[i].to(a.dtype)), f"params[{i}]"
                continue
            torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol,
                                       msg=lambda msg: f"{name}[{i}]: {msg}")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_op_matches_reference(device, dtype):
    # Several chunks in one tensor, a partial vector, an empty tensor; an
    # offset of one element makes every array unaligned.
    _check_op_against_reference(device, dtype, [70000, 13, 0, 1, 300], scaled=True)
    _check_op_against_reference(device, dtype, [1027, 5], offset=1, adamw=False,
                                tensor_lr=True)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_with_masters_matches_reference(device, dtype):
    _check_op_against_reference(device, dtype, [70000, 13, 1], master=True, scaled=True)


@pytest.mark.cuda
def test_cuda_many_tensors_and_chunks():
    """More tensors (40) than a launch's table holds, and more chunks (300)
    than its blocks: the lists span several launches, a tensor split
    between two."""
    sizes = [(i * 7919) % 5000 + 1 for i in range(40)] + [300 * 65536 + 17, 3, 65536]
    _check_op_against_reference("cuda", torch.float32, sizes, scaled=True)
    _check_op_against_reference("cuda", torch.bfloat16, sizes, master=True)
    # The split tensor mid-table, then more tensors than its old slot: the
    # later ones take the table's slots again while its last chunks run.
    sizes = [5] * 10 + [300 * 65536 + 17] + [7] * 20
    _check_op_against_reference("cuda", torch.float32, sizes)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    cpu = _op_inputs("cpu", torch.float32, [5000, 77])
    gpu = [None if ts is None else [t.cuda() for t in ts] for ts in cpu]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=True,
              maximize=True, adamw=True)
    torchops.fused_adam_(*cpu[:6], **kw)
    torchops.fused_adam_(*gpu[:6], **kw)
    for a, b in zip(cpu[:5], gpu[:5]):
        for s, t in zip(a, b):
            torch.testing.assert_close(t.cpu(), s, rtol=1e-6, atol=1e-7)


def test_found_inf_skips_the_op():
    params, grads, m, v, x, steps, _ = _op_inputs("cpu", torch.float32, [10])
    before = [t.clone() for t in (*params, *grads, *m, *v, *x)]
    torchops.fused_adam_(params, grads, m, v, x, steps, lr=1e-2, beta1=0.9, beta2=0.99,
                         eps=1e-8, weight_decay=0.0, amsgrad=True, maximize=False, adamw=True,
                         grad_scale=torch.tensor(2.0), found_inf=torch.tensor(1.0))
    for a, b in zip(before, (*params, *grads, *m, *v, *x)):
        assert torch.equal(a, b)


def _error_cases():
    def base(**over):
        params, grads, m, v, x, steps, _ = _op_inputs("cpu", torch.float32, [4, 3])
        args = dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=x,
                    state_steps=steps)
        args.update(over)
        return args
    p = _op_inputs("cpu", torch.float32, [4, 3])
    sparse = torch.zeros(3).to_sparse()
    return [
        (base(grads=p[1][:1]), r"'grads' to have 2 tensors"),
        (base(max_exp_avg_sqs=[]), r"'max_exp_avg_sqs' to have 2 tensors"),
        (base(exp_avgs=[p[2][0], p[2][1].double()]), r"'exp_avgs\[1\]' to have dtype"),
        (base(grads=[p[1][0], sparse]), r"'grads\[1\]'.*sparse"),
        (base(params=[p[0][0], p[0][0]]), r"'params\[1\]' appears twice"),
        (base(exp_avg_sqs=[p[3][0], torch.zeros(4)]), r"'exp_avg_sqs\[1\]' has shape"),
        (base(state_steps=[p[5][0], torch.tensor(1.0, dtype=torch.float64)]),
         r"'state_steps\[1\]'"),
        (base(params=[p[0][0].half(), p[0][1].half()]), r"'grads\[0\]' to have dtype"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
def test_errors_name_the_op_and_index(fake):
    for args, match in _error_cases():
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=True,
                  maximize=False, adamw=True)
        if fake:
            if any(t.is_sparse for t in args["grads"]):
                continue  # fake tensors of sparse layouts are not what this checks
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                args = {k: [mode.from_tensor(t) for t in ts] for k, ts in args.items()}
                with pytest.raises(RuntimeError, match=r"torchops\.fused_adam_: .*" + match):
                    OP(**args, **kw)
        else:
            with pytest.raises(RuntimeError, match=r"torchops\.fused_adam_: .*" + match):
                OP(**args, **kw)


def test_master_weights_with_sparse_or_dense_mix_is_rejected():
    params, grads, m, v, x, steps, masters = _op_inputs("cpu", torch.bfloat16, [4], master=True)
    with pytest.raises(RuntimeError, match=r"'master_params' to have 1 tensors"):
        OP(params, grads, m, v, x, steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
           weight_decay=0.0, amsgrad=True, maximize=False, adamw=True, master_params=[])
    with pytest.raises(RuntimeError, match=r"'params' to be float16 or bfloat16"):
        OP([p.float() for p in params], [g.float() for g in grads], m, v, x, steps, lr=1e-3,
           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=True, maximize=False,
           adamw=True, master_params=masters)


def test_op_under_compile():
    params, grads, m, v, x, steps, _ = _op_inputs("cpu", torch.float32, [10, 3])
    ref = [[t.clone() for t in ts] for ts in (params, grads, m, v, x, steps)]
    kw = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False,
              adamw=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(lr):
        torchops.fused_adam_(params, grads, m, v, x, steps, lr=lr, **kw)

    step(torch.tensor(1e-2))
    torchops.fused_adam_(*ref, lr=torch.tensor(1e-2), **kw)
    for a, b in zip((params, grads, m, v, x), ref):
        for s, t in zip(a, b):
            assert torch.equal(s, t)


def test_scalar_path_matches_reference():
    """Without AVX2 (ATEN_CPU_CAPABILITY=default) the CPU kernel runs the
    scalar update of common/fused_adam.h, the one the CUDA kernel runs."""
    import os
    import subprocess
    import sys
    code = ("import torch, test_optim as t; "
            "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
            "t._check_op_against_reference('cpu', torch.float32, [70000, 13, 1], scaled=True); "
            "t._check_op_against_reference('cpu', torch.bfloat16, [1027], master=True); "
            "t._check_op_against_reference('cpu', torch.float64, [33], adamw=False)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


# --- HybridAdam, one call per device, torch.compile of the step, optimizer errors ----------

from torchops.optim import HybridAdam  # noqa: E402

HYBRID_VARIANTS = [
    ({}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ({"weight_decay": 0.1}, torch.optim.AdamW, {"weight_decay": 0.1}),
    ({"weight_decay": 0.1, "adamw_mode": False, "amsgrad": True}, torch.optim.Adam,
     {"weight_decay": 0.1, "amsgrad": True}),
]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kw,theirs,their_kw", HYBRID_VARIANTS,
                         ids=["defaults", "adamw-wd", "adam-l2-amsgrad"])
def test_hybrid_adam_matches_torch_optim(device, kw, theirs, their_kw):
    """ColossalAI's defaults: AdamW (adamw_mode=True) without weight decay."""
    batches = _batches(device, 50)
    ma, mb = _model(device), _model(device)
    oa = HybridAdam(ma.parameters(), lr=1e-2, **kw)
    ob = theirs(mb.parameters(), lr=1e-2, **their_kw)
    _train(ma, oa, batches)
    _train(mb, ob, batches)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cuda" else {}
    _assert_states_close(oa, ob, **tol)


def _adam_without_bias_correction(p, grads, lr, beta1, beta2, eps, wd):
    """Adam with decoupled weight decay and no bias corrections, in float64."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(
        p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        p = p * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * m / (v.sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("device", _devices())
def test_hybrid_adam_without_bias_correction(device):
    """The kernels' bias corrections 1 - beta ** step are exactly 1 for the
    step +inf the optimizer passes them."""
    g = torch.Generator().manual_seed(3)
    p0 = torch.randn(37, generator=g).to(device)
    grads = [torch.randn(37, generator=g).to(device) for _ in range(5)]
    p = p0.clone().requires_grad_()
    opt = HybridAdam([p], lr=1e-2, bias_correction=False, weight_decay=0.1, betas=(0.8, 0.9))
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    want_p, want_m, want_v = _adam_without_bias_correction(p0, grads, 1e-2, 0.8, 0.9, 1e-8, 0.1)
    torch.testing.assert_close(p.detach().double(), want_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), want_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), want_v, rtol=1e-6,
                               atol=1e-7)
    assert float(opt.state[p]["step"]) == 5  # the state still counts steps
    # Per group: a second group with bias correction follows torch.optim.AdamW.
    q, r = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt.add_param_group({"params": [q], "bias_correction": True})
    ref = torch.optim.AdamW([r], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9))
    for grad in grads:
        p.grad, q.grad, r.grad = grad.clone(), grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(q, r, rtol=1e-6, atol=1e-7)


def test_hybrid_adam_arguments():
    p = torch.zeros(3, requires_grad=True)
    opt = HybridAdam([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 0)
    assert group["bias_correction"] is True and group["decoupled_weight_decay"] is True
    assert HybridAdam([p], adamw_mode=False).param_groups[0]["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match=r"torchops\.optim\.HybridAdam: NVMe offloading"):
        HybridAdam([p], nvme_offload_fraction=0.5)
    with pytest.raises(TypeError, match=r"torchops\.optim\.HybridAdam: unexpected arguments "
                                        r"\['simd_log'\]"):
        HybridAdam([p], simd_log=True)


def test_hybrid_adam_div_scale():
    """step(div_scale=s) steps as with the gradients divided by s."""
    batches = _batches("cpu", 5)
    ma, mb = _model("cpu"), _model("cpu")
    oa, ob = HybridAdam(ma.parameters(), lr=1e-2), HybridAdam(mb.parameters(), lr=1e-2)
    for x, y in batches:
        for model, opt, scale in ((ma, oa, 8.0), (mb, ob, None)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * (scale or 1.0)).backward()
            opt.step(div_scale=scale or -1)
    _assert_states_close(oa, ob)


@pytest.mark.parametrize("direction", ["hybrid-to-torch", "torch-to-hybrid"])
def test_hybrid_adam_state_dict_round_trip(direction):
    batches = _batches("cpu", 20)
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    m1 = _model("cpu")
    first = HybridAdam if direction == "hybrid-to-torch" else torch.optim.AdamW
    second = torch.optim.AdamW if direction == "hybrid-to-torch" else HybridAdam
    o1 = first(m1.parameters(), **kw)
    _train(m1, o1, batches[:10])
    m2 = copy.deepcopy(m1)
    # The other's mode is the saved one: an AdamW state makes HybridAdam AdamW.
    o2 = second(m2.parameters(), **kw, **({"adamw_mode": False} if second is HybridAdam
                                          else {}))
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    assert set(o2.state_dict()["state"][0]) == set(o1.state_dict()["state"][0])
    _train(m1, o1, batches[10:])
    _train(m2, o2, batches[10:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_hybrid_adam_keeps_its_mode_for_a_state_without_it():
    """A group saved without decoupled_weight_decay (ColossalAI's, an older
    torch's) takes the HybridAdam's adamw_mode, not torch.optim.Adam's L2."""
    p = torch.zeros(3, requires_grad=True)
    for mode in (True, False):
        opt = HybridAdam([p], adamw_mode=mode, bias_correction=False)
        sd = opt.state_dict()
        for key in ("decoupled_weight_decay", "bias_correction"):
            del sd["param_groups"][0][key]
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["decoupled_weight_decay"] is mode
        assert opt.param_groups[0]["bias_correction"] is False


def _spy_calls(monkeypatch):
    """Records the device of every fused_adam_ call of torchops.optim, and
    runs those on the meta device (a stand-in for a second device) through
    the op's fake."""
    calls = []
    real = torchops.optim.ops.fused_adam_

    def spy(params, *args, **kwargs):
        calls.append(params[0].device.type)
        real(params, *args, **kwargs)

    monkeypatch.setattr(torchops.optim.ops, "fused_adam_", spy)
    return calls


def test_hybrid_adam_one_call_per_device(monkeypatch):
    """CPU parameters and parameters of another device in one optimizer:
    one fused_adam_ call per device and step, each state on its parameter's
    device, the CPU parameters as torch.optim.AdamW steps them."""
    calls = _spy_calls(monkeypatch)
    g = torch.Generator().manual_seed(4)
    cpu = [torch.randn(s, generator=g).requires_grad_() for s in (5, 7, 3)]
    meta = [torch.empty(s, device="meta", requires_grad=True) for s in (4, 6)]
    ref = [p.detach().clone().requires_grad_() for p in cpu]
    # Interleaved, in two groups: the grouping is per device within a group.
    opt = HybridAdam([{"params": [cpu[0], meta[0], cpu[1]]},
                      {"params": [meta[1], cpu[2]], "lr": 1e-2}], weight_decay=0.1)
    ref_opt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "lr": 1e-2}],
                                weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in cpu]
        for p, r, grad in zip(cpu, ref, grads):
            p.grad, r.grad = grad.clone(), grad.clone()
        for p in meta:
            p.grad = torch.empty_like(p)
        opt.step()
        ref_opt.step()
    assert calls == ["cpu", "meta", "meta", "cpu"] * 3
    for p in cpu + meta:
        for key, value in opt.state[p].items():
            assert value.device == p.device, key
    for p, r in zip(cpu, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
def test_hybrid_adam_cpu_and_cuda_parameters(monkeypatch):
    """An offloaded half of a model (CPU) and a GPU half in one HybridAdam:
    each half steps with its device's kernel and matches torch.optim.AdamW."""
    calls = _spy_calls(monkeypatch)
    batches = _batches("cpu", 20)
    ma, mb = _model("cpu"), _model("cpu")
    ma[2].cuda()
    mb[2].cuda()

    def train(model, opt):
        for x, y in batches:
            opt.zero_grad()
            out = model[2](model[1](model[0](x)).cuda())
            torch.nn.functional.mse_loss(out, y.cuda()).backward()
            opt.step()

    oa = HybridAdam(ma.parameters(), lr=1e-2, weight_decay=0.1)
    ob = torch.optim.AdamW(mb.parameters(), lr=1e-2, weight_decay=0.1)
    train(ma, oa)
    train(mb, ob)
    assert calls == ["cpu", "cuda"] * len(batches)
    for p in ma.parameters():
        assert all(v.device == p.device for v in oa.state[p].values())
    _assert_states_close(oa, ob, rtol=1e-5, atol=1e-6)


def test_compiled_step_matches_eager():
    """torch.compile(fullgraph=True) of opt.step(): no graph break, the eager
    result, and one graph whatever the lr tensor's value (the kernel reads
    it).  The state is made at the first compiled step (in _init_group,
    which dynamo runs eagerly)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    batches = _batches("cpu", 4)
    ma, mb = _model("cpu"), _model("cpu")
    lr_a, lr_b = torch.tensor(1e-2), torch.tensor(1e-2)
    oa = HybridAdam(ma.parameters(), lr=lr_a, weight_decay=0.1, bias_correction=False)
    ob = HybridAdam(mb.parameters(), lr=lr_b, weight_decay=0.1, bias_correction=False)

    def step(opt):
        opt.step()

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, (x, y) in enumerate(batches):
        if i == 2:  # a new lr value: no recompile
            lr_a.fill_(3e-3)
            lr_b.fill_(3e-3)
        for model, opt, fn in ((ma, oa, compiled), (mb, ob, step)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            fn(opt)
    assert counter.frame_count == 1
    _assert_states_close(oa, ob)
    assert int(oa.state[next(ma.parameters())]["step"]) == len(batches)


def test_compiled_training_step_breaks_only_at_backward():
    """A compiled forward, backward and step: dynamo breaks the graph at
    loss.backward() (as for any optimizer) and nowhere in the step."""
    model = _model("cpu")
    opt = AdamW(model.parameters(), lr=torch.tensor(1e-2), amsgrad=True)

    def train(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    (x, y), = _batches("cpu", 1)
    explained = torch._dynamo.explain(train)(x, y)
    assert explained.graph_break_count == 1, [r.reason for r in explained.break_reasons]
    assert "backward" in explained.break_reasons[0].reason
    assert explained.graph_count == 2  # up to the backward, and the step


def test_sparse_gradient_is_rejected_naming_the_optimizer():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"torchops\.optim\.AdamW: the gradient of parameter "
                                           r"0 of its param group has layout torch\.sparse_coo"):
        opt.step()


def test_duplicate_parameters_are_rejected():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        AdamW([{"params": [p]}, {"params": [p]}])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = AdamW([p, p])
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"torchops\.fused_adam_: 'params\[1\]' appears twice"):
        opt.step()


@pytest.mark.parametrize("device", _devices())
def test_hybrid_adam_low_precision_gradients_of_float32_parameters(device):
    """ColossalAI's mixed case: float32 parameters with bfloat16/float16
    gradients step as with those gradients converted to float32."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("this torch takes no gradient of another dtype than its tensor's")
    g = torch.Generator().manual_seed(6)
    ps = [torch.randn(s, generator=g).to(device).requires_grad_() for s in (9, 4)]
    for p in ps:
        p.grad_dtype = None  # any gradient dtype
    refs = [p.detach().clone().requires_grad_() for p in ps]
    opt = HybridAdam(ps, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p, r, dtype in zip(ps, refs, (torch.bfloat16, torch.float16)):
            grad = torch.randn(p.shape, generator=g).to(device, dtype)
            p.grad, r.grad = grad, grad.float()
        opt.step(div_scale=2.0)
        for r in refs:
            r.grad /= 2.0
        ref.step()
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert ps[0].grad.dtype == torch.bfloat16
