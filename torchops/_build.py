"""How torchops's two native libraries are built: the one place that lists
their sources and flags.

``setup.py`` (ahead-of-time build) and the runtime loader (just-in-time build)
both describe the libraries through :data:`LIBRARIES`, so the two builds can
never drift apart.  This module imports nothing from ``torchops`` itself:
``setup.py`` loads it by file path, before the package is importable.

Two libraries, so a CPU-only install works and CUDA stays optional:

* ``torchops_cpu``  -- the schemas (``csrc/schema.cpp``), autograd, autocast and
  CPU kernels;
* ``torchops_cuda`` -- the CUDA kernels (``csrc/cuda``, matmul's in
  ``csrc/cuda/matmul``); it registers kernels only and never defines the
  namespace, so it loads after ``torchops_cpu``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Library", "CPU", "CUDA", "LIBRARIES", "VERSION", "find_csrc", "file_fingerprint"]

VERSION = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent


def _envs():
    """torchops.envs, the registry of environment variables; loaded by path
    where this module was (importing the package would load the libraries)."""
    if __package__ == "torchops":
        from torchops import envs

        return envs
    module = sys.modules.get("torchops_envs")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("torchops_envs", PACKAGE_DIR / "envs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return module


envs = _envs()

# The architectures built when no GPU can be asked (CI, a build machine, or a
# JIT build that must not initialise CUDA): Turing .. Hopper (CUDA 13 has no
# Volta), plus PTX so newer GPUs can still run the code.  Hopper is always
# built as 9.0a: the matmul's wgmma/TMA path exists only in sm_90a code
# (see with_sm90a).
DEFAULT_CUDA_ARCHS = "7.5;8.0;8.6;8.9;9.0a;10.0+PTX"

MANIFEST_SUFFIX = ".manifest.json"


def find_csrc() -> Path | None:
    """The C++/CUDA source tree: ``csrc/`` beside the package in a checkout or
    editable install, ``torchops/csrc`` in a wheel (copied there by setup.py)."""
    for candidate in (PACKAGE_DIR.parent / "csrc", PACKAGE_DIR / "csrc"):
        if (candidate / "schema.cpp").is_file():
            return candidate
    return None


def _files(csrc: Path, subdirs: tuple[str, ...], suffixes: tuple[str, ...],
           recursive: bool) -> list[Path]:
    out: list[Path] = []
    for sub in subdirs:
        folder = csrc / sub if sub else csrc
        pattern = "**/*" if recursive else "*"
        out += [p for p in folder.glob(pattern) if p.suffix in suffixes and p.is_file()]
    return sorted(out)


GLUE_UNIT = "dispatch/all_ops.cpp"


def glue_unit(csrc: Path) -> Path:
    """dispatch/all_ops.cpp, after checking that it includes every glue file
    (dispatch/*_dispatch.cpp) and nothing else: a glue file left out would
    build fine and lose its op's autograd and autocast kernels."""
    unit = csrc / GLUE_UNIT
    if not unit.is_file():
        raise RuntimeError(f"torchops_cpu: {unit} is missing")
    listed = re.findall(r'^#include "dispatch/([^"]+)"', unit.read_text(), re.MULTILINE)
    present = sorted(p.name for p in (csrc / "dispatch").glob("*_dispatch.cpp"))
    missing = sorted(set(present) - set(listed))
    unknown = sorted(set(listed) - set(present))
    dupes = sorted({n for n in listed if listed.count(n) > 1})
    if missing or unknown or dupes:
        problems = [f"{what}: {names}" for what, names in
                    (("not included", missing), ("no such glue file", unknown),
                     ("included twice", dupes)) if names]
        raise RuntimeError(f"torchops_cpu: {unit} must include every dispatch/*_dispatch.cpp "
                           f"once ({'; '.join(problems)})")
    return unit


def sources_hash(csrc: Path) -> str:
    """Hash of every source and header under csrc: a header edit must rebuild."""
    h = hashlib.sha256()
    for path in _files(csrc, ("",), (".cpp", ".cu", ".h", ".cuh"), recursive=True):
        h.update(path.relative_to(csrc).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    # Plain reads, never mmap: a truncated library must not be able to raise
    # SIGBUS in the process that is checking it.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_fingerprint(path: Path) -> dict:
    """Size and sha256 of a built library, recorded in its manifest so that the
    loader can tell a damaged file (truncated, overwritten) before dlopen-ing it."""
    return {"library_size": os.stat(path).st_size, "library_sha256": file_sha256(path)}


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else None


def debug_symbols() -> bool:
    """TORCHOPS_DEBUG_SYMBOLS=1 builds libraries with debug information and
    symbols (AOT and JIT alike; the flags are part of the JIT cache key)."""
    return envs.get("TORCHOPS_DEBUG_SYMBOLS")


def cxx_compiler() -> str:
    return os.environ.get("CXX", "c++")


def cxx_version() -> str | None:
    return _first_line([cxx_compiler(), "--version"])


def cuda_home() -> str | None:
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


def nvcc_path() -> str | None:
    home = cuda_home()
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_version() -> str | None:
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    m = re.search(r"release ([\d.]+)", out.stdout)
    return m.group(1) if m else None


def cuda_arch_list() -> str:
    """Arch list for a CUDA build, without initialising CUDA in this process.

    TORCH_CUDA_ARCH_LIST wins; else the visible GPUs' capabilities as
    nvidia-smi reports them (a separate process, so no CUDA context here and
    fork-based data loaders keep working); else DEFAULT_CUDA_ARCHS.
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return with_sm90a(env)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30)
            caps = sorted({c.strip() for c in out.stdout.split() if re.fullmatch(r"\d+\.\d+", c.strip())})
            if out.returncode == 0 and caps:
                return with_sm90a(";".join(caps))
        except (OSError, subprocess.SubprocessError):
            pass
    return DEFAULT_CUDA_ARCHS


def with_sm90a(arch_list: str) -> str:
    """Hopper entries as 9.0a: a plain sm_90 cubin would hold the matmul's
    wgmma kernel as a trap, and beside a 9.0a cubin it leaves the driver a
    choice.  So "9.0+PTX" becomes 9.0a too (no compute_90 PTX: GPUs after
    Hopper get PTX from a later entry, as in DEFAULT_CUDA_ARCHS)."""
    out = []
    for arch in re.split(r"[;\s]+", arch_list.strip()):
        if arch in ("9.0", "9.0+PTX"):
            out.append("9.0a")
        elif arch:
            out.append(arch)
    return ";".join(dict.fromkeys(out))


def torch_tag() -> str:
    import torch

    return f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"


def cache_root() -> Path:
    """$TORCHOPS_CACHE_DIR, else $XDG_CACHE_HOME/torchops, else ~/.cache/torchops."""
    env = envs.get("TORCHOPS_CACHE_DIR")
    if env is not None:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "torchops"


@dataclass(frozen=True)
class Library:
    """One native library: its sources, flags, and how to build and find it."""

    name: str          # "torchops_cpu" or "torchops_cuda"
    cuda: bool         # built with nvcc, holds CUDA kernels
    description: str

    # -- sources and flags ---------------------------------------------------
    def sources(self, csrc: Path) -> list[Path]:
        if self.cuda:
            # matmul's translation units live with its headers, in cuda/matmul.
            files = _files(csrc, ("cuda", "cuda/matmul"), (".cu",), recursive=False)
        else:
            # The dispatcher glue files compile as one unit, through
            # dispatch/all_ops.cpp (it says why); first, as the longest job
            # (ninja starts jobs in this order).
            files = [glue_unit(csrc)] + _files(csrc, ("", "cpu"), (".cpp",), recursive=False)
        # cpp_extension.load names object files by basename only.
        stems = [p.stem for p in files]
        dupes = sorted({s for s in stems if stems.count(s) > 1})
        if dupes:
            raise RuntimeError(f"{self.name}: source basenames must be unique, "
                               f"repeated: {dupes}")
        return files

    def cxx_flags(self) -> list[str]:
        # -fopenmp: at::parallel_for is inline, and without it the OpenMP
        # pragmas inside it are dropped and every "parallel" loop runs on one
        # thread.
        flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
        if not self.cuda:
            flags.append("-fopenmp")
        # setuptools compiles with Python's -g: 40 MB of debug information
        # around 1 MB of code.  Release builds drop it (-g0 after -g wins);
        # TORCHOPS_DEBUG_SYMBOLS=1 keeps it, for gdb and perf.
        flags.append("-g" if debug_symbols() else "-g0")
        return flags

    def nvcc_flags(self) -> list[str]:
        flags = ["-O3", "-std=c++17", "--extended-lambda", "--expt-relaxed-constexpr",
                 "-lineinfo"]
        # The GPU check's racecheck build (csrc/cuda/matmul/tma.cuh says
        # why); part of the JIT cache key like every flag.
        if envs.get("TORCHOPS_TESTING_NO_SETMAXNREG"):
            flags.append("-DTORCHOPS_NO_SETMAXNREG")
        return flags

    def ld_flags(self) -> list[str]:
        # Link libstdc++ dynamically, ahead of anything the driver adds: some
        # toolchains (seen: a wrapped GCC 13 on the GPU machine) link it
        # statically, and a second, uninitialised copy of the iostream/locale
        # machinery inside our library segfaults the first time an error
        # message is formatted.
        # -s: no symbol table or debug sections in release libraries (the
        # dynamic symbols that loading needs stay).
        return (["-l:libstdc++.so.6"] + ([] if self.cuda else ["-fopenmp"])
                + ([] if debug_symbols() else ["-s"]))

    def include_dirs(self, csrc: Path) -> list[Path]:
        return [csrc]

    # -- availability ----------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why this library cannot be used with the running torch, or None."""
        if not self.cuda:
            return None
        import torch

        if envs.get("TORCHOPS_CUDA") == "0":
            return "TORCHOPS_CUDA=0"
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is a CPU-only build"
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def assert_compatible(self) -> None:
        """Raise if this library cannot be *built* here."""
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(f"{self.name}: {reason}")
        if self.cuda and nvcc_path() is None:
            raise RuntimeError(
                f"{self.name}: no CUDA compiler: nvcc was not found "
                "(set CUDA_HOME to the CUDA toolkit matching torch.version.cuda)")
        if self.cuda:
            import torch

            have = nvcc_version()
            want = torch.version.cuda
            if have and want and have.split(".")[0] != want.split(".")[0]:
                raise RuntimeError(
                    f"{self.name}: nvcc {have} does not match the CUDA {want} this "
                    "torch was built with (major versions must agree)")

    # -- manifest ----------------------------------------------------------------
    def manifest(self, csrc: Path, built_by: str, arch_list: str | None = None,
                 library_file: Path | None = None) -> dict:
        """What a build was made for; with `library_file`, also that file's size
        and sha256 (every manifest the loader trusts has them)."""
        import torch

        return {
            "library": self.name,
            "torchops_version": VERSION,
            "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda if self.cuda else None,
            "nvcc_version": nvcc_version() if self.cuda else None,
            "arch_list": arch_list if self.cuda else None,
            "compiler": cxx_version(),
            "python": platform.python_version(),
            "sources_hash": sources_hash(csrc),
            "flags": self.cxx_flags() + (self.nvcc_flags() if self.cuda else []),
            "built_by": built_by,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(file_fingerprint(library_file) if library_file is not None else {}),
        }

    def manifest_mismatch(self, manifest: dict, csrc: Path | None) -> str | None:
        """Why a library built with `manifest` cannot be loaded here, or None."""
        import torch

        if manifest.get("library") != self.name:
            return f"manifest is for {manifest.get('library')!r}"
        if manifest.get("torch_version") != torch.__version__:
            return (f"built for torch {manifest.get('torch_version')}, "
                    f"running torch {torch.__version__}")
        if self.cuda and manifest.get("cuda_version") != torch.version.cuda:
            return (f"built for CUDA {manifest.get('cuda_version')}, "
                    f"torch uses CUDA {torch.version.cuda}")
        if csrc is not None and manifest.get("sources_hash") != sources_hash(csrc):
            return f"sources in {csrc} changed since it was built"
        return None

    # -- ahead of time (setup.py) ---------------------------------------------------
    def build_aot(self, root: Path):
        """The setuptools extension for this library (paths relative to root)."""
        from torch.utils import cpp_extension

        csrc = root / "csrc"
        rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
        kwargs = dict(
            name=f"torchops._{self.name}",
            sources=[rel(p) for p in self.sources(csrc)],
            include_dirs=[str(d) for d in self.include_dirs(csrc)],
            extra_link_args=self.ld_flags(),
            # No Python C-API in these libraries: drop the libtorch_python link.
            py_limited_api=True,
        )
        if self.cuda:
            return cpp_extension.CUDAExtension(
                extra_compile_args={"cxx": self.cxx_flags(), "nvcc": self.nvcc_flags()},
                **kwargs)
        return cpp_extension.CppExtension(
            extra_compile_args={"cxx": self.cxx_flags()}, **kwargs)

    def prebuilt_candidates(self) -> list[Path]:
        return sorted(PACKAGE_DIR.glob(f"_{self.name}*.so"))

    @staticmethod
    def manifest_path(library_file: Path) -> Path:
        return library_file.with_name(library_file.name.split(".")[0] + MANIFEST_SUFFIX)

    # -- just in time ------------------------------------------------------------------
    def jit_key(self, csrc: Path, arch_list: str | None) -> str:
        h = hashlib.sha256()
        for part in (sources_hash(csrc), json.dumps(self.cxx_flags()),
                     json.dumps(self.nvcc_flags() if self.cuda else []),
                     json.dumps(self.ld_flags()), arch_list or "", cxx_compiler()):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def jit_dir(self, csrc: Path, arch_list: str | None) -> Path:
        """Cache folder keyed by everything that makes a build incompatible:
        torchops, torch, CPU/CUDA flavour, Python, sources, flags and archs."""
        import torch

        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        flavour = f"torchops{VERSION}-torch{torch.__version__.split('+')[0]}-{torch_tag()}-{py}"
        return cache_root() / flavour / f"{self.name}-{self.jit_key(csrc, arch_list)}"

    def library_file(self, folder: Path) -> Path:
        return folder / f"{self.name}.so"

    def build_jit(self, csrc: Path, folder: Path, arch_list: str | None,
                  verbose: bool = False) -> Path:
        """Compile into `folder` (which must not be in use by anyone else) with
        torch.utils.cpp_extension.load; this also loads the library into the
        process.  Returns the library path.  Objects already in `folder` are
        reused where ninja finds them up to date (its log and dependency
        records beside them): the loader leaves there only those of an
        identical build."""
        from torch.utils import cpp_extension

        # Private from the start: the folder is renamed into the cache, where
        # the loader refuses anything that others can write.
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        env_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if self.cuda:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list or DEFAULT_CUDA_ARCHS
        try:
            path = cpp_extension.load(
                name=self.name,
                sources=[str(p) for p in self.sources(csrc)],
                extra_cflags=self.cxx_flags(),
                extra_cuda_cflags=self.nvcc_flags() if self.cuda else None,
                extra_ldflags=self.ld_flags(),
                extra_include_paths=[str(d) for d in self.include_dirs(csrc)],
                build_directory=str(folder),
                with_cuda=self.cuda,
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            if self.cuda:
                if env_arch is None:
                    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
                else:
                    os.environ["TORCH_CUDA_ARCH_LIST"] = env_arch
        return Path(path) if path else self.library_file(folder)


CPU = Library("torchops_cpu", cuda=False,
              description="schemas, autograd and CPU kernels")
CUDA = Library("torchops_cuda", cuda=True, description="CUDA kernels")
LIBRARIES = (CPU, CUDA)


def stale_prebuilt(package_dir: Path, csrc: Path) -> str | None:
    """Why the libraries an editable install built into `package_dir` do not
    match the sources in `csrc` (and the running torch and flags), or None
    when every library that ``setup.py`` would build is there and current.
    ``run.sh`` asks this before reinstalling: pip builds an editable install
    from scratch, so reinstalling unchanged sources recompiles every kernel."""
    for lib in LIBRARIES:
        try:
            lib.assert_compatible()
        except RuntimeError:
            continue  # setup.py would not build it either
        found = sorted(package_dir.glob(f"_{lib.name}*.so"))
        if len(found) != 1:
            return f"{lib.name}: {len(found)} libraries in {package_dir}"
        try:
            manifest = json.loads(Library.manifest_path(found[0]).read_text())
        except (OSError, ValueError) as e:
            return f"{lib.name}: no readable manifest ({e})"
        reason = lib.manifest_mismatch(manifest, csrc)
        if reason is not None:
            return f"{lib.name}: {reason}"
        if manifest.get("flags") != lib.cxx_flags() + (lib.nvcc_flags() if lib.cuda else []):
            return f"{lib.name}: built with other flags"
    return None
