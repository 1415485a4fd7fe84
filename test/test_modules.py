"""torchops.modules: each module calls its op with the hyper-parameters it
holds, is documented, and compiles.  Values of the ops themselves are the op
database's business; here the module must equal the functional call."""

from __future__ import annotations

import pytest
import torch

import torchops
from torchops import modules

from opdb import random_rois
from torchops import references


def test_every_module_is_public_and_documented():
    for name in modules.__all__:
        cls = getattr(torchops, name)
        assert issubclass(cls, torch.nn.Module), name
        assert cls.__doc__ and len(cls.__doc__) > 40, f"{name} needs a docstring"


@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_module_equals_op(aligned):
    x = torch.randn(2, 3, 12, 10)
    rois = random_rois(2, 7, 12, 10, 0.5, torch.float32, "cpu", seed=1)
    m = torchops.RoIAlign((3, 4), 0.5, 2, aligned=aligned)
    expect = torchops.roi_align(x, rois, (3, 4), 0.5, 2, aligned)
    torch.testing.assert_close(m(x, rois), expect, rtol=0, atol=0)
    assert "aligned" in repr(m)


def test_roi_pool_module_equals_op_and_compiles():
    x = torch.randn(2, 3, 12, 10)
    rois = random_rois(2, 5, 12, 10, 1.0, torch.float32, "cpu", seed=2)
    m = torchops.RoIPool(2, 1.0)
    expect = torchops.roi_pool(x, rois, 2, 1.0)
    torch.testing.assert_close(m(x, rois), expect, rtol=0, atol=0)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x, rois), expect, rtol=0, atol=0)


# --- CARAFEPack ---------------------------------------------------------------


def _carafe_pack_by_hand(m: torchops.CARAFEPack, x: torch.Tensor) -> torch.Tensor:
    """mmcv's CARAFEPack.forward written out, with the reference carafe."""
    mask = m.content_encoder(m.channel_compressor(x))
    mask = torch.nn.functional.pixel_shuffle(mask, m.scale_factor)
    n, mc, h, w = mask.shape
    k2 = m.up_kernel**2
    mask = torch.softmax(mask.view(n, mc // k2, k2, h, w), dim=2).view(n, mc, h, w)
    return references.carafe(x, mask, m.up_kernel, m.up_group, m.scale_factor)


@pytest.mark.parametrize("up_kernel,up_group,scale,dilation", [(5, 1, 2, 1), (3, 2, 3, 2)])
def test_carafe_pack_equals_its_formula(up_kernel, up_group, scale, dilation):
    torch.manual_seed(0)
    m = torchops.CARAFEPack(4, scale, up_kernel=up_kernel, up_group=up_group,
                            encoder_dilation=dilation, compressed_channels=8).double()
    # Weights larger than the near-uniform initial ones, so the kernels differ per pixel.
    torch.nn.init.normal_(m.content_encoder.weight, 0.0, 0.3)
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    out = m(x)
    assert out.shape == (2, 4, 5 * scale, 6 * scale)
    expect = _carafe_pack_by_hand(m, x)
    torch.testing.assert_close(out, expect)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    want = torch.autograd.grad(expect, [x, *m.parameters()], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert "up_kernel" in repr(m)


def test_carafe_pack_parameters_init_and_compile():
    torch.manual_seed(0)
    m = torchops.CARAFEPack(16, 2)  # mmcv's defaults: k 5, one group, 64 compressed channels
    assert m.channel_compressor.weight.shape == (64, 16, 1, 1)
    assert m.content_encoder.weight.shape == (5 * 5 * 1 * 2 * 2, 64, 3, 3)
    assert m.content_encoder.weight.std() < 0.002
    assert not m.content_encoder.bias.any() and not m.channel_compressor.bias.any()
    x = torch.randn(1, 16, 6, 7)
    mask = m.kernel_normalizer(m.content_encoder(m.channel_compressor(x)))
    torch.testing.assert_close(mask.view(1, 1, 25, 12, 14).sum(2), torch.ones(1, 1, 12, 14))
    expect = m(x)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), expect)
