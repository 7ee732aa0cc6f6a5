"""The manager daemon: the control loop of the paper's Fig. 2, steps 3-6, plus housekeeping.

One turn of the loop waits for a notice on the inbox (at most until the next periodic task),
and for a notice: refreshes every app's record (step 3), runs the policy for the notifying app
(step 4), writes the new DR into its record (step 5) and posts its semaphore (step 6). Periodic
tasks: heartbeat, utilisation sampling and smoothing, garbage collection of dead apps (their
IPC objects are removed), adoption of live apps found through their claims (e.g. after a
manager restart), the check of the runtime directory, and the status file read by
``drbalance status``.

Liveness is decided by the process alone: an app is dead when the pid its claim names is gone
or now belongs to a process with another start time (a record may say anything: one that names
another process than its claim is invalid, logged and ignored). An app that is alive but has not updated its record for
``quiet_after`` seconds (a long evaluation, a checkpoint) is shown as quiet, never removed.
Objects are removed only when their owner is dead. Objects under this namespace's prefix that
belong to another user are never opened for use; they are reported by name and owner.

Faults of the file system (the runtime directory removed, the status file replaced by a folder,
a full disk, a truncated heartbeat) are logged and survived: every periodic task and every
notice is handled under a guard that logs the error (once per minute at most per task) and goes
on; the task is tried again at its next period, and recovery is logged.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import posix_ipc

from drbalance import defaults
from drbalance.clock import Clock, SystemClock
from drbalance.ipc import discovery, objects
from drbalance.ipc.endpoint import AppChannel, ManagerEndpoint, other_live_manager
from drbalance.ipc.layout import AppCommand, AppState, ManagerBeat, Notice, NoticeKind, RecordError
from drbalance.ipc.names import IpcNames, ListedObject
from drbalance.ipc.private import (
    UnsafePath,
    is_open_file,
    open_private,
    read_private,
    remove_private,
    user_name,
    write_private,
)
from drbalance.ipc.records import AppRecord, RecordBusy, RecordEmpty
from drbalance.jsonlog import JsonLinesWriter
from drbalance.manager.listing import ShmLister, ShmListing
from drbalance.manager.metrics import AppMetrics, ManagerMetrics, MetricsSnapshot
from drbalance.manager.status import printable
from drbalance.manager.table import AppEntry, AppTable, ServerGpus, Unmapped
from drbalance.manager.utilization import UtilizationSource, UtilizationWindow
from drbalance.policy import DEFAULT_POLICY, AppView, Policy, PolicyConfig, Snapshot, make_policy, violations
from drbalance.policy.base import SoloEstimating
from drbalance.ratio import DEFAULT_TOTAL, DataRatio

logger = logging.getLogger("drbalance.manager")

UNCLAIMED_READ_ATTEMPTS = 20  # reads of a record no claim names: spins only, never sleeps (SeqlockArea.read)
GRACE_SECONDS = 5.0  # an unfinished claim or an unclaimed record younger than this is being created
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
MAX_FOREIGN_LISTED = 20
"""Other users' objects named in the status file and on stderr, and newly named in the manager log
per listing of /dev/shm; the rest are only counted (``foreign_total``, and ``foreign_count`` events
per owner in the log): a neighbour can plant hundreds of thousands, and a status file over
``MAX_PRIVATE_FILE`` could not be read back."""
MAX_FOREIGN_NAMED = 1000
"""Other users' objects the manager remembers by name (the first by name), so each is named in
the log once while it stays; a flood beyond them is counted, not kept."""


class ManagerAlreadyRunning(RuntimeError):
    """Another manager holds this namespace's lock."""


class ManagerStartError(RuntimeError):
    """The manager cannot start; the text says what, where, and what to do."""


class SampleFailed(RuntimeError):
    """The utilisation source raised; its readings count as unavailable (a fault of ``sample``)."""


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

    def __post_init__(self) -> None:
        for name in ("sample_period", "util_log_period", "heartbeat_period", "gc_period", "rescan_period",
                     "status_period", "quiet_after"):
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


def _lock_owner(fd: int, tries: int = 10) -> str:
    """The pid on the first line of a held lock file; a manager that has just taken the lock may
    not have written it yet, so an empty file is read again a few times (10 ms apart)."""
    for attempt in range(tries):
        first = os.pread(fd, 32, 0).decode("ascii", "replace").split("\n")[0].strip()
        if first:
            return first
        if attempt + 1 < tries:
            time.sleep(0.01)
    return "unknown"


class ManagerLock:
    """An exclusive ``flock`` on the namespace's lock file, released when the process dies.

    The folder of ``path`` must be the checked private runtime directory (see ``IpcNames``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, _ = open_private(path, os.O_RDWR | os.O_CREAT, private=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            os.close(fd)
            raise ManagerAlreadyRunning(
                f"a drbalance-manager (pid {owner}) is already running in namespace {path.parent.name!r}; "
                f"stop it first, or use another namespace (--namespace / DRBALANCE_NAMESPACE)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        mine = f"{os.getpid()}\n".encode()
        os.pwrite(fd, mine, 0)  # the pid first, then the old tail cut: a reader never finds the file empty
        os.ftruncate(fd, len(mine))
        self.fd: int | None = fd

    def held(self) -> bool:
        """Whether ``path`` still names the file we hold locked (not removed with its folder)."""
        return self.fd is not None and is_open_file(self.fd, self.path, private=True)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the descriptor releases the flock


class Manager:
    """The daemon. ``start()``, then ``run()`` (or ``turn()`` repeatedly), then ``stop()``."""

    def __init__(
        self,
        settings: ManagerSettings,
        source: UtilizationSource,
        clock: Clock | None = None,
        policy: Policy | None = None,
        metrics: ManagerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics  # None: no metrics are kept (drbalance-manager without --metrics-port)
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
        self.foreign: dict[str, int] = {}  # /dev/shm entries under our prefix owned by others, named: entry -> uid
        self.foreign_counts: dict[int, int] = {}  # per owner uid: their entries under our prefix, all counted
        self._lister = ShmLister(self.names, MAX_FOREIGN_NAMED)
        self._listing_claims: set[tuple[str, str]] = set()  # (app, token) of the claims at the last rescan
        self._foreign_warned = 0  # foreign objects named on stderr (MAX_FOREIGN_LISTED at most)
        self._uuids_retry_at = -math.inf  # when GPU UUIDs unknown at start-up are read again
        self._memory_read: list[tuple[Any, float]] = [(None, -math.inf)] * self.gpu_count  # per GPU: reading, when
        self._stuck_unclaimed: dict[str, int] = {}  # unclaimed records left mid-write: entry -> its odd counter
        self.faults: dict[str, str] = {}  # task -> the error it last failed with (cleared on recovery)
        self.fault_counts: dict[str, int] = {}  # task -> times it failed in a row (cleared on recovery)
        self._fault_logged: dict[str, float] = {}
        self._reported: dict[tuple[str, ...], float] = {}  # (kind, app, ...) reported once -> when last seen
        self._unreported = 0  # new problems not kept nor named on stderr since the count was last said
        self._unreported_said = -math.inf  # when that count was last said (monotonic seconds)
        self._claims_left: set[tuple[str, str]] = set()  # (app, token) removed while its claim was still locked
        self._lock: ManagerLock | None = None
        self._endpoint: ManagerEndpoint | None = None
        self._log: JsonLinesWriter | None = None
        self._log_path: Path | None = None
        self._next: dict[str, float] = {}
        self._started_wall = 0.0

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Check the runtime directory, open the log, take the lock, create the inbox and heartbeat.

        ``ManagerAlreadyRunning``, ``ManagerStartError`` (unsafe runtime directory, unwritable log,
        refused message queue): nothing is left behind then.
        """
        try:
            self.names.private_runtime_dir()
        except OSError as error:
            raise ManagerStartError(
                f"cannot use the runtime directory {self.names.runtime_dir()}: {error}. Point "
                f"DRBALANCE_RUNTIME_DIR (or XDG_RUNTIME_DIR) at a folder only you can write"
            ) from None
        self._log_path = self.settings.log_path or (self.names.runtime_dir() / "manager.jsonl")
        try:
            self._log = JsonLinesWriter(self._log_path, flush_every=1, max_bytes=self.settings.log_max_bytes,
                                        keep=self.settings.log_keep)
        except OSError as error:
            raise ManagerStartError(f"cannot write the manager log {self._log_path}: {error}") from None
        try:
            self._lock = ManagerLock(self.names.manager_lock())
            other = other_live_manager(self.names)
            if other is not None:
                raise ManagerAlreadyRunning(
                    f"another manager (pid {other.pid}) runs in namespace {self.names.namespace!r} with its lock "
                    f"in another runtime directory (not {self.names.runtime_dir()}); stop it, or give both the same "
                    "DRBALANCE_RUNTIME_DIR")
            # /dev/shm listed before the inbox and heartbeat exist: no job waits on this manager while
            # it lists (a neighbour's flood of names can make that take seconds)
            first_listing = self._lister.list_now()
            self._endpoint = ManagerEndpoint(self.names, self.settings.inbox_messages)
        except BaseException as error:
            self._abort_start()
            if isinstance(error, (objects.QueueLimitError, UnsafePath)):
                raise ManagerStartError(str(error)) from None
            raise
        self._started_wall = self.clock.wall()
        self.log("start", pid=os.getpid(), namespace=self.names.namespace, policy=self.policy.name,
                 gpus=self.gpu_count, config=asdict(self.config), runtime_dir=str(self.names.runtime_dir()),
                 settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.settings).items()})
        now = self.clock.monotonic()
        tasks = ("beat", "sample", "util_log", "gc", "runtime", "endpoint", "rescan", "status", "metrics")
        self._next = dict.fromkeys(tasks, now)
        self._run_task("beat", self._heartbeat, now)
        # a restarted manager picks up the apps still running, with the listing made before it could be reached
        self._run_task("rescan", lambda at: self._rescan(at, first_listing), now)
        logger.info("drbalance-manager: namespace %r, policy %r, %d GPU(s), log %s",
                    self.names.namespace, self.policy.name, self.gpu_count, self._log_path)

    def _abort_start(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
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

    def stop(self) -> None:
        """Remove the inbox, heartbeat, ``manager.json`` and status file; release the lock.

        Apps train on alone. Every step is attempted whatever the others do.
        """
        reason = self.stopping or "stopped"
        self._lister.join(timeout=1.0)  # a listing under way only reads /dev/shm: nothing to undo
        for entry in list(self.table.entries.values()):
            self.table.remove(entry.name, unlink=False)
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        self._remove_own_status()
        try:
            self.source.close()
        except Exception as error:  # the stop goes on: its log record, the lock
            logger.error("drbalance-manager: closing the utilisation source failed: %s", error)
        in_use = dict(getattr(self.source, "left_in_use", {}))  # emulated GPUs: jobs still map them
        if in_use:
            logger.info("drbalance-manager: emulated GPU(s) %s are still used by pid(s) %s and stay in %s; a "
                        "manager of namespace %r that stops when no job uses them removes them", sorted(in_use),
                        sorted({pid for pids in in_use.values() for pid in pids}), objects.SHM_DIR,
                        self.names.namespace)
        self.log("stop", reason=reason, decisions=self.decisions,
                 **({"gpus_left_in_use": {str(gpu): pids for gpu, pids in in_use.items()}} if in_use else {}))
        if self._log is not None:
            lost = self._log.close()
            if lost:
                logger.error("drbalance-manager: %d line(s) of the manager log %s could not be written (%s)",
                             lost, self._log_path, self.faults.get("log", "disk full?"))
            self._log = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _remove_own_status(self) -> None:
        path = self.names.manager_status()
        try:
            status = json.loads(read_private(path, private=True))
            if isinstance(status, dict) and status.get("pid") == os.getpid():
                remove_private(path, private=True)
        except (OSError, ValueError):
            pass  # gone, or not ours (a successor's): leave it

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
            self._run_task("notice", lambda _now: self.handle(notice), now)
        self._periodic(self.clock.monotonic())

    def _periodic(self, now: float) -> None:
        settings = self.settings
        tasks = (
            ("beat", settings.heartbeat_period, self._heartbeat),
            ("sample", settings.sample_period, self._sample),
            ("util_log", settings.util_log_period, self._log_utilization),
            ("gc", settings.gc_period, self._collect_garbage),
            ("runtime", settings.rescan_period, self._check_runtime_files),
            ("endpoint", settings.rescan_period, self._check_endpoint),
            ("rescan", settings.rescan_period, self._rescan),
            ("status", settings.status_period, self._write_status),
            ("metrics", settings.status_period, self._update_metrics),
        )
        for key, period, task in tasks:
            if now >= self._next[key]:
                self._next[key] = now + period
                self._run_task(key, task, now)
        if self._lister.ready():  # the listing of /dev/shm the last rescan began in a thread
            self._run_task("listing", self._take_listing, now)

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

    # --- notices: steps 3 to 6 ------------------------------------------------------------------
    def handle(self, notice: Notice) -> None:
        now = self.clock.monotonic()
        entry = self.table.get(notice.app)
        if notice.kind == NoticeKind.FINISH:
            if entry is not None and entry.owner_pid == notice.pid:
                self.table.remove(notice.app, unlink=False)  # the app removes its own objects
                self.log("app_removed", app=notice.app, pid=notice.pid, reason="finished")
            return
        if entry is not None and entry.owner_pid != notice.pid:
            if not self._replaced(entry, notice):
                return
            entry = None
        if entry is None:
            entry = self._admit(notice.app, now, notice.pid, via="notice")
            if entry is None:
                return
        self._refresh_all(now)  # step 3: read every app's record
        trigger = "register" if notice.kind == NoticeKind.REGISTER else "boundary"
        self.decide(entry, trigger, notice.seq)
        if self.metrics is not None:
            self.metrics.exchange(self.clock.wall() - notice.sent_wall)

    def _replaced(self, entry: AppEntry, notice: Notice) -> bool:
        """A notice from another pid than the app's: True if a new process now holds the name.

        Otherwise (a stray or forged notice) it is logged and ignored: the live app keeps its
        place in the table.
        """
        try:
            claim = discovery.read_claim(self.names, notice.app)
        except (OSError, discovery.DiscoveryError):
            claim = None
        if claim is not None and claim.pid == notice.pid and claim.token != entry.token:
            dead = not entry.alive()
            self.table.remove(entry.name, unlink=dead)
            self.log("app_removed", app=entry.name, pid=entry.owner_pid,
                     reason=f"its name was taken by pid {notice.pid}" + (" after it died" if dead else ""))
            return True
        error = (f"notice from pid {notice.pid} for app {notice.app!r}, which pid {entry.owner_pid} runs "
                 f"(claim: {'pid ' + str(claim.pid) if claim else 'none'}); ignored")
        self.log("invalid", what="notice", app=notice.app, error=error)
        logger.warning("drbalance-manager: %s", error)
        return False

    def decide(self, entry: AppEntry, trigger: str, generation: int) -> DataRatio:
        """Steps 4-6 for one app; returns the DR sent (in the app's slot order).

        Policies work in the server's GPU order (the table maps each app's slots by GPU UUID);
        the command goes back in the app's own order. Policies see every DR at the manager's DR
        total, whatever total the app's record carries, and a new DR is sent at that total; a DR
        kept is sent as the app has it (a job takes a command only at its manager's total, or
        when it keeps the DR the job has). An app whose GPUs this manager does not see keeps its DR.
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
                 solo_estimate=solo, decide_us=spent * 1e6)
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

    def _admit(self, name: str, now: float, pid: int | None, via: str) -> AppEntry | None:
        """Add app ``name`` found through a notice from ``pid``: its claim names its objects."""
        try:
            claim = discovery.read_claim(self.names, name)
            if claim is None:
                raise RecordError(f"app {name!r} has no claim in {self.names.claims_dir()} (not running, or "
                                  f"not started by this user in namespace {self.names.namespace!r})")
            if pid is not None and claim.pid != pid:
                raise RecordError(f"notice from pid {pid} for app {name!r}, whose claim belongs to pid {claim.pid}")
            entry = self.table.admit(name, now, expected_pid=claim.pid, token=claim.token,
                                     expected_ticks=claim.start_ticks)
        except objects.ForeignObject as error:
            self._report_foreign(error.name, error.owner)
            return None
        except (RecordError, OSError, discovery.DiscoveryError, posix_ipc.Error) as error:
            self.log("invalid", what="record", app=name, error=str(error))  # every time: the log is the record
            if self._first_report(("admit", name, str(error))):  # stderr: once per app and reason
                logger.warning("drbalance-manager: cannot admit %r: %s", name, error)
            return None
        self._log_added(entry, via)
        return entry

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

    # --- periodic tasks ----------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        beat = ManagerBeat(os.getpid(), self.gpu_count, self.config.dr_total, self._started_wall, now)
        if self._endpoint.beat(beat):
            self.log("repaired", what="heartbeat", error="the heartbeat segment was truncated")
            logger.warning("drbalance-manager: the heartbeat segment was truncated; restored it")

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

    def _collect_garbage(self, now: float) -> None:
        """Remove the apps whose process is gone (pid, and start time); mark quiet ones."""
        self._refresh_all(now)
        for entry in list(self.table.entries.values()):
            status = entry.status
            if not entry.alive():
                pid = entry.owner_pid
                reason = "process gone" if not objects.pid_alive(pid) else f"pid {pid} now belongs to another process"
                self.table.remove(entry.name, unlink=True)  # the objects of this token are the dead app's
                if discovery.collect_claim(self.names, entry.name, entry.token) is None:
                    self._claims_left.add((entry.name, entry.token))  # a later rescan collects it, quietly
                self.log("app_removed", app=entry.name, pid=pid, reason=reason)
                logger.info("drbalance-manager: removed %r (%s)", entry.name, reason)
            elif status.state == AppState.FINISHED:
                self.table.remove(entry.name, unlink=False)  # its FINISH notice was lost; it cleans up itself
                self.log("app_removed", app=entry.name, pid=status.pid, reason="finished")
            else:
                self._mark_quiet(entry, now)

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

    def _rescan(self, now: float, listing: ShmListing | None = None) -> None:
        """Adopt live apps found through their claims; remove dead ones' objects; report objects of
        other users under this namespace's prefix: from ``listing`` if given, else from a listing
        of /dev/shm begun in a thread here (the loop takes it when it ends: ``_take_listing``)."""
        referenced = {(entry.name, entry.token) for entry in self.table.entries.values()}
        claims: dict[str, str | None] = {}  # app -> the token its claim names (None: unknown this time)
        for app in discovery.claimed_apps(self.names):
            entry = self.table.get(app)
            if entry is not None:
                claims[app] = entry.token
                continue
            claims[app] = None
            try:
                token = self._consider_claim(app, now)
            except OSError as error:  # one bad entry (a folder or a link as a claim) stops no other app's
                self._report_once(("claim", app, str(error)), "invalid", what="claim", app=app,
                                  error=f"{error}; left as it is")
                continue
            if token is not None:
                referenced.add((app, token))
                claims[app] = token
        self._listing_claims = referenced
        if listing is None:
            self._lister.start()
        else:
            self._scan_listing(now, listing)
        self._forget_gone(claims)

    def _take_listing(self, now: float) -> None:
        listing = self._lister.take()
        if listing is not None:
            self._scan_listing(now, listing)

    def _forget_gone(self, claims: dict[str, str | None]) -> None:
        """Drop what is kept about apps that are gone: a claim left locked whose file is gone or
        now names another token (a new job took the name), and problems not seen for
        ``REPORT_FORGET_SECONDS``."""
        self._claims_left = {(app, token) for app, token in self._claims_left
                             if app in claims and claims[app] in (token, None)}
        now = self.clock.monotonic()
        horizon = now - REPORT_FORGET_SECONDS
        for key in [key for key, seen in self._reported.items() if seen < horizon]:
            del self._reported[key]
        if self._unreported and now - self._unreported_said >= UNREPORTED_SAID_SECONDS:
            logger.warning("drbalance-manager: %d more problem(s) (other apps or reasons) were not named on stderr; "
                           "the manager log records them", self._unreported)
            self._unreported, self._unreported_said = 0, now

    def _consider_claim(self, app: str, now: float) -> str | None:
        """Adopt ``app`` if its claim's process runs, collect it if dead; the token it names."""
        try:
            claim = discovery.read_claim(self.names, app)
            problem = None
        except (OSError, discovery.DiscoveryError) as error:
            claim, problem = None, str(error)
        if claim is None:  # still empty (being created), or unreadable: only a dead holder's goes
            if discovery.claim_age(self.names, app) > GRACE_SECONDS:
                if discovery.collect_claim(self.names, app) is not None:
                    self.log("app_removed", app=app, reason="an unfinished claim of a dead process")
                elif problem:
                    self._report_once(("claim", app, problem), "invalid", what="claim", app=app, error=problem)
            return None
        if not claim.alive():
            removed = (app, claim.token) in self._claims_left  # its removal is logged already
            if discovery.collect_claim(self.names, app, claim.token) is not None:
                self._claims_left.discard((app, claim.token))
                if not removed:
                    self.log("app_removed", app=app, pid=claim.pid, reason="leftovers of a dead process")
            elif discovery.remove_app_objects(self.names, app, claim.token, claim.signal):
                self.log("app_removed", app=app, pid=claim.pid,
                         reason="process gone; its claim is still held (by a process it forked?)")
            return claim.token
        self._adopt(app, claim.token, now, claim)
        return claim.token

    def _adopt(self, app: str, token: str, now: float, claim: discovery.ClaimInfo | None) -> None:
        try:
            entry = self.table.admit(app, now, expected_pid=claim.pid if claim else None, token=token,
                                     expected_ticks=claim.start_ticks if claim else 0)
        except (RecordEmpty, RecordBusy) as error:
            # not written yet: it will be (or, if its writer died, its claim shows it dead); a live
            # app whose record stays unwritten past the grace period is worth a line
            if claim is None or time.time() - claim.claimed > GRACE_SECONDS:
                self._report_once(("record", app, token, type(error).__name__), "invalid", what="record", app=app,
                                  error=f"{error} (its process runs: kept, not adopted)")
            return
        except posix_ipc.ExistentialError:
            return  # its objects are being created
        except objects.ForeignObject as error:
            self._report_foreign(error.name, error.owner)
            return
        except (RecordError, OSError, posix_ipc.Error) as error:
            # unreadable (e.g. a newer layout) but its process runs: kept, reported once, never removed
            self._report_once(("record", app, token, str(error)), "invalid", what="record", app=app,
                              error=f"{error} (its process runs: kept, not adopted)")
            return
        if entry.status.state == AppState.FINISHED:  # said goodbye, removing its own objects now
            self.table.remove(app, unlink=False)
            return
        self._take_last_command(entry)
        self._log_added(entry, "adopted")

    def _take_last_command(self, entry: AppEntry) -> None:
        """An adopted app's DR is the one its record's command area holds when that command (an
        earlier manager's answer or push) came after the status: a job publishes the DR it applied
        only at its next report, and one it refused at once (a newer status)."""
        try:
            command = entry.channel.record.read_command()
        except (RecordError, OSError):
            return
        status = entry.status
        if (command is None or command.generation != status.notice_seq or command.written_wall < status.updated_wall
                or len(command.ratio) != len(status.ratio) or command.ratio == status.ratio):
            return
        entry.assigned, entry.assigned_mono = command.ratio, self.clock.monotonic()

    def _scan_listing(self, now: float, listing: ShmListing) -> None:
        """Report foreign objects; deal with this user's app records that no claim names, and with
        signal semaphores of apps that have neither a claim nor a record (their token is not the
        record's, so only the claim names them: left by a dead app whose claim went)."""
        referenced = self._listing_claims | {(entry.name, entry.token) for entry in self.table.entries.values()}
        seen = set()
        signals = []
        for listed in listing.own:
            seen.add(listed.entry)
            if listed.kind == "app" and (listed.app, listed.token) not in referenced:
                self._unclaimed(listed.app, listed.token, listed.entry, now)
            elif listed.kind == "sig":
                signals.append(listed)
        if signals:
            self._stray_signals(signals, {o.app for o in listing.own if o.kind == "app"})
        self._note_foreign(listing)
        for gone in set(self._stuck_unclaimed) - seen:
            del self._stuck_unclaimed[gone]

    def _note_foreign(self, listing: ShmListing) -> None:
        """Other users' entries: the first ``MAX_FOREIGN_NAMED`` by name are remembered and each
        named once in the log (``MAX_FOREIGN_LISTED`` new ones per listing, the rest at the next),
        and every owner's count is logged when it changes (``foreign_count``)."""
        present = dict(listing.foreign_first)
        for entry in [entry for entry in self.foreign if entry not in present]:
            # past the first by name, or named through an object a claim or notice led to: kept while
            # it exists, as long as the manager remembers no more than MAX_FOREIGN_NAMED
            gone = objects.listed_owner(entry) is None and objects.listed_owner(entry, "semaphore") is None
            if len(self.foreign) > MAX_FOREIGN_NAMED or gone:
                del self.foreign[entry]
        named = 0
        for entry, owner in listing.foreign_first:
            if named >= MAX_FOREIGN_LISTED:
                break
            if self.foreign.get(entry) != owner:
                self._report_foreign(entry, owner)
                named += 1
        counts = dict(listing.foreign_counts)
        for owner in sorted(set(counts) | set(self.foreign_counts)):
            if counts.get(owner, 0) != self.foreign_counts.get(owner, 0):
                self.log("foreign_count", owner_uid=owner, owner=user_name(owner), count=counts.get(owner, 0),
                         listing_seconds=listing.seconds)
        self.foreign_counts = counts

    def _stray_signals(self, signals: list[ListedObject], with_record: set[str | None]) -> None:
        """Remove this user's signal semaphores of apps with no claim, no record (``with_record``:
        the apps that have one) and no entry here, older than ``GRACE_SECONDS`` (a starting app
        writes its claim before its objects)."""
        claimed = set(discovery.claimed_apps(self.names))
        for listed in signals:
            if listed.app in with_record or listed.app in claimed or listed.app in self.table:
                continue
            try:
                age = time.time() - (objects.SHM_DIR / listed.entry).stat(follow_symlinks=False).st_ctime
            except OSError:
                continue
            if age >= GRACE_SECONDS and objects.unlink_semaphore(self.names.app_signal(listed.app, listed.token)):
                self.log("app_removed", app=listed.app, reason="a signal semaphore of a dead process (no claim)")

    def _unclaimed(self, app: str, token: str, entry: str, now: float) -> None:
        """A record no claim names (its claim was removed, e.g. with the runtime directory)."""
        try:
            age = time.time() - (objects.SHM_DIR / entry).stat().st_ctime
        except OSError:
            return
        if age < GRACE_SECONDS or app in self.table:
            return
        try:
            record = AppRecord.open(self.names, app, token)
        except (OSError, RecordError, posix_ipc.Error):
            return
        area = record.status_area
        area.stuck_counter = self._stuck_unclaimed.get(entry, -1)  # waited for in vain at an earlier rescan
        try:
            # no sleeping reads: a live writer finishes in microseconds, and records left mid-write by
            # dead writers (hundreds, maybe) must not hold up the loop at every rescan
            status = record.read_status(attempts=UNCLAIMED_READ_ATTEMPTS)
        except RecordError as error:
            if area.stuck_counter >= 0:
                self._stuck_unclaimed[entry] = area.stuck_counter
            self._report_once(("unclaimed", app, token), "invalid", what="record", app=app,
                              error=f"{error}; no claim names it and its owner is unknown: kept")
            return
        finally:
            record.close()
        self._stuck_unclaimed.pop(entry, None)
        if objects.process_alive(status.pid, status.start_ticks):
            self._adopt(app, token, now, None)
        elif discovery.remove_app_objects(self.names, app, token):
            self.log("app_removed", app=app, pid=status.pid, reason="leftovers of a dead process (no claim)")

    def _report_foreign(self, entry: str, owner: int | None) -> None:
        """Name another user's object in the log (and, for the first ``MAX_FOREIGN_LISTED``, on stderr)."""
        entry = entry.lstrip("/")
        if self.foreign.get(entry) == owner:
            return
        self.foreign[entry] = owner if owner is not None else -1
        who = user_name(owner) if owner is not None else "an unknown user"
        self.log("foreign", object=entry, owner_uid=owner, owner=who)
        self._foreign_warned += 1
        if self._foreign_warned <= MAX_FOREIGN_LISTED:
            logger.warning("drbalance-manager: /dev/shm/%s is under this namespace's prefix but belongs to %s: "
                           "ignored, never trusted", printable(entry), printable(who))
        if self._foreign_warned == MAX_FOREIGN_LISTED:
            logger.warning("drbalance-manager: more objects of other users may follow; only the manager log "
                           "(event 'foreign') names them")

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

    def _check_runtime_files(self, now: float) -> None:
        """Put the lock file and ``manager.json`` back if the runtime directory lost them, and
        reopen the manager log if it was removed or replaced (its lines went to a deleted file)."""
        if self._log is not None and self._log.reopen_if_replaced():
            self.log("repaired", what="manager log", error=f"{self._log_path} was removed or replaced; reopened")
            logger.warning("drbalance-manager: its log %s was removed or replaced; writing to a new one",
                           self._log_path)
        lock_ok = self._lock.held()
        published = self._endpoint.published()
        if lock_ok and published:
            return
        self.names.private_runtime_dir()
        if not lock_ok:
            try:
                lock = ManagerLock(self.names.manager_lock())
            except ManagerAlreadyRunning as error:
                self.log("fault", task="lock", error=str(error))
                logger.error("drbalance-manager: the runtime directory was removed and another manager took "
                             "namespace %r meanwhile: %s; stopping", self.names.namespace, error)
                self.request_stop("another manager took over the namespace")
                return
            self._lock.release()
            self._lock = lock
        self._endpoint.republish()
        self.log("repaired", what="runtime files", error=f"lock {'ok' if lock_ok else 'lost'}, "
                 f"manager.json {'ok' if published else 'lost'}; restored in {self.names.runtime_dir()}")
        logger.warning("drbalance-manager: restored the lock and manager.json in %s", self.names.runtime_dir())

    def _check_endpoint(self, now: float) -> None:
        """IPC objects removed while open (systemd-logind's ``RemoveIPC=yes`` when the user's last
        session ends, a cleanup of /dev/shm): a new inbox and heartbeat for this manager, and the
        apps' records reopened once the apps made them again."""
        for entry in list(self.table.entries.values()):
            if entry.channel.unlinked():
                self._reopen_channel(entry)
        if self._endpoint.unlinked():
            self._replace_endpoint(now)

    def _reopen_channel(self, entry: AppEntry) -> None:
        """Open the app's record and semaphore again (the app creates them again when it next
        publishes); until it has, the old ones stay and this is tried again next period. Under the
        token its claim names now: the same one, unless another user had taken one of the names
        (they were visible in /dev/shm), and the app made its objects under a new token."""
        token = entry.token
        try:
            claim = discovery.read_claim(self.names, entry.name)
        except (OSError, discovery.DiscoveryError):
            claim = None
        if claim is not None and claim.pid == entry.owner_pid:
            token = claim.token
        try:
            channel = AppChannel(self.names, entry.name, token)
        except (posix_ipc.Error, RecordError, OSError):
            return
        old, entry.channel, entry.token = entry.channel, channel, token
        old.close()
        self.log("repaired", what=f"record of {entry.name}", error="removed from /dev/shm; the app made it again")
        logger.warning("drbalance-manager: the record of %r was removed from /dev/shm; reopened the one the app "
                       "made again", entry.name)

    def _replace_endpoint(self, now: float) -> None:
        """A new inbox and heartbeat (under a new token, published in ``manager.json``) when the
        ones in use were unlinked: apps could neither find nor reach this manager any more. Notices
        left in the old inbox are lost; their apps' next exchanges reach the new one."""
        gone = self._endpoint.unlinked()
        old = self._endpoint
        try:
            self._endpoint = ManagerEndpoint(self.names, self.settings.inbox_messages, replacing=True)
        except BaseException:  # e.g. /dev/shm full: a fault, retried next period; jobs keep what is left
            old.republish()  # the failed one withdrew manager.json; it names the objects in use again
            raise
        old.close()  # its names are gone (or its last one goes now); manager.json names the new token
        what = " and ".join(gone)
        self.log("repaired", what=what, error=f"the {what} was removed from {objects.SHM_DIR} (e.g. by RemoveIPC); "
                 f"new ones under token {self._endpoint.token}")
        logger.warning("drbalance-manager: its %s was removed (e.g. by systemd-logind's RemoveIPC); created new "
                       "ones, and jobs find them through manager.json", what)
        self._run_task("beat", self._heartbeat, now)

    def _write_status(self, now: float) -> None:
        status = {
            "pid": os.getpid(), "namespace": self.names.namespace, "policy": self.policy.name,
            "started": self._started_wall, "updated": self.clock.wall(), "gpus": self.gpu_count,
            "util": list(self.window.values()), "decisions": self.decisions,
            "runtime_dir": str(self.names.runtime_dir()), "quiet_after": self.settings.quiet_after,
            "log": str(self._log_path),
            "apps": [
                {"name": e.name, "pid": e.status.pid, "epoch": e.status.epoch, "epochs": e.status.epochs,
                 "iteration": e.status.iteration, "iterations_total": e.status.iterations_total,
                 "sd": e.status.slowdown, "dr": dr, "state": e.status.state.name,
                 "sd_estimated": e.status.solo_estimated, "solo_basis": e.status.solo_basis,
                 "updated_ago": now - e.status.updated_mono,
                 "quiet_for": None if e.quiet_since is None else now - e.quiet_since,
                 "steered": steered}
                for e in self.table.entries.values() for dr, steered in (self._server_dr(e),)
            ],
            "memory": [None if m is None else {"used": m.used, "total": m.total}
                       for m in (self.server.memory or (None,) * self.gpu_count)],
            "foreign": [{"object": entry, "owner_uid": uid, "owner": user_name(uid)}
                        for entry, uid in sorted(self.foreign.items())[:MAX_FOREIGN_LISTED]],
            "foreign_total": max(len(self.foreign), sum(self.foreign_counts.values())),
            "faults": dict(self.faults),
            "fault_counts": {task: self.fault_counts.get(task, 1) for task in self.faults},
            "metrics": self.metrics.url() if self.metrics is not None else None,
        }
        write_private(self.names.manager_status(), json.dumps(status).encode(), private=True)

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
            apps.append(AppMetrics(entry.name, status.slowdown, status.iteration_time, shares, status.solo_estimated,
                                   status.solo_basis == "manager"))
        memory = self.server.memory or (None,) * self.gpu_count
        self.metrics.update(MetricsSnapshot(tuple(apps), tuple(self.window.values()), tuple(memory)))

    # --- the log -------------------------------------------------------------------------------
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
