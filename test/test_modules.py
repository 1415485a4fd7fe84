"""torchops.modules: each module calls its op with the hyper-parameters it
holds, is documented, and compiles.  Values of the ops themselves are the op
database's business; here the module must equal the functional call."""

from __future__ import annotations

import pytest
import torch

import torchops
from torchops import modules

from opdb import random_mask, random_rois


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


# --- MaskedConv2d ------------------------------------------------------------------------------

def test_masked_conv2d_module_equals_op_and_conv2d_without_mask():
    torch.manual_seed(0)
    m = torchops.MaskedConv2d(4, 6, 3, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    assert isinstance(m, torch.nn.Conv2d)
    x = torch.randn(2, 4, 9, 10)
    plain = m(x)
    torch.testing.assert_close(plain, torch.nn.functional.conv2d(
        x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups), rtol=0, atol=0)
    mask = random_mask((2, *plain.shape[2:]), "cpu", seed=3)
    expect = torchops.masked_conv2d(x, mask, m.weight, m.bias, 1, (2, 1), (1, 2), 2)
    torch.testing.assert_close(m(x, mask), expect, rtol=0, atol=0)
    torch.testing.assert_close(m(x, mask), torch.where(mask[:, None], plain, 0.0))
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x, mask), expect)


def test_masked_conv2d_module_string_padding():
    torch.manual_seed(1)
    x = torch.randn(1, 3, 7, 8)
    mask = torch.ones(1, 7, 8, dtype=torch.bool)
    same = torchops.MaskedConv2d(3, 2, (3, 5), padding="same", bias=False)
    torch.testing.assert_close(same(x, mask), same(x))
    valid = torchops.MaskedConv2d(3, 2, 3, padding="valid")
    torch.testing.assert_close(valid(x, torch.ones(1, 5, 6, dtype=torch.bool)), valid(x))
    with pytest.raises(ValueError, match=r"MaskedConv2d.*'same'"):
        torchops.MaskedConv2d(3, 2, 2, padding="same")(x, mask)
    with pytest.raises(ValueError, match=r"MaskedConv2d.*padding_mode"):
        torchops.MaskedConv2d(3, 2, 3, padding=1, padding_mode="reflect")(x, mask)
