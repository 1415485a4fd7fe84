"""Optimizers on torchops' fused kernels.

``Adam`` and ``AdamW`` are ``torch.optim.Adam`` / ``torch.optim.AdamW``
subclasses with the same arguments and defaults, plus ``master_weights``.
Their ``step()`` calls ``torchops.fused_adam_`` once per (device, dtype) of
the parameters that have gradients; everything else -- param groups, the
state's keys and layout (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), ``state_dict()`` / ``load_state_dict()`` -- is
torch.optim's, so a state saved by one loads into the other and continues
the same run.  ``step`` is kept as torch's fused optimizers keep it: a
float32 tensor on the parameter's device.

With ``master_weights=True``, float16 and bfloat16 parameters get a float32
copy (state key ``master_param``) and float32 moments; each step updates the
copy and writes it, rounded, into the parameter.  A torch.optim state loaded
into such an optimizer gets its moments converted to float32 and, without a
saved copy, a master made from the parameter.

``torch.amp.GradScaler`` hands these optimizers its scale and inf flag (as
it does to torch's fused ones): the gradients are unscaled inside the step,
and a step with an inf or NaN gradient leaves parameters, states and steps
unchanged.

``HybridAdam`` is ColossalAI's optimizer of that name on the same step: its
arguments and defaults (``adamw_mode=True``, ``bias_correction``,
``step(div_scale=...)``), CPU parameters stepped by the CPU kernel and CUDA
parameters by the CUDA kernel in one optimizer.

Every step makes one ``fused_adam_`` call per (device, parameter dtype,
gradient dtype, master copy, DTensor) of a param group.  Parameters that are
DTensors (FSDP2's ``fully_shard``) are stepped on their local shards; their
states are DTensors with the parameter's placements, so a distributed
checkpoint saves and loads them sharded.  The step is written for
``torch.compile(fullgraph=True)``: the state is made in ``_init_group``,
which dynamo runs eagerly as it does for torch.optim's optimizers, and an
``lr`` tensor is read by the kernel, so changing it recompiles nothing.
"""

from __future__ import annotations

from collections import defaultdict

import math
import sys

import torch
from torch import Tensor

from . import ops

__all__ = ["Adam", "AdamW", "HybridAdam"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _dtensor_type():
    """DTensor's class when its module is loaded (no parameter can be one
    otherwise; importing it here would slow ``import torchops``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


class _FusedAdam:
    """The step and the state handling that Adam and AdamW share."""

    master_weights: bool
    # Whether a gradient whose dtype is not its parameter's (without a master
    # copy) is converted for the step; otherwise fused_adam_ rejects it.
    _converts_grads = False

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype in _LOW_PRECISION

    def _param_state(self, p: Tensor, group: dict) -> dict:
        """p's state, made (zeros, step 0) or brought to this optimizer's
        layout: a float32 step on p's device, float32 moments and a master
        copy for a master-weight parameter."""
        state = self.state[p]
        master = self._uses_master(p)
        sdtype = torch.float32 if master else p.dtype
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=sdtype,
                                                memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype,
                                                   memory_format=torch.preserve_format)
        step = state["step"]
        if not torch.is_tensor(step):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.device != p.device or step.dtype != torch.float32:
            state["step"] = step.to(device=p.device, dtype=torch.float32)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"],
                                                       memory_format=torch.preserve_format)
        for key in _MOMENTS:
            if key in state and state[key].dtype != sdtype:
                state[key] = state[key].to(sdtype)
        if master:
            m = state.get("master_param")
            if m is None:
                state["master_param"] = p.detach().to(torch.float32, copy=True)
            elif m.dtype != torch.float32 or m.device != p.device:
                state["master_param"] = m.to(device=p.device, dtype=torch.float32)
        return state

    def _name(self) -> str:
        return f"torchops.optim.{type(self).__name__}"

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                    state_steps, master_params):
        """Fills the lists (empty on entry) with the group's parameters that
        have gradients, their gradients and states (made or converted here),
        ordered by fused_adam_ call, and returns the calls: a tuple of
        (start, stop, master, dtensor, convert), the list slice of each call
        and how its tensors are passed.

        Dynamo runs a method of this name eagerly, outside the graph, and
        hands the traced step the filled lists (the state is made once, not
        traced); so the lists hold only parameters, gradients and states,
        and the return value only Python constants."""
        dtensor_type = _dtensor_type()
        members: dict[tuple, list[tuple[Tensor, dict]]] = {}
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            if grad.layout != torch.strided:
                raise RuntimeError(
                    f"{self._name()}: the gradient of parameter {i} of its param group has "
                    f"layout {grad.layout}; torchops.fused_adam_ takes dense gradients only "
                    f"(sparse gradients are not supported)")
            dtensor = dtensor_type is not None and isinstance(p, dtensor_type)
            if dtensor and not isinstance(grad, dtensor_type):
                raise RuntimeError(
                    f"{self._name()}: parameter {i} of its param group is a DTensor but its "
                    f"gradient is a {type(grad).__name__}")
            state = self._param_state(p, group)
            if dtensor and not all(isinstance(state[k], dtensor_type)
                                   for k in (*_MOMENTS, "master_param") if k in state):
                raise RuntimeError(
                    f"{self._name()}: parameter {i} of its param group is a DTensor but its "
                    f"state is not (load DTensor states, e.g. with "
                    f"torch.distributed.checkpoint.state_dict.set_state_dict)")
            master = self._uses_master(p)
            convert = self._converts_grads and not master and grad.dtype != p.dtype
            key = (p.device, p.dtype, grad.dtype, master, dtensor, convert)
            members.setdefault(key, []).append((p, state))
        calls = []
        for (_, _, _, master, dtensor, convert), items in members.items():
            start = len(params)
            for p, state in items:
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                state_steps.append(state["step"])
                if master:
                    master_params.append(state["master_param"])
            calls.append((start, len(params), master, dtensor, convert))
        return tuple(calls)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see torch.optim.Adam.step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fused_step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def _fused_step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """fused_adam_ over every param group: one call per device and dtype."""
        adamw_default = isinstance(self, torch.optim.AdamW)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            max_exp_avg_sqs: list[Tensor] = []
            state_steps: list[Tensor] = []
            master_params: list[Tensor] = []
            calls = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs,
                                     max_exp_avg_sqs, state_steps, master_params)
            beta1, beta2 = group["betas"]
            adamw = bool(group.get("decoupled_weight_decay", adamw_default))
            amsgrad = bool(group["amsgrad"])
            # master_params holds the master calls' masters only, in call order.
            m_start = 0
            for start, stop, master, dtensor, convert in calls:
                n = stop - start
                lists = [params[start:stop], grads[start:stop], exp_avgs[start:stop],
                         exp_avg_sqs[start:stop],
                         max_exp_avg_sqs[start:stop] if amsgrad else []]
                masters = None
                if master:
                    masters = master_params[m_start:m_start + n]
                    m_start += n
                if dtensor:
                    # FSDP2: the step is elementwise, so each rank steps its
                    # shards; the DTensors share their local tensors' storage.
                    lists = [[t.to_local() for t in ts] for ts in lists]
                    if masters is not None:
                        masters = [t.to_local() for t in masters]
                if convert:
                    lists[1] = [g.to(lists[0][0].dtype) for g in lists[1]]
                steps = state_steps[start:stop]
                device = lists[0][0].device
                lr = group["lr"]
                if torch.is_tensor(lr):
                    lr = lr.to(device=device, dtype=torch.float32)
                scale = None if grad_scale is None else grad_scale.to(device, torch.float32)
                inf = None if found_inf is None else found_inf.to(device, torch.float32)
                # torch.optim's fused path: the steps count this step before
                # the kernel reads them, and are taken back when it is skipped.
                torch._foreach_add_(steps, 1)
                kernel_steps = steps
                if not group.get("bias_correction", True):
                    # beta ** inf is exactly 0 for beta in [0, 1), so the
                    # kernel's bias corrections are exactly 1: the update
                    # without them, while the states keep counting steps.
                    kernel_steps = [torch.full((), math.inf, dtype=torch.float32,
                                               device=device)] * n
                ops.fused_adam_(
                    *lists, kernel_steps, lr=lr, beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    amsgrad=amsgrad, maximize=bool(group["maximize"]), adamw=adamw,
                    master_params=masters, grad_scale=scale, found_inf=inf)
                if inf is not None:
                    torch._foreach_sub_(steps, [inf] * n)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's, except that master-weight parameters keep float32
        moments and masters (torch.optim casts every state to its
        parameter's dtype)."""
        super().load_state_dict(state_dict)
        if not self.master_weights:
            return
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i not in saved or not self._uses_master(p) or p not in self.state:
                continue
            for key, value in saved[i].items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32,
                                                  copy=True)


class Adam(_FusedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` whose step is ``torchops.fused_adam_``.

    Arguments and defaults are torch.optim.Adam's (``foreach``,
    ``capturable``, ``differentiable`` and ``fused`` are accepted and
    recorded in the param groups, but the step is always the fused kernel),
    plus ``master_weights``: float32 master copies and moments for float16
    and bfloat16 parameters."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 master_weights: bool = False):
        if differentiable:
            raise ValueError("torchops.optim.Adam: differentiable=True is not supported")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self.master_weights = master_weights
        self._step_supports_amp_scaling = True


class AdamW(_FusedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step is ``torchops.fused_adam_``
    (decoupled weight decay); arguments as ``torchops.optim.Adam``."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False):
        if differentiable:
            raise ValueError("torchops.optim.AdamW: differentiable=True is not supported")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)
        self.master_weights = master_weights
        self._step_supports_amp_scaling = True


class HybridAdam(_FusedAdam, torch.optim.Adam):
    """ColossalAI's ``HybridAdam`` on ``torchops.fused_adam_``: Adam with
    decoupled weight decay (``adamw_mode=True``, AdamW) or L2 weight decay
    (``adamw_mode=False``, Adam), its arguments and defaults.

    One optimizer steps parameters on any device: those on the CPU (an
    offloaded model's) through the CPU kernel, those on a GPU through the
    CUDA kernel, one call per device and dtype; each state lives on its
    parameter's device.  ``bias_correction=False`` drops Adam's bias
    corrections (the states still count steps).  ``step(div_scale=s)`` with
    ``s > 0`` divides the gradients by ``s`` first (and leaves them divided,
    as ``GradScaler``'s unscale does).  A gradient in another float dtype
    than its parameter (float16 gradients of float32 parameters) is
    converted to the parameter's for the step; the step then leaves it
    undivided.  ``amsgrad``, ``maximize`` and ``master_weights`` are
    torchops.optim.Adam's.

    ``adamw_mode`` and ``bias_correction`` are kept per param group (as
    ``decoupled_weight_decay`` and ``bias_correction``): the state dict has
    ``torch.optim.AdamW``'s layout plus that key, so one saved by either
    loads into the other.  A state saved without them gets this optimizer's
    ``adamw_mode`` and bias correction.  NVMe offloading
    (``nvme_offload_fraction > 0``) is not supported."""

    def __init__(self, params, lr: float | Tensor = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 adamw_mode: bool = True, nvme_offload_fraction: float = 0.0,
                 nvme_offload_dir: str | None = None, *, amsgrad: bool = False,
                 maximize: bool = False, master_weights: bool = False, **defaults):
        name = "torchops.optim.HybridAdam"
        if nvme_offload_fraction != 0.0 or nvme_offload_dir is not None:
            raise ValueError(f"{name}: NVMe offloading (nvme_offload_fraction="
                             f"{nvme_offload_fraction}, nvme_offload_dir={nvme_offload_dir!r}) "
                             f"is not supported; keep the states on the CPU or the GPU")
        if defaults:
            raise TypeError(f"{name}: unexpected arguments {sorted(defaults)}")
        self.adamw_mode = bool(adamw_mode)
        self.bias_correction = bool(bias_correction)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=self.adamw_mode)
        for group in self.param_groups:
            group.setdefault("bias_correction", self.bias_correction)
        self.defaults["bias_correction"] = self.bias_correction
        self.master_weights = master_weights
        self._step_supports_amp_scaling = True
        self._converts_grads = True

    def __setstate__(self, state: dict) -> None:
        # torch.optim.Adam fills a group without decoupled_weight_decay with
        # False (L2); a HybridAdam's own mode and bias correction come first.
        adamw = state.get("adamw_mode", getattr(self, "adamw_mode", True))
        bias_correction = state.get("bias_correction", getattr(self, "bias_correction", True))
        for group in state.get("param_groups", ()):
            group.setdefault("decoupled_weight_decay", adamw)
            group.setdefault("bias_correction", bias_correction)
        super().__setstate__(state)

    @torch.no_grad()
    def step(self, closure=None, div_scale: float = -1):
        """One optimization step; ``div_scale > 0`` divides the gradients
        by it first (ColossalAI's argument)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        if div_scale > 0:
            if grad_scale is not None:
                raise RuntimeError("torchops.optim.HybridAdam: div_scale given to a step that "
                                   "GradScaler already unscales")
            grad_scale = torch.tensor(float(div_scale), dtype=torch.float32)
        self._fused_step(grad_scale, getattr(self, "found_inf", None))
        return loss


# --- optim: SGD ---------------------------------------------------------------------------

__all__ += ["SGD"]


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` whose step is ``torchops.fused_sgd_``, called once
    per (device, dtype) of the parameters that have gradients.

    Arguments and defaults are torch.optim.SGD's (``foreach`` and ``fused``
    are accepted and recorded in the param groups, but the step is always the
    fused kernel), plus ``master_weights``: float32 master copies (state key
    ``master_param``) and momentum buffers for float16 and bfloat16
    parameters, each step updating the copy and writing it, rounded, into the
    parameter.  The state is torch.optim.SGD's (``momentum_buffer`` when
    ``momentum != 0``), so a state saved by one loads into the other and
    continues the same run; loaded into a master-weight optimizer, buffers
    become float32 and a missing master is made from the parameter.

    ``torch.amp.GradScaler`` hands the step its scale and inf flag: the
    gradients are unscaled inside the step, and a step with an inf or NaN
    gradient leaves parameters and buffers unchanged.  A parameter's first
    step with momentum starts its buffer from the gradient, as torch's does;
    when GradScaler skips that step the buffer is not made (the step reads
    the inf flag on the host then, once per parameter)."""

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0, nesterov: bool = False,
                 *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False):
        if differentiable:
            raise ValueError("torchops.optim.SGD: differentiable=True is not supported")
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov,
                         maximize=maximize, foreach=foreach, differentiable=differentiable,
                         fused=fused)
        self.master_weights = master_weights
        self._step_supports_amp_scaling = True

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype in _LOW_PRECISION

    def _param_state(self, p: Tensor) -> dict:
        """p's state in this optimizer's layout: a master-weight parameter's
        buffer float32 and its master present.  As in torch.optim.SGD, a
        parameter without momentum or master gets no state entry."""
        if not self._uses_master(p):
            return self.state[p] if p in self.state else {}
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is not None and buf.dtype != torch.float32:
            state["momentum_buffer"] = buf.to(torch.float32)
        m = state.get("master_param")
        if m is None:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        elif m.dtype != torch.float32 or m.device != p.device:
            state["master_param"] = m.to(device=p.device, dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see torch.optim.SGD.step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            momentum = float(group["momentum"])
            # (device, param dtype, grad dtype, master, first step) -> the lists of one call
            calls: dict[tuple, dict[str, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._param_state(p)
                master = self._uses_master(p)
                first = momentum != 0 and state.get("momentum_buffer") is None
                lists = calls[(p.device, p.dtype, p.grad.dtype, master, first)]
                lists["params"].append(p)
                lists["grads"].append(p.grad)
                if master:
                    lists["master_params"].append(state["master_param"])
            for (device, _, _, master, first), lists in calls.items():
                lr = group["lr"]
                if torch.is_tensor(lr):
                    lr = lr.to(device=device, dtype=torch.float32)
                scale = None if grad_scale is None else grad_scale.to(device, torch.float32)
                inf = None if found_inf is None else found_inf.to(device, torch.float32)
                if first and inf is not None and float(inf) == 1.0:
                    continue  # a skipped first step makes no buffer
                bufs = []
                if momentum != 0:
                    for p in lists["params"]:
                        state = self.state[p]
                        if first:
                            state["momentum_buffer"] = torch.empty_like(
                                p, dtype=torch.float32 if master else p.dtype,
                                memory_format=torch.preserve_format)
                        bufs.append(state["momentum_buffer"])
                ops.fused_sgd_(
                    lists["params"], lists["grads"], bufs,
                    weight_decay=float(group["weight_decay"]), momentum=momentum, lr=lr,
                    dampening=float(group["dampening"]), nesterov=bool(group["nesterov"]),
                    maximize=bool(group["maximize"]), is_first_step=first,
                    master_params=lists["master_params"] if master else None,
                    grad_scale=scale, found_inf=inf)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's, except that master-weight parameters keep float32
        buffers and masters (torch.optim casts every state to its
        parameter's dtype)."""
        super().load_state_dict(state_dict)
        if not self.master_weights:
            return
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i not in saved or not self._uses_master(p) or p not in self.state:
                continue
            for key, value in saved[i].items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32,
                                                  copy=True)
