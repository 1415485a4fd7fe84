"""Gates on the op database and the public API.

* Coverage: every operator registered in the torchops namespace has a
  database entry (internal ``_<op>_backward`` ops: listed in some entry's
  ``internal_ops``); every entry names a registered op.
* The checklist: what the dispatcher holds for each op -- CPU, CUDA (where
  the CUDA library is loaded), Autograd and Autocast kernels, a fake -- agrees
  with its entry, and each op has a benchmark case and a README row.  The
  failure lists one line per missing item.
* API snapshot: the schemas (and tags) of all torchops operators, so that a
  change of the public API is deliberate.  After an intended change, accept
  the new snapshot with
      EXPECTTEST_ACCEPT=1 python -m pytest test/test_gates.py -k schema
  (expecttest rewrites the string below) and review the diff.
* Entry hygiene: skip records, exemptions and kernel-only error inputs have
  written reasons and name real tests, devices and dtypes; the samples have
  the variety the generic tests rely on.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import expecttest
import pytest
import torch

import torchops
from op_testing import generic_param, op_name
from opdb import (DEVICE_TYPES, ENTRY_DTYPES, GENERIC_TESTS, MATMUL, OP_DB, OPCHECK_UTILS,
                  OpInfo, Skip)

NAMESPACE = "torchops::"
README = Path(__file__).resolve().parents[1] / "README.md"


def registered_ops() -> dict[str, list[torch._ops.OpOverload]]:
    """Every op the dispatcher knows in the torchops namespace, with its overloads."""
    names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(NAMESPACE)})
    ops = {}
    for qualname in names:
        packet = getattr(torch.ops.torchops, qualname[len(NAMESPACE):])
        ops[qualname] = [getattr(packet, o) for o in sorted(packet.overloads())]
    return ops


def test_every_op_has_an_entry():
    ops = registered_ops()
    assert ops, "no torchops operators registered"
    covered = {f"{NAMESPACE}{o.name}" for o in OP_DB}
    internal = {f"{NAMESPACE}{n}" for o in OP_DB for n in o.internal_ops}
    missing = [n for n in ops if n not in covered | internal]
    assert not missing, (f"ops without an entry in test/opdb/: {missing} (internal backward "
                         f"ops: list them in their op's `internal_ops`)")
    unknown = sorted((covered | internal) - set(ops))
    assert not unknown, f"entries/internal_ops naming no registered op: {unknown}"


# --- the checklist ----------------------------------------------------------------------


def _has_kernel(overload: torch._ops.OpOverload, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key)


def _has_fake(overload: torch._ops.OpOverload) -> bool:
    """A fake registered with torch.library.register_fake, as `python -m
    torchops doctor` reads it (or, for an op defined in Python, a
    composite kernel that needs none)."""
    entry = torch._library.simple_registry.singleton.find(overload._schema.name)
    return (entry.fake_impl.kernel is not None
            or _has_kernel(overload, "CompositeImplicitAutograd"))


def readme_ops() -> set[str]:
    """The op names of README.md's "Ops" table (rows "| `name(...)` | ...")."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Ops", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)\(", section, flags=re.M))


def benchmarked() -> tuple[set[str], set[str]]:
    """(ops with a benchmark case, ops with a forward+backward case) in the
    torchops.bench.cases registry."""
    from torchops.bench import cases
    return ({c.op for c in cases.CASES}, {c.op for c in cases.CASES if c.backward})


def checklist_gaps() -> list[str]:
    """One line per item an op of the dispatcher lacks (or has against its
    entry): kernels, fake, benchmark case, README row."""
    cuda_loaded = torchops._loader.records()["torchops_cuda"].loaded
    cased, cased_backward = benchmarked()
    rows = readme_ops()
    entries = {o.name: o for o in OP_DB}
    parents = {n: o for o in OP_DB for n in o.internal_ops}
    gaps = []
    for qualname, overloads in registered_ops().items():
        name = qualname[len(NAMESPACE):]
        entry, parent = entries.get(name), parents.get(name)
        if entry is None and parent is None:
            continue  # test_every_op_has_an_entry says so
        # An internal backward op is differentiable when its op claims double
        # backward, and has no autocast kernel (autocast wraps the forward).
        if entry is not None:
            owner, differentiable, autocast = entry, entry.differentiable, entry.autocast
            claim = f"its entry says differentiable={differentiable}"
        else:
            owner, differentiable, autocast = parent, parent.supports_gradgrad, False
            claim = f"entry {parent.name!r} says supports_gradgrad={differentiable}"
        for ov in overloads:
            def gap(what: str) -> None:
                gaps.append(f"{ov.name()}: {what}")
            if not _has_kernel(ov, "CPU"):
                gap("no CPU kernel (csrc/cpu/)")
            if cuda_loaded and not _has_kernel(ov, "CUDA"):
                gap("no CUDA kernel (csrc/cuda/), though the CUDA library is loaded")
            has_autograd = _has_kernel(ov, "Autograd")
            if differentiable != has_autograd:
                gap(f"{'an' if has_autograd else 'no'} Autograd kernel, though {claim}")
            for key in ("AutocastCPU", "AutocastCUDA"):
                has = _has_kernel(ov, key)
                if autocast and not has:
                    gap(f"no {key} kernel, though its entry says autocast=True")
                if has and not autocast:
                    gap(f"an {key} kernel, though its entry says autocast=False"
                        if entry is not None else f"an {key} kernel, which an internal op "
                        f"should not have (autocast wraps its forward op)")
            if not _has_fake(ov):
                gap("no fake (torch.library.register_fake in torchops/ops.py)")
        exempt = name in owner.no_benchmark
        if entry is not None and name not in cased and not exempt:
            gaps.append(f"{qualname}: no benchmark case in torchops/bench/cases.py (nor an "
                        f"exemption, with its reason, in its entry's no_benchmark)")
        if entry is None and parent.name not in cased_backward and not exempt:
            gaps.append(f"{qualname}: no fwd+bwd benchmark case of {parent.name} in "
                        f"torchops/bench/cases.py (nor an exemption, with its reason, in "
                        f"no_benchmark of entry {parent.name!r})")
        if entry is not None and name not in rows:
            gaps.append(f"{qualname}: no row in README.md's Ops table")
    for name in sorted(rows - set(entries)):
        gaps.append(f"README.md's Ops table has a row for {name!r}, which is no public op")
    return gaps


def test_every_op_has_its_kernels_fake_benchmark_and_readme_row():
    gaps = checklist_gaps()
    assert not gaps, "\n".join(["ops that miss an item of the checklist:", *gaps])


# --- entries ----------------------------------------------------------------------------


def test_entries_match_the_public_api():
    for o in OP_DB:
        assert o.op == getattr(torch.ops.torchops, o.name).default, o.name
        assert getattr(torchops, o.name, None) is o.wrapper, f"torchops.{o.name} is not the entry's wrapper"
    public = {n for n in torchops.ops.__all__}
    assert public == {o.name for o in OP_DB}, \
        f"torchops.ops.__all__ and the database differ: {sorted(public ^ {o.name for o in OP_DB})}"
    assert len({o.name for o in OP_DB}) == len(OP_DB), "duplicate entries"


def _written(reason) -> bool:
    return isinstance(reason, str) and len(reason.split()) >= 3


def skip_record_problems(op: OpInfo) -> list[str]:
    """What is wrong with an entry's Skip records (empty when nothing)."""
    problems = []
    entry_dtypes = {dt for dts in op.dtypes.values() for dt in dts}
    for s in op.skips:
        where = f"{op.name}: {s}"
        if s.test not in GENERIC_TESTS:
            problems.append(f"{where}: unknown test {s.test!r} (known: {sorted(GENERIC_TESTS)})")
            continue
        if not _written(s.reason):
            problems.append(f"{where}: needs a written reason")
        if s.device not in (None, *DEVICE_TYPES):
            problems.append(f"{where}: device must be None or one of {DEVICE_TYPES}")
        if s.dtype is not None:
            runs_at = GENERIC_TESTS[s.test]
            allowed = entry_dtypes if runs_at == ENTRY_DTYPES else set(runs_at or ())
            if s.dtype not in allowed:
                problems.append(f"{where}: {s.test} never runs at {s.dtype} "
                                f"(it runs at {sorted(map(str, allowed)) or 'no dtype'})")
            if s.xfail and s.test == "property":
                problems.append(f"{where}: the property test draws its dtype, so it can skip "
                                f"one but not expect it to fail")
    if len(set(op.skips)) != len(op.skips):
        problems.append(f"{op.name}: duplicate Skip records")
    return problems


@pytest.mark.parametrize("op", [pytest.param(o, id=o.name) for o in OP_DB])
def test_skips_have_reasons(op: OpInfo):
    problems = skip_record_problems(op)
    for name, reason in op.opcheck_skips.items():
        if name not in OPCHECK_UTILS:
            problems.append(f"{op.name}: unknown opcheck test_util {name!r} (known: {OPCHECK_UTILS})")
        if not _written(reason):
            problems.append(f"{op.name}: turning off {name!r} needs a written reason")
    for name, reason in op.no_benchmark.items():
        if name not in (op.name, *op.internal_ops):
            problems.append(f"{op.name}: no_benchmark names {name!r}, neither the op nor one of "
                            f"its internal_ops")
        if not _written(reason):
            problems.append(f"{op.name}: no_benchmark[{name!r}] needs a written reason")
    for name in op.internal_ops:
        if not name.startswith("_"):
            problems.append(f"{op.name}: internal op {name!r} should start with '_'")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("op", [pytest.param(o, id=o.name) for o in OP_DB])
def test_error_inputs_are_well_formed(op: OpInfo):
    """kernel_only inputs say why; an input for another overload calls one
    of the entry's internal ops, through the dispatcher."""
    internal = {getattr(torch.ops.torchops, n).default for n in op.internal_ops}
    for e in op.error_inputs("cpu"):
        assert not e.kernel_only or _written(e.kernel_only), \
            f"{op.name}: {e.sample}: kernel_only needs a written reason"
        if e.op is not None:
            assert e.op in internal, \
                f"{op.name}: {e.sample} calls {op_name(e.op)}, not one of its internal_ops"
            assert not e.via_wrapper, f"{op.name}: {e.sample}: an internal op has no wrapper"


def test_skip_records_target_a_test_a_device_and_a_dtype():
    """The machinery the generic tests use: a record turns off exactly the
    runs it names; xfail expects them to fail (strict)."""
    op = dataclasses.replace(MATMUL, skips=[
        Skip("gradcheck", "a reason of three words", device="cuda"),
        Skip("correctness", "a reason of three words", dtype=torch.float16, xfail=True)])

    def marks(test, device, dtype=None):
        p = generic_param(test, op, device, dtype, values=(op,), id="x")
        return [(m.name, m.kwargs.get("strict")) for m in p.marks if m.name != "cuda"]

    assert marks("gradcheck", "cuda") == [("skip", None)]
    assert marks("gradcheck", "cpu") == []
    assert marks("gradgradcheck", "cuda") == []
    assert marks("correctness", "cpu", torch.float16) == [("xfail", True)]
    assert marks("correctness", "cuda", torch.float16) == [("xfail", True)]
    assert marks("correctness", "cpu", torch.float32) == []
    assert skip_record_problems(op) == []
    bad = dataclasses.replace(MATMUL, skips=[
        Skip("gradcheck", "why", dtype=torch.float16), Skip("no_such_test", "a reason of words"),
        Skip("opcheck", "a reason of words", device="tpu")])
    problems = "\n".join(skip_record_problems(bad))
    for expected in ("needs a written reason", "never runs at torch.float16", "unknown test",
                     "device must be"):
        assert expected in problems, problems


@pytest.mark.parametrize("op", [
    generic_param("sample_variety", o, "cpu" if o.dtypes.get("cpu") else "cuda", values=(o,),
                  id=o.name) for o in OP_DB])
def test_sample_variety(op: OpInfo):
    """Samples include an empty tensor, a size-1 dim, a non-contiguous input
    and (differentiable ops) inputs requiring grad."""
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
torchops::_carafe_backward(Tensor grad, Tensor features, Tensor masks, int kernel_size, int group_size, int scale_factor) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_d_sigmoid_backward(Tensor grad, Tensor z) -> Tensor  [pt2_compliant_tag]
torchops::_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_deform_roi_pool_backward(Tensor grad, Tensor input, Tensor rois, Tensor? offset, Tensor? slopes, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, float gamma) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_deform_roi_pool_forward(Tensor input, Tensor rois, Tensor offset, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, float gamma) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_fused_add_rms_norm_forward(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight, float? eps) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_fused_linear_cross_entropy_backward(Tensor grad, Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor lse, int ignore_index, float label_smoothing, str reduction, float lse_square_scale, float? softcap, int vocab_start, int vocab_size, bool[3] output_mask) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_fused_linear_cross_entropy_forward(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing, str reduction, float lse_square_scale, float? softcap, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_fused_linear_cross_entropy_scale_(Tensor(a!)[] grads, Tensor scale) -> ()  [pt2_compliant_tag]
torchops::_fused_linear_cross_entropy_stats(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float? softcap, int vocab_start, int vocab_size) -> Tensor  [pt2_compliant_tag]
torchops::_gelu_and_mul_backward(Tensor grad, Tensor x, str approximate) -> Tensor  [pt2_compliant_tag]
torchops::_layer_norm_backward(Tensor grad, Tensor input, Tensor mean, Tensor rstd, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, bool[3] output_mask) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_layer_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_masked_conv2d_backward(Tensor grad, Tensor input, Tensor mask, Tensor weight, int[2] padding, int[2] stride, int[2] dilation, int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_ms_deform_attn_backward(Tensor grad, Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights) -> (Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_rms_norm_backward(Tensor grad, Tensor input, Tensor rstd, SymInt[] normalized_shape, Tensor? weight, bool[2] output_mask) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_rms_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor  [pt2_compliant_tag]
torchops::_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor  [pt2_compliant_tag]
torchops::_rotary_embedding_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, bool interleaved, bool cos_sin_grad) -> (Tensor, Tensor, Tensor, Tensor)  [pt2_compliant_tag]
torchops::_scaled_masked_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor  [pt2_compliant_tag]
torchops::_scaled_upper_triang_masked_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor  [pt2_compliant_tag]
torchops::_sigmoid_focal_loss_backward(Tensor grad, Tensor inputs, Tensor targets, float alpha, float gamma, str reduction) -> Tensor  [pt2_compliant_tag]
torchops::_silu_and_mul_backward(Tensor grad, Tensor x) -> Tensor  [pt2_compliant_tag]
torchops::batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::batched_nms_rotated(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::box_iou(Tensor boxes1, Tensor boxes2) -> Tensor  [pt2_compliant_tag]
torchops::box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor  [pt2_compliant_tag]
torchops::carafe(Tensor features, Tensor masks, int kernel_size, int group_size, int scale_factor) -> Tensor  [pt2_compliant_tag]
torchops::d_sigmoid(Tensor z) -> Tensor  [pt2_compliant_tag]
torchops::deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor  [pt2_compliant_tag]
torchops::deform_roi_pool(Tensor input, Tensor rois, Tensor? offset, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, float gamma) -> Tensor  [pt2_compliant_tag]
torchops::fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, float lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, bool adamw, Tensor(f!)[]? master_params=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()  [pt2_compliant_tag]
torchops::fused_adam_.tensor_lr(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, bool adamw, Tensor(f!)[]? master_params=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()  [pt2_compliant_tag]
torchops::fused_add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()  [pt2_compliant_tag]
torchops::fused_linear_cross_entropy(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0., str reduction="mean", float lse_square_scale=0., float? softcap=None) -> Tensor  [pt2_compliant_tag]
torchops::fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffer_list, *, float weight_decay, float momentum, float lr, float dampening, bool nesterov, bool maximize, bool is_first_step, Tensor(d!)[]? master_params=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()  [pt2_compliant_tag]
torchops::fused_sgd_.tensor_lr(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffer_list, *, float weight_decay, float momentum, Tensor lr, float dampening, bool nesterov, bool maximize, bool is_first_step, Tensor(d!)[]? master_params=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()  [pt2_compliant_tag]
torchops::gelu_and_mul(Tensor x, str approximate="none") -> Tensor  [pt2_compliant_tag]
torchops::layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1.0000000000000001e-05) -> Tensor  [pt2_compliant_tag]
torchops::masked_conv2d(Tensor input, Tensor mask, Tensor weight, Tensor? bias=None, int[2] padding=0, int[2] stride=1, int[2] dilation=1, int groups=1) -> Tensor  [pt2_compliant_tag]
torchops::matmul(Tensor a, Tensor b) -> Tensor  [pt2_compliant_tag]
torchops::ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights) -> Tensor  [pt2_compliant_tag]
torchops::multi_tensor_l2norm(Tensor[] tensors, bool per_tensor=False) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::multi_tensor_scale_(Tensor(a!)[] tensors, float scale) -> ()  [pt2_compliant_tag]
torchops::multi_tensor_scale_.tensor(Tensor(a!)[] tensors, Tensor scale) -> ()  [pt2_compliant_tag]
torchops::nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::nms_padded(Tensor boxes, Tensor scores, float iou_threshold, Tensor? idxs=None) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::nms_rotated(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor  [pt2_compliant_tag]
torchops::rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor  [pt2_compliant_tag]
torchops::roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor  [pt2_compliant_tag]
torchops::roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, bool interleaved=False) -> (Tensor, Tensor)  [pt2_compliant_tag]
torchops::rotary_embedding_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, bool interleaved=False) -> ()  [pt2_compliant_tag]
torchops::scaled_masked_softmax(Tensor input, Tensor mask, float scale) -> Tensor  [pt2_compliant_tag]
torchops::scaled_upper_triang_masked_softmax(Tensor input, float scale) -> Tensor  [pt2_compliant_tag]
torchops::sigmoid_focal_loss(Tensor inputs, Tensor targets, float alpha=0.25, float gamma=2., str reduction="none") -> Tensor  [pt2_compliant_tag]
torchops::silu_and_mul(Tensor x) -> Tensor  [pt2_compliant_tag]
torchops::soft_nms(Tensor boxes, Tensor scores, float iou_threshold=0.29999999999999999, float sigma=0.5, float min_score=0.001, str method="gaussian") -> (Tensor, Tensor)  [pt2_compliant_tag]
""")


# --- Comments describe the present -------------------------------------------
# A comment or docstring in csrc/ or torchops/ says why the code is as it is
# now.  Dates, machine names, commit hashes and issue numbers belong in git's
# history (measured figures: docs/performance.md, or a docs/design.md line
# with the command that reproduces them).  Only comment text is scanned, so a
# hex constant or a float literal in code is not mistaken for a hash.
HISTORY_ROOTS = ("csrc", "torchops")
HISTORY_PATTERNS = (
    ("a date", re.compile(r"\b20\d\d-\d\d-\d\d\b")),
    ("a machine name", re.compile(r"\bH[12]00\b")),
    ("an issue reference", re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)),
    # 7-40 lowercase hex digits with at least one digit and one letter.
    ("a commit hash", re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")),
)


def cpp_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every `//` and `/* */` comment line, string and
    character literals skipped."""
    out: list[tuple[int, str]] = []
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i:end]))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for k, part in enumerate(text[i:end].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, end)
            i = end
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # digit separator 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every `#` comment and every docstring line (a string
    that is a statement of its own); other string literals are code."""
    import io
    import tokenize

    out: list[tuple[int, str]] = []
    statement_start = True
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and statement_start:
            for k, part in enumerate(tok.string.split("\n")):
                out.append((tok.start[0] + k, part))
        if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            statement_start = True
        elif tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING):
            statement_start = False
    return out


def history_in_comments(root: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """`path:line: <what>: <comment>` for each comment line under root's
    HISTORY_ROOTS that carries a date, a machine name, an issue reference or
    a commit hash.  `exclude`: path prefixes (relative to root) to skip."""
    problems = []
    for top in HISTORY_ROOTS:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if not path.is_file() or rel.startswith(exclude):
                continue
            if path.suffix == ".py":
                comments = python_comments(path.read_text())
            elif path.suffix in (".h", ".cuh", ".cpp", ".cu"):
                comments = cpp_comments(path.read_text())
            else:
                continue
            for line, comment in comments:
                for what, pattern in HISTORY_PATTERNS:
                    if pattern.search(comment):
                        problems.append(f"{rel}:{line}: {what}: {comment.strip()}")
    return problems


def test_comments_describe_the_present():
    problems = history_in_comments(README.parent)
    assert not problems, (
        "comments that carry history (dates, machine names, commit hashes, issue numbers); "
        "say why the code is as it is now, and put measured figures in docs/design.md "
        "with the command that reproduces them:\n" + "\n".join(problems))

def test_csrc_layering_and_no_harness_code():
    # The shared-math layer (csrc/common) never depends on the dispatcher
    # glue (csrc/dispatch); the matmul tuning harness's configs live in
    # scripts/matmul_dev, never behind a macro in the library's sources.
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    upward = [str(p.relative_to(csrc)) for p in (csrc / "common").rglob("*")
              if p.is_file() and re.search(r'#include\s+"dispatch/', p.read_text())]
    assert not upward, f"csrc/common includes csrc/dispatch: {upward}"
    harness = [str(p.relative_to(csrc)) for p in csrc.rglob("*")
               if p.is_file() and "TORCHOPS_MATMUL_DEV" in p.read_text()]
    assert not harness, f"harness-only code in the library's sources: {harness}"
