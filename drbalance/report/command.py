"""``drbalance report [PATH ...]``: a summary table and PNG plots, runs side by side.

A PATH is a run directory (``launch``, ``demo``, ``simulate --out``: one column each), a folder of
SD logs (``$DRBALANCE_LOG_DIR``), or SD log files; the jobs of a folder or of the files are
grouped into runs of overlapping jobs, one column each. Without a PATH: the jobs in this user's log
folder, beside the running (or last) manager's log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from drbalance import env
from drbalance.argtypes import non_empty_path, point_in_time, positive_float
from drbalance.ipc.names import IpcNames
from drbalance.ipc.private import read_private, write_private
from drbalance.jsonlog import rotated_files
from drbalance.report.metrics import (
    MAX_GRID_POINTS,
    RunData,
    Selection,
    Summary,
    load_log_groups,
    load_run,
    run_span,
    summarise,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="*", type=non_empty_path, metavar="PATH",
                        help="run directories (from launch, demo or simulate), folders of SD logs, or SD log files "
                        "(<app>.sd.jsonl; together one column); none: the jobs in DRBALANCE_LOG_DIR")
    parser.add_argument("--app", action="append", default=[], metavar="NAME",
                        help="only this job (repeat for more; shell patterns such as 'res*' match names)")
    parser.add_argument("--since", type=point_in_time, default=None, metavar="WHEN",
                        help="only jobs that ran at or after WHEN: 2026-12-04, 2026-12-04T09:30 (local time), "
                        "or a time ago: 90m, 2h, 3d")
    parser.add_argument("--until", type=point_in_time, default=None, metavar="WHEN",
                        help="only jobs that ran at or before WHEN (as --since)")
    parser.add_argument("--manager-log", type=non_empty_path, default=None, metavar="FILE",
                        help="the manager log for folders and files of SD logs (default: their folder's "
                        "manager.jsonl, else the running or last manager's log of DRBALANCE_NAMESPACE)")
    parser.add_argument("--out", type=non_empty_path, default=None,
                        help="where to write the plots and report.md (default: <first run>/../report)")
    parser.add_argument("--step", type=positive_float, default=None,
                        help="time grid of the SD views, seconds (default 1, coarser when the logs span more "
                        f"than {MAX_GRID_POINTS:,} s)")
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
        rows.append((f"final SD {name}", [_final_sd(s, name) for s in summaries]))
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
    bases = {basis for s in summaries for name, basis in s.solo_basis.items() if s.final_sd.get(name) is not None}
    if bases - {"manager"}:
        lines.append("~ final SD from the job's own estimate of its solo-run time (no solo_time given)")
    if "manager" in bases:
        lines.append("* final SD from the manager's estimate of its solo-run time (no solo_time given, no GPU alone)")
    if any(s.final_sd_bound for s in summaries):
        lines.append(">= the final SD is at least this: the job's own estimate of its solo-run time could still only "
                     "be too high (in no other number; docs/profiles.md)")
    profiled = sum(s.profile_runs for s in summaries)
    if profiled:
        lines.append(f"left out: {profiled} measuring run(s) of drbalance profile")
    return "\n".join(lines)


def _final_sd(summary: Summary, name: str) -> str:
    """A job's final SD for the table: the SD (``~`` before one from the job's own solo-time
    estimate, ``*`` from the manager's), ``>=`` a lower bound, or ``-``."""
    bound = summary.final_sd_bound.get(name)
    if bound is not None:
        return f">={bound:.3f}"
    sd = summary.final_sd.get(name)
    basis = summary.solo_basis.get(name) if sd is not None else None
    mark = "" if basis is None else "*" if basis == "manager" else "~"
    return mark + _fmt(sd)


def _is_report(path: Path) -> bool:
    """A folder this command wrote (``report.md``, no SD logs): ``runs/sim/*`` matches the default
    report folder ``runs/sim/report`` the second time it is run."""
    return (path / "report.md").is_file() and not (path / "apps").is_dir() and not _sd_logs_in(path)


def _sd_logs_in(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.sd.jsonl")) if folder.is_dir() else []


def summarise_runs(paths: list[Path], step: float = 1.0) -> str:
    return format_table([summarise(load_run(p), step) for p in paths])


def manager_log(given: Path | None, folder: Path | None) -> Path | None:
    """The manager log to read beside SD logs that are not a run directory: ``given`` (--manager-log),
    else ``folder``'s ``manager.jsonl``, else the log the running manager of this namespace names in
    its status file, else its default place (``<runtime dir>/<namespace>/manager.jsonl``, where the
    last one wrote it); None when there is none."""
    if given is not None:
        if not given.is_file():
            raise FileNotFoundError(f"--manager-log {given} is not a file")
        return given
    if folder is not None and (folder / "manager.jsonl").is_file():
        return folder / "manager.jsonl"
    names = IpcNames.current()
    try:
        status = json.loads(read_private(names.manager_status()))
        named = Path(status["log"]) if isinstance(status, dict) and isinstance(status.get("log"), str) else None
    except (OSError, ValueError):  # no manager running (no status file), or not one to trust
        named = None
    for candidate in (named, names.runtime_dir() / "manager.jsonl"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def load_sources(args: argparse.Namespace, select: Selection) -> tuple[list[RunData], Path]:
    """The report's columns (a run directory or a folder of SD logs each; SD log files given one by
    one together) and the default folder for its output."""
    paths = args.runs or [env.log_dir()]
    folders = [path for path in paths if path.is_dir() and not _is_report(path)]
    files = [path for path in paths if not path.is_dir()]
    if not folders and not files:
        raise FileNotFoundError(f"no run directories among {', '.join(map(str, paths))} (only reports)")
    runs, bases = [], []
    for folder in folders:
        if (folder / "apps").is_dir() or (folder / "run.json").is_file() or not _sd_logs_in(folder):
            runs.append(load_run(folder, select))
        else:
            logs = _sd_logs_in(folder)
            groups = _logs_runs(folder.resolve().name, logs, manager_log(args.manager_log, folder), select)
            runs += groups
            bases += [folder.resolve().parent] * len(groups)
            continue
        bases.append(folder.resolve().parent)
    if files:
        missing = [str(path) for path in files if not path.exists()]
        if missing:
            raise FileNotFoundError(f"no such run directory or SD log: {', '.join(missing)}")
        other = [str(path) for path in files if not path.name.endswith(".sd.jsonl")]
        if other:
            raise NotADirectoryError(f"run directory {other[0]} is not a folder, nor an SD log (<app>.sd.jsonl)")
        runs += _logs_runs("jobs", files, manager_log(args.manager_log, files[0].parent), select)
        bases.append(files[0].resolve().parent.parent)
    return runs, bases[0] / "report"


def _logs_runs(label: str, logs: list[Path], manager: Path | None, select: Selection) -> list[RunData]:
    """Columns from SD logs and a manager log (none: the utilisation is left out, with a note): one
    per group of jobs that overlapped in time (jobs that never ran together share no SD_max^diff)."""
    if manager is None:
        print("no manager log found (give --manager-log FILE): GPU utilisation is left out", file=sys.stderr)
    runs = load_log_groups(label, logs, rotated_files(manager) if manager is not None else [], select)
    if not any(run_data.apps for run_data in runs):
        raise FileNotFoundError(f"no jobs in {', '.join(sorted({str(log.parent) for log in logs}))} match the "
                                f"selection (--app, --since, --until)")
    if len(runs) > 1:
        print(f"{label}: {len(runs)} runs of jobs that never ran at the same time, one column each",
              file=sys.stderr)
    return runs


def _grid_step(runs: list[RunData], step: float | None) -> float:
    """``step`` as given, else 1 s, or coarser when the logs span more than ``MAX_GRID_POINTS`` seconds."""
    if step is not None:
        return step
    return max([1.0] + [run_span(run) / (MAX_GRID_POINTS - 1) for run in runs])


def check_arguments(args: argparse.Namespace) -> None:
    """A time window that holds no time: ValueError, a usage error (exit status 2)."""
    if args.since is not None and args.until is not None and args.since > args.until:
        raise ValueError("--since is after --until: the window holds no time")


def run(args: argparse.Namespace) -> int:
    if args.out is not None and not args.no_plots and os.path.lexists(args.out) and not args.out.is_dir():
        raise NotADirectoryError(f"--out {args.out} exists and is not a folder; give a folder for the plots "
                                 f"and report.md (made if missing)")  # now: the write's error names a temp file
    runs, default_out = load_sources(args, Selection(tuple(args.app), args.since, args.until))
    args.step = _grid_step(runs, args.step)
    summaries = [summarise(run_data, args.step) for run_data in runs]
    if args.json:
        print(json.dumps([asdict(s) for s in summaries], indent=2))
    else:
        print(format_table(summaries))
    if not args.no_plots:
        from drbalance.report.plots import plot_runs

        out = args.out or default_out
        paths = plot_runs(runs, out, args.step)
        markdown = ("```\n" + format_table(summaries) + "\n```\n\n" +
                    "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n")
        write_private(out / "report.md", markdown.encode("utf-8"))  # never through a planted symbolic link
        print(f"plots: {', '.join(str(p) for p in paths)}", file=sys.stderr if args.json else sys.stdout)
    return 0
