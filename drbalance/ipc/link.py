"""The training side of the manager protocol, over POSIX IPC.

An app owns two objects: its record (shared memory; status written by the app, command by the
manager) and its signal (a semaphore the manager posts after writing a command). It talks to
the manager through the manager's single inbox (a message queue) and watches the manager's
heartbeat segment to know whether a manager is there at all. Every wait is bounded. The app's
name is held by a claim in the private runtime directory, where the manager's ``manager.json``
also names its objects (see ``discovery``).

``ManagerLink`` is the interface the client session uses; ``PosixManagerLink`` is the real one
and ``DetachedLink`` the one used when no manager may be contacted (profile runs, opt-out).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import posix_ipc

from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.discovery import AppClaim, AppNameInUse, DiscoveryError, ManagerInfo, read_manager
from drbalance.ipc.layout import AppCommand, AppStatus, ManagerBeat, Notice, RecordError
from drbalance.ipc.names import IpcNames, new_token
from drbalance.ipc.private import entry_stat
from drbalance.ipc.records import AppRecord, ManagerRecord, SegmentTruncated
from drbalance.ratio import DataRatio

logger = logging.getLogger("drbalance.client")

INBOX_MAX_MESSAGES = 10  # Linux's default limit for an unprivileged user
INBOX_MESSAGE_SIZE = 128  # a Notice is 76 bytes
DEFAULT_SEND_TIMEOUT = 0.25  # seconds a notice may wait for room in a full inbox
DEFAULT_EXCHANGE_TIMEOUT = 0.5  # seconds an app waits for the manager's answer


class ManagerLink(Protocol):
    """How a session reaches the manager. Nothing here may block longer than its timeout."""

    def publish(self, status: AppStatus) -> None:
        """Write the app's status into its record (cheap: every few iterations)."""

    def manager(self) -> ManagerBeat | None:
        """The live manager's heartbeat, or None when no live manager is there. Call before ``notify``."""

    def notify(self, notice: Notice, timeout: float) -> bool:
        """Send a notice to the manager last seen by ``manager()``; False if not delivered in ``timeout``."""

    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
        """Wait up to ``timeout`` seconds for the manager's answer to notice ``generation``."""

    def poll_command(self, generation: int) -> AppCommand | None:
        """The answer to notice ``generation`` if it has arrived (never waits)."""

    def command_signalled(self) -> bool:
        """Whether the manager has signalled a new command since the last look (never waits; cheap
        enough for every iteration). A True is followed by ``poll_command``."""

    def close(self) -> None:
        """Remove everything this app created."""


def command_for(record: AppRecord | None, generation: int, dr_total: int | None, published: DataRatio | None,
                app: str, report: Callable[..., None]) -> AppCommand | None:
    """The command in ``record`` if it answers notice ``generation`` and may be applied: a new DR
    must be at the manager's DR total (``dr_total``, from its heartbeat or welcome), a kept one is
    the DR last published (``published``). Anything else is ignored (said once through ``report``)."""
    if record is None:
        return None
    try:
        command = record.read_command()
    except RecordError:
        return None  # a half-written, corrupt or truncated command is never applied
    if command is None or command.generation != generation:
        return None  # none yet, or a stale answer to an older notice
    if command.ratio.total != dr_total and command.ratio != published:
        # a manager sends a new DR at its own total (a kept one as the job has it): not the manager's
        report(f"total:{command.ratio.total}:{dr_total}", "drbalance: %r ignored a command for DR %s: its manager "
               "decides at DR total %s", app, command.ratio, dr_total if dr_total is not None else "(none found yet)")
        return None
    return command


class DetachedLink:
    """No manager: status goes nowhere, notices are never delivered."""

    def publish(self, status: AppStatus) -> None:
        pass

    def manager(self) -> ManagerBeat | None:
        return None

    def notify(self, notice: Notice, timeout: float) -> bool:
        return False

    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
        return None

    def poll_command(self, generation: int) -> AppCommand | None:
        return None

    def command_signalled(self) -> bool:
        return False

    def close(self) -> None:
        pass


class PosixManagerLink:
    """The real link: the app's claim, record and signal, the manager's inbox and heartbeat.

    Creating it takes the app's name (``discovery.AppClaim``: ``AppNameInUse`` if a live
    process holds it; a dead holder's leftovers are removed) and creates the record and the
    semaphore under a fresh token; what cannot be made yet (a full /dev/shm) is made at a later
    look for the manager, and the job trains meanwhile as without a manager. The manager is
    found through ``manager.json`` in the private runtime directory; its heartbeat and inbox are
    opened only if they are this user's. A foreign or unreadable object is reported once (by
    name and owner) and treated as "no manager": the app trains on with its own DR.
    """

    def __init__(self, names: IpcNames, app: str, clock: Clock | None = None, stale_after: float = 5.0) -> None:
        self.names = names
        self.app = app
        self.clock = clock or SystemClock()
        self.stale_after = stale_after
        self.claim: AppClaim | None = None
        self.token = ""  # the record's
        self.signal_token = ""  # the semaphore's: not to be guessed from the record's name
        self.record: AppRecord | None = None
        self.signal: posix_ipc.Semaphore | None = None
        self._view: _ManagerObjects | None = None
        self._info: ManagerInfo | None = None
        self._info_stamp: tuple[int, int, int] | None = None
        self._reported: set[str] = set()
        self.problem = "none is running"  # why manager() last found no manager
        self._closed = False
        self._set_up_failed = False
        self._dr_total: int | None = None  # the DR total of the manager last found (commands: see _command_for)
        self._published: DataRatio | None = None  # the DR of the status last published
        try:
            self._set_up(first=True)
        except BaseException:
            self.close()
            raise

    def _set_up(self, first: bool = False) -> bool:
        """Take the app's name and make its record and semaphore, whichever is not done yet;
        whether all are there. A fault (a full /dev/shm, a runtime directory that cannot be used
        now) is said once and tried again at the next call: ``manager()``, which a session calls
        at its later reports, as when no manager runs. The name is claimed as soon as it can be,
        also while the objects cannot be made. ``AppNameInUse`` at the first call (later: another
        process took the name meanwhile, said once)."""
        try:
            if self.claim is None:
                self.claim = AppClaim.take(self.names, self.app)
                self.token, self.signal_token = self.claim.token, self.claim.signal_token
            if self.record is None:
                self.record, self.signal = self._make_objects()
        except (OSError, posix_ipc.Error, AppNameInUse) as error:
            if first and isinstance(error, AppNameInUse):
                raise
            self._set_up_failed = True
            self.problem = f"its record and semaphore cannot be made yet ({error})"
            # said once, whatever the error of a later try (ENOSPC, then posix_ipc's own)
            self._report("setup:name" if isinstance(error, AppNameInUse) else "setup", "drbalance: POSIX IPC "
                         "unavailable for %r (%s); it trains with its own DR and tries again at its later reports",
                         self.app, error)
            return False
        if self._set_up_failed:
            self._set_up_failed = False
            self._reported = {key for key in self._reported if not key.startswith("setup")}
            logger.info("drbalance: %r made its record %s; a manager can reach it now", self.app, self.record.name)
        return True

    @property
    def objects_pending(self) -> bool:
        """Whether the record and semaphore are still to be made: the fault that keeps them from
        being made was said (once), and they are tried again at each later look for a manager."""
        return self._set_up_failed

    # --- status -------------------------------------------------------------------------------
    def publish(self, status: AppStatus) -> None:
        self._published = status.ratio
        if self.record is None:  # not made yet (see _set_up): this status goes nowhere
            return
        record_gone = objects.unlinked_fd(self.record.segment.memory.fd)
        signal_gone = not objects.semaphore_listed(self.names.app_signal(self.app, self.signal_token))
        if record_gone or signal_gone:
            self._restore_objects(" and ".join(what for what, gone in (("record", record_gone),
                                                                       ("semaphore", signal_gone)) if gone))
        try:
            if self.record.segment.repair():  # truncated, or its header overwritten: a manager refuses it
                self._report(f"record:{self.record.name}", "drbalance: the record %s was damaged (truncated or "
                             "its header overwritten); restored it", self.record.name)
        except OSError as failure:  # e.g. /dev/shm full: this status goes nowhere, the next tries again
            self._report(f"repair:{self.record.name}", "drbalance: the record %s is damaged and cannot be "
                         "restored (%s); the status is not published until it can be", self.record.name, failure)
            return
        try:
            self.record.write_status(status)
        except SegmentTruncated as error:
            try:
                self.record.segment.repair()
            except OSError as failure:  # e.g. /dev/shm full: this status goes nowhere, the next tries again
                self._report(f"repair:{self.record.name}", "drbalance: %s and cannot be restored (%s); the "
                             "status is not published until it can be", error, failure)
                return
            self._report(f"record:{self.record.name}", "drbalance: %s; restored it", error)
            self.record.write_status(status)

    def _restore_objects(self, removed: str) -> None:
        """Create the record and the semaphore again when either (``removed`` says which) was
        removed while open: by systemd-logind's ``RemoveIPC=yes`` when the user's last session
        ends, a cleanup of /dev/shm, or any process of this user or root. Both, so that a manager
        sees the record go and reopens the pair (a semaphore alone it could not tell from the one
        it holds). Under the same names while nobody else holds them; their names were visible in
        /dev/shm, so where another user created one first, under a new token, named in the claim
        first (``AppClaim.move_to``): a manager follows the claim, and the other user's objects are
        left alone. Until then this app's status reaches nobody."""
        me = os.geteuid()
        record_name = self.names.app_record(self.app, self.token)
        signal_name = self.names.app_signal(self.app, self.signal_token)
        if objects.listed_owner(record_name) == me:
            objects.unlink_shared_memory(record_name)  # ours, still there: only the semaphore was removed
        if objects.listed_owner(signal_name, "semaphore") == me:
            objects.unlink_semaphore(signal_name)  # another user's name is left to them (root could remove it)
        try:
            record, signal = self._make_objects()
        except (posix_ipc.Error, OSError) as error:  # e.g. /dev/shm full; tried again at the next publish
            self._report(f"restore:{self.app}", "drbalance: the record %s of %r was removed and cannot be created "
                         "again (%s); no manager sees this job until it can", self.record.name, self.app, error)
            return
        for old in (self.record, self.signal):
            try:
                old.close()
            except posix_ipc.Error:
                pass
        self.record, self.signal = record, signal
        logger.warning("drbalance: the %s of %r %s removed from /dev/shm while the job ran, by a process of this "
                       "user or root (which one cannot be told: a cleanup of /dev/shm, systemd-logind's RemoveIPC=yes "
                       "when the user's last session ended, ...); made its record and semaphore again as %s",
                       removed, self.app, "were" if " and " in removed else "was", record.name)
        self._reported.discard(f"restore:{self.app}")

    def _make_objects(self) -> tuple[AppRecord, posix_ipc.Semaphore]:
        """A new record and semaphore under the claim's tokens, or, where another user holds one
        of their names (they were visible in /dev/shm), under new tokens named in the claim first
        (``AppClaim.move_to``: each object can be traced to its owner)."""
        if self._names_taken(self.token, self.signal_token):
            self._move_to_new_tokens()
        try:
            return self._create_objects(self.token, self.signal_token)
        except posix_ipc.ExistentialError:  # another user took a name meanwhile
            self._move_to_new_tokens()
            return self._create_objects(self.token, self.signal_token)

    def _move_to_new_tokens(self) -> None:
        token, signal_token = new_token(), new_token()
        self.claim.move_to(token, signal_token)
        self.token, self.signal_token = token, signal_token

    def _names_taken(self, token: str, signal_token: str) -> bool:
        """Whether another user holds the record's name under ``token`` or the semaphore's under
        ``signal_token``."""
        me = os.geteuid()
        owners = (objects.listed_owner(self.names.app_record(self.app, token)),
                  objects.listed_owner(self.names.app_signal(self.app, signal_token), "semaphore"))
        return any(owner not in (None, me) for owner in owners)

    def _create_objects(self, token: str, signal_token: str) -> tuple[AppRecord, posix_ipc.Semaphore]:
        """A new record under ``token`` and semaphore under ``signal_token`` (both, or neither is left)."""
        record = AppRecord.create(self.names, self.app, token)
        try:
            return record, objects.create_semaphore(self.names.app_signal(self.app, signal_token))
        except BaseException:
            record.close()
            objects.unlink_shared_memory(self.names.app_record(self.app, token))
            raise

    # --- the manager --------------------------------------------------------------------------
    def manager(self) -> ManagerBeat | None:
        if not self._set_up():
            return self._absent(self.problem)
        if not self.claim.renew():
            self._report("claim", "drbalance: the name claim %s of app %r was removed and cannot be put back "
                         "(its folder is not usable, or another process took the name); a manager may not find "
                         "this job", self.claim.path, self.app)
        info = self._discover()
        if info is None:
            return self._absent("none is running")
        if not info.alive():
            return self._absent(f"the manager named in {self.names.manager_info()} (pid {info.pid}) is gone")
        view = self._objects(info)
        if view is None:
            return None
        try:
            beat = view.heartbeat.read()
        except RecordError as error:
            return self._absent(f"its heartbeat is unreadable: {error}")
        if beat.pid != info.pid:
            return self._absent(f"its heartbeat names pid {beat.pid}, not {info.pid}")
        if self.clock.monotonic() - beat.beat_mono >= self.stale_after:
            return self._absent(f"its heartbeat is older than {self.stale_after:g} s")
        self.problem = ""
        self._dr_total = beat.dr_total
        return beat

    def _discover(self) -> ManagerInfo | None:
        """``manager.json``, re-read only when the file changed."""
        path = self.names.manager_info()
        info = entry_stat(path, private=True)
        if info is None:
            self._info, self._info_stamp = None, None
            return None
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        if stamp == self._info_stamp:
            return self._info
        try:
            self._info = read_manager(self.names)
        except (OSError, DiscoveryError) as error:
            self._report(f"info:{stamp}", "drbalance: not trusting %s: %s", path, error)
            self._info = None
        self._info_stamp = stamp
        return self._info

    def _objects(self, info: ManagerInfo) -> _ManagerObjects | None:
        """The heartbeat and inbox of the manager with ``info.token`` (kept open while it lives)."""
        if self._view is not None and self._view.token == info.token:
            return self._view
        self._close_view()
        try:
            self._view = _ManagerObjects.open(self.names, info.token, info.inbox)
        except objects.ForeignObject as error:
            self._report(f"foreign:{error.name}", "drbalance: %s", error)
            return self._absent(f"its objects are not this user's: {error}")
        except (posix_ipc.ExistentialError, RecordError) as error:
            return self._absent(f"its objects are missing or unreadable: {error}")
        return self._view

    def _absent(self, reason: str) -> None:
        self._close_view()
        self.problem = reason
        return None

    def _report(self, key: str, message: str, *args: object) -> None:
        if key not in self._reported:
            self._reported.add(key)
            logger.warning(message, *args)

    def notify(self, notice: Notice, timeout: float) -> bool:
        if self._view is None:
            return False
        inbox = self._view.inbox
        deadline = time.monotonic() + timeout
        message = notice.encode()
        while True:
            remaining = deadline - time.monotonic()
            try:
                inbox.send(message, timeout=max(0.0, remaining))
                return True
            except posix_ipc.SignalError:
                continue  # a signal handler ran: try again within the same deadline
            except posix_ipc.BusyError:
                if time.monotonic() >= deadline:
                    return False  # inbox full all along: the manager is overloaded or stuck
            except (posix_ipc.ExistentialError, OSError):
                self._close_view()
                return False

    # --- the manager's answer ----------------------------------------------------------------
    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
        if self.signal is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            command = self._command_for(generation)
            if command is not None:
                return command
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self.signal.acquire(remaining)
            except posix_ipc.BusyError:
                return self._command_for(generation)
            except posix_ipc.SignalError:
                continue

    def poll_command(self, generation: int) -> AppCommand | None:
        self._drain_signal()
        return self._command_for(generation)

    def command_signalled(self) -> bool:
        """One non-blocking ``sem_trywait`` on the app's signal (about a microsecond)."""
        if self.signal is None:
            return False
        try:
            self.signal.acquire(0)
        except posix_ipc.Error:  # BusyError: nothing posted
            return False
        return True

    def _command_for(self, generation: int) -> AppCommand | None:
        return command_for(self.record, generation, self._dr_total, self._published, self.app, self._report)

    def _drain_signal(self) -> None:
        while self.signal is not None:
            try:
                self.signal.acquire(0)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                return

    # --- cleanup ------------------------------------------------------------------------------
    def _close_view(self) -> None:
        if self._view is not None:
            self._view.close()
        self._view = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_view()
        if self.signal is not None:
            try:
                self.signal.close()
            except posix_ipc.Error:
                pass
            objects.unlink_semaphore(self.names.app_signal(self.app, self.signal_token))
        if self.record is not None:
            self.record.close()
            objects.unlink_shared_memory(self.names.app_record(self.app, self.token))
        if self.claim is not None:
            self.claim.release()


class _ManagerObjects:
    """An open heartbeat and inbox of one manager (both checked to be this user's)."""

    def __init__(self, token: str, heartbeat: ManagerRecord, inbox: posix_ipc.MessageQueue) -> None:
        self.token = token
        self.heartbeat = heartbeat
        self.inbox = inbox

    @classmethod
    def open(cls, names: IpcNames, token: str, inbox_token: str) -> _ManagerObjects:
        heartbeat = ManagerRecord.open(names, token)
        try:
            inbox = objects.open_queue(names.inbox(inbox_token))
        except BaseException:
            heartbeat.close()
            raise
        return cls(token, heartbeat, inbox)

    def close(self) -> None:
        try:
            self.inbox.close()
        except posix_ipc.Error:
            pass
        self.heartbeat.close()
