"""A short tour of torchops: every op and every module, beside its reference.

Each line calls one op (or module) through the public API and prints:

* ``max|err|``: the largest difference from the same call computed in float64
  by the pure-PyTorch formulas of :mod:`torchops.references` (integer outputs,
  the indices nms keeps, must be identical);
* ``torchops`` and ``reference``: steady-state times of the call and of its
  reference on the same inputs, measured in this run with
  ``torch.utils.benchmark.Timer.blocked_autorange`` (warm: the first call,
  which may allocate or compile, is not timed).  The reference is the peer
  users would otherwise call (torchvision, where installed) or, failing one,
  the same call with every torchops operator computed by its formula.

The sizes are small, so the whole tour takes seconds; ``python -m torchops
bench`` measures at realistic sizes, with cold caches.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.benchmark import Timer

import torchops
from torchops import references

# Seconds of timed calls per line and variant: enough for a stable median of
# the small calls below, short enough for the whole tour to take seconds.
MIN_RUN_TIME = 0.05


class ReferenceMode(TorchDispatchMode):
    """Computes every ``torch.ops.torchops`` operator called inside it by its
    formula in :mod:`torchops.references` (same arguments, same outputs), so
    that a module or a wrapper runs unchanged around the reference.  Forward
    only: the references' autograd is theirs, not the ops' backward ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func.name().partition("::")
        if namespace != "torchops":
            return func(*args, **kwargs)
        out = getattr(references, name.split(".")[0])(*args, **kwargs)
        # An in-place op's reference returns the new values of the arguments
        # it writes: write them, as the op does.
        written = [a for a, arg in zip(args, func._schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        if not written:
            return out
        for tensor, value in zip(written, out):
            if isinstance(tensor, (list, tuple)):  # a Tensor(a!)[] list
                for t, v in zip(tensor, value):
                    t.copy_(v)
            else:
                tensor.copy_(value)
        return None


@dataclass
class Line:
    label: str
    args: Callable[[str, torch.dtype], tuple]   # (device, dtype) -> the call's arguments
    call: Callable                              # the public torchops call
    peer: Callable | None = None                # torchvision's, same arguments
    peer_name: str = ""


def _has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def _float64(args: tuple) -> tuple:
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _check(got: torch.Tensor, want: torch.Tensor) -> str:
    if not got.is_floating_point():
        return "identical" if torch.equal(got.cpu(), want.cpu().to(got.dtype)) else "DIFFERENT"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    return f"max|err|={err:.1e}"


def _time(fn: Callable, device: str) -> float:
    fn()  # untimed: allocations, lazy initialisation, compilation
    if device == "cuda":
        torch.cuda.synchronize()
    # Timer synchronises CUDA around its blocks.
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=MIN_RUN_TIME).median


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def _show(line: Line, device: str, dtype: torch.dtype = torch.float32) -> None:
    torch.manual_seed(0)
    args = line.args(device, dtype)
    with torch.no_grad():
        got = _first(line.call(*args))
        with ReferenceMode():
            want = _first(line.call(*_float64(args)))
        ours = _time(lambda: line.call(*args), device)
        if line.peer is not None:
            ref, ref_name = _time(lambda: line.peer(*args), device), line.peer_name
        else:
            def in_reference_mode():
                with ReferenceMode():
                    return line.call(*args)
            ref, ref_name = _time(in_reference_mode, device), "references"
    print(f"  {line.label:52s} {str(dtype)[6:]:8s} {_check(got, want):17s} "
          f"torchops {_ms(ours)}  {ref_name} {_ms(ref)} ({ref / ours:.1f}x)")


# --- inputs -----------------------------------------------------------------------------------

def _boxes(n: int, device: str, dtype: torch.dtype, size: float = 400.0) -> torch.Tensor:
    xy = torch.rand(n, 2) * size
    wh = torch.rand(n, 2) * size / 8 + 4
    return torch.cat([xy, xy + wh], 1).to(device, dtype)


def _rois(k: int, n_images: int, side: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """(k, 5) rows (batch index, x1, y1, x2, y2) inside a side x side image."""
    xy = torch.rand(k, 2) * side * 0.7
    wh = torch.rand(k, 2) * side * 0.3 + 2
    batch = torch.randint(0, n_images, (k, 1)).to(torch.float32)
    return torch.cat([batch, xy, xy + wh], 1).to(device, dtype)


def _rotated_boxes(n: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """(n, 5) rotated boxes (x_ctr, y_ctr, w, h, angle in degrees)."""
    b = _boxes(n, device, torch.float32)
    angle = torch.rand(n, 1) * 180 - 90
    return torch.cat([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2], angle.to(device)],
                     1).to(dtype)


def _lines() -> list[Line]:
    tv = _has_torchvision()
    if tv:
        import torchvision.ops as tvo

    def peer(fn, name):
        return dict(peer=fn, peer_name=name) if tv else {}

    def deform_args(dev, dt, mask=True):
        x = torch.randn(2, 16, 24, 24)
        w = torch.randn(32, 16, 3, 3) / 12
        off = torch.randn(2, 18, 24, 24)
        m = torch.rand(2, 9, 24, 24)
        return tuple(t.to(dev, dt) for t in (x, off, w, torch.randn(32), m))

    return [
        Line("matmul (256x384 @ 384x128)",
             lambda dev, dt: (torch.randn(256, 384, device=dev, dtype=dt),
                              torch.randn(384, 128, device=dev, dtype=dt)),
             torchops.matmul, peer=torch.matmul, peer_name="torch.matmul"),
        Line("matmul (8x64x32 @ 8x32x96, b transposed)",
             lambda dev, dt: (torch.randn(8, 64, 32, device=dev, dtype=dt),
                              torch.randn(8, 96, 32, device=dev, dtype=dt).transpose(1, 2)),
             torchops.matmul, peer=torch.matmul, peer_name="torch.matmul"),
        Line("d_sigmoid (2^20 elements)",
             lambda dev, dt: (torch.randn(1 << 20, device=dev, dtype=dt),), torchops.d_sigmoid),
        Line("nms (500 boxes, IoU 0.5)",
             lambda dev, dt: (_boxes(500, dev, dt), torch.rand(500, device=dev, dtype=dt), 0.5),
             torchops.nms, **peer(lambda *a: tvo.nms(*a), "torchvision")),
        Line("batched_nms (500 boxes, 5 classes)",
             lambda dev, dt: (_boxes(500, dev, dt), torch.rand(500, device=dev, dtype=dt),
                              torch.randint(0, 5, (500,), device=dev), 0.5),
             torchops.batched_nms, **peer(lambda *a: tvo.batched_nms(*a), "torchvision")),
        Line("nms_padded (500 boxes, IoU 0.5: static shapes)",
             lambda dev, dt: (_boxes(500, dev, dt), torch.rand(500, device=dev, dtype=dt), 0.5),
             torchops.nms_padded),
        Line("box_iou (300 x 200)",
             lambda dev, dt: (_boxes(300, dev, dt), _boxes(200, dev, dt)),
             torchops.box_iou, **peer(lambda *a: tvo.box_iou(*a), "torchvision")),
        Line("roi_align (64 RoIs on 2x64x50x50, 7x7)",
             lambda dev, dt: (torch.randn(2, 64, 50, 50, device=dev, dtype=dt),
                              _rois(64, 2, 50, dev, dt)),
             lambda x, r: torchops.roi_align(x, r, 7, 1.0, 2, True),
             **peer(lambda x, r: tvo.roi_align(x, r, 7, 1.0, 2, True), "torchvision")),
        Line("roi_pool (8 RoIs on 2x64x50x50, 7x7)",
             lambda dev, dt: (torch.randn(2, 64, 50, 50, device=dev, dtype=dt),
                              _rois(8, 2, 50, dev, dt)),
             lambda x, r: torchops.roi_pool(x, r, 7, 1.0),
             **peer(lambda x, r: tvo.roi_pool(x, r, 7, 1.0), "torchvision")),
        Line("deform_roi_pool (64 RoIs on 2x64x50x50, 7x7)",
             lambda dev, dt: (torch.randn(2, 64, 50, 50, device=dev, dtype=dt),
                              _rois(64, 2, 50, dev, dt),
                              torch.randn(64, 2, 7, 7, device=dev, dtype=dt)),
             lambda x, r, o: torchops.deform_roi_pool(x, r, o, 7, 1.0, 2, 0.1)),
        Line("sigmoid_focal_loss (4096x80, mean)",
             lambda dev, dt: (torch.randn(4096, 80, device=dev, dtype=dt),
                              (torch.rand(4096, 80) < 0.05).to(dev, dt)),
             lambda x, t: torchops.sigmoid_focal_loss(x, t, 0.25, 2.0, "mean"),
             **peer(lambda x, t: tvo.sigmoid_focal_loss(x, t, 0.25, 2.0, "mean"), "torchvision")),
        Line("deform_conv2d (2x16x24x24 -> 32, 3x3, DCNv2)",
             deform_args,
             lambda x, o, w, b, m: torchops.deform_conv2d(x, o, w, b, padding=1, mask=m),
             **peer(lambda x, o, w, b, m: tvo.deform_conv2d(x, o, w, b, padding=1, mask=m),
                    "torchvision")),
        Line("masked_conv2d (2x32x40x40 -> 32, 3x3, 25% selected)",
             lambda dev, dt: (torch.randn(2, 32, 40, 40, device=dev, dtype=dt),
                              torch.rand(2, 40, 40, device=dev) < 0.25,
                              torch.randn(32, 32, 3, 3, device=dev, dtype=dt) / 17,
                              torch.randn(32, device=dev, dtype=dt)),
             lambda x, m, w, b: torchops.masked_conv2d(x, m, w, b, padding=1)),
        Line("carafe (2x32x24x24, k 5, scale 2)",
             lambda dev, dt: (torch.randn(2, 32, 24, 24, device=dev, dtype=dt),
                              F.softmax(torch.randn(2, 25, 48, 48, device=dev, dtype=dt), 1)),
             lambda x, m: torchops.carafe(x, m, 5, 1, 2)),
        Line("rms_norm (2048x1024)", lambda dev, dt: rand(dev, dt, (2048, 1024), (1024,)),
             lambda x, w: torchops.rms_norm(x, (1024,), w, 1e-6),
             peer=lambda x, w: F.rms_norm(x, (1024,), w, 1e-6), peer_name="F.rms_norm"),
        Line("fused_add_rms_norm (2048x1024)",
             lambda dev, dt: rand(dev, dt, (2048, 1024), (2048, 1024), (1024,)),
             lambda x, r, w: torchops.fused_add_rms_norm(x, r, (1024,), w, 1e-6)),
        Line("fused_add_rms_norm_ (2048x1024, in place)",
             lambda dev, dt: rand(dev, dt, (2048, 1024), (2048, 1024), (1024,)),
             lambda x, r, w: _written(torchops.fused_add_rms_norm_, x, r, w, 1e-6)),
        Line("layer_norm (2048x1024)",
             lambda dev, dt: rand(dev, dt, (2048, 1024), (1024,), (1024,)),
             lambda x, w, b: torchops.layer_norm(x, (1024,), w, b),
             peer=lambda x, w, b: F.layer_norm(x, (1024,), w, b), peer_name="F.layer_norm"),
        Line("rotary_embedding (q 2x8x256x64, k 2 heads)",
             lambda dev, dt: rand(dev, dt, (2, 8, 256, 64), (2, 2, 256, 64), (2, 256, 64),
                                  (2, 256, 64)),
             torchops.rotary_embedding),
        Line("rotary_embedding_ (512 tokens, q 8 heads, k 2, in place)",
             lambda dev, dt: (torch.randint(0, 1024, (512,), device=dev),
                              *rand(dev, dt, (512, 8, 64), (512, 2, 64), (1024, 64))),
             lambda p, q, k, cache: _written(torchops.rotary_embedding_, p, q, k, cache)),
        Line("silu_and_mul (1024x4096)", lambda dev, dt: rand(dev, dt, (1024, 4096)),
             torchops.silu_and_mul),
        Line("gelu_and_mul (1024x4096, tanh)", lambda dev, dt: rand(dev, dt, (1024, 4096)),
             lambda x: torchops.gelu_and_mul(x, "tanh")),
        Line("scaled_masked_softmax (2x4x128x128, padding mask)",
             lambda dev, dt: (*rand(dev, dt, (2, 4, 128, 128)),
                              torch.arange(128, device=dev).expand(2, 1, 128, 128)
                              >= torch.tensor([96, 128], device=dev).view(2, 1, 1, 1)),
             lambda x, m: torchops.scaled_masked_softmax(x, m, 0.125)),
        Line("scaled_upper_triang_masked_softmax (2x4x128x128)",
             lambda dev, dt: rand(dev, dt, (2, 4, 128, 128)),
             lambda x: torchops.scaled_upper_triang_masked_softmax(x, 0.125)),
        # optim
        Line("fused_adam_ (an AdamW step of 1M parameters)",
             lambda dev, dt: rand(dev, dt, (1 << 20,), (1 << 20,), (1 << 20,), (1 << 20,)),
             _adamw_step),
        Line("fused_sgd_ (an SGD step with momentum, 1M parameters)",
             lambda dev, dt: rand(dev, dt, (1 << 20,), (1 << 20,), (1 << 20,)),
             _sgd_step),
        # optim: multi_tensor_l2norm, multi_tensor_scale_
        Line("multi_tensor_l2norm (20 tensors of 64k)",
             lambda dev, dt: rand(dev, dt, *([(1 << 16,)] * 20)),
             lambda *ts: torchops.multi_tensor_l2norm(list(ts))[0],
             peer=lambda *ts: torch.nn.utils.get_total_norm(ts),
             peer_name="get_total_norm"),
        Line("multi_tensor_scale_ (20 tensors of 64k, in place)",
             lambda dev, dt: rand(dev, dt, *([(1 << 16,)] * 20)),
             lambda *ts: _scaled_copies(ts, 0.5)),
        # losses: fused linear cross-entropy
        Line("fused_linear_cross_entropy (512 tokens, 256 -> 8000 classes)",
             lambda dev, dt: (torch.randn(512, 256, device=dev, dtype=dt),
                              torch.randn(8000, 256, device=dev, dtype=dt) / 16,
                              torch.randint(0, 8000, (512,), device=dev)),
             torchops.fused_linear_cross_entropy,
             peer=lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t),
             peer_name="F.cross_entropy(F.linear)"),
        # detection: multi-scale deformable attention
        Line("ms_deform_attn (2 images, 4 levels 40x60..5x8, 8 heads x 32, 300 queries)",
             lambda dev, dt: _msda_args(dev, dt, 300), torchops.ms_deform_attn),
        # detection: rotated boxes and soft-NMS
        Line("box_iou_rotated (300 x 200)",
             lambda dev, dt: (_rotated_boxes(300, dev, dt), _rotated_boxes(200, dev, dt)),
             torchops.box_iou_rotated),
        Line("nms_rotated (300 boxes, IoU 0.5)",
             lambda dev, dt: (_rotated_boxes(300, dev, dt), torch.rand(300, device=dev, dtype=dt),
                              0.5),
             torchops.nms_rotated),
        Line("batched_nms_rotated (300 boxes, 5 classes)",
             lambda dev, dt: (_rotated_boxes(300, dev, dt), torch.rand(300, device=dev, dtype=dt),
                              torch.randint(0, 5, (300,), device=dev), 0.5),
             torchops.batched_nms_rotated),
        Line("soft_nms (300 boxes, gaussian)",
             lambda dev, dt: (_boxes(300, dev, dt), torch.rand(300, device=dev, dtype=dt)),
             torchops.soft_nms),
    ]


def rand(device: str, dtype: torch.dtype, *shapes) -> tuple:
    return tuple(torch.randn(s, device=device, dtype=dtype) for s in shapes)


def _adamw_step(p, g, m, v):
    """One AdamW step of fused_adam_ on copies of a parameter and its
    state; returns the new parameter."""
    p, m, v = p.clone(), m.clone(), v.abs()
    step = torch.ones((), device=p.device)
    torchops.fused_adam_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
                         adamw=True)
    return p


def _sgd_step(p, g, buf):
    """One Nesterov SGD step of fused_sgd_ on copies of a parameter and its
    momentum buffer; returns the new parameter."""
    p, buf = p.clone(), buf.clone()
    torchops.fused_sgd_([p], [g], [buf], weight_decay=1e-4, momentum=0.9, lr=1e-2,
                        dampening=0.0, nesterov=True, maximize=False, is_first_step=False)
    return p
def _scaled_copies(tensors: tuple, scale: float):
    """multi_tensor_scale_ on copies of the tensors; returns the first."""
    copies = [t.clone() for t in tensors]
    torchops.multi_tensor_scale_(copies, scale)
    return copies[0]


def _written(op: Callable, *args):
    """Calls an in-place op on copies of its tensor arguments and returns
    the first one it wrote."""
    copies = [a.clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    op(*copies)
    return next(c for c, a in zip(copies, args) if c is not a)


def _msda_args(dev: str, dt: torch.dtype, queries: int) -> tuple:
    """Deformable DETR's attention inputs over 4 levels (torchops.bench.inputs')."""
    from torchops.bench import inputs

    torch.manual_seed(0)
    args = inputs.ms_deform_attn_args({"levels": [(40, 60), (20, 30), (10, 15), (5, 8)], "b": 2,
                                       "q": queries, "heads": 8, "c": 32, "points": 4})
    return tuple(a.to(dev, dt) if a.is_floating_point() else a.to(dev) for a in args)


def _msda_module_args(dev: str, dt: torch.dtype) -> tuple:
    """MultiScaleDeformableAttention's positional call: 300 queries at random
    reference points on every level of a 2-image, 4-level memory."""
    value, shapes, starts, _, _ = _msda_args(dev, dt, 1)
    memory = torch.randn(2, value.shape[1], 256, device=dev, dtype=dt)
    query = torch.randn(2, 300, 256, device=dev, dtype=dt)
    ref = torch.rand(2, 300, 4, 2, device=dev, dtype=dt)
    return query, None, memory, None, None, None, ref, shapes, starts


def _module_lines(device: str) -> list[Line]:
    """Every module of torchops.modules, its parameters initialised as in the
    library it replaces; float64 copies compute the reference."""
    torch.manual_seed(0)
    m = torchops
    x_roi = lambda dev, dt: (torch.randn(2, 16, 32, 32, device=dev, dtype=dt),  # noqa: E731
                             _rois(8, 2, 32, dev, dt))
    mods = [
        ("RoIAlign(7, 0.5, 2, aligned=True)", m.RoIAlign(7, 0.5, 2, aligned=True), x_roi),
        ("RoIPool(7, 0.5)", m.RoIPool(7, 0.5), x_roi),
        ("DeformConv2d(16, 32, 3, padding=1)", m.DeformConv2d(16, 32, 3, padding=1),
         lambda dev, dt: (torch.randn(2, 16, 24, 24, device=dev, dtype=dt),
                          torch.randn(2, 18, 24, 24, device=dev, dtype=dt))),
        ("ModulatedDeformConv2dPack(16, 32, 3, padding=1)",
         m.ModulatedDeformConv2dPack(16, 32, 3, padding=1),
         lambda dev, dt: (torch.randn(2, 16, 24, 24, device=dev, dtype=dt),)),
        ("DeformRoIPool(7, 0.5)", m.DeformRoIPool(7, 0.5), x_roi),
        ("DeformRoIPoolPack(7, 16)", m.DeformRoIPoolPack(7, 16), x_roi),
        ("ModulatedDeformRoIPoolPack(7, 16)", m.ModulatedDeformRoIPoolPack(7, 16), x_roi),
        ("MaskedConv2d(32, 32, 3, padding=1)", m.MaskedConv2d(32, 32, 3, padding=1),
         lambda dev, dt: (torch.randn(2, 32, 40, 40, device=dev, dtype=dt),
                          torch.rand(2, 40, 40, device=dev) < 0.25)),
        ("CARAFEPack(32, 2)", m.CARAFEPack(32, 2),
         lambda dev, dt: (torch.randn(2, 32, 24, 24, device=dev, dtype=dt),)),
        ("RMSNorm(1024)", m.RMSNorm(1024), lambda dev, dt: rand(dev, dt, (2048, 1024))),
        ("LayerNorm(1024)", m.LayerNorm(1024), lambda dev, dt: rand(dev, dt, (2048, 1024))),
        # losses: fused linear cross-entropy
        ("FusedLinearCrossEntropyLoss(softcap=30.0)", m.FusedLinearCrossEntropyLoss(softcap=30.0),
         lambda dev, dt: (torch.randn(8000, 256, device=dev, dtype=dt) / 16,
                          torch.randn(512, 256, device=dev, dtype=dt),
                          torch.randint(0, 8000, (512,), device=dev))),
        # detection: multi-scale deformable attention
        ("MultiScaleDeformableAttention(256, dropout=0.0, batch_first=True)",
         m.MultiScaleDeformableAttention(256, dropout=0.0, batch_first=True),
         _msda_module_args),
    ]
    assert {type(mod).__name__ for _, mod, _ in mods} == set(torchops.modules.__all__), \
        "the demo lists every module of torchops.modules"
    lines = []
    for label, mod, args in mods:
        mod = mod.to(device)
        mod64 = copy.deepcopy(mod).double()

        def call(*a, mod=mod, mod64=mod64):
            floating = [t for t in a if isinstance(t, torch.Tensor) and t.is_floating_point()]
            return (mod64 if floating and floating[0].dtype == torch.float64 else mod)(*a)
        lines.append(Line(label, args, call))
    return lines


def run(device: str | None = None) -> None:
    devices = [device] if device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    reference = ("torchvision where installed, else torchops.references"
                 if _has_torchvision() else "torchops.references (torchvision is not installed)")
    print(f"torchops {torchops.__version__} on torch {torch.__version__}.\n"
          f"max|err|: against the float64 formulas of torchops.references.  Times: steady "
          f"state (median of torch.utils.benchmark's blocked_autorange) of torchops and of the "
          f"reference, {reference}; (Nx): the reference's time over torchops's.")
    for dev in devices:
        print(f"device {dev}: ops")
        for line in _lines():
            _show(line, dev)
        _show(_lines()[0], dev, torch.bfloat16)
        print(f"device {dev}: modules (torchops.modules)")
        for line in _module_lines(dev):
            _show(line, dev)
