"""Smoke test of a torchops build on a GPU: both libraries loaded the expected
way, and the CUDA kernels give PyTorch's answers.  Used by scripts/gpu_check.sh
after the ahead-of-time build (``--expect prebuilt``) and for the just-in-time
build (``--expect jit-built``, with TORCHOPS_PREBUILT=0 and an empty
TORCHOPS_CACHE_DIR).

    python scripts/smoke.py --expect prebuilt|jit-built|any
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect", choices=["prebuilt", "jit-built", "any"], default="any")
    args = parser.parse_args()

    t0 = time.perf_counter()
    import torch

    import torchops
    from torchops import _loader

    print(f"import torchops: {time.perf_counter() - t0:.1f} s")
    failures = []
    for name in ("torchops_cpu", "torchops_cuda"):
        rec = _loader.records().get(name)
        how = rec.how if rec else "missing"
        print(f"{name}: {how} {rec.path if rec else ''}")
        if rec is None or not rec.loaded:
            failures.append(f"{name} not loaded: {rec.tried if rec else 'no record'}")
        elif args.expect != "any" and how != args.expect:
            failures.append(f"{name} was {how}, expected {args.expect}")
    if not torch.cuda.is_available():
        failures.append("torch sees no CUDA GPU")
    if failures:
        print("SMOKE FAILED: " + "; ".join(failures))
        return 1

    torch.manual_seed(0)
    dev = "cuda"
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        a = torch.randn(3, 257, 129, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(3, 129, 65, device=dev, dtype=dtype).transpose(1, 2).contiguous() \
            .transpose(1, 2).requires_grad_()
        got = torchops.matmul(a, b)
        want = torch.bmm(a.double(), b.double())
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        g = torch.autograd.grad(got.sum(), (a, b))
        gw = torch.autograd.grad(want.sum(), (a, b))
        gerr = max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
                   for x, y in zip(g, gw))
        print(f"matmul {str(dtype)[6:]}: rel err {err:.1e}, grad rel err {gerr:.1e}")
        if not (err <= tol and gerr <= tol):
            failures.append(f"matmul {dtype}")
    z = torch.randn(1 << 20, device=dev, requires_grad=True)
    y = torchops.d_sigmoid(z)
    s = torch.sigmoid(z.detach().double())
    (gz,) = torch.autograd.grad(y.sum(), z)
    err = max((y.double() - s * (1 - s)).abs().max().item(),
              (gz.double() - s * (1 - s) * (1 - 2 * s)).abs().max().item())
    print(f"d_sigmoid: abs err {err:.1e}")
    if not err <= 1e-5:
        failures.append("d_sigmoid")
    torch.cuda.synchronize()

    # Every public op should have a CUDA kernel (or be composite of ops that do).
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchops::"))
    no_cuda = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")
               and not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CompositeImplicitAutograd")]
    print(f"{len(names)} torchops operators; without a CUDA kernel: {', '.join(no_cuda) or 'none'}")
    if failures:
        print("SMOKE FAILED: " + ", ".join(failures))
        return 1
    print(f"smoke ok ({args.expect}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
