"""Tests of torchops.fused_sgd_ and torchops.optim.SGD: 50 steps of a small
model against torch.optim.SGD (momentum, dampening, nesterov, weight decay,
maximize), state dicts loaded both ways, float16/bfloat16 parameters with
float32 masters, GradScaler's grad_scale/found_inf, lr as a tensor, the op
against its reference in every dtype (several chunks, unaligned tensors, and
on a GPU more tensors and chunks than one launch takes), and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from test_optim import _assert_states_close, _batches, _devices, _model, _train
from torch._subclasses.fake_tensor import FakeTensorMode

import torchops
from torchops import references
from torchops.optim import SGD

OP = torch.ops.torchops.fused_sgd_.default

VARIANTS = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "momentum-dampening-wd": {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1},
    "nesterov-wd": {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
    "nesterov-maximize": {"momentum": 0.9, "nesterov": True, "maximize": True},
    "wd-maximize": {"weight_decay": 0.1, "maximize": True},
}


# test_optim's CUDA tolerance over many steps: torch's CUDA steps order or
# widen some of the arithmetic differently.
_CUDA_TOL = {"cuda": dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kw", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_torch_optim_for_50_steps(device, kw):
    batches = _batches(device, 50)
    ma, mb = _model(device), _model(device)
    oa = SGD(ma.parameters(), lr=1e-2, **kw)
    ob = torch.optim.SGD(mb.parameters(), lr=1e-2, foreach=False, **kw)
    _train(ma, oa, batches)
    _train(mb, ob, batches)
    # On the CPU the arithmetic is torch's for-loop's, fma for fma: equal
    # bit for bit.  CUDA: test_optim's tolerance (torch's kernels there may
    # contract a product and a sum that ours rounds apart, or the reverse).
    _assert_states_close(oa, ob, **_CUDA_TOL.get(device, dict(rtol=0, atol=0)))
    sa, sb = oa.state_dict(), ob.state_dict()
    assert set(sa["param_groups"][0]) == set(sb["param_groups"][0])
    assert {i: set(s) for i, s in sa["state"].items()} == \
        {i: set(s) for i, s in sb["state"].items()}


@pytest.mark.parametrize("device", _devices())
def test_lr_as_tensor(device):
    batches = _batches(device, 20)
    ma, mb = _model(device), _model(device)
    oa = SGD(ma.parameters(), lr=torch.tensor(3e-2), momentum=0.9, weight_decay=0.1)
    ob = torch.optim.SGD(mb.parameters(), lr=torch.tensor(3e-2), momentum=0.9, weight_decay=0.1,
                         foreach=False)
    _train(ma, oa, batches)
    _train(mb, ob, batches)
    _assert_states_close(oa, ob, **_CUDA_TOL.get(device, {}))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("direction", ["ours-to-torch", "torch-to-ours"])
def test_state_dict_round_trip(device, direction):
    batches = _batches(device, 20)
    ours_first = direction == "ours-to-torch"
    kw = {"lr": 1e-2, "momentum": 0.9, "nesterov": True}
    m1 = _model(device)
    o1 = SGD(m1.parameters(), **kw) if ours_first else torch.optim.SGD(m1.parameters(), **kw)
    _train(m1, o1, batches[:10])
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.SGD(m2.parameters(), **kw) if ours_first else SGD(m2.parameters(), **kw)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    assert set(o2.state_dict()["state"][0]) == {"momentum_buffer"}
    _train(m1, o1, batches[10:])
    _train(m2, o2, batches[10:])
    tol = _CUDA_TOL.get(device, dict(rtol=1e-6, atol=1e-7))
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, **tol)


def test_some_parameters_start_their_buffers_later():
    """A parameter whose first gradient comes later starts its buffer then
    (a call with is_first_step beside one without), as in torch.optim.SGD."""
    ma, mb = _model("cpu"), _model("cpu")
    oa = SGD(ma.parameters(), lr=1e-2, momentum=0.9, dampening=0.5)
    ob = torch.optim.SGD(mb.parameters(), lr=1e-2, momentum=0.9, dampening=0.5, foreach=False)
    for k, (x, y) in enumerate(_batches("cpu", 6)):
        for m, o in ((ma, oa), (mb, ob)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if k < 3:
                m[2].weight.grad = None
            o.step()
    _assert_states_close(oa, ob, rtol=0, atol=0)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_a_float32_run(device, dtype):
    g = torch.Generator().manual_seed(2)
    p32 = [torch.randn(shape, generator=g).to(device) for shape in ((33, 5), (17,), (1,))]
    plow = [torch.nn.Parameter(p.to(dtype)) for p in p32]
    p32 = [torch.nn.Parameter(p.to(dtype).float()) for p in p32]
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    oa = SGD(plow, master_weights=True, **kw)
    ob = torch.optim.SGD(p32, **kw)
    for _ in range(20):
        for a, b in zip(plow, p32):
            grad = torch.randn(b.shape, generator=g).to(device)
            b.grad = grad
            a.grad = grad.to(dtype)
        oa.step()
        ob.step()
    for a, b in zip(plow, p32):
        state = oa.state[a]
        assert a.dtype == dtype and state["momentum_buffer"].dtype == torch.float32
        # The parameter is its master rounded, and the master follows the
        # float32 run up to the gradients' rounding.
        assert torch.equal(a, state["master_param"].to(dtype))
        torch.testing.assert_close(state["master_param"], b.detach(), rtol=0, atol=3e-3)
    # Saved and loaded, the float32 states stay float32.
    oc = SGD(plow, master_weights=True, **kw)
    oc.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert oc.state[plow[0]]["master_param"].dtype == torch.float32
    assert torch.equal(oc.state[plow[0]]["momentum_buffer"], oa.state[plow[0]]["momentum_buffer"])


@pytest.mark.parametrize("device", _devices())
def test_master_update_equals_the_float32_update(device):
    """The op with masters does the float32 op's arithmetic on the master,
    bit for bit, and rounds it into the parameter."""
    n = 1000
    g = torch.Generator().manual_seed(3)
    master = [torch.randn(n, generator=g).to(device)]
    grad = [torch.randn(n, generator=g).to(device)]
    kw = dict(weight_decay=0.1, momentum=0.9, lr=1e-2, dampening=0.2, nesterov=False,
              maximize=True)
    buf32, buf16 = [torch.empty(n, device=device)], [torch.empty(n, device=device)]
    p32 = [master[0].clone()]
    p16 = [master[0].to(torch.bfloat16)]
    m16 = [master[0].clone()]
    for step in range(3):
        OP(p32, grad, buf32, is_first_step=step == 0, **kw)
        OP(p16, grad, buf16, is_first_step=step == 0, master_params=m16, **kw)
    assert torch.equal(m16[0], p32[0])
    assert torch.equal(p16[0], p32[0].to(torch.bfloat16))
    assert torch.equal(buf16[0], buf32[0])


@pytest.mark.parametrize("device", _devices())
def test_grad_scaler(device):
    """GradScaler hands the fused step its scale and inf flag, as it does to
    torch's fused SGD; a step with an inf gradient is skipped whole, and a
    skipped first step makes no momentum buffer."""
    batches = _batches(device, 10)
    ma, mb = _model(device), _model(device)
    kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.01)
    oa = SGD(ma.parameters(), **kw)
    ob = torch.optim.SGD(mb.parameters(), fused=True, **kw)
    sa = torch.amp.GradScaler(device, init_scale=1024.0)
    sb = torch.amp.GradScaler(device, init_scale=1024.0)
    _train(ma, oa, batches, sa)
    _train(mb, ob, batches, sb)
    # CUDA: torch's fused step adds and multiplies in double, rounding once
    # where the for-loop order ours follows rounds each float32 operation.
    _assert_states_close(oa, ob, **_CUDA_TOL.get(device, {}))

    def inf_step(model, opt, scaler):
        x, y = batches[0]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()

    before = copy.deepcopy(oa.state_dict())
    params = [p.detach().clone() for p in ma.parameters()]
    inf_step(ma, oa, sa)
    for p, q in zip(ma.parameters(), params):
        assert torch.equal(p, q)
    for i, s in before["state"].items():
        for key, value in s.items():
            assert torch.equal(oa.state_dict()["state"][i][key], value), key
    # A first step skipped: no buffer, and the next step starts it from its
    # gradient as the first step would have.
    mc = _model(device)
    oc = SGD(mc.parameters(), **kw)
    inf_step(mc, oc, torch.amp.GradScaler(device, init_scale=1024.0))
    assert len(oc.state) == 0


@pytest.mark.parametrize("device", _devices())
def test_found_inf_skips_the_op(device):
    params, grads, bufs, _ = _op_inputs(device, torch.float32, [10, 3])
    before = [t.clone() for t in (*params, *grads, *bufs)]
    OP(params, grads, bufs, weight_decay=0.1, momentum=0.9, lr=1e-2, dampening=0.0,
       nesterov=False, maximize=False, is_first_step=False,
       grad_scale=torch.tensor(2.0, device=device), found_inf=torch.tensor(1.0, device=device))
    for a, b in zip(before, (*params, *grads, *bufs)):
        assert torch.equal(a, b)


def _op_inputs(device, dtype, sizes, offset=0, master=False, momentum=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(n, dt):
        base = torch.empty(n + offset, dtype=torch.float64).uniform_(-1.0, 1.0, generator=g)
        return base.to(device=device, dtype=dt)[offset:]

    sdtype = torch.float32 if master else dtype
    params = [rand(n, dtype) for n in sizes]
    grads = [rand(n, dtype) for n in sizes]
    bufs = [rand(n, sdtype) for n in sizes] if momentum else []
    masters = [p.float() for p in params] if master else None
    return params, grads, bufs, masters


_TOLS = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-6, 1e-6),
         torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


def _check_op_against_reference(device, dtype, sizes, offset=0, master=False, scaled=False,
                                tensor_lr=False, **hyper):
    momentum = hyper.get("momentum", 0.9)
    params, grads, bufs, masters = _op_inputs(device, dtype, sizes, offset=offset, master=master,
                                              momentum=momentum != 0)
    scale = torch.tensor([4.0], device=device) if scaled else None
    lr = torch.tensor(1e-2, device=device) if tensor_lr else 1e-2
    kw = dict(dict(weight_decay=0.05, momentum=0.9, dampening=0.1, nesterov=False,
                   maximize=False, is_first_step=False), **hyper)
    kw.update(lr=lr, grad_scale=scale)
    f64 = lambda ts: None if ts is None else [t.double() for t in ts]  # noqa: E731
    want = references.fused_sgd_(f64(params), f64(grads), f64(bufs),
                                 master_params=f64(masters), **kw)
    torchops.fused_sgd_(params, grads, bufs, master_params=masters, **kw)
    rtol, atol = _TOLS[torch.float32 if master else dtype]
    got = (params, grads, bufs) + ((masters,) if master else ())
    for name, g_list, w_list in zip(("params", "grads", "momentum_buffer_list",
                                     "master_params"), got, want):
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
    _check_op_against_reference(device, dtype, [1027, 5], offset=1, tensor_lr=True,
                                nesterov=True, dampening=0.0, maximize=True)
    _check_op_against_reference(device, dtype, [33, 2], is_first_step=True, nesterov=True,
                                dampening=0.0)
    _check_op_against_reference(device, dtype, [33, 2], momentum=0.0, weight_decay=0.0)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_with_masters_matches_reference(device, dtype):
    _check_op_against_reference(device, dtype, [70000, 13, 1], master=True, scaled=True)
    _check_op_against_reference(device, dtype, [1027], master=True, is_first_step=True)


def test_grads_in_float32_with_masters():
    params, grads, bufs, masters = _op_inputs("cpu", torch.bfloat16, [100], master=True)
    grads32 = [g.float() for g in grads]
    kw = dict(weight_decay=0.0, momentum=0.9, lr=1e-2, dampening=0.0, nesterov=False,
              maximize=False, is_first_step=True)
    p2, b2 = [p.clone() for p in params], [b.clone() for b in bufs]
    m2 = [m.clone() for m in masters]
    OP(params, grads, bufs, master_params=masters, **kw)
    OP(p2, grads32, b2, master_params=m2, **kw)
    assert torch.equal(params[0], p2[0]) and torch.equal(b2[0], bufs[0])


@pytest.mark.cuda
def test_cuda_many_tensors_and_chunks():
    """More tensors (60) than a launch's table holds, and more chunks (300)
    than its blocks: the lists span several launches, a tensor split
    between two."""
    sizes = [(i * 7919) % 5000 + 1 for i in range(60)] + [300 * 65536 + 17, 3, 65536]
    _check_op_against_reference("cuda", torch.float32, sizes, scaled=True)
    _check_op_against_reference("cuda", torch.bfloat16, sizes, master=True, nesterov=True,
                                dampening=0.0)
    # The split tensor mid-table, then more tensors than its old slot.
    _check_op_against_reference("cuda", torch.float32, [5] * 10 + [300 * 65536 + 17] + [7] * 20)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    cpu = _op_inputs("cpu", torch.float32, [5000, 77])
    gpu = [None if ts is None else [t.cuda() for t in ts] for ts in cpu]
    kw = dict(weight_decay=0.01, momentum=0.9, lr=1e-3, dampening=0.1, nesterov=False,
              maximize=True, is_first_step=False)
    torchops.fused_sgd_(*cpu[:3], **kw)
    torchops.fused_sgd_(*gpu[:3], **kw)
    for a, b in zip(cpu[:3], gpu[:3]):
        for s, t in zip(a, b):
            torch.testing.assert_close(t.cpu(), s, rtol=1e-6, atol=1e-7)


def _error_cases():
    p = _op_inputs("cpu", torch.float32, [4, 3])

    def base(**over):
        params, grads, bufs, _ = _op_inputs("cpu", torch.float32, [4, 3])
        args = dict(params=params, grads=grads, momentum_buffer_list=bufs)
        args.update(over)
        return args
    sparse = torch.zeros(3).to_sparse()
    return [
        (base(grads=p[1][:1]), r"'grads' to have 2 tensors"),
        (base(momentum_buffer_list=[]), r"'momentum_buffer_list' to have 2 tensors"),
        (base(momentum_buffer_list=[p[2][0], p[2][1].double()]),
         r"'momentum_buffer_list\[1\]' to have dtype"),
        (base(grads=[p[1][0], sparse]), r"'grads\[1\]'.*sparse"),
        (base(params=[p[0][0], p[0][0]]), r"'params\[1\]' appears twice"),
        (base(momentum_buffer_list=[p[2][0], torch.zeros(4)]),
         r"'momentum_buffer_list\[1\]' has shape"),
        (base(params=[p[0][0].half(), p[0][1].half()]), r"'grads\[0\]' to have dtype"),
        (base(params=[p[0][0], p[0][1].double()]), r"'params\[1\]' to have dtype"),
        (base(grads=[p[1][0], torch.zeros(6)[::2]]), r"'grads\[1\]' must be dense"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
def test_errors_name_the_op_and_index(fake):
    kw = dict(weight_decay=0.0, momentum=0.9, lr=1e-3, dampening=0.0, nesterov=False,
              maximize=False, is_first_step=False)
    for args, match in _error_cases():
        if fake:
            if any(t.is_sparse for t in args["grads"]):
                continue  # fake tensors of sparse layouts are not what this checks
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                args = {k: [mode.from_tensor(t) for t in ts] for k, ts in args.items()}
                with pytest.raises(RuntimeError, match=r"torchops\.fused_sgd_: .*" + match):
                    OP(**args, **kw)
        else:
            with pytest.raises(RuntimeError, match=r"torchops\.fused_sgd_: .*" + match):
                OP(**args, **kw)


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
def test_momentum_list_rules(fake):
    """No buffers without momentum, masters only for half parameters, the
    step's scalars float32 single elements (messages as the kernel's)."""
    params, grads, bufs, masters = _op_inputs("cpu", torch.bfloat16, [4], master=True)
    floats = [t.float() for t in params]
    kw = dict(weight_decay=0.0, lr=1e-3, dampening=0.0, nesterov=False, maximize=False,
              is_first_step=False)
    # (momentum, params, grads, buffers, masters, grad_scale, message)
    cases = [
        (0.0, params, grads, bufs, None, None,
         r"'momentum_buffer_list' to have 0 tensors \(none without momentum\)"),
        (0.9, params, grads, bufs, [], None, r"'master_params' to have 1 tensors"),
        (0.9, floats, [t.clone() for t in floats], bufs, masters, None,
         r"'params' to be float16 or bfloat16"),
        (0.9, params, grads, bufs, masters, torch.tensor([1.0, 2.0]),
         r"'grad_scale' to be a float32 tensor of one element"),
        (0.9, params, grads, bufs, masters, None, r"'lr' to be a float32 tensor"),
    ]
    match = r"torchops\.fused_sgd_: .*"
    for momentum, ps, gs, bs, ms, scale, msg in cases:
        # The last case: a float64 lr, through the tensor_lr overload.
        kw["lr"] = torch.tensor(1e-3, dtype=torch.float64) if "'lr'" in msg else 1e-3
        if fake:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            conv = lambda ts: None if ts is None else [mode.from_tensor(t) for t in ts]  # noqa
            ps, gs, bs, ms = conv(ps), conv(gs), conv(bs), conv(ms)
            scale = None if scale is None else mode.from_tensor(scale)
            if torch.is_tensor(kw["lr"]):
                kw["lr"] = mode.from_tensor(kw["lr"])
            with mode, pytest.raises(RuntimeError, match=match + msg):
                torchops.fused_sgd_(ps, gs, bs, momentum=momentum, master_params=ms,
                                    grad_scale=scale, **kw)
        else:
            with pytest.raises(RuntimeError, match=match + msg):
                torchops.fused_sgd_(ps, gs, bs, momentum=momentum, master_params=ms,
                                    grad_scale=scale, **kw)


def test_op_under_compile():
    params, grads, bufs, _ = _op_inputs("cpu", torch.float32, [10, 3])
    ref = [[t.clone() for t in ts] for ts in (params, grads, bufs)]
    kw = dict(weight_decay=0.1, momentum=0.9, dampening=0.0, nesterov=True, maximize=False,
              is_first_step=False)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(lr):
        torchops.fused_sgd_(params, grads, bufs, lr=lr, **kw)

    step(torch.tensor(1e-2))
    torchops.fused_sgd_(*ref, lr=torch.tensor(1e-2), **kw)
    for a, b in zip((params, grads, bufs), ref):
        for s, t in zip(a, b):
            assert torch.equal(s, t)


def test_optimizer_arguments():
    p = [torch.nn.Parameter(torch.zeros(3))]
    ours, theirs = SGD(p), torch.optim.SGD(p)
    assert ours.defaults == theirs.defaults
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(p, nesterov=True)
    with pytest.raises(ValueError, match="differentiable"):
        SGD(p, differentiable=True)


def test_scalar_path_matches_reference():
    """Without AVX2 (ATEN_CPU_CAPABILITY=default) the CPU kernel runs the
    scalar update of common/fused_sgd.h, the one the CUDA kernel runs."""
    import os
    import subprocess
    import sys
    code = ("import torch, test_sgd as t; "
            "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
            "t._check_op_against_reference('cpu', torch.float32, [70000, 13, 1], scaled=True); "
            "t._check_op_against_reference('cpu', torch.bfloat16, [1027], master=True); "
            "t._check_op_against_reference('cpu', torch.float64, [33], nesterov=True, "
            "dampening=0.0, is_first_step=True)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
