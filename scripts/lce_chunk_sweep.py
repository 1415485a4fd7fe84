"""Time and peak memory of torchops.fused_linear_cross_entropy's forward +
backward against its chunk budget (TORCHOPS_LCE_CHUNK_MIB), on one CUDA
device, beside the unfused formula (eager and torch.compile) and Liger-Kernel
(when installed):

    python scripts/lce_chunk_sweep.py [--n 8192 --h 4096 --v 128256] [--mib 64,128,256,512]

"extra" is the peak allocated memory of one step beyond its inputs and the
gradients it returns (the quantity the op's memory target is about)."""

import argparse
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import torchops


def step(fn, x, w, t):
    x.grad = w.grad = None
    fn(x, w, t).backward()


def measure(fn, x, w, t):
    step(fn, x, w, t)  # warm-up (and compile)
    torch.cuda.synchronize()
    grads = x.numel() * x.element_size() + w.numel() * w.element_size()
    x.grad = w.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(x, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - grads
    ms = do_bench(lambda: step(fn, x, w, t), warmup=5, rep=50)
    return ms, extra / 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--mib", default="64,128,256,512")
    a = ap.parse_args()
    torch.manual_seed(0)
    x = (torch.randn(a.n, a.h, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    w = (torch.randn(a.v, a.h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, a.v, (a.n,), device="cuda")
    rows = []

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    rows.append(("eager",) + measure(eager, x, w, t))
    rows.append(("torch.compile",) + measure(torch.compile(eager), x, w, t))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        pass
    else:
        liger = LigerFusedLinearCrossEntropyLoss()
        rows.append(("Liger-Kernel",) + measure(lambda x, w, t: liger(w, x, t), x, w, t))
    for mib in a.mib.split(","):
        os.environ["TORCHOPS_LCE_CHUNK_MIB"] = mib
        rows.append((f"torchops {mib} MiB",) + measure(torchops.fused_linear_cross_entropy,
                                                      x, w, t))
    flop = 6 * a.n * a.h * a.v
    print(f"N={a.n} H={a.h} V={a.v} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| formulation | fwd+bwd ms | TFLOP/s | extra GiB |")
    print("|---|---|---|---|")
    for name, ms, extra in rows:
        print(f"| {name} | {ms:.2f} | {flop / ms / 1e9:.0f} | {extra:.3f} |")


if __name__ == "__main__":
    main()
