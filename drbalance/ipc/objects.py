"""Creating, opening and removing POSIX IPC objects safely.

- Objects are created with mode 0600 whatever the process umask is.
- Calls interrupted by a signal handler (``posix_ipc.SignalError``) are retried.
- Removing an object that is already gone is not an error.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import posix_ipc

T = TypeVar("T")
PRIVATE_MODE = 0o600
_umask_lock = threading.Lock()


@contextmanager
def private_umask() -> Iterator[None]:
    """Make objects created inside get exactly the mode asked for (0600), not less."""
    with _umask_lock:
        previous = os.umask(0o177)
        try:
            yield
        finally:
            os.umask(previous)


def retry_on_signal(call: Callable[[], T], deadline: float | None = None) -> T:
    """Run ``call``, retrying when a signal interrupts it, until ``deadline`` (monotonic seconds)."""
    while True:
        try:
            return call()
        except posix_ipc.SignalError:
            if deadline is not None and time.monotonic() >= deadline:
                raise posix_ipc.BusyError("interrupted by signals until the deadline") from None


def create_shared_memory(name: str, size: int) -> tuple[posix_ipc.SharedMemory, mmap.mmap]:
    """Create a new segment (fails if it exists) of ``size`` bytes, zero-filled, mode 0600."""
    with private_umask():
        segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=PRIVATE_MODE, size=size)
    try:
        os.fchmod(segment.fd, PRIVATE_MODE)
        mapping = mmap.mmap(segment.fd, size)
    finally:
        segment.close_fd()
    return segment, mapping


def open_shared_memory(name: str, writable: bool = True) -> tuple[posix_ipc.SharedMemory, mmap.mmap]:
    """Open an existing segment and map all of it."""
    flags = 0 if writable else posix_ipc.O_RDONLY
    segment = posix_ipc.SharedMemory(name, flags, read_only=not writable)
    try:
        if segment.size <= 0:
            raise ValueError(f"shared memory {name} is empty")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        mapping = mmap.mmap(segment.fd, segment.size, access=access)
    finally:
        segment.close_fd()
    return segment, mapping


def create_semaphore(name: str) -> posix_ipc.Semaphore:
    """Create a new semaphore with value 0 (fails if it exists), mode 0600."""
    with private_umask():
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=PRIVATE_MODE, initial_value=0)


def create_queue(name: str, max_messages: int, max_message_size: int) -> posix_ipc.MessageQueue:
    """Create a new message queue (fails if it exists), mode 0600."""
    with private_umask():
        return posix_ipc.MessageQueue(
            name, posix_ipc.O_CREX, mode=PRIVATE_MODE,
            max_messages=max_messages, max_message_size=max_message_size,
        )


def unlink_shared_memory(name: str) -> bool:
    """Remove a segment by name; False if it was already gone."""
    return _unlink(posix_ipc.unlink_shared_memory, name)


def unlink_semaphore(name: str) -> bool:
    return _unlink(posix_ipc.unlink_semaphore, name)


def unlink_queue(name: str) -> bool:
    return _unlink(posix_ipc.unlink_message_queue, name)


def _unlink(unlink: Callable[[str], None], name: str) -> bool:
    try:
        unlink(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in {"Z", "X"}


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started: field 22 of /proc/<pid>/stat, in clock ticks since boot.

    Together with the pid it names one process: a later process that reuses the pid has another
    start time. None when it cannot be read (no such process, no /proc).
    """
    if pid <= 0:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])  # fields after the command name start at field 3 (state)
    except (OSError, IndexError, ValueError):
        return None


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700 if missing; refuse one owned by another user."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path
