"""Finds, builds if needed, and loads torchops's native libraries, once.

Rule, per library: a prebuilt library whose manifest matches the running torch
is loaded; otherwise one from the JIT cache, built first if it is missing or
damaged (unless TORCHOPS_JIT=0, which never compiles but still uses what is
cached); otherwise one error lists everything tried and the fix.

What is loaded is executed, so the loader only loads what it can vouch for
(docs/design.md, "What the loader trusts"):

* a prebuilt library inside the package -- trusted as the package is -- whose
  size and sha256 match its manifest;
* a cached library whose file, folders and cache root belong to the current
  user and are writable by nobody else, and whose size and sha256 match its
  manifest.  Files are checked by reading them, never by mapping them: a
  truncated library that is mapped kills the process with SIGBUS.

Loading is idempotent.  PyTorch aborts the *process* when a second library
defines the ``torchops`` namespace, so this module never loads a second copy,
whatever the caller does, and refuses with a Python error when somebody else
already loaded one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchops import _build, envs
from torchops._build import Library

__all__ = ["LoadError", "LoadRecord", "load", "records", "jit_cache_dir", "describe_path"]

_lock = threading.RLock()
_records: dict[str, "LoadRecord"] = {}

_GO_WRITE = stat.S_IWGRP | stat.S_IWOTH


class LoadError(RuntimeError):
    """No usable torchops library could be loaded or built."""

    def __init__(self, message: str, tried: list[str] | None = None, fix: str = ""):
        super().__init__(message)
        self.tried = list(tried or [])
        self.fix = fix


class _CacheProblem(Exception):
    """The JIT cache cannot provide the library; str() is the "tried" line and
    `fix` the remedy, when it is not the generic one."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix


@dataclass
class LoadRecord:
    library: str
    loaded: bool = False
    path: Path | None = None
    how: str = ""     # "prebuilt", "jit-cache", "jit-built", "already-loaded", "skipped", "failed"
    tried: list[str] = field(default_factory=list)
    manifest: dict | None = None
    error: LoadError | None = None


def jit_cache_dir() -> Path:
    return _build.cache_root()


def _say(msg: str) -> None:
    print(f"torchops: {msg}", file=sys.stderr, flush=True)


def _namespace_defined() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw("torchops::matmul", "")
    except RuntimeError:
        return False
    return True


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_library(path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        # The useful part ("undefined symbol ...") is in the cause.
        cause = e.__cause__ or e
        raise LoadError(f"loading {path} failed: {cause}") from e


# -- integrity -------------------------------------------------------------------------

def _verify_file(path: Path, manifest: dict) -> tuple[str | None, bool]:
    """(why `path` is not the file its manifest describes, or None; whether it
    is damaged, as opposed to merely unverifiable)."""
    size, digest = manifest.get("library_size"), manifest.get("library_sha256")
    if not isinstance(size, int) or not isinstance(digest, str):
        return "its manifest records no size and sha256 (made by an older torchops)", False
    try:
        actual_size = os.stat(path).st_size
        # Size first: a truncated file is caught without reading it all.
        if actual_size != size:
            return (f"damaged: {actual_size} bytes, its manifest says {size}", True)
        actual = _build.file_sha256(path)
    except OSError as e:
        return f"unreadable: {e.strerror or e}", True
    if actual != digest:
        return (f"damaged: sha256 {actual[:16]}..., its manifest says {digest[:16]}...", True)
    return None, False


# -- ownership and modes (the checks ssh and ccache make) ------------------------------

def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def describe_path(path: Path) -> str:
    """`path (owner NAME, uid N, mode 0700)`, for messages and `doctor`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} (does not exist yet)"
    except OSError as e:
        return f"{path} ({e.strerror or e})"
    return (f"{path} (owner {_user(st.st_uid)}, uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):04o})")


def _who_can_write(mode: int) -> str:
    return " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
                        if mode & bit)


def _private_problem(path: Path, st: os.stat_result) -> str | None:
    """Inside the cache: ours alone.  Owner and mode bits, not access(): tests
    and CI run as root, for whom access() says yes to everything."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return (f"{path} is owned by {_user(st.st_uid)} (uid {st.st_uid}), not by you "
                f"({_user(uid)}, uid {uid})")
    if st.st_mode & _GO_WRITE:
        return (f"{path} can be written by {_who_can_write(st.st_mode)} "
                f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def _parent_problem(path: Path, st: os.stat_result) -> str | None:
    """Above the cache: ours or root's, and nobody else may replace what is in
    it -- a sticky folder (/tmp) only lets each user rename their own."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return (f"{path} is owned by {_user(st.st_uid)} (uid {st.st_uid}), neither you "
                f"(uid {uid}) nor root")
    if st.st_mode & _GO_WRITE and not st.st_mode & stat.S_ISVTX:
        return (f"{path} can be written by {_who_can_write(st.st_mode)} and is not sticky "
                f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def _untrusted(problem: str) -> _CacheProblem:
    return _CacheProblem(
        f"JIT cache refused: {problem}, so another user could put code there that "
        "torchops would run",
        fix="use a private cache: set TORCHOPS_CACHE_DIR to a folder that you own and only "
            "you can write (e.g. `mkdir -m 700 ~/.torchops-cache && export "
            "TORCHOPS_CACHE_DIR=~/.torchops-cache`), or make the folder named above yours "
            "and `chmod go-w` it")


def _trusted_root(root: Path) -> Path:
    """The cache root with symbolic links resolved, once it and every folder
    above it pass the checks; the loader then uses only the resolved path, so a
    link swapped after the check cannot redirect it."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows): nothing to check
        return root
    real = Path(os.path.realpath(root))
    problem = _private_problem(real, os.stat(real))
    for parent in real.parents:
        problem = problem or _parent_problem(parent, os.stat(parent))
    if problem:
        raise _untrusted(problem)
    return real


def _check_inside(real_root: Path, parts: tuple[str, ...]) -> None:
    """Each existing path from real_root down through `parts` is ours alone and
    not a link (torchops never makes links there)."""
    if not hasattr(os, "geteuid"):
        return
    path = real_root
    for part in parts:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise _untrusted(f"{path} is a symbolic link")
        problem = _private_problem(path, st)
        if problem:
            raise _untrusted(problem)


def _makedirs_private(path: Path) -> None:
    # Only the folders created here get 0700; an existing folder is judged by
    # the checks, not silently changed.
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def _make_private(tree: Path) -> None:
    # The compiler honours the umask (002 on some systems): clear group/other
    # write so the entry passes the loader's own checks once renamed in place.
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & _GO_WRITE:
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~_GO_WRITE)
    os.chmod(tree, 0o700)


# -- who is building -----------------------------------------------------------------------

def _write_builder(path: Path, lib: Library, final: Path) -> None:
    # A sidecar, not the lock file: filelock truncates the lock file itself.
    info = {"pid": os.getpid(), "host": socket.gethostname(), "library": lib.name,
            "folder": str(final), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)


def _describe_builder(path: Path) -> str:
    info = _read_json(path) or {}
    pid = info.get("pid")
    if not isinstance(pid, int):
        return "another process"
    host = info.get("host")
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "another process"  # a stale record of a builder that died
        except PermissionError:
            pass
        where = ""
    else:
        where = f" on {host}"
    return f"process {pid}{where} (started {info.get('started', '?')})"


def _acquire(lock, sidecar: Path, lib: Library, final: Path) -> None:
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
        return
    except Timeout:
        pass
    try:
        # The holder writes the sidecar just after it gets the lock.
        lock.acquire(timeout=1)
        return
    except Timeout:
        pass
    _say(f"waiting for {_describe_builder(sidecar)}, which is building {lib.name} in {final}")
    lock.acquire()


# -- the two sources -------------------------------------------------------------------------

def _try_prebuilt(lib: Library, csrc: Path | None, rec: LoadRecord) -> bool:
    if not envs.get("TORCHOPS_PREBUILT"):
        rec.tried.append("prebuilt: skipped (TORCHOPS_PREBUILT=0)")
        return False
    candidates = lib.prebuilt_candidates()
    if not candidates:
        rec.tried.append(f"prebuilt: none in {_build.PACKAGE_DIR}")
        return False
    for path in candidates:
        manifest = _read_json(Library.manifest_path(path))
        if manifest is None:
            rec.tried.append(f"prebuilt {path}: no readable manifest beside it")
            continue
        why = lib.manifest_mismatch(manifest, csrc)
        if not why:
            why, damaged = _verify_file(path, manifest)
            if damaged:
                # Otherwise a working JIT cache would hide a broken install.
                _say(f"not loading the installed {path}: {why}; reinstall torchops to repair it")
        if why:
            rec.tried.append(f"prebuilt {path}: {why}")
            continue
        _load_library(path)
        rec.loaded, rec.path, rec.how, rec.manifest = True, path, "prebuilt", manifest
        return True
    return False


def _jit(lib: Library, csrc: Path, rec: LoadRecord, verbose: bool, may_build: bool) -> None:
    """Load from the JIT cache, building the entry first when it is missing or
    damaged and `may_build`.

    Concurrency: an OS file lock (released by the kernel if the holder dies,
    so a killed build never leaves later ones hanging) serialises builders;
    each build happens in a private temporary folder that is renamed into
    place only when complete, so a reader never sees half a build.
    """
    from filelock import FileLock

    arch_list = _build.cuda_arch_list() if lib.cuda else None
    final = lib.jit_dir(csrc, arch_list)
    root = _build.cache_root()
    rel = final.relative_to(root).parts
    no_build = ("TORCHOPS_JIT=0 forbids compiling it here "
                "(`python -m torchops build` compiles it once, whatever TORCHOPS_JIT says)")
    if may_build:
        _makedirs_private(root)
    elif not root.is_dir():
        raise _CacheProblem(f"JIT cache: {root} does not exist; {no_build}")
    real_root = _trusted_root(root)
    if may_build:  # only below a root that passed: a refused cache is left as it is
        _check_inside(real_root, rel[:1])
        _makedirs_private(real_root / rel[0])
    real_final = real_root.joinpath(*rel)
    lib_file = lib.library_file(real_final)
    manifest_file = real_final / "manifest.json"

    def lookup() -> tuple[dict | None, str | None]:
        """(manifest, None): usable; (None, why): there but unusable; (None, None): absent."""
        _check_inside(real_root, rel)
        if not os.path.lexists(real_final):
            return None, None
        for f in (lib_file, manifest_file):
            _check_inside(real_root, (*rel, f.name))
            if not os.path.lexists(f):
                return None, f"incomplete: {f.name} is missing"
        m = _read_json(manifest_file)
        if m is None:
            return None, "its manifest is unreadable"
        why = lib.manifest_mismatch(m, None) or _verify_file(lib_file, m)[0]
        return (None, why) if why else (m, None)

    m, why = lookup()
    if m is None and not may_build:
        raise _CacheProblem(f"JIT cache {real_final}: {why or 'no build there'}; {no_build}")
    if m is None:
        lib.assert_compatible()
        sidecar = real_final.parent / f"{real_final.name}.builder"
        # mode: the lock file, like the folders, is nobody else's business.
        lock = FileLock(str(real_final) + ".lock", mode=0o600)
        _acquire(lock, sidecar, lib, real_final)
        try:
            _write_builder(sidecar, lib, real_final)
            m, why = lookup()
            if m is None:
                _build_entry(lib, csrc, arch_list, real_final, why, verbose)
                m = _read_json(manifest_file)
                rec.loaded, rec.path, rec.how, rec.manifest = True, lib_file, "jit-built", m
                return
        finally:
            try:
                sidecar.unlink()
            except OSError:
                pass
            lock.release()
    _load_library(lib_file)
    rec.loaded, rec.path, rec.how, rec.manifest = True, lib_file, "jit-cache", m


# The build's own state, besides the objects, that ninja needs to see them as
# up to date: without its log and dependency records it recompiles everything.
_NINJA_STATE = (".ninja_log", ".ninja_deps")


def _build_files(folder: Path) -> dict[str, str]:
    """sha256 of the compiled objects and ninja's records in a finished build
    folder: the manifest keeps them so that a rebuild can tell which are intact."""
    return {p.name: _build.file_sha256(p) for p in sorted(folder.iterdir())
            if p.is_file() and not p.is_symlink()
            and (p.name.endswith(".o") or p.name in _NINJA_STATE)}


def _keep_reusable(lib: Library, csrc: Path, arch_list: str | None, folder: Path) -> int:
    """Empty `folder` (a damaged entry, moved there under the lock) except for
    the objects and ninja records that a build now would produce: those its
    manifest lists, with the same sha256, when everything else that manifest
    records about the build (torchops, torch, CUDA, nvcc, Python, compiler,
    flags, arch list, sources hash) is what this build has.  ninja then
    recompiles only what is missing and relinks.  Returns how many objects
    are kept."""
    old = _read_json(folder / "manifest.json") or {}
    recorded = old.get("build_files")
    now = lib.manifest(csrc, built_by="jit", arch_list=arch_list)
    same = isinstance(recorded, dict) and all(
        old.get(k) == v for k, v in now.items() if k not in ("built_by", "built_at"))
    keep = set()
    for name, digest in (recorded.items() if same else ()):
        if not isinstance(digest, str) or os.path.basename(name) != name:
            continue
        path = folder / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode)
                and (not hasattr(os, "geteuid") or _private_problem(path, st) is None)
                and _build.file_sha256(path) == digest):
            keep.add(name)
    for entry in os.scandir(folder):
        if entry.name in keep:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    return sum(1 for name in keep if name.endswith(".o"))


def _build_entry(lib: Library, csrc: Path, arch_list: str | None, final: Path,
                 why: str | None, verbose: bool) -> None:
    """Build into a temporary folder and rename it to `final` (under the lock).

    A damaged entry is the temporary folder's start: it is moved there and
    keeps the compiled objects that are intact and current (`_keep_reusable`),
    so rebuilding a damaged library relinks it instead of compiling every
    source again."""
    # Any leftover temporary folder is from a dead build.
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    kept = 0
    try:
        if os.path.isdir(final) and not os.path.islink(final):
            os.rename(final, tmp)
            kept = _keep_reusable(lib, csrc, arch_list, tmp)
        elif os.path.lexists(final):
            os.unlink(final)
        objects = len(lib.sources(csrc))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LoadError(f"JIT build of {lib.name} failed: {e}") from e
    if why:
        if not kept:
            how = "a minute or two"
        elif kept >= objects:
            how = f"relinking its {kept} compiled objects, which are intact"
        else:
            how = (f"reusing the {kept} of its {objects} compiled objects that are intact, "
                   "compiling the others")
        _say(f"the cached {lib.name} in {final} is unusable ({why}); rebuilding it ({how}).")
    else:
        _say(f"building the {lib.description} for torch {torch.__version__} "
             f"(first use; this takes a minute or two) in {final}. "
             "To build ahead of time: `python -m torchops build`.")
    t0 = time.monotonic()
    try:
        # cpp_extension.load also loads the library (from tmp).
        built = lib.build_jit(csrc, tmp, arch_list, verbose=verbose)
        m = lib.manifest(csrc, built_by="jit", arch_list=arch_list,
                         library_file=lib.library_file(tmp))
        if built.resolve() != lib.library_file(tmp).resolve():
            raise RuntimeError(f"the build produced {built}, not {lib.library_file(tmp)}")
        m["build_files"] = _build_files(tmp)
        (tmp / "manifest.json").write_text(json.dumps(m, indent=2))
        _make_private(tmp)
        os.replace(tmp, final)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LoadError(f"JIT build of {lib.name} failed: {e}") from e
    # The GPU check reports this time (the limit is on the CUDA library's build).
    _say(f"built {lib.name} in {time.monotonic() - t0:.0f} s.")


def _load_one(lib: Library, verbose: bool, build: bool) -> LoadRecord:
    rec = LoadRecord(lib.name)
    csrc = _build.find_csrc()
    if _try_prebuilt(lib, csrc, rec):
        return rec
    jit_off = not envs.get("TORCHOPS_JIT")
    refusal = ""   # the remedy when the cache itself was refused
    if csrc is None:
        rec.tried.append("JIT cache: the C++ sources (csrc/) are not installed, so no "
                         "cached library can be found or built")
    else:
        try:
            _jit(lib, csrc, rec, verbose, may_build=build or not jit_off)
            return rec
        except _CacheProblem as e:
            rec.tried.append(str(e))
            refusal = e.fix
        except (RuntimeError, OSError) as e:
            rec.tried.append(f"JIT: {e}")
    reinstall = ("reinstall against the torch you run "
                 "(`pip install --no-build-isolation --force-reinstall --no-deps torchops`)")
    if refusal:
        # Allowing or running a build would meet the same refusal.
        fixes = [refusal, reinstall]
    else:
        fixes = [reinstall]
        if jit_off and not build:
            fixes.append("allow just-in-time builds (unset TORCHOPS_JIT; needs a C++ compiler"
                         + (" and nvcc" if lib.cuda else "") + ")")
        fixes.append("build it now with `python -m torchops build` (which compiles even "
                     "with TORCHOPS_JIT=0)")
    fix = "; or ".join(fixes)
    raise LoadError(
        f"torchops could not load its {lib.description} ({lib.name}). Tried:\n  - "
        + "\n  - ".join(rec.tried) + f"\nFix: {fix}.", tried=rec.tried, fix=fix)


def _failed(name: str, e: LoadError) -> LoadRecord:
    return LoadRecord(name, how="failed", tried=e.tried or [str(e)], error=e)


def load(verbose: bool = False, build: bool = False) -> dict[str, LoadRecord]:
    """Load the CPU library and, where torch has CUDA, the CUDA library.

    Safe to call any number of times, from any thread.  A failure is recorded
    (for `doctor`) and raised again by later calls.  `build=True` (used by
    `python -m torchops build`) retries failed libraries and compiles what is
    missing or damaged even with TORCHOPS_JIT=0.
    """
    with _lock:
        cpu = _records.get("torchops_cpu")
        if cpu is not None and cpu.error is not None and not build:
            raise cpu.error
        if cpu is None or not cpu.loaded:
            if _namespace_defined():
                loaded = [p for p in torch.ops.loaded_libraries if "torchops_cpu" in Path(p).name]
                if len(loaded) == 1:
                    # Ours, loaded before this module's state was reset
                    # (importlib.reload): adopt it rather than load again.
                    _records["torchops_cpu"] = LoadRecord(
                        "torchops_cpu", loaded=True, path=Path(loaded[0]), how="already-loaded")
                    return load(verbose, build)
                e = LoadError(
                    "the torchops operators are already registered by another copy of the "
                    f"library ({', '.join(loaded) or 'unknown path'}); loading a second one "
                    "would abort the process. Import torchops only once, from one install.")
                _records["torchops_cpu"] = _failed("torchops_cpu", e)
                raise e
            try:
                _records["torchops_cpu"] = _load_one(_build.CPU, verbose, build)
            except LoadError as e:
                _records["torchops_cpu"] = _failed("torchops_cpu", e)
                raise
        cuda = _records.get("torchops_cuda")
        if (cuda is not None and cuda.error is not None and not build
                and envs.get("TORCHOPS_CUDA") == "1"):
            raise cuda.error
        if cuda is None or (build and not cuda.loaded):
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
                    _records["torchops_cuda"] = _load_one(_build.CUDA, verbose, build)
                except LoadError as e:
                    _records["torchops_cuda"] = _failed("torchops_cuda", e)
                    if envs.get("TORCHOPS_CUDA") == "1":
                        raise
                    import warnings

                    warnings.warn(f"{e}\nCUDA kernels are unavailable; CPU kernels work.",
                                  stacklevel=3)
        return dict(_records)


def records() -> dict[str, LoadRecord]:
    with _lock:
        return dict(_records)
