"""What every drbalance manager does, whoever its jobs belong to: decide, sample, log, survive.

``Balancer`` holds the policy, the table of live apps and the GPUs' readings, and does steps 4-6
of the paper's loop for one app (``decide``: the policy's DR checked against the app's
constraints, written into its record through its channel, the app signalled), the utilisation
sampling, the metrics and the manager log, every task under a guard that logs a fault and goes
on. How apps arrive and are known differs: a user's own manager (``daemon.Manager``) finds them
through their claims and an inbox in the user's private runtime directory; a machine's system
manager (``system.SystemManager``) through a Unix socket, knowing each job's uid and pid from the
kernel. Both subclass this.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from drbalance import defaults
from drbalance.clock import Clock, SystemClock
from drbalance.ipc.layout import AppCommand, AppState, RecordError
from drbalance.jsonlog import JsonLinesWriter
from drbalance.manager.metrics import AppMetrics, ManagerMetrics, MetricsSnapshot
from drbalance.manager.slurm import DEFAULT_PERIOD as DEFAULT_WEIGHT_PERIOD
from drbalance.manager.slurm import SlurmWeight, new_job_slowdown
from drbalance.manager.table import AppEntry, AppTable, ServerGpus, Unmapped
from drbalance.manager.utilization import UtilizationSource, UtilizationWindow
from drbalance.policy import DEFAULT_POLICY, AppView, Policy, PolicyConfig, Snapshot, make_policy, violations
from drbalance.policy.base import SoloEstimating
from drbalance.ratio import DEFAULT_TOTAL, DataRatio

logger = logging.getLogger("drbalance.manager")

FAULT_REPEAT_SECONDS = 60.0  # a fault that persists is logged again at most this often
DEFAULT_LOG_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_LOG_KEEP = 5
MAX_LOG_KEEP = 1000  # rotated manager logs kept at most
UUID_RETRY_SECONDS = 10.0  # how often GPU UUIDs that could not be read are tried again
MEMORY_KEPT_SECONDS = 10.0
"""A GPU's last memory reading stands in for one that failed (an NVML error on one call of many)
for this long: without a reading the GPU has no free-memory cap, and a decision made meanwhile
could send a job more than fits."""
REPORT_FORGET_SECONDS = 60.0
"""A problem reported once per app and reason (an unreadable claim or record, a notice that
cannot be admitted) is forgotten when it has not been seen again for this long (its app gone), so
the set of reported problems does not grow with every job that ever failed; seen again later, it
is reported again."""
MAX_REPORTED = 10_000
"""Distinct problems (kind, app, reason) the manager keeps so as to name each once on stderr; past
that a new one is only counted, and the count said in one line a minute (the manager log still
records every one). Without that cap, notices for 188,000 made-up app names in 30 s (a process
of the same user) would write as many warnings and hold 85 MB of them for a minute."""
UNREPORTED_SAID_SECONDS = 60.0
"""How often (seconds, at most) the count of problems not named on stderr is said."""


class NotLive(Exception):
    """An app's record says it is not running (``FINISHED``): it gets no decision."""


class SampleFailed(RuntimeError):
    """The utilisation source raised; its readings count as unavailable (a fault of ``sample``)."""


class ManagerAlreadyRunning(RuntimeError):
    """Another manager holds this namespace's lock."""


class ManagerStartError(RuntimeError):
    """The manager cannot start; the text says what, where, and what to do."""


@dataclass(frozen=True)
class ManagerSettings:
    """The daemon's options (seconds for periods; percent points for ``util_threshold``).

    ``quiet_after``: seconds without a record update after which a live app is shown as quiet
    (it is never removed while its process runs). ``log_max_bytes`` / ``log_keep``: the manager
    log is rotated when it would grow beyond this many bytes, keeping this many old files
    (``log_max_bytes=None``: never rotated).
    """

    namespace: str | None = None
    policy: str = DEFAULT_POLICY
    sd_threshold: float = defaults.SD_THRESHOLD
    util_threshold: float = defaults.UTIL_THRESHOLD
    dr_total: int = DEFAULT_TOTAL
    sample_period: float = defaults.SAMPLE_PERIOD
    window: int = defaults.UTIL_WINDOW
    util_log_period: float = defaults.UTIL_LOG_PERIOD
    heartbeat_period: float = 0.5
    gc_period: float = 1.0
    rescan_period: float = 2.0
    status_period: float = 1.0
    quiet_after: float = 600.0
    inbox_messages: int = 10
    log_path: Path | None = None
    log_max_bytes: int | None = DEFAULT_LOG_MAX_BYTES
    log_keep: int = DEFAULT_LOG_KEEP
    slurm_weight_period: float = DEFAULT_WEIGHT_PERIOD  # seconds between weight updates (--slurm-weight)

    def __post_init__(self) -> None:
        for name in ("sample_period", "util_log_period", "heartbeat_period", "gc_period", "rescan_period",
                     "status_period", "quiet_after", "slurm_weight_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1 sample; got {self.window}")
        if isinstance(self.dr_total, bool) or not isinstance(self.dr_total, int) or not 1 <= self.dr_total <= 65535:
            raise ValueError(f"the DR granularity (--dr-total) must be an integer 1..65535 (what a record's "
                             f"16-bit shares carry); got {self.dr_total!r}")
        if not 1 <= self.inbox_messages <= 10:
            raise ValueError(f"inbox_messages must be 1..10 (Linux's limit for unprivileged users); "
                             f"got {self.inbox_messages}")
        if self.log_max_bytes is not None and (isinstance(self.log_max_bytes, bool) or self.log_max_bytes < 4096):
            raise ValueError(f"the log's rotation size (--log-max-bytes) must be at least 4096 bytes, or 0 for "
                             f"never; got {self.log_max_bytes!r}")
        keep = self.log_keep
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= MAX_LOG_KEEP:
            raise ValueError(f"the rotated logs to keep (--log-keep) must be an integer 0..{MAX_LOG_KEEP}; "
                             f"got {keep!r}")


class Balancer:
    """The part of a manager that does not depend on how its apps reach it (see the module
    docstring). Subclasses add ``start``, ``turn`` and ``stop``."""

    def __init__(
        self,
        settings: ManagerSettings,
        source: UtilizationSource,
        table: AppTable,
        namespace: str,
        clock: Clock | None = None,
        policy: Policy | None = None,
        metrics: ManagerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.metrics = metrics  # None: no metrics are kept (drbalance-manager without --metrics-port)
        self.source = source
        self.clock = clock or SystemClock()
        self.policy = policy or make_policy(settings.policy)
        self.gpu_count = source.gpu_count()
        self.config = PolicyConfig(self.gpu_count, settings.dr_total, settings.sd_threshold, settings.util_threshold)
        self.window = UtilizationWindow(self.gpu_count, settings.window)
        self.table = table
        self.last_sample: tuple[float | None, ...] = (None,) * self.gpu_count
        self.server = ServerGpus(self.gpu_count, _gpu_uuids(source, self.gpu_count))  # memory: see _sample
        self.stopping: str | None = None
        self.decisions = 0
        self._uuids_retry_at = -math.inf  # when GPU UUIDs unknown at start-up are read again
        self._memory_read: list[tuple[Any, float]] = [(None, -math.inf)] * self.gpu_count  # per GPU: reading, when
        self.faults: dict[str, str] = {}  # task -> the error it last failed with (cleared on recovery)
        self.fault_counts: dict[str, int] = {}  # task -> times it failed in a row (cleared on recovery)
        self._fault_logged: dict[str, float] = {}
        self._reported: dict[tuple[str, ...], float] = {}  # (kind, app, ...) reported once -> when last seen
        self._unreported = 0  # new problems not kept nor named on stderr since the count was last said
        self._unreported_said = -math.inf  # when that count was last said (monotonic seconds)
        self._log: JsonLinesWriter | None = None
        self._log_path: Path | None = None
        self._next: dict[str, float] = {}
        self._started_wall = 0.0
        self.slurm: SlurmWeight | None = None  # --slurm-weight: this node's weight in Slurm
        self._weight_due = -math.inf  # when the node's weight is next computed (monotonic seconds)

    def finish(self, reason: str) -> None:
        """The end of a stop that every manager does: the Slurm weight's run, the utilisation source
        (emulated GPUs still used by jobs stay, and are named), the ``stop`` record, the log. Each
        step is attempted whatever the others do."""
        if self.slurm is not None:
            self.slurm.close()
        try:
            self.source.close()
        except Exception as error:  # the stop goes on: its log record, the lock
            logger.error("drbalance-manager: closing the utilisation source failed: %s", error)
        in_use = dict(getattr(self.source, "left_in_use", {}))  # emulated GPUs: jobs still map them
        if in_use:
            logger.info("drbalance-manager: emulated GPU(s) %s are still used by pid(s) %s and stay; the manager of "
                        "namespace %r that stops when no job uses them removes them", sorted(in_use),
                        sorted({pid for pids in in_use.values() for pid in pids}), self.namespace)
        self.log("stop", reason=reason, decisions=self.decisions,
                 **({"gpus_left_in_use": {str(gpu): pids for gpu, pids in in_use.items()}} if in_use else {}))
        if self._log is not None:
            lost = self._log.close()
            if lost:
                logger.error("drbalance-manager: %d line(s) of the manager log %s could not be written (%s)",
                             lost, self._log_path, self.faults.get("log", "disk full?"))
            self._log = None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _open_log(self, path: Path) -> None:
        """Open the manager log at ``path`` (rotated as the settings say); ``ManagerStartError`` if
        it cannot be written."""
        self._log_path = path
        try:
            self._log = JsonLinesWriter(path, flush_every=1, max_bytes=self.settings.log_max_bytes,
                                        keep=self.settings.log_keep)
        except OSError as error:
            raise ManagerStartError(f"cannot write the manager log {path}: {error}") from None

    def _close_log_unwritten(self) -> None:
        """Close the log of a start that failed (nothing of the stop's is written)."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def request_stop(self, reason: str) -> None:
        """Ask the loop to end after the current turn (safe from a signal handler)."""
        if self.stopping is None:  # the first reason is the one that counts
            self.stopping = reason

    def run(self, duration: float | None = None) -> None:
        """Loop until ``request_stop`` (or ``duration`` seconds)."""
        end = None if duration is None else self.clock.monotonic() + duration
        while self.stopping is None:
            self.turn()
            if end is not None and self.clock.monotonic() >= end:
                self.request_stop("duration reached")

    def _run_task(self, key: str, task: Any, now: float) -> None:
        """Run one task; an error is logged (once a minute at most per task) and the loop goes on."""
        try:
            task(now)
        except Exception as error:  # a fault must never stop the daemon: log it, try again next period
            self._fault(key, error)
        else:
            if key in self.faults:
                self._recovered(key)

    def _fault(self, key: str, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        now = self.clock.monotonic()  # the injected clock (a manual one in tests), as every other period
        if self.faults.get(key) != text or now - self._fault_logged.get(key, -math.inf) >= FAULT_REPEAT_SECONDS:
            self._fault_logged[key] = now
            self.log("fault", task=key, error=text)
            if isinstance(error, (OSError, RecordError, SampleFailed)):
                logger.error("drbalance-manager: %s failed: %s (serving on; trying again)", key, text)
            else:
                logger.exception("drbalance-manager: %s failed (serving on; trying again)", key)
        self.faults[key] = text
        self.fault_counts[key] = self.fault_counts.get(key, 0) + 1

    def _recovered(self, key: str) -> None:
        error = self.faults.pop(key)
        failures = self.fault_counts.pop(key, 0)
        self._fault_logged.pop(key, None)
        self.log("recovered", task=key, error=error, failures=failures)
        logger.warning("drbalance-manager: %s works again after %d failure(s) (last: %s)", key, failures, error)

    def decide(self, entry: AppEntry, trigger: str, generation: int, queued: float | None = None) -> DataRatio:
        """Steps 4-6 for one app; returns the DR sent (in the app's slot order).

        Policies work in the server's GPU order (the table maps each app's slots by GPU UUID);
        the command goes back in the app's own order. Policies see every DR at the manager's DR
        total, whatever total the app's record carries, and a new DR is sent at that total; a DR
        kept is sent as the app has it (a job takes a command only at its manager's total, or
        when it keeps the DR the job has). An app whose GPUs this manager does not see keeps its DR,
        and so does one whose record says it finished (branch ``finished``): the snapshot leaves it
        out, and a policy asked about it would fail.
        """
        snapshot = Snapshot(self.table.views(self.config.dr_total, self.server), self.window.values(), self.config)
        app_old = entry.effective_ratio()
        started = time.perf_counter()
        next_boundary = None
        pushes: dict[str, DataRatio] = {}
        try:
            if entry.status.state == AppState.FINISHED:  # its record says it ended: in no snapshot, so no policy
                raise NotLive("its record says it finished (a FINISH notice removes a job that ends)")
            view = entry.view(self.config.dr_total, self.server)
        except NotLive as error:
            view = None
            old, ratio, branch, details = app_old, app_old, "finished", {"error": str(error)}
        except Unmapped as error:
            view = None
            old, ratio, branch, details = app_old, app_old, "unmapped", {"error": str(error)}
        except (ArithmeticError, ValueError) as error:  # its record holds values no view can be built from
            view = None
            old, ratio, branch, details = app_old, app_old, "bad-record", {"error": repr(error)}
        if view is not None:
            old = view.ratio
            try:
                decision = self.policy.decide(entry.name, trigger, snapshot)
                ratio, branch, details = decision.ratio, decision.branch, dict(decision.details)
                next_boundary = decision.next_boundary
                self._check_ratio(ratio, old, view)
                sent = app_old if ratio == old else entry.to_app_ratio(ratio, self.server)
                pushes = dict(decision.others)
            except Exception as error:  # a policy bug must never crash the daemon or reach the app
                logger.exception("drbalance-manager: policy %r failed for %r", self.policy.name, entry.name)
                ratio, branch, details = old, "policy-error", {"error": repr(error)}
                sent = app_old
        else:
            sent = app_old
        spent = time.perf_counter() - started
        if sent != ratio:
            details["app_dr"] = sent.to_list()  # the same DR in the app's slot order
        solo = self._solo_estimate(entry.name)
        entry.channel.answer(AppCommand(os.getpid(), generation, sent, branch, self.clock.wall(), next_boundary,
                                        solo_iteration=solo))
        entry.assigned, entry.assigned_mono = sent, self.clock.monotonic()
        self.decisions += 1
        if self.metrics is not None:
            self.metrics.decision(self.policy.name, branch)
        self.log("decision", app=entry.name, trigger=trigger, generation=generation, branch=branch,
                 old_dr=old.to_list(), new_dr=ratio.to_list(), dr_total=ratio.total,
                 sd={view.name: view.slowdown for view in snapshot.apps},
                 dr={view.name: view.ratio.to_list() for view in snapshot.apps},
                 util=list(snapshot.utilization), details=details, next_boundary=next_boundary,
                 solo_estimate=solo, decide_us=spent * 1e6, **({} if queued is None else {"queued_us": queued * 1e6}))
        for other, other_ratio in pushes.items():
            if other == entry.name:  # the deciding app's own DR is the answer above, never a push
                self.log("push", app=other, branch=branch, refused="a push to the deciding app itself")
                continue
            self._push(other, other_ratio, branch, snapshot)
        return sent

    def _solo_estimate(self, app: str) -> float | None:
        """The policy's estimate of the app's solo iteration in seconds, sent with every answer and
        push (``policy.base.SoloEstimating``); None if the policy makes none or it fails (logged)."""
        if not isinstance(self.policy, SoloEstimating):
            return None
        try:
            seconds = self.policy.solo_estimate(app)
        except Exception:  # a policy bug must never crash the daemon or reach the app
            logger.exception("drbalance-manager: policy %r failed to estimate %r's solo time", self.policy.name, app)
            return None
        return seconds if isinstance(seconds, float) and math.isfinite(seconds) and seconds > 0 else None

    def _push(self, name: str, ratio: DataRatio, branch: str, snapshot: Snapshot) -> None:
        """Send another app its part of a joint decision now (it applies it after its current iteration)."""
        entry = self.table.get(name)
        try:
            if entry is None:
                raise ValueError(f"app {name!r} is not in the table")
            if not isinstance(ratio, DataRatio):
                raise TypeError(f"policy pushed {ratio!r}, not a DataRatio")
            view = snapshot.app(name)
            self._check_ratio(ratio, view.ratio, view)
            sent = entry.effective_ratio() if ratio == view.ratio else entry.to_app_ratio(ratio, self.server)
        except Exception as error:  # one bad push is refused and logged; the decision's other pushes go on
            shown = ratio.to_list() if isinstance(ratio, DataRatio) else repr(ratio)
            self.log("push", app=name, branch=branch, new_dr=shown, refused=str(error))
            return
        generation = entry.status.notice_seq
        entry.channel.answer(AppCommand(os.getpid(), generation, sent, branch, self.clock.wall(), pushed=True,
                                        solo_iteration=self._solo_estimate(name)))
        entry.assigned, entry.assigned_mono = sent, self.clock.monotonic()
        self.log("push", app=name, branch=branch, generation=generation, old_dr=view.ratio.to_list(),
                 new_dr=ratio.to_list())

    def _check_ratio(self, ratio: DataRatio, old: DataRatio, view: AppView) -> None:
        """A new DR must fit the server, the configured total and the app's constraints.

        Keeping the old one is always fine.
        """
        if ratio == old:
            return
        if len(ratio) != self.gpu_count or ratio.total != self.config.dr_total:
            raise ValueError(f"policy returned {ratio} for {self.gpu_count} GPUs of total {self.config.dr_total}")
        problems = violations(view, ratio, self.config)
        if problems:
            raise ValueError(f"policy returned {ratio}, which breaks the app's constraints: {'; '.join(problems)}")

    def _log_added(self, entry: AppEntry, via: str) -> None:
        status = entry.status
        self.log("app_added", app=entry.name, pid=status.pid, via=via, dr=entry.effective_ratio().to_list(),
                 iterations_total=status.iterations_total, solo_time=status.solo_time)

    def _refresh_all(self, now: float) -> None:
        for entry in list(self.table.entries.values()):
            try:
                self.table.refresh(entry)
            except RecordError as error:
                if now - entry.last_complaint_mono > 10.0:  # one log line per app per 10 s at most
                    entry.last_complaint_mono = now
                    self.log("invalid", what="record", app=entry.name, error=str(error))
                    logger.warning("drbalance-manager: kept %r's last valid record: %s", entry.name, error)

    def _sample(self, now: float) -> None:
        """Read the GPUs' utilisation and memory. A source that fails counts as unavailable readings,
        and the error is raised after them: a fault of this task (logged when it starts, changes or
        ends, shown in ``faults``), not a warning at every period."""
        failure = None
        try:
            reading = self.source.sample()
        except Exception as error:  # a flaky driver or a broken script must not stop the loop
            failure, reading = error, (None,) * self.gpu_count
        self.last_sample = tuple(reading)
        self.window.add(reading)
        self.server = ServerGpus(self.gpu_count, self._known_uuids(now), self._memory(now))
        if failure is not None:
            raise SampleFailed(f"the utilisation source {getattr(self.source, 'name', '?')!r} failed: "
                               f"{type(failure).__name__}: {failure}") from failure

    def _memory(self, now: float) -> tuple:
        """The GPUs' memory now; a GPU whose reading failed keeps its last one for
        ``MEMORY_KEPT_SECONDS`` (a stale free-memory cap is better than none); () if none is known."""
        memory = _gpu_memory(self.source, self.gpu_count) or (None,) * self.gpu_count
        merged = []
        for gpu, reading in enumerate(memory):
            if reading is not None:
                self._memory_read[gpu] = (reading, now)
            else:
                last, when = self._memory_read[gpu]
                reading = last if now - when <= MEMORY_KEPT_SECONDS else None
            merged.append(reading)
        return tuple(merged) if any(reading is not None for reading in merged) else ()

    def _known_uuids(self, now: float) -> tuple[str | None, ...]:
        """The GPUs' UUIDs, read again every ``UUID_RETRY_SECONDS`` while any is unknown: one that
        failed to read at start-up would otherwise leave the jobs on that GPU unmapped (their DRs
        kept) for the manager's life."""
        uuids = self.server.uuids
        if (uuids and None not in uuids) or not hasattr(self.source, "gpu_uuids") or now < self._uuids_retry_at:
            return uuids
        self._uuids_retry_at = now + UUID_RETRY_SECONDS
        found = _gpu_uuids(self.source, self.gpu_count, quiet=True)
        if found != uuids and sum(u is not None for u in found) >= sum(u is not None for u in uuids):
            self.log("gpu_uuids", uuids=list(found), before=list(uuids))
            return found
        return uuids

    def _log_utilization(self, now: float) -> None:
        self.log("util", util=list(self.last_sample), smoothed=list(self.window.values()))

    def _mark_quiet(self, entry: AppEntry, now: float) -> None:
        silent = now - entry.status.updated_mono
        if silent > self.settings.quiet_after and entry.quiet_since is None:
            entry.quiet_since = now
            self.log("app_quiet", app=entry.name, pid=entry.status.pid, silent=silent)
            logger.info("drbalance-manager: %r (pid %d) has not reported for %.0f s; its process runs, so it "
                        "stays (shown as quiet)", entry.name, entry.status.pid, silent)
        elif silent <= self.settings.quiet_after and entry.quiet_since is not None:
            self.log("app_active", app=entry.name, pid=entry.status.pid, quiet_for=now - entry.quiet_since)
            entry.quiet_since = None

    def _first_report(self, key: tuple[str, ...]) -> bool:
        """Whether ``key`` (a problem: kind, app, ...) is new and to be named on stderr; a known one
        is marked as seen now. Past ``MAX_REPORTED`` known problems a new one is counted, not kept."""
        now = self.clock.monotonic()
        if key in self._reported:
            self._reported[key] = now
            return False
        if len(self._reported) >= MAX_REPORTED:
            self._unreported += 1
            return False
        self._reported[key] = now
        return True

    def _forget_reports(self, now: float) -> None:
        """Drop the problems not seen for ``REPORT_FORGET_SECONDS``, and say how many were not
        named on stderr (at most every ``UNREPORTED_SAID_SECONDS``)."""
        horizon = now - REPORT_FORGET_SECONDS
        for key in [key for key, seen in self._reported.items() if seen < horizon]:
            del self._reported[key]
        if self._unreported and now - self._unreported_said >= UNREPORTED_SAID_SECONDS:
            logger.warning("drbalance-manager: %d more problem(s) (other apps or reasons) were not named on stderr; "
                           "the manager log records them", self._unreported)
            self._unreported, self._unreported_said = 0, now

    def _report_once(self, key: tuple[str, ...], event: str, **fields: Any) -> None:
        """Log a problem (and name it on stderr) once while it stays; one past ``MAX_REPORTED`` is
        logged every time it is seen, as there is no room to remember it."""
        known = key in self._reported
        named = self._first_report(key)  # marks a known one as seen now
        if known:
            return
        self.log(event, **fields)
        if named:
            logger.warning("drbalance-manager: %s", fields.get("error", fields))

    def _slurm_weight(self, now: float) -> None:
        """``--slurm-weight``: collect the last ``scontrol`` run (logged; a failure is this task's
        fault), and every ``slurm_weight_period`` seconds set the node's weight from the SD a new job
        would have here (``drbalance.manager.slurm``)."""
        if self.slurm is None:
            return
        done = self.slurm.poll(now)
        if done is not None:
            self.log("slurm_weight", node=self.slurm.node, weight=done.weight, predicted_sd=done.slowdown,
                     command=" ".join(done.command), returncode=done.returncode, output=done.output)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(done.command)} failed ({done.returncode}): {done.output}")
        if now >= self._weight_due:
            self._weight_due = now + self.settings.slurm_weight_period
            views = self.table.views(self.config.dr_total, self.server)
            self.slurm.update(new_job_slowdown(views, self.gpu_count), now)

    def status_document(self, now: float) -> dict[str, Any]:
        """What ``drbalance status`` shows, as JSON-ready data (each subclass adds its own fields)."""
        return {
            "pid": os.getpid(), "namespace": self.namespace, "policy": self.policy.name,
            "started": self._started_wall, "updated": self.clock.wall(), "gpus": self.gpu_count,
            "util": list(self.window.values()), "decisions": self.decisions, "quiet_after": self.settings.quiet_after,
            "apps": [self.app_status(entry, now) for entry in self.table.entries.values()],
            "memory": [None if m is None else {"used": m.used, "total": m.total}
                       for m in (self.server.memory or (None,) * self.gpu_count)],
            "faults": dict(self.faults),
            "fault_counts": {task: self.fault_counts.get(task, 1) for task in self.faults},
            "metrics": self.metrics.url() if self.metrics is not None else None,
        }

    def app_status(self, entry: AppEntry, now: float) -> dict[str, Any]:
        """One app in ``status_document``."""
        status = entry.status
        dr, steered = self._server_dr(entry)
        return {"name": entry.name, "pid": status.pid, "epoch": status.epoch, "epochs": status.epochs,
                "iteration": status.iteration, "iterations_total": status.iterations_total, "sd": status.slowdown,
                "dr": dr, "state": status.state.name, "sd_estimated": status.solo_estimated,
                "solo_basis": status.solo_basis, "sd_bound": status.sd_bound,
                "updated_ago": now - status.updated_mono,
                "quiet_for": None if entry.quiet_since is None else now - entry.quiet_since, "steered": steered}

    def _server_dr(self, entry: AppEntry) -> tuple[list[int], bool]:
        """The app's DR by the manager's GPU index (as in the manager log and the metrics), and
        whether this manager can steer it (its devices are among the manager's GPUs). An app that
        cannot be mapped keeps its own slot order."""
        ratio = entry.effective_ratio()
        try:
            mapping = entry.slot_map(self.server)
        except Unmapped:
            return ratio.to_list(), False
        if len(mapping) != len(ratio):
            return ratio.to_list(), True
        shares = [0] * self.gpu_count
        for slot, gpu in enumerate(mapping):
            if gpu is not None:
                shares[gpu] = ratio[slot]
        return shares, True

    def metric_name(self, entry: AppEntry) -> str:
        """The ``app`` label of an app's metrics."""
        return entry.name

    def _update_metrics(self, now: float) -> None:
        """Swap in the metrics' view of the apps and GPUs (apps that left drop out of it)."""
        if self.metrics is None:
            return
        apps = []
        for entry in self.table.live():
            status = entry.status
            try:
                ratio = entry.view(self.config.dr_total, self.server).ratio
                shares = tuple(share / ratio.total for share in ratio.to_list())
            except (Unmapped, ArithmeticError, ValueError):
                shares = ()
            apps.append(AppMetrics(self.metric_name(entry), status.slowdown, status.iteration_time, shares,
                                   status.solo_estimated, status.solo_basis == "manager", status.sd_bound))
        memory = self.server.memory or (None,) * self.gpu_count
        self.metrics.update(MetricsSnapshot(tuple(apps), tuple(self.window.values()), tuple(memory)))

    def log(self, event: str, **fields: Any) -> None:
        if self._log is None:
            return
        self._log.write({"t": self.clock.wall(), "event": event, **fields})
        error = self._log.error
        if error is not None:  # counted in fault_counts like every other task: writes failed in a row
            self.fault_counts["log"] = self.fault_counts.get("log", 0) + 1
            if self.faults.get("log") != str(error):
                self.faults["log"] = str(error)
                logger.error("drbalance-manager: cannot write the manager log %s: %s (lines are kept in memory and "
                             "written when it works again)", self._log_path, error)
        elif "log" in self.faults:
            previous = self.faults.pop("log")
            failures = self.fault_counts.pop("log", 0)
            logger.warning("drbalance-manager: the manager log works again after %d failed write(s) (last: %s)",
                           failures, previous)


def _gpu_uuids(source: UtilizationSource, count: int, quiet: bool = False) -> tuple[str | None, ...]:
    """The source's GPU UUIDs, or () when it cannot tell (slots then map to GPUs by index).
    ``quiet``: no warning when they cannot be read (a retry)."""
    try:
        uuids = tuple(source.gpu_uuids()) if hasattr(source, "gpu_uuids") else ()
    except Exception as error:  # a flaky driver: map by index
        if not quiet:
            logger.warning("drbalance-manager: GPU UUIDs unavailable (%s); jobs' slots map to GPUs by index", error)
        return ()
    return uuids if len(uuids) == count else ()


def _gpu_memory(source: UtilizationSource, count: int) -> tuple:
    """The source's memory readings now, or () (no memory caps) when it cannot tell."""
    try:
        memory = tuple(source.memory()) if hasattr(source, "memory") else ()
    except Exception as error:  # a flaky driver must not stop the loop
        logger.debug("drbalance-manager: GPU memory unavailable: %s", error)
        return ()
    return memory if len(memory) == count else ()
