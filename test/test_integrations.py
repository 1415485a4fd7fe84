"""torchops.integrations.transformers on a small, randomly initialised
LlamaForCausalLM: logits and gradients match the stock model within bf16
tolerance.  Skipped when transformers is not installed (the GPU machine has
it; CI does not)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchops  # noqa: E402
from torchops.integrations import transformers as tt  # noqa: E402

from opdb import devices  # noqa: E402


def _model(device, dtype, act="silu"):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        hidden_act=act, rms_norm_eps=1e-5, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


@pytest.fixture
def restore_rotary():
    yield
    tt.restore()


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_matches_stock(device, dtype, act, restore_rotary):
    stock = _model(device, dtype, act)
    ours = tt.apply(copy.deepcopy(stock))
    names = {type(m).__name__ for m in ours.modules()}
    assert {"TorchopsLlamaRMSNorm", "TorchopsLlamaMLP"} <= names, names
    import transformers.models.llama.modeling_llama as modeling
    assert modeling.apply_rotary_pos_emb is tt._rotary
    assert ours.state_dict().keys() == stock.state_dict().keys()

    ids = torch.randint(0, 256, (2, 17), device=device)
    # The stock model runs after the patch too: compute it with the original
    # rotary put back, then patch again.
    tt.restore()
    ref = stock(ids, labels=ids)
    ref.loss.backward()
    tt.apply(ours)
    got = ours(ids, labels=ids)
    got.loss.backward()

    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.logits.float(), ref.logits.float(), **tol)
    ref_g, got_g = _grads(stock), _grads(ours)
    assert ref_g.keys() == got_g.keys()
    for n in ref_g:
        scale = ref_g[n].abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got_g[n] / scale, ref_g[n] / scale, **tol, msg=n)


def test_unknown_forms_are_left_alone(restore_rotary):
    """A norm of another form (Gemma's 1 + weight) and a non-gated MLP keep
    their classes."""
    class GemmaRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    class PlainMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.act_fn = torch.nn.SiLU()

    model = torch.nn.Sequential(GemmaRMSNorm(), PlainMLP())
    tt.apply(model)
    assert [type(m).__name__ for m in model] == ["GemmaRMSNorm", "PlainMLP"]
