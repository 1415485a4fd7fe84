"""Benchmark results as Markdown (printed, and docs/performance.md), CSV, JSON
and a PNG plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from torchops.bench.runner import Row, fmt_bytes, fmt_time

CSV_FIELDS = ["device", "case", "op", "size", "dtype", "threads", "backward", "deterministic",
              "requires_grad", "variant", "variant_name", "median_s", "p25_s", "p75_s", "samples",
              "calls", "method", "metric", "throughput", "roofline_pct", "torchops_speedup",
              "best", "check", "notes", "peak_bytes", "returned_bytes"]


def _groups(rows: list[Row]) -> list[tuple[str, str, list[Row]]]:
    """(device, case, rows) in first-seen order."""
    out: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        out.setdefault((r.device, r.case), []).append(r)
    return [(d, c, rs) for (d, c), rs in out.items()]


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _alternatives(rows: list[Row]) -> list[str]:
    """The alternatives of a group of rows, in column order."""
    return list(dict.fromkeys(v for r in rows for v in r.alternatives()))


def _cells(r: Row, alternatives: list[str] | None = None) -> dict[str, str]:
    m, tput, pct = r.results.get("torchops"), r.throughput(), r.roofline_pct()
    if tput is not None and r.metric == "TFLOP/s" and tput < 1:
        tput_text = f"{tput * 1e3:.3g} GFLOP/s"
    else:
        tput_text = "-" if tput is None else f"{tput:.3g} {r.metric}"
    cells = {"size": r.size, "dtype": r.dtype, "threads": str(r.threads) if r.threads else "-",
             "torchops": "skipped" if r.skipped else fmt_time(r.seconds("torchops")),
             "IQR": f"{100 * m.iqr / m.median:.0f}%" if m and m.median > 0 else "-",
             "throughput": tput_text, "% roofline": "-" if pct is None else f"{pct:.0f}%",
             "mem": fmt_bytes(r.extra_bytes("torchops"))}
    for v in r.alternatives() if alternatives is None else alternatives:
        cells[v], cells[f"vs {v}"] = fmt_time(r.seconds(v)), _x(r.speedup(v))
        cells[f"{v} mem"] = fmt_bytes(r.extra_bytes(v))
    # Against the strongest alternative, where the row has a choice; with its
    # own % of the roofline where the row has one.
    best = r.best()
    several = sum(v in r.results and v not in r.bounds for v in r.alternatives()) > 1
    best_pct = r.roofline_pct(best) if best else None
    cells["vs best"] = (f"{_x(r.speedup(best))} ({best}" + (
        f", {best_pct:.0f}%" if best_pct is not None else "") + ")") if several else "-"
    cells["check"] = "MISMATCH" if r.check.startswith("MISMATCH") else r.check
    return cells


def _table(rows: list[Row]) -> list[str]:
    """A Markdown table, padded so that it also reads as a table in a terminal."""
    alternatives = _alternatives(rows)
    cells = [_cells(r, alternatives) for r in rows]
    header = [h for h in cells[0] if h in ("size", "dtype", "threads", "torchops")
              or any(c[h] != "-" for c in cells)]
    body = [[c[h].replace("|", "\\|") for h in header] for c in cells]
    widths = [max(map(len, col)) for col in zip(header, *body)]
    left = [h in ("size", "dtype", "check") for h in header]
    line = lambda cs: "| " + " | ".join(  # noqa: E731
        c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(cs, widths, left)) + " |"
    rule = "|" + "|".join("-" * (w + 2 - (not lft)) + ("" if lft else ":")
                          for w, lft in zip(widths, left)) + "|"
    return [line(header), rule] + [line(b) for b in body]


def _at(threads: str) -> str:
    return "" if threads in ("gpu", "0") else f" at {threads} thread" + "s" * (threads != "1")


def _notes(rows: list[Row], case_note: str) -> list[str]:
    """The case's note, then each row's notes; a note every row of the group
    carries is said once, without naming the row."""
    out = [case_note] if case_note else []
    if any(r.requires_grad for r in rows):
        out.append("Forward only, with inputs that require gradients (a training step's "
                   "forward: autograd decides what each variant saves).")
    if any(r.peak_bytes for r in rows):
        out.append("`mem`: the peak memory one call allocates beyond its inputs and what it "
                   "returns (for fwd+bwd rows, beyond the gradients; for training-style "
                   "forwards it includes what is saved for the backward), measured on one more "
                   "call: torch.cuda.max_memory_allocated on CUDA, the profiler's record of "
                   "torch's CPU allocations on the CPU.")
    per_row = [(r.size + _at(str(r.threads)).replace(" at", ","), n) for r in rows
               for n in r.notes + ([r.check] if r.check.startswith("MISMATCH") else [])]
    bodies = [n for _, n in per_row]
    for where, n in per_row:
        line = n if len(rows) > 1 and bodies.count(n) == len(rows) else f"{where}: {n}"
        if line not in out:
            out.append(line)
    return out


def _roofline(roof: dict) -> str:
    bw = ", ".join(f"{v:g} GB/s{_at(k)}" for k, v in roof["bandwidth_GBps"].items())
    fl = ", ".join(f"{k.split('@')[0]} {v:g} TFLOP/s{_at(k.split('@')[1])}"
                   for k, v in roof["mm_TFLOPs"].items())
    return "; ".join([f"copy {bw}"] * bool(bw) + [f"torch.mm {fl}"] * bool(fl)) or "not measured"


def markdown_report(rows: list[Row], meta: dict, case_notes: dict[str, str]) -> str:
    env = meta["environment"]
    commit = f" (commit {env['torchops_commit']})" if env.get("torchops_commit") else ""
    out = [
        "# Performance", "",
        f"Generated by `{env['command']}` on {env['date']}; do not edit by hand "
        "(regenerate with `scripts/gpu_check.sh`, see [benchmarks.md](benchmarks.md)).", "",
        "| | |", "|---|---|", *([f"| GPU | {env['gpu']} |"] if env.get("gpu") else []),
        f"| CPU | {env['cpu']} |", f"| torch | {env['torch']} (CUDA {env['cuda'] or 'none'}) |",
        f"| torchvision | {env['torchvision'] or 'not installed'} |",
        f"| triton | {env['triton'] or 'not installed'} |",
        *([f"| liger-kernel | {env['liger_kernel']} |"] if env.get("liger_kernel") else []),
        f"| torchops | {env['torchops']}{commit} |", f"| python | {env['python']} |",
        *(f"| roofline ({d}) | {_roofline(roof)} |" for d, roof in meta["roofline"].items()), "",
        "Times are medians over many repeats with cold caches (CUDA: `triton.testing.do_bench`, "
        "which flushes the L2 before every call; CPU: `torch.utils.benchmark`, rotating through "
        "input sets larger than the last-level cache, the variants of a row timed in "
        "interleaved blocks; docs/benchmarks.md explains the method); "
        "IQR is the interquartile range relative to the median. `vs X` is the time of X divided "
        "by the time of torchops: above 1, torchops is faster; `vs best` compares with the "
        "fastest alternative of the row (eager, compiled or a peer, all timed in the same run), "
        "names it and gives its % of the roofline. Throughput and % of the roofline are "
        "torchops's: TFLOP/s against `torch.mm` in the same dtype, GB/s (compulsory bytes, every "
        "tensor read or written once) against a large device copy timed in the same run (the "
        "copy roofline). `check` compares torchops's output with every alternative's but a "
        "bound's.",
    ]
    current = None
    for device, case, rs in _groups(rows):
        if device != current:
            out, current = out + ["", f"## {device.upper()}"], device
        names = {k: v for r in rs for k, v in r.names.items()}
        bounds = {b for r in rs for b in r.bounds}
        names = "<br>".join(f"{v} = {names[v]}" + " (a bound: not compared, never best)"
                            * (v in bounds) for v in _alternatives(rs) if v in names)
        out += ["", f"### {case}", ""] + [names, ""] * bool(names) + _table(rs)
        notes = _notes(rs, case_notes.get(case, ""))
        out += [""] + [f"- {n}" for n in notes] if notes else []
    return "\n".join(out + ["", summary_line(rows), ""])


def failed_rows(rows: list[Row]) -> list[Row]:
    """Rows where torchops raised, or disagreed with an alternative."""
    return [r for r in rows if r.check.startswith("MISMATCH")
            or (not r.skipped and "torchops" not in r.results)]


def summary_line(rows: list[Row]) -> str:
    """The run's last line, which scripts/gpu_check.sh's summary quotes."""
    count = lambda f: sum(1 for r in rows if f(r))  # noqa: E731
    return (f"bench: {len(rows)} rows, {count(lambda r: r.results)} timed, "
            f"{count(lambda r: r.skipped)} skipped, "
            f"{count(lambda r: not r.skipped and 'torchops' not in r.results)} torchops failures, "
            f"{count(lambda r: r.check.startswith('MISMATCH'))} mismatches")


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per (row, variant timed); a row with nothing timed gets one,
    with its notes."""
    g = lambda v, f=".4g": "" if v is None else format(v, f)  # noqa: E731
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            base = {**vars(r), "notes": " | ".join(r.notes), "best": r.best() or "",
                    "peak_bytes": "", "returned_bytes": ""}
            for v, m in r.results.items() or [(None, None)]:
                w.writerow({**base} if m is None else {
                    **base, **vars(m), "variant": v, "variant_name": r.names.get(v, ""),
                    **{f"{k}_s": g(getattr(m, k), ".6g") for k in ("median", "p25", "p75")},
                    "throughput": g(r.throughput(v)), "roofline_pct": g(r.roofline_pct(v)),
                    "torchops_speedup": g(r.speedup(v)) if v != "torchops" else "",
                    "peak_bytes": r.peak_bytes.get(v, ""),
                    "returned_bytes": r.returned_bytes.get(v, "")})


def write_json(rows: list[Row], meta: dict, path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]}, indent=1))


def write_plot(rows: list[Row], path: Path) -> str | None:
    """Speedup of torchops over each alternative against size, one panel per
    (device, case).  Returns why no plot was written, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    panels = [g for g in _groups(rows) if any(r.speedup(v) for r in g[2] for v in r.alternatives())]
    if not panels:
        return "no speedups to plot"
    cols, n_rows = min(3, len(panels)), (len(panels) + 2) // 3
    fig, axes = plt.subplots(n_rows, cols, figsize=(6 * cols, 3.6 * n_rows), squeeze=False)
    for ax, (device, case, rs) in zip(axes.flat, panels):
        labels = list(dict.fromkeys(f"{r.size}\n{r.dtype}" for r in rs))
        series: dict[str, dict[int, float]] = {}
        for r in rs:
            for v in (v for v in r.alternatives() if r.speedup(v)):
                who = r.names[v].split(".")[0] if v == "peer" else v
                series.setdefault(f"vs {who}" + (f", {r.threads} thr" if r.threads else ""), {})[
                    labels.index(f"{r.size}\n{r.dtype}")] = r.speedup(v)
        for key, pts in series.items():
            ax.plot(list(pts), list(pts.values()), marker="o", label=key)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(f"{case} [{device}]", fontsize=10)
        ax.set_ylabel("torchops speedup")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
