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
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from . import ops

__all__ = ["Adam", "AdamW"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class _FusedAdam:
    """The step and the state handling that Adam and AdamW share."""

    master_weights: bool

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

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see torch.optim.Adam.step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        adamw_default = isinstance(self, torch.optim.AdamW)
        for group in self.param_groups:
            beta1, beta2 = (float(b) for b in group["betas"])
            adamw = bool(group.get("decoupled_weight_decay", adamw_default))
            # (device, param dtype, grad dtype, master) -> the lists of one call
            calls: dict[tuple, dict[str, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._param_state(p, group)
                master = self._uses_master(p)
                lists = calls[(p.device, p.dtype, p.grad.dtype, master)]
                lists["params"].append(p)
                lists["grads"].append(p.grad)
                lists["exp_avgs"].append(state["exp_avg"])
                lists["exp_avg_sqs"].append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    lists["max_exp_avg_sqs"].append(state["max_exp_avg_sq"])
                lists["state_steps"].append(state["step"])
                if master:
                    lists["master_params"].append(state["master_param"])
            for (device, _, _, master), lists in calls.items():
                lr = group["lr"]
                if torch.is_tensor(lr):
                    lr = lr.to(device=device, dtype=torch.float32)
                scale = None if grad_scale is None else grad_scale.to(device, torch.float32)
                inf = None if found_inf is None else found_inf.to(device, torch.float32)
                steps = lists["state_steps"]
                # torch.optim's fused path: the steps count this step before
                # the kernel reads them, and are taken back when it is skipped.
                torch._foreach_add_(steps, 1)
                ops.fused_adam_(
                    lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                    lists["max_exp_avg_sqs"], steps, lr=lr, beta1=beta1, beta2=beta2,
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                    adamw=adamw, master_params=lists["master_params"] if master else None,
                    grad_scale=scale, found_inf=inf)
                if inf is not None:
                    torch._foreach_sub_(steps, [inf] * len(steps))
        return loss

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
