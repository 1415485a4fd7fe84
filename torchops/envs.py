"""Every ``TORCHOPS_*`` environment variable, defined once: its type, default,
allowed values, meaning, audience and readers.

Python reads a variable through :func:`get`; C++ through ``csrc/common/env.h``,
whose table of names and allowed values (``csrc/common/env_registry.h``) and
the README's table of variables are generated from this file:

    python torchops/envs.py --write     # regenerate both
    python torchops/envs.py --check     # exit 1 if either is stale

Unset and empty mean the same: the default.  Any other value must be one the
variable allows, or reading it raises an error naming the variable and the
values it allows; a typo never silently selects the default.

This module imports nothing from torchops: ``setup.py`` and
``.ci/compile_cuda.py`` load ``_build.py``, which loads this file, by path,
before the package (whose import loads the libraries) can be imported.
test/test_envs.py keeps the registry, the code that reads each variable and
the generated files in step.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EnvVar", "VARIABLES", "get", "allowed", "render_readme", "render_cpp"]

# Who sets a variable: users; whoever builds the libraries; the test suite
# (switches that force one of an op's internal paths); CI and the repository's
# scripts; the matmul kernel harness (scripts/matmul_dev, its own builds only).
AUDIENCES = ("user", "build", "ci/script", "testing", "harness")
TYPES = ("bool", "choice", "str", "path", "int", "ints")
READERS = ("python", "C++", "shell")


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str                    # one of TYPES
    audience: str                # one of AUDIENCES
    read_by: tuple[str, ...]     # subset of READERS
    meaning: str                 # one line, for the README
    default: str | None = None   # the value unset means; None: see `unset`
    unset: str = ""              # what unset means where no value stands for it
    choices: tuple[str, ...] = ()  # "choice": the allowed values, the default first
    count: int = 1               # "ints": how many comma-separated integers
    minimum: int | None = None   # "int", "ints": the smallest allowed

    @property
    def values(self) -> tuple[str, ...]:
        """The allowed values of a bool or a choice; () for other types."""
        return ("0", "1") if self.type == "bool" else self.choices


def _v(name, type, audience, read_by, meaning, **kw) -> EnvVar:
    return EnvVar(name, type, audience, tuple(read_by.split(",")), meaning, **kw)


def _forced_path(name, meaning, *paths) -> EnvVar:
    """A testing switch, read by C++, that forces one of an op's internal paths;
    `auto`, the default, leaves the choice to the op."""
    return _v(name, "choice", "testing", "C++", meaning, default="auto",
              choices=("auto", *paths))


VARIABLES: tuple[EnvVar, ...] = (
    # -- users ---------------------------------------------------------------------------
    _v("TORCHOPS_JIT", "bool", "user", "python",
       "`0` forbids compiling at import: a library already in the JIT cache (say, from "
       "`python -m torchops build`) still loads, a missing one is an error", default="1"),
    _v("TORCHOPS_PREBUILT", "bool", "user", "python",
       "`0` ignores installed prebuilt libraries", default="1"),
    _v("TORCHOPS_CACHE_DIR", "path", "user", "python",
       "the JIT cache; it must belong to you and be writable by nobody else",
       unset="`$XDG_CACHE_HOME/torchops`, i.e. `~/.cache/torchops`"),
    _v("TORCHOPS_LCE_CHUNK_MIB", "int", "user", "C++",
       "the most memory, in MiB, a chunk of fused_linear_cross_entropy's logits may take "
       "(never more than a quarter of the free memory): larger chunks make fewer, larger "
       "GEMMs (read at each call; docs/design.md)",
       unset="512 on CUDA, 32 on CPU", minimum=1),
    _v("TORCHOPS_LCE_TARGET_CHECK", "choice", "user", "C++",
       "how CUDA fused_linear_cross_entropy checks its targets: `sync` raises a RuntimeError "
       "for a target outside [0, V) that is not ignore_index, at the cost of one host sync "
       "per call; `nan` never syncs, and such a token's loss and gradients are NaN (also "
       "what `sync` does while a CUDA graph is being captured) (read at each call)",
       default="sync", choices=("sync", "nan")),
    _v("TORCHOPS_TORCH_PIP_ARGS", "str", "user", "shell",
       "`./run.sh`: pip options for installing torch where none is installed (for example "
       "an index of CPU-only wheels)", unset="none"),
    # -- building ------------------------------------------------------------------------
    _v("TORCHOPS_CUDA", "choice", "build", "python",
       "`auto`: build and load the CUDA library when torch has CUDA and `nvcc` is found; "
       "`1`: require it; `0`: CPU only", default="auto", choices=("auto", "1", "0")),
    _v("TORCHOPS_DEBUG_SYMBOLS", "bool", "build", "python",
       "`1` builds the libraries with debug information and symbols (release builds are "
       "stripped: about 1 MB instead of 40)", default="0"),
    # -- CI and scripts ------------------------------------------------------------------
    _v("TORCHOPS_TORCH_VERSION", "str", "ci/script", "shell",
       "`./run.sh`: the torch version it installs where none is installed", default="2.13.0"),
    _v("TORCHOPS_COMMIT", "str", "ci/script", "python,shell",
       "the commit that benchmark reports and `scripts/gpu_check.sh` name, for a copied "
       "working tree without `.git`", unset="`git` asked"),
    # -- tests ---------------------------------------------------------------------------
    _v("TORCHOPS_TEST_PROFILE", "choice", "testing", "python",
       "the test suite's profile: `full` adds larger samples and more hypothesis examples "
       "(as `pytest --full` does; docs/testing.md)", default="ci", choices=("ci", "full")),
    _v("TORCHOPS_TESTING_NO_SETMAXNREG", "bool", "testing", "python",
       "`1` builds the CUDA library without the Hopper kernels' register hand-over "
       "(`setmaxnreg`), on which compute-sanitizer's racecheck deadlocks; the GPU check's "
       "racecheck runs such a JIT build (its own cache entry; docs/design.md)", default="0"),
    _forced_path("TORCHOPS_TESTING_MATMUL_PATH",
                 "a named path becomes the CUDA matmul's first choice wherever it can run the "
                 "call (read at each call; docs/design.md)",
                 "decode", "sm90", "sm80", "simt"),
    _v("TORCHOPS_TESTING_MATMUL_NARROW", "bool", "testing", "C++",
       "`1` runs the CPU matmul's 32-byte (AVX2/SSE) kernels even on an AVX-512 CPU "
       "(read at each call)", unset="the widest kernels the CPU has"),
    _v("TORCHOPS_TESTING_MATMUL_DIRECT_B", "bool", "testing", "C++",
       "`1` / `0` makes the CPU matmul's micro-kernel read a row-major B in place / from a "
       "packed copy for any number of rows (read at each call)", unset="chosen by size"),
    _v("TORCHOPS_TESTING_MATMUL_SHARED", "bool", "testing", "C++",
       "`1` / `0` takes / avoids the CPU matmul's shared schedule (every block packed once "
       "for all threads) for any single matrix (read at each call; docs/design.md)",
       unset="chosen by size"),
    _v("TORCHOPS_TESTING_CPU_CACHES", "ints", "testing", "C++",
       "`L1,L2,L3`: the per-core cache sizes in bytes that the CPU matmul derives its "
       "block sizes from, so tests can force many small blocks (read once per process)",
       unset="detected", count=3, minimum=1),
    _forced_path("TORCHOPS_TESTING_ROI_ALIGN_WALK",
                 "every RoI of the CPU roi_align walks its taps the named way, and a RoI that "
                 "walk cannot serve raises (read at each call)",
                 "sparse", "four", "dense"),
    _forced_path("TORCHOPS_TESTING_DEFORM_INPUT_GRAD",
                 "forces deform_conv2d's CUDA input-gradient path outside deterministic mode "
                 "(read at each call; docs/design.md)",
                 "atomic", "gather"),
    _v("TORCHOPS_TESTING_DEFORM_COLUMN_BYTES", "int", "testing", "C++",
       "bytes of deform_conv2d's column buffer per chunk of images: a small value runs the "
       "multi-chunk paths on small problems (read at each call)",
       unset="the built-in budget (`kColumnBytes`, csrc/common/deform_conv2d.h)", minimum=1),
    _forced_path("TORCHOPS_TESTING_CARAFE_PATH",
                 "forces the CUDA carafe's kernels: `generic` everywhere, or `tiled`, which "
                 "raises where the tiled kernels cannot run the call (read at each call)",
                 "generic", "tiled"),
    _forced_path("TORCHOPS_TESTING_MASKED_CONV_PATH",
                 "forces masked_conv2d's forward path: `sparse` (the selected positions only) or "
                 "`dense` (the library's convolution, then the mask) (read at each call)",
                 "sparse", "dense"),
    # -- softmax (scaled_masked_softmax, scaled_upper_triang_masked_softmax) ------------
    _forced_path("TORCHOPS_TESTING_SOFTMAX_PATH",
                 "forces the CUDA masked softmaxes' kernels (forward and backward): `warp` "
                 "(a row in a warp's registers) or `chunked` (a row streamed twice in 16-byte "
                 "packs) where they can run the call, else `block`; `block` everywhere "
                 "(read at each call)",
                 "warp", "chunked", "block"),
    # -- the matmul kernel harness (scripts/matmul_dev/README.md; its own builds only) ------
    _v("TORCHOPS_DEV_SM80_CFG", "int", "harness", "C++",
       "the sm80 path's tile config, an index of its harness table", unset="automatic"),
    _v("TORCHOPS_DEV_SIMT_CFG", "int", "harness", "C++",
       "the simt path's tile config, an index of its harness table", unset="automatic"),
    _v("TORCHOPS_DEV_SIMT_SPLITS", "int", "harness", "C++",
       "the simt path's split-K count", unset="automatic"),
    _v("TORCHOPS_DEV_SIMT90", "choice", "harness", "C++",
       "the simt path's Hopper kernel: `0` never, `2` wherever it can run",
       default="1", choices=("1", "0", "2")),
    _v("TORCHOPS_DEV_DECODE_CFG", "int", "harness", "C++",
       "the decode path's config, an index of its harness table", unset="automatic"),
    _v("TORCHOPS_DEV_DECODE_CLUSTER", "bool", "harness", "C++",
       "`0` keeps the decode path's two-kernel split-K", default="1"),
    _v("TORCHOPS_DEV_SM90", "str", "harness", "C++",
       "`BN,STORE[,TM]` pins the sm90 path's tile choice", unset="automatic"),
    _v("TORCHOPS_DEV_SM90_SPLITS", "int", "harness", "C++",
       "the sm90 path's split-K count", unset="automatic"),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


# -- reading ------------------------------------------------------------------------------

_INT = re.compile(r"-?[0-9]+")


def allowed(var: EnvVar) -> str:
    """The allowed values, in the words of the error (and of csrc/common/env.h)."""
    if var.values:
        return "one of " + ", ".join(var.values)
    if var.type == "int":
        return f"an integer >= {var.minimum}" if var.minimum is not None else "an integer"
    if var.type == "ints":
        bound = f" >= {var.minimum}" if var.minimum is not None else ""
        return f"{var.count} comma-separated integers{bound}"
    return "any text"


def _reject(var: EnvVar, raw: str) -> ValueError:
    hint = " (a testing switch; unset it for normal use)" if var.audience == "testing" else ""
    return ValueError(f"torchops: {var.name}='{raw}' is not {allowed(var)}{hint}")


def _parse(var: EnvVar, raw: str):
    if var.type == "bool":
        if raw not in var.values:
            raise _reject(var, raw)
        return raw == "1"
    if var.type == "choice":
        if raw not in var.values:
            raise _reject(var, raw)
        return raw
    if var.type in ("int", "ints"):
        parts = raw.split(",")
        want = 1 if var.type == "int" else var.count
        if (len(parts) != want or not all(_INT.fullmatch(p) for p in parts)
                or (var.minimum is not None and min(int(p) for p in parts) < var.minimum)):
            raise _reject(var, raw)
        return int(parts[0]) if var.type == "int" else tuple(int(p) for p in parts)
    if var.type == "path":
        return Path(raw).expanduser()
    return raw


def get(name: str):
    """The value of the variable `name`, parsed: bool, str (a choice or text),
    Path, int or tuple of ints; its default when unset or empty (None where it
    has none).  Raises ValueError, naming the variable and the values it
    allows, for any other value; KeyError for a name the registry lacks."""
    var = BY_NAME[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return None if var.default is None else _parse(var, var.default)
    return _parse(var, raw)


# -- generated files ---------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CPP_HEADER = ROOT / "csrc" / "common" / "env_registry.h"
README_BEGIN = "<!-- envs:begin (generated by `python torchops/envs.py --write`) -->"
README_END = "<!-- envs:end -->"
# The README lists what users, builders, CI and tests set; the harness's own
# variables are documented with the harness.
README_AUDIENCES = ("user", "build", "ci/script", "testing")


def _values_cell(var: EnvVar) -> str:
    if var.values:
        cells = [f"`{v}`" + (" (default)" if v == var.default else "") for v in var.values]
        text = ", ".join(cells)
    elif var.type == "path":
        text = "a folder"
    elif var.type == "str":
        text = "text" + (f" (default `{var.default}`)" if var.default is not None else "")
    else:
        text = allowed(var)
    return text + (f"; unset: {var.unset}" if var.unset else "")


def render_readme() -> str:
    """The README's table of variables, between its markers."""
    rows = [README_BEGIN, "| variable | for | values | effect |", "| --- | --- | --- | --- |"]
    for audience in README_AUDIENCES:
        for var in VARIABLES:
            if var.audience == audience:
                rows.append(f"| `{var.name}` | {var.audience} | {_values_cell(var)} "
                            f"| {var.meaning} |")
    rows.append(README_END)
    return "\n".join(rows)


def cpp_name(var: EnvVar) -> str:
    """The C++ constant of `var`: TORCHOPS_TESTING_CARAFE_PATH -> kTestingCarafePath."""
    return "k" + "".join(w.capitalize() for w in var.name.removeprefix("TORCHOPS_").split("_"))


def cpp_variables() -> list[EnvVar]:
    """The variables the library's C++ reads through csrc/common/env.h (the
    harness reads its own)."""
    return [v for v in VARIABLES if "C++" in v.read_by and v.audience != "harness"]


_CPP_KIND = {"bool": "kFlag", "choice": "kChoice", "int": "kInt", "ints": "kInts"}


def render_cpp() -> str:
    """csrc/common/env_registry.h."""
    out = [
        "// Generated from torchops/envs.py by `python torchops/envs.py --write`: do not edit.",
        "// The environment variables that the library's C++ reads, each with the",
        "// values it allows; common/env.h reads them.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace torchops::env {",
        "",
        "enum class EnvKind { kFlag, kChoice, kInt, kInts };",
        "",
        "struct EnvVar {",
        "  const char* name;",
        "  EnvKind kind;",
        "  const char* const* values;  // kFlag, kChoice: the allowed values, the default first",
        "  int count;                  // how many values (kInts: integers)",
        "  int64_t minimum;            // kInt, kInts: the smallest allowed",
        "  bool testing;               // a testing switch",
        "};",
        "",
    ]
    for var in cpp_variables():
        if var.type not in _CPP_KIND:
            raise ValueError(f"{var.name}: C++ reads no variable of type {var.type}")
        name = cpp_name(var)
        values = "nullptr"
        count = var.count
        if var.values:
            out.append(f"inline constexpr const char* {name}Values[] = "
                       "{" + ", ".join(f'"{v}"' for v in var.values) + "};")
            values, count = f"{name}Values", len(var.values)
        minimum = var.minimum if var.minimum is not None else "INT64_MIN"
        out.append(f"inline constexpr EnvVar {name} = {{\n"
                   f'    "{var.name}", EnvKind::{_CPP_KIND[var.type]}, {values}, {count}, '
                   f"{minimum}, {str(var.audience == 'testing').lower()}}};")
    out += ["", "}  // namespace torchops::env", ""]
    return "\n".join(out)


def readme_with_table(text: str) -> str:
    begin, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:begin] + render_readme() + text[end:]


def _main(argv: list[str]) -> int:
    if argv not in (["--write"], ["--check"]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    wanted = {README: readme_with_table(README.read_text()), CPP_HEADER: render_cpp()}
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if argv == ["--check"]:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run `python torchops/envs.py --write`")
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


def _check_registry() -> None:
    for var in VARIABLES:
        assert var.name.startswith("TORCHOPS_"), var.name
        assert var.type in TYPES and var.audience in AUDIENCES, var.name
        assert var.read_by and set(var.read_by) <= set(READERS), var.name
        assert (var.type == "choice") == bool(var.choices), var.name
        # C++ takes index 0 for unset: a choice's default is its first value.
        assert var.type != "choice" or var.default == var.choices[0], var.name
        assert var.default is None or _parse(var, var.default) is not None, var.name
        assert (var.default is None) != (var.unset == ""), f"{var.name}: default xor unset"
    assert len(BY_NAME) == len(VARIABLES), "a variable is defined twice"


_check_registry()

if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
