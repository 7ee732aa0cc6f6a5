"""The training side of the protocol with a machine's *system* manager, and the link a session
uses by default: the system manager when one runs, else the user's own manager.

With a system manager (another user's process, ``drbalance-manager --system``) a job keeps the
same record layout, notices and commands as with its own manager (``link``), but passes them
over one Unix socket (``wire``) instead of names in /dev/shm: its record is a sealed memfd with
no name that it hands to the manager when it attaches (``ATTACH``), notices are messages on the
connection, and the manager's *signal* after writing a command is a ``COMMAND`` message on it.
Nobody else can open the record, send a notice for the job or signal it; the manager knows the
job's uid and pid from the kernel (``peer``), and the job knows the manager's the same way.
A manager that stops closes the connection: the job sees no manager at its next look.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct

from drbalance.clock import Clock, SystemClock
from drbalance.ipc import system, wire
from drbalance.ipc.discovery import AppNameInUse
from drbalance.ipc.layout import AppCommand, AppStatus, ManagerBeat, Notice
from drbalance.ipc.link import DetachedLink, ManagerLink, PosixManagerLink, command_for
from drbalance.ipc.names import IpcNames
from drbalance.ipc.peer import Peer, PeerRefused, check_manager
from drbalance.ipc.private import UnsafePath
from drbalance.ipc.records import AppRecord
from drbalance.ratio import DataRatio

logger = logging.getLogger("drbalance.client")

ATTACH_TIMEOUT = 2.0
"""Seconds a job waits for a system manager's welcome when it attaches (an answer the manager
gives at its next turn; a manager that does not answer in time is taken as absent, and the job
looks again at its later reports)."""
LOOK_AGAIN_SECONDS = 5.0
"""Seconds after an attach that waited in vain (no welcome within ``ATTACH_TIMEOUT``, or no room in
the manager's queue) before a job tries again: a stopped or hung manager would otherwise cost
every look, a session's start (three looks in a row) and each boundary, the whole wait. A job
alone looks for a manager every 5 s of reports as well."""
_FROM_MANAGER = frozenset({wire.Kind.WELCOME, wire.Kind.REFUSED, wire.Kind.COMMAND})


def connect(place: system.SystemPlace, timeout: float = ATTACH_TIMEOUT) -> tuple[socket.socket, Peer]:
    """A connection to the system manager's socket in ``place``, reached through the checked
    folder's descriptor (so the folder checked is the folder used), and the listener, whose uid the
    kernel says is the system owner's or root's (``PeerRefused`` otherwise; ``UnsafePath`` for a
    socket file that is not one; ``FileNotFoundError``, ``ConnectionRefusedError`` with no listener;
    ``TimeoutError`` after ``timeout`` seconds with a listener whose queue is full)."""
    folder = place.open_folder()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        info = os.stat(system.SOCKET_NAME, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISSOCK(info.st_mode):
            raise UnsafePath(place.socket, "is not a socket")
        connect_within(sock, f"/proc/self/fd/{folder}/{system.SOCKET_NAME}", timeout)
        return sock, check_manager(sock, (place.owner, 0))
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(folder)


class SystemManagerLink:
    """A job's link to its machine's system manager (see the module docstring).

    ``AppNameInUse`` at creation when the manager says a live job of this user has the name.
    """

    def __init__(self, place: system.SystemPlace, app: str, clock: Clock | None = None,
                 attach_timeout: float = ATTACH_TIMEOUT) -> None:
        self.place = place
        self.app = app
        self.clock = clock or SystemClock()
        self.attach_timeout = attach_timeout
        self.record: AppRecord | None = AppRecord.create_sealed(app)
        self.sock: socket.socket | None = None
        self.welcome: wire.Welcome | None = None
        self.problem = "none is running"
        self._signalled = False
        self._published: DataRatio | None = None
        self._status: AppStatus | None = None
        self._reported: set[str] = set()
        self._look_again = -float("inf")  # monotonic time before which no attach is tried (LOOK_AGAIN_SECONDS)
        try:
            self._attach(first=True)
        except BaseException:
            self.close()
            raise

    # --- attaching ----------------------------------------------------------------------------
    def _attach(self, first: bool = False) -> bool:
        """Connect, check the listener's uid, pass the record, wait for the welcome; whether attached."""
        self._disconnect()
        try:
            sock = self._connect()
        except (FileNotFoundError, ConnectionRefusedError):
            self.problem = f"no system manager listens at {self.place.socket}"
            return False
        except BlockingIOError:
            self.problem = (f"the system manager at {self.place.socket} accepts no connection within "
                            f"{self.attach_timeout:g} s (stopped, hung or overloaded)")
            self._look_again = self.clock.monotonic() + LOOK_AGAIN_SECONDS
            return False
        except (UnsafePath, PeerRefused) as error:
            self.problem = f"not trusting {self.place.socket}: {error}"
            self._report(f"trust:{error}", "drbalance: %s", self.problem)
            return False
        except OSError as error:
            self.problem = f"cannot reach the system manager at {self.place.socket}: {error}"
            return False
        if self._status is not None:
            self.record.write_status(self._status)  # the manager reads it when the job attaches
        try:
            sent = wire.send(sock, wire.Kind.ATTACH, wire.attach_payload(self.app),
                             fds=(self.record.segment.memory.fd,), timeout=self.attach_timeout)
            answer = self._answer(sock) if sent else None
        except (OSError, EOFError, wire.WireError) as error:
            sock.close()
            self.problem = f"the system manager dropped the connection ({error})"
            return False
        if answer is None:
            sock.close()
            self.problem = f"the system manager did not answer within {self.attach_timeout:g} s"
            self._look_again = self.clock.monotonic() + LOOK_AGAIN_SECONDS
            return False
        if answer.kind == wire.Kind.REFUSED:
            sock.close()
            code, reason = wire.refusal(answer.payload)
            self.problem = f"the system manager refused {self.app!r}: {reason}"
            if first and code == wire.Refusal.NAME_IN_USE:
                raise AppNameInUse(reason)
            self._report(f"refused:{reason}", "drbalance: %s", self.problem)
            return False
        self.sock, self.welcome, self.problem = sock, wire.Welcome.decode(answer.payload), ""
        self._reported = {key for key in self._reported if not key.startswith("refused:")}
        return True

    def _connect(self) -> socket.socket:
        return connect(self.place, self.attach_timeout)[0]

    def _answer(self, sock: socket.socket) -> wire.Message | None:
        """The manager's ``WELCOME`` or ``REFUSED`` to an attach (None after ``attach_timeout``)."""
        if not wire.wait_readable(sock, self.attach_timeout):
            return None
        message = wire.receive(sock, _FROM_MANAGER)
        if message is None or message.kind not in (wire.Kind.WELCOME, wire.Kind.REFUSED):
            raise wire.WireError("the system manager's first message is neither a welcome nor a refusal")
        return message

    def _disconnect(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.welcome = None, None

    def _pump(self) -> None:
        """Read what the manager sent (never waits): commands signalled, or the connection's end."""
        while self.sock is not None:
            try:
                message = wire.receive(self.sock, _FROM_MANAGER)
            except EOFError:
                self._disconnect()
                self.problem = "the system manager closed the connection (it stopped)"
                return
            except (OSError, wire.WireError) as error:
                self._report(f"wire:{error}", "drbalance: a message from the system manager was refused: %s", error)
                continue
            if message is None:
                return
            if message.kind == wire.Kind.COMMAND:
                self._signalled = True
            elif message.kind == wire.Kind.REFUSED:
                _, reason = wire.refusal(message.payload)
                self._report(f"refused:{reason}", "drbalance: the system manager refused a message of %r: %s",
                             self.app, reason)

    def _report(self, key: str, message: str, *args: object) -> None:
        if key not in self._reported:
            self._reported.add(key)
            logger.warning(message, *args)

    # --- ManagerLink ----------------------------------------------------------------------------
    def publish(self, status: AppStatus) -> None:
        self._published, self._status = status.ratio, status
        if self.record is not None:
            self.record.write_status(status)

    def manager(self) -> ManagerBeat | None:
        self._pump()
        if self.sock is None and (self.clock.monotonic() < self._look_again or not self._attach()):
            return None
        welcome = self.welcome
        return ManagerBeat(welcome.pid, welcome.gpu_count, welcome.dr_total, welcome.started, self.clock.monotonic())

    def notify(self, notice: Notice, timeout: float) -> bool:
        if self.sock is None:
            return False
        try:
            return wire.send(self.sock, wire.Kind.NOTICE, notice.encode(), timeout=timeout)
        except OSError:
            self._disconnect()
            self.problem = "the system manager closed the connection (it stopped)"
            return False

    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
        deadline = self.clock.monotonic() + timeout
        while True:
            self._pump()
            command = self._command_for(generation)
            remaining = deadline - self.clock.monotonic()
            if command is not None or remaining <= 0 or self.sock is None:
                return command
            wire.wait_readable(self.sock, remaining)

    def poll_command(self, generation: int) -> AppCommand | None:
        self._pump()
        self._signalled = False
        return self._command_for(generation)

    def command_signalled(self) -> bool:
        self._pump()
        signalled, self._signalled = self._signalled, False
        return signalled

    def _command_for(self, generation: int) -> AppCommand | None:
        total = self.welcome.dr_total if self.welcome is not None else None
        return command_for(self.record, generation, total, self._published, self.app, self._report)

    def close(self) -> None:
        self._disconnect()
        if self.record is not None:
            self.record.close()
            self.record = None


class AutoLink:
    """The link a session uses by default: at every look for a manager, the machine's system
    manager when one runs in the namespace (``system.find``), else the user's own manager
    (``PosixManagerLink``, made when first needed). A job is attached to one manager at a time;
    a user's manager does not run beside a system manager of its namespace (it stops), so no job
    is balanced by two managers. ``AppNameInUse`` at creation when the name is taken."""

    def __init__(self, names: IpcNames, app: str, clock: Clock | None = None) -> None:
        self.names = names
        self.app = app
        self.clock = clock or SystemClock()
        self.system: SystemManagerLink | None = None
        self.user: PosixManagerLink | None = None
        self.current: ManagerLink = DetachedLink()
        self.problem = "none is running"
        self._reported: set[str] = set()
        try:
            if self._system_beat(first=True) is None:
                self._use_user(first=True)
        except BaseException:
            self.close()
            raise

    def _place(self) -> system.SystemPlace | None:
        try:
            return system.find(self.names.namespace)
        except (UnsafePath, OSError, ValueError) as error:
            key = f"place:{error}"
            if key not in self._reported:
                self._reported.add(key)
                logger.warning("drbalance: not using the system manager's folder of namespace %r: %s",
                               self.names.namespace, error)
            return None

    def _system_beat(self, first: bool = False) -> ManagerBeat | None:
        place = self._place()
        if place is None:
            return None
        if self.system is None or self.system.place != place:
            if self.system is not None:
                self.system.close()
                self.system = None
            try:
                self.system = SystemManagerLink(place, self.app, self.clock)
            except AppNameInUse:
                if first:
                    raise
                return None
            except OSError as error:  # no memory for the record: as without a system manager
                self.problem = f"its record cannot be made ({error})"
                return None
        beat = self.system.manager()
        if beat is not None:
            self.current = self.system
        return beat

    def _use_user(self, first: bool = False) -> ManagerLink:
        if self.user is None:
            try:
                self.user = PosixManagerLink(self.names, self.app, self.clock)
            except AppNameInUse:
                if first:
                    raise
                self.current = DetachedLink()
                return self.current
        self.current = self.user
        return self.current

    @property
    def objects_pending(self) -> bool:
        """Whether the user's link still has to make its record and semaphore (it said why, once:
        ``PosixManagerLink.objects_pending``) and no system manager holds the job."""
        return self.current is self.user and self.user is not None and self.user.objects_pending

    def publish(self, status: AppStatus) -> None:
        self.current.publish(status)

    def manager(self) -> ManagerBeat | None:
        beat = self._system_beat()
        if beat is not None:
            self.problem = ""
            return beat
        link = self._use_user()
        beat = link.manager()
        self.problem = getattr(link, "problem", "") or ""
        if beat is None and self.system is not None and self.system.problem:
            self.problem = f"{self.problem}; {self.system.problem}" if self.problem else self.system.problem
        return beat

    def notify(self, notice: Notice, timeout: float) -> bool:
        return self.current.notify(notice, timeout)

    def await_command(self, generation: int, timeout: float) -> AppCommand | None:
        return self.current.await_command(generation, timeout)

    def poll_command(self, generation: int) -> AppCommand | None:
        return self.current.poll_command(generation)

    def command_signalled(self) -> bool:
        return self.current.command_signalled()

    def close(self) -> None:
        for link in (self.system, self.user):
            if link is not None:
                link.close()
        self.system = self.user = None
        self.current = DetachedLink()


def connect_within(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect the Unix socket ``sock`` to ``path``, waiting at most ``timeout`` seconds for room in
    the listener's queue: a stopped or hung manager accepts nothing, and a plain ``connect`` would
    wait for it for ever once its queue is full (``BlockingIOError`` then; ``SO_SNDTIMEO`` bounds
    the kernel's wait)."""
    seconds = max(0.0, timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000)))
    sock.connect(path)


def running_system_manager(namespace: str) -> Peer | None:
    """The system manager that listens in ``namespace`` now, as the kernel names it; None when
    none does (no folder, no listener, or one that is not the folder owner's)."""
    try:
        place = system.find(namespace)
        if place is None:
            return None
        sock, peer = connect(place)
    except (OSError, ValueError):  # UnsafePath, PeerRefused are OSErrors
        return None
    sock.close()
    return peer


class SystemStatusError(RuntimeError):
    """A system manager runs but its status cannot be had; the text says why."""


def read_system_status(namespace: str, timeout: float = ATTACH_TIMEOUT) -> dict | None:
    """The status of the system manager of ``namespace`` as this user may see it (its own jobs by
    name, others' as anonymous load: ``drbalance.manager.visibility``), or None when no system
    manager runs there. ``SystemStatusError`` when one runs but gives no usable answer."""
    try:
        place = system.find(namespace)
    except (UnsafePath, OSError, ValueError) as error:
        raise SystemStatusError(f"not trusting the system manager's folder: {error}") from None
    if place is None:
        return None
    sock = None
    try:
        sock, _ = connect(place, timeout)
        if not wire.send(sock, wire.Kind.STATUS, timeout=timeout) or not wire.wait_readable(sock, timeout):
            raise SystemStatusError(f"the system manager at {place.socket} did not answer within {timeout:g} s")
        message = wire.receive(sock, frozenset({wire.Kind.STATUS_REPLY, wire.Kind.REFUSED}), size=wire.MAX_REPLY,
                               max_fds=0)
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # its folder stays after it stopped (it is in /run): no system manager runs
    except BlockingIOError:
        raise SystemStatusError(f"the system manager at {place.socket} accepts no connection within {timeout:g} s "
                                f"(stopped, hung or overloaded)") from None
    except (OSError, EOFError, wire.WireError, PeerRefused) as error:
        raise SystemStatusError(f"cannot ask the system manager at {place.socket}: {error}") from None
    finally:
        if sock is not None:
            sock.close()
    if message is None or message.kind == wire.Kind.REFUSED:
        reason = wire.refusal(message.payload)[1] if message is not None else "no answer"
        raise SystemStatusError(f"the system manager refused the status request: {reason}")
    try:
        return json.loads(message.payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise SystemStatusError(f"the system manager's status is not JSON: {error}") from None
