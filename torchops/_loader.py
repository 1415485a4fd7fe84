"""Finds, builds if needed, and loads torchops's native libraries, once.

Rule, per library: a prebuilt library whose manifest matches the running torch
is loaded; otherwise it is built just in time into the cache (unless
TORCHOPS_JIT=0); otherwise one error lists everything tried and the fix.

Loading is idempotent.  PyTorch aborts the *process* when a second library
defines the ``torchops`` namespace, so this module never loads a second copy,
whatever the caller does, and refuses with a Python error when somebody else
already loaded one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchops import _build
from torchops._build import Library

__all__ = ["LoadError", "LoadRecord", "load", "records", "jit_cache_dir"]

_lock = threading.RLock()
_records: dict[str, "LoadRecord"] = {}


class LoadError(RuntimeError):
    """No usable torchops library could be loaded or built."""


@dataclass
class LoadRecord:
    library: str
    loaded: bool = False
    path: Path | None = None
    how: str = ""                 # "prebuilt", "jit-cache", "jit-built" or "skipped"
    tried: list[str] = field(default_factory=list)
    manifest: dict | None = None


def _env_flag(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower()


def jit_cache_dir() -> Path:
    return _build.cache_root()


def _namespace_defined() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw("torchops::matmul", "")
    except RuntimeError:
        return False
    return True


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _load_library(path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        # The useful part ("undefined symbol ...") is in the cause.
        cause = e.__cause__ or e
        raise LoadError(f"loading {path} failed: {cause}") from e


def _try_prebuilt(lib: Library, csrc: Path | None, rec: LoadRecord) -> bool:
    if _env_flag("TORCHOPS_PREBUILT", "1") == "0":
        rec.tried.append("prebuilt: skipped (TORCHOPS_PREBUILT=0)")
        return False
    candidates = lib.prebuilt_candidates()
    if not candidates:
        rec.tried.append(f"prebuilt: none in {_build.PACKAGE_DIR}")
        return False
    for path in candidates:
        manifest = _read_manifest(Library.manifest_path(path))
        if manifest is None:
            rec.tried.append(f"prebuilt {path}: no readable manifest beside it")
            continue
        why = lib.manifest_mismatch(manifest, csrc)
        if why:
            rec.tried.append(f"prebuilt {path}: {why}")
            continue
        _load_library(path)
        rec.loaded, rec.path, rec.how, rec.manifest = True, path, "prebuilt", manifest
        return True
    return False


def _say(msg: str) -> None:
    print(f"torchops: {msg}", file=sys.stderr, flush=True)


def _jit(lib: Library, csrc: Path, rec: LoadRecord, verbose: bool) -> None:
    """Load from the JIT cache, building it first if no process has yet.

    Concurrency: an OS file lock (released by the kernel if the holder dies,
    so a killed build never leaves later ones hanging) serialises builders;
    each build happens in a private temporary folder that is renamed into
    place only when complete, so a reader never sees half a build.
    """
    from filelock import FileLock

    arch_list = _build.cuda_arch_list() if lib.cuda else None
    final = lib.jit_dir(csrc, arch_list)
    lib_file = lib.library_file(final)
    manifest_file = final / "manifest.json"

    def cached() -> dict | None:
        if lib_file.is_file() and manifest_file.is_file():
            m = _read_manifest(manifest_file)
            if m is not None and lib.manifest_mismatch(m, None) is None:
                return m
        return None

    m = cached()
    if m is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock"):
            m = cached()
            if m is None:
                # Under the lock: any leftover temporary folder is from a dead build.
                for stale in final.parent.glob(f".{final.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                if final.exists():
                    shutil.rmtree(final)
                tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                _say(f"building the {lib.description} for torch {torch.__version__} "
                     f"(first use; this takes a minute or two) in {final}. "
                     "To build ahead of time: `python -m torchops build`.")
                try:
                    # cpp_extension.load also loads the library (from tmp).
                    lib.build_jit(csrc, tmp, arch_list, verbose=verbose)
                    m = lib.manifest(csrc, built_by="jit", arch_list=arch_list)
                    (tmp / "manifest.json").write_text(json.dumps(m, indent=2))
                    os.replace(tmp, final)
                except Exception as e:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise LoadError(f"JIT build of {lib.name} failed: {e}") from e
                rec.loaded, rec.path, rec.how, rec.manifest = True, lib_file, "jit-built", m
                _say(f"built {lib.name}.")
                return
    _load_library(lib_file)
    rec.loaded, rec.path, rec.how, rec.manifest = True, lib_file, "jit-cache", m


def _load_one(lib: Library, verbose: bool) -> LoadRecord:
    rec = LoadRecord(lib.name)
    csrc = _build.find_csrc()
    if _try_prebuilt(lib, csrc, rec):
        return rec
    if _env_flag("TORCHOPS_JIT", "1") == "0":
        rec.tried.append("JIT build: disabled by TORCHOPS_JIT=0")
    elif csrc is None:
        rec.tried.append("JIT build: the C++ sources (csrc/) are not installed")
    else:
        try:
            lib.assert_compatible()
            _jit(lib, csrc, rec, verbose)
            return rec
        except (RuntimeError, OSError) as e:
            rec.tried.append(f"JIT build: {e}")
    raise LoadError(
        f"torchops could not load its {lib.description} ({lib.name}). Tried:\n  - "
        + "\n  - ".join(rec.tried)
        + "\nFix: reinstall against the torch you run "
        "(`pip install --no-build-isolation --force-reinstall --no-deps torchops`), "
        "or allow a just-in-time build (unset TORCHOPS_JIT; needs a C++ compiler"
        + (" and nvcc" if lib.cuda else "") + "), "
        "or build it now with `python -m torchops build`.")


def load(verbose: bool = False) -> dict[str, LoadRecord]:
    """Load the CPU library and, where torch has CUDA, the CUDA library.

    Safe to call any number of times, from any thread.
    """
    with _lock:
        if "torchops_cpu" not in _records:
            if _namespace_defined():
                loaded = [p for p in torch.ops.loaded_libraries if "torchops_cpu" in Path(p).name]
                if len(loaded) == 1:
                    # Ours, loaded before this module's state was reset
                    # (importlib.reload): adopt it rather than load again.
                    _records["torchops_cpu"] = LoadRecord(
                        "torchops_cpu", loaded=True, path=Path(loaded[0]), how="already-loaded")
                    return load(verbose)
                raise LoadError(
                    "the torchops operators are already registered by another copy of the "
                    f"library ({', '.join(loaded) or 'unknown path'}); loading a second one "
                    "would abort the process. Import torchops only once, from one install.")
            _records["torchops_cpu"] = _load_one(_build.CPU, verbose)
        if "torchops_cuda" not in _records:
            reason = _build.CUDA.unavailable_reason()
            loaded = [p for p in torch.ops.loaded_libraries if "torchops_cuda" in Path(p).name]
            if loaded:
                _records["torchops_cuda"] = LoadRecord(
                    "torchops_cuda", loaded=True, path=Path(loaded[0]), how="already-loaded")
            elif reason:
                _records["torchops_cuda"] = LoadRecord(
                    "torchops_cuda", how="skipped", tried=[f"skipped: {reason}"])
            else:
                try:
                    _records["torchops_cuda"] = _load_one(_build.CUDA, verbose)
                except LoadError as e:
                    if _env_flag("TORCHOPS_CUDA", "auto") == "1":
                        raise
                    import warnings

                    warnings.warn(f"{e}\nCUDA kernels are unavailable; CPU kernels work.",
                                  stacklevel=3)
                    _records["torchops_cuda"] = LoadRecord(
                        "torchops_cuda", how="failed", tried=[str(e)])
        return dict(_records)


def records() -> dict[str, LoadRecord]:
    with _lock:
        return dict(_records)
