"""``drbalance report RUN_DIR [RUN_DIR ...]``: a summary table and PNG plots, runs side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from drbalance.argtypes import non_empty_path, positive_float
from drbalance.ipc.private import write_private
from drbalance.report.metrics import Summary, load_run, summarise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=non_empty_path, help="run directories (from launch, demo or simulate)")
    parser.add_argument("--out", type=non_empty_path, default=None,
                        help="where to write the plots and report.md (default: <first run>/../report)")
    parser.add_argument("--step", type=positive_float, default=1.0,
                        help="time grid of the SD views, seconds (default 1)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def format_table(summaries: list[Summary]) -> str:
    """The comparison table: one column per run."""
    rows = [
        ("makespan (s)", [_fmt(s.makespan, "{:.1f}") for s in summaries]),
        ("SD_max^diff at start", [_fmt(s.start_sd_diff) for s in summaries]),
        ("SD_max^diff final", [_fmt(s.final_sd_diff) for s in summaries]),
        ("SD_max^diff time-avg", [_fmt(s.mean_sd_diff) for s in summaries]),
        ("mean SD final", [_fmt(s.final_mean_sd) for s in summaries]),
        ("mean SD time-avg", [_fmt(s.mean_sd) for s in summaries]),
        ("mean GPU util (%)", [_fmt(s.mean_util, "{:.1f}") for s in summaries]),
    ]
    apps = sorted({name for s in summaries for name in s.final_sd})
    for name in apps:
        rows.append((f"final SD {name}", [_fmt(s.final_sd.get(name)) for s in summaries]))
    header = ("", [s.label for s in summaries])
    width0 = max(len(r[0]) for r in [header, *rows])
    widths = [max(len(header[1][i]), *(len(r[1][i]) for r in rows)) for i in range(len(summaries))]
    lines = []
    for label, cells in [header, *rows]:
        lines.append("  ".join([label.ljust(width0), *(c.rjust(w) for c, w in zip(cells, widths))]).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    unfinished = [f"{s.label}: {', '.join(s.unfinished)}" for s in summaries if s.unfinished]
    if unfinished:
        lines.append("not finished (final SD = last prediction): " + "; ".join(unfinished))
    silent = [f"{s.label}: {', '.join(s.no_records)}" for s in summaries if s.no_records]
    if silent:
        lines.append("no SD records (in no number): " + "; ".join(silent))
    return "\n".join(lines)


def _is_report(path: Path) -> bool:
    """A folder this command wrote (``report.md``, no SD logs): ``runs/sim/*`` matches the default
    report folder ``runs/sim/report`` the second time it is run."""
    return (path / "report.md").is_file() and not (path / "apps").is_dir()


def summarise_runs(paths: list[Path], step: float = 1.0) -> str:
    return format_table([summarise(load_run(p), step) for p in paths])


def run(args: argparse.Namespace) -> int:
    if args.out is not None and not args.no_plots and os.path.lexists(args.out) and not args.out.is_dir():
        raise NotADirectoryError(f"--out {args.out} exists and is not a folder; give a folder for the plots "
                                 f"and report.md (made if missing)")  # was a temporary file's name, after the table
    paths = [path for path in args.runs if not _is_report(path)]
    if not paths:
        raise FileNotFoundError(f"no run directories among {', '.join(map(str, args.runs))} (only reports)")
    args.runs = paths
    runs = [load_run(path) for path in args.runs]
    summaries = [summarise(run_data, args.step) for run_data in runs]
    if args.json:
        print(json.dumps([asdict(s) for s in summaries], indent=2))
    else:
        print(format_table(summaries))
    if not args.no_plots:
        from drbalance.report.plots import plot_runs

        out = args.out or (args.runs[0].resolve().parent / "report")
        paths = plot_runs(runs, out, args.step)
        markdown = ("```\n" + format_table(summaries) + "\n```\n\n" +
                    "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n")
        write_private(out / "report.md", markdown.encode("utf-8"))  # never through a planted symbolic link
        print(f"plots: {', '.join(str(p) for p in paths)}", file=sys.stderr if args.json else sys.stdout)
    return 0
