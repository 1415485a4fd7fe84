"""Check and time the CUDA matmul paths one by one (see README.md here)."""

import argparse
import ctypes
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# name -> (header, dtypes it serves, shapes it is meant for: "any" or "decode")
PATHS = {
    "sm90": ("cuda/matmul/sm90.cuh", ("bf16", "f16", "f32tf32"), "any"),
    "sm80": ("cuda/matmul/sm80.cuh", ("bf16", "f16", "f32tf32"), "any"),
    "simt": ("cuda/matmul/simt.cuh", ("f32", "f64", "bf16", "f16"), "any"),
    "decode": ("cuda/matmul/decode.cuh", ("bf16", "f16", "f32"), "decode"),
    # not a torchops.matmul choice: the opt-in 3xTF32 float32 (deform_conv2d)
    "sm90_3xtf32": ("cuda/matmul/sm90.cuh", ("f32x3",), "any"),
}
DTYPES = {"f16": (torch.float16, 0), "bf16": (torch.bfloat16, 1), "f32": (torch.float32, 2),
          "f32tf32": (torch.float32, 2), "f32x3": (torch.float32, 2), "f64": (torch.float64, 3)}


class Operand(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("row_stride", ctypes.c_int64), ("col_stride", ctypes.c_int64)]


class GemmArgs(ctypes.Structure):
    _fields_ = [("a", Operand), ("b", Operand), ("c", ctypes.c_void_p),
                ("batch", ctypes.c_int64), ("m", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("dtype", ctypes.c_int), ("allow_tf32", ctypes.c_bool)]


def load(so):
    lib = ctypes.CDLL(str(so))
    lib.dev_run.argtypes = [ctypes.POINTER(GemmArgs), ctypes.c_void_p, ctypes.c_void_p]
    lib.dev_supports.argtypes = [ctypes.POINTER(GemmArgs)]
    lib.dev_workspace_bytes.argtypes = [ctypes.POINTER(GemmArgs)]
    lib.dev_workspace_bytes.restype = ctypes.c_longlong
    return lib


def build(names, outdir, arch, ptxas_v=False, prebuilt=None):
    if prebuilt:  # built earlier (say on a machine without the GPU): <name>.so in that folder
        return {name: load(Path(prebuilt) / f"{name}.so") for name in names}
    nvcc = os.environ.get("NVCC", "nvcc")

    def one(name):
        so = Path(outdir) / f"{name}.so"
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
               f"-gencode=arch={arch.replace('sm', 'compute')},code={arch}",
               # as torch's extension builds do: no implicit half conversions
               "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
               "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
               f"-I{ROOT / 'csrc'}", f"-DPATH_HEADER=\"{PATHS[name][0]}\"", f"-DPATH_NAME={name}",
               str(Path(__file__).with_name("capi.cu")), "-o", str(so)]
        if ptxas_v:
            cmd.insert(1, "-Xptxas=-v")
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        return name, so, r, time.time() - t0

    libs = {}
    with ThreadPoolExecutor(len(names)) as pool:
        for name, so, r, secs in pool.map(one, names):
            print(f"build {name}: {'ok' if r.returncode == 0 else 'FAILED'} in {secs:.0f} s", flush=True)
            if r.returncode:
                print(r.stderr[-4000:])
                continue
            if ptxas_v:
                print_ptxas(name, r.stderr)
            libs[name] = load(so)
    return libs


def print_ptxas(name, log):
    """One line a kernel: registers and spill bytes, from nvcc -Xptxas=-v."""
    kern, spills = None, ""
    for line in log.splitlines():
        if "Compiling entry function" in line:
            kern = line.split("'")[1]
        elif kern and "registers" in line:
            regs = line.split("Used ")[1].split(" registers")[0]
            print(f"  {name} regs {regs:>3s} {spills}  {kern}")
            kern = None
        elif kern and "spill" in line:
            spills = line.strip()


def args_of(a, b, c, dcode, tf32):
    batched = a.dim() == 3
    def op(t):
        return Operand(t.data_ptr(), t.stride(0) if batched else 0, t.stride(-2), t.stride(-1))
    return GemmArgs(op(a), op(b), c.data_ptr(), a.shape[0] if batched else 1,
                    a.shape[-2], b.shape[-1], a.shape[-1], dcode, tf32)


class Runner:
    """Calls one path like the extension would: output contiguous, workspace from torch."""

    def __init__(self, lib, dkey):
        self.lib, self.dkey = lib, dkey

    def prepare(self, a, b):
        dtype, dcode = DTYPES[self.dkey]
        shape = (*a.shape[:-1], b.shape[-1])
        c = torch.empty(shape, dtype=dtype, device=a.device)
        g = args_of(a, b, c, dcode, self.dkey == "f32tf32")
        if not self.lib.dev_supports(ctypes.byref(g)):
            return None
        ws = torch.empty(max(int(self.lib.dev_workspace_bytes(ctypes.byref(g))), 1),
                         dtype=torch.uint8, device=a.device)
        stream = torch.cuda.current_stream().cuda_stream

        def call():
            rc = self.lib.dev_run(ctypes.byref(g), ctypes.c_void_p(ws.data_ptr()),
                                  ctypes.c_void_p(stream))
            if rc:
                raise RuntimeError(f"launch failed: cudaError {rc}")
            return c
        return call


def make(shape_a, shape_b, dtype, layout, gen):
    """layout: 'nn' row-major both, 'tn' A column-major, 'nt' B column-major,
    'tt' both, 'xb' B expanded over the batch (stride 0)."""
    def mk(shape, transposed):
        if transposed:
            t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen, device="cuda",
                            dtype=torch.float32).to(dtype)
            return t.transpose(-2, -1)
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    a = mk(shape_a, layout in ("tn", "tt"))
    if layout == "xb":
        b = mk(shape_b[1:], False).expand(*shape_b)
    else:
        b = mk(shape_b, layout in ("nt", "tt"))
    return a, b


def operands(batch, m, n, k, dtype, layout, gen):
    """A (m x k) and B (k x n), each with a leading batch dimension unless
    `batch` is None."""
    sa = (batch, m, k) if batch else (m, k)
    sb = (batch, k, n) if batch else (k, n)
    return make(sa, sb, dtype, layout, gen)


CORRECTNESS = [  # (batch or None, m, n, k)
    (None, 1, 1, 1), (None, 1, 4096, 4096), (None, 16, 4096, 4096), (None, 7, 257, 4099),
    (None, 3, 64, 2048), (None, 13, 1000, 768), (None, 128, 128, 64), (None, 127, 129, 65),
    (None, 256, 256, 256), (None, 97, 211, 1), (None, 1000, 3000, 768), (None, 509, 521, 523),
    (None, 4095, 4097, 4093), (None, 2048, 2048, 2048), (None, 64, 8192, 128),
    (4, 100, 72, 40), (512, 64, 64, 64), (3, 129, 255, 200), (2, 16, 512, 1024),
    # odd numbers of 128-row tiles (3 and 5), k not a multiple of a 64-deep stage
    (None, 300, 520, 136), (3, 520, 264, 72),
    # split-K of the CUDA-core path: few output tiles, long k with a partial last split
    (3, 50, 60, 3001), (None, 2, 3, 70001),
    # decode's cluster split-K with B K-major and a 2-column last slice (of
    # 16-column CTA slices in the automatic one, of 32-column ones in config 36)
    (None, 16, 1026, 4096), (None, 16, 2050, 4096),
]


def check(libs, seed, tag="", dkeys=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    fails, rows = 0, 0
    for name, lib in libs.items():
        _, path_dkeys, kind = PATHS[name]
        for dkey in (path_dkeys if dkeys is None else dkeys):
            dtype = DTYPES[dkey][0]
            run = Runner(lib, dkey)
            for batch, m, n, k in CORRECTNESS:
                if kind == "decode" and m > 16:
                    continue
                for layout in ("nn", "tn", "nt", "tt", "xb"):
                    if layout == "xb" and batch is None:
                        continue
                    a, b = operands(batch, m, n, k, dtype, layout, gen)
                    call = run.prepare(a, b)
                    if call is None:
                        continue
                    rows += 1
                    torch.cuda.synchronize()
                    try:
                        out = call()
                        torch.cuda.synchronize()
                        out2 = call().clone()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        print(f"FAIL{tag} {name} {dkey} {layout} b={batch} {m}x{n}x{k}: {e}")
                        fails += 1
                        return fails, rows
                    ref = torch.matmul(a.double(), b.double())
                    peer = torch.matmul(a, b).double() if dkey != "f32tf32" else None
                    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
                    scale = ref.abs().max().item() + 1e-30 if ref.numel() else 1.0
                    # f32x3: three TF32 products, float32-sized error (2^-22 terms
                    # dropped, tensor-core accumulation)
                    eps = {"f16": 2**-10, "bf16": 2**-7, "f32": 2**-23, "f32tf32": 2**-10,
                           "f32x3": 2**-20, "f64": 2**-52}[dkey]
                    # output rounding plus accumulated rounding, growing with sqrt(K)
                    tol = scale * eps + 8 * eps * math.sqrt(k) * (
                        a.double().abs().max().item() * b.double().abs().max().item())
                    if peer is not None and peer.numel():
                        tol = max(tol, 2 * (peer - ref).abs().max().item())
                    det = torch.equal(out, out2)
                    bad = not (err <= tol) or not det
                    if bad:
                        fails += 1
                        print(f"FAIL{tag} {name} {dkey} {layout} b={batch} {m}x{n}x{k}: "
                              f"err {err:.3g} tol {tol:.3g} deterministic {det}", flush=True)
    print(f"correctness{tag}: {rows} cases, {fails} failures", flush=True)
    return fails, rows


BENCH = [  # (label, batch, m, n, k, dtype key, layout)
    ("bf16 4096^3", None, 4096, 4096, 4096, "bf16", "nn"),
    ("f16 4096^3", None, 4096, 4096, 4096, "f16", "nn"),
    ("bf16 8192^3", None, 8192, 8192, 8192, "bf16", "nn"),
    ("f16 8192^3", None, 8192, 8192, 8192, "f16", "nn"),
    ("bf16 4096^3 B^T", None, 4096, 4096, 4096, "bf16", "nt"),
    ("bf16 4095x4097x4093", None, 4095, 4097, 4093, "bf16", "nn"),
    ("bf16 1000x3000x768", None, 1000, 3000, 768, "bf16", "nn"),
    ("bf16 8192x1024x8192", None, 8192, 1024, 8192, "bf16", "nn"),
    ("bf16 4096x4096x16384", None, 4096, 4096, 16384, "bf16", "nn"),
    ("bf16 8192x8192x1024", None, 8192, 8192, 1024, "bf16", "nn"),
    ("bf16 16x4096x4096", None, 16, 4096, 4096, "bf16", "nn"),
    ("bf16 1x4096x4096", None, 1, 4096, 4096, "bf16", "nn"),
    ("bf16 16x4096x4096 W^T", None, 16, 4096, 4096, "bf16", "nt"),
    ("f16 512x64^3", 512, 64, 64, 64, "f16", "nn"),
    # a few dozen to hundreds of rows against a weight (batched tokens)
    ("bf16 32x4096x4096 W^T", None, 32, 4096, 4096, "bf16", "nt"),
    ("bf16 64x4096x4096 W^T", None, 64, 4096, 4096, "bf16", "nt"),
    ("bf16 128x4096x4096 W^T", None, 128, 4096, 4096, "bf16", "nt"),
    ("bf16 256x4096x4096 W^T", None, 256, 4096, 4096, "bf16", "nt"),
    ("bf16 512x11008x4096 W^T", None, 512, 11008, 4096, "bf16", "nt"),
    ("bf16 64x4096x4096", None, 64, 4096, 4096, "bf16", "nn"),
    ("bf16 512^3", None, 512, 512, 512, "bf16", "nn"),
    # few output tiles, long K (sm90's tile and split-K choice)
    ("lk bf16 1024x1024x16384", None, 1024, 1024, 16384, "bf16", "nn"),
    ("lk bf16 768x768x8192", None, 768, 768, 8192, "bf16", "nn"),
    ("lk bf16 1024x1024x4096", None, 1024, 1024, 4096, "bf16", "nn"),
    ("bf16 1024^3", None, 1024, 1024, 1024, "bf16", "nn"),
    ("bf16 32x512^3", 32, 512, 512, 512, "bf16", "nn"),
    # batched small matrices (M <= 64: the product sends them to sm80)
    ("bsmall bf16 64x64x1024x1024", 64, 64, 1024, 1024, "bf16", "nn"),
    ("bsmall bf16 8x32x4096x4096", 8, 32, 4096, 4096, "bf16", "nn"),
    ("bsmall f16 256x64x256x64", 256, 64, 256, 64, "f16", "nn"),
    ("bsmall bf16 128x48x512x256", 128, 48, 512, 256, "bf16", "nn"),
    ("bsmall bf16 4x64x2048x2048", 4, 64, 2048, 2048, "bf16", "nn"),
    ("bsmall bf16 32x64x512x512 B^T", 32, 64, 512, 512, "bf16", "nt"),
    ("f32 4096^3", None, 4096, 4096, 4096, "f32", "nn"),
    ("f32 2048^3", None, 2048, 2048, 2048, "f32", "nn"),
    ("f32 8192^3", None, 8192, 8192, 8192, "f32", "nn"),
    ("f32 1000x3000x768", None, 1000, 3000, 768, "f32", "nn"),
    # few output tiles, long K (the CUDA-core path's split-K)
    ("f32 512^3", None, 512, 512, 512, "f32", "nn"),
    ("f32 1024^3", None, 1024, 1024, 1024, "f32", "nn"),
    ("f32 768x768x8192", None, 768, 768, 8192, "f32", "nn"),
    ("f32 256x256x16384", None, 256, 256, 16384, "f32", "nn"),
    ("f64 512^3", None, 512, 512, 512, "f64", "nn"),
    ("f32tf32 4096^3", None, 4096, 4096, 4096, "f32tf32", "nn"),
    ("f32tf32 4096^3 B^T", None, 4096, 4096, 4096, "f32tf32", "nt"),
    ("f64 1024^3", None, 1024, 1024, 1024, "f64", "nn"),
    ("f32x3 4096^3", None, 4096, 4096, 4096, "f32x3", "nn"),
    # deform_conv2d 2x64x128x128's folded forward GEMM (one image per batch)
    ("f32x3 2x64x16384x580", 2, 64, 16384, 580, "f32x3", "nn"),
    ("f32 2x64x16384x580", 2, 64, 16384, 580, "f32", "nn"),
    ("f32x3 64x32768x2308", None, 64, 32768, 2308, "f32x3", "nn"),
]


def bench_case(batch, m, n, k, dkey, layout, gen, do_bench):
    """The operands of a timing row, its flop count and torch.matmul's time on
    them (TF32 allowed exactly for the f32tf32 rows)."""
    a, b = operands(batch, m, n, k, DTYPES[dkey][0], layout, gen)
    flop = 2.0 * (batch or 1) * m * n * k
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dkey == "f32tf32"
    try:
        t_ref = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return a, b, flop, t_ref


def sweep_values(sweeps, name):
    """--sweep PATH:VAR=v1/v2/..: each value of the tuning variable VAR is
    timed as its own row for PATH (the harness's hooks, dev_<path>.cuh,
    read VAR at each call)."""
    for sw in sweeps:
        path, _, rest = sw.partition(":")
        if path == name:
            var, _, values = rest.partition("=")
            return var, values.split("/")
    return None, [None]


def bench(libs, sweeps=(), only=None):
    from triton.testing import do_bench
    gen = torch.Generator(device="cuda").manual_seed(1)
    print(f"{'case':28s} {'path':7s} {'ours TF/s':>10s} {'torch TF/s':>10s} {'ratio':>6s}")
    for label, batch, m, n, k, dkey, layout in BENCH:
        if only and not any(o in label for o in only):
            continue
        a, b, flop, t_ref = bench_case(batch, m, n, k, dkey, layout, gen, do_bench)
        for name, lib in libs.items():
            if dkey not in PATHS[name][1]:
                continue
            var, values = sweep_values(sweeps, name)
            for value in values:
                if var:
                    os.environ[var] = value
                call = Runner(lib, dkey).prepare(a, b)
                if call is None:
                    continue
                t = do_bench(call, warmup=50, rep=300)
                tag = name if var is None else f"{name}[{value}]"
                print(f"{label:28s} {tag:7s} {flop / t / 1e9:10.1f} {flop / t_ref / 1e9:10.1f} "
                      f"{t_ref / t:6.3f}", flush=True)
            if var:
                os.environ.pop(var, None)


def bench_rows(*labels):
    """The BENCH rows of these labels, in this order."""
    by_label = {row[0]: row for row in BENCH}
    return [by_label[label] for label in labels]


CFG_BENCH = {  # path -> [(label, batch, m, n, k, dtype key, layout)] for --cfgs
    "sm80": bench_rows("bf16 4096^3", "bf16 8192x1024x8192", "bf16 1000x3000x768",
                       "f32tf32 4096^3"),
    "simt": bench_rows("f32 4096^3", "f32 2048^3", "f32 1000x3000x768",
                       # few output tiles, long K (the CUDA-core path's split-K)
                       "f32 512^3", "f32 1024^3", "f32 768x768x8192", "f32 256x256x16384",
                       "f64 512^3", "f64 1024^3"),
    "decode": bench_rows("bf16 16x4096x4096", "bf16 16x4096x4096 W^T", "bf16 1x4096x4096") + [
        ("bf16 4x4096x4096", None, 4, 4096, 4096, "bf16", "nn"),
        ("bf16 8x4096x4096", None, 8, 4096, 4096, "bf16", "nn"),
        ("f16 16x4096x4096", None, 16, 4096, 4096, "f16", "nn"),
        ("f32 16x4096x4096", None, 16, 4096, 4096, "f32", "nn"),
        ("bf16 4x8192x8192", None, 4, 8192, 8192, "bf16", "nn"),
        # short K or narrow N: a few steps per warp, latency more than bandwidth
        ("bf16 16x1024x4096", None, 16, 4096, 1024, "bf16", "nn"),
        ("bf16 1x1024x4096", None, 1, 4096, 1024, "bf16", "nn"),
        ("bf16 16x4096x1024 W^T", None, 16, 1024, 4096, "bf16", "nt"),
        ("bf16 1x4096x1024 W^T", None, 1, 1024, 4096, "bf16", "nt"),
        ("bf16 16x8192x1024 W^T", None, 16, 1024, 8192, "bf16", "nt"),
        ("bf16 16x16384x1024 W^T", None, 16, 1024, 16384, "bf16", "nt"),
        ("bf16 16x1024x1024 W^T", None, 16, 1024, 1024, "bf16", "nt"),
        ("bf16 16x4096x1536 W^T", None, 16, 1536, 4096, "bf16", "nt"),
        ("bf16 16x14336x4096 W^T", None, 16, 4096, 14336, "bf16", "nt"),
    ],
}
HBM_BYTES_PER_S = 4.8e12  # H200


def cfg_list(lib, name, spec):
    """--cfgs PATH:all|I,J: names, dtypes and the env var come from the .so."""
    lib.dev_cfg_name.restype = ctypes.c_char_p
    lib.dev_cfg_dtypes.restype = ctypes.c_char_p
    lib.dev_cfg_env.restype = ctypes.c_char_p
    count = lib.dev_cfg_count()
    if count == 0:
        raise SystemExit(f"--cfgs: path {name} has no harness config table")
    idx = list(range(count)) if spec == "all" else [int(x) for x in spec.split(",") if x]
    bad = [i for i in idx if not 0 <= i < count]
    if bad:
        raise SystemExit(f"--cfgs: {bad} not in 0..{count - 1}")
    out = []
    for i in idx:
        dts = lib.dev_cfg_dtypes(i).decode()
        out.append((i, lib.dev_cfg_name(i).decode(), tuple(d for d in dts.split(",") if d)))
    return out, lib.dev_cfg_env().decode()


def run_cfgs(name, lib, spec, do_check, do_bench, only=None):
    """Each config of a path's harness table, picked through the env var the .so
    reads at each call: the correctness list per config (the config's dtypes),
    then timings on CFG_BENCH[name]."""
    cfgs, env_var = cfg_list(lib, name, spec)
    path_dtypes = PATHS[name][1]
    fails = 0
    try:
        if do_check:
            for i, cname, dts in cfgs:
                os.environ[env_var] = str(i)
                f, _ = check({name: lib}, seed=0, tag=f" [cfg {i}: {cname}]",
                             dkeys=[d for d in path_dtypes if not dts or d in dts])
                fails += f
        if do_bench:
            from triton.testing import do_bench
            gen = torch.Generator(device="cuda").manual_seed(1)
            print(f"{'case':22s} {'cfg':46s} {'ours TF/s':>9s} {'torch TF/s':>10s} {'ratio':>6s} "
                  f"{'ours GB/s':>9s} {'%HBM':>5s} {'torch %HBM':>10s}")
            for label, batch, m, n, k, dkey, layout in CFG_BENCH[name]:
                if only and not any(o in label for o in only):
                    continue
                a, b, flop, t_ref = bench_case(batch, m, n, k, dkey, layout, gen, do_bench)
                # compulsory bytes: A and B read, C written once
                nbytes = (a.numel() + b.numel() + (batch or 1) * m * n) * a.element_size()
                rows = [("auto", "auto")] + [(str(i), f"{i}: {c}") for i, c, dts in cfgs
                                             if not dts or dkey in dts]
                for env, cname in rows:
                    if env == "auto":
                        os.environ.pop(env_var, None)
                    else:
                        os.environ[env_var] = env
                    call = Runner(lib, dkey).prepare(a, b)
                    if call is None:
                        print(f"{label:22s} {cname:46s} unsupported")
                        continue
                    try:
                        first = call().clone()
                        t = do_bench(call, warmup=50, rep=300)
                        # after hundreds of launches, still the same bits (e.g.
                        # split-K tickets back to 0 each time)
                        same = torch.equal(call(), first)
                        torch.cuda.synchronize()
                    except RuntimeError as e:
                        print(f"{label:22s} {cname:46s} {e}", flush=True)
                        fails += 1
                        continue
                    fails += not same
                    gbs = nbytes / t / 1e6
                    print(f"{label:22s} {cname:46s} {flop / t / 1e9:9.1f} "
                          f"{flop / t_ref / 1e9:10.1f} {t_ref / t:6.3f} {gbs:9.0f} "
                          f"{100 * gbs * 1e9 / HBM_BYTES_PER_S:5.1f} "
                          f"{100 * nbytes / t_ref * 1e3 / HBM_BYTES_PER_S:10.1f}"
                          f"{'' if same else '  NOT DETERMINISTIC'}", flush=True)
    finally:
        os.environ.pop(env_var, None)
    return fails


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--prebuilt", default=None, metavar="DIR",
                   help="load DIR/<path>.so (from an earlier --build-only --out DIR) instead of "
                        "building: nvcc links cudart statically, so a build from a machine "
                        "without the GPU runs on one")
    p.add_argument("--bench-only", action="store_true")
    p.add_argument("--sweep", action="append", default=[], help="PATH:VAR=v1/v2/...")
    p.add_argument("--only", default="", help="comma-separated substrings of bench labels")
    p.add_argument("--ptxas-v", action="store_true",
                   help="print registers and spills of every kernel (nvcc -Xptxas=-v)")
    p.add_argument("--cfgs", default=None, metavar="PATH:all|I,J,..",
                   help="one path (sm80, simt, decode): correctness (unless --bench-only) and "
                        "timings (unless --no-bench) for each config of its harness table")
    p.add_argument("--sm80-cfgs", default=None, metavar="all|I,J,..",
                   help="same as --cfgs sm80:SPEC")
    p.add_argument("--decode-cfgs", default=None, metavar="all|I,J,..",
                   help="same as --cfgs decode:SPEC")
    args = p.parse_args()
    names = [n for n in args.paths.split(",") if n]
    if args.sm80_cfgs:
        args.cfgs = f"sm80:{args.sm80_cfgs}"
    if args.decode_cfgs:
        args.cfgs = f"decode:{args.decode_cfgs}"
    cfg_path = cfg_spec = None
    if args.cfgs:
        cfg_path, _, cfg_spec = args.cfgs.partition(":")
        if cfg_path not in CFG_BENCH or not cfg_spec:
            raise SystemExit(f"--cfgs: PATH:all|I,J with PATH in {sorted(CFG_BENCH)}")
        names = [cfg_path]
    outdir = args.out or tempfile.mkdtemp()
    os.makedirs(outdir, exist_ok=True)
    libs = build(names, outdir, args.arch, args.ptxas_v, args.prebuilt)
    if args.build_only:
        return 0 if len(libs) == len(names) else 1
    torch.cuda.init()
    if cfg_path:
        if cfg_path not in libs:
            return 1
        return 1 if run_cfgs(cfg_path, libs[cfg_path], cfg_spec, not args.bench_only,
                             not args.no_bench, [o for o in args.only.split(",") if o]) else 0
    fails = 0 if args.bench_only else check(libs, seed=0)[0]
    if not args.no_bench:
        bench(libs, args.sweep, [o for o in args.only.split(",") if o])
    return 1 if fails or len(libs) != len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
