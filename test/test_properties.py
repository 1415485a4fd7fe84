"""Property tests with hypothesis: random shapes (0 and 1 included), dtypes,
memory layouts and values, per op, against the float64 reference.

Entries with a ``hypothesis_sample`` get genuinely drawn inputs; the others
get a drawn one of their samples with drawn values.  Example counts come from
the hypothesis profile (conftest.py): "ci" by default, "full" with --full or
--hypothesis-profile=full.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given, note, strategies as st  # noqa: E402

from op_testing import (DEVICES, assert_matches_reference, call, generic_param,  # noqa: E402
                        reference)
from opdb import OP_DB, OpInfo, Sample  # noqa: E402


def _sample_from_generator(draw, op: OpInfo, device: str, dtype: torch.dtype) -> Sample:
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        samples = list(op.samples(device, dtype))
    return samples[draw(st.integers(0, len(samples) - 1), label="sample")]


@pytest.mark.parametrize("op,device", [
    generic_param("property", op, d, values=(op, d), id=f"{op.name}-{d}")
    for op in OP_DB for d in DEVICES])
@given(data=st.data())
def test_property(op: OpInfo, device: str, data):
    # The dtype is drawn, not a parameter: a dtype's Skip record takes it out
    # of the draw.
    dtypes = [dt for dt in op.dtypes.get(device, ()) if not op.skip_for("property", device, dt)]
    if not dtypes:
        pytest.skip(f"{op.name} has no {device} kernel, or skips all its dtypes")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    if op.hypothesis_sample is not None:
        s = op.hypothesis_sample(data.draw, device, dtype)
    else:
        s = _sample_from_generator(data.draw, op, device, dtype)
    note(f"sample {s}: " + ", ".join(f"{tuple(t.shape)}/{t.stride()}" for t in s.tensors()))
    assert_matches_reference(op, s, call(op, s), reference(op, s), dtype, device, scale_atol=True)
