"""`python -m torchops demo` (./run.sh demo): every op and every module, each
beside its reference with steady-state times, and no warnings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import torchops
from torchops import demo

ROOT = Path(__file__).resolve().parents[1]
OPS = ("matmul", "d_sigmoid", "nms", "batched_nms", "nms_padded", "box_iou", "roi_align", "roi_pool",
       "deform_roi_pool", "sigmoid_focal_loss", "deform_conv2d", "masked_conv2d", "carafe",
       "rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm", "rotary_embedding",
       "rotary_embedding_", "silu_and_mul", "gelu_and_mul", "scaled_masked_softmax",
       "scaled_upper_triang_masked_softmax", "fused_linear_cross_entropy", "fused_adam_",
       "ms_deform_attn", "fused_sgd_", "box_iou_rotated", "nms_rotated", "batched_nms_rotated",
       "soft_nms", "multi_tensor_l2norm", "multi_tensor_scale_")


def test_demo_shows_every_op_and_module_without_warnings(capsys, monkeypatch):
    monkeypatch.setattr(demo, "MIN_RUN_TIME", 0.002)   # the content, not the timings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        demo.run(device="cpu")
    out = capsys.readouterr().out
    public_ops = {name for name in torchops.ops.__all__
                  if hasattr(torch.ops.torchops, name)}
    assert public_ops == set(OPS), "the demo's list of ops is torchops's"
    for name in OPS + tuple(torchops.modules.__all__):
        assert re.search(rf"^  {name}[ (]", out, re.M), f"{name} missing from the demo"
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    for ln in lines:
        # every line: an error check and two steady-state times
        assert re.search(r"max\|err\|=|identical", ln), ln
        assert "DIFFERENT" not in ln, ln
        assert len(re.findall(r"\d+\.\d+ ms", ln)) == 2, ln


def test_cli_prints_no_numpy_warning_without_numpy(tmp_path):
    # A bare environment without numpy: `import torch` warns "Failed to
    # initialize NumPy"; with -W error the warning would be an exception.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoNumpy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy' or name.startswith('numpy.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoNumpy())\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-W", "error", "-m", "torchops", "demo", "--help"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "NumPy" not in out.stderr, out.stderr
    # The filter is the command line's only: the library keeps torch's warning.
    lib = subprocess.run([sys.executable, "-c", "import torchops"], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "Failed to initialize NumPy" in lib.stderr
