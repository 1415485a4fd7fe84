"""Peers of the transformer ops: PyTorch's native op and Liger-Kernel; and of
the multi-tensor optimizer ops: PyTorch's own steps (:func:`torch_optim`).

Each factory returns a :class:`~torchops.bench.cases.Peer` whose callable
takes the torchops op's own arguments (its schema's order, as a case's input
factory returns them) and calls the peer's public API, so a case gets it with
``peers=(peers.torch_native("rms_norm"), peers.liger("rms_norm"))``, or every
case of an op gets every peer known for it with :func:`attach`.

Nothing is imported until a run loads the peer: an absent package (or, for
Liger, an absent Triton) is an ImportError, which the runner reports as "not
installed" and skips, as it does torchvision's.  Liger's kernels are Triton's,
so its peers are CUDA-only (``devices=("cuda",)``): CPU rows do not list them.

Liger's calls, per op (liger_kernel's public ``transformers.functional``
functions and ``transformers.rope.liger_rotary_pos_emb``):

* rms_norm: ``liger_rms_norm(x, w, eps, offset=0, casting_mode="llama",
  in_place=False)``: Llama's casting (what Liger's Llama patch runs);
  ``in_place=False`` because the bench reuses one output gradient for every
  call, which ``in_place=True`` would overwrite with dX.
* fused_add_rms_norm: ``liger_fused_add_rms_norm``, same settings; it needs a
  weight: ones where the op gets None.
* layer_norm: ``liger_layer_norm(x, w, b, eps)``; ones / zeros where the op
  gets None.
* Norms over several trailing dimensions are flattened to one (a view).
* rotary_embedding: ``liger_rotary_pos_emb(q, k, cos, sin)``: halves only
  (``interleaved=True`` raises), q and k in (B, H, S, D) order
  (``unsqueeze_dim=2``, the (B, S, H, D) layout, is transposed to it and back:
  views).  Liger writes the result into q and k where their memory is (B, S,
  H, D) (a projection's output viewed as heads), and copies them first
  otherwise: it does what it does for a Llama model.
* silu_and_mul / gelu_and_mul: ``liger_swiglu(a, b)`` / ``liger_geglu(a, b)``
  on the two halves of x; Liger makes both contiguous (copies), as its
  kernels take a separate gate and up projection.  Liger's GEGLU always
  computes the tanh approximation of GELU.
* fused_linear_cross_entropy: ``LigerFusedLinearCrossEntropyLoss(ignore_index=...,
  label_smoothing=..., reduction=..., lse_square_scale=..., softcap=...)``
  (one module per setting), called as ``loss(weight, input, target, bias)``
  with the tokens flattened; where a version returns a tuple or a record, its
  loss.
* scaled_masked_softmax, scaled_upper_triang_masked_softmax:
  ``liger_softmax(x)``, the plain row softmax of the same scores without
  scale or mask: a bound (not compared; never a row's best), as Liger has no
  masked softmax.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:
    from torchops.bench.cases import Case, Peer

# cases.py is imported by the factories, not here: cases.py may import this
# module at its end (to attach peers to its cases) without a cycle.

__all__ = ["torch_native", "liger", "for_op", "attach", "TORCH_NATIVE_OPS", "LIGER_OPS",
           "torch_optim"]


def _norm_shape(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _rms_eps(x: torch.Tensor, eps: float | None) -> float:
    """The op's rule: eps=None means the input dtype's machine epsilon."""
    return torch.finfo(x.dtype).eps if eps is None else eps


def _flat(x: torch.Tensor, normalized_shape, *params: torch.Tensor | None):
    """x with its normalised dimensions merged into one (a view where the
    layout allows), and each parameter flattened to match."""
    k = len(_norm_shape(normalized_shape))
    if k == 1:
        return (x, *params)
    n = math.prod(x.shape[x.dim() - k:])
    return (x.reshape(*x.shape[:x.dim() - k], n),
            *(None if p is None else p.reshape(n) for p in params))


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


# --- PyTorch's native ops ------------------------------------------------------------------------

def _native_rms_norm():
    import torch.nn.functional as F

    return lambda input, normalized_shape, weight=None, eps=None: F.rms_norm(
        input, list(_norm_shape(normalized_shape)), weight, eps)


def _native_layer_norm():
    import torch.nn.functional as F

    return lambda input, normalized_shape, weight=None, bias=None, eps=1e-5: F.layer_norm(
        input, list(_norm_shape(normalized_shape)), weight, bias, eps)


def _native_fused_add_rms_norm():
    import torch.nn.functional as F

    def call(input, residual, normalized_shape, weight=None, eps=None):
        s = input + residual
        return F.rms_norm(s, list(_norm_shape(normalized_shape)), weight, eps), s
    return call


# op -> (label, name, loader)
_TORCH_NATIVE: dict[str, tuple[str, str, Callable[[], Callable]]] = {
    "rms_norm": ("F.rms_norm", "torch.nn.functional.rms_norm", _native_rms_norm),
    "layer_norm": ("F.layer_norm", "torch.nn.functional.layer_norm", _native_layer_norm),
    "fused_add_rms_norm": ("F.rms_norm(x+r)", "torch.nn.functional.rms_norm(input + residual)",
                           _native_fused_add_rms_norm),
}
TORCH_NATIVE_OPS = tuple(_TORCH_NATIVE)


def torch_native(op: str) -> Peer:
    """PyTorch's own op for `op` (``F.rms_norm``, ``F.layer_norm``; for
    fused_add_rms_norm, ``F.rms_norm`` of the sum), on every device."""
    if op not in _TORCH_NATIVE:
        raise ValueError(f"no PyTorch-native peer for {op!r}; known: {sorted(_TORCH_NATIVE)}")
    from torchops.bench.cases import Peer

    label, name, load = _TORCH_NATIVE[op]
    return Peer(name, load, label=label)


# --- Liger-Kernel --------------------------------------------------------------------------------

def _liger_import(module: str, *names: str) -> tuple:
    """liger_kernel's `names` from `module`; any failure while importing it
    (no package, no Triton, an incompatible Triton) is an ImportError, which
    the runner reports as the peer not being installed."""
    import importlib

    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001  (a broken install reads as absent, with its cause)
        raise ImportError(f"importing {module} failed: {type(e).__name__}: {e}") from e


_FUNCTIONAL = "liger_kernel.transformers.functional"


def _liger_rms_norm():
    (f,) = _liger_import(_FUNCTIONAL, "liger_rms_norm")

    def call(input, normalized_shape, weight=None, eps=None):
        x, w = _flat(input, normalized_shape, weight)
        return f(x, w, _rms_eps(input, eps), 0.0, "llama", False).view(input.shape)
    return call


def _liger_fused_add_rms_norm():
    (f,) = _liger_import(_FUNCTIONAL, "liger_fused_add_rms_norm")

    def call(input, residual, normalized_shape, weight=None, eps=None):
        x, w = _flat(input, normalized_shape, weight)
        r = residual.reshape(x.shape)
        if w is None:
            w = torch.ones(x.shape[-1], dtype=input.dtype, device=input.device)
        y, s = f(x, r, w, _rms_eps(input, eps), 0.0, "llama", False)
        return y.view(input.shape), s.view(input.shape)
    return call


def _liger_layer_norm():
    (f,) = _liger_import(_FUNCTIONAL, "liger_layer_norm")

    def call(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        x, w, b = _flat(input, normalized_shape, weight, bias)
        n = x.shape[-1]
        w = torch.ones(n, dtype=input.dtype, device=input.device) if w is None else w
        b = torch.zeros(n, dtype=w.dtype, device=input.device) if b is None else b
        return f(x, w, b, eps).view(input.shape)
    return call


def _liger_rotary():
    (f,) = _liger_import("liger_kernel.transformers.rope", "liger_rotary_pos_emb")

    def call(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
        if interleaved:
            raise NotImplementedError("Liger's rotary rotates halves only (interleaved=False)")
        if unsqueeze_dim == 1:           # (B, H, S, D): Liger's order
            return f(q, k, cos, sin)
        if unsqueeze_dim == 2:           # (B, S, H, D): the same call on transposed views
            qo, ko = f(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)
        raise NotImplementedError(f"Liger's rotary takes q and k as (B, H, S, D) or "
                                  f"(B, S, H, D); unsqueeze_dim={unsqueeze_dim}")
    return call


def _liger_gated(fn_name: str):
    def load():
        (f,) = _liger_import(_FUNCTIONAL, fn_name)

        def call(x, *_approximate):
            return f(*_halves(x))
        return call
    return load


def _liger_softmax_bound():
    (f,) = _liger_import(_FUNCTIONAL, "liger_softmax")
    return lambda input, *_mask_and_scale: f(input)


def _liger_fused_linear_cross_entropy():
    (loss_cls,) = _liger_import("liger_kernel.transformers.fused_linear_cross_entropy",
                                "LigerFusedLinearCrossEntropyLoss")
    modules: dict[tuple, torch.nn.Module] = {}

    def call(input, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
             reduction="mean", lse_square_scale=0.0, softcap=None):
        key = (ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
        if key not in modules:  # one module per setting, built outside the timed calls
            modules[key] = loss_cls(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                    reduction=reduction, lse_square_scale=lse_square_scale,
                                    softcap=softcap)
        out = modules[key](weight, input.reshape(-1, input.shape[-1]), target.reshape(-1), bias)
        if isinstance(out, (tuple, list)):  # (loss, z_loss, ...) in some versions
            out = out[0]
        out = getattr(out, "loss", out)     # an output record in others
        return out.reshape(target.shape) if reduction == "none" else out
    return call


_LIGER_CALL = "liger_kernel.transformers.functional."
# op -> (name, loader, bound)
_LIGER: dict[str, tuple[str, Callable[[], Callable], bool]] = {
    "rms_norm": (_LIGER_CALL + "liger_rms_norm (casting_mode='llama')", _liger_rms_norm, False),
    "fused_add_rms_norm": (_LIGER_CALL + "liger_fused_add_rms_norm (casting_mode='llama')",
                           _liger_fused_add_rms_norm, False),
    "layer_norm": (_LIGER_CALL + "liger_layer_norm", _liger_layer_norm, False),
    "rotary_embedding": ("liger_kernel.transformers.rope.liger_rotary_pos_emb (in place where "
                         "q, k are (B, S, H, D) in memory)", _liger_rotary, False),
    "silu_and_mul": (_LIGER_CALL + "liger_swiglu (LigerSiLUMulFunction; copies the halves "
                     "of x)", _liger_gated("liger_swiglu"), False),
    "gelu_and_mul": (_LIGER_CALL + "liger_geglu (LigerGELUMulFunction: tanh GELU; copies the "
                     "halves of x)", _liger_gated("liger_geglu"), False),
    "scaled_masked_softmax": (_LIGER_CALL + "liger_softmax of the unscaled, unmasked scores",
                              _liger_softmax_bound, True),
    "scaled_upper_triang_masked_softmax": (
        _LIGER_CALL + "liger_softmax of the unscaled, unmasked scores (the whole square)",
        _liger_softmax_bound, True),
    "fused_linear_cross_entropy": (
        "liger_kernel.transformers.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyLoss "
        "(gradients computed in the forward, chunked over tokens)",
        _liger_fused_linear_cross_entropy, False),
}
LIGER_OPS = tuple(_LIGER)


def liger(op: str) -> Peer:
    """Liger-Kernel's kernel for `op` (CUDA only), called with the op's
    arguments; for the two masked softmaxes, Liger's plain softmax as a bound."""
    if op not in _LIGER:
        raise ValueError(f"no Liger-Kernel peer for {op!r}; known: {sorted(_LIGER)}")
    from torchops.bench.cases import Peer

    name, load, bound = _LIGER[op]
    return Peer(name, load, label="Liger", devices=("cuda",), bound=bound)


def for_op(op: str) -> tuple[Peer, ...]:
    """Every peer known for `op`: PyTorch's native op, then Liger's."""
    return tuple(make(op) for make, known in ((torch_native, _TORCH_NATIVE), (liger, _LIGER))
                 if op in known)


def attach(cases: Iterable[Case], ops: Iterable[str] | None = None) -> None:
    """Give every case whose op is in `ops` (default: every op with a peer
    here) the peers :func:`for_op` knows, after its own; a peer whose label
    or name the case already has is left out."""
    ops = set(TORCH_NATIVE_OPS + LIGER_OPS if ops is None else ops)
    for case in cases:
        if case.op in ops:
            have = {x for p in case.all_peers() for x in (p.label, p.name)}
            case.peers += tuple(p for p in for_op(case.op)
                                if p.label not in have and p.name not in have)


# --- PyTorch's optimizer steps and multi-tensor ops -------------------------------------------
#
# Each adapter takes the torchops op's arguments (its lists, then its
# keyword-only hyper-parameters) and calls PyTorch's own implementation on
# the same tensors, in place.  Float32 master parameters have no PyTorch
# counterpart: an adapter given them raises NotImplementedError (the cases
# with masters declare no peer).

def _no_masters(what: str, master_params) -> None:
    if master_params is not None:
        raise NotImplementedError(f"{what} has no float32 master parameters")


def _torch_fused_adam():
    """``torch._fused_adamw_`` / ``torch._fused_adam_``: the kernel that
    ``torch.optim.AdamW(fused=True)`` calls, with the op's semantics (step
    counts on the parameters' device, already incremented)."""
    def call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
             beta2, eps, weight_decay, amsgrad, maximize, adamw, master_params=None,
             grad_scale=None, found_inf=None):
        _no_masters("torch's fused Adam", master_params)
        (torch._fused_adamw_ if adamw else torch._fused_adam_)(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr,
            beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
            maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
    return call


def _torch_optim_adam(foreach: bool):
    """``torch.optim.adamw.adamw`` / ``torch.optim.adam.adam`` (the step of
    ``AdamW(foreach=...)``), which keeps non-fused step counts on the CPU and
    increments them before the update: the adapter keeps CPU counts per
    ``state_steps`` list, one below the op's (the op's list holds the count
    after the increment), so the first call steps as the op does; later
    calls count on (the benchmark's repeated steps)."""
    from torch.optim import adam, adamw as adamw_mod

    cpu_steps: dict[int, tuple[list, list]] = {}

    def call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
             beta2, eps, weight_decay, amsgrad, maximize, adamw, master_params=None,
             grad_scale=None, found_inf=None):
        _no_masters("torch.optim's Adam", master_params)
        if id(state_steps) not in cpu_steps:  # the list is kept: its id is not reused
            cpu_steps[id(state_steps)] = (state_steps, [s.detach().to("cpu", copy=True) - 1
                                                        for s in state_steps])
        steps = cpu_steps[id(state_steps)][1]
        (adamw_mod.adamw if adamw else adam.adam)(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=foreach,
            grad_scale=grad_scale, found_inf=found_inf, amsgrad=amsgrad, beta1=beta1,
            beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)
    return call


def _torch_fused_sgd():
    """``torch._fused_sgd_``: the kernel of ``torch.optim.SGD(fused=True)``,
    with the op's arguments."""
    def call(params, grads, momentum_buffer_list, *, master_params=None, grad_scale=None,
             found_inf=None, **hyper):
        _no_masters("torch's fused SGD", master_params)
        torch._fused_sgd_(params, grads, momentum_buffer_list, grad_scale=grad_scale,
                          found_inf=found_inf, **hyper)
    return call


def _torch_optim_sgd(foreach: bool):
    """``torch.optim.sgd.sgd`` (the step of ``SGD(foreach=...)``) on the same
    buffers."""
    from torch.optim import sgd

    def call(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
             nesterov, maximize, is_first_step, master_params=None, grad_scale=None,
             found_inf=None):
        _no_masters("torch.optim's SGD", master_params)
        bufs = [None] * len(params) if is_first_step else list(momentum_buffer_list)
        sgd.sgd(params, grads, bufs, foreach=foreach, grad_scale=grad_scale,
                found_inf=found_inf, weight_decay=weight_decay, momentum=momentum, lr=lr,
                dampening=dampening, nesterov=nesterov, maximize=maximize)
    return call


def _torch_total_norm():
    from torch.nn.utils import get_total_norm

    def call(tensors, per_tensor=False):
        if per_tensor:
            raise NotImplementedError("get_total_norm gives the total norm only")
        return get_total_norm(tensors, 2.0, foreach=True)
    return call


def _torch_foreach_mul():
    return lambda tensors, scale: torch._foreach_mul_(tensors, scale)


# (op, implementation) -> (label, name, loader, devices)
_TORCH_OPTIM: dict[tuple[str, str], tuple[str, str, Callable[[], Callable], tuple | None]] = {
    ("fused_adam_", "fused"): ("fused", "torch._fused_adamw_ (the kernel of "
                               "torch.optim.AdamW(fused=True))", _torch_fused_adam, None),
    ("fused_adam_", "foreach"): ("foreach", "torch.optim.adamw.adamw(foreach=True) (the step of "
                                 "AdamW(foreach=True); step counts on the CPU)",
                                 lambda: _torch_optim_adam(True), None),
    ("fused_adam_", "for-loop"): ("for-loop", "torch.optim.adamw.adamw(foreach=False) (the "
                                  "for-loop step of AdamW(foreach=False))",
                                  lambda: _torch_optim_adam(False), ("cpu",)),
    ("fused_sgd_", "fused"): ("fused", "torch._fused_sgd_ (the kernel of "
                              "torch.optim.SGD(fused=True))", _torch_fused_sgd, None),
    ("fused_sgd_", "foreach"): ("foreach", "torch.optim.sgd.sgd(foreach=True) (the step of "
                                "SGD(foreach=True))", lambda: _torch_optim_sgd(True), None),
    ("fused_sgd_", "for-loop"): ("for-loop", "torch.optim.sgd.sgd(foreach=False) (the for-loop "
                                 "step of SGD(foreach=False))", lambda: _torch_optim_sgd(False),
                                 ("cpu",)),
    ("multi_tensor_l2norm", "foreach"): ("get_total_norm", "torch.nn.utils.get_total_norm("
                                         "foreach=True)", _torch_total_norm, None),
    ("multi_tensor_scale_", "foreach"): ("_foreach_mul_", "torch._foreach_mul_",
                                         _torch_foreach_mul, None),
}


def torch_optim(op: str) -> tuple[Peer, ...]:
    """PyTorch's implementations of a multi-tensor op, each a peer taking the
    op's arguments: for fused_adam_ the fused kernel, the foreach step and
    (CPU only: a loop of hundreds of launches on a GPU) the for-loop step;
    get_total_norm for multi_tensor_l2norm; _foreach_mul_ for
    multi_tensor_scale_."""
    from torchops.bench.cases import Peer

    found = tuple(Peer(name, load, label=label, devices=devices)
                  for (o, _), (label, name, load, devices) in _TORCH_OPTIM.items() if o == op)
    if not found:
        raise ValueError(f"no PyTorch optimizer peer for {op!r}; known: "
                         f"{sorted({o for o, _ in _TORCH_OPTIM})}")
    return found
