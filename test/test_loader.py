"""The just-in-time build and the loader, in fresh subprocesses with a
private cache folder (TORCHOPS_PREBUILT=0 hides the installed library)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

REPORT = """
import json, torch, torchops
from torchops import _loader
r = _loader.records()["torchops_cpu"]
# Loading again -- directly, after a module reload, or by path -- is harmless.
_loader.load(); _loader.load()
import importlib; importlib.reload(_loader); _loader.load()
torch.ops.load_library(str(r.path)) if r.how == "jit-cache" else None
x = torch.randn(4, 3); w = torch.randn(3, 2)
ok = torch.allclose(torchops.matmul(x, w), x @ w, atol=1e-5)
print("REPORT" + json.dumps({"how": r.how, "path": str(r.path), "ok": ok}))
"""

LOCK_AND_HANG = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("b", sys.argv[1] + "/torchops/_build.py")
b = importlib.util.module_from_spec(spec); sys.modules["b"] = b; spec.loader.exec_module(b)
from filelock import FileLock
final = b.CPU.jit_dir(b.find_csrc(), None)
final.parent.parent.mkdir(mode=0o700); final.parent.mkdir(mode=0o700)   # as the loader does
(final.parent / f".{final.name}.tmp-99999-dead").mkdir()   # a crashed build's leftovers
lock = FileLock(str(final) + ".lock", mode=0o600); lock.acquire()
print("LOCKED", flush=True); time.sleep(600)
"""


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, TORCHOPS_CACHE_DIR=str(cache), TORCHOPS_PREBUILT="0",
               TORCHOPS_CUDA="0")
    env.update(extra)
    return env


def _report(proc_out: str) -> dict:
    line = [ln for ln in proc_out.splitlines() if ln.startswith("REPORT")]
    assert line, proc_out
    return json.loads(line[-1][len("REPORT"):])


def _quick_cxx(folder: Path) -> str:
    """A compiler named c++ (so torch's compiler check takes it) that runs
    the real one with -O1 after the library's flags (the last -O wins).

    The JIT test is about the loader -- building under a lock, waiting,
    caching, refusing and rebuilding damaged entries -- not the optimiser:
    the library that the rest of the suite runs is the installed one, built
    at -O3.  At -O1 each compile takes about a quarter less; -O0 is no
    option (GCC 12 fails on the CPU kernels' multiversioned vector code
    there, an internal compiler error).  The wrapper's path is part of the
    cache key, like any compiler's, and every process of the test is given
    the same one."""
    import shlex
    import shutil

    real = shutil.which(os.environ.get("CXX", "c++"))
    assert real, "no C++ compiler"
    wrapper = folder / "quick" / "c++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(real)} "$@" -O1\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.slow
def test_jit_build_cache_and_concurrency(tmp_path):
    cache = tmp_path / "cache"
    cxx = _quick_cxx(tmp_path)
    # A builder killed while holding the lock must not block later builds.
    holder = subprocess.Popen([sys.executable, "-c", LOCK_AND_HANG, str(ROOT)],
                              stdout=subprocess.PIPE, text=True, env=_env(cache, CXX=cxx))
    assert holder.stdout.readline().strip() == "LOCKED"
    holder.send_signal(signal.SIGKILL)
    holder.wait()

    # Two processes started together: one builds, the other waits and loads.
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", REPORT], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(cache, CXX=cxx))
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    reports = [_report(o) for o in outs]
    assert sorted(r["how"] for r in reports) == ["jit-built", "jit-cache"], outs
    assert all(r["ok"] for r in reports)
    assert len({r["path"] for r in reports}) == 1
    builder = [r["how"] for r in reports].index("jit-built")
    builder_out = outs[builder]
    assert "python -m torchops build" in builder_out  # the user is told
    # ... and the other one is told whom it waits for.
    assert f"waiting for process {procs[builder].pid} " in outs[1 - builder], outs[1 - builder]
    folders = [p for p in cache.rglob("torchops_cpu-*") if p.is_dir()]
    assert len(folders) == 1, folders
    assert not list(cache.rglob(".*.tmp-*")), "temporary build folders left behind"
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    assert manifest["built_by"] == "jit" and manifest["sources_hash"]
    so = folders[0] / "torchops_cpu.so"
    assert manifest["library_size"] == so.stat().st_size and manifest["library_sha256"]
    # Private: folders 0700 (so nobody else can plant a library), lock files 0600,
    # and no builder record left behind.
    for folder in (cache, folders[0].parent, folders[0]):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    locks = list(cache.rglob("*.lock"))
    assert locks and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in locks)
    assert not list(cache.rglob("*.builder"))
    print(f"JIT build took {time.time() - t0:.0f} s")

    # A third process loads from the cache without compiling: with no compiler
    # or ninja on PATH any build attempt would fail.
    out = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True,
                         env=_env(cache, CXX=cxx, PATH="/nonexistent"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    r = _report(out.stdout)
    assert r["how"] == "jit-cache" and r["ok"]
    assert "building" not in out.stderr

    # A damaged entry is never mapped (a truncated library would be SIGBUS).
    # Overwritten bytes, with TORCHOPS_JIT=0: an error naming the damage and
    # the advertised fix.  (Cases without a build: test_loader_cache.py.)
    data = so.read_bytes()
    so.write_bytes(data[:1000] + bytes(b ^ 0xFF for b in data[1000:2000]) + data[2000:])
    out = subprocess.run([sys.executable, "-c", "import torchops"], capture_output=True,
                         text=True, env=_env(cache, CXX=cxx, TORCHOPS_JIT="0"), timeout=300)
    assert out.returncode == 1, out.stderr
    assert "damaged: sha256" in out.stderr and "python -m torchops build" in out.stderr

    # Truncated to half: that fix works, despite TORCHOPS_JIT=0 -- one line
    # says the entry is damaged, it is rebuilt under the lock -- and a later
    # JIT-off run loads the result without a compiler and computes right.
    # The rebuild keeps the entry's intact objects (the manifest lists each
    # with its sha256) and relinks; a damaged object -- schema.o, the
    # quickest to compile, truncated, so newer than its source and up to date
    # for ninja -- is compiled again, never linked in.
    objects = {p.name: p.stat().st_mtime_ns for p in folders[0].glob("*.o")}
    assert set(manifest["build_files"]) == {*objects, ".ninja_log", ".ninja_deps"}
    so.write_bytes(data[: len(data) // 2])
    schema_o = folders[0] / "schema.o"
    schema_o.write_bytes(schema_o.read_bytes()[:4096])
    out = subprocess.run([sys.executable, "-m", "torchops", "build"], capture_output=True,
                         text=True, env=_env(cache, CXX=cxx, TORCHOPS_JIT="0"), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    said = [ln for ln in out.stderr.splitlines() if "unusable" in ln]
    assert len(said) == 1 and "damaged" in said[0] and "rebuilding" in said[0], out.stderr
    assert f"reusing the {len(objects) - 1} of its {len(objects)} compiled objects" in said[0]
    assert f"torchops_cpu: ready (jit-built: {so})" in out.stdout, out.stdout + out.stderr
    rebuilt = {p.name: p.stat().st_mtime_ns for p in folders[0].glob("*.o")}
    assert rebuilt.keys() == objects.keys()
    assert [n for n in objects if rebuilt[n] != objects[n]] == ["schema.o"]
    new_object = schema_o.read_bytes()
    assert len(new_object) > 4096   # compiled again, and recorded as it is now
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    assert manifest["build_files"]["schema.o"] == hashlib.sha256(new_object).hexdigest()
    assert not list(cache.rglob(".*.tmp-*"))
    for path in (folders[0], *folders[0].iterdir()):
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, path
    out = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True,
                         env=_env(cache, CXX=cxx, TORCHOPS_JIT="0", PATH="/nonexistent"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    r = _report(out.stdout)
    assert r["how"] == "jit-cache" and r["ok"] and r["path"] == str(so)
    assert "unusable" not in out.stderr and "building" not in out.stderr


def test_no_prebuilt_and_no_jit_gives_one_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-c", "import torchops"], capture_output=True,
                         text=True, env=_env(tmp_path, TORCHOPS_JIT="0"), timeout=300)
    assert out.returncode != 0
    err = out.stderr
    assert "torchops could not load" in err
    assert "TORCHOPS_PREBUILT=0" in err and "TORCHOPS_JIT=0" in err
    assert "Fix:" in err and "python -m torchops build" in err


def test_doctor_lists_every_op_with_its_kernels():
    out = subprocess.run([sys.executable, "-m", "torchops", "doctor"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torchops_cpu" in out.stdout and "JIT cache" in out.stdout
    import torch

    import torchops  # noqa: F401

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchops::")]
    assert names
    for n in names:
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(n + " "))
        assert "CPU" in line and line.rstrip().endswith("yes"), line


def test_import_does_not_initialise_cuda():
    code = "import torch, torchops; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
