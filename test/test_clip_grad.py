"""Tests of torchops.multi_tensor_l2norm, torchops.multi_tensor_scale_ and
torchops.clip_grad_norm_ on them: norms against a float64 reference and
torch.nn.utils.get_total_norm in every dtype (several chunks, empty tensors
and lists, permuted layouts, unaligned arrays, and on a GPU more tensors and
chunks than one launch takes), determinism, inf/NaN, the scale in every
dtype with a float and a tensor scale, clip_grad_norm_ against
torch.nn.utils.clip_grad_norm_ on a small model, and the errors (kernel and
fake)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchops
from torchops import references

L2NORM = torch.ops.torchops.multi_tensor_l2norm.default
SCALE = torch.ops.torchops.multi_tensor_scale_.default
SCALE_T = torch.ops.torchops.multi_tensor_scale_.tensor

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Relative error of a float32 sum of squares (float64 for float64).
_NORM_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5,
              torch.float16: 1e-5}


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _tensors(device, dtype, sizes, offset=0, seed=0):
    """Random tensors of `sizes` (offset > 0: views one element into their
    storage, so no array is aligned for vector loads)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        base = torch.empty(n + offset, dtype=torch.float64).uniform_(-2, 2, generator=g)
        out.append(base.to(device=device, dtype=dtype)[offset:])
    return out


def _check_norm(tensors, per_tensor=True):
    dtype = tensors[0].dtype
    want_total, want_per = (w.cpu() for w in references.multi_tensor_l2norm(
        [t.double() for t in tensors], True))
    total, per = torchops.multi_tensor_l2norm(tensors, per_tensor=per_tensor)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert total.dtype == acc and total.shape == () and total.device == tensors[0].device
    rtol = _NORM_RTOL[dtype]
    torch.testing.assert_close(total.double().cpu(), want_total, rtol=rtol, atol=0)
    if per_tensor:
        assert per.dtype == acc and per.shape == (len(tensors),)
        torch.testing.assert_close(per.double().cpu(), want_per, rtol=rtol, atol=0)
    else:
        assert per.shape == (0,)
    return total, per


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_reference(device, dtype):
    # Several chunks in one tensor, a partial vector, empty tensors; an
    # offset of one element makes every array unaligned.
    _check_norm(_tensors(device, dtype, [70000, 13, 0, 1, 300]))
    _check_norm(_tensors(device, dtype, [1027, 5, 0], offset=1), per_tensor=False)
    _check_norm(_tensors(device, dtype, [0, 0]))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_get_total_norm(device, dtype):
    g = torch.Generator().manual_seed(1)
    for trial in range(3):
        sizes = torch.randint(0, 3000, (int(torch.randint(1, 12, (1,), generator=g)),),
                              generator=g).tolist()
        ts = _tensors(device, dtype, sizes, seed=trial)
        total, _ = torchops.multi_tensor_l2norm(ts)
        # torch rounds each tensor's norm to the dtype: compare the float32
        # ones closely, the half ones within that rounding.
        want = torch.nn.utils.get_total_norm(ts)
        tol = dict(rtol=1e-5, atol=0) if dtype in (torch.float32, torch.float64) else \
            dict(rtol=1e-2, atol=0)
        torch.testing.assert_close(total.to(want.dtype), want, **tol)


@pytest.mark.parametrize("device", _devices())
def test_l2norm_of_permuted_and_multi_dim_tensors(device):
    a = torch.randn(5, 7, 3, device=device).permute(2, 0, 1)
    b = torch.randn(4, 6, device=device).t()
    total, per = torchops.multi_tensor_l2norm([a, b], per_tensor=True)
    torch.testing.assert_close(per, torch.stack([a.norm(), b.norm()]))
    torch.testing.assert_close(total, torch.cat([a.flatten(), b.flatten()]).norm())


def test_l2norm_empty_list():
    total, per = torchops.multi_tensor_l2norm([], per_tensor=True)
    assert total.item() == 0.0 and total.dtype == torch.float32 and per.shape == (0,)
    assert torch.equal(total, torch.nn.utils.get_total_norm([]))
    # The operator itself has no device to run on: the dispatcher says so
    # (and the fake, under FakeTensorMode, names the wrapper).
    with pytest.raises(RuntimeError, match=r"empty list of Tensors"):
        L2NORM([], False)
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=r"torchops\.multi_tensor_l2norm: 'tensors' is "
                           r"empty"):
            L2NORM([], False)


@pytest.mark.parametrize("device", _devices())
def test_l2norm_inf_and_nan(device):
    for bad, want in ((float("inf"), float("inf")), (float("nan"), float("nan")),
                      (-float("inf"), float("inf"))):
        ts = _tensors(device, torch.float32, [100, 70000])
        ts[1][12345] = bad
        total, per = torchops.multi_tensor_l2norm(ts, per_tensor=True)
        ref = torch.nn.utils.get_total_norm(ts)
        assert torch.equal(total.isnan(), ref.isnan()) and torch.equal(total.isinf(), ref.isinf())
        torch.testing.assert_close(total.cpu(), torch.tensor(want), equal_nan=True)
        assert torch.isfinite(per[0]) and not torch.isfinite(per[1])
    # inf and NaN together: NaN, as torch's.
    ts = _tensors(device, torch.float32, [10, 10])
    ts[0][0], ts[1][1] = float("inf"), float("nan")
    assert torchops.multi_tensor_l2norm(ts)[0].isnan()
    assert torch.nn.utils.get_total_norm(ts).isnan()


@pytest.mark.parametrize("device", _devices())
def test_l2norm_is_deterministic_across_thread_counts(device):
    ts = _tensors(device, torch.float32, [300000, 70000, 5, 131072])
    first = torchops.multi_tensor_l2norm(ts, per_tensor=True)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            again = torchops.multi_tensor_l2norm(ts, per_tensor=True)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_matches_reference(device, dtype):
    for offset, scale in ((0, 0.37), (1, -3.0)):
        ts = _tensors(device, dtype, [70000, 13, 0, 1, 300], offset=offset)
        want = references.multi_tensor_scale_(ts, scale)[0]
        torchops.multi_tensor_scale_(ts, scale)
        for i, (a, b) in enumerate(zip(ts, want)):
            assert torch.equal(a, b), f"tensors[{i}]"
    # A tensor scale, float32 and float64, read by the kernel.
    for sdt in (torch.float32, torch.float64):
        scale = torch.tensor(0.37, device=device, dtype=sdt)
        ts = _tensors(device, dtype, [1027, 5])
        want = references.multi_tensor_scale_(ts, scale)[0]
        torchops.multi_tensor_scale_(ts, scale)
        for a, b in zip(ts, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", _devices())
def test_scale_matches_foreach_mul(device):
    ts = _tensors(device, torch.float32, [70000, 33])
    us = [t.clone() for t in ts]
    coef = torch.tensor(0.123, device=device)
    torchops.multi_tensor_scale_(ts, coef)
    torch._foreach_mul_(us, coef)
    for a, b in zip(ts, us):
        assert torch.equal(a, b)
    ts[0][0] = float("inf")
    torchops.multi_tensor_scale_(ts, 0.0)
    assert ts[0][0].isnan() and ts[0][1] == 0


def test_scale_empty_list():
    torchops.multi_tensor_scale_([], 2.0)
    torchops.multi_tensor_scale_([], torch.tensor(2.0))


@pytest.mark.cuda
def test_cuda_many_tensors_and_chunks():
    """More tensors (150) than a launch's table holds, and more chunks (300)
    than its blocks: the lists span several launches, a tensor split
    between two; more tensors than one per-tensor reduction launch takes."""
    sizes = [(i * 7919) % 5000 + 1 for i in range(150)] + [300 * 65536 + 17, 0, 3, 65536]
    ts = _tensors("cuda", torch.float32, sizes)
    _check_norm(ts)
    _check_norm(_tensors("cuda", torch.bfloat16, sizes))
    want = references.multi_tensor_scale_(ts, 0.5)[0]
    torchops.multi_tensor_scale_(ts, torch.tensor(0.5, device="cuda"))
    for a, b in zip(ts, want):
        assert torch.equal(a, b)
    # The split tensor mid-table, then more tensors than its old slot.
    _check_norm(_tensors("cuda", torch.float32, [5] * 10 + [300 * 65536 + 17] + [7] * 20))


@pytest.mark.cuda
def test_cuda_matches_cpu():
    cpu = _tensors("cpu", torch.float32, [70000, 77, 0, 5])
    gpu = [t.cuda() for t in cpu]
    a = torchops.multi_tensor_l2norm(cpu, per_tensor=True)
    b = torchops.multi_tensor_l2norm(gpu, per_tensor=True)
    torch.testing.assert_close(b[0].cpu(), a[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(b[1].cpu(), a[1], rtol=1e-5, atol=0)


@pytest.mark.cuda
def test_cuda_under_graph_capture():
    ts = _tensors("cuda", torch.float32, [70000, 13])
    out = torchops.multi_tensor_l2norm(ts)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torchops.multi_tensor_l2norm(ts)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[0].double().cpu(),
                               references.multi_tensor_l2norm([t.double() for t in ts])[0].cpu(),
                               rtol=2e-6, atol=0)


def _model(device, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5)).to(device=device, dtype=dtype)


def _grads(model, device, dtype=torch.float32, scale=1.0):
    torch.manual_seed(1)
    x = torch.randn(8, 7, device=device, dtype=dtype)
    model.zero_grad()
    (model(x).square().sum() * scale).backward()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(device, dtype, max_norm):
    ma, mb = _model(device, dtype), _model(device, dtype)
    _grads(ma, device, dtype)
    _grads(mb, device, dtype)
    na = torchops.clip_grad_norm_(ma.parameters(), max_norm)
    nb = torch.nn.utils.clip_grad_norm_(mb.parameters(), max_norm)
    assert na.dtype == nb.dtype and na.device == nb.device and na.shape == nb.shape == ()
    tol = dict(rtol=2e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)
    torch.testing.assert_close(na, nb, **tol)
    for a, b in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tol)


@pytest.mark.parametrize("device", _devices())
def test_clip_grad_norm_mixed_dtypes_and_a_single_tensor(device):
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dt))
              for n, dt in ((100, torch.float32), (30, torch.bfloat16), (7, torch.float32),
                            (9, torch.float64))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, ref):
        q.grad = p.grad.clone()
    na = torchops.clip_grad_norm_(params, 1.0)
    nb = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert na.dtype == nb.dtype == torch.float64
    torch.testing.assert_close(na, nb, rtol=1e-3, atol=0)
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-2 if a.dtype == torch.bfloat16
                                   else 1e-3, atol=1e-6)
    # One tensor, not a list; a parameter without a gradient is left out.
    p = torch.nn.Parameter(torch.ones(4, device=device))
    q = torch.nn.Parameter(torch.ones(4, device=device))
    p.grad = torch.full((4,), 3.0, device=device)
    assert torchops.clip_grad_norm_(p, 1.0).item() == pytest.approx(6.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 0.5, device=device), rtol=1e-6, atol=0)
    assert torchops.clip_grad_norm_([q], 1.0).item() == 0.0


@pytest.mark.parametrize("device", _devices())
def test_clip_grad_norm_nonfinite(device):
    model = _model(device)
    _grads(model, device)
    next(model.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"non-finite, so it cannot be clipped"):
        torchops.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    ref = _model(device)
    _grads(ref, device)
    next(ref.parameters()).grad[0, 0] = float("inf")
    na = torchops.clip_grad_norm_(model.parameters(), 1.0)
    nb = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert na.isinf() and nb.isinf()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)


@pytest.mark.parametrize("norm_type", [1.0, float("inf"), 3.0])
def test_clip_grad_norm_other_norms_fall_back_to_torch(norm_type):
    ma, mb = _model("cpu"), _model("cpu")
    _grads(ma, "cpu", scale=10.0)
    _grads(mb, "cpu", scale=10.0)
    na = torchops.clip_grad_norm_(ma.parameters(), 1.0, norm_type=norm_type)
    nb = torch.nn.utils.clip_grad_norm_(mb.parameters(), 1.0, norm_type=norm_type)
    assert torch.equal(na, nb)
    for a, b in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_clip_grad_norm_under_compile():
    ma, mb = _model("cpu"), _model("cpu")
    _grads(ma, "cpu", scale=10.0)
    _grads(mb, "cpu", scale=10.0)
    params = list(ma.parameters())

    @torch.compile(fullgraph=True, backend="aot_eager")
    def clip():
        return torchops.clip_grad_norm_(params, 1.0)

    na = clip()
    nb = torchops.clip_grad_norm_(mb.parameters(), 1.0)
    assert torch.equal(na, nb)
    for a, b in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(a.grad, b.grad)


def _error_cases():
    f = lambda *s, dt=torch.float32: torch.randn(s, dtype=dt)  # noqa: E731
    p = f(3)
    return [
        (L2NORM, ([f(3), f(2, dt=torch.float64)], False),
         r"multi_tensor_l2norm: expected 'tensors\[1\]' to have dtype torch.float64|"
         r"multi_tensor_l2norm: expected 'tensors\[1\]' to have dtype"),
        (L2NORM, ([f(3), f(4, 2)[:, 0]], True), r"multi_tensor_l2norm: 'tensors\[1\]' must be "
         r"dense"),
        (L2NORM, ([f(3), f(2).expand(2, 2)], True), r"multi_tensor_l2norm: 'tensors\[1\]' must "
         r"be dense"),
        (L2NORM, ([torch.zeros(2, dtype=torch.int32)], True),
         r"multi_tensor_l2norm: expected 'tensors\[0\]' to be a floating-point"),
        (SCALE, ([f(3), f(3, dt=torch.bfloat16)], 2.0),
         r"multi_tensor_scale_: expected 'tensors\[1\]' to have dtype"),
        (SCALE, ([p, p], 2.0), r"multi_tensor_scale_: 'tensors\[1\]' appears twice"),
        (SCALE, ([f(3), f(3, 2).t()[0]], 2.0), r"multi_tensor_scale_: 'tensors\[1\]' must be "
         r"dense"),
        (SCALE_T, ([f(3)], torch.ones(2)),
         r"multi_tensor_scale_: expected 'scale' to be a float32 or float64 tensor"),
        (SCALE_T, ([f(3)], torch.ones((), dtype=torch.int64)),
         r"multi_tensor_scale_: expected 'scale' to be a float32 or float64 tensor"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
def test_errors_name_the_op_and_index(fake):
    for op, args, match in _error_cases():
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                def conv(a):
                    return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                args = tuple([conv(t) for t in a] if isinstance(a, list) else conv(a)
                             for a in args)
                with pytest.raises(RuntimeError, match=r"torchops\." + match):
                    op(*args)
        else:
            with pytest.raises(RuntimeError, match=r"torchops\." + match):
                op(*args)


def test_sparse_is_rejected_by_name():
    sparse = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"multi_tensor_l2norm: 'tensors\[1\]' must be a "
                       r"dense \(strided\)"):
        L2NORM([torch.ones(2), sparse], False)
    with pytest.raises(RuntimeError, match=r"multi_tensor_scale_: 'tensors\[1\]' must be a "
                       r"dense \(strided\)"):
        SCALE([torch.ones(2), sparse], 2.0)


def test_ops_under_compile():
    ts = _tensors("cpu", torch.float32, [100, 7])
    ref = [t.clone() for t in ts]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(scale):
        total, per = torchops.multi_tensor_l2norm(ts, per_tensor=True)
        torchops.multi_tensor_scale_(ts, scale)
        return total, per

    total, per = step(torch.tensor(0.5))
    want = torchops.multi_tensor_l2norm(ref, per_tensor=True)
    torchops.multi_tensor_scale_(ref, 0.5)
    assert torch.equal(total, want[0]) and torch.equal(per, want[1])
    for a, b in zip(ts, ref):
        assert torch.equal(a, b)


def test_scalar_path_matches_reference():
    """Without AVX2 (ATEN_CPU_CAPABILITY=default) the CPU kernels run their
    scalar loops."""
    import os
    import subprocess
    import sys
    code = ("import torch, test_clip_grad as t; "
            "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
            "t._check_norm(t._tensors('cpu', torch.float32, [70000, 13, 1])); "
            "t._check_norm(t._tensors('cpu', torch.bfloat16, [1027])); "
            "t.test_scale_matches_reference('cpu', torch.float32); "
            "t.test_scale_matches_reference('cpu', torch.float16)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
