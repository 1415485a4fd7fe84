"""``python -m torchops bench``: options, and what a run writes."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

__all__ = ["add_parser", "main"]

DESCRIPTION = """\
Time every torchops operator against its eager PyTorch reference,
torch.compile of that reference, and the peer library (torchvision, the
vendor BLAS) where installed, at realistic sizes.  Prints a table, writes
bench.csv, bench.json and (with matplotlib) bench.png into --out, and with
--write-doc the Markdown page of docs/performance.md.  Method: docs/benchmarks.md.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the ops against PyTorch and peers",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cpu, cuda, or both as 'cuda,cpu' (default: cuda if available, else cpu)")
    p.add_argument("--op", action="append", default=None, metavar="NAME",
                   help="only this op or case (repeatable, or comma-separated; default: all)")
    p.add_argument("--quick", action="store_true",
                   help="one small size per case and short timings (a smoke run, seconds)")
    p.add_argument("--slow", action="store_true",
                   help="also time the slow alternatives (torchvision's deterministic "
                        "roi_align backward: tens of seconds and GBs)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--min-time", type=float, default=None, metavar="S",
                   help="seconds of timed calls per variant (default 0.1 on CUDA, 0.15 on CPU)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop starting new rows after S seconds (the rest are reported as not run)")
    p.add_argument("--threads", default=None, metavar="LIST",
                   help="CPU thread counts for every CPU row, e.g. '1' or '1,2,all' "
                        "(default: each case's own; 'all' is torch's default count)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="folder for bench.csv, bench.json, bench.png (default: %(default)s)")
    p.add_argument("--write-doc", default=None, metavar="PATH",
                   help="also write the results as Markdown (docs/performance.md)")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 when torchops failed on a row or its output "
                        "disagreed with an alternative's")
    p.add_argument("--list", action="store_true", help="list the rows that would run, and exit")
    p.add_argument("--compile-only", action="store_true",
                   help="only run every row's torch.compile variant once and exit: fills "
                        "torch.compile's on-disk caches, so a later timing run compiles from them")


def _devices(spec: str | None) -> list[str]:
    if spec is None:
        return ["cuda" if torch.cuda.is_available() else "cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in devices if d not in ("cpu", "cuda")]
    if bad or not devices:
        raise SystemExit(f"bench: --device takes cpu, cuda or cuda,cpu; got {spec!r}")
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    return devices


def _thread_counts(spec: str | None) -> tuple[int | str, ...] | None:
    if spec is None:
        return None
    out = []
    for t in spec.split(","):
        t = t.strip()
        if t != "all" and not (t.isdigit() and int(t) > 0):
            raise SystemExit(f"bench: --threads takes positive counts or 'all'; got {spec!r}")
        out.append(t if t == "all" else int(t))
    return tuple(out)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from torchops.bench import cases as registry
    from torchops.bench import report
    from torchops.bench.environment import environment
    from torchops.bench.runner import ALL_THREADS, Options, plan, run

    devices = _devices(args.device)
    names = [n.strip() for spec in (args.op or []) for n in spec.split(",") if n.strip()]
    try:
        cases = registry.select(names or None)
    except ValueError as e:
        raise SystemExit(f"bench: {e}")

    threads = _thread_counts(args.threads)
    if args.list:
        for case, device, size, n in plan(cases, devices, args.quick, threads):
            missing = case.missing()
            print(f"{device:5s} {case.name:34s} {size.label:28s} {str(size.dtype)[6:]:9s} "
                  f"{n or '-':>3}" + (f"  (skipped: {missing})" if missing else ""))
        return 0

    opts = Options(quick=args.quick, slow=args.slow, compile=not args.no_compile,
                   min_time=args.min_time, time_budget=args.time_budget, threads=threads,
                   compile_only=args.compile_only)
    # Absolute paths name a machine's folders: keep only their last part.
    command = shlex.join(["python", "-m", "torchops",
                          *(os.path.basename(a) if os.path.isabs(a) else a for a in argv)])
    rows, rooflines = run(cases, devices, opts)
    if args.compile_only:
        done = sum(1 for r in rows if any(n.startswith("compiled in") for n in r.notes))
        failed = [f"{r.device} {r.case} {r.size}: {n}" for r in rows for n in r.notes
                  if n.startswith("compiled:")]
        print(f"bench: compiled {done} rows" + "".join(f"\n  {f}" for f in failed))
        return 1 if failed else 0
    meta = {"environment": environment(devices, command, ALL_THREADS), "roofline": rooflines,
            "options": {k: v for k, v in vars(args).items() if k != "func"}}
    case_notes = {c.name: c.note for c in cases}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_csv(rows, out / "bench.csv")
    report.write_json(rows, meta, out / "bench.json")
    written = [out / "bench.csv", out / "bench.json"]
    why_no_plot = report.write_plot(rows, out / "bench.png")
    if why_no_plot is None:
        written.append(out / "bench.png")
    else:
        print(f"bench: {why_no_plot}", file=sys.stderr)
    if args.write_doc:
        doc = Path(args.write_doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(report.markdown_report(rows, meta, case_notes), encoding="utf-8")
        written.append(doc)
    print(report.text_report(rows, meta, case_notes))
    print("bench: wrote " + ", ".join(map(str, written)), file=sys.stderr)
    bad = report.failed_rows(rows)
    return 1 if args.strict and bad else 0
