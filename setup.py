"""Ahead-of-time build of torchops.

    pip install --no-build-isolation .        # or -e . for development

--no-build-isolation builds against the torch you run (build isolation would
download another, possibly multi-GB CUDA, torch and build against that).

TORCHOPS_CUDA=auto (default) builds the CUDA library when torch has CUDA and
nvcc is found; 1 requires it; 0 skips it.  The sources and flags of both
libraries come from torchops/_build.py, which the runtime JIT build uses too.
"""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_build_module():
    # By path: importing the torchops package would load its libraries.
    spec = importlib.util.spec_from_file_location("torchops_build", ROOT / "torchops" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()


def extensions():
    want_cuda = _build.envs.get("TORCHOPS_CUDA")
    libs = [_build.CPU]
    if want_cuda != "0":
        try:
            _build.CUDA.assert_compatible()
            libs.append(_build.CUDA)
            # Always through cuda_arch_list: it keeps a user's list but turns
            # its 9.0 into 9.0a (a plain sm_90 build would run the matmul's
            # Hopper kernel as a trap).
            os.environ["TORCH_CUDA_ARCH_LIST"] = _build.cuda_arch_list()
        except RuntimeError as e:
            if want_cuda == "1":
                raise
            print(f"torchops: not building the CUDA library: {e}", file=sys.stderr)
    return libs


class BuildPy(build_py):
    """Also ship csrc/ inside the package, so an installed torchops can still
    build itself just in time for another torch."""

    def run(self):
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "torchops" / "csrc"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / "csrc", target)


def make_build_ext(libs):
    from torch.utils.cpp_extension import BuildExtension

    by_ext_name = {f"torchops._{lib.name}": lib for lib in libs}

    class BuildExt(BuildExtension):
        """Writes a manifest beside each library: what it was built for."""

        def build_extension(self, ext):
            lib = by_ext_name[ext.name]
            arch = os.environ.get("TORCH_CUDA_ARCH_LIST") if lib.cuda else None
            # The sources' hash as the compiler is about to read them: a source
            # edited during the build must leave the library stale, not current.
            manifest = lib.manifest(ROOT / "csrc", built_by="aot", arch_list=arch)
            super().build_extension(ext)
            out = Path(self.get_ext_fullpath(ext.name))
            # Size and sha256 of the library: the loader checks them before
            # loading it, so a damaged install falls back instead of crashing.
            manifest.update(_build.file_fingerprint(out))
            _build.Library.manifest_path(out).write_text(json.dumps(manifest, indent=2))

        def copy_extensions_to_source(self):
            # Editable installs copy each library into the source tree; its
            # manifest must travel with it.
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace, regular = self._get_inplace_equivalent(build_py, ext)
                src = _build.Library.manifest_path(Path(regular))
                if src.is_file():
                    shutil.copyfile(src, _build.Library.manifest_path(Path(inplace)))

    return BuildExt


libs = extensions()
setup(
    ext_modules=[lib.build_aot(ROOT) for lib in libs],
    cmdclass={"build_ext": make_build_ext(libs), "build_py": BuildPy},
    # The abi3 tag names the oldest Python the wheel installs on: the one
    # pyproject's requires-python names.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
