"""The training side of the manager protocol, over POSIX IPC.

An app owns two objects: its record (shared memory; status written by the app, command by the
manager) and its signal (a semaphore the manager posts after writing a command). It talks to
the manager through the manager's single inbox (a message queue) and watches the manager's
heartbeat segment to know whether a manager is there at all. Every wait is bounded.

``ManagerLink`` is the interface the client session uses; ``PosixManagerLink`` is the real one
and ``DetachedLink`` the one used when no manager may be contacted (profile runs, opt-out).
"""

from __future__ import annotations

import time
from typing import Protocol

import posix_ipc

from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.layout import AppCommand, AppStatus, ManagerBeat, Notice, RecordError
from drbalance.ipc.names import IpcNames
from drbalance.ipc.records import AppRecord, ManagerRecord

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

    def close(self) -> None:
        """Remove everything this app created."""


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

    def close(self) -> None:
        pass


class PosixManagerLink:
    """The real link: the app's record and signal, the manager's inbox and heartbeat."""

    def __init__(self, names: IpcNames, app: str, clock: Clock | None = None, stale_after: float = 5.0) -> None:
        self.names = names
        self.app = app
        self.clock = clock or SystemClock()
        self.stale_after = stale_after
        self.record = AppRecord.create(names, app)  # removes a dead app's leftovers of this name
        try:
            self.signal = _create_signal(names, app)
        except Exception:
            self.record.close()
            objects.unlink_shared_memory(names.app_record(app))
            raise
        self._inbox: posix_ipc.MessageQueue | None = None
        self._inbox_pid = 0
        self._closed = False

    # --- status -------------------------------------------------------------------------------
    def publish(self, status: AppStatus) -> None:
        self.record.write_status(status)

    # --- the manager --------------------------------------------------------------------------
    def manager(self) -> ManagerBeat | None:
        try:
            heartbeat = ManagerRecord.open(self.names)
        except (posix_ipc.ExistentialError, RecordError):
            self._close_inbox()
            return None
        try:
            beat = heartbeat.read()
        except RecordError:
            self._close_inbox()
            return None
        finally:
            heartbeat.close()
        if self.clock.monotonic() - beat.beat_mono >= self.stale_after or not objects.pid_alive(beat.pid):
            self._close_inbox()
            return None
        self._open_inbox(beat.pid)
        return beat

    def _open_inbox(self, manager_pid: int) -> None:
        """Keep the inbox of the manager with this pid open (a new manager means a new queue)."""
        if self._inbox is not None and self._inbox_pid == manager_pid:
            return
        self._close_inbox()
        try:
            self._inbox = posix_ipc.MessageQueue(self.names.inbox())
            self._inbox_pid = manager_pid
        except posix_ipc.ExistentialError:
            pass

    def notify(self, notice: Notice, timeout: float) -> bool:
        inbox = self._inbox
        if inbox is None:
            return False
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
            except posix_ipc.ExistentialError:
                self._close_inbox()
                return False

    # --- the manager's answer ----------------------------------------------------------------
    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
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

    def _command_for(self, generation: int) -> AppCommand | None:
        try:
            command = self.record.read_command()
        except RecordError:
            return None  # a half-written or corrupt command is never applied
        if command is None or command.generation != generation:
            return None  # none yet, or a stale answer to an older notice
        return command

    def _drain_signal(self) -> None:
        while True:
            try:
                self.signal.acquire(0)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                return

    # --- cleanup ------------------------------------------------------------------------------
    def _close_inbox(self) -> None:
        if self._inbox is not None:
            try:
                self._inbox.close()
            except posix_ipc.Error:
                pass
        self._inbox, self._inbox_pid = None, 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_inbox()
        try:
            self.signal.close()
        except posix_ipc.Error:
            pass
        objects.unlink_semaphore(self.names.app_signal(self.app))
        self.record.close()
        objects.unlink_shared_memory(self.names.app_record(self.app))


def _create_signal(names: IpcNames, app: str) -> posix_ipc.Semaphore:
    name = names.app_signal(app)
    try:
        return objects.create_semaphore(name)
    except posix_ipc.ExistentialError:
        # The record was just created by us, so any semaphore of this name is a dead app's leftover.
        objects.unlink_semaphore(name)
        return objects.create_semaphore(name)
