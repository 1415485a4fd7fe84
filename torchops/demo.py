"""A short tour of torchops: every op once, checked against its pure-PyTorch
reference (torchops.references) computed in float64."""

from __future__ import annotations

import time

import torch

import torchops
from torchops import references


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
            _report(f"matmul (256x384 @ 384x128, {dtype})", c,
                    references.matmul(a.double(), b.double()), time.perf_counter() - t0)
        a = torch.randn(8, 64, 32, device=dev)
        b = torch.randn(8, 96, 32, device=dev).transpose(1, 2)  # non-contiguous
        t0 = time.perf_counter()
        c = torchops.matmul(a, b)
        _report("matmul batched, transposed b", c, references.matmul(a.double(), b.double()),
                time.perf_counter() - t0)

        z = torch.randn(1 << 20, device=dev, requires_grad=True)
        t0 = time.perf_counter()
        y = torchops.d_sigmoid(z)
        y.sum().backward()
        seconds = time.perf_counter() - t0
        zd = z.detach().double().requires_grad_()
        want = references.d_sigmoid(zd)
        want.sum().backward()
        _report("d_sigmoid (forward)", y.detach(), want.detach(), seconds)
        _report("d_sigmoid (gradient)", z.grad, zd.grad, 0.0)

        model = torch.compile(lambda x, w: torchops.d_sigmoid(torchops.matmul(x, w)),
                              fullgraph=True)
        x = torch.randn(64, 32, device=dev)
        w = torch.randn(32, 16, device=dev)
        t0 = time.perf_counter()
        out = model(x, w)
        seconds = time.perf_counter() - t0
        _report("torch.compile(d_sigmoid(matmul(x, w)))", out,
                references.d_sigmoid(references.matmul(x.double(), w.double())), seconds)

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
    seconds = time.perf_counter() - t0
    same = torch.equal(keep.cpu(), references.nms(boxes.cpu(), scores.cpu(), 0.5))
    print(f"  {'nms (2000 boxes, IoU 0.5)':44s} kept {keep.numel()} boxes, "
          f"{'the same as' if same else 'NOT the same as'} the reference "
          f"{seconds * 1e3:7.2f} ms")
    keep_c = torchops.batched_nms(boxes, scores, classes, 0.5)
    same = torch.equal(keep_c.cpu(), references.batched_nms(boxes.cpu(), scores.cpu(),
                                                            classes.cpu(), 0.5))
    print(f"  {'batched_nms (5 classes)':44s} kept {keep_c.numel()} boxes, "
          f"{'the same as' if same else 'NOT the same as'} the reference")
    iou = torchops.box_iou(boxes[:300], boxes[:200])
    _report("box_iou (300 x 200)", iou,
            references.box_iou(boxes[:300].double(), boxes[:200].double()), 0.0)

    feats = torch.randn(2, 16, 32, 32, generator=g).to(dev).requires_grad_()
    rois = torch.cat([torch.tensor([[0.0], [1.0], [0.0]]),
                      torch.tensor([[2.0, 3.0, 20.0, 25.0], [0.0, 0.0, 31.0, 31.0],
                                    [5.5, 7.25, 9.0, 30.0]])], 1).to(dev)
    pooled = torchops.roi_align(feats, rois, output_size=7, spatial_scale=1.0,
                                sampling_ratio=2, aligned=True)
    pooled.sum().backward()
    fd = feats.detach().double().requires_grad_()
    want = references.roi_align(fd, rois.double(), 1.0, 7, 7, 2, True)
    want.sum().backward()
    _report("roi_align (3 RoIs, 7x7)", pooled.detach(), want.detach(), 0.0)
    _report("roi_align (gradient)", feats.grad, fd.grad, 0.0)
    mx = torchops.roi_pool(feats.detach(), rois, output_size=(4, 4))
    _report("roi_pool (3 RoIs, 4x4)", mx,
            references.roi_pool(fd.detach(), rois.double(), 1.0, 4, 4)[0], 0.0)

    logits = torch.randn(512, 80, generator=g).to(dev).requires_grad_()
    targets = (torch.rand(512, 80, generator=g) < 0.05).float().to(dev)
    loss = torchops.sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0, reduction="mean")
    loss.backward()
    ref = references.sigmoid_focal_loss(logits.detach().double(), targets.double(), 0.25, 2.0,
                                        "mean")
    _report("sigmoid_focal_loss (512x80, mean)", loss.detach(), ref, 0.0)
