"""A short tour of torchops: every op once, checked against PyTorch."""

from __future__ import annotations

import time

import torch

import torchops


def _devices(device: str | None) -> list[str]:
    if device:
        return [device]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _report(name: str, got: torch.Tensor, want: torch.Tensor, seconds: float) -> None:
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    print(f"  {name:44s} shape={tuple(got.shape)!s:16s} dtype={str(got.dtype):15s} "
          f"max|err|={err:.2e}  {seconds * 1e3:7.2f} ms")


def run(device: str | None = None) -> None:
    torch.manual_seed(0)
    for dev in _devices(device):
        print(f"device {dev}:")
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            a = torch.randn(256, 384, device=dev, dtype=dtype)
            b = torch.randn(384, 128, device=dev, dtype=dtype)
            t0 = time.perf_counter()
            c = torchops.matmul(a, b)
            if dev == "cuda":
                torch.cuda.synchronize()
            _report(f"matmul (256x384 @ 384x128, {dtype})", c, a.double() @ b.double(),
                    time.perf_counter() - t0)
        a = torch.randn(8, 64, 32, device=dev)
        b = torch.randn(8, 96, 32, device=dev).transpose(1, 2)  # non-contiguous
        t0 = time.perf_counter()
        c = torchops.matmul(a, b)
        _report("matmul batched, transposed b", c, torch.bmm(a.double(), b.double()),
                time.perf_counter() - t0)

        z = torch.randn(1 << 20, device=dev, requires_grad=True)
        t0 = time.perf_counter()
        y = torchops.d_sigmoid(z)
        y.sum().backward()
        s = torch.sigmoid(z.detach().double())
        _report("d_sigmoid (forward)", y.detach(), s * (1 - s), time.perf_counter() - t0)
        _report("d_sigmoid (gradient)", z.grad, s * (1 - s) * (1 - 2 * s), 0.0)

        model = torch.compile(lambda x, w: torchops.d_sigmoid(torchops.matmul(x, w)),
                              fullgraph=True)
        x = torch.randn(64, 32, device=dev)
        w = torch.randn(32, 16, device=dev)
        t0 = time.perf_counter()
        out = model(x, w)
        xw = x.double() @ w.double()
        _report("torch.compile(d_sigmoid(matmul(x, w)))", out,
                torch.sigmoid(xw) * (1 - torch.sigmoid(xw)), time.perf_counter() - t0)
