"""The manager daemon: the control loop of the paper's Fig. 2, steps 3-6, plus housekeeping.

One turn of the loop waits for a notice on the inbox (at most until the next periodic task),
and for a notice: refreshes every app's record (step 3), runs the policy for the notifying app
(step 4), writes the new DR into its record (step 5) and posts its semaphore (step 6). Periodic
tasks: heartbeat, utilisation sampling and smoothing, garbage collection of dead apps (pid gone
or record stale; their IPC objects are removed), adoption of live apps whose records appear
(e.g. after a manager restart), and the status file read by ``drbalance status``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.endpoint import ManagerEndpoint
from drbalance.ipc.layout import AppCommand, AppState, ManagerBeat, Notice, NoticeKind, RecordError
from drbalance.ipc.names import IpcNames
from drbalance.ipc.records import RecordEmpty, remove_stale_app
from drbalance.jsonlog import JsonLinesWriter
from drbalance.manager.table import AppEntry, AppTable, ServerGpus, Unmapped
from drbalance.manager.utilization import UtilizationSource, UtilizationWindow
from drbalance.policy import DEFAULT_POLICY, AppView, Policy, PolicyConfig, Snapshot, make_policy, violations
from drbalance.ratio import DEFAULT_TOTAL, DataRatio

logger = logging.getLogger("drbalance.manager")


class ManagerAlreadyRunning(RuntimeError):
    """Another manager holds this namespace's lock."""


@dataclass(frozen=True)
class ManagerSettings:
    """The daemon's options (seconds for periods; percent points for ``util_threshold``)."""

    namespace: str | None = None
    policy: str = DEFAULT_POLICY
    sd_threshold: float = 0.1
    util_threshold: float = 20.0
    dr_total: int = DEFAULT_TOTAL
    sample_period: float = 0.5
    window: int = 6
    util_log_period: float = 1.0
    heartbeat_period: float = 0.5
    gc_period: float = 1.0
    rescan_period: float = 2.0
    status_period: float = 1.0
    stale_after: float = 600.0
    inbox_messages: int = 10
    log_path: Path | None = None

    def __post_init__(self) -> None:
        for name in ("sample_period", "util_log_period", "heartbeat_period", "gc_period", "rescan_period",
                     "status_period", "stale_after"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1 sample; got {self.window}")
        if not 1 <= self.inbox_messages <= 10:
            raise ValueError(f"inbox_messages must be 1..10 (Linux's limit for unprivileged users); "
                             f"got {self.inbox_messages}")


class ManagerLock:
    """An exclusive ``flock`` on the namespace's lock file, released when the process dies."""

    def __init__(self, path: Path) -> None:
        objects.ensure_private_dir(path.parent.parent)
        objects.ensure_private_dir(path.parent)
        self.path = path
        self.handle: TextIO | None = open(path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "unknown"
            self.handle.close()
            self.handle = None
            raise ManagerAlreadyRunning(
                f"a drbalance-manager (pid {owner}) is already running in namespace {path.parent.name!r}; "
                f"stop it first, or use another namespace (--namespace / DRBALANCE_NAMESPACE)"
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"{os.getpid()}\n")
        self.handle.flush()

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


class Manager:
    """The daemon. ``start()``, then ``run()`` (or ``turn()`` repeatedly), then ``stop()``."""

    def __init__(
        self,
        settings: ManagerSettings,
        source: UtilizationSource,
        clock: Clock | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.settings = settings
        self.source = source
        self.clock = clock or SystemClock()
        self.policy = policy or make_policy(settings.policy)
        self.names = IpcNames.current(settings.namespace)
        self.gpu_count = source.gpu_count()
        self.config = PolicyConfig(self.gpu_count, settings.dr_total, settings.sd_threshold, settings.util_threshold)
        self.window = UtilizationWindow(self.gpu_count, settings.window)
        self.table = AppTable(self.names)
        self.last_sample: tuple[float | None, ...] = (None,) * self.gpu_count
        self.server = ServerGpus(self.gpu_count, _gpu_uuids(source, self.gpu_count))  # memory: see _sample
        self.stopping: str | None = None
        self.decisions = 0
        self._lock: ManagerLock | None = None
        self._endpoint: ManagerEndpoint | None = None
        self._log: JsonLinesWriter | None = None
        self._next: dict[str, float] = {}
        self._started_wall = 0.0

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._lock = ManagerLock(self.names.manager_lock())
        try:
            self._endpoint = ManagerEndpoint(self.names, self.settings.inbox_messages)
        except Exception:
            self._lock.release()
            raise
        self._started_wall = self.clock.wall()
        log_path = self.settings.log_path or (self.names.runtime_dir() / "manager.jsonl")
        self._log = JsonLinesWriter(log_path, flush_every=1)
        self.log("start", pid=os.getpid(), namespace=self.names.namespace, policy=self.policy.name,
                 gpus=self.gpu_count, config=asdict(self.config),
                 settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.settings).items()})
        now = self.clock.monotonic()
        self._next = dict.fromkeys(("beat", "sample", "util_log", "gc", "rescan", "status"), now)
        self._heartbeat(now)
        self._rescan(now)  # a restarted manager picks up the apps that are still running
        logger.info("drbalance-manager: namespace %r, policy %r, %d GPU(s), log %s",
                    self.names.namespace, self.policy.name, self.gpu_count, log_path)

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

    def stop(self) -> None:
        """Remove the inbox, heartbeat and status file; release the lock. Apps train on alone."""
        reason = self.stopping or "stopped"
        for entry in list(self.table.entries.values()):
            self.table.remove(entry.name, unlink=False)
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        try:
            self.names.manager_status().unlink()
        except FileNotFoundError:
            pass
        self.log("stop", reason=reason, decisions=self.decisions)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self.source.close()

    def __enter__(self) -> Manager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- one turn of the loop ----------------------------------------------------------------
    def turn(self) -> None:
        """Wait for a notice until the next periodic task is due; handle it; run due tasks."""
        now = self.clock.monotonic()
        wait = max(0.0, min(self._next.values()) - now)
        try:
            notice = self._endpoint.receive(wait)
        except RecordError as error:
            self.log("invalid", what="notice", error=str(error))
            logger.warning("drbalance-manager: ignored a malformed notice: %s", error)
            notice = None
        if notice is not None:
            self.handle(notice)
        self._periodic(self.clock.monotonic())

    def _periodic(self, now: float) -> None:
        settings = self.settings
        tasks = (
            ("beat", settings.heartbeat_period, self._heartbeat),
            ("sample", settings.sample_period, self._sample),
            ("util_log", settings.util_log_period, self._log_utilization),
            ("gc", settings.gc_period, self._collect_garbage),
            ("rescan", settings.rescan_period, self._rescan),
            ("status", settings.status_period, self._write_status),
        )
        for key, period, task in tasks:
            if now >= self._next[key]:
                self._next[key] = now + period
                task(now)

    # --- notices: steps 3 to 6 ------------------------------------------------------------------
    def handle(self, notice: Notice) -> None:
        now = self.clock.monotonic()
        if notice.kind == NoticeKind.FINISH:
            entry = self.table.get(notice.app)
            if entry is not None and entry.status.pid == notice.pid:
                self.table.remove(notice.app, unlink=False)  # the app removes its own objects
                self.log("app_removed", app=notice.app, pid=notice.pid, reason="finished")
            return
        entry = self.table.get(notice.app)
        if entry is not None and entry.status.pid != notice.pid:
            # a new process under an old name: our mapping is the dead one's record
            self.table.remove(notice.app, unlink=False)
            entry = None
        if entry is None:
            entry = self._admit(notice.app, now, notice.pid, via="notice")
            if entry is None:
                return
        self._refresh_all(now)  # step 3: read every app's record
        trigger = "register" if notice.kind == NoticeKind.REGISTER else "boundary"
        self.decide(entry, trigger, notice.seq)

    def decide(self, entry: AppEntry, trigger: str, generation: int) -> DataRatio:
        """Steps 4-6 for one app; returns the DR sent (in the app's slot order).

        Policies work in the server's GPU order (the table maps each app's slots by GPU UUID);
        the command goes back in the app's own order. An app whose GPUs this manager does not
        see keeps its DR.
        """
        snapshot = Snapshot(self.table.views(self.config.dr_total, self.server), self.window.values(), self.config)
        app_old = entry.effective_ratio()
        started = time.perf_counter()
        next_boundary = None
        pushes: dict[str, DataRatio] = {}
        try:
            view = entry.view(self.config.dr_total, self.server)
        except Unmapped as error:
            view = None
            old, ratio, branch, details = app_old, app_old, "unmapped", {"error": str(error)}
        if view is not None:
            old = view.ratio
            try:
                decision = self.policy.decide(entry.name, trigger, snapshot)
                ratio, branch, details = decision.ratio, decision.branch, dict(decision.details)
                next_boundary = decision.next_boundary
                self._check_ratio(ratio, old, view)
                sent = entry.to_app_ratio(ratio, self.server)
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
        entry.channel.answer(AppCommand(os.getpid(), generation, sent, branch, self.clock.wall(), next_boundary))
        entry.assigned, entry.assigned_mono = sent, self.clock.monotonic()
        self.decisions += 1
        self.log("decision", app=entry.name, trigger=trigger, generation=generation, branch=branch,
                 old_dr=old.to_list(), new_dr=ratio.to_list(), dr_total=ratio.total,
                 sd={view.name: view.slowdown for view in snapshot.apps},
                 dr={view.name: view.ratio.to_list() for view in snapshot.apps},
                 util=list(snapshot.utilization), details=details, next_boundary=next_boundary,
                 decide_us=spent * 1e6)
        for other, other_ratio in pushes.items():
            self._push(other, other_ratio, branch, snapshot)
        return sent

    def _push(self, name: str, ratio: DataRatio, branch: str, snapshot: Snapshot) -> None:
        """Send another app its part of a joint decision now (it applies it at its next report)."""
        entry = self.table.get(name)
        try:
            if entry is None:
                raise ValueError(f"app {name!r} is not in the table")
            view = snapshot.app(name)
            self._check_ratio(ratio, view.ratio, view)
            sent = entry.to_app_ratio(ratio, self.server)
        except (ValueError, KeyError, Unmapped) as error:
            self.log("push", app=name, branch=branch, new_dr=ratio.to_list(), refused=str(error))
            return
        generation = entry.status.notice_seq
        entry.channel.answer(AppCommand(os.getpid(), generation, sent, branch, self.clock.wall(), pushed=True))
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

    def _admit(self, name: str, now: float, pid: int | None, via: str) -> AppEntry | None:
        try:
            entry = self.table.admit(name, now, expected_pid=pid)
        except RecordError as error:
            self.log("invalid", what="record", app=name, error=str(error))
            logger.warning("drbalance-manager: cannot admit %r: %s", name, error)
            return None
        status = entry.status
        self.log("app_added", app=name, pid=status.pid, via=via, dr=status.ratio.to_list(),
                 iterations_total=status.iterations_total, solo_time=status.solo_time)
        return entry

    def _refresh_all(self, now: float) -> None:
        for entry in list(self.table.entries.values()):
            try:
                self.table.refresh(entry)
            except RecordError as error:
                if now - entry.last_complaint_mono > 10.0:  # one log line per app per 10 s at most
                    entry.last_complaint_mono = now
                    self.log("invalid", what="record", app=entry.name, error=str(error))
                    logger.warning("drbalance-manager: kept %r's last valid record: %s", entry.name, error)

    # --- periodic tasks ----------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        self._endpoint.beat(ManagerBeat(os.getpid(), self.gpu_count, self.config.dr_total, self._started_wall, now))

    def _sample(self, now: float) -> None:
        try:
            reading = self.source.sample()
        except Exception as error:  # a flaky driver must not stop the loop
            logger.warning("drbalance-manager: utilisation sample failed: %s", error)
            reading = (None,) * self.gpu_count
        self.last_sample = tuple(reading)
        self.window.add(reading)
        self.server = ServerGpus(self.gpu_count, self.server.uuids, _gpu_memory(self.source, self.gpu_count))

    def _log_utilization(self, now: float) -> None:
        self.log("util", util=list(self.last_sample), smoothed=list(self.window.values()))

    def _collect_garbage(self, now: float) -> None:
        self._refresh_all(now)
        for entry in list(self.table.entries.values()):
            status = entry.status
            if not objects.pid_alive(status.pid):
                reason = "process gone"
            elif now - status.updated_mono > self.settings.stale_after:
                reason = f"record stale for {now - status.updated_mono:.0f} s"
            elif status.state == AppState.FINISHED:
                reason = "finished"  # its FINISH notice was lost; it cleans up after itself
            else:
                continue
            self.table.remove(entry.name, unlink=reason != "finished")
            self.log("app_removed", app=entry.name, pid=status.pid, reason=reason)
            logger.info("drbalance-manager: removed %r (%s)", entry.name, reason)

    def _rescan(self, now: float) -> None:
        """Adopt live apps whose records exist but that never reached us; remove dead ones' objects."""
        for name in self.names.listed_apps():
            if name in self.table:
                continue
            try:
                removed = remove_stale_app(self.names, name, grace_seconds=5.0)
            except Exception:  # alive (AppNameInUse) or still being created: adopt if readable
                removed = False
            if removed:
                self.log("app_removed", app=name, reason="leftovers of a dead process")
                continue
            try:
                entry = self.table.admit(name, now)
            except (RecordError, OSError) as error:
                if not isinstance(error, RecordEmpty):
                    logger.debug("drbalance-manager: not adopting %r yet: %s", name, error)
                continue
            if entry.status.state == AppState.FINISHED:  # said goodbye, removing its own objects now
                self.table.remove(name, unlink=False)
                continue
            self.log("app_added", app=name, pid=entry.status.pid, via="adopted", dr=entry.status.ratio.to_list(),
                     iterations_total=entry.status.iterations_total, solo_time=entry.status.solo_time)

    def _write_status(self, now: float) -> None:
        path = self.names.manager_status()
        status = {
            "pid": os.getpid(), "namespace": self.names.namespace, "policy": self.policy.name,
            "started": self._started_wall, "updated": self.clock.wall(), "gpus": self.gpu_count,
            "util": list(self.window.values()), "decisions": self.decisions,
            "apps": [
                {"name": e.name, "pid": e.status.pid, "epoch": e.status.epoch, "epochs": e.status.epochs,
                 "iteration": e.status.iteration, "iterations_total": e.status.iterations_total,
                 "sd": e.status.slowdown, "dr": e.effective_ratio().to_list(), "state": e.status.state.name,
                 "updated_ago": now - e.status.updated_mono}
                for e in self.table.entries.values()
            ],
        }
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".status.")
        with os.fdopen(handle, "w") as out:
            json.dump(status, out)
        os.replace(temporary, path)

    # --- the log -------------------------------------------------------------------------------
    def log(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.write({"t": self.clock.wall(), "event": event, **fields})


def _gpu_uuids(source: UtilizationSource, count: int) -> tuple[str | None, ...]:
    """The source's GPU UUIDs, or () when it cannot tell (slots then map to GPUs by index)."""
    try:
        uuids = tuple(source.gpu_uuids()) if hasattr(source, "gpu_uuids") else ()
    except Exception as error:  # a flaky driver: map by index
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
