"""Who is at the other end of a Unix socket, as the kernel says it, and what a passed descriptor is.

A system manager serves every user of the machine, so it never believes what a job writes about
itself: a connection's uid, gid and pid come from ``SO_PEERCRED`` (set by the kernel at
``connect``), the process is then held by a *pidfd* (``pidfd_open``: it names that process, never
a later one that reuses its pid, and becomes readable when the process ends), and a record
passed as a descriptor (``SCM_RIGHTS``) is checked on the descriptor itself: a sealed memfd of
the connecting user, of the record's size (``check_record_descriptor``). A job checks the
manager the same way: the uid behind the socket must be the system owner's or root's.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import stat
import struct
from dataclasses import dataclass

from drbalance.ipc.objects import process_start_ticks
from drbalance.ipc.private import user_name

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""Seals a record passed to a system manager must carry: its size can never change again, so the
manager's mapping of it can never fault (a record truncated under a mapping would kill the
manager with SIGBUS) and nobody can add or remove seals later."""
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x10  # F_SEAL_FUTURE_WRITE (Linux 5.1; not named in fcntl)
"""Seals a record passed to a system manager must not carry: it writes its commands into the record."""


class PeerRefused(PermissionError):
    """A peer or a descriptor it passed is not what it must be; the text says what and why."""


@dataclass(frozen=True)
class Peer:
    """A connected process as the kernel knows it: pid, uid, gid (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int

    def describe(self) -> str:
        return f"pid {self.pid} of {user_name(self.uid)}"


def peer_of(sock: socket.socket) -> Peer:
    """The process at the other end of the connected Unix socket ``sock``, as it was at ``connect``
    (``PeerRefused`` when the kernel names none: a peer of another pid namespace shows pid 0)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if pid <= 0:
        raise PeerRefused(f"the peer of this connection has no process id here (pid {pid}: another pid namespace?)")
    return Peer(pid, uid, gid)


class ProcessHandle:
    """A pidfd of a peer's process: readable once that process has ended. ``open`` checks, after
    opening it, that the pid still names a process of the peer's uid, and reads its start time
    (``start_ticks``, clock ticks since boot, 0 = unknown), which a record must then name."""

    def __init__(self, fd: int, peer: Peer) -> None:
        self.fd: int | None = fd
        self.peer = peer
        self.start_ticks = 0
        self.pids: tuple[int, ...] = (peer.pid,)  # its pid in each pid namespace from ours inward (NSpid)

    @classmethod
    def open(cls, peer: Peer) -> ProcessHandle:
        try:
            fd = os.pidfd_open(peer.pid)
        except ProcessLookupError:
            raise PeerRefused(f"{peer.describe()} ended before it could be registered") from None
        handle = cls(fd, peer)
        try:
            uid = os.stat(f"/proc/{peer.pid}").st_uid
            ticks = process_start_ticks(peer.pid) or 0
        except OSError:
            handle.close()
            raise PeerRefused(f"{peer.describe()} ended before it could be registered") from None
        if uid != peer.uid or handle.ended():
            handle.close()
            raise PeerRefused(f"{peer.describe()} ended, and its pid now names another process")
        handle.start_ticks = ticks
        handle.pids = namespace_pids(peer.pid) or (peer.pid,)
        return handle

    def ended(self) -> bool:
        """Whether the process has ended (never blocks)."""
        if self.fd is None:
            return True
        readable, _, _ = select.select([self.fd], [], [], 0)
        return bool(readable)

    def fileno(self) -> int:
        if self.fd is None:
            raise ValueError("closed process handle")
        return self.fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def namespace_pids(pid: int) -> tuple[int, ...]:
    """Process ``pid``'s pid in each pid namespace from ours inward (``NSpid`` in /proc/<pid>/status):
    a job in a container knows itself by the last; () when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return tuple(int(part) for part in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def check_record_descriptor(fd: int, peer: Peer, size: int) -> None:
    """``PeerRefused`` unless ``fd`` (passed by ``peer``) is a memfd of the peer's uid, exactly
    ``size`` bytes, sealed against resizing (``REQUIRED_SEALS``) and not against writing
    (``WRITE_SEALS``): what a system manager may map and write."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise PeerRefused(f"{peer.describe()} passed a descriptor that is not a memory file (mode "
                          f"{stat.filemode(info.st_mode)})")
    if info.st_uid != peer.uid:
        raise PeerRefused(f"{peer.describe()} passed a memory file of {user_name(info.st_uid)}, not its own")
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if not target.startswith("/memfd:"):
        raise PeerRefused(f"{peer.describe()} passed {target or 'a descriptor'} instead of a memfd record")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise PeerRefused(f"{peer.describe()} passed a record that is not sealed against resizing (seals "
                          f"{seals:#x}, need {REQUIRED_SEALS:#x})")
    if seals & WRITE_SEALS:
        raise PeerRefused(f"{peer.describe()} passed a record sealed against writing (seals {seals:#x}): the "
                          f"manager writes its commands into the record")
    if info.st_size != size:
        raise PeerRefused(f"{peer.describe()} passed a record of {info.st_size} bytes, expected {size}")


def check_manager(sock: socket.socket, owners: tuple[int, ...]) -> Peer:
    """The process behind a system manager's socket, if its uid is one of ``owners`` (the system
    owner, root); ``PeerRefused`` otherwise (someone else's listener at that path)."""
    peer = peer_of(sock)
    if peer.uid not in owners:
        raise PeerRefused(f"the socket's listener is {peer.describe()}, not the system manager's owner "
                          f"({', '.join(user_name(uid) for uid in sorted(set(owners)))})")
    return peer
