"""matmul-specific tests (the generic ones come from its opdb entry).  CPU:
both vector widths of the packed GEMM on shapes that end mid-tile in every
dimension, also with tiny cache blocks, and of the streaming kernel (M <= 8).
CUDA: every path forced in turn, against float64, NaN/Inf, the float32
precision rule, CUDA graphs, and small shapes for compute-sanitizer."""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import torchops
from torchops import references

# Runs in a subprocess: the kernel reads TORCHOPS_TESTING_MATMUL_NARROW, and a
# fresh process makes sure the forced path is the one that ran.
_CHECK = r"""
import torch, torchops
from torchops import references
torch.manual_seed(0)
shapes = [(None, 1, 1, 1), (None, 7, 1, 5), (None, 1, 300, 1), (None, 97, 300, 33),
          (None, 6, 256, 32), (None, 5, 257, 31), (None, 13, 700, 17), (3, 19, 23, 29),
          # M <= 8 streams B (no packing), up to eight rows a pass, and so
          # do 13-16 rows in two passes (9-12 are packed): column slices,
          # vector tails, K % 4
          (None, 1, 701, 4101), (3, 1, 333, 37), (2, 1, 4, 70), (2, 3, 41, 70),
          (None, 8, 129, 2051), (None, 9, 130, 45), (None, 16, 515, 2051),
          (2, 14, 67, 70),
          # A read in place; rows 4 KB apart (K = 1024 floats, 512 doubles)
          # too where C has at most 512 columns, else packed; last row panels
          # of 2, 4 and 8 rows
          (None, 20, 1024, 40), (2, 10, 512, 33), (None, 22, 1024, 35), (None, 26, 1024, 520)]
def operand(pre, rows, cols, dt, layout):
    # Row-major, column-major (a transposed view, read in place), an expanded
    # batch (stride 0), or every other column (copied).
    if layout == "col":
        return torch.randn(*pre, cols, rows, dtype=torch.float64).to(dt).transpose(-1, -2)
    if layout == "expand" and pre:
        return torch.randn(1, rows, cols, dtype=torch.float64).to(dt).expand(*pre, rows, cols)
    if layout == "strided":
        return torch.randn(*pre, rows, 2 * cols, dtype=torch.float64).to(dt)[..., ::2]
    return torch.randn(*pre, rows, cols, dtype=torch.float64).to(dt)

layouts = [("row", "col"), ("col", "row"), ("row", "row"), ("col", "col"),
           ("expand", "strided"), ("strided", "expand")]
for threads in (1, 2):
    torch.set_num_threads(threads)
    for batch, m, k, n in shapes:
        pre = () if batch is None else (batch,)
        for dt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12),
                        (torch.bfloat16, 1e-2), (torch.float16, 1e-3)):
            for la, lb in layouts:
                a = operand(pre, m, k, dt, la)
                b = operand(pre, k, n, dt, lb)
                got = torchops.matmul(a, b).double()
                want = references.matmul(a.double(), b.double())
                err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-9)).item()
                assert err < tol, (threads, batch, m, k, n, dt, la, lb, err)
print("CHECKED")
"""


@pytest.mark.parametrize("narrow", ["0", "1"])
def test_cpu_gemm_paths_match_reference(narrow):
    """narrow=1 forces the 32-byte (AVX2/SSE) kernels even on an AVX-512 CPU;
    narrow=0 takes the widest the CPU has."""
    env = dict(os.environ, TORCHOPS_TESTING_MATMUL_NARROW=narrow)
    proc = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stdout + proc.stderr


# Tiny caches through TORCHOPS_TESTING_CPU_CACHES (read once per process, hence
# the subprocess) give blocks of 64 to 120 elements: K = 1029 takes 17 depth
# blocks, N = 75 and 203 several column blocks, M = 301 several row blocks, all
# ending mid-tile.  13 rows against a column-major B (W^T, the dot-product
# kernel) take its passes over column blocks of 12 (float) or 6 (double)
# columns, the last one partial.
_TINY_CACHES = r"""
import itertools, math, os, torch, torchops
torch.manual_seed(0)
for threads, shared in itertools.product((1, 2), ("0", "1")):
    torch.set_num_threads(threads)
    os.environ["TORCHOPS_TESTING_MATMUL_SHARED"] = shared
    for *pre, m, k, n, wt in ((37, 1029, 75, 0), (301, 300, 203, 0), (3, 50, 70, 33, 0),
                              (13, 300, 75, 1), (2, 13, 300, 75, 1)):
        for dt, eps in ((torch.float32, 2.0**-24), (torch.float64, 2.0**-53)):
            a = torch.randn(*pre, m, k, dtype=dt)
            b = (torch.randn(*pre, n, k, dtype=dt).transpose(-1, -2) if wt
                 else torch.randn(*pre, k, n, dtype=dt))
            got = torchops.matmul(a, b).double()
            want = torch.matmul(a.double(), b.double())
            bound = torch.matmul(a.double().abs(), b.double().abs())
            tol = 2 * eps * (want.abs() + 4 * math.sqrt(k) * bound)
            excess = ((got - want).abs() - tol).max().item()
            assert excess <= 0, (threads, shared, pre, m, k, n, dt, excess)
print("CHECKED")
"""


@pytest.mark.parametrize("narrow", ["0", "1"])
def test_cpu_gemm_tiny_cache_blocks_match_float64(narrow):
    env = dict(os.environ, TORCHOPS_TESTING_MATMUL_NARROW=narrow,
               TORCHOPS_TESTING_CPU_CACHES="4096,32768,65536")
    proc = subprocess.run([sys.executable, "-c", _TINY_CACHES], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stdout + proc.stderr
    # The kernel does read the variable: a malformed value is refused.
    env["TORCHOPS_TESTING_CPU_CACHES"] = "4096,32768"
    proc = subprocess.run([sys.executable, "-c", _TINY_CACHES], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "TORCHOPS_TESTING_CPU_CACHES" in proc.stderr, proc.stderr


@pytest.fixture
def restore_threads():
    """torch's thread count before the test (put back after it)."""
    prev = torch.get_num_threads()
    yield prev
    torch.set_num_threads(prev)


def _assert_near_float64(got, a, b, eps, ctx):
    """got within float64 A @ B's rounding bound: output rounding plus sqrt(K)
    growth of each product's magnitude."""
    want = references.matmul(a.double(), b.double())
    bound = references.matmul(a.double().abs(), b.double().abs())
    tol = 2 * eps * (want.abs() + 4 * math.sqrt(a.shape[-1]) * bound)
    excess = ((got.double() - want).abs() - tol).max().item()
    assert excess <= 0, (*ctx, excess)


# A row-major B read in place by the micro-kernel (parts of up to 24 rows,
# read_b_direct) against the packed copy of B, bit for bit (the same sums in
# the same order), and against float64: whole and partial column panels, a
# last panel narrower than a vector, several depth blocks (K > 512), rows
# 13-16 as two blocks of 8, a B whose rows are longer than N (a column
# slice), and TORCHOPS_TESTING_MATMUL_DIRECT_B=1 past 24 rows.
@pytest.mark.parametrize("narrow", ["0", "1"])
def test_cpu_gemm_direct_b_matches_packed(narrow, monkeypatch, restore_threads):
    monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_NARROW", narrow)
    gen = torch.Generator().manual_seed(0)
    shapes = ((9, 1029, 100, False), (16, 600, 64, True), (13, 70, 31, False), (24, 1030, 97, True),
              (48, 200, 65, False), (12, 513, 7, False), (100, 300, 70, False))
    for threads, (m, k, n, sliced) in itertools.product((1, 2), shapes):
        torch.set_num_threads(threads)
        for dt, eps in ((torch.float32, 2.0**-24), (torch.float64, 2.0**-53)):
            a = torch.randn(m, k, dtype=dt, generator=gen)
            b = torch.randn(k, n + 5 if sliced else n, dtype=dt, generator=gen)[:, :n]
            monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_DIRECT_B", "1")
            got = torchops.matmul(a, b)
            monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_DIRECT_B", "0")
            packed = torchops.matmul(a, b)
            monkeypatch.delenv("TORCHOPS_TESTING_MATMUL_DIRECT_B")
            auto = torchops.matmul(a, b)
            assert torch.equal(got, packed) and torch.equal(got, auto), (threads, m, k, n, dt)
            _assert_near_float64(got, a, b, eps, (threads, m, k, n, dt))


# The shared schedule (one matrix, every block packed once for all threads,
# C tiles claimed from counters) against float64 and against the per-thread
# grid, bit for bit: both sum each element over k in order, in the same depth
# blocks.  Shapes: depth blocks of three generations, super blocks (2048
# rows or columns) ending mid-tile, three super blocks of two depth blocks
# each (the third reuses the first one's per-tile slots), fewer units than
# threads, M = 9; A and B each row-major or transposed (read in place), by
# turns.  Threads 1 and 3 too (the workers must not
# need each other to run at the same time), and all of the machine's.
@pytest.mark.parametrize("narrow", ["0", "1"])
def test_cpu_gemm_shared_schedule(narrow, monkeypatch, restore_threads):
    monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_NARROW", narrow)
    gen = torch.Generator().manual_seed(0)
    for threads in sorted({1, 2, 3, restore_threads}):
        torch.set_num_threads(threads)
        for i, (m, k, n) in enumerate(((301, 1500, 257), (2100, 40, 70), (50, 30, 2100),
                                       (9, 700, 33), (130, 64, 2049), (4200, 600, 50))):
            for dt, eps in ((torch.float32, 2.0**-24), (torch.float64, 2.0**-53)):
                a = (torch.randn(k, m, dtype=dt, generator=gen).t() if i % 2 else
                     torch.randn(m, k, dtype=dt, generator=gen))
                b = (torch.randn(k, n, dtype=dt, generator=gen) if i % 3 == 2 else
                     torch.randn(n, k, dtype=dt, generator=gen).t())
                monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_SHARED", "1")
                got = torchops.matmul(a, b)
                monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_SHARED", "0")
                grid = torchops.matmul(a, b)
                assert torch.equal(got, grid), (threads, m, k, n, dt)
                _assert_near_float64(got, a, b, eps, (threads, m, k, n, dt))


# --- CUDA: every path, forced through TORCHOPS_TESTING_MATMUL_PATH -------------------------
# The kernel reads the switch at each call, so monkeypatch.setenv is enough.
# A forced path that cannot take a call (say decode for M > 16, or sm90 on
# an Ampere GPU) leaves it to the normal choice: every case must still pass.

cuda = pytest.mark.cuda
PATHS = ["auto", "decode", "sm90", "sm80", "simt"]
HALF = [torch.bfloat16, torch.float16]

# (batch or None, m, k, n): tails in every dimension, primes, K = 1, M or
# N = 1, decode shapes, batched small matrices.
SHAPES = [
    (None, 1, 1, 1), (None, 1, 4096, 4096), (None, 16, 2048, 1024), (None, 7, 4099, 257),
    (None, 97, 1, 211), (None, 127, 65, 129), (None, 509, 523, 521), (None, 1, 77, 1),
    (None, 300, 257, 1), (None, 1000, 768, 3000), (None, 257, 512, 384), (4, 100, 40, 72),
    (64, 64, 64, 64), (3, 129, 200, 255), (2, 16, 1024, 512),
]


def _operands(batch, m, k, n, dtype, layout, gen):
    def mk(shape, transposed):
        if transposed:
            t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen, device="cuda")
            return t.to(dtype).transpose(-2, -1)
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    pre = () if batch is None else (batch,)
    a = mk((*pre, m, k), layout in ("tn", "tt"))
    if layout == "expanded" and batch is not None:
        b = mk((k, n), False).expand(batch, k, n)
    elif layout == "sliced":
        a = mk((*pre, m, 2 * k + 1), False)[..., 1::2][..., :k]
        b = mk((*pre, k, n), False)
    else:
        b = mk((*pre, k, n), layout in ("nt", "tt"))
    return a, b


def _assert_close_to_float64(got, a, b, eps):
    """|got - ref| <= eps * (|ref| + 4 sqrt(K) (|A| @ |B|)): output rounding
    plus accumulation error that grows with sqrt(K), elementwise."""
    assert got.dtype == a.dtype and got.device == a.device and got.is_contiguous()
    ref = torch.matmul(a.double(), b.double())
    assert got.shape == ref.shape
    bound = torch.matmul(a.double().abs(), b.double().abs())
    k = a.shape[-1]
    tol = eps * (ref.abs() + 4 * math.sqrt(k) * bound) + 1e-30
    excess = ((got.double() - ref).abs() - tol).max().item() if ref.numel() else -1
    assert excess <= 0, f"error exceeds tolerance by {excess:.3g}"


EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24,
       torch.float64: 2.0**-53}


# "tf32": float32 with TF32 allowed (precision "high"), a 10-bit mantissa.
TF32 = "tf32"
EPS[TF32] = 2.0**-11


@pytest.fixture
def matmul_dtype(request):
    """The dtype a test runs; "tf32" is float32 under precision "high"
    (restored afterwards)."""
    old = torch.get_float32_matmul_precision()
    if request.param == TF32:
        torch.set_float32_matmul_precision("high")
    yield torch.float32 if request.param == TF32 else request.param, EPS[request.param]
    torch.set_float32_matmul_precision(old)


@cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("matmul_dtype", [*HALF, torch.float32, TF32, torch.float64], ids=str,
                         indirect=True)
def test_cuda_paths_match_float64(path, matmul_dtype, monkeypatch):
    """With TF32, row-major operands take sm90's swapped problem (C^T =
    B^T A^T) and column-major A its A-from-registers wgmma: both layouts
    are in the list."""
    dtype, eps = matmul_dtype
    monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_PATH", path)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, m, k, n in SHAPES:
        for layout in ("nn", "tn", "nt", "tt", "expanded", "sliced"):
            if layout == "expanded" and batch is None:
                continue
            a, b = _operands(batch, m, k, n, dtype, layout, gen)
            got = torch.ops.torchops.matmul(a, b)
            try:
                _assert_close_to_float64(got, a, b, eps * 2)
            except AssertionError as e:
                raise AssertionError(f"{path} {dtype} {layout} {batch} {m}x{k}x{n}: {e}") from None
            # Deterministic: the same call again (through the public
            # function this time) gives the same bits.
            assert torch.equal(got, torchops.matmul(a, b)), (path, m, k, n, layout)


@cuda
@pytest.mark.parametrize("path", PATHS)
def test_cuda_nan_inf_propagate_like_torch(path, monkeypatch):
    monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_PATH", path)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (*HALF, torch.float32):
        for m, k, n in ((16, 256, 64), (200, 96, 136)):
            a = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            b = torch.randn(k, n, generator=gen, device="cuda").to(dtype)
            a[1, 3] = float("nan")
            a[5, 7] = float("inf")
            b[9, 2] = float("-inf")
            got, want = torch.ops.torchops.matmul(a, b), torch.matmul(a, b)
            assert torch.equal(got.isnan(), want.isnan()), (path, dtype, m)
            assert torch.equal(got.isposinf(), want.isposinf()), (path, dtype, m)
            assert torch.equal(got.isneginf(), want.isneginf()), (path, dtype, m)


@cuda
def test_cuda_float32_follows_the_precision_setting():
    """"highest" (the default) is exact fp32 whatever the shape; "high" may
    use TF32 (10-bit mantissa); the setting is read at call time, also inside
    a compiled function."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(512, 1024, generator=gen, device="cuda")
    b = torch.randn(1024, 384, generator=gen, device="cuda")
    compiled = torch.compile(torch.ops.torchops.matmul, fullgraph=True)
    old = torch.get_float32_matmul_precision()
    try:
        for fn in (torch.ops.torchops.matmul, compiled):
            torch.set_float32_matmul_precision("highest")
            _assert_close_to_float64(fn(a, b), a, b, EPS[torch.float32] * 2)
            torch.set_float32_matmul_precision("high")
            _assert_close_to_float64(fn(a, b), a, b, 2.0**-11 * 2)
            torch.set_float32_matmul_precision("highest")
            _assert_close_to_float64(fn(a, b), a, b, EPS[torch.float32] * 2)
    finally:
        torch.set_float32_matmul_precision(old)


@cuda
@pytest.mark.parametrize("m,k,n", [(8, 4096, 1024), (16, 4096, 4096), (700, 512, 900),
                                   (256, 8192, 256)])
def test_cuda_matmul_in_a_cuda_graph(m, k, n):
    """Decode (split-K through a workspace, or on Hopper, two splits summed
    inside a 2-CTA cluster) and the tensor-core path (256 x 8192 x 256:
    split-K with a workspace and a summing kernel) replay in a graph with no
    host sync and the graph's own allocations."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, generator=gen, device="cuda", dtype=torch.bfloat16)
    want = torch.ops.torchops.matmul(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.torchops.matmul(a, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.torchops.matmul(a, b)
    a.copy_(torch.randn(m, k, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, want)
    assert torch.equal(out, torch.ops.torchops.matmul(a, b))


# Exact float32 problems that take the simt path's big tile, row-major with
# K % 4 == 0: on Hopper, simt90.cuh's TMA-fed kernel.  Tails in M, in N (a
# multiple of 4: TMA wants 16-byte row strides) and in K (a part stage); a
# K shorter than one stage.
BIG_TILE_F32_SHAPES = [(2047, 2052, 2044), (1290, 132, 1300), (1290, 36, 1300)]


@cuda
@pytest.mark.parametrize("m,k,n", BIG_TILE_F32_SHAPES)
def test_cuda_exact_float32_big_tiles(m, k, n):
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(m, k, generator=gen, device="cuda")
    b = torch.randn(k, n, generator=gen, device="cuda")
    if torch.cuda.get_device_capability() == (9, 0):
        # The kernel that ran is the TMA one (a fallback would give the
        # same bits: both sum k in order with fmaf).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = torch.ops.torchops.matmul(a, b)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        assert any("simt90_kernel" in name for name in names), sorted(set(names))
    else:
        got = torch.ops.torchops.matmul(a, b)
    _assert_close_to_float64(got, a, b, EPS[torch.float32] * 2)
    assert torch.equal(got, torchops.matmul(a, b))
    a[1, 3] = float("nan")
    a[5, 7] = float("inf")
    b[9, 2] = float("-inf")
    got, want = torch.ops.torchops.matmul(a, b), torch.matmul(a, b)
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(got), pred(want)), pred


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,m,k,n", [(None, 64, 8192, 64), (3, 50, 3001, 60),
                                         (None, 20, 70001, 3), (None, 512, 512, 512)])
def test_cuda_simt_split_k(batch, m, k, n, dtype):
    """Few output tiles and a long K: the CUDA-core path splits K and sums
    the splits' partials in split order (a second kernel), so the result is
    within the float64 bound and the same bits from call to call; NaN and
    Inf still propagate."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    shape_a, shape_b = ((batch, m, k), (batch, k, n)) if batch else ((m, k), (k, n))
    a = torch.randn(shape_a, generator=gen, device="cuda", dtype=dtype)
    b = torch.randn(shape_b, generator=gen, device="cuda", dtype=dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = torchops.matmul(a, b)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("simt_kernel" in name for name in names), sorted(set(names))
    if torch.cuda.get_device_properties(0).multi_processor_count >= 64:
        # These shapes' blocks fill at most half of such a GPU: split.
        assert any("sum_splits" in name for name in names), sorted(set(names))
    _assert_close_to_float64(got, a, b, EPS[dtype] * 2)
    assert torch.equal(got, torch.ops.torchops.matmul(a, b))
    a[..., 1, 3] = float("nan")
    b[..., k - 1, 0] = float("inf")
    got, want = torch.ops.torchops.matmul(a, b), torch.matmul(a, b)
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(got), pred(want)), pred


@cuda
@pytest.mark.parametrize("m,k,n", [(1290, 164, 1300), (1290, 4, 1300)])
def test_cuda_big_tile_f32_sanitizer_shapes(m, k, n):
    """For compute-sanitizer (the name has "sanitizer_shapes"): the TMA
    kernel's stage ring wrapping (six k tiles, four stages) and a single
    part stage, once each (float32, row-major)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    a = torch.randn(m, k, generator=gen, device="cuda")
    b = torch.randn(k, n, generator=gen, device="cuda")
    _assert_close_to_float64(torch.ops.torchops.matmul(a, b), a, b, EPS[torch.float32] * 2)


# Shapes for each tile of the sm90 path, (batch, m, k, n) -> (tile rows, tile
# columns) that `choose` picks on a GPU of 132 SMs (the Hopper SXM parts): the
# small shapes elsewhere in this file mostly take 64x64 tiles (64x32 where
# B is K-major).  32 x 4096 x 4096 (long K, A filling half of a 64-row tile)
# takes 64x128 split K-wise.  None: no sm90 kernel (batches of at most 64 x
# 64 outputs run on sm80, matmul.cu).
SM90_TILE_SHAPES = {(None, 2048, 256, 2048): (128, 256), (None, 1000, 768, 3000): (128, 192),
                    (None, 1024, 256, 1536): (128, 128), (None, 1024, 256, 1024): (64, 128),
                    (None, 128, 512, 4096): (64, 64), (None, 512, 256, 512): (64, 64),
                    (16, 64, 256, 1024): (64, 128), (8, 48, 512, 256): (64, 64),
                    (None, 32, 1024, 1024): (64, 64), (None, 32, 4096, 4096): (64, 128),
                    (16, 64, 256, 64): None}
# Where B is K-major ("nt") and 64x32 tiles win (they need a K-major B).
SM90_TILE_SHAPES_NT = {(None, 512, 256, 512): (64, 32), (8, 48, 512, 256): (64, 32),
                       (None, 32, 1024, 1024): (64, 32)}


@cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("layout", ["nn", "tn", "nt"])
@pytest.mark.parametrize("shape", list(SM90_TILE_SHAPES),
                         ids=lambda s: "x".join(str(d) for d in s if d is not None))
def test_cuda_sm90_each_tile(shape, layout, dtype):
    batch, m, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    a, b = _operands(batch, m, k, n, dtype, layout, gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = torch.ops.torchops.matmul(a, b)
        torch.cuda.synchronize()
    _assert_close_to_float64(got, a, b, EPS[dtype] * 2)
    props = torch.cuda.get_device_properties(a.device)
    if (props.major, props.minor) == (9, 0) and props.multi_processor_count == 132:
        # gemm_kernel<Tag, BN, transA, transB, tma_store, split3, TM>, the
        # name demangled or not
        pattern = (r"sm90_detail::gemm_kernel<[^,]+, (\d+), \d, \d, \w+, \w+, (\d+)>"
                   r"|gemm_kernelI\w+?TagELi(\d+)ELi\dELi\dELb\dELb\dELi(\d+)E")
        tiles = {(int(g[1] or g[3]), int(g[0] or g[2])) for e in prof.events()
                 for g in re.findall(pattern, e.name)}
        want = SM90_TILE_SHAPES_NT.get(shape, SM90_TILE_SHAPES[shape]) if layout == "nt" \
            else SM90_TILE_SHAPES[shape]
        assert tiles == ({want} if want else set()), (tiles, sorted({e.name for e in prof.events()}))


# Small shapes for compute-sanitizer (memcheck and racecheck in the GPU
# check): every path, tails in every dimension, each layout, batched; 3 x
# 1024 x 4096 splits K in two, which decode sums inside a cluster on Hopper
# (5 x 4096 x 1026 too where B is K-major: 65 slices of 16 columns, the last
# 2 wide, take the cluster's per-element sum instead of the 4-column one).
# On sm90 the small ones take 64x64 tiles (64x32 where B is K-major), 256 x
# 72 x 2560 64x128, 32 x 2048 x 1024 64x128 split K-wise in four.
SANITIZER_SHAPES = [(None, 1, 1, 1), (None, 5, 33, 17), (None, 16, 264, 136), (2, 130, 72, 264),
                    (None, 129, 257, 129), (3, 64, 64, 64), (None, 3, 1024, 4096),
                    (None, 256, 72, 2560), (None, 32, 2048, 1024), (None, 5, 4096, 1026)]


@cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("matmul_dtype", [torch.bfloat16, torch.float32, TF32], ids=str,
                         indirect=True)
def test_cuda_paths_sanitizer_shapes(path, matmul_dtype, monkeypatch):
    dtype, eps = matmul_dtype
    monkeypatch.setenv("TORCHOPS_TESTING_MATMUL_PATH", path)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for batch, m, k, n in SANITIZER_SHAPES:
        for layout in ("nn", "tn", "nt", "tt"):
            a, b = _operands(batch, m, k, n, dtype, layout, gen)
            _assert_close_to_float64(torch.ops.torchops.matmul(a, b), a, b, eps * 2)


# --- the public wrapper: torch.matmul's shape rules -------------------------------

_ND_SHAPES = [
    ((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,)),               # vectors
    ((2, 4, 5), (5, 3)), ((4, 5), (2, 5, 3)),                   # a linear layer; expanded a
    ((2, 3, 4, 5), (2, 3, 5, 6)), ((2, 1, 4, 5), (3, 5, 6)),    # attention-style; broadcast
    ((1, 4, 5), (2, 5, 3)), ((5,), (2, 3, 5, 4)), ((2, 3, 4, 5), (5,)),
    ((0, 4, 5), (5, 3)), ((2, 0, 4, 5), (5, 3)), ((2, 2, 4, 0), (2, 2, 0, 3)),  # empty
]


# The cuda marker too, so that the GPU check (-m cuda) runs these on the GPU.
_DEVICES = ["cpu", pytest.param("cuda", marks=(cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU")))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", _ND_SHAPES, ids=lambda s: f"{s[0]}@{s[1]}")
def test_wrapper_follows_torch_matmul_shape_rules(shapes, dtype, device):
    """torchops.matmul takes what torch.matmul takes: values and gradients
    to both inputs against the float64 reference, torch.matmul's output
    shape; a transposed (non-contiguous) a as well."""
    torch.manual_seed(0)
    for transposed in (False, True):
        if transposed and len(shapes[0]) < 2:
            continue
        sa, sb = shapes
        if transposed:
            a = torch.randn(*sa[:-2], sa[-1], sa[-2], dtype=dtype,
                            device=device).transpose(-1, -2)
        else:
            a = torch.randn(sa, dtype=dtype, device=device)
        b = torch.randn(sb, dtype=dtype, device=device)
        a.requires_grad_(True)
        b.requires_grad_(True)
        got = torchops.matmul(a, b)
        assert got.shape == torch.matmul(a.detach(), b.detach()).shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        grad = torch.randn_like(got)
        ga, gb = torch.autograd.grad(got, (a, b), grad)
        a64 = a.detach().double().requires_grad_(True)
        b64 = b.detach().double().requires_grad_(True)
        want = references.matmul(a64, b64)
        torch.testing.assert_close(got.detach().double(), want.detach(), rtol=tol, atol=tol)
        ra, rb = torch.autograd.grad(want, (a64, b64), grad.double())
        torch.testing.assert_close(ga.double(), ra, rtol=tol, atol=tol)
        torch.testing.assert_close(gb.double(), rb, rtol=tol, atol=tol)


def test_wrapper_shape_errors_name_the_op():
    cases = [((), (3,)), ((2, 3, 4), (3, 4, 5)), ((3, 4), (5, 6)), ((2, 3, 4), (5, 6)),
             ((4,), (5,))]
    for sa, sb in cases:
        with pytest.raises(RuntimeError, match="torchops.matmul"):
            torchops.matmul(torch.randn(sa), torch.randn(sb))


def test_wrapper_nd_compiles_and_exports():
    """The folding and broadcasting under torch.compile(fullgraph=True,
    dynamic=True), at two sizes of each case, and in torch.export."""
    fn = torch.compile(torchops.matmul, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    cases = [lambda g: ((2 * g, 4, 5), (5, 3)),        # batch of rows @ matrix
             lambda g: ((5 + g,), (5 + g, 3 * g)),      # vector @ matrix
             lambda g: ((2, 1, 4, 5 * g), (3, 5 * g, 6))]  # broadcast batch
    for case in cases:
        for g in (1, 3):
            sa, sb = case(g)
            a, b = torch.randn(sa), torch.randn(sb)
            torch.testing.assert_close(fn(a, b), torchops.matmul(a, b))

    class Linear(torch.nn.Module):
        def forward(self, x, w):
            return torchops.matmul(x, w)

    x, w = torch.randn(2, 4, 5), torch.randn(5, 3)
    ep = torch.export.export(Linear(), (x, w))
    torch.testing.assert_close(ep.module()(x, w), torchops.matmul(x, w))


# --- autocast: torch.matmul's policy ----------------------------------------------------

_HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", _HALF, ids=str)
def test_autocast_casts_like_torch_matmul(device, dtype):
    """Under torch.autocast, float32 inputs (and mixed half x float32 ones,
    which the op alone rejects) are cast to the region's dtype, as
    torch.matmul does: same output dtype as torch.matmul, the same bits as
    torchops.matmul on the cast inputs outside the region, within the
    dtype's tolerance of float64.  float64 inputs are left alone."""
    torch.manual_seed(0)
    a = torch.randn(2, 33, 70, device=device)
    b = torch.randn(70, 19, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        got = torchops.matmul(a, b)
        mixed = torchops.matmul(a.to(dtype), b)
        peer = torch.matmul(a, b)
        a64, b64 = a.double(), b.double()
        f64 = torchops.matmul(a64, b64)
    assert got.dtype == mixed.dtype == peer.dtype == dtype
    cast = torchops.matmul(a.to(dtype), b.to(dtype))
    assert torch.equal(got, cast) and torch.equal(mixed, cast)
    want = references.matmul(a.to(dtype).double(), b.to(dtype).double())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * math.sqrt(70))
    assert f64.dtype == torch.float64 and torch.equal(f64, torchops.matmul(a64, b64))


@pytest.mark.parametrize("device", _DEVICES)
def test_autocast_gradients_reach_float32_leaves(device):
    """A float32 weight used under autocast gets a float32 gradient (through
    the casts' backward), close to the float64 one; the forward compiles
    with the autocast region inside the graph (fullgraph=True, dynamic=True)."""
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    w = torch.randn(64, 24, device=device, requires_grad=True)
    g = torch.randn(16, 24, device=device)

    def step(x, w):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return torchops.matmul(x, w)

    y = step(x, w)
    assert y.dtype == torch.bfloat16
    gx, gw = torch.autograd.grad(y, (x, w), g.bfloat16())
    assert gx.dtype == gw.dtype == torch.float32
    xb, wb = x.detach().bfloat16().double(), w.detach().bfloat16().double()
    gd = g.bfloat16().double()
    torch.testing.assert_close(gx.double(), gd @ wb.t(), rtol=3e-2, atol=0.3)
    torch.testing.assert_close(gw.double(), xb.t() @ gd, rtol=3e-2, atol=0.3)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    yc = compiled(x.detach(), w.detach())
    assert yc.dtype == torch.bfloat16
    torch.testing.assert_close(yc.float(), y.detach().float(), rtol=1e-2, atol=1e-2)
