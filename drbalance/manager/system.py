"""The system manager: one per machine (and namespace), balancing every user's jobs together.

``drbalance-manager --system``, started by the administrator (a systemd system unit:
docs/operations.md). It listens on a Unix socket in its folder (``drbalance.ipc.system``); each
job connects, passes its record (a sealed memfd) and sends its notices over that connection
(``drbalance.ipc.wire``). The kernel tells who each job is (``SO_PEERCRED``, a pidfd:
``drbalance.ipc.peer``): a record or notice that names another process or app than its
connection is refused and reported, never believed. The decisions are the ones a user's own
manager makes (``Balancer``): one policy over every job of every user, each job counted once.

Isolation (docs/protocol.md): a job's record is reachable only through its connection; the
manager's only signal to a job is a message on that job's own connection (it sends no UNIX
signal to anyone); per-user limits and a round-robin notice queue keep one user from starving
another (``admission``); a user sees others' jobs only as anonymous load (``visibility``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import resource
import selectors
import socket
import stat
from dataclasses import asdict
from pathlib import Path
from typing import Any

from drbalance.clock import Clock
from drbalance.ipc import system, wire
from drbalance.ipc.layout import SEGMENT_SIZE, AppCommand, AppState, Notice, NoticeKind, RecordError
from drbalance.ipc.peer import Peer, PeerRefused, ProcessHandle, check_record_descriptor, peer_of
from drbalance.ipc.private import UnsafePath, login_name, user_name
from drbalance.ipc.records import AppRecord, RecordEmpty, SegmentTruncated
from drbalance.jsonlog import JsonLinesWriter
from drbalance.manager.admission import Admission, NoticeQueue, TokenBucket, UserLimits
from drbalance.manager.balancer import Balancer, ManagerAlreadyRunning, ManagerSettings, ManagerStartError
from drbalance.manager.metrics import ManagerMetrics
from drbalance.manager.table import AppEntry, AppTable
from drbalance.manager.utilization import UtilizationSource
from drbalance.manager.visibility import metric_label, status_for
from drbalance.policy import Policy

logger = logging.getLogger("drbalance.manager")

LISTEN_BACKLOG = 128
ACCEPT_BUDGET = 16
"""Connections accepted per turn at most (a flood of connections waits in the backlog)."""
READ_BUDGET = 16
"""Messages read per user per turn at most (a flood of messages waits in its sockets)."""
SERVE_SECONDS = 0.05
"""Seconds a turn spends answering queued notices at most before its periodic tasks."""
REFUSALS_PER_SECOND = 1.0
"""``REFUSED`` messages sent per connection and second at most (a flood is refused silently)."""
PROBLEM_LINES_PER_SECOND = 10
"""Lines a user's refused messages (``invalid``, ``refused``) may write to the manager log per
second, with a burst of as many; past that they are counted and the count logged (``withheld``)
once a GC period. A reason of its own for each junk message would otherwise let one user write a
line per message: rotate the administrator's log away, and slow the manager down for everyone."""
RECORD_READ_ATTEMPTS = 20
"""Tries to read a job's record before keeping its last valid status; so few never sleep
(``SeqlockArea.read``): a record its owner, another user, keeps mid-write costs microseconds at
each decision, not a wait."""
_FROM_PEERS = frozenset({wire.Kind.ATTACH, wire.Kind.NOTICE, wire.Kind.STATUS})


class Connection:
    """One connected process: its kernel identity, and once attached its app and record."""

    def __init__(self, sock: socket.socket, peer: Peer, opened: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.opened = opened
        self.app: str | None = None
        self.key: str | None = None  # the app's key in the table: "<uid>:<app>"
        self.record: AppRecord | None = None
        self.process: ProcessHandle | None = None
        self.serial = 0  # the number metrics show for the job (visibility.metric_label)
        self.login = ""  # the user's login name (looked up once: a uid without a passwd entry is slow to)
        self.last_refusal = -float("inf")

    def describe(self) -> str:
        what = f"app {self.app!r} " if self.app else ""
        return f"{what}({self.peer.describe()})"

    def close(self) -> None:
        self.sock.close()
        if self.record is not None:
            self.record.close()
            self.record = None
        if self.process is not None:
            self.process.close()
            self.process = None


class SocketChannel:
    """The manager's handle on an attached job: its record (read the status, write the command)
    and its connection (the signal). The connection owns both; closing the channel keeps them."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.record = connection.record
        self.token = ""

    def read_status(self):
        return self.record.read_status(RECORD_READ_ATTEMPTS)

    def answer(self, command: AppCommand) -> bool:
        """Write the command into the job's record, then signal it on its connection (a full
        socket drops the signal: the job reads its record at its next report anyway)."""
        try:
            self.record.write_command(command)
        except SegmentTruncated:
            return False
        try:
            wire.send(self.connection.sock, wire.Kind.COMMAND, wire.COMMAND.pack(command.generation))
        except (OSError, wire.WireError):
            pass  # gone: the connection's end is seen at the next turn
        return True

    def unlinked(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def remove_objects(self) -> None:
        pass


class SystemManager(Balancer):
    """The system manager (see the module docstring). ``start()``, ``run()`` or ``turn()``, ``stop()``."""

    def __init__(
        self,
        settings: ManagerSettings,
        source: UtilizationSource,
        clock: Clock | None = None,
        policy: Policy | None = None,
        metrics: ManagerMetrics | None = None,
        limits: UserLimits | None = None,
        show_names: bool = False,
    ) -> None:
        from drbalance import env

        namespace = settings.namespace if settings.namespace is not None else env.namespace()
        super().__init__(settings, source, AppTable(None), namespace, clock, policy, metrics)
        self.limits = limits or UserLimits()
        self.show_names = show_names
        self.admission = Admission(self.limits)
        self.queue: NoticeQueue[tuple[Connection, Notice, float]] = NoticeQueue()  # (.., when it was read)
        self.place: system.SystemPlace | None = None
        self.connections: dict[int, Connection] = {}  # socket fd -> connection
        self.attached: dict[str, Connection] = {}  # app key -> its connection
        self._listener: socket.socket | None = None
        self._socket_id: tuple[int, int] | None = None  # (device, inode) of the socket file we bound
        self._lock_fd: int | None = None
        self._selector = selectors.DefaultSelector()
        self._serials = 0
        self._told: dict[int, float] = {}  # per user: when a refused connection was last told why
        self._problem_lines: dict[int, TokenBucket] = {}  # per user: the allowance of PROBLEM_LINES_PER_SECOND
        self._withheld: dict[int, int] = {}  # per user: problem lines not written since the last ``withheld``

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Make (or check) the system folder, open the log, take the lock, listen.

        ``ManagerAlreadyRunning`` when another system manager holds the namespace;
        ``ManagerStartError`` for a folder that cannot be used (the text says what to do)."""
        try:
            self.place = system.create(self.namespace)
        except (UnsafePath, PermissionError, OSError) as error:
            raise ManagerStartError(
                f"cannot use the system folder {system.system_root() / self.namespace}: {error}. Run the system "
                f"manager as root, or as a service user to whom root gave {system.system_root()} (systemd: "
                f"RuntimeDirectory=drbalance; docs/operations.md)") from None
        self._log_path = self.settings.log_path or (self.place.folder / "manager.jsonl")
        try:
            self._log = JsonLinesWriter(self._log_path, flush_every=1, max_bytes=self.settings.log_max_bytes,
                                        keep=self.settings.log_keep)
        except OSError as error:
            raise ManagerStartError(f"cannot write the manager log {self._log_path}: {error}") from None
        try:
            self._lock_fd = self._take_lock()
            self._listener = self._listen()
        except BaseException:
            self._abort_start()
            raise
        _raise_file_limit()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._started_wall = self.clock.wall()
        self.log("start", pid=os.getpid(), namespace=self.namespace, policy=self.policy.name, gpus=self.gpu_count,
                 config=asdict(self.config), system=True, folder=str(self.place.folder),
                 owner=user_name(self.place.owner), limits=asdict(self.limits), show_names=self.show_names,
                 settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.settings).items()})
        now = self.clock.monotonic()
        self._next = dict.fromkeys(("sample", "util_log", "gc", "idle", "withheld", "metrics", "slurm", "socket"), now)
        logger.info("drbalance-manager: system manager of namespace %r at %s, policy %r, %d GPU(s), log %s",
                    self.namespace, self.place.socket, self.policy.name, self.gpu_count, self._log_path)

    def _take_lock(self) -> int:
        """The namespace's lock (``flock``), opened relative to the checked folder."""
        folder = self.place.open_folder()
        try:
            fd = os.open(system.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         0o644, dir_fd=folder)
        finally:
            os.close(folder)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ManagerStartError(f"{self.place.lock} is not a file of this user: remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ManagerAlreadyRunning(f"a system manager (pid {owner}) already runs in namespace "
                                        f"{self.namespace!r} ({self.place.folder})") from None
        except BaseException:
            os.close(fd)
            raise
        mine = f"{os.getpid()}\n".encode()
        os.pwrite(fd, mine, 0)
        os.ftruncate(fd, len(mine))
        return fd

    def _listen(self) -> socket.socket:
        """Bind the socket in the folder (a stale one of a dead predecessor replaced: we hold the
        lock), every user may connect (mode 0666); only the folder's owner may replace it."""
        folder = self.place.open_folder()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                os.unlink(system.SOCKET_NAME, dir_fd=folder)
            except FileNotFoundError:
                pass
            listener.bind(f"/proc/self/fd/{folder}/{system.SOCKET_NAME}")
            os.chmod(system.SOCKET_NAME, 0o666, dir_fd=folder)
            info = os.stat(system.SOCKET_NAME, dir_fd=folder, follow_symlinks=False)
            self._socket_id = (info.st_dev, info.st_ino)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError as error:
            listener.close()
            raise ManagerStartError(f"cannot listen at {self.place.socket}: {error}") from None
        finally:
            os.close(folder)
        return listener

    def _abort_start(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Close every connection (jobs see no manager and train on), remove the socket, release the lock."""
        reason = self.stopping or "stopped"
        for connection in list(self.connections.values()):
            self._close(connection, None)
        for entry in list(self.table.entries.values()):
            self.table.remove(entry.name, unlink=False)
        if self._listener is not None:
            self._remove_socket()
            self._listener.close()
            self._listener = None
        self.finish(reason)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _remove_socket(self) -> None:
        """Unlink the socket file if it is still the one we bound (never a successor's)."""
        try:
            folder = self.place.open_folder()
        except OSError:
            return
        try:
            info = os.stat(system.SOCKET_NAME, dir_fd=folder, follow_symlinks=False)
            if (info.st_dev, info.st_ino) == self._socket_id:
                os.unlink(system.SOCKET_NAME, dir_fd=folder)
        except OSError:
            pass
        finally:
            os.close(folder)

    def __enter__(self) -> SystemManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- one turn -------------------------------------------------------------------------------
    def turn(self) -> None:
        """Wait for connections, messages or ended processes until the next periodic task; take
        them; answer queued notices (round-robin over users); run the due tasks."""
        now = self.clock.monotonic()
        wait = 0.0 if len(self.queue) else max(0.0, min(self._next.values()) - now)
        ready: dict[int, list[Connection]] = {}  # per user, the connections with something to read
        for key, _mask in self._select(wait):
            if key.data is None:
                self._run_task("accept", lambda _now: self._accept(), now)
            elif isinstance(key.data, ProcessHandle):
                self._process_ended(key.data)
            else:
                ready.setdefault(key.data.peer.uid, []).append(key.data)
        for connections in ready.values():
            self._run_task("read", lambda _now, c=connections: self._read_user(c), now)
        self._serve(self.clock.monotonic() + SERVE_SECONDS)
        self._forget_reports(self.clock.monotonic())
        self._periodic(self.clock.monotonic())

    def _select(self, wait: float) -> list[tuple[selectors.SelectorKey, int]]:
        try:
            return self._selector.select(wait)
        except InterruptedError:
            return []

    def _periodic(self, now: float) -> None:
        settings = self.settings
        for key, period, task in (("sample", settings.sample_period, self._sample),
                                  ("util_log", settings.util_log_period, self._log_utilization),
                                  ("gc", settings.gc_period, self._collect_garbage),
                                  ("idle", settings.gc_period, self._close_idle),
                                  ("withheld", settings.gc_period, self._log_withheld),
                                  ("metrics", settings.status_period, self._update_metrics),
                                  ("slurm", 1.0, self._slurm_weight),
                                  ("socket", settings.rescan_period, self._check_socket)):
            if now >= self._next[key]:
                self._next[key] = now + period
                self._run_task(key, task, now)

    def _check_socket(self, now: float) -> None:
        """Listen again when the socket file is gone or is not the one bound (removed by a cleanup
        of /run, or the folder removed and made again): jobs could not connect any more. Jobs
        already connected keep their connections."""
        try:
            folder = self.place.open_folder()
        except FileNotFoundError:
            folder = None
        try:
            info = None if folder is None else os.stat(system.SOCKET_NAME, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        finally:
            if folder is not None:
                os.close(folder)
        if info is not None and (info.st_dev, info.st_ino) == self._socket_id:
            return
        self.place = system.create(self.namespace)
        listener = self._listen()
        self._selector.unregister(self._listener)
        self._listener.close()
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)
        self.log("repaired", what="socket", error=f"{self.place.socket} was removed or replaced; listening again")
        logger.warning("drbalance-manager: the socket %s was removed or replaced; listening there again",
                       self.place.socket)

    # --- connections ----------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPT_BUDGET):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    self._fault("accept", error)
                    return
                raise
            try:
                peer = peer_of(sock)
            except (OSError, PeerRefused):
                sock.close()
                continue
            refusal = self.admission.connection_refusal(peer.uid)
            if refusal is not None:
                self._refuse_quietly(sock, peer, wire.Refusal.LIMIT, refusal)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SEND_BUFFER)
            connection = Connection(sock, peer, self.clock.monotonic())
            self.connections[sock.fileno()] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _refuse_quietly(self, sock: socket.socket, peer: Peer, code: wire.Refusal, reason: str) -> None:
        """Refuse a connection at once; the reason is sent at most once a second per user (a flood of
        connections costs an accept and a close each), logged once per user and reason while it lasts."""
        now = self.clock.monotonic()
        if now - self._told.get(peer.uid, -math.inf) >= 1.0 / REFUSALS_PER_SECOND:
            self._told[peer.uid] = now
            try:
                wire.send(sock, wire.Kind.REFUSED, wire.refusal_payload(code, reason))
            except (OSError, wire.WireError):
                pass
        sock.close()
        self._report_refusal("refused", peer, None, reason)

    def _report_refusal(self, event: str, peer: Peer, app: str | None, reason: str) -> None:
        """Log a refusal once per user and reason while it lasts (names looked up only then)."""
        key = (event, str(peer.uid), reason)
        now = self.clock.monotonic()
        if key in self._reported:
            self._reported[key] = now
            return
        allowance = self._problem_lines.get(peer.uid)
        if allowance is None:
            allowance = self._problem_lines[peer.uid] = TokenBucket(PROBLEM_LINES_PER_SECOND, now)
        if not allowance.take(now):
            self._withheld[peer.uid] = self._withheld.get(peer.uid, 0) + 1
            return
        self._report_once(key, event, what="message", app=app, uid=peer.uid, user=user_name(peer.uid),
                          pid=peer.pid, error=reason)

    def _log_withheld(self, now: float) -> None:
        """Log how many problem lines of each user were not written (``PROBLEM_LINES_PER_SECOND``)."""
        for uid, count in self._withheld.items():
            self.log("withheld", uid=uid, user=user_name(uid), count=count)
        self._withheld.clear()
        for uid in [uid for uid, allowance in self._problem_lines.items()
                    if allowance.tokens + (now - allowance.updated) * allowance.rate >= allowance.rate
                    and not self.admission.connections.get(uid)]:
            del self._problem_lines[uid]  # a full allowance of a user with no connection: nothing to keep

    def _read_user(self, connections: list[Connection]) -> None:
        """Read one user's ready connections, one message from each in turn, ``READ_BUDGET``
        messages in all at most (the rest wait in their sockets for the next turn), so that a user
        with many connections takes no more of a turn than a user with one."""
        budget = READ_BUDGET
        while connections and budget > 0:
            for connection in list(connections):
                if budget <= 0:
                    return
                budget -= 1
                if not self._read_one(connection):
                    connections.remove(connection)

    def _read_one(self, connection: Connection) -> bool:
        """Take one message from ``connection``; whether there may be more."""
        if connection.sock.fileno() < 0:
            return False
        try:
            message = wire.receive(connection.sock, _FROM_PEERS)
        except EOFError:
            self._close(connection, "disconnected")
            return False
        except wire.WireError as error:
            self._refuse(connection, wire.Refusal.INVALID, f"malformed message: {error}")
            return True
        except OSError as error:
            self._close(connection, f"connection failed: {error}")
            return False
        if message is None:
            return False
        if message.kind == wire.Kind.ATTACH:
            self._attach(connection, message)
        elif message.kind == wire.Kind.NOTICE:
            self._take_notice(connection, message.payload)
        else:
            self._send_status(connection)
        return True

    def _refuse(self, connection: Connection, code: wire.Refusal, reason: str, event: str = "invalid") -> None:
        """Log a refusal (stderr once per user and reason) and tell the peer, at most once a second."""
        self._report_refusal(event, connection.peer, connection.app, reason)
        now = self.clock.monotonic()
        if now - connection.last_refusal >= 1.0 / REFUSALS_PER_SECOND:
            connection.last_refusal = now
            try:
                wire.send(connection.sock, wire.Kind.REFUSED, wire.refusal_payload(code, reason))
            except (OSError, wire.WireError):
                pass

    def _attach(self, connection: Connection, message: wire.Message) -> None:
        """A job passes its record: checked, kept with the connection, welcomed."""
        try:
            self._check_attach(connection, message)
        except _Refused as refused:
            self._tell(connection, refused.refusal, str(refused))
            return
        except (PeerRefused, wire.WireError, RecordError, OSError) as error:
            self._refuse(connection, wire.Refusal.INVALID, str(error))
            return
        welcome = wire.Welcome(os.getpid(), self.gpu_count, self.config.dr_total, self._started_wall)
        try:
            wire.send(connection.sock, wire.Kind.WELCOME, welcome.encode())
        except (OSError, wire.WireError):
            self._close(connection, "disconnected")
            return
        self.log("attached", app=connection.key, uid=connection.peer.uid, user=user_name(connection.peer.uid),
                 pid=connection.peer.pid)

    def _check_attach(self, connection: Connection, message: wire.Message) -> None:
        """Attach the job the message names, or raise (its descriptors closed: the record's is the
        record's once adopted, closed by ``AppRecord.adopt`` if that fails)."""
        peer = connection.peer
        try:
            if connection.app is not None:
                raise wire.WireError(f"this connection already attached app {connection.app!r}")
            app = wire.attached_app(message.payload)
            if len(message.fds) != 1:
                raise wire.WireError(f"an attach carries one descriptor (the record); got {len(message.fds)}")
            key = f"{peer.uid}:{app}"
            holder = self.attached.get(key)
            if holder is not None:
                if holder.process is not None and not holder.process.ended():
                    raise _Refused(wire.Refusal.NAME_IN_USE, f"a job of this user named {app!r} already runs as "
                                   f"pid {holder.peer.pid}; choose another name")
                self._close(holder, "process gone")
            check_record_descriptor(message.fds[0], peer, SEGMENT_SIZE)
            process = ProcessHandle.open(peer)
        except BaseException:
            message.close_fds()
            raise
        refusal = self.admission.job_refusal(peer.uid)
        if refusal is not None:
            process.close()
            message.close_fds()
            raise _Refused(wire.Refusal.LIMIT, refusal)
        try:
            record = AppRecord.adopt(message.fds[0], app, f"record of {app!r} ({peer.describe()})")
        except BaseException:
            self.admission.job_left(peer.uid)
            process.close()
            raise
        self._serials += 1
        connection.app, connection.key, connection.record, connection.process = app, key, record, process
        connection.serial = self._serials
        connection.login = login_name(peer.uid)
        self.attached[key] = connection
        self._selector.register(process, selectors.EVENT_READ, process)

    def _tell(self, connection: Connection, code: wire.Refusal, reason: str) -> None:
        """A refusal that is not an attack (a name in use, a limit): logged once per user and reason."""
        self._report_refusal("refused", connection.peer, connection.app, reason)
        try:
            wire.send(connection.sock, wire.Kind.REFUSED, wire.refusal_payload(code, reason))
        except (OSError, wire.WireError):
            pass

    def _take_notice(self, connection: Connection, payload: bytes) -> None:
        peer = connection.peer
        try:
            notice = Notice.decode(payload)
        except RecordError as error:
            self._refuse(connection, wire.Refusal.INVALID, f"malformed notice: {error}")
            return
        if connection.app is None:
            self._refuse(connection, wire.Refusal.INVALID, "a notice before the job attached its record")
            return
        if notice.pid not in connection.process.pids or notice.app != connection.app:
            self._refuse(connection, wire.Refusal.INVALID,
                         f"a notice for app {notice.app!r} of pid {notice.pid} on the connection of app "
                         f"{connection.app!r}, pid {peer.pid} (the kernel's): refused")
            return
        if notice.kind == NoticeKind.FINISH:  # no decision to make: taken at once, before the job closes
            self.queue.drop(peer.uid, connection.key)
            self.handle(connection, notice)
            return
        refusal = self.admission.notice_refusal(peer.uid, self.clock.monotonic())
        if refusal is not None:
            self._refuse(connection, wire.Refusal.LIMIT, refusal, event="refused")
            return
        self.queue.put(peer.uid, connection.key, (connection, notice, self.clock.monotonic()))

    def _send_status(self, connection: Connection) -> None:
        document = status_for(self.system_status(), connection.peer.uid, os.geteuid(), self.show_names)
        data = json.dumps(document).encode()
        if len(data) > wire.MAX_REPLY:
            data = json.dumps({**document, "apps": document["apps"][:50],
                               "apps_omitted": len(document["apps"]) - 50}).encode()[:wire.MAX_REPLY]
        try:
            wire.send(connection.sock, wire.Kind.STATUS_REPLY, data)
        except (OSError, wire.WireError):
            self._close(connection, "disconnected")

    def system_status(self) -> dict[str, Any]:
        """Every job, each with its owner (what ``visibility.status_for`` filters)."""
        now = self.clock.monotonic()
        document = self.status_document(now)
        document["system"] = True
        document["log"] = str(self._log_path)
        document["runtime_dir"] = str(self.place.folder) if self.place is not None else ""
        return document

    def app_status(self, entry: AppEntry, now: float) -> dict[str, Any]:
        app = super().app_status(entry, now)
        connection = self.attached.get(entry.name)
        if connection is not None:
            app.update(name=connection.app, uid=connection.peer.uid, user_login=connection.login)
        return app

    def _close(self, connection: Connection, reason: str | None) -> None:
        """Forget a connection: its job leaves the table (logged with ``reason``), its limits free."""
        if connection.sock.fileno() >= 0:
            try:
                self._selector.unregister(connection.sock)
            except (KeyError, ValueError):
                pass
        if connection.process is not None:
            try:
                self._selector.unregister(connection.process)
            except (KeyError, ValueError):
                pass
        if self.connections.get(connection.fd) is connection:
            del self.connections[connection.fd]
        if connection.key is not None and self.attached.get(connection.key) is connection:
            del self.attached[connection.key]
            self.queue.drop(connection.peer.uid, connection.key)
            self.admission.job_left(connection.peer.uid)
            if self.table.remove(connection.key, unlink=False) is not None and reason is not None:
                self.log("app_removed", app=connection.key, pid=connection.peer.pid, reason=reason)
        self.admission.connection_closed(connection.peer.uid)
        self.admission.forget_idle(connection.peer.uid)
        connection.close()

    def _process_ended(self, process: ProcessHandle) -> None:
        for connection in list(self.attached.values()):
            if connection.process is process:
                self._close(connection, "process gone")
                return
        try:
            self._selector.unregister(process)
        except (KeyError, ValueError):
            pass

    def _close_idle(self, now: float) -> None:
        """Close connections that neither attached nor asked anything within ``attach_seconds``."""
        for connection in list(self.connections.values()):
            if connection.app is None and now - connection.opened > self.limits.attach_seconds:
                self._close(connection, None)

    # --- notices --------------------------------------------------------------------------------
    def _serve(self, until: float) -> None:
        while len(self.queue) and self.clock.monotonic() < until:
            item = self.queue.pop()
            if item is None:
                return
            _, (connection, notice, received) = item
            if connection.key is None or self.attached.get(connection.key) is not connection:
                continue  # it left meanwhile
            self._run_task("notice", lambda _now, c=connection, n=notice, r=received: self.handle(c, n, r),
                           self.clock.monotonic())

    def handle(self, connection: Connection, notice: Notice, received: float | None = None) -> None:
        """Steps 3-6 for a job's notice (already checked to be its own; ``received``: when it was
        read, monotonic seconds, for the decision's ``queued_us``)."""
        now = self.clock.monotonic()
        key = connection.key
        entry = self.table.get(key)
        if notice.kind == NoticeKind.FINISH:
            if entry is not None:
                self.table.remove(key, unlink=False)
                self.log("app_removed", app=key, pid=notice.pid, reason="finished")
            return
        if entry is None:
            entry = self._admit(connection, now)
            if entry is None:
                return
        self._refresh_all(now)
        trigger = "register" if notice.kind == NoticeKind.REGISTER else "boundary"
        self.decide(entry, trigger, notice.seq, None if received is None else self.clock.monotonic() - received)
        if self.metrics is not None:
            self.metrics.exchange(self.clock.wall() - notice.sent_wall)

    def _admit(self, connection: Connection, now: float) -> AppEntry | None:
        """Add an attached job to the table at its first notice (its record holds a status by then)."""
        peer = connection.peer
        ticks = connection.process.start_ticks if connection.process is not None else 0
        pids = connection.process.pids if connection.process is not None else (peer.pid,)
        try:
            status = connection.record.read_status(RECORD_READ_ATTEMPTS)
            if status.pid not in pids or (ticks and status.start_ticks and status.start_ticks != ticks):
                raise RecordError(f"the record of app {connection.app!r} names pid {status.pid} started at "
                                  f"{status.start_ticks}; the kernel says its connection is pid {peer.pid} started at "
                                  f"{ticks} (clock ticks since boot): refused")
        except (RecordEmpty, RecordError) as error:
            self._refuse(connection, wire.Refusal.INVALID, str(error))
            return None
        entry = AppEntry(connection.key, SocketChannel(connection), status, now, owner_pid=status.pid,
                         owner_ticks=ticks)
        self.table.entries[connection.key] = entry
        self._log_added(entry, "notice")
        return entry

    def _collect_garbage(self, now: float) -> None:
        """Remove jobs whose process ended (a pidfd not yet seen by the selector) or that finished;
        mark quiet ones."""
        self._refresh_all(now)
        for key, connection in list(self.attached.items()):
            if connection.process is None or connection.process.ended():
                self._close(connection, "process gone")
                continue
            entry = self.table.get(key)
            if entry is None:
                continue
            if entry.status.state == AppState.FINISHED:
                self.table.remove(key, unlink=False)
                self.log("app_removed", app=key, pid=entry.status.pid, reason="finished")
            else:
                self._mark_quiet(entry, now)

    def metric_name(self, entry: AppEntry) -> str:
        connection = self.attached.get(entry.name)
        if connection is None:
            return entry.name
        return metric_label(connection.app, connection.login, connection.serial, self.show_names)


class _Refused(PeerRefused):
    """A refusal with its ``wire.Refusal`` code."""

    def __init__(self, refusal: wire.Refusal, reason: str) -> None:
        super().__init__(reason)
        self.refusal = refusal


def _raise_file_limit() -> None:
    """Open files: the soft limit raised to the hard one (each job holds a connection, a record
    and a pidfd; the per-user limits bound how many)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


