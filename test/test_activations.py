"""Op-specific tests of the gated activations (silu_and_mul, gelu_and_mul);
the generic ones come from their op-database entries (test/opdb/activations.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torchops
from torchops import references

from opdb import make

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPS = {
    "silu": (lambda x: torchops.silu_and_mul(x), references.silu_and_mul),
    "gelu": (lambda x: torchops.gelu_and_mul(x), references.gelu_and_mul),
    "gelu_tanh": (lambda x: torchops.gelu_and_mul(x, "tanh"),
                  lambda x: references.gelu_and_mul(x, "tanh")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", list(OPS))
def test_float32_accuracy_against_float64(device, act):
    """In float32 the kernels' exp, erf and tanh (CPU: ATen's vectorised
    exp_u20 and erf, SLEEF's tanh) are as accurate as PyTorch's own float32
    activations, forward and backward, over the whole range and its tails:
    each error against float64 is within twice PyTorch's (which is large
    where the formula cancels, as 1 + erf(x / sqrt 2) for x << 0) plus 32
    ulp of the value (exp_u20 is a 20-ulp exp); gradients near the slopes'
    zero crossings, where O(1) terms cancel, within 4 ulp of those terms."""
    op, ref = OPS[act]
    a = torch.linspace(-40, 40, 20001, dtype=torch.float64)
    x = torch.cat([a, torch.ones_like(a)]).view(1, -1).float().to(device)
    g = torch.randn(1, a.numel(), dtype=torch.float64).float().to(device)

    def run(fn, x):
        x = x.detach().requires_grad_()
        out = fn(x)
        (dx,) = torch.autograd.grad(out, x, g.to(x.dtype))
        return out.detach().double(), dx.double()

    eps = torch.finfo(torch.float32).eps
    terms = (0.0, 4 * eps * g.double().abs().repeat(1, 2))
    ours, torch32, exact = run(op, x), run(ref, x), run(ref, x.double())
    for got, theirs, want, term in zip(ours, torch32, exact, terms):
        bound = 2 * (theirs - want).abs() + 32 * eps * want.abs() + term + 1e-30
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", list(OPS))
def test_long_rows_split_into_column_blocks(act, dtype):
    """Rows longer than one work item (4096 columns) split over threads; the
    result is independent of the thread count, and each block's tail (d not
    a multiple of the vector width) is right."""
    op, ref = OPS[act]
    x = make((3, 2 * 9001), "cpu", dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x)
    finally:
        torch.set_num_threads(threads)
    many = op(x)
    assert torch.equal(one, many)
    tol = {torch.float32: (1e-5, 1.3e-5), torch.bfloat16: (1e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(many.double(), ref(x.double()), atol=tol[0], rtol=tol[1])


def test_scalar_path_matches_the_vector_path():
    """On a CPU without AVX2 (here: PyTorch told so with ATEN_CPU_CAPABILITY)
    the kernels run their one-element-at-a-time loops; they agree with the
    vector ones."""
    code = textwrap.dedent("""
        import torch, torchops
        torch.manual_seed(0)
        out = {}
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            x = (torch.randn(5, 2 * 37, dtype=torch.float64) * 4).to(dtype).requires_grad_()
            for name, fn in (("silu", torchops.silu_and_mul),
                             ("gelu", torchops.gelu_and_mul),
                             ("tanh", lambda t: torchops.gelu_and_mul(t, "tanh"))):
                y = fn(x)
                (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
                out[(name, str(dtype))] = (y.detach().double(), g.double())
        torch.save(out, PATH)
    """)
    results = []
    for capability in ("default", None):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                            f"torchops_act_{os.getpid()}_{capability}.pt")
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(torchops.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        subprocess.run([sys.executable, "-c", code.replace("PATH", repr(path))], env=env,
                       check=True,
                       timeout=300)
        results.append(torch.load(path))
        os.remove(path)
    scalar, vector = results
    for key, (y, g) in scalar.items():
        tol = {"atol": 1e-5, "rtol": 1e-5} if key[1] in ("torch.float32", "torch.float64") \
            else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(y, vector[key][0], **tol, msg=str(key))
        torch.testing.assert_close(g, vector[key][1], **tol, msg=str(key))


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_functional(device):
    """The public wrappers against F.silu / F.gelu written out, as a user
    would (the references are the same formula; this pins them to torch)."""
    x = make((4, 6, 2 * 50), device, torch.float64)
    a, b = x.chunk(2, dim=-1)
    torch.testing.assert_close(torchops.silu_and_mul(x), F.silu(a) * b)
    torch.testing.assert_close(torchops.gelu_and_mul(x), F.gelu(a) * b)
    torch.testing.assert_close(torchops.gelu_and_mul(x, approximate="tanh"),
                               F.gelu(a, approximate="tanh") * b)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_are_not_copied(device):
    """A slice along the last dimension is read in place: the op gives the
    same result as on a contiguous copy, and the output is contiguous."""
    base = make((16, 3 * 64), device, torch.float32)
    x = base[:, 32:32 + 2 * 48]
    out = torchops.silu_and_mul(x)
    assert out.is_contiguous() and out.shape == (16, 48)
    torch.testing.assert_close(out, torchops.silu_and_mul(x.contiguous()), rtol=0, atol=0)
    dx = torch.ops.torchops._silu_and_mul_backward.default(torch.ones_like(out), x)
    torch.testing.assert_close(
        dx, torch.ops.torchops._silu_and_mul_backward.default(torch.ones_like(out),
                                                              x.contiguous()), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cuda_packed_and_unpacked_paths(dtype):
    """The CUDA kernels' 16-byte packed path and the element path (odd d,
    a base pointer mid-pack, a row stride off the pack size) agree with the
    float64 reference, forward and backward."""
    cases = {
        "packed": make((33, 2 * 64), "cuda", dtype),
        "odd_d": make((33, 2 * 61), "cuda", dtype),
        "d_not_pack_multiple": make((33, 2 * 12), "cuda", dtype),
        "offset_base": make((33, 2 * 64 + 1), "cuda", dtype)[:, 1:],
        "odd_row_stride": make((33, 2 * 64 + 2), "cuda", dtype)[:, :128],
        "one_row_offset": make((1, 2 * 64 + 3), "cuda", dtype)[:, 3:],
        # Rows split into several column tiles, the last one partly filled.
        "column_tiles": make((5, 2 * 8800), "cuda", dtype),
        "column_tiles_odd_d": make((5, 2 * 4097), "cuda", dtype),
    }
    tol = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3),
           torch.float32: (1e-5, 1.3e-5), torch.float64: (1e-9, 1e-7)}[dtype]
    for name, x in cases.items():
        for act, (op, ref) in OPS.items():
            xg = x.detach().requires_grad_()
            out = op(xg)
            x64 = x.detach().double().requires_grad_()
            expect = ref(x64)
            g = torch.randn_like(expect)
            (dx,) = torch.autograd.grad(out, xg, g.to(dtype))
            (dx_ref,) = torch.autograd.grad(expect, x64, g)
            torch.testing.assert_close(out.double(), expect.detach(), atol=tol[0], rtol=tol[1],
                                       msg=f"{name} {act}")
            torch.testing.assert_close(dx.double(), dx_ref, atol=tol[0] * 4, rtol=tol[1] * 2,
                                       msg=f"{name} {act} backward")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [8 * 520, 1033], ids=["packed", "odd_d"])
def test_cuda_rows_beyond_the_grid(d):
    """More rows than the CUDA kernels' grid covers (it is bounded by a few
    waves of the SMs: with one row per block here, about 60 blocks per SM,
    so 12000 rows loop on any GPU of under 200 SMs): every row is computed,
    forward and backward, packed and element path."""
    x = make((12000, 2 * d), "cuda", torch.bfloat16)
    for act, (op, ref) in OPS.items():
        xg = x.detach().requires_grad_()
        out = op(xg)
        x64 = x.detach().double().requires_grad_()
        expect = ref(x64)
        g = torch.randn_like(expect)
        (dx,) = torch.autograd.grad(out, xg, g.to(torch.bfloat16))
        (dx_ref,) = torch.autograd.grad(expect, x64, g)
        torch.testing.assert_close(out.double(), expect.detach(), atol=2e-2, rtol=2e-2,
                                   msg=act)
        torch.testing.assert_close(dx.double(), dx_ref, atol=8e-2, rtol=4e-2,
                                   msg=f"{act} backward")
