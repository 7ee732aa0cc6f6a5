"""Creating, opening and removing POSIX IPC objects safely.

- Objects are created with mode 0600 and then set to exactly 0600 with ``fchmod`` (the process
  umask is never changed: it belongs to the training script).
- Every object opened is checked (``fstat``): it must belong to this user and must not be
  writable by group or others. Anything else is a ``ForeignObject``: never trusted, never
  written to, reported by name and owner.
- Calls interrupted by a signal handler (``posix_ipc.SignalError``) are retried.
- Removing an object that is already gone is not an error.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import posix_ipc

from drbalance.ipc.private import private_dir, user_name

PRIVATE_MODE = 0o600
SHM_DIR = Path("/dev/shm")  # where Linux lists shared memory (and named semaphores as sem.<name>)
MQUEUE_LIMITS = Path("/proc/sys/fs/mqueue")


class ForeignObject(PermissionError):
    """An object under one of this user's names that this user did not create, or others may write."""

    def __init__(self, name: str, reason: str, owner: int | None = None) -> None:
        super().__init__(f"{name}: {reason}; not trusted")
        self.name = name
        self.owner = owner
        self.reason = reason


# --- ownership -------------------------------------------------------------------------------
def check_owned(info: os.stat_result, name: str) -> None:
    """``ForeignObject`` unless ``info`` is this user's and not writable by group or others."""
    me = os.geteuid()
    if info.st_uid != me:
        raise ForeignObject(name, f"belongs to {user_name(info.st_uid)}, not to this user ({user_name(me)})",
                            info.st_uid)
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise ForeignObject(name, f"is writable by group or others (mode {mode:04o})", info.st_uid)


def check_owner(info: os.stat_result, name: str, owner: int) -> None:
    """``ForeignObject`` unless ``info`` is a regular file of ``owner`` or of root."""
    if not stat.S_ISREG(info.st_mode):
        raise ForeignObject(name, "is not a regular file", info.st_uid)
    if info.st_uid not in (owner, 0):
        raise ForeignObject(name, f"belongs to {user_name(info.st_uid)}, not to {user_name(owner)}", info.st_uid)


def _listed_path(name: str, kind: str) -> Path:
    return SHM_DIR / (("sem." if kind == "semaphore" else "") + name.lstrip("/"))


def semaphore_listed(name: str) -> bool:
    """Whether a named semaphore is still listed in /dev/shm (posix_ipc gives it no descriptor
    whose link count could tell)."""
    return os.path.lexists(_listed_path(name, "semaphore"))


def unlinked_fd(fd: int | None) -> bool:
    """Whether the object open on ``fd`` (a segment or a message queue) has no name any more."""
    try:
        return fd is None or os.fstat(fd).st_nlink == 0
    except (OSError, ValueError):
        return True


def _refused(name: str, kind: str, owner: int | None = None) -> ForeignObject:
    """The error for an object we may not open: who owns it, if /dev/shm tells (``owner``: whose
    it must be, if not this user's)."""
    try:
        info = os.lstat(_listed_path(name, kind))
    except OSError:
        return ForeignObject(name, f"{kind} cannot be opened (permission denied)")
    try:
        if owner is None:
            check_owned(info, name)
        else:
            check_owner(info, name, owner)
    except ForeignObject as error:
        return error
    return ForeignObject(name, f"{kind} cannot be opened (permission denied, mode {stat.S_IMODE(info.st_mode):04o})")


# --- shared memory -----------------------------------------------------------------------------
def create_shared_memory(name: str, size: int, mode: int = PRIVATE_MODE) -> tuple[posix_ipc.SharedMemory, mmap.mmap]:
    """Create a new segment (fails if it exists) of ``size`` bytes, zero-filled, mode 0600 (or
    ``mode``: a machine's emulated GPU, which every user's jobs write, is 0666).

    The segment's fd stays open (``segment.fd``) so that its size can be checked before every
    access of the mapping; the caller closes it with ``segment.close_fd()``.
    """
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
    try:
        os.fchmod(segment.fd, mode)
        back_pages(segment.fd, size, fresh=True)
        mapping = mmap.mmap(segment.fd, size)
    except BaseException:
        segment.close_fd()
        unlink_shared_memory(name)
        raise
    return segment, mapping


def back_pages(fd: int, size: int, fresh: bool = False) -> None:
    """Give the first ``size`` bytes of a shared-memory file real pages now (zeros where unwritten).

    ``ftruncate`` alone leaves the file sparse: mapping it works even on a full /dev/shm, and
    the first touch of a page tmpfs cannot supply then kills the process with SIGBUS (any user
    can fill /dev/shm). Allocated here, a full /dev/shm is an ``OSError`` (ENOSPC) instead.
    Where the file system has no ``fallocate``, zeros are written: over all of a ``fresh`` file
    (nobody else has it yet), else only past its end (others may be writing what is there).
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        start = 0 if fresh else min(size, os.fstat(fd).st_size)
        os.pwrite(fd, bytes(size - start), start)


def open_shared_memory(name: str, writable: bool = True,
                       owner: int | None = None) -> tuple[posix_ipc.SharedMemory, mmap.mmap]:
    """Open an existing segment of this user and map all of it (the fd stays open, see create).

    ``ForeignObject`` if it is not this user's, or is a symbolic link; ``ValueError`` if it is
    empty. ``owner``: the segment is that user's instead (or root's), whoever may write it (a
    machine's emulated GPU: the system manager's, mode 0666).
    """
    flags = 0 if writable else posix_ipc.O_RDONLY
    try:
        segment = posix_ipc.SharedMemory(name, flags, read_only=not writable)
    except posix_ipc.PermissionsError:
        raise _refused(name, "shared memory", owner) from None
    except OSError as error:
        if error.errno == errno.ELOOP:  # shm_open does not follow links: someone planted one under the name
            raise ForeignObject(name, "is a symbolic link in /dev/shm, not a segment") from None
        raise
    try:
        info = os.fstat(segment.fd)
        if owner is None:
            check_owned(info, name)
        else:
            check_owner(info, name, owner)
        if info.st_size <= 0:
            raise ValueError(f"shared memory {name} is empty")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        mapping = mmap.mmap(segment.fd, info.st_size, access=access)
    except BaseException:
        segment.close_fd()
        raise
    return segment, mapping


# --- semaphores --------------------------------------------------------------------------------
def create_semaphore(name: str) -> posix_ipc.Semaphore:
    """Create a new semaphore with value 0 (fails if it exists), mode 0600."""
    semaphore = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=PRIVATE_MODE, initial_value=0)
    try:
        _fix_semaphore_mode(name)
    except BaseException:
        semaphore.close()
        unlink_semaphore(name)
        raise
    return semaphore


def _fix_semaphore_mode(name: str) -> None:
    """Set a semaphore we just created to exactly 0600 (posix_ipc exposes no fd for it)."""
    try:
        fd = os.open(_listed_path(name, "semaphore"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # not listed in /dev/shm on this system: the mode asked for (0600) can only be narrower
    try:
        check_owned(os.fstat(fd), name)
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open an existing semaphore of this user (``ForeignObject`` otherwise).

    posix_ipc gives no descriptor of a semaphore, so its file in /dev/shm is checked before and
    after opening and must be the same file. A semaphore carries no data: a wrong one could at
    worst wake an app early (it then re-reads its record) or never (it waits its bounded timeout).
    """
    listed = _listed_path(name, "semaphore")
    before = _owned_listing(listed, name)
    try:
        semaphore = posix_ipc.Semaphore(name)
    except posix_ipc.PermissionsError:
        raise _refused(name, "semaphore") from None
    after = _owned_listing(listed, name) if before is not None else None
    if before is not None and (after is None or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)):
        semaphore.close()
        raise ForeignObject(name, "semaphore was replaced while being opened")
    return semaphore


def _owned_listing(listed: Path, name: str) -> os.stat_result | None:
    try:
        info = os.lstat(listed)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise ForeignObject(name, "is not a regular file in /dev/shm")
    check_owned(info, name)
    return info


# --- message queues ----------------------------------------------------------------------------
def create_queue(name: str, max_messages: int, max_message_size: int) -> posix_ipc.MessageQueue:
    """Create a new message queue (fails if it exists), mode 0600.

    ``QueueLimitError`` says which kernel limit refused it and how to raise that limit.
    """
    try:
        queue = posix_ipc.MessageQueue(name, posix_ipc.O_CREX, mode=PRIVATE_MODE,
                                       max_messages=max_messages, max_message_size=max_message_size)
    except posix_ipc.ExistentialError:
        raise
    except (OSError, ValueError, posix_ipc.Error) as error:
        raise QueueLimitError(name, max_messages, max_message_size, error) from None
    try:
        os.fchmod(queue.mqd, PRIVATE_MODE)  # on Linux a queue descriptor is a file descriptor
    except BaseException:
        queue.close()
        unlink_queue(name)
        raise
    return queue


def open_queue(name: str) -> posix_ipc.MessageQueue:
    """Open an existing message queue of this user (``ForeignObject`` otherwise)."""
    try:
        queue = posix_ipc.MessageQueue(name)
    except posix_ipc.PermissionsError:
        raise ForeignObject(name, "message queue cannot be opened (permission denied)") from None
    try:
        check_owned(os.fstat(queue.mqd), name)
    except BaseException:
        queue.close()
        raise
    return queue


class QueueLimitError(OSError):
    """The kernel refused to create a message queue; the text names the limit and how to raise it."""

    def __init__(self, name: str, max_messages: int, max_message_size: int, cause: BaseException) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)
        limits = {key: _read_limit(key) for key in ("msg_max", "msgsize_max", "queues_max")}
        if isinstance(cause, ValueError) or getattr(cause, "errno", None) == errno.EINVAL:
            detail = (f"the queue's size is beyond the system's limits: {max_messages} messages (msg_max = "
                      f"{limits['msg_max']}) of {max_message_size} bytes (msgsize_max = {limits['msgsize_max']}) "
                      f"in {MQUEUE_LIMITS}; raise them with sysctl fs.mqueue.msg_max=N (as root), or ask for "
                      f"fewer messages")
        elif _system_count_reached(cause):
            detail = (f"the system-wide count of message queues is reached: at most {limits['queues_max']} queues "
                      f"may exist (sysctl fs.mqueue.queues_max) and the queues of every user count, so another "
                      f"user's queues can keep this one from being made{_queue_holders()}; only processes with "
                      f"CAP_SYS_RESOURCE are exempt (root without it is not, as in many containers). Raise it with "
                      f"sysctl -w fs.mqueue.queues_max=N (as root), "
                      f"or have stale queues removed (mount -t mqueue none /dev/mqueue lists them with their owners); "
                      f"this user's RLIMIT_MSGQUEUE is not the limit")
        else:
            budget = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            detail = (f"this user's message-queue budget is probably used up: RLIMIT_MSGQUEUE is {budget} "
                      f"(hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard}) and every queue of "
                      f"this user counts against it, about {max_messages} x ({max_message_size} + 48) bytes each; "
                      f"raise it with 'ulimit -q BYTES' (or 'msgqueue' in /etc/security/limits.conf, or "
                      f"LimitMSGQUEUE= in a systemd unit), or remove "
                      f"stale queues (mount -t mqueue none /dev/mqueue to list them); at most "
                      f"{limits['queues_max']} queues may exist system-wide (sysctl fs.mqueue.queues_max)")
        code = errno.ENOSPC if _system_count_reached(cause) else errno.EMFILE
        super().__init__(code, f"cannot create message queue {name}: {cause}. {detail}")


_SYSTEM_COUNT_TEXT = "Insufficient space for a new queue"  # posix_ipc's text for mq_open's ENOSPC (no errno)


def _system_count_reached(cause: BaseException) -> bool:
    """Whether ``mq_open`` failed with ENOSPC: fs.mqueue.queues_max queues exist (EMFILE is the
    user's RLIMIT_MSGQUEUE)."""
    return getattr(cause, "errno", None) == errno.ENOSPC or str(cause) == _SYSTEM_COUNT_TEXT


def _queue_holders(shown: int = 3) -> str:
    """Who holds the queues, from a mounted mqueue file system: `` (/dev/mqueue lists 255 queues
    of mallory (uid 1001) and 1 of root (uid 0))``; "" where none is mounted or it cannot be read."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3 or fields[2] != "mqueue":
            continue
        mount = fields[1].replace("\\040", " ")
        counts: dict[int, int] = {}
        try:
            for entry in os.scandir(mount):
                owner = entry.stat(follow_symlinks=False).st_uid
                counts[owner] = counts.get(owner, 0) + 1
        except OSError:
            continue
        if not counts:
            return ""
        ranked = sorted(counts.items(), key=lambda item: -item[1])
        named = [f"{count} of {user_name(uid)}" for uid, count in ranked[:shown]]
        rest = ranked[shown:]
        more = f" and {sum(count for _, count in rest)} of {len(rest)} more users" if rest else ""
        return f" ({mount} lists {sum(counts.values())} queues: {', '.join(named)}{more})"
    return ""


def _read_limit(key: str) -> str:
    try:
        return (MQUEUE_LIMITS / key).read_text().strip()
    except OSError:
        return "unknown"


# --- removal -----------------------------------------------------------------------------------
def unlink_shared_memory(name: str) -> bool:
    """Remove a segment by name; False if it was already gone (or is not ours to remove)."""
    return _unlink(posix_ipc.unlink_shared_memory, name)


def unlink_semaphore(name: str) -> bool:
    return _unlink(posix_ipc.unlink_semaphore, name)


def unlink_queue(name: str) -> bool:
    return _unlink(posix_ipc.unlink_message_queue, name)


def _unlink(unlink: Callable[[str], None], name: str) -> bool:
    try:
        unlink(name)
        return True
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False


def listed_owner(name: str, kind: str = "shared memory") -> int | None:
    """The uid owning ``name`` as /dev/shm lists it, or None if it is not listed."""
    try:
        return os.lstat(_listed_path(name, kind)).st_uid
    except OSError:
        return None


def shm_users(name: str) -> list[int]:
    """Pids of the processes (that this user may inspect) mapping shared memory ``name``."""
    return shm_users_of([name])[name]


def shm_users_of(names: Sequence[str]) -> dict[str, list[int]]:
    """For each shared-memory name, the pids of the processes (that this user may inspect) mapping
    it: one pass over /proc for all of them."""
    paths = {str(SHM_DIR / name.lstrip("/")): name for name in names}
    users: dict[str, list[int]] = {name: [] for name in names}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps", encoding="utf-8", errors="replace") as maps:
                mapped = {paths[path] for path in map(_mapped_path, maps) if path in paths}
        except OSError:
            continue
        for name in mapped:
            users[name].append(int(entry.name))
    return users


def _mapped_path(line: str) -> str:
    """The path of a /proc/<pid>/maps line ("" for an anonymous mapping): what follows the inode."""
    start = line.find(" /")
    return line[start + 1:].rstrip("\n") if start >= 0 else ""


# --- processes ---------------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: beyond any pid (pid_t)
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


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start_ticks``.

    ``start_ticks`` (see ``process_start_ticks``) tells the process from a later one that reuses
    its pid; 0 means unknown, and then the pid alone decides. A start time that cannot be read
    (no /proc) counts as a match.
    """
    if not pid_alive(pid):
        return False
    if start_ticks <= 0:
        return True
    current = process_start_ticks(pid)
    return current is None or current == start_ticks


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` as this user's private folder (0700); ``UnsafePath`` if it is not safe."""
    return private_dir(path)

