"""torchops kernels in a Hugging Face Llama-family model.

    import torchops.integrations.transformers as tt
    model = tt.apply(model)          # in place; returns the model

What changes, and what does not:

* **RMSNorm** modules of Llama's form (``weight`` and ``variance_epsilon``:
  LlamaRMSNorm, MistralRMSNorm, Qwen2/3RMSNorm, ...) compute through
  ``torchops.rms_norm``.  Gemma's norm (``1 + weight``) is left alone.  The
  module keeps its parameters, so the state dict and the optimizer are the
  same.  The one numerical difference: the stock module rounds the normalised
  row to the input dtype before multiplying by the weight; torchops multiplies
  in float32 and rounds once.
* **The rotary application**: ``apply_rotary_pos_emb`` is a module-level
  function of each modeling file, which the attention's forward looks up at
  call time.  ``apply`` replaces it in the modeling modules of the model's
  attention classes with ``torchops.rotary_embedding`` (the same formula).
  That is a process-wide change for that architecture; ``restore()`` undoes it.
* **The gated MLP** (``gate_proj``, ``up_proj``, ``down_proj`` with a SiLU or GELU
  ``act_fn``) runs one GEMM on the concatenated gate and up weights, then
  ``torchops.silu_and_mul`` / ``gelu_and_mul``.  The concatenation copies the
  two weights each call (small beside the GEMM) and keeps the parameters as
  they are.

Modules are changed by swapping their class for a subclass that overrides
``forward`` only, so ``isinstance`` checks, hooks and attributes still hold.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import torchops

__all__ = ["apply", "restore"]

# modeling module -> its original apply_rotary_pos_emb
_PATCHED: dict[str, Callable] = {}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def _rms_norm_forward(self, hidden_states):
    return torchops.rms_norm(hidden_states, (self.weight.shape[-1],), self.weight,
                             self.variance_epsilon)


def _gated_mlp_forward(self, x):
    weight = torch.cat([self.gate_proj.weight, self.up_proj.weight], 0)
    bias = None
    if self.gate_proj.bias is not None:
        bias = torch.cat([self.gate_proj.bias, self.up_proj.bias], 0)
    h = F.linear(x, weight, bias)
    kind = self._torchops_activation
    if kind == "silu":
        h = torchops.silu_and_mul(h)
    else:
        h = torchops.gelu_and_mul(h, approximate=kind.removeprefix("gelu-"))
    return self.down_proj(h)


def _rotary(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
    if kwargs:  # position_ids and other legacy arguments are unused, as in HF's own
        kwargs.pop("position_ids", None)
        if kwargs:
            raise TypeError(f"torchops rotary_embedding: unexpected arguments {sorted(kwargs)}")
    return torchops.rotary_embedding(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _swap_class(module: nn.Module, tag: str, forward: Callable) -> None:
    cls = type(module)
    if getattr(cls, "_torchops_tag", None) == tag:
        return
    key = (cls, tag)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Torchops{cls.__name__}", (cls,),
                                {"forward": forward, "_torchops_tag": tag,
                                 "__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[key]


def _is_llama_rms_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    return (name.endswith("RMSNorm") and "Gemma" not in name
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float))


def _mlp_activation(m: nn.Module) -> str | None:
    if not all(isinstance(getattr(m, p, None), nn.Linear)
               for p in ("gate_proj", "up_proj", "down_proj")):
        return None
    if (m.gate_proj.bias is None) != (m.up_proj.bias is None):
        return None
    from transformers import activations

    act = getattr(m, "act_fn", None)
    if isinstance(act, (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))):
        return "silu"
    for cls_name, kind in (("GELUTanh", "gelu-tanh"), ("PytorchGELUTanh", "gelu-tanh"),
                           ("NewGELUActivation", "gelu-tanh"), ("GELUActivation", "gelu-none")):
        cls = getattr(activations, cls_name, None)
        if cls is not None and type(act) is cls:
            return kind
    if isinstance(act, nn.GELU):
        return f"gelu-{act.approximate}"
    return None


def _same_rotary(original: Callable) -> bool:
    # Only a modeling file whose rotary is HF's halves-rotating formula (with
    # rotary_dim <= head size) is patched; GPT-J-style pairs and other
    # variants keep their own.  Checked on a small float64 example.
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 5, 8, generator=g, dtype=torch.float64) for h in (4, 2))
    cos, sin = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        want = original(q, k, cos, sin)
    except Exception:
        return False
    got = torchops.rotary_embedding(q, k, cos, sin)
    return all(torch.allclose(a, b) for a, b in zip(want, got))


def apply(model: nn.Module, *, norms: bool = True, rotary: bool = True,
          mlp: bool = True) -> nn.Module:
    """Route ``model``'s RMSNorms, rotary embedding and gated MLPs through
    torchops kernels, in place (see the module docstring); returns ``model``.
    Modules of other forms are left as they are.  Apply it before
    ``torch.compile`` or wrapping for distributed training."""
    for m in model.modules():
        if norms and _is_llama_rms_norm(m):
            _swap_class(m, "rms_norm", _rms_norm_forward)
        elif mlp and (kind := _mlp_activation(m)) is not None:
            m._torchops_activation = kind
            _swap_class(m, "gated_mlp", _gated_mlp_forward)
        if rotary and type(m).__name__.endswith("Attention"):
            modeling = sys.modules.get(type(m).__module__)
            original = getattr(modeling, "apply_rotary_pos_emb", None)
            if (original is not None and modeling.__name__ not in _PATCHED
                    and _same_rotary(original)):
                _PATCHED[modeling.__name__] = original
                modeling.apply_rotary_pos_emb = _rotary
    return model


def restore() -> None:
    """Put back every ``apply_rotary_pos_emb`` that ``apply`` replaced.  (The
    module classes stay swapped: swap a module back with
    ``m.__class__ = type(m).__mro__[1]``.)"""
    for name, original in _PATCHED.items():
        setattr(sys.modules[name], "apply_rotary_pos_emb", original)
    _PATCHED.clear()
