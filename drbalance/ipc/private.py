"""Private files and folders: this user's own, never reached through a planted link, 0600/0700.

The runtime directory (the manager's lock, its discovery file, the apps' claims) and the logs
live where other users can plant things (``/tmp``). The rules, whatever the umask:

- Every existing folder on the way to the runtime directory must belong to root or to this user
  and must not be writable by others unless it has the sticky bit (as ``/tmp`` has). A symbolic
  link on the way is followed only if root or this user owns it, one level at a time (a link
  that one of ours leads to is checked too).
- A private folder itself is opened without following a symbolic link; it must belong to this
  user and must not be writable by group or others (refused, not repaired: someone may already
  have planted files in it). One that others may only read is narrowed to 0700.
- Private files are opened with ``O_NOFOLLOW``, must be regular files of this user, are created
  with mode 0600 and set to exactly 0600 with ``fchmod`` (the process umask is never changed).

Every refusal is an ``UnsafePath`` (a ``PermissionError``) that names the path, its owner and why.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
MAX_PRIVATE_FILE = 1 << 20  # bytes read at most from a discovery or claim file
_MAX_LINKS = 16


class UnsafePath(PermissionError):
    """A path that another user could control, or that is not what it must be."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.reason = reason


def user_name(uid: int) -> str:
    """``name (uid N)`` for messages; just ``uid N`` when the uid has no passwd entry."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _check_folder_on_the_way(path: Path, info: os.stat_result, me: int) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(path, "is not a folder")
    if info.st_uid not in (0, me):
        raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, who could replace what lies below it")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}) and not sticky")


def check_ancestors(path: str | os.PathLike[str]) -> None:
    """Check every existing folder on the way to ``path`` (``path`` itself excluded); see the module."""
    me = os.geteuid()
    _walk(Path(os.path.abspath(os.fspath(path))).parent, me, 0,
          lambda folder, info: _check_folder_on_the_way(folder, info, me))


def _walk(path: Path, me: int, links: int, check: Callable[[Path, os.stat_result], None]) -> Path:
    """Apply ``check`` to every existing part of ``path`` (``/`` included), following symbolic
    links of root or ``me`` one level at a time, so that a link behind an accepted one is checked
    too (``UnsafePath`` for one of another user); returns ``path`` with those links resolved."""
    current = Path("/")
    check(current, os.lstat(current))
    parts = path.parts[1:]
    for position, part in enumerate(parts):
        if part == "..":
            current = current.parent  # current has no links: its parent is the real one
            continue
        candidate = current / part
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            return current.joinpath(*parts[position:])  # the rest does not exist yet: this user creates it
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (0, me):
                raise UnsafePath(candidate, f"is a symbolic link owned by {user_name(info.st_uid)}: not followed")
            if links >= _MAX_LINKS:
                raise UnsafePath(candidate, "too many levels of symbolic links")
            current = _walk(Path(os.path.join(current, os.readlink(candidate))), me, links + 1, check)
            continue
        check(candidate, info)
        current = candidate
    return current


def private_dir(path: str | os.PathLike[str], create: bool = True) -> Path:
    """``path`` as this user's private folder (mode 0700), created with its missing parents.

    Raises ``UnsafePath`` when a folder on the way is unsafe, when ``path`` is a symbolic link,
    not a folder, another user's, or writable by group or others; ``FileNotFoundError`` when it
    is missing and ``create`` is False.
    """
    absolute = Path(os.path.abspath(os.fspath(path)))
    check_ancestors(absolute)
    if create:
        _make_missing(absolute)
        check_ancestors(absolute)  # again: what another user may have created meanwhile is checked too
    try:
        fd = os.open(absolute, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_a_folder(absolute) from None
        raise
    try:
        _check_own_folder(absolute, fd)
    finally:
        os.close(fd)
    return absolute


def _not_a_folder(path: Path) -> UnsafePath:
    try:
        info = os.lstat(path)
    except OSError:
        return UnsafePath(path, "is not a folder")
    if stat.S_ISLNK(info.st_mode):
        return UnsafePath(path, f"is a symbolic link owned by {user_name(info.st_uid)}; a private folder is "
                          f"never reached through one")
    return UnsafePath(path, "is not a folder")


def _check_own_folder(path: Path, fd: int) -> None:
    info = os.fstat(fd)
    me = os.geteuid()
    if info.st_uid != me:
        raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, not to this user ({user_name(me)})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise UnsafePath(path, f"is writable by group or others (mode {mode:04o}); if it is yours and nothing "
                         f"foreign is in it, make it private with: chmod 700 {path}")
    if mode & 0o077:
        os.fchmod(fd, DIR_MODE)


def _make_missing(path: Path) -> None:
    """Create the missing folders of ``path``, each with mode 0700 (whatever the umask)."""
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, DIR_MODE)  # mkdir's mode is cut by the umask: set it exactly
        finally:
            os.close(fd)


def make_dirs(path: str | os.PathLike[str]) -> Path:
    """Create the missing folders of ``path`` with mode 0700; existing ones are left as they are.

    For folders the user chose (logs, run directories): they may be shared, so a group-writable
    folder or another user's is accepted (the files written there have their own rules). But a
    neighbour must not choose where the files go: ``UnsafePath`` when a symbolic link on the way
    (``path`` included) belongs to another user than root or this one, or a folder on the way
    may be written by every user and has no sticky bit (anyone could plant such a link in it).
    Checked before and after the missing folders are made.
    """
    absolute = Path(os.path.abspath(os.fspath(path)))
    me = os.geteuid()
    _walk(absolute, me, 0, _check_chosen)
    _make_missing(absolute)
    _walk(absolute, me, 0, _check_chosen)
    return absolute


def _check_chosen(folder: Path, info: os.stat_result) -> None:
    """``make_dirs``'s rule for an existing folder on the way: not writable by every user unless sticky."""
    if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(folder, f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}) and not "
                         f"sticky: anyone could replace what is written there")


def open_private(path: str | os.PathLike[str], flags: int) -> tuple[int, bool]:
    """Open a private file with ``flags`` (``O_CREAT`` allowed); return (fd, created).

    Never follows a symbolic link; refuses a file that is not regular or not this user's, or
    that group or others may write. A file this call created gets mode 0600 exactly.
    """
    path = os.fspath(path)
    base = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO cannot block us
    created = False
    if flags & os.O_CREAT:
        try:
            fd = os.open(path, base | os.O_EXCL, FILE_MODE)
            created = True
        except FileExistsError:
            fd = _open_existing(path, base & ~os.O_CREAT)
    else:
        fd = _open_existing(path, base)
    try:
        info = os.fstat(fd)
        me = os.geteuid()
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePath(path, "is not a regular file")
        if info.st_uid != me:
            raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, not to this user ({user_name(me)})")
        if created:
            os.fchmod(fd, FILE_MODE)
        elif stat.S_IMODE(info.st_mode) & 0o022:
            raise UnsafePath(path, f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _open_existing(path: str, flags: int) -> int:
    try:
        return os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafePath(path, "is a symbolic link; a private file is never opened through one") from None
        raise


def read_private(path: str | os.PathLike[str], limit: int = MAX_PRIVATE_FILE) -> bytes:
    """The content of a private file (at most ``limit`` bytes); see ``open_private``."""
    fd, _ = open_private(path, os.O_RDONLY)
    try:
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace a private file atomically with ``data`` (a new 0600 file renamed over it).

    ``OSError`` when the folder is gone, the disk is full (the error names ``path``) or ``path``
    is a folder; nothing is left behind then.
    """
    path = Path(os.fspath(path))
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd, _ = open_private(temporary, os.O_WRONLY | os.O_CREAT)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError as error:  # os.write's error names no file: ENOSPC, EFBIG, EDQUOT, EIO
            raise OSError(error.errno, error.strerror, os.fspath(path)) from None
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
