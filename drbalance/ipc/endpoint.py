"""The manager's side of the protocol: its inbox, its heartbeat, and a channel to each app."""

from __future__ import annotations

import posix_ipc

from drbalance.ipc import objects
from drbalance.ipc.layout import AppCommand, AppStatus, ManagerBeat, Notice, RecordError
from drbalance.ipc.link import INBOX_MAX_MESSAGES, INBOX_MESSAGE_SIZE
from drbalance.ipc.names import IpcNames
from drbalance.ipc.records import AppRecord, ManagerRecord


class ManagerEndpoint:
    """Owns the inbox queue and the heartbeat segment of one namespace.

    Create it only while holding the namespace's manager lock: it replaces any leftovers of a
    previous manager (a queue or heartbeat that survived its owner's death).
    """

    def __init__(self, names: IpcNames, inbox_messages: int = INBOX_MAX_MESSAGES) -> None:
        self.names = names
        objects.unlink_queue(names.inbox())
        self.inbox = objects.create_queue(names.inbox(), inbox_messages, INBOX_MESSAGE_SIZE)
        try:
            self.heartbeat = ManagerRecord.create(names)
        except Exception:
            self.inbox.close()
            objects.unlink_queue(names.inbox())
            raise

    def beat(self, beat: ManagerBeat) -> None:
        self.heartbeat.write(beat)

    def receive(self, timeout: float) -> Notice | None:
        """The next notice, or None after ``timeout`` seconds (or a signal). RecordError if malformed."""
        try:
            message, _priority = self.inbox.receive(max(0.0, timeout))
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return None
        return Notice.decode(message)

    def close(self) -> None:
        """Remove the inbox and heartbeat (apps then see no manager and train on)."""
        for action in (self.inbox.close, self.heartbeat.close):
            try:
                action()
            except (posix_ipc.Error, OSError):
                pass
        objects.unlink_queue(self.names.inbox())
        objects.unlink_shared_memory(self.names.manager_record())


class AppChannel:
    """The manager's handle on one app: read its status, write its command, signal it."""

    def __init__(self, names: IpcNames, app: str) -> None:
        self.names = names
        self.app = app
        self.record = AppRecord.open(names, app)
        try:
            self.signal = posix_ipc.Semaphore(names.app_signal(app))
        except posix_ipc.ExistentialError:
            self.record.close()
            raise RecordError(f"app {app!r} has a record but no signal semaphore") from None

    def read_status(self) -> AppStatus:
        return self.record.read_status()

    def answer(self, command: AppCommand) -> None:
        """Step 5 and 6 of the loop: write the new DR, then signal the app."""
        self.record.write_command(command)
        try:
            self.signal.release()
        except posix_ipc.Error:
            pass  # value at its maximum or object gone: the app polls its record anyway

    def close(self) -> None:
        try:
            self.signal.close()
        except posix_ipc.Error:
            pass
        self.record.close()

    def remove_objects(self) -> None:
        """Unlink the app's record and semaphore (after the app died without cleaning up)."""
        objects.unlink_shared_memory(self.names.app_record(self.app))
        objects.unlink_semaphore(self.names.app_signal(self.app))
