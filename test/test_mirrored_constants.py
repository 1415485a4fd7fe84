"""Constants that the Python fakes (torchops/ops.py) and the C++ checks both
hold stay equal: each pair below is compared, the C++ side parsed from its
``constexpr``.  A new mirrored bound is one line in MIRRORED; every public
UPPER_CASE number of torchops/ops.py must have its line."""

from __future__ import annotations

import ast
import importlib
import numbers
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (Python module, its constant, C++ file, its constexpr)
MIRRORED = [
    ("torchops.ops", "MAX_SAMPLING_RATIO", "csrc/common/roi.h", "kMaxSamplingRatio"),
    ("torchops.ops", "MAX_CONV_ARGUMENT", "csrc/common/checks.h", "kConvArgumentMax"),
]

_LIMITS = {f"{s}int{b}_t": (0 if s else -(2 ** (b - 1)), 2 ** b - 1 if s else 2 ** (b - 1) - 1)
           for s in ("", "u") for b in (8, 16, 32, 64)}


def cpp_constant(path: Path, name: str):
    """The value of `constexpr <type> name = <expr>;` in `path`: integer and
    floating literals, casts, std::numeric_limits<intN_t>::max()/min() and
    arithmetic."""
    text = path.read_text()
    found = re.findall(r"\bconstexpr\s+[\w:<>\s]+?\b" + name + r"\s*=\s*([^;]+);", text)
    assert len(found) == 1, f"{path}: {len(found)} constexpr definitions of {name}"
    expr = found[0]
    expr = re.sub(r"std::numeric_limits<\s*(u?int\d+_t)\s*>::(max|min)\(\)",
                  lambda m: str(_LIMITS[m.group(1)][m.group(2) == "max"]), expr)
    expr = re.sub(r"static_cast<[\w:\s]+>", "", expr)
    expr = re.sub(r"\b(?:std::)?(?:u?int\d+_t|size_t|int|long|unsigned|double|float)\s*\(",
                  "(", expr)
    expr = re.sub(r"\b(\d+)(?:[uU]?[lL]{0,2}|[lL]{1,2}[uU])\b", r"\1", expr)
    tree = ast.parse(expr.strip(), mode="eval")
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.LShift: lambda a, b: a << b,
           ast.RShift: lambda a, b: a >> b,
           ast.Div: lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) else a / b}

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, numbers.Number):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise AssertionError(f"{path}: cannot evaluate {name} = {expr.strip()}")

    return value(tree.body)


@pytest.mark.parametrize("module,py_name,cpp_file,cpp_name", MIRRORED,
                         ids=[m[1] for m in MIRRORED])
def test_python_and_cpp_constants_agree(module, py_name, cpp_file, cpp_name):
    py_value = getattr(importlib.import_module(module), py_name)
    cpp_value = cpp_constant(ROOT / cpp_file, cpp_name)
    assert py_value == cpp_value, (f"{module}.{py_name} = {py_value}, but {cpp_file} "
                                   f"{cpp_name} = {cpp_value}: they must agree")


def test_every_public_constant_of_the_fakes_is_mirrored():
    tree = ast.parse((ROOT / "torchops" / "ops.py").read_text())
    public = {t.id for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)
              and re.fullmatch(r"[A-Z][A-Z0-9_]*", t.id)}
    listed = {py for module, py, _, _ in MIRRORED if module == "torchops.ops"}
    assert public <= listed, (f"torchops/ops.py constants without their C++ twin in "
                              f"MIRRORED: {sorted(public - listed)}")


def test_the_parser_reads_the_forms_the_sources_use(tmp_path):
    src = tmp_path / "x.h"
    src.write_text("constexpr int64_t kA = int64_t(256) << 20;\n"
                   "inline constexpr int kB = std::numeric_limits<int32_t>::max();\n"
                   "constexpr int64_t kC = 64;\nconstexpr double kD = 1.5 * 2;\n"
                   "static constexpr uint32_t kE = 7u - 2;\n")
    assert cpp_constant(src, "kA") == 256 << 20
    assert cpp_constant(src, "kB") == 2**31 - 1
    assert cpp_constant(src, "kC") == 64
    assert cpp_constant(src, "kD") == 3.0
    assert cpp_constant(src, "kE") == 5
