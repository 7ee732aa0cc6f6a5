"""A run's logs as time series and a summary: the paper's three views plus per-app results.

Definitions (docs/report.md):
- Time is seconds since the run started (``run.json``'s ``started``, else the first record).
- An app is *live* from its ``start`` record until its ``finish`` (or ``closed``) record.
- At time t, each live app's SD is its latest logged SD at or before t (unknown before its
  first measurement). ``SD_max^diff(t)`` = max - min of the known SDs of live apps (defined when
  at least two are known); ``mean SD(t)`` = their mean.
- Utilisation: the manager's raw samples, averaged over GPUs; ``util(t)`` = the latest sample.
- An app's records are placed at their session's clock (``elapsed`` since its ``start`` record,
  which a wall-clock step does not move) where they have one, at their wall time ``t`` otherwise,
  and its SD points are sorted by that time.
- An SD logged as a lower bound (``sd_bound``: the job's own estimate of its solo time could still
  only be too high) is not an SD: it is in no view and no mean; a job whose final SD is one shows
  it as such (``>=0.412``) and counts in no final number.
- Measuring runs of ``drbalance profile`` (``measuring`` in their ``start`` record) are no jobs of
  the report: they are left out and counted.
- SD logs read without a run directory (a log folder, log files) hold jobs of many runs: jobs whose
  lifetimes overlap, directly or through others, are one run, and each run is one column.
- Summary: final SD per app (the SD of its last record in the log's order: its ``finish``, or the
  ``closed`` record of an app stopped before it, else the last known one),
  makespan (last finish - start; none if an app did not finish or has no SD records), final
  SD_max^diff (max - min of the final SDs), time averages over the run (from its start to the
  makespan) of SD_max^diff, mean SD and mean utilisation, and SD_max^diff at the start (the first
  time every app has an SD).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

from drbalance.jsonlog import finite_number, read_json_lines, rotated_files

logger = logging.getLogger("drbalance.report")

SD_EVENTS = {"report", "boundary", "finish", "update", "closed"}  # records whose SD the report reads


@dataclass
class AppSeries:
    name: str
    start: float
    end: float | None  # finish (or close) time; None if still running when the logs end
    finished: bool
    times: list[float] = field(default_factory=list)  # seconds since the run's start, ascending
    sds: list[float] = field(default_factory=list)
    last_sd: float | None = None  # the SD of its last record that has one, in the log's order: its last word
    last_sd_bound: bool = False  # that last SD is only a lower bound (sd_bound): not the SD
    solo_basis: str | None = None  # that record's estimated solo time's basis (alone, shared, manager); None: given

    def sd_at(self, t: float) -> float | None:
        index = bisect_right(self.times, t)
        return self.sds[index - 1] if index else None

    def live_at(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t <= self.end)

    @property
    def final_sd(self) -> float | None:
        """The final SD; None while it is unknown or only a lower bound (:attr:`final_sd_bound`)."""
        return None if self.last_sd_bound else self.last_sd

    @property
    def final_sd_bound(self) -> float | None:
        """The final SD's lower bound, where the final SD is only that."""
        return self.last_sd if self.last_sd_bound else None


@dataclass
class RunData:
    """Everything a report needs from one run directory (or a simulator's output directory)."""

    label: str
    path: Path
    start: float
    apps: dict[str, AppSeries]
    util_times: list[float]
    util_means: list[float]
    info: dict
    no_records: list[str] = field(default_factory=list)  # apps of the run with no SD records at all
    profile_runs: int = 0  # measuring runs of drbalance profile found in its logs and left out


@dataclass(frozen=True)
class Selection:
    """Which jobs a report takes: ``apps``, names or shell-style patterns (``res*``; empty: every
    app), and a time window (wall-clock seconds, None: open) that a job's run must overlap."""

    apps: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None

    def picks(self, name: str, records: list[dict]) -> bool:
        """Whether the job ``name`` (its run's SD records, in the log's order) is one the report takes."""
        if self.apps and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.apps):
            return False
        times = [record["t"] for record in records]
        if not times:
            return self.since is None and self.until is None
        return (self.until is None or min(times) <= self.until) and (self.since is None or max(times) >= self.since)


EVERYTHING = Selection()


def load_run(path: str | Path, select: Selection = EVERYTHING) -> RunData:
    """Read ``run.json``, ``apps/*.sd.jsonl`` and ``manager.jsonl`` of a run directory.

    The manager's log is read with its rotated predecessors (``manager.jsonl.N`` ... ``.1``,
    oldest first), so a long run's early utilisation samples are not lost to rotation. An app
    named in ``run.json`` without an SD log, or with a log of no records, is in ``no_records``
    (with a warning): a job that exited before its first line is not silently left out.
    ``select`` picks jobs by name and time (:class:`Selection`)."""
    root = Path(path)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"run directory {root} {what}")
    info = _read_run_info(root / "run.json")
    logs = sorted((root / "apps").glob("*.sd.jsonl")) if (root / "apps").is_dir() else []
    if not logs:
        raise FileNotFoundError(f"{root} has no apps/*.sd.jsonl SD logs: is it a drbalance run directory?")
    launched = info.get("apps")
    expected = [str(name) for name in launched] if isinstance(launched, dict) else []
    return load_logs(str(info.get("label") or root.name), logs, rotated_files(root / "manager.jsonl"), select,
                     info, root, expected)


def load_logs(label: str, sd_logs: list[Path], manager_logs: list[Path], select: Selection = EVERYTHING,
              info: dict | None = None, path: Path | None = None, expected: list[str] | None = None) -> RunData:
    """A run from SD log files and manager log files (oldest first), as one column of a report.

    An SD log is ``<app>.sd.jsonl``; one that holds several runs of the same app name (a job run
    again with the same name appends to its log) gives one job per run, named ``<app>#1``,
    ``<app>#2``, ... in the log's order (measuring runs of ``drbalance profile`` are left out).
    ``select`` picks jobs by name and time; the manager's utilisation samples are kept from the
    first picked job's start to the last one's end (a manager log of weeks does not count its idle
    days). ``expected``: app names that should have records (``run.json``'s): those without are in
    ``no_records``."""
    jobs, profile_runs = read_jobs(sd_logs, select)
    for name in expected or ():
        if select.picks(name, jobs.get(name, [])):
            jobs.setdefault(name, [])
    return _run_of_jobs(label, jobs, manager_logs, info, path, profile_runs)


def load_log_groups(label: str, sd_logs: list[Path], manager_logs: list[Path],
                    select: Selection = EVERYTHING) -> list[RunData]:
    """SD log files that are not one run directory's (a log folder): one run per group of jobs whose
    lifetimes overlap (:func:`overlapping_groups`), oldest first. With one group its label is
    ``label``; with several, ``label`` and the group's start time (local), e.g. ``logs 12-07 09:30``."""
    jobs, profile_runs = read_jobs(sd_logs, select)
    groups = overlapping_groups(jobs)
    if len(groups) <= 1:
        return [_run_of_jobs(label, jobs, manager_logs, None, None, profile_runs)]
    runs = []
    for names in groups:
        first = min(record["t"] for name in names for record in jobs[name])
        stamp = time.strftime("%m-%d %H:%M", time.localtime(first))
        group_label = f"{label} {stamp}"
        if any(run.label == group_label for run in runs):  # two runs begun in one minute
            group_label = f"{label} {time.strftime('%m-%d %H:%M:%S', time.localtime(first))}"
        runs.append(_run_of_jobs(group_label, {name: jobs[name] for name in names}, manager_logs, None, None,
                                 profile_runs if not runs else 0))
    return runs


def overlapping_groups(jobs: dict[str, list[dict]]) -> list[list[str]]:
    """The jobs (records with wall times ``t``) in groups of overlapping lifetimes (first to last
    record): two jobs are in one group when their lifetimes overlap, or both overlap a third of
    it. Groups oldest first; jobs without records are left out."""
    spans = sorted((min(r["t"] for r in records), max(r["t"] for r in records), name)
                   for name, records in jobs.items() if records)
    groups: list[list[str]] = []
    end = None
    for first, last, name in spans:
        if end is None or first > end:
            groups.append([])
            end = last
        groups[-1].append(name)
        end = max(end, last)
    return [sorted(group) for group in groups]


def read_jobs(sd_logs: list[Path], select: Selection = EVERYTHING) -> tuple[dict[str, list[dict]], int]:
    """The jobs of SD log files, each its records (see :func:`load_logs`), and how many measuring
    runs of ``drbalance profile`` were left out."""
    jobs: dict[str, list[dict]] = {}
    profile_runs = 0
    for log in sd_logs:
        name = log.name[: -len(".sd.jsonl")] if log.name.endswith(".sd.jsonl") else log.name
        sessions = _sessions(_timed_records([log], fields=APP_FIELDS))
        runs = [records for records in sessions if not _measuring(records)]
        profile_runs += len(sessions) - len(runs)
        for index, records in enumerate(runs, start=1):
            job = name if len(runs) == 1 else f"{name}#{index}"
            if select.picks(job, records):
                jobs[job] = records
    return jobs, profile_runs


def _run_of_jobs(label: str, jobs: dict[str, list[dict]], manager_logs: list[Path], info: dict | None,
                 path: Path | None, profile_runs: int) -> RunData:
    times = [record["t"] for records in jobs.values() for record in records]
    manager = [record for record in _timed_records(manager_logs, events={"util"}, fields=MANAGER_FIELDS)
               if info is not None or (times and min(times) <= record["t"] <= max(times))]
    run = run_from_records(label, jobs, manager, info, path)
    run.profile_runs = profile_runs
    if run.no_records:
        logger.warning("%s: apps %s of the run have no SD records (no SD log, or an empty one): they are in no "
                       "number of the report, and it claims no makespan", path or label, ", ".join(run.no_records))
    return run


def _measuring(records: list[dict]) -> bool:
    """Whether a session's records are a measuring run of ``drbalance profile`` (its ``start`` says so)."""
    return bool(records) and records[0].get("event") == "start" and records[0].get("measuring") is True


def _sessions(records: list[dict]) -> list[list[dict]]:
    """An SD log's records cut into one list per run of the job: each ``start`` record begins one."""
    runs: list[list[dict]] = []
    for record in records:
        if record.get("event") == "start" or not runs:
            runs.append([])
        runs[-1].append(record)
    return runs


def _read_run_info(path: Path) -> dict:
    """``run.json`` as a dict ({} when there is none); ValueError naming the file when it is not
    a JSON object or its ``started`` is not a finite number of seconds."""
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: not a JSON object")
    started = info.get("started")
    if started is not None and not finite_number(started):
        raise ValueError(f"{path}: 'started' must be a number of seconds; got {started!r}")
    return info


APP_FIELDS = ("t", "elapsed", "event", "sd", "sd_bound", "measuring", "solo_estimated",
              "solo_basis")  # what the report reads of an SD log record
MANAGER_FIELDS = ("t", "event", "util")  # ... and of a manager log record (its util records only)


def _timed_records(paths: list[Path], events: set[str] | None = None,
                   fields: tuple[str, ...] | None = None) -> list[dict]:
    """The records of the JSON Lines files ``paths`` (in order) that carry a finite time ``t`` and
    a text ``event``; others (cut off, hand-edited, of another program) are skipped with a warning
    naming the file, like the malformed lines ``read_json_lines`` skips. Values the report would
    ignore (an ``sd`` that is not a number >= 0, ``util`` samples that are not percentages) are
    counted in a warning too.

    Only records whose event is in ``events`` (None: every event) are kept, each with only the
    keys ``fields`` (None: all), read one line at a time: a run of days has hundreds of MB of
    logs, most of it the manager's decisions, which the report does not read."""
    kept = []
    for path in paths:
        skipped = bad_sd = bad_util = 0
        for record in read_json_lines(path):
            event = record.get("event")
            if not (finite_number(record.get("t")) and isinstance(event, str)):
                skipped += 1
                continue
            if event in SD_EVENTS and record.get("sd") is not None and not sd_value(record["sd"]):
                bad_sd += 1
            if event == "util" and isinstance(record.get("util"), list):
                bad_util += sum(1 for sample in record["util"] if sample is not None and not percent_value(sample))
            if events is None or event in events:
                kept.append(record if fields is None else {key: record[key] for key in fields if key in record})
        if skipped:
            logger.warning("%s: skipped %d record(s) without a numeric time 't' or a text 'event'", path, skipped)
        if bad_sd:
            logger.warning("%s: ignored %d value(s) out of range ('sd' must be a number >= 0)", path, bad_sd)
        if bad_util:
            logger.warning("%s: ignored %d value(s) out of range ('util' samples must be percentages 0..100)",
                           path, bad_util)
    return kept


def sd_value(value: object) -> bool:
    """Whether a decoded ``sd`` is one the report uses: a finite number >= 0 (a ratio of times)."""
    return finite_number(value) and value >= 0


def percent_value(value: object) -> bool:
    """Whether a decoded utilisation sample is one the report uses: a finite number in 0..100."""
    return finite_number(value) and 0 <= value <= 100


def run_from_records(label: str, app_records: dict[str, list[dict]], manager_records: list[dict],
                     info: dict | None = None, path: Path | None = None) -> RunData:
    """A run from SD-log records per app and manager-log records (files or the simulator's memory)."""
    info = info or {}
    first = min((r[0]["t"] for r in app_records.values() if r), default=0.0)
    started = info.get("started")  # null: not recorded (a run that did not start, a hand-made run.json)
    start = float(started) if finite_number(started) else first
    apps = {name: _series(name, recs, start) for name, recs in app_records.items() if recs}
    util_times, util_means = [], []
    for record in manager_records:
        if record.get("event") != "util":
            continue
        samples = record.get("util")
        known = [u for u in samples if percent_value(u)] if isinstance(samples, list) else []
        if known:
            util_times.append(record["t"] - start)
            util_means.append(fmean(known))
    silent = sorted(name for name, records in app_records.items() if not records)
    return RunData(label, path or Path("."), start, apps, util_times, util_means, info, silent)


def _series(name: str, records: list[dict], start: float) -> AppSeries:
    """An app's SD series from its records in the log's order. A record is placed at its session's
    clock where it has one (``elapsed``: monotonic seconds since the session's ``start`` record, so
    a wall-clock step does not move it), at its wall time ``t`` otherwise; the SD points are then
    sorted by that time, and the final SD is the last one in the log's order (a ``closed`` record's
    if the app was stopped)."""
    anchor = None  # wall time of the session's start: its 't' less its 'elapsed'
    points: list[tuple[float, int, float]] = []  # (time, order in the log, SD)
    begin = end = None
    finished, last_sd, last_bound, basis = False, None, False, None
    for order, record in enumerate(records):
        event, elapsed = record.get("event"), record.get("elapsed")
        if finite_number(elapsed) and (anchor is None or event == "start"):
            anchor = record["t"] - elapsed
        t = (anchor + elapsed if anchor is not None and finite_number(elapsed) else record["t"]) - start
        begin = t if begin is None else begin
        sd = record.get("sd")
        if event in SD_EVENTS and sd_value(sd):
            last_sd, last_bound = float(sd), record.get("sd_bound") is True
            found = record.get("solo_basis") if record.get("solo_estimated") is True else None
            basis = found if isinstance(found, str) else None
            if not last_bound:  # a lower bound is no SD: in no view
                points.append((t, order, float(sd)))
        if event == "finish":
            end, finished = t, True
        elif event == "closed" and not finished:
            end = t
    points.sort()
    return AppSeries(name, begin if begin is not None else 0.0, end, finished, [t for t, _, _ in points],
                     [sd for _, _, sd in points], last_sd, last_bound, basis)


MAX_GRID_POINTS = 1_000_000  # a finer --step than the run's length / this would only fill memory


def run_span(run: RunData) -> float:
    """Seconds from the run's start to its last finish or SD record."""
    ends = [a.end for a in run.apps.values() if a.end is not None]
    last_sd = max((a.times[-1] for a in run.apps.values() if a.times), default=0.0)
    return max(ends + [last_sd])


def grid_times(run: RunData, step: float) -> list[float]:
    """0, step, 2 step, ... seconds past the run's last record; ValueError when that would be more
    than ``MAX_GRID_POINTS`` points (a ``--step`` far finer than the run)."""
    end = run_span(run)
    count = int(end / step) + 1
    if count > MAX_GRID_POINTS:
        raise ValueError(f"a time grid of {step:g} s over the {end:.0f} s of run {run.label!r} has more than "
                         f"{MAX_GRID_POINTS:,} points; use a larger --step (e.g. {end / 2000:.3g})")
    return [i * step for i in range(count + 1)]


def sd_views(run: RunData, step: float = 1.0) -> tuple[list[float], list[float | None], list[float | None]]:
    """(times, SD_max^diff(t), mean SD(t)) on a grid of ``step`` seconds."""
    times = grid_times(run, step)
    diffs: list[float | None] = []
    means: list[float | None] = []
    for t in times:
        known = [sd for app in run.apps.values() if app.live_at(t) for sd in [app.sd_at(t)] if sd is not None]
        diffs.append(max(known) - min(known) if len(known) >= 2 else None)
        means.append(_mean(known))
    return times, diffs, means


def util_view(run: RunData, window: float = 5.0) -> tuple[list[float], list[float]]:
    """Mean GPU utilisation over time, as a trailing mean over ``window`` seconds of samples."""
    times, values = run.util_times, run.util_means
    smoothed, start, running = [], 0, 0.0
    for index, (t, value) in enumerate(zip(times, values)):
        running += value
        while times[start] < t - window:
            running -= values[start]
            start += 1
        smoothed.append(running / (index - start + 1))
    return times, smoothed


@dataclass
class Summary:
    label: str
    final_sd: dict[str, float | None]
    makespan: float | None
    final_sd_diff: float | None
    start_sd_diff: float | None
    mean_sd_diff: float | None
    mean_sd: float | None
    final_mean_sd: float | None
    mean_util: float | None
    unfinished: list[str]
    no_records: list[str] = field(default_factory=list)  # apps of the run without SD records (final SD None)
    final_sd_bound: dict[str, float] = field(default_factory=dict)  # apps whose final SD is only this lower bound
    profile_runs: int = 0  # measuring runs of drbalance profile left out
    solo_basis: dict[str, str] = field(default_factory=dict)  # apps whose final SD uses an estimated solo time


def summarise(run: RunData, step: float = 1.0) -> Summary:
    times, diffs, means = sd_views(run, step)
    finals = dict(sorted({**{name: None for name in run.no_records},
                          **{name: app.final_sd for name, app in run.apps.items()}}.items()))
    known = [sd for sd in finals.values() if sd is not None]
    unfinished = [name for name, app in run.apps.items() if not app.finished]
    ends = [app.end for app in run.apps.values() if app.end is not None]
    makespan = max(ends) if ends and not unfinished and not run.no_records else None
    all_known_at = max((app.times[0] for app in run.apps.values() if app.times), default=None)
    start_diff = None
    if all_known_at is not None:
        for t, diff in zip(times, diffs):
            if t >= all_known_at and diff is not None:
                start_diff = diff
                break
    end = makespan if makespan is not None else (times[-1] if times else 0.0)
    # samples over the run only: the manager runs (idle GPUs) while the apps set up, before the start
    util = [u for t, u in zip(run.util_times, run.util_means) if 0 <= t <= end]
    return Summary(
        label=run.label, final_sd=finals, makespan=makespan,
        final_sd_diff=max(known) - min(known) if len(known) >= 2 else None,
        start_sd_diff=start_diff,
        mean_sd_diff=_mean(diffs), mean_sd=_mean(means),
        final_mean_sd=_mean(known), mean_util=_mean(util), unfinished=sorted(unfinished),
        no_records=list(run.no_records),
        final_sd_bound={name: app.final_sd_bound for name, app in sorted(run.apps.items())
                        if app.final_sd_bound is not None},
        profile_runs=run.profile_runs,
        solo_basis={name: app.solo_basis for name, app in sorted(run.apps.items()) if app.solo_basis is not None},
    )


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values that are not None (None if none are); one that would overflow (a
    sum beyond the largest float, of values each below it) is taken of the values scaled down."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    try:
        return fmean(known)
    except OverflowError:
        return fmean([v / len(known) for v in known]) * len(known)
