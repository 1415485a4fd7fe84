"""What the GPU check runs for each op family (scripts/gpu_check.sh with
GPU_CHECK_OPS=<families>): the family's ops, its own test file, and whether
its kernels include the Hopper matmul kernels that hand registers over with
``setmaxnreg`` (racecheck then needs a build without it).  The families and
their ops are the op database's (test/opdb/<family>.py); test_gpu_check.py
keeps this table in step with it.  No torch import: the script reads the
plan before anything is built.

    python scripts/gpu_check_families.py --shell basic,roi   # shell assignments
    python scripts/gpu_check_families.py --list               # the table

Every family's selection also takes the op database's generic tests
(GENERIC_FILES, whose test ids name the op) and the gates.
"""

from __future__ import annotations

import argparse
import shlex
import sys

# family -> (ops, the family's own test files (space-separated), runs the
# setmaxnreg kernels)
FAMILIES: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "basic": (("matmul", "d_sigmoid"), "test/test_matmul.py", True),
    "boxes": (("nms", "batched_nms", "nms_padded", "box_iou"), "test/test_boxes.py", False),
    "roi": (("roi_align", "roi_pool", "deform_roi_pool"), "test/test_roi.py", False),
    "losses": (("sigmoid_focal_loss", "fused_linear_cross_entropy"),
               "test/test_losses.py test/test_linear_cross_entropy.py", False),
    # deform_conv2d's 3xTF32 GEMM is the sm90 matmul kernel.
    "deform": (("deform_conv2d",), "test/test_deform.py", True),
    "masked_conv": (("masked_conv2d",), "test/test_masked_conv2d.py", False),
    "upsample": (("carafe",), "test/test_upsample.py", False),
    "norms": (("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm"),
              "test/test_norms.py", False),
    "softmax": (("scaled_masked_softmax", "scaled_upper_triang_masked_softmax"),
                "test/test_softmax.py", False),
    # activations
    "activations": (("silu_and_mul", "gelu_and_mul"), "test/test_activations.py", False),
    # rotary
    "rotary": (("rotary_embedding", "rotary_embedding_"), "test/test_rotary.py", False),
    "optim": (("fused_adam_", "fused_sgd_", "multi_tensor_l2norm", "multi_tensor_scale_"),
              "test/test_optim.py test/test_sgd.py test/test_optim_distributed.py "
              "test/test_clip_grad.py", False),
    # detection: multi-scale deformable attention
    "deform_attn": (("ms_deform_attn",), "test/test_deform_attn.py", False),
    # detection: rotated boxes and soft-NMS
    "rotated": (("box_iou_rotated", "nms_rotated", "batched_nms_rotated", "soft_nms"),
                "test/test_rotated.py", False),
}

# Test files generated from the op database (test ids carry the op's name),
# and the seeded fuzzer (its ids too); a missing one is left out.
GENERIC_FILES = ("test/test_ops.py", "test/test_export.py", "test/test_properties.py",
                 "test/test_modules.py", "test/test_fuzz.py", "test/test_sharding.py")

# A substring of the names of every kernel that runs setmaxnreg (their
# namespaces: sm90_detail, simt90_detail).  racecheck's instrumentation
# deadlocks on setmaxnreg, so a racecheck on the normal build leaves these
# kernels uninstrumented (--kernel-name-exclude); the families that own them
# racecheck a build without setmaxnreg instead.
SETMAXNREG_KERNELS = "90_detail"


def parse(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown:
        raise SystemExit(f"gpu_check: GPU_CHECK_OPS takes a comma list of op families, "
                         f"{', '.join(FAMILIES)}; got {spec!r}")
    return list(dict.fromkeys(names))


def plan(names: list[str], root: str = ".") -> dict[str, str]:
    import os

    ops = [op for n in names for op in FAMILIES[n][0]]
    own = [f for n in names for f in FAMILIES[n][1].split()]
    generic = [f for f in GENERIC_FILES if os.path.exists(os.path.join(root, f))]
    # pytest -k matches test ids (which name the op) and module names: the
    # family's own file is selected whole, the generic files by op name.
    modules = [os.path.splitext(os.path.basename(f))[0] for f in own]
    select = " or ".join(modules + ops)
    return {
        "FAMILY_NAMES": ",".join(names),
        "FAMILY_OPS": ",".join(ops),
        "FAMILY_TEST_FILES": " ".join(own + generic),
        "FAMILY_OWN_FILES": " ".join(own),
        "FAMILY_K": select,
        "FAMILY_SETMAXNREG": "1" if any(FAMILIES[n][2] for n in names) else "0",
        "SETMAXNREG_KERNELS": SETMAXNREG_KERNELS,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shell", metavar="FAMILIES", help="print the plan as shell assignments")
    p.add_argument("--list", action="store_true", help="print the families")
    args = p.parse_args(argv)
    if args.list or not args.shell:
        for name, (ops, own, smr) in FAMILIES.items():
            print(f"{name:12s} {','.join(ops):40s} {own}"
                  + ("  (racechecks a build without setmaxnreg)" if smr else ""))
        return 0
    for key, value in plan(parse(args.shell)).items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
