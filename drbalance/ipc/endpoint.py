"""The manager's side of the protocol: its inbox, its heartbeat, and a channel to each app."""

from __future__ import annotations

import errno
import os
import time

import posix_ipc

from drbalance.ipc import discovery, objects
from drbalance.ipc.layout import AppCommand, AppStatus, ManagerBeat, Notice, RecordError
from drbalance.ipc.link import INBOX_MAX_MESSAGES, INBOX_MESSAGE_SIZE
from drbalance.ipc.names import IpcNames, new_token
from drbalance.ipc.records import AppRecord, ManagerRecord, SegmentTruncated


class ManagerEndpoint:
    """Owns the inbox queue and the heartbeat segment of one namespace, and ``manager.json``.

    Create it only while holding the namespace's manager lock. It removes the objects of the
    previous manager that ``manager.json`` names (a manager killed with ``kill -9`` leaves
    them), publishes its own pid and token there *before* creating its objects (so a manager
    killed half-way still leaves objects that its successor finds), then creates them under the
    new token. Nobody else can know the token beforehand, so nobody can have created them first.
    ``replacing``: made by the manager that ``manager.json`` names, to replace its own objects; its
    predecessor's objects are then the caller's to close, once this one exists.
    """

    def __init__(self, names: IpcNames, inbox_messages: int = INBOX_MAX_MESSAGES, replacing: bool = False) -> None:
        self.names = names
        self.token = new_token()  # the heartbeat's
        self.inbox_token = new_token()  # the inbox's: not to be guessed from the heartbeat's name, nor it from this
        if not replacing:
            self._remove_predecessor()
        self.info = discovery.this_process(self.token, self.inbox_token)
        discovery.publish_manager(names, self.info)
        self.inbox: posix_ipc.MessageQueue | None = None
        self.heartbeat: ManagerRecord | None = None
        try:
            self.inbox = objects.create_queue(names.inbox(self.inbox_token), inbox_messages, INBOX_MESSAGE_SIZE)
            self.heartbeat = ManagerRecord.create(names, self.token)
        except OSError as error:
            self.close()
            if type(error) is OSError and error.errno in (errno.ENOSPC, errno.ENOMEM):  # e.g. /dev/shm full
                raise OSError(error.errno, f"cannot create the manager's inbox queue and heartbeat segment "
                                           f"({objects.SHM_DIR}): {error.strerror}") from error
            raise
        except BaseException:
            self.close()
            raise

    def _remove_predecessor(self) -> None:
        try:
            previous = discovery.read_manager(self.names)
        except (OSError, discovery.DiscoveryError):
            return  # unreadable: replaced by ours below; its objects (if any) cannot be named
        if previous is not None:
            objects.unlink_queue(self.names.inbox(previous.inbox))
            objects.unlink_shared_memory(self.names.manager_record(previous.token))

    def republish(self) -> None:
        """Write ``manager.json`` again (after the runtime directory was removed or the file replaced)."""
        discovery.publish_manager(self.names, self.info)

    def published(self) -> bool:
        """Whether ``manager.json`` names this endpoint now."""
        try:
            current = discovery.read_manager(self.names)
        except (OSError, discovery.DiscoveryError):
            return False
        return current is not None and current.token == self.token

    def beat(self, beat: ManagerBeat) -> bool:
        """Write the heartbeat; a truncated heartbeat segment is repaired first. True if repaired."""
        repaired = self.heartbeat.segment.repair()
        self.heartbeat.write(beat)
        return repaired

    def unlinked(self) -> list[str]:
        """Which of its objects ("inbox", "heartbeat") were removed from /dev/shm (or the
        message-queue file system) while open: by systemd-logind's ``RemoveIPC=yes`` when the
        user's last login session ends, or by a cleanup. Apps cannot find them any more."""
        inbox = None if self.inbox is None else self.inbox.mqd
        heartbeat = None if self.heartbeat is None else self.heartbeat.segment.memory.fd
        return [label for label, fd in (("inbox", inbox), ("heartbeat", heartbeat)) if objects.unlinked_fd(fd)]

    def receive(self, timeout: float) -> Notice | None:
        """The next notice, or None after ``timeout`` seconds (or a signal). RecordError if malformed."""
        try:
            message, _priority = self.inbox.receive(max(0.0, timeout))
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return None
        return Notice.decode(message)

    def close(self) -> None:
        """Remove the inbox, heartbeat and ``manager.json`` (apps then see no manager and train on)."""
        for closable in (self.inbox, self.heartbeat):
            if closable is None:
                continue
            try:
                closable.close()
            except (posix_ipc.Error, OSError):
                pass
        self.inbox = self.heartbeat = None
        objects.unlink_queue(self.names.inbox(self.inbox_token))
        objects.unlink_shared_memory(self.names.manager_record(self.token))
        discovery.withdraw_manager(self.names, self.token)


LIVE_BEAT_SECONDS = 30.0  # a heartbeat younger than this, of a process that runs, is a live manager's


def other_live_manager(names: IpcNames) -> ManagerBeat | None:
    """The heartbeat of another manager of this user that runs in this namespace now, if any.

    The namespace's lock keeps a second manager out only where both resolve the same runtime
    directory; one started where ``XDG_RUNTIME_DIR`` differs would take the namespace's jobs too.
    /dev/shm is the same for both: a heartbeat there that beat within ``LIVE_BEAT_SECONDS``, of a
    process that runs, is such a manager (a dead one's heartbeat stops beating)."""
    me, now = os.geteuid(), time.monotonic()
    for listed in names.listed():
        if listed.kind != "manager" or listed.owner != me or listed.token is None:
            continue
        try:
            record = ManagerRecord.open(names, listed.token)
        except (posix_ipc.Error, RecordError, OSError):
            continue
        try:
            beat = record.read()
        except (RecordError, OSError):
            continue
        finally:
            record.close()
        if beat.pid != os.getpid() and now - beat.beat_mono < LIVE_BEAT_SECONDS and objects.process_alive(beat.pid):
            return beat
    return None


class AppChannel:
    """The manager's handle on one app: read its status, write its command, signal it.

    ``objects.ForeignObject`` if the record or semaphore is not this user's; ``RecordError``
    if the record is unreadable or the semaphore is missing.
    """

    def __init__(self, names: IpcNames, app: str, token: str | None = None, signal_token: str | None = None) -> None:
        self.names = names
        self.app = app
        self.record = AppRecord.open(names, app, token)  # token None: the one the app's claim names
        self.token = token = self.record.token
        self.signal_token = signal_token or _claimed_signal_token(names, app, token)
        try:
            self.signal = objects.open_semaphore(names.app_signal(app, self.signal_token))
        except posix_ipc.ExistentialError:
            self.record.close()
            raise RecordError(f"app {app!r} has a record but no signal semaphore") from None
        except BaseException:
            self.record.close()
            raise

    def read_status(self) -> AppStatus:
        return self.record.read_status()

    def unlinked(self) -> bool:
        """Whether the app's record or semaphore open here lost its name (the app creates them
        again under the same names: ``PosixManagerLink.publish``)."""
        return (objects.unlinked_fd(self.record.segment.memory.fd)
                or not objects.semaphore_listed(self.names.app_signal(self.app, self.signal_token)))

    def answer(self, command: AppCommand) -> bool:
        """Step 5 and 6 of the loop: write the new DR, then signal the app.

        False (nothing written) when the record is truncated: the app repairs its own record.
        """
        try:
            self.record.write_command(command)
        except SegmentTruncated:
            return False
        try:
            self.signal.release()
        except posix_ipc.Error:
            pass  # value at its maximum or object gone: the app polls its record anyway
        return True

    def close(self) -> None:
        try:
            self.signal.close()
        except posix_ipc.Error:
            pass
        self.record.close()

    def remove_objects(self) -> None:
        """Unlink the app's record and semaphore (after the app died without cleaning up)."""
        discovery.remove_app_objects(self.names, self.app, self.token, self.signal_token)


def _claimed_signal_token(names: IpcNames, app: str, token: str) -> str:
    """The token of the semaphore of ``app``'s record made with ``token``, as its claim names it:
    ``token`` itself where the claim names another record, none, or is unreadable (claims of
    older releases name one token for both)."""
    try:
        claim = discovery.read_claim(names, app)
    except (OSError, discovery.DiscoveryError):
        return token
    return claim.signal if claim is not None and claim.token == token else token
