"""``python -m torchops bench``: options, what the run ran on, and what it writes."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from torchops import envs

DESCRIPTION = """\
Time every torchops operator against its eager PyTorch reference, torch.compile
of that reference and the peers (torchvision, PyTorch's native ops,
Liger-Kernel, the vendor BLAS) where installed. Prints a table, writes
bench.csv, bench.json and (with matplotlib) bench.png into --out, and with
--write-doc the Markdown of docs/performance.md. Method: docs/benchmarks.md."""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the ops against PyTorch and peers",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--device", help="cpu, cuda or 'cuda,cpu' (default: cuda if available, else cpu)")
    add("--op", action="append", metavar="NAME",
        help="only this op or case (repeatable, or comma-separated; default: all)")
    add("--quick", action="store_true", help="one small size per case, short timings (seconds)")
    add("--slow", action="store_true", help="also time the slow alternatives (torchvision's "
        "deterministic roi_align backward: tens of seconds and GBs)")
    add("--no-compile", action="store_true", help="skip the torch.compile variants")
    add("--min-time", type=float, metavar="S",
        help="seconds of timed calls per variant (default 0.1 on CUDA, 0.15 on CPU)")
    add("--time-budget", type=float, metavar="S",
        help="start no new row after S seconds (the rest are reported as not run)")
    add("--threads", metavar="LIST", help="CPU thread counts for every CPU row, e.g. '1' or "
        "'1,2,all' (default: each case's own; 'all' is torch's default count)")
    add("--out", default="bench-results", metavar="DIR",
        help="folder for bench.csv, bench.json, bench.png (default: %(default)s)")
    add("--write-doc", metavar="PATH", help="also write the report as Markdown (performance.md)")
    add("--merge-doc", action="store_true", help="with --write-doc: merge this run's sections "
        "into the existing file (the others stay; a 'run' column names each row's run)")
    add("--strict", action="store_true", help="exit with status 1 when torchops failed on a row "
        "or its output disagreed with an alternative's")
    add("--list", action="store_true", help="list the rows that would run, and exit")
    add("--compile-only", action="store_true", help="only call every row's torch.compile "
        "variant once, and exit: fills torch.compile's on-disk caches for a later run")


def _parse(args: argparse.Namespace) -> tuple[list[str], tuple | None]:
    """The devices and CPU thread counts asked for."""
    devices = [d.strip() for d in (args.device or ("cuda" if torch.cuda.is_available() else "cpu")
                                   ).split(",")]
    if not devices or any(d not in ("cpu", "cuda") for d in devices):
        raise SystemExit(f"bench: --device takes cpu, cuda or cuda,cpu; got {args.device!r}")
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    counts = [t.strip() for t in args.threads.split(",")] if args.threads else []
    if not all(t == "all" or (t.isdigit() and int(t) > 0) for t in counts):
        raise SystemExit(f"bench: --threads takes positive counts or 'all'; got {args.threads!r}")
    return devices, tuple(t if t == "all" else int(t) for t in counts) or None


def _git_commit() -> str | None:
    """The checkout's commit; TORCHOPS_COMMIT names it where there is no .git
    (a copied working tree)."""
    root = Path(__file__).resolve().parents[2]
    commit = envs.get("TORCHOPS_COMMIT")
    if commit is not None or not (root / ".git").exists():
        return commit
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=10)
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--",
                                                              "csrc", "torchops")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + " (modified)" * bool(dirty.stdout.strip()) \
        if head.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(devices: list[str], command: str, all_threads: int) -> dict:
    import torchops

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": command, "torch": torch.__version__, "cuda": torch.version.cuda,
           "torchvision": _version("torchvision"), "triton": _version("triton"),
           "liger_kernel": _version("liger_kernel"),
           "torchops": torchops.__version__, "torchops_commit": _git_commit(),
           "python": platform.python_version(),
           "cpu": f"{cpu} ({all_threads} threads used as 'all')"}
    if "cuda" in devices:
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = (f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
                      f"sm_{p.major}{p.minor})")
    return env


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from torchops.bench import cases as registry
    from torchops.bench import report
    from torchops.bench.runner import ALL_THREADS, Options, plan, run

    devices, threads = _parse(args)
    if args.merge_doc and not args.write_doc:
        raise SystemExit("bench: --merge-doc merges into the file --write-doc names; give both")
    try:
        cases = registry.select([n.strip() for spec in args.op or [] for n in spec.split(",")
                                 if n.strip()])
    except ValueError as e:
        raise SystemExit(f"bench: {e}")
    if args.list:
        for case, device, size, n in plan(cases, devices, args.quick, threads):
            print(f"{device:5s} {case.name:34s} {size.label:28s} {str(size.dtype)[6:]:9s} "
                  f"{n or '-':>3}" + (f"  (skipped: {case.missing()})" if case.missing() else ""))
        return 0

    rows, rooflines = run(cases, devices, Options(
        quick=args.quick, slow=args.slow, compile=not args.no_compile, min_time=args.min_time,
        time_budget=args.time_budget, threads=threads, compile_only=args.compile_only))
    if args.compile_only:
        done = sum(any(n.startswith("compiled in") for n in r.notes) for r in rows)
        failed = [f"{r.device} {r.case} {r.size}: {n}" for r in rows for n in r.notes
                  if n.startswith("compiled:")]
        print(f"bench: compiled {done} rows" + "".join(f"\n  {f}" for f in failed))
        return 1 if failed else 0

    # Absolute paths name a machine's folders: keep only their last part.
    command = shlex.join(["python", "-m", "torchops",
                          *(os.path.basename(a) if os.path.isabs(a) else a for a in argv)])
    meta = {"environment": environment(devices, command, ALL_THREADS), "roofline": rooflines,
            "options": vars(args)}
    markdown = report.markdown_report(rows, meta, {c.name: c.note for c in cases})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_csv(rows, out / "bench.csv")
    report.write_json(rows, meta, out / "bench.json")
    written = [out / "bench.csv", out / "bench.json"]
    why_no_plot = report.write_plot(rows, out / "bench.png")
    if why_no_plot:
        print(f"bench: {why_no_plot}", file=sys.stderr)
    written += [out / "bench.png"] * (not why_no_plot)
    if args.write_doc:
        written.append(Path(args.write_doc))
        written[-1].parent.mkdir(parents=True, exist_ok=True)
        doc = markdown
        if args.merge_doc and written[-1].exists():
            from torchops.bench.merge import merge

            doc = merge(written[-1].read_text(encoding="utf-8"), markdown)
        written[-1].write_text(doc, encoding="utf-8")
    print(markdown)
    print("bench: wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return 1 if args.strict and report.failed_rows(rows) else 0
