"""Tests of torchops.fused_adam_ and the optimizers on it (torchops.optim):
50 steps of a small model against torch.optim.Adam/AdamW, state dicts
loaded both ways, float16/bfloat16 parameters with float32 masters,
GradScaler's grad_scale/found_inf, lr as a tensor, the op against its
reference in every dtype (several chunks, unaligned tensors, and on a GPU
more tensors and chunks than one launch takes), and the errors."""

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
