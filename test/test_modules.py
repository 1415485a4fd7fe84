"""torchops.modules: each module calls its op with the hyper-parameters it
holds, is documented, and compiles.  Values of the ops themselves are the op
database's business; here the module must equal the functional call."""

from __future__ import annotations

import pytest
import torch

import torchops
from torchops import modules

from opdb import random_rois


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
