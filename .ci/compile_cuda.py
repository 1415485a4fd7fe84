"""Compile every csrc/cuda source with nvcc, against the installed (CPU)
torch's headers, so CUDA compile errors fail CI on machines without a GPU.
Sources and flags come from torchops/_build.py, as the real builds use them;
nothing is linked or run."""

import importlib.util
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("torchops_build", ROOT / "torchops" / "_build.py")
_build = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = _build  # dataclasses look their module up here
spec.loader.exec_module(_build)


def main() -> int:
    nvcc = _build.nvcc_path()
    if nvcc is None:
        print("compile_cuda: nvcc not found", file=sys.stderr)
        return 1
    csrc = ROOT / "csrc"
    lib = _build.CUDA
    includes = [ROOT / ".ci" / "include", *lib.include_dirs(csrc),
                *map(Path, cpp_extension.include_paths())]
    # One real architecture keeps CI fast; the GPU machine builds the full list.
    # Host code at -O0: it is compiled only to be checked.  nvcc's -O is the
    # host compiler's level (device code is optimised regardless, ptxas
    # included), and nvcc puts it after any -Xcompiler flag, so the library's
    # -O3 is replaced, not followed by -Xcompiler -O0 (which it overrode:
    # roi_align.cu 95 -> 86 s).
    # Device code at -O0 as well (cicc and ptxas): every kernel is still
    # parsed, instantiated, lowered to PTX and assembled, inline PTX
    # included, which is what this check is for.  Optimised device builds
    # are the GPU check's (it builds at -O3); here they took most of the
    # time (matmul_sm90.cu 33 -> 8 s).
    flags = ["-O0" if f == "-O3" else f for f in lib.nvcc_flags()]
    flags += ["-Xcicc", "-O0", "-Xptxas", "-O0"]
    # -cuda stops before the host compiler compiles nvcc's generated host
    # code: every device pass still runs (cicc, ptxas: the device code is
    # built into the fatbinary), and the host code is still checked by
    # nvcc's own C++ front end (cudafe++), which reports host-side errors --
    # a wrong call or member in a dispatch lambda, a launch whose arguments
    # match no kernel -- as the host compiler would.  The host compiler's
    # pass parsed every torch header a third time, for a third of each
    # file's time.  The real builds (pip, JIT, the GPU check) compile the
    # host code with the host compiler.
    cmd = [nvcc, "-cuda", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
           *flags, *[f"-I{p}" for p in includes]]
    sources = lib.sources(csrc)
    if len(sys.argv) > 1:  # a subset: compile_cuda.py matmul.cu csrc/cuda/nms.cu ...
        wanted = {Path(a).name for a in sys.argv[1:]}
        unknown = wanted - {p.name for p in sources}
        if unknown:  # a typo must not pass as "0/0 compiled"
            print(f"compile_cuda: not CUDA sources of the library: {sorted(unknown)}",
                  file=sys.stderr)
            return 1
        sources = [p for p in sources if p.name in wanted]
    with tempfile.TemporaryDirectory() as out:
        def compile_one(src: Path):
            obj = Path(out) / (src.stem + ".cu.cpp.ii")  # -cuda's output: host code
            t0 = time.monotonic()
            r = subprocess.run([*cmd, str(src), "-o", str(obj)], capture_output=True, text=True)
            return src, r, time.monotonic() - t0
        failed = 0
        with ThreadPoolExecutor(max_workers=2) as pool:
            for src, r, secs in pool.map(compile_one, sources):
                status = "ok" if r.returncode == 0 else "FAILED"
                print(f"nvcc {src.relative_to(ROOT)}: {status} ({secs:.0f} s)", flush=True)
                if r.returncode != 0:
                    failed += 1
                    print(r.stdout + r.stderr, file=sys.stderr)
    print(f"compile_cuda: {len(sources) - failed}/{len(sources)} CUDA sources compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
