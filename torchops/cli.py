"""``python -m torchops``: build, doctor, demo and bench.

* ``build``  -- build (or confirm) the native libraries now, so that the first
  ``import torchops`` in a job does not compile; it compiles even with
  TORCHOPS_JIT=0, so that "build ahead, then run with JIT off" works.
* ``doctor`` -- versions, which library was loaded from where, the cache
  folder, and every registered op with the dispatch keys that have kernels;
  when loading failed, every attempt, why it failed, and the fix.
* ``demo``   -- run every op once on small inputs and print the results.
* ``bench``  -- time every op against PyTorch and peer libraries
  (torchops/bench; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

import torchops
from torchops import _build, _loader

# Dispatch keys shown by `doctor`; read from the dispatcher, per op.
_KEYS = ("CPU", "CUDA", "Autograd", "AutogradCPU", "AutogradCUDA", "Meta",
         "AutocastCPU", "AutocastCUDA")


def registered_ops() -> list[str]:
    """Every operator of the torchops namespace, as the dispatcher knows them."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchops::"))


def has_fake(qualname: str) -> bool:
    entry = torch._library.simple_registry.singleton.find(qualname)
    return entry.fake_impl.kernel is not None


def kernel_keys(qualname: str) -> list[str]:
    return [k for k in _KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, k)]


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _require_loaded() -> None:
    if torchops.load_error is not None:
        print(torchops.load_error, file=sys.stderr)
        raise SystemExit(1)


def cmd_doctor(args: argparse.Namespace) -> int:
    print(f"torchops      {torchops.__version__}")
    print(f"python        {platform.python_version()} ({sys.executable})")
    print(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"C++ compiler  {_build.cxx_version() or 'not found'}")
    print(f"nvcc          {_build.nvcc_version() or 'not found'} ({_build.nvcc_path() or '-'})")
    print(f"sources       {_build.find_csrc() or 'not installed (JIT builds impossible)'}")
    # Owner and mode: the loader refuses a cache that others can write.
    print(f"JIT cache     {_loader.describe_path(_loader.jit_cache_dir())}")
    print()
    recs = _loader.records()
    for name in ("torchops_cpu", "torchops_cuda"):
        rec = recs.get(name)
        if rec is None:
            print(f"{name:14s}not attempted")
            continue
        where = f"{rec.how}: {rec.path}" if rec.loaded else ("NOT LOADED" if rec.how == "failed"
                                                             else rec.how or "not loaded")
        print(f"{name:14s}{where}")
        if rec.manifest:
            m = rec.manifest
            print(f"{'':14s}built by {m.get('built_by')} for torch {m.get('torch_version')}, "
                  f"CUDA {m.get('cuda_version')}, archs {m.get('arch_list')}, "
                  f"at {m.get('built_at')}")
        for t in rec.tried:
            print(f"{'':14s}tried: {t}")
    error = torchops.load_error
    if error is not None:
        text = str(error)
        if getattr(error, "fix", ""):
            # The attempts are listed above; their reasons and the fix suffice.
            print(f"\nLOAD ERROR: {text.splitlines()[0].removesuffix(' Tried:')}")
            print(f"Fix: {error.fix}.")
        else:
            print(f"\nLOAD ERROR: {text}")
        return 1
    rows = [[q, ", ".join(kernel_keys(q)), "yes" if has_fake(q) else "NO"]
            for q in registered_ops()]
    print()
    print(_table(rows, ["operator", "kernels", "fake"]))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    # Not _require_loaded(): the import may have failed for exactly the reason
    # this command fixes (nothing built yet and TORCHOPS_JIT=0, or a damaged
    # cache entry), so load again, allowed to compile.
    try:
        recs = _loader.load(build=True)
    except _loader.LoadError as e:
        print(f"torchops: {e}", file=sys.stderr)
        return 1
    status = 0
    for name, rec in recs.items():
        if rec.loaded:
            print(f"{name}: ready ({rec.how}: {rec.path})")
        else:
            print(f"{name}: not built -- {'; '.join(rec.tried)}")
            status = status or (1 if rec.how == "failed" else 0)
    return status


def cmd_demo(args: argparse.Namespace) -> int:
    _require_loaded()
    from torchops import demo

    demo.run(device=args.device)
    return 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    _require_loaded()
    from torchops.bench import command

    return command.main(args, argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m torchops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report versions, loaded libraries and registered ops")
    sub.add_parser("build", help="build the native libraries now (into the JIT cache)")
    demo = sub.add_parser("demo", help="run every op once and print the results")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: both where present)")
    from torchops.bench.command import add_parser as add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args, argv)
    return {"doctor": cmd_doctor, "build": cmd_build, "demo": cmd_demo}[args.command](args)
