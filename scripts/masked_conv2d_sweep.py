"""masked_conv2d against conv2d + torch.where on CUDA, at the benchmark's
layer (2x256x100x152, 256 -> 256, 3x3, padding 1), under PyTorch's default
settings unless a table names others: every density through the default
path and through each forced path (TORCHOPS_TESTING_MASKED_CONV_PATH), in
float32 (TF32 and exact) and bfloat16; the path history patterns of the
dense hand-off's queued convolution; the forward GEMM alone; with
--timelines, a profiler timeline of single calls.  Needs triton (do_bench).

    python scripts/masked_conv2d_sweep.py [--timelines]
"""
import os
import sys
import time
import torch
import torch.nn.functional as F
import torchops  # noqa: F401
from triton.testing import do_bench

SW = "TORCHOPS_TESTING_MASKED_CONV_PATH"
dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
print("defaults: cudnn.allow_tf32", torch.backends.cudnn.allow_tf32, "matmul.allow_tf32",
      torch.backends.cuda.matmul.allow_tf32, flush=True)
torch.manual_seed(0)
n, c, h, w = 2, 256, 100, 152
x32 = torch.randn(n, c, h, w).to(dev)
w32 = (torch.randn(c, c, 3, 3) / 48).to(dev)
b32 = torch.randn(c).to(dev)


def mask_of(d):
    g = torch.Generator().manual_seed(int(d * 1000))
    return (torch.rand(n, h, w, generator=g) < d).to(dev)


def op(x, m, wt, b):
    return torch.ops.torchops.masked_conv2d(x, m, wt, b, [1, 1], [1, 1], [1, 1], 1)


def ref(x, m, wt, b):
    out = F.conv2d(x, wt, b, 1, 1)
    return torch.where(m.unsqueeze(1), out, out.new_zeros(()))


def bench(fn, path="auto"):
    os.environ[SW] = path
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=60, rep=250, return_mode="median") * 1e3  # us
    finally:
        os.environ[SW] = "auto"


def table(dtype, densities, extra_cublas=False):
    x, wt, b = x32.to(dtype), w32.to(dtype), b32.to(dtype)
    print(f"\n== {dtype}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} "
          f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}", flush=True)
    hdr = f"{'dens':>5} {'ref us':>8} {'auto us':>8} {'auto x':>7} {'sparse':>8} {'sp x':>6} {'dense':>8} {'dn x':>6}"
    if extra_cublas:
        hdr += f" {'sp(cuBLAS)':>10} {'x':>6}"
    print(hdr, flush=True)
    for d in densities:
        m = mask_of(d)
        r = bench(lambda: ref(x, m, wt, b))
        a = bench(lambda: op(x, m, wt, b))
        s = bench(lambda: op(x, m, wt, b), "sparse")
        dn = bench(lambda: op(x, m, wt, b), "dense")
        line = f"{d:5.0%} {r:8.1f} {a:8.1f} {r / a:7.2f} {s:8.1f} {r / s:6.2f} {dn:8.1f} {r / dn:6.2f}"
        if extra_cublas:
            torch.backends.cuda.matmul.allow_tf32 = True
            sc = bench(lambda: op(x, m, wt, b), "sparse")
            torch.backends.cuda.matmul.allow_tf32 = False
            line += f" {sc:10.1f} {r / sc:6.2f}"
        err = ((op(x, m, wt, b).double() - ref(x.double(), m, wt.double(), b.double())).abs().max()
               / ref(x.double(), m, wt.double(), b.double()).abs().max()).item()
        print(line + f"  err {err:.1e}", flush=True)


def patterns():
    """Path history: a layer's dense calls in a row queue the convolution
    before the count; alternating masks never do; a dense streak broken by
    a sparse mask wastes one convolution."""
    m5, m100, m60 = mask_of(0.05), mask_of(1.0), mask_of(0.6)
    f = lambda m: op(x32, m, w32, b32)  # noqa: E731
    print("\n== history patterns, fp32 default flags (us per pattern)", flush=True)
    for name, seq in (("5%", [m5]), ("100%", [m100]), ("60%", [m60]),
                      ("5%,100% alternating", [m5, m100]), ("5%,60% alternating", [m5, m60]),
                      ("100%,100%,5%", [m100, m100, m5]), ("60%,60%,5%", [m60, m60, m5])):
        def run(seq=seq):
            for m in seq:
                f(m)
        print(f"  {name:24s} {bench(run):8.1f}", flush=True)
    rr = lambda m: ref(x32, m, w32, b32)  # noqa: E731
    print(f"  ref 5% {bench(lambda: rr(m5)):8.1f}  ref 100% {bench(lambda: rr(m100)):8.1f}"
          f"  ref 60% {bench(lambda: rr(m60)):8.1f}", flush=True)


t0 = time.time()
patterns()
table(torch.float32, [0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.40, 0.60, 0.80, 0.95, 1.0],
      extra_cublas=True)
table(torch.bfloat16, [0.05, 0.15, 0.20, 0.25, 0.30, 0.50, 1.0])
torch.backends.cudnn.allow_tf32 = False
table(torch.float32, [0.05, 0.25, 1.0])
torch.backends.cudnn.allow_tf32 = True
print(f"tables {time.time() - t0:.0f} s", flush=True)

# The GEMM alone, TF32: (P, 2304) x (2304, 256) as cuBLAS, torchops.matmul (both
# orientations) and cuDNN's 1x1 convolution of (P, 2304, 1, 1); GPU time, and
# host time per call (launch-bound loop of 50 calls).
print("\n== forward GEMM alone, TF32, GPU us (host us per call)", flush=True)


def host_us(fn):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        fn()
    h = (time.perf_counter() - t) / 50 * 1e6
    torch.cuda.synchronize()
    return h


for d in (0.05, 0.10, 0.25, 0.40):
    p = int(d * n * h * w)
    a = torch.randn(p, 2304, device=dev)
    wm = torch.randn(256, 2304, device=dev)
    at = a.t().contiguous().t()
    variants = {
        "cuBLAS (P,K)(K,N)": lambda: torch.matmul(a, wm.t()),
        "torchops (P,K)(K,N)": lambda: torch.ops.torchops.matmul(a, wm.t()),
        "torchops (N,K)(K,P)": lambda: torch.ops.torchops.matmul(wm, a.t()),
        "cuDNN 1x1": lambda: F.conv2d(a.view(p, 2304, 1, 1), wm.view(256, 2304, 1, 1)),
    }
    torch.set_float32_matmul_precision("high")
    cells = []
    for name, fn in variants.items():
        g = do_bench(fn, warmup=30, rep=100) * 1e3
        cells.append(f"{name} {g:6.1f} ({host_us(fn):5.1f})")
    torch.set_float32_matmul_precision("highest")
    print(f"{d:4.0%} P={p:6d} " + " | ".join(cells), flush=True)

# cuDNN's 1x1 convolution at a count it has not seen: the plan it builds first.
wm = torch.randn(256, 2304, device=dev)
for p in (1521, 1522, 7601):
    a = torch.randn(p, 2304, device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    F.conv2d(a.view(p, 2304, 1, 1), wm.view(256, 2304, 1, 1))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    F.conv2d(a.view(p, 2304, 1, 1), wm.view(256, 2304, 1, 1))
    torch.cuda.synchronize()
    print(f"cuDNN 1x1 new P={p}: first call {(t1 - t) * 1e6:8.0f} us, "
          f"second {(time.perf_counter() - t1) * 1e6:6.0f} us", flush=True)

if "--timelines" not in sys.argv:
    sys.exit(0)

# Timelines: one call, kernels and host API calls, relative to the call's start.
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def timeline(label, fn, path):
    os.environ[SW] = path
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    os.environ[SW] = "auto"
    evs = [e for e in prof.events() if e.time_range.elapsed_us() >= 0]
    evs.sort(key=lambda e: e.time_range.start)
    # the last call: from the last top-level masked_conv2d / conv2d op
    starts = [e.time_range.start for e in evs
              if e.name in ("torchops::masked_conv2d", "aten::conv2d")]
    t0 = starts[-1] if starts else evs[0].time_range.start
    print(f"\n== timeline {label} ({path})", flush=True)
    for e in evs:
        if e.time_range.start < t0:
            continue
        kind = "GPU" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu"
        if kind == "cpu" and not (e.name.startswith(("cuda", "torchops", "aten::_conv",
                                                     "aten::where", "aten::mm", "aten::matmul",
                                                     "aten::cudnn", "aten::conv2d"))):
            continue
        print(f"  {kind} {e.time_range.start - t0:8.1f} +{e.time_range.elapsed_us():7.1f}  "
              f"{e.name[:70]}", flush=True)


m5, m100 = mask_of(0.05), mask_of(1.0)
timeline("5% fp32", lambda: op(x32, m5, w32, b32), "auto")
timeline("100% fp32", lambda: op(x32, m100, w32, b32), "auto")
timeline("25% fp32 sparse", lambda: op(x32, mask_of(0.25), w32, b32), "sparse")
timeline("ref 100%", lambda: ref(x32, m100, w32, b32), "auto")
print(f"total {time.time() - t0:.0f} s", flush=True)
