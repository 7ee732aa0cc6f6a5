"""The messages on a system manager's socket (``SOCK_SEQPACKET``: each send is one message).

A job's exchange with a *system* manager has the shape of its exchange with its user's own
manager (``docs/protocol.md``), over one Unix socket instead of a message queue and a semaphore,
because the manager is another user's process:

| kind | from | payload | descriptors |
|---|---|---|---|
| ``ATTACH`` | job | app name (48 bytes ASCII) | the job's record: a sealed memfd |
| ``NOTICE`` | job | a ``Notice`` (76 bytes), as to the inbox | |
| ``STATUS`` | anyone | none | |
| ``WELCOME`` | manager | manager pid i32, GPU count u16, DR total u16, started (wall s) f64 | |
| ``REFUSED`` | manager | a ``Refusal`` code u8, then why, UTF-8 (at most ``MAX_REASON`` bytes) | |
| ``COMMAND`` | manager | generation u64: a command was written into the job's record (the *signal*) | |
| ``STATUS_REPLY`` | manager | the status as the asking user may see it, JSON | |

Every message starts with ``HEADER``: magic ``"DRBW"``, the layout version, the kind, a zero
byte. A message that is too long, malformed, of an unknown kind, or that carries descriptors it
must not is refused; descriptors that came with a refused message are closed at once.
"""

from __future__ import annotations

import array
import enum
import errno
import math
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

from drbalance.ipc.layout import LAYOUT_VERSION, RecordError, _name

HEADER = struct.Struct("<4sHBB")
MAGIC = b"DRBW"
WELCOME = struct.Struct("<iHHd")
COMMAND = struct.Struct("<Q")
APP_NAME = struct.Struct("48s")
MAX_REQUEST = 512
"""Bytes a manager reads of one message from a job (the largest, a notice, is 84)."""
MAX_REASON = 1000
MAX_REPLY = 256 * 1024
"""Bytes of a status reply at most (a socket's default send buffer holds about 200 KiB more)."""
SEND_BUFFER = MAX_REPLY + 64 * 1024
_FD = array.array("i")  # a descriptor's C type in SCM_RIGHTS data


class Kind(enum.IntEnum):
    ATTACH = 1
    NOTICE = 2
    STATUS = 3
    WELCOME = 101
    REFUSED = 102
    COMMAND = 103
    STATUS_REPLY = 104


class Refusal(enum.IntEnum):
    """Why a system manager refused a message (the text says more)."""

    INVALID = 1  # malformed, or claiming another process or app than the connection's
    NAME_IN_USE = 2  # a live job of this user already has this app name
    LIMIT = 3  # a per-user limit (jobs, connections, notices per second)


class WireError(RecordError):
    """A message that is not what the protocol allows; the text says why."""


@dataclass(frozen=True)
class Message:
    kind: Kind
    payload: bytes
    fds: tuple[int, ...] = ()

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass(frozen=True)
class Welcome:
    """A system manager's answer to an ``ATTACH``: who it is and how it decides."""

    pid: int
    gpu_count: int
    dr_total: int
    started: float

    def encode(self) -> bytes:
        return WELCOME.pack(self.pid, self.gpu_count, self.dr_total, self.started)

    @classmethod
    def decode(cls, payload: bytes) -> Welcome:
        if len(payload) != WELCOME.size:
            raise WireError(f"welcome: {len(payload)} bytes, expected {WELCOME.size}")
        pid, gpus, total, started = WELCOME.unpack(payload)
        if pid <= 0 or gpus < 1 or total < 1 or not math.isfinite(started):
            raise WireError(f"welcome: pid {pid}, {gpus} GPUs, DR total {total}, started {started}: not a manager's")
        return cls(pid, gpus, total, started)


def encode(kind: Kind, payload: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, LAYOUT_VERSION, int(kind), 0) + payload


def attach_payload(app: str) -> bytes:
    return APP_NAME.pack(app.encode("ascii"))


def attached_app(payload: bytes) -> str:
    if len(payload) != APP_NAME.size:
        raise WireError(f"attach: {len(payload)} bytes of app name, expected {APP_NAME.size}")
    return _name(payload, "attach")


def refusal_payload(code: Refusal, reason: str) -> bytes:
    return bytes([int(code)]) + reason.encode("utf-8", "replace")[:MAX_REASON]


def refusal(payload: bytes) -> tuple[Refusal, str]:
    """The code and text of a ``REFUSED`` message (an unknown code reads as ``INVALID``)."""
    if not payload:
        return Refusal.INVALID, "refused"
    try:
        code = Refusal(payload[0])
    except ValueError:
        code = Refusal.INVALID
    return code, payload[1:MAX_REASON + 1].decode("utf-8", "replace")


def decode(data: bytes, fds: list[int] | tuple[int, ...], flags: int, allowed: frozenset[Kind]) -> Message:
    """A received message (its bytes, the descriptors that came with it, ``recvmsg``'s flags),
    checked; ``WireError`` (its descriptors closed) when it is not one of ``allowed``."""
    message = None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise WireError("message longer than the protocol allows (or with too many descriptors)")
        if len(data) < HEADER.size:
            raise WireError(f"message of {len(data)} bytes: shorter than its header")
        magic, version, kind, _ = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise WireError(f"bad magic {magic!r}")
        if version != LAYOUT_VERSION:
            raise WireError(f"layout version {version}, this build speaks {LAYOUT_VERSION}")
        try:
            kind = Kind(kind)
        except ValueError:
            raise WireError(f"unknown message kind {kind}") from None
        if kind not in allowed:
            raise WireError(f"a {kind.name} message is not expected here")
        if fds and kind != Kind.ATTACH:
            raise WireError(f"a {kind.name} message carries descriptors")
        message = Message(kind, data[HEADER.size:], tuple(fds))
        return message
    finally:
        if message is None:
            Message(Kind.REFUSED, b"", tuple(fds)).close_fds()


def receive(sock: socket.socket, allowed: frozenset[Kind], size: int = MAX_REQUEST, max_fds: int = 1) -> Message | None:
    """The next message on a non-blocking ``sock``, or None when none is waiting. ``EOFError`` when
    the peer closed the connection; ``WireError`` for a message the protocol does not allow."""
    try:
        data, ancillary, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(max_fds * _FD.itemsize),
                                                 socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        return None
    except ConnectionResetError:
        raise EOFError("the peer reset the connection") from None
    fds = _descriptors(ancillary)
    if not data and not fds:
        raise EOFError("the peer closed the connection")
    return decode(data, fds, flags, allowed)


def send(sock: socket.socket, kind: Kind, payload: bytes = b"", fds: tuple[int, ...] = (),
         timeout: float = 0.0) -> bool:
    """Send one message, waiting at most ``timeout`` seconds for room; whether it went. A peer
    that is gone raises ``BrokenPipeError`` (or ``ConnectionResetError``)."""
    data = encode(kind, payload)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sock.sendmsg([data], ancillary, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            return True
        except InterruptedError:
            continue
        except BlockingIOError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                select.select([], [sock], [], remaining)
            except InterruptedError:
                continue
        except OSError as error:
            if error.errno == errno.EMSGSIZE:
                raise WireError(f"a {kind.name} message of {len(data)} bytes does not fit the socket") from None
            raise


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors ``SCM_RIGHTS`` items of ``recvmsg``'s ancillary data installed in this process
    (``socket.recv_fds`` of Python 3.11 drops the call's flags, so ``MSG_DONTWAIT`` would be lost)."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % _FD.itemsize
            fds.extend(array.array("i", payload[:usable]))
    return fds


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read (or was closed) within ``timeout`` seconds."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
            return bool(readable)
        except InterruptedError:  # a signal handler ran: wait the rest
            if time.monotonic() >= deadline:
                return False
