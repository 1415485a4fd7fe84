"""The loader against damaged, foreign and busy JIT caches, without compiling.

Every case runs `import torchops` (or the CLI) in a fresh subprocess with a
private cache folder.  Instead of building, a cache entry is planted: a copy of
the installed (editable) prebuilt library, or a tiny C library whose
constructor leaves a marker file, with a manifest that matches in every
respect, size and sha256 included.  PATH=/nonexistent keeps any accidental
build from running: without ninja and a compiler it fails at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREBUILT = sorted((ROOT / "torchops").glob("_torchops_cpu*.so"))
needs_prebuilt = pytest.mark.skipif(
    not PREBUILT, reason="needs the editable install's torchops/_torchops_cpu*.so")

REPORT = """
import json, torch, torchops
from torchops import _loader
r = _loader.records()["torchops_cpu"]
x = torch.randn(4, 3); w = torch.randn(3, 2)
ok = torch.allclose(torchops.matmul(x, w), x @ w, atol=1e-5)
print("REPORT" + json.dumps({"how": r.how, "path": str(r.path), "ok": ok, "tried": r.tried,
                             "file": torchops.__file__}))
"""


def _build_module():
    # By path, as setup.py does: importing the package would load a library.
    spec = importlib.util.spec_from_file_location("torchops_build_for_tests",
                                                  ROOT / "torchops" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_b = _build_module()


def _entry(cache: Path, csrc: Path | None = None) -> Path:
    """The exact folder the loader uses for torchops_cpu under `cache`."""
    # _build.py read afresh: the key covers its flags, and the subprocess
    # that is to find this entry reads the file as it is now.
    b = _build_module()
    final = b.CPU.jit_dir(csrc or b.find_csrc(), None)
    return cache / final.relative_to(b.cache_root())


def _plant(cache: Path, so: Path, csrc: Path | None = None) -> Path:
    """A cache entry holding a copy of `so`, with a manifest that matches it."""
    final = _entry(cache, csrc)
    for folder in (cache, final.parent, final):
        folder.mkdir(mode=0o700, exist_ok=True)
    lib = _b.CPU.library_file(final)
    shutil.copyfile(so, lib)
    os.chmod(lib, 0o755)
    manifest = _b.CPU.manifest(csrc or _b.find_csrc(), built_by="jit", library_file=lib)
    (final / "manifest.json").write_text(json.dumps(manifest))
    return lib


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, TORCHOPS_CACHE_DIR=str(cache), TORCHOPS_PREBUILT="0",
               TORCHOPS_CUDA="0", PATH="/nonexistent")
    env.update(extra)
    return env


def _run(args: list[str], env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _py(code: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", code], env, cwd)


def _report(out: subprocess.CompletedProcess) -> dict:
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT")]
    assert line, out.stdout + out.stderr
    return json.loads(line[-1][len("REPORT"):])


def _corrupt(lib: Path, how: str) -> None:
    data = lib.read_bytes()
    if how == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    else:  # same size, some bytes in the middle overwritten
        mid = len(data) // 2
        lib.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 4096])
                        + data[mid + 4096:])


# -- TORCHOPS_JIT=0 and a filled cache ----------------------------------------------------

@needs_prebuilt
def test_jit_off_still_loads_a_filled_cache(tmp_path):
    cache = tmp_path / "cache"
    lib = _plant(cache, PREBUILT[0])
    out = _py(REPORT, _env(cache, TORCHOPS_JIT="0"))
    assert out.returncode == 0, out.stderr
    r = _report(out)
    assert r["how"] == "jit-cache" and r["ok"] and r["path"] == str(lib.resolve())
    assert "building" not in out.stderr


def test_build_command_compiles_even_with_jit_off(tmp_path):
    # No compiler on PATH: the build fails, but it must have been attempted,
    # and the failure is reported in a message, not a traceback.
    cache = tmp_path / "cache"
    out = _run([sys.executable, "-m", "torchops", "build"], _env(cache, TORCHOPS_JIT="0"))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "building the schemas" in out.stderr, text
    assert "JIT build of torchops_cpu failed" in out.stderr, text
    assert "Traceback" not in text


# -- damaged entries -------------------------------------------------------------------------

@needs_prebuilt
@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_damaged_cache_entry_is_never_loaded(tmp_path, damage):
    cache = tmp_path / "cache"
    lib = _plant(cache, PREBUILT[0])
    _corrupt(lib, damage)
    reason = "bytes, its manifest says" if damage == "truncated" else "sha256"

    # JIT off: a clear error from doctor (a mapped truncated library would be
    # SIGBUS: returncode -7), naming the entry and the fix.
    out = _run([sys.executable, "-m", "torchops", "doctor"], _env(cache, TORCHOPS_JIT="0"))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    tried = [ln for ln in out.stdout.splitlines() if "tried: JIT cache" in ln]
    assert len(tried) == 1 and "damaged" in tried[0] and reason in tried[0], text
    assert str(lib.parent) in tried[0]
    assert "Fix:" in out.stdout and "python -m torchops build" in out.stdout

    # JIT allowed: one line says the entry is damaged and is being rebuilt
    # (the rebuild itself fails here, with no compiler on PATH; the slow test
    # in test_loader.py rebuilds for real).
    out = _py("import torchops", _env(cache))
    assert out.returncode == 1, out.stderr
    said = [ln for ln in out.stderr.splitlines() if "unusable" in ln]
    assert len(said) == 1, out.stderr
    assert said[0].startswith("torchops: ") and "damaged" in said[0]
    assert "rebuilding" in said[0] and str(lib.parent) in said[0]
    assert "building the schemas" not in out.stderr  # no second announcement


@needs_prebuilt
def test_damaged_prebuilt_falls_back_to_the_jit_cache(tmp_path):
    # A copy of the package, so the installed library stays intact for the
    # other tests (and whoever else uses this checkout).
    pkg = tmp_path / "site"
    shutil.copytree(ROOT / "torchops", pkg / "torchops",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "csrc", pkg / "csrc")
    so = pkg / "torchops" / PREBUILT[0].name
    manifest_file = _b.Library.manifest_path(so)
    manifest = json.loads(manifest_file.read_text())
    # setup.py recorded what the loader verifies.
    assert manifest["library_size"] == so.stat().st_size
    assert manifest["library_sha256"] == _b.file_sha256(so)
    # Sources the other tests' engineer may be editing must not make this
    # copy "stale": pin the copied sources as the ones it was built from.
    manifest["sources_hash"] = _b.sources_hash(pkg / "csrc")
    manifest_file.write_text(json.dumps(manifest))

    cache = tmp_path / "cache"
    env = _env(cache, TORCHOPS_PREBUILT="1", TORCHOPS_JIT="0", PYTHONPATH=str(pkg))
    out = _py(REPORT, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    r = _report(out)
    assert r["file"].startswith(str(pkg)) and r["how"] == "prebuilt" and r["ok"], r

    _plant(cache, PREBUILT[0], csrc=pkg / "csrc")
    _corrupt(so, "overwritten")
    out = _py(REPORT, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    r = _report(out)
    assert r["how"] == "jit-cache" and r["ok"], r
    assert any(t.startswith(f"prebuilt {so}: damaged: sha256") for t in r["tried"]), r
    said = [ln for ln in out.stderr.splitlines() if "not loading the installed" in ln]
    assert len(said) == 1 and "reinstall" in said[0], out.stderr


# -- caches that others can write --------------------------------------------------------------

MARKER_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
"""


def _planted_library(tmp_path: Path) -> tuple[Path, Path | None]:
    """(library, marker): a library that leaves `marker` when loaded, or, with
    no C compiler, a copy of the prebuilt library and no marker."""
    cc = shutil.which("cc")
    if cc is None:
        if not PREBUILT:
            pytest.skip("needs a C compiler or the editable install's prebuilt library")
        return PREBUILT[0], None
    marker = tmp_path / "marker"
    src = tmp_path / "planted.c"
    src.write_text(MARKER_C)
    so = tmp_path / "planted.so"
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(so), str(src)],
                   check=True)
    return so, marker


def _chown_nobody(path: Path) -> None:
    os.chown(path, 65534, 65534)


# (how the cache is made unsafe, which path the error must name)
UNSAFE = {
    "root other-writable": (lambda c, e: os.chmod(c, 0o777), lambda c, e: c),
    "root group-writable": (lambda c, e: os.chmod(c, 0o770), lambda c, e: c),
    "entry group-writable": (lambda c, e: os.chmod(e, 0o770), lambda c, e: e),
    "parent other-writable, not sticky":
        (lambda c, e: os.chmod(c.parent, 0o777), lambda c, e: c.parent),
    "entry owned by uid 65534": (lambda c, e: _chown_nobody(e), lambda c, e: e),
    "library owned by uid 65534":
        (lambda c, e: _chown_nobody(_b.CPU.library_file(e)), lambda c, e: _b.CPU.library_file(e)),
}


@pytest.mark.parametrize("case", list(UNSAFE))
def test_cache_that_others_can_write_is_refused(tmp_path, case):
    if "uid 65534" in case and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    so, marker = _planted_library(tmp_path)
    cache = tmp_path / "shared" / "cache"
    cache.parent.mkdir(mode=0o700)
    lib = _plant(cache, so)
    make_unsafe, named = UNSAFE[case]
    make_unsafe(cache, lib.parent)

    out = _py("import torchops", _env(cache))   # JIT allowed: refusing must not build either
    assert out.returncode == 1, out.stderr
    if marker is not None:
        assert not marker.exists(), "the planted library was loaded"
    err = out.stderr
    refused = [ln for ln in err.splitlines() if "JIT cache refused" in ln]
    assert refused and f"{named(cache, lib.parent)} " in refused[0], err
    assert "TORCHOPS_CACHE_DIR" in err
    assert "building" not in err
    assert lib.is_file(), "a refused entry must be left alone"


@pytest.mark.parametrize("parent_mode", [0o700, 0o1777])
def test_private_cache_is_used(tmp_path, parent_mode):
    # The control for the test above: the same planted entry in a private
    # cache -- also below a sticky, world-writable folder like /tmp -- is
    # loaded, so the refusals are not an artefact of a wrong path or manifest.
    so, marker = _planted_library(tmp_path)
    cache = tmp_path / "shared" / "cache"
    cache.parent.mkdir()
    os.chmod(cache.parent, parent_mode)
    _plant(cache, so)
    out = _py("import torchops", _env(cache))
    if marker is not None:
        assert marker.exists(), out.stderr
    else:
        assert out.returncode == 0, out.stderr
    assert "JIT cache refused" not in out.stderr


# -- waiting for another builder -----------------------------------------------------------------

HOLD_LOCK = """
import importlib.util, json, os, shutil, socket, sys
spec = importlib.util.spec_from_file_location("b", sys.argv[1] + "/torchops/_build.py")
b = importlib.util.module_from_spec(spec); sys.modules["b"] = b; spec.loader.exec_module(b)
from filelock import FileLock
final = b.CPU.jit_dir(b.find_csrc(), None)
lock = FileLock(str(final) + ".lock"); lock.acquire()
(final.parent / (final.name + ".builder")).write_text(json.dumps(
    {"pid": os.getpid(), "host": socket.gethostname(), "started": "just now"}))
print("LOCKED", flush=True)
sys.stdin.readline()
shutil.copytree(sys.argv[2], final)   # "the build" finishes, then the lock is released
lock.release()
"""


@needs_prebuilt
def test_waiting_for_a_builder_names_it(tmp_path):
    cache = tmp_path / "cache"
    staged = _plant(tmp_path / "staging", PREBUILT[0]).parent
    _entry(cache).parent.mkdir(parents=True, mode=0o700)
    env = _env(cache)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ROOT), str(staged)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    waiter = None
    # If the waiter never says it waits, release it rather than hang the suite.
    guard = threading.Timer(120, holder.kill)
    guard.start()
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        waiter = subprocess.Popen([sys.executable, "-c", REPORT], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        seen = []
        for line in waiter.stderr:
            seen.append(line)
            if "waiting for" in line:
                break
        assert seen and f"waiting for process {holder.pid} " in seen[-1], seen
        assert "which is building torchops_cpu" in seen[-1]
        holder.stdin.write("\n")
        holder.stdin.flush()
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, "".join(seen) + err
        r = _report(subprocess.CompletedProcess([], 0, out, err))
        assert r["how"] == "jit-cache" and r["ok"]
    finally:
        guard.cancel()
        for p in (holder, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# -- doctor when loading failed: `python -m torchops` and the console script -------------------

def _console_script(tmp_path: Path) -> list[str]:
    installed = Path(sys.executable).parent / "torchops"
    if installed.is_file():
        return [str(installed)]
    # What pip generates for [project.scripts]: it imports torchops.cli while
    # sys.argv[0] is still the script's path.
    script = tmp_path / "bin" / "torchops"
    script.parent.mkdir()
    script.write_text("import re, sys\nfrom torchops.cli import main\n"
                      "sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "sys.exit(main())\n")
    return [sys.executable, str(script)]


@pytest.mark.parametrize("entry", ["python -m torchops", "torchops"])
def test_doctor_reports_a_failed_load(tmp_path, entry):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cmd = [sys.executable, "-m", "torchops"] if entry != "torchops" else _console_script(tmp_path)
    out = _run(cmd + ["doctor"], _env(cache, TORCHOPS_JIT="0"))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    lines = out.stdout.splitlines()
    st = cache.stat()
    assert f"JIT cache     {cache} (owner " in out.stdout
    assert f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})" in out.stdout
    cpu = lines.index(next(ln for ln in lines if ln.startswith("torchops_cpu")))
    assert "NOT LOADED" in lines[cpu]
    assert "tried: prebuilt: skipped (TORCHOPS_PREBUILT=0)" in lines[cpu + 1]
    assert "tried: JIT cache" in lines[cpu + 2] and "TORCHOPS_JIT=0" in lines[cpu + 2]
    fix = [ln for ln in lines if ln.startswith("Fix:")]
    assert fix and "python -m torchops build" in fix[0], text


def test_glue_unit_must_include_every_glue_file_once(tmp_path):
    """The dispatcher glue compiles through dispatch/all_ops.cpp; a glue file
    it leaves out would build and silently lose its op's autograd kernel."""
    real = _b.find_csrc()
    # The real tree passes, with the unit first (the longest compile).
    sources = _b.CPU.sources(real)
    assert sources[0] == real / _b.GLUE_UNIT
    assert not [p for p in sources if p.name.endswith("_dispatch.cpp")]

    csrc = tmp_path / "csrc"
    shutil.copytree(real, csrc)
    unit = csrc / _b.GLUE_UNIT
    text = unit.read_text()
    (csrc / "dispatch" / "new_op_dispatch.cpp").write_text("// a new op's glue\n")
    with pytest.raises(RuntimeError, match=r"not included: \['new_op_dispatch.cpp'\]"):
        _b.CPU.sources(csrc)
    unit.write_text(text + '#include "dispatch/new_op_dispatch.cpp"\n'
                    '#include "dispatch/gone_dispatch.cpp"\n')
    with pytest.raises(RuntimeError, match=r"no such glue file: \['gone_dispatch.cpp'\]"):
        _b.CPU.sources(csrc)
    unit.write_text(text + '#include "dispatch/new_op_dispatch.cpp"\n' * 2)
    with pytest.raises(RuntimeError, match="included twice"):
        _b.CPU.sources(csrc)
    unit.write_text(text + '#include "dispatch/new_op_dispatch.cpp"\n')
    assert csrc / "dispatch" / "new_op_dispatch.cpp" not in _b.CPU.sources(csrc)


def test_racecheck_build_flag_is_its_own_cache_entry(monkeypatch):
    """The GPU check's racecheck build (no setmaxnreg) compiles with its own
    define and lands in its own JIT cache entry, never in the product's."""
    csrc = _b.find_csrc()
    monkeypatch.delenv("TORCHOPS_TESTING_NO_SETMAXNREG", raising=False)
    plain_flags, plain_key = _b.CUDA.nvcc_flags(), _b.CUDA.jit_key(csrc, "9.0a")
    monkeypatch.setenv("TORCHOPS_TESTING_NO_SETMAXNREG", "1")
    assert "-DTORCHOPS_NO_SETMAXNREG" not in plain_flags
    assert "-DTORCHOPS_NO_SETMAXNREG" in _b.CUDA.nvcc_flags()
    assert _b.CUDA.jit_key(csrc, "9.0a") != plain_key
