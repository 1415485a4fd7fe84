"""Gates on the op database and the public API.

* Coverage: every operator registered in the torchops namespace has a
  database entry (internal ``_<op>_backward`` ops: listed in some entry's
  ``internal_ops``) and a fake kernel; every entry names a registered op.
* API snapshot: the schemas (and tags) of all torchops operators, so that a
  change of the public API is deliberate.  After an intended change, accept
  the new snapshot with
      EXPECTTEST_ACCEPT=1 python -m pytest test/test_gates.py -k schema
  (expecttest rewrites the string below) and review the diff.
* Entry hygiene: skip reasons are written and name real tests; the samples
  have the variety the generic tests rely on.
"""

from __future__ import annotations

import expecttest
import pytest
import torch

import torchops
from opdb import GENERIC_TESTS, OP_DB, OPCHECK_UTILS, OpInfo

NAMESPACE = "torchops::"


def registered_ops() -> dict[str, list[torch._ops.OpOverload]]:
    """Every op the dispatcher knows in the torchops namespace, with its overloads."""
    names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(NAMESPACE)})
    ops = {}
    for qualname in names:
        packet = getattr(torch.ops.torchops, qualname[len(NAMESPACE):])
        ops[qualname] = [getattr(packet, o) for o in sorted(packet.overloads())]
    return ops


def test_every_op_has_an_entry_and_a_fake():
    ops = registered_ops()
    assert ops, "no torchops operators registered"
    covered = {f"{NAMESPACE}{o.name}" for o in OP_DB}
    internal = {f"{NAMESPACE}{n}" for o in OP_DB for n in o.internal_ops}
    missing = [n for n in ops if n not in covered | internal]
    assert not missing, (f"ops without an entry in test/opdb.py: {missing} (internal backward "
                         f"ops: list them in their op's `internal_ops`)")
    unknown = sorted((covered | internal) - set(ops))
    assert not unknown, f"entries/internal_ops naming no registered op: {unknown}"
    no_fake = [str(ov) for overloads in ops.values() for ov in overloads
               if not torch._C._dispatch_has_kernel_for_dispatch_key(ov.name(), "Meta")
               and not torch._C._dispatch_has_kernel_for_dispatch_key(
                   ov.name(), "CompositeImplicitAutograd")]
    assert not no_fake, f"ops without a fake kernel (torch.library.register_fake in torchops/ops.py): {no_fake}"


def test_entries_match_the_public_api():
    for o in OP_DB:
        assert o.op == getattr(torch.ops.torchops, o.name).default, o.name
        assert getattr(torchops, o.name, None) is o.wrapper, f"torchops.{o.name} is not the entry's wrapper"
    public = {n for n in torchops.ops.__all__}
    assert public == {o.name for o in OP_DB}, \
        f"torchops.ops.__all__ and the database differ: {sorted(public ^ {o.name for o in OP_DB})}"
    assert len({o.name for o in OP_DB}) == len(OP_DB), "duplicate entries"


@pytest.mark.parametrize("op", [pytest.param(o, id=o.name) for o in OP_DB])
def test_skips_have_reasons(op: OpInfo):
    for table, known in ((op.skips, GENERIC_TESTS), (op.opcheck_skips, OPCHECK_UTILS)):
        for name, reason in table.items():
            assert name in known, f"{op.name}: unknown test {name!r} (known: {known})"
            assert isinstance(reason, str) and len(reason.split()) >= 3, \
                f"{op.name}: skipping {name!r} needs a written reason"
    for name in op.internal_ops:
        assert name.startswith("_"), f"{op.name}: internal op {name!r} should start with '_'"


@pytest.mark.parametrize("op", [pytest.param(o, id=o.name) for o in OP_DB])
def test_sample_variety(op: OpInfo):
    """Samples include an empty tensor, a size-1 dim, a non-contiguous input
    and (differentiable ops) inputs requiring grad."""
    if "sample_variety" in op.skips:
        pytest.skip(op.skips["sample_variety"])
    device = "cpu" if op.dtypes.get("cpu") else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA-only op")
    dtype = op.dtypes[device][0]
    tensors = [t for s in op.sample_inputs(device, dtype) for t in s.tensors()]
    assert any(t.numel() == 0 for t in tensors), f"{op.name}: no sample with an empty tensor"
    assert any(1 in t.shape for t in tensors), f"{op.name}: no sample with a size-1 dimension"
    assert any(not t.is_contiguous() for t in tensors), f"{op.name}: no non-contiguous sample"
    if op.differentiable:
        grads = [t for s in op.sample_inputs(device, dtype, requires_grad=True) for t in s.tensors()]
        assert any(t.requires_grad for t in grads), f"{op.name}: requires_grad=True samples need grad"
        assert not any(t.requires_grad and not t.is_floating_point() for t in grads)


def schema_snapshot() -> str:
    lines = []
    for overloads in registered_ops().values():
        for ov in overloads:
            tags = ", ".join(sorted(str(t).removeprefix("Tag.") for t in ov.tags))
            lines.append(f"{ov._schema}  [{tags}]")
    return "\n".join(lines) + "\n"


class TestAPISnapshot(expecttest.TestCase):
    def test_schema_snapshot(self):
        self.assertExpectedInline(schema_snapshot(), """\
torchops::_box_iou_backward(Tensor grad, Tensor boxes1, Tensor boxes2) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_d_sigmoid_backward(Tensor grad, Tensor z) -> Tensor  [pt2_compliant_tag]
torchops::_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor  [pt2_compliant_tag]
torchops::_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor  [pt2_compliant_tag]
torchops::_sigmoid_focal_loss_backward(Tensor grad, Tensor inputs, Tensor targets, float alpha, float gamma, str reduction) -> Tensor  [pt2_compliant_tag]
torchops::batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::box_iou(Tensor boxes1, Tensor boxes2) -> Tensor  [pt2_compliant_tag]
torchops::d_sigmoid(Tensor z) -> Tensor  [pt2_compliant_tag]
torchops::matmul(Tensor a, Tensor b) -> Tensor  [pt2_compliant_tag]
torchops::nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor  [pt2_compliant_tag]
torchops::roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::sigmoid_focal_loss(Tensor inputs, Tensor targets, float alpha=0.25, float gamma=2., str reduction="none") -> Tensor  [pt2_compliant_tag]
""")
