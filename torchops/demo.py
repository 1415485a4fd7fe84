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
    timing = f"  {seconds * 1e3:7.2f} ms" if seconds else ""
    print(f"  {name:44s} shape={tuple(got.shape)!s:16s} dtype={str(got.dtype):15s} "
          f"max|err|={err:.2e}{timing}")


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

        _detection(dev)


def _detection(dev: str) -> None:
    g = torch.Generator().manual_seed(1)
    xy = torch.rand(2000, 2, generator=g) * 400
    wh = torch.rand(2000, 2, generator=g) * 60 + 4
    boxes = torch.cat([xy, xy + wh], 1).to(dev)
    scores = torch.rand(2000, generator=g).to(dev)
    classes = torch.randint(0, 5, (2000,), generator=g).to(dev)
    t0 = time.perf_counter()
    keep = torchops.nms(boxes, scores, 0.5)
    print(f"  {'nms (2000 boxes, IoU 0.5)':44s} kept {keep.numel()} boxes "
          f"{(time.perf_counter() - t0) * 1e3:7.2f} ms")
    keep_c = torchops.batched_nms(boxes, scores, classes, 0.5)
    print(f"  {'batched_nms (5 classes)':44s} kept {keep_c.numel()} boxes")
    iou = torchops.box_iou(boxes[:300], boxes[:200])
    a, b = boxes[:300, None].double(), boxes[None, :200].double()
    inter = ((torch.minimum(a[..., 2:], b[..., 2:]) - torch.maximum(a[..., :2], b[..., :2]))
             .clamp(min=0).prod(-1))
    area = lambda x: (x[..., 2:] - x[..., :2]).prod(-1)  # noqa: E731
    _report("box_iou (300 x 200)", iou, inter / (area(a) + area(b) - inter), 0.0)

    feats = torch.randn(2, 16, 32, 32, generator=g).to(dev).requires_grad_()
    rois = torch.cat([torch.tensor([[0.0], [1.0], [0.0]]),
                      torch.tensor([[2.0, 3.0, 20.0, 25.0], [0.0, 0.0, 31.0, 31.0],
                                    [5.5, 7.25, 9.0, 30.0]])], 1).to(dev)
    pooled = torchops.roi_align(feats, rois, output_size=7, spatial_scale=1.0,
                                sampling_ratio=2, aligned=True)
    pooled.sum().backward()
    print(f"  {'roi_align (3 RoIs, 7x7) + backward':44s} shape={tuple(pooled.shape)!s:16s} "
          f"grad sum={feats.grad.sum().item():.3f}")
    mx = torchops.roi_pool(feats.detach(), rois, output_size=(4, 4))
    print(f"  {'roi_pool (3 RoIs, 4x4)':44s} shape={tuple(mx.shape)!s:16s} max={mx.max().item():.3f}")

    logits = torch.randn(512, 80, generator=g).to(dev).requires_grad_()
    targets = (torch.rand(512, 80, generator=g) < 0.05).float().to(dev)
    loss = torchops.sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0, reduction="mean")
    loss.backward()
    x, t = logits.detach().double(), targets.double()
    p = torch.sigmoid(x)
    ce = torch.nn.functional.binary_cross_entropy_with_logits(x, t, reduction="none")
    ref = (ce * (1 - (p * t + (1 - p) * (1 - t))) ** 2 * (0.25 * t + 0.75 * (1 - t))).mean()
    _report("sigmoid_focal_loss (512x80, mean)", loss.detach(), ref, 0.0)
