"""Gates on the registry of environment variables (torchops/envs.py).

* Every ``TORCHOPS_*`` variable the code reads -- Python, C++ or shell -- is
  registered, and every registered variable is read, by the readers the
  registry names.
* Reads go through the two helpers: ``torchops.envs.get`` in Python,
  ``csrc/common/env.h`` in C++ (the matmul harness's own switches excepted).
* Every ``TORCHOPS_*`` variable that tests and scripts set is registered: a
  test that sets a misspelt switch fails here, not by testing the default
  path.
* The README's table and csrc/common/env_registry.h are what the registry
  generates (``python torchops/envs.py --write`` regenerates both).
* A value that is not allowed raises, naming the variable and the values it
  allows, in Python and in C++, with the same words.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torchops
from torchops import envs

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python torchops/envs.py --write"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# -- what the code reads ----------------------------------------------------------------

NAME = r"(TORCHOPS_[A-Z0-9_]*[A-Z0-9])"
PY_HELPER = re.compile(r"\benvs\.get\(\s*[\"']" + NAME + r"[\"']")
PY_RAW = [
    re.compile(r"(?:\bgetenv|\benviron\.get|\benviron\.setdefault|\benviron\.pop)\(\s*[\"']"
               + NAME + r"[\"']"),
    re.compile(r"\benviron\[\s*[\"']" + NAME + r"[\"']\s*\](?!\s*=[^=])"),   # not a store
    re.compile(r"[\"']" + NAME + r"[\"']\s+(?:not\s+)?in\s+(?:os\.)?environ\b"),
]
CPP_RAW = re.compile(r"\bgetenv\(\s*\"" + NAME + r"\"")
CPP_HELPER = re.compile(r"\benv::(k[A-Z]\w*)\b")
CPP_CALL = re.compile(r"\benv::(choice|flag|integer|integers)\(\s*[^;]*?\benv::(k[A-Z]\w*)\b")
SHELL_READ = re.compile(r"\$\{?" + NAME)
SHELL_DEFAULT = re.compile(r"\$\{" + NAME + r":-([^}]*)\}")
# Where Python sets a variable: setenv/delenv, os.environ[...] = , a keyword
# of dict(os.environ, ...), a dict key, or a constant naming it for later.
PY_SET = [re.compile(r"\b(?:setenv|delenv)\(\s*[\"']" + NAME),
          re.compile(r"\benviron\[\s*[\"']" + NAME + r"[\"']\s*\]\s*=[^=]"),
          re.compile(r"[(,]\s*" + NAME + r"=[^=]"),
          re.compile(r"[\"']" + NAME + r"[\"']\s*:"),
          re.compile(r"^\s*\w+\s*=\s*[\"']" + NAME + r"[\"']\s*$", re.M)]
SHELL_SET = re.compile(r"(?:^|[\s;(\"'])(?:export\s+)?" + NAME + r"=", re.M)

PY_SUFFIXES = (".py",)
CPP_SUFFIXES = (".cpp", ".h", ".cu", ".cuh", ".hpp", ".c")
SHELL_SUFFIXES = (".sh",)
HELPERS = {ROOT / "torchops" / "envs.py", ROOT / "csrc" / "common" / "env.h",
           ROOT / "csrc" / "common" / "env_registry.h"}
THIS_FILE = Path(__file__).resolve()  # reads and names made-up variables on purpose
CPP_KIND = {"choice": "choice", "flag": "bool", "integer": "int", "integers": "ints"}


def _kind(path: Path) -> str | None:
    if path.suffix in PY_SUFFIXES:
        return "python"
    if path.suffix in CPP_SUFFIXES:
        return "C++"
    if path.suffix in SHELL_SUFFIXES or path.name == "run.sh" or path.relative_to(ROOT) == Path(
            ".ci/run"):
        return "shell"
    return None


def code_files() -> list[tuple[Path, str]]:
    """Every Python, C++ and shell file of the repository, with its language."""
    files = [ROOT / "setup.py", ROOT / "run.sh"]
    for folder in ("torchops", "csrc", "scripts", "test", ".ci"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    out = []
    for p in files:
        if "__pycache__" in p.parts:
            continue
        kind = _kind(p)
        if kind is not None and p.resolve() != THIS_FILE:
            out.append((p, kind))
    return out


def _shell_code(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


def scan() -> dict:
    """reads: name -> {(language, path, via helper)}; sets: name -> {path};
    shell_defaults: (name, default, path); cpp_calls: (function, constant, path)."""
    by_constant = {envs.cpp_name(v): v.name for v in envs.cpp_variables()}
    reads: dict[str, set] = {}
    sets: dict[str, set] = {}
    shell_defaults, cpp_calls = [], []

    def read(name, lang, path, helper):
        reads.setdefault(name, set()).add((lang, path.relative_to(ROOT).as_posix(), helper))

    for path, lang in code_files():
        text = path.read_text(errors="replace")
        setters = PY_SET if lang == "python" else [SHELL_SET] if lang == "shell" else []
        for rx in setters:
            for name in rx.findall(text):
                sets.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
        if path in HELPERS:
            continue
        if lang == "python":
            for name in PY_HELPER.findall(text):
                read(name, lang, path, True)
            for rx in PY_RAW:
                for name in rx.findall(text):
                    read(name, lang, path, False)
        elif lang == "C++":
            for name in CPP_RAW.findall(text):
                read(name, lang, path, False)
            for constant in CPP_HELPER.findall(text):
                if constant in by_constant:
                    read(by_constant[constant], lang, path, True)
            cpp_calls += [(f, c, path.relative_to(ROOT).as_posix())
                          for f, c in CPP_CALL.findall(text)]
        else:
            code = _shell_code(text)
            for name in SHELL_READ.findall(code):
                read(name, lang, path, False)
            shell_defaults += [(n, d, path.relative_to(ROOT).as_posix())
                               for n, d in SHELL_DEFAULT.findall(code)]
    return dict(reads=reads, sets=sets, shell_defaults=shell_defaults, cpp_calls=cpp_calls)


@pytest.fixture(scope="module")
def scanned() -> dict:
    return scan()


def test_every_variable_read_is_registered(scanned):
    unknown = {n: sorted(p for _, p, _ in where) for n, where in scanned["reads"].items()
               if n not in envs.BY_NAME}
    assert not unknown, (f"TORCHOPS_* variables read but not registered in torchops/envs.py: "
                         f"{unknown}; add each to VARIABLES, then run `{REGENERATE}`")


def test_every_registered_variable_is_read_by_its_readers(scanned):
    problems = []
    for var in envs.VARIABLES:
        where = scanned["reads"].get(var.name, set())
        langs = {lang for lang, _, _ in where}
        if not where:
            problems.append(f"{var.name}: registered, but nothing reads it (remove it)")
        elif langs != set(var.read_by):
            problems.append(f"{var.name}: registered as read by {sorted(var.read_by)}, read by "
                            f"{sorted(langs)} ({sorted(p for _, p, _ in where)})")
    assert not problems, "\n".join(problems)


def test_reads_go_through_the_helpers(scanned):
    """Python through torchops.envs.get, the library's C++ through
    common/env.h: both validate.  The matmul harness reads its own."""
    raw = []
    for name, where in scanned["reads"].items():
        var = envs.BY_NAME.get(name)
        for lang, path, helper in where:
            if helper or lang == "shell" or (var is not None and var.audience == "harness"):
                continue
            raw.append(f"{path}: reads {name} directly; use "
                       + ("torchops.envs.get" if lang == "python" else "common/env.h"))
    assert not raw, "\n".join(sorted(raw))


def test_every_variable_set_is_registered(scanned):
    """What tests and scripts set: a misspelt switch would otherwise test the
    default path and pass."""
    stray = {n: sorted(paths) for n, paths in scanned["sets"].items() if n not in envs.BY_NAME}
    assert not stray, f"TORCHOPS_* variables set but not registered (torchops/envs.py): {stray}"
    assert len(scanned["sets"]) >= 10, "the scan finds too few settings: is it broken?"


def test_cpp_reads_match_the_variables_types(scanned):
    by_constant = {envs.cpp_name(v): v for v in envs.cpp_variables()}
    bad = []
    for function, constant, path in scanned["cpp_calls"]:
        var = by_constant.get(constant)
        if var is None:
            bad.append(f"{path}: env::{function} of {constant}, which is not generated")
        elif CPP_KIND[function] != var.type:
            bad.append(f"{path}: env::{function} reads {var.name}, a {var.type}")
    assert not bad, "\n".join(bad)


def test_shell_defaults_match_the_registry(scanned):
    bad = [f"{path}: ${{{name}:-{default}}}, but the registry's default is "
           f"{envs.BY_NAME[name].default!r}"
           for name, default, path in scanned["shell_defaults"]
           # A computed default ($(git ...)) is what the registry's `unset` describes.
           if name in envs.BY_NAME and "$" not in default
           and (envs.BY_NAME[name].default or "") != default]
    assert not bad, "\n".join(bad)


# -- generated files ----------------------------------------------------------------------

def test_readme_table_is_generated():
    text = envs.README.read_text()
    assert envs.README_BEGIN in text and envs.README_END in text, (
        f"README.md lacks the markers of the variables' table ({envs.README_BEGIN!r} ... "
        f"{envs.README_END!r})")
    assert envs.readme_with_table(text) == text, (
        f"README.md's table of variables differs from torchops/envs.py: run `{REGENERATE}`")


def test_cpp_registry_is_generated():
    assert envs.CPP_HEADER.read_text() == envs.render_cpp(), (
        f"csrc/common/env_registry.h differs from torchops/envs.py: run `{REGENERATE}`")


# -- invalid values ----------------------------------------------------------------------

def _message(var: envs.EnvVar, value: str) -> str:
    return f"{var.name}='{value}' is not {envs.allowed(var)}"


@pytest.mark.parametrize("name", [v.name for v in envs.VARIABLES if v.values or
                                  v.type in ("int", "ints")])
def test_python_rejects_a_value_not_allowed(name, monkeypatch):
    var = envs.BY_NAME[name]
    monkeypatch.setenv(name, "bogus")
    with pytest.raises(ValueError, match=re.escape(_message(var, "bogus"))):
        envs.get(name)
    for value in var.values:
        monkeypatch.setenv(name, value)
        envs.get(name)


def test_python_unset_and_empty_give_the_default(monkeypatch):
    monkeypatch.delenv("TORCHOPS_JIT", raising=False)
    assert envs.get("TORCHOPS_JIT") is True
    monkeypatch.setenv("TORCHOPS_JIT", "")
    assert envs.get("TORCHOPS_JIT") is True
    monkeypatch.setenv("TORCHOPS_JIT", "0")
    assert envs.get("TORCHOPS_JIT") is False
    monkeypatch.setenv("TORCHOPS_TESTING_CPU_CACHES", "1,2,3")
    assert envs.get("TORCHOPS_TESTING_CPU_CACHES") == (1, 2, 3)
    monkeypatch.setenv("TORCHOPS_TESTING_CPU_CACHES", "1,2,0")
    with pytest.raises(ValueError, match="3 comma-separated integers >= 1"):
        envs.get("TORCHOPS_TESTING_CPU_CACHES")
    with pytest.raises(KeyError):
        envs.get("TORCHOPS_NO_SUCH_VARIABLE")


def _roi_align(device):
    x = torch.randn(1, 2, 8, 8, device=device)
    rois = torch.tensor([[0, 1.0, 1.0, 6.0, 6.0]], device=device)
    return torchops.roi_align(x, rois, (2, 2), 1.0, 2)


def _matmul(device):
    return torchops.matmul(torch.randn(64, 64, device=device), torch.randn(64, 64, device=device))


def _deform_conv2d(device):
    x = torch.randn(2, 2, 5, 5, device=device)
    w = torch.randn(2, 2, 3, 3, device=device)
    offset = torch.zeros(2, 18, 3, 3, device=device)
    return torchops.deform_conv2d(x, offset, w)


def _deform_conv2d_backward(device):
    x = torch.randn(1, 2, 5, 5, device=device, requires_grad=True)
    w = torch.randn(2, 2, 3, 3, device=device)
    offset = torch.zeros(1, 18, 3, 3, device=device)
    torchops.deform_conv2d(x, offset, w).sum().backward()


def _masked_conv2d(device):
    x = torch.randn(1, 2, 6, 6, device=device)
    mask = torch.ones(1, 6, 6, device=device)
    return torchops.masked_conv2d(x, mask, torch.randn(3, 2, 3, 3, device=device), None,
                                  padding=1)


def _carafe(device):
    f = torch.randn(1, 2, 4, 4, device=device)
    m = torch.randn(1, 9, 8, 8, device=device).softmax(1)
    return torchops.carafe(f, m, 3, 1, 2)


def _causal_softmax(device):
    return torchops.scaled_upper_triang_masked_softmax(torch.randn(1, 8, 8, device=device), 1.0)


# (variable, a value it does not allow, the call that reads it, its op)
CPP_READS = [
    ("TORCHOPS_TESTING_ROI_ALIGN_WALK", "diagonal", _roi_align, "roi_align", "cpu"),
    ("TORCHOPS_TESTING_MATMUL_NARROW", "yes", _matmul, "matmul", "cpu"),
    ("TORCHOPS_TESTING_MATMUL_SHARED", "2", _matmul, "matmul", "cpu"),
    ("TORCHOPS_TESTING_MATMUL_DIRECT_B", "true", _matmul, "matmul", "cpu"),
    ("TORCHOPS_TESTING_DEFORM_COLUMN_BYTES", "0", _deform_conv2d, "deform_conv2d", "cpu"),
    ("TORCHOPS_TESTING_DEFORM_COLUMN_BYTES", "1MB", _deform_conv2d, "deform_conv2d", "cpu"),
    ("TORCHOPS_TESTING_MASKED_CONV_PATH", "fast", _masked_conv2d, "masked_conv2d", "cpu"),
    ("TORCHOPS_TESTING_MASKED_CONV_PATH", "fast", _masked_conv2d, "masked_conv2d", "cuda"),
    ("TORCHOPS_TESTING_MATMUL_PATH", "sm70", _matmul, "matmul", "cuda"),
    ("TORCHOPS_TESTING_CARAFE_PATH", "fast", _carafe, "carafe", "cuda"),
    ("TORCHOPS_TESTING_DEFORM_INPUT_GRAD", "sideways", _deform_conv2d_backward,
     "deform_conv2d", "cuda"),
    # softmax
    ("TORCHOPS_TESTING_SOFTMAX_PATH", "fast", _causal_softmax,
     "scaled_upper_triang_masked_softmax", "cuda"),
]


# fused linear cross-entropy
def _linear_cross_entropy(device):
    x, w = torch.randn(4, 8, device=device), torch.randn(6, 8, device=device)
    return torchops.fused_linear_cross_entropy(x, w, torch.randint(0, 6, (4,), device=device))


CPP_READS += [
    ("TORCHOPS_LCE_CHUNK_MIB", "0", _linear_cross_entropy, "fused_linear_cross_entropy", "cpu"),
    ("TORCHOPS_LCE_CHUNK_MIB", "0", _linear_cross_entropy, "fused_linear_cross_entropy",
     "cuda"),
    ("TORCHOPS_LCE_TARGET_CHECK", "never", _linear_cross_entropy, "fused_linear_cross_entropy",
     "cuda"),
]


@pytest.mark.parametrize(
    "name,value,call,op,device",
    [pytest.param(*r, marks=[cuda] if r[4] == "cuda" else [], id=f"{r[0]}-{r[1]}-{r[4]}")
     for r in CPP_READS])
def test_cpp_rejects_a_value_not_allowed(name, value, call, op, device, monkeypatch):
    """The C++ message is Python's, word for word, after the op's name."""
    var = envs.BY_NAME[name]
    monkeypatch.setenv(name, value)
    # A testing switch's message says so; a user variable's ends with the value.
    tail = " (a testing" if var.audience == "testing" else ""
    with pytest.raises(RuntimeError,
                       match=re.escape(f"torchops.{op}: {_message(var, value)}{tail}")):
        call(device)
    monkeypatch.delenv(name)
    call(device)
    monkeypatch.setenv(name, "")
    call(device)


def test_every_library_switch_has_a_rejection_test():
    """Each variable the library's C++ reads per call is exercised above (the
    CPU caches, read once per process: test_matmul's tiny-cache test)."""
    tested = {r[0] for r in CPP_READS} | {"TORCHOPS_TESTING_CPU_CACHES"}
    assert {v.name for v in envs.cpp_variables()} == tested
