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
import os
import time
from dataclasses import asdict
from pathlib import Path

import posix_ipc

from drbalance.clock import Clock
from drbalance.ipc import discovery, objects
from drbalance.ipc.endpoint import AppChannel, ManagerEndpoint, other_live_manager
from drbalance.ipc.layout import AppState, ManagerBeat, Notice, NoticeKind, RecordError
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
from drbalance.ipc.system_link import running_system_manager
from drbalance.manager.balancer import (  # noqa: F401 (ManagerSettings, SampleFailed: this module's API too)
    REPORT_FORGET_SECONDS,
    UNREPORTED_SAID_SECONDS,
    Balancer,
    ManagerAlreadyRunning,
    ManagerSettings,
    ManagerStartError,
    SampleFailed,
)
from drbalance.manager.listing import ShmLister, ShmListing
from drbalance.manager.metrics import ManagerMetrics
from drbalance.manager.status import printable
from drbalance.manager.table import AppEntry, AppTable
from drbalance.manager.utilization import UtilizationSource
from drbalance.policy import Policy

logger = logging.getLogger("drbalance.manager")

UNCLAIMED_READ_ATTEMPTS = 20  # reads of a record no claim names: spins only, never sleeps (SeqlockArea.read)
GRACE_SECONDS = 5.0  # an unfinished claim or an unclaimed record younger than this is being created
MAX_FOREIGN_LISTED = 20
"""Other users' objects named in the status file and on stderr, and newly named in the manager log
per listing of /dev/shm; the rest are only counted (``foreign_total``, and ``foreign_count`` events
per owner in the log): a neighbour can plant hundreds of thousands, and a status file over
``MAX_PRIVATE_FILE`` could not be read back."""
MAX_FOREIGN_NAMED = 1000
"""Other users' objects the manager remembers by name (the first by name), so each is named in
the log once while it stays; a flood beyond them is counted, not kept."""






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


class Manager(Balancer):
    """A user's own manager (the daemon of one user and namespace). ``start()``, then ``run()``
    (or ``turn()`` repeatedly), then ``stop()``."""

    def __init__(
        self,
        settings: ManagerSettings,
        source: UtilizationSource,
        clock: Clock | None = None,
        policy: Policy | None = None,
        metrics: ManagerMetrics | None = None,
    ) -> None:
        names = IpcNames.current(settings.namespace)
        super().__init__(settings, source, AppTable(names), names.namespace, clock, policy, metrics)
        self.names = names
        self.foreign: dict[str, int] = {}  # /dev/shm entries under our prefix owned by others, named: entry -> uid
        self.foreign_counts: dict[int, int] = {}  # per owner uid: their entries under our prefix, all counted
        self._lister = ShmLister(self.names, MAX_FOREIGN_NAMED)
        self._listing_claims: set[tuple[str, str]] = set()  # (app, token) of the claims at the last rescan
        self._foreign_warned = 0  # foreign objects named on stderr (MAX_FOREIGN_LISTED at most)
        self._stuck_unclaimed: dict[str, int] = {}  # unclaimed records left mid-write: entry -> its odd counter
        self._claims_left: set[tuple[str, str]] = set()  # (app, token) removed while its claim was still locked
        self._lock: ManagerLock | None = None
        self._endpoint: ManagerEndpoint | None = None

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
        self._open_log(self.settings.log_path or (self.names.runtime_dir() / "manager.jsonl"))
        try:
            self._lock = ManagerLock(self.names.manager_lock())
            system_manager = running_system_manager(self.names.namespace)
            if system_manager is not None:
                raise ManagerAlreadyRunning(
                    f"the machine's system manager ({system_manager.describe()}) balances every user's jobs in "
                    f"namespace {self.names.namespace!r}; jobs attach to it, so this user's manager would have "
                    f"none. Use it (drbalance status shows it), or another namespace")
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
        tasks = ("beat", "sample", "util_log", "gc", "runtime", "endpoint", "rescan", "system", "status", "metrics",
                 "slurm")
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
        self._close_log_unwritten()



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
        self.finish(reason)
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
            ("system", settings.rescan_period, self._check_system_manager),
            ("status", settings.status_period, self._write_status),
            ("metrics", settings.status_period, self._update_metrics),
            ("slurm", 1.0, self._slurm_weight),
        )
        for key, period, task in tasks:
            if now >= self._next[key]:
                self._next[key] = now + period
                self._run_task(key, task, now)
        if self._lister.ready():  # the listing of /dev/shm the last rescan began in a thread
            self._run_task("listing", self._take_listing, now)

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



    # --- periodic tasks ----------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        beat = ManagerBeat(os.getpid(), self.gpu_count, self.config.dr_total, self._started_wall, now)
        if self._endpoint.beat(beat):
            self.log("repaired", what="heartbeat", error="the heartbeat segment was truncated")
            logger.warning("drbalance-manager: the heartbeat segment was truncated; restored it")





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


    def _check_system_manager(self, now: float) -> None:
        """Stop when a system manager started in this namespace: jobs attach to it, and a job must
        not be balanced by two managers."""
        system_manager = running_system_manager(self.names.namespace)
        if system_manager is not None:
            self.log("fault", task="system", error=f"a system manager ({system_manager.describe()}) runs in "
                     f"namespace {self.names.namespace!r}")
            logger.warning("drbalance-manager: the machine's system manager (%s) now balances every user's jobs "
                           "in namespace %r; stopping (the jobs attach to it)", system_manager.describe(),
                           self.names.namespace)
            self.request_stop("a system manager took over the namespace")

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
        self._forget_reports(self.clock.monotonic())

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
            **self.status_document(now),
            "runtime_dir": str(self.names.runtime_dir()), "log": str(self._log_path),
            "foreign": [{"object": entry, "owner_uid": uid, "owner": user_name(uid)}
                        for entry, uid in sorted(self.foreign.items())[:MAX_FOREIGN_LISTED]],
            "foreign_total": max(len(self.foreign), sum(self.foreign_counts.values())),
        }
        write_private(self.names.manager_status(), json.dumps(status).encode(), private=True)



    # --- the log -------------------------------------------------------------------------------




