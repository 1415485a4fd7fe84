"""A small model built from several torchops ops: eager, autograd and
torch.compile(fullgraph=True, dynamic=True) agree."""

import pytest
import torch

import torchops
from opdb import devices


class TinyMLP(torch.nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(d_in, d_hidden) / d_in**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(d_hidden, d_out) / d_hidden**0.5)

    def forward(self, x):
        return torchops.matmul(torchops.d_sigmoid(torchops.matmul(x, self.w1)), self.w2)


@pytest.mark.parametrize("device", [pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else [])
                                    for d in devices()])
def test_compiled_model_matches_eager_forward_and_backward(device):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TinyMLP(16, 32, 8).to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for batch in (5, 7, 11):  # several sizes through one dynamic graph
        x = torch.randn(batch, 16, device=device)
        model.zero_grad()
        eager_out = model(x)
        eager_out.square().sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(x)
        out.square().sum().backward()
        torch.testing.assert_close(out, eager_out)
        for p, g in zip(model.parameters(), eager_grads):
            torch.testing.assert_close(p.grad, g)
