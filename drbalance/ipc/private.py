"""Private files and folders: this user's own, never reached through a planted link, 0600/0700.

The runtime directory (the manager's lock, its discovery file, the apps' claims) and the logs
live where other users can plant things (``/tmp``, a shared group folder). A path checked and
then opened again by its name could be swapped in between (a folder on the way exchanged with a
symbolic link), so a path is never trusted twice: every folder on the way is opened relative to
the descriptor of the one before it, with ``O_NOFOLLOW``, and checked on the descriptor it gave
(``fstat``); a file is then opened, made, replaced or removed relative to its folder's
descriptor (``Folder``). The rules, whatever the umask:

- A symbolic link on the way is followed only if root or this user owns it, one level at a time
  (a link that one of ours leads to is checked too), from a descriptor of the link itself.
- Folders the user chose (logs, run directories, profiles: ``open_folder``, ``make_dirs``) may
  be shared, so a group-writable folder or another user's is accepted; one that every user may
  write without the sticky bit is refused (anyone could plant a link or a folder in it).
- For the private runtime directory (``open_folder(private=True)``, ``private_dir``) every folder
  on the way must belong to root or to this user and must not be writable by others unless it
  has the sticky bit (as ``/tmp`` has). The private folder itself is never a symbolic link; it
  must belong to this user and must not be writable by group or others (refused, not repaired:
  someone may already have planted files in it). One that others may only read is narrowed to 0700.
- Missing folders are made with mode 0700. Files are opened with ``O_NOFOLLOW`` and must be
  regular files of this user, not writable by group or others, and (when opened for writing)
  with no second hard link; they are created with mode 0600 and set to exactly 0600 with
  ``fchmod`` (the process umask is never changed).

Every refusal is an ``UnsafePath`` (a ``PermissionError``) that names the path, its owner and why.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
MAX_PRIVATE_FILE = 1 << 20  # bytes read at most from a discovery or claim file
_MAX_LINKS = 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def login_name(uid: int) -> str:
    """The user's login name, or the uid as a number when it has no passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# --- the checks ----------------------------------------------------------------------------------
def _check_folder_on_the_way(path: Path, info: os.stat_result, me: int) -> None:
    """The private rule for a folder on the way: root's or ours, not writable by others unless sticky."""
    if info.st_uid not in (0, me):
        raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, who could replace what lies below it")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}) and not sticky")


def _check_chosen(path: Path, info: os.stat_result) -> None:
    """The rule for a folder the user chose, and every folder on its way: not writable by every
    user unless sticky."""
    if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}) and not "
                         f"sticky: anyone could replace what is written there")


def _check_own_folder(path: Path, fd: int) -> None:
    """The private folder itself: ours, not writable by group or others (narrowed to 0700)."""
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


# --- an open folder ----------------------------------------------------------------------------------
class Folder:
    """A folder open as a descriptor (``fd``), reached by ``path`` (for messages only): the files
    below it are opened, made, replaced and removed relative to the descriptor, so the folder
    that was checked is the folder that is used. Close it (or use it in a ``with`` block)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def _name(self, name: str) -> str:
        if not name or name in (".", "..") or "/" in name:
            raise ValueError(f"{name!r} is not a file name in {self.path}")
        return name

    def open(self, name: str, flags: int) -> tuple[int, bool]:
        """Open the private file ``name`` with ``flags`` (``O_CREAT`` allowed); (fd, created).

        Never follows a symbolic link; refuses a file that is not regular or not this user's, that
        group or others may write, or (opened for writing) that has another hard link. A file this
        call created gets mode 0600 exactly.
        """
        name = self._name(name)
        shown = self.path / name
        base = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO cannot block us
        created = False
        if flags & os.O_CREAT:
            try:
                fd = os.open(name, base | os.O_EXCL, FILE_MODE, dir_fd=self.fd)
                created = True
            except FileExistsError:
                fd = self._open_existing(name, base & ~os.O_CREAT)
        else:
            fd = self._open_existing(name, base)
        try:
            _check_own_file(shown, fd, created, writing=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        except BaseException:
            os.close(fd)
            raise
        return fd, created

    def _open_existing(self, name: str, flags: int) -> int:
        try:
            return os.open(name, flags, dir_fd=self.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePath(self.path / name, "is a symbolic link; a private file is never opened through "
                                 "one") from None
            raise type(error)(error.errno, error.strerror, os.fspath(self.path / name)) from None

    def read(self, name: str, limit: int = MAX_PRIVATE_FILE) -> bytes:
        """The content of the private file ``name`` (at most ``limit`` bytes); see ``open``."""
        fd, _ = self.open(name, os.O_RDONLY)
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

    def write(self, name: str, data: bytes) -> None:
        """Replace the private file ``name`` atomically with ``data`` (a new 0600 file renamed over it).

        ``OSError`` when the disk is full (the error names the file) or ``name`` is a folder;
        nothing is left behind then.
        """
        name = self._name(name)
        temporary = f".{name}.{secrets.token_hex(4)}.tmp"
        fd, _ = self.open(temporary, os.O_WRONLY | os.O_CREAT)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            except OSError as error:  # os.write's error names no file: ENOSPC, EFBIG, EDQUOT, EIO
                raise OSError(error.errno, error.strerror, os.fspath(self.path / name)) from None
            finally:
                os.close(fd)
            os.replace(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                self.remove(temporary)
            except OSError:
                pass
            raise

    def remove(self, name: str) -> bool:
        """Remove the entry ``name`` (a file or a link, never what a link points at); False if it
        was not there. ``OSError`` when it cannot be removed."""
        try:
            os.unlink(self._name(name), dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def rename(self, old: str, new: str) -> None:
        """Rename ``old`` to ``new`` within this folder (``new`` replaced if it exists)."""
        os.replace(self._name(old), self._name(new), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a link is not followed); None if absent."""
        try:
            return os.stat(self._name(name), dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return None

    def identity(self, name: str) -> tuple[int, int] | None:
        """(device, inode) of the entry ``name`` itself (a link is not followed); None if absent."""
        info = self.lstat(name)
        return None if info is None else (info.st_dev, info.st_ino)


def _check_own_file(path: Path, fd: int, created: bool, writing: bool) -> None:
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
    elif writing and info.st_nlink > 1:
        raise UnsafePath(path, f"has {info.st_nlink} hard links: another name may be someone else's way to "
                         f"make this user write there")
    os.set_blocking(fd, True)


# --- walking to a folder ------------------------------------------------------------------------------
def _child_folder(parent: int, name: str, shown: Path, create: bool) -> int | tuple[int, str]:
    """Open the folder ``name`` below the folder open as ``parent`` without following a link
    (made, mode 0700, if missing and ``create``): its descriptor, or (owner, text) of the symbolic
    link that ``name`` is. ``NotADirectoryError`` for anything else, ``FileNotFoundError`` when
    missing; both name the path."""
    for _ in range(_MAX_LINKS):  # the entry may change between two looks: look again
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(shown / name)) from None
            made = _make_folder(parent, name)
            if made is not None:
                return made
        except OSError as error:
            if error.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            seen = _look(parent, name)
            if seen is None or stat.S_ISDIR(seen[0].st_mode):
                continue  # removed or made a folder since the open: look again
            info, text = seen
            if stat.S_ISLNK(info.st_mode):
                return info.st_uid, text
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(shown / name)) from None
    raise UnsafePath(shown / name, "keeps changing between a folder and something else")


def _make_folder(parent: int, name: str) -> int | None:
    """Make the folder ``name`` (mode 0700 exactly) and open it; None if something else took
    the name meanwhile (the caller looks again)."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent)
    except FileExistsError:
        return None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return None
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, DIR_MODE)  # mkdir's mode is cut by the umask: set it exactly
    return fd


def _look(parent: int, name: str) -> tuple[os.stat_result, str] | None:
    """The entry ``name`` itself, from a descriptor of it (so that the owner checked is that of the
    link followed): its ``fstat`` and, for a symbolic link, its text ("" otherwise); None if missing."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        return info, os.readlink("", dir_fd=fd) if stat.S_ISLNK(info.st_mode) else ""
    finally:
        os.close(fd)


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def open_folder(path: str | os.PathLike[str], private: bool = False, create: bool = False) -> Folder:
    """Open the folder ``path`` as a ``Folder``, walking to it one descriptor at a time (see the
    module for the rules): a folder the user chose, or with ``private`` this user's private folder.
    ``create``: missing folders are made (mode 0700); else ``FileNotFoundError`` when one is missing.
    ``UnsafePath`` for a link, a folder or an owner the rules refuse; ``NotADirectoryError`` when a
    part of the path is a file.
    """
    me = os.geteuid()
    absolute = _absolute(path)
    pending = [(part, False) for part in reversed(absolute.parts[1:])]  # a stack: the next part last
    if pending:
        pending[0] = (pending[0][0], True)  # the folder itself
    fd, current = _open_root(private, me)
    links = 0
    try:
        while pending:
            part, final = pending.pop()
            name = current.parent if part == ".." else current / part
            opened = os.open("..", _DIR_FLAGS, dir_fd=fd) if part == ".." else _child_folder(fd, part, current, create)
            if isinstance(opened, tuple):  # a symbolic link: its parts go on the stack
                links += 1
                target = _link_target(name, *opened, refuse=private and final, links=links, me=me)
                if target.is_absolute():
                    os.close(fd)
                    fd = -1
                    fd, current = _open_root(private, me)
                pending.extend((part, False) for part in reversed(target.parts[1 if target.is_absolute() else 0:]))
                continue
            try:
                _check_step(name, opened, private, final, me)
            except BaseException:
                os.close(opened)
                raise
            os.close(fd)
            fd, current = opened, name
        return Folder(fd, absolute)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _link_target(name: Path, owner: int, text: str, refuse: bool, links: int, me: int) -> Path:
    """Where the symbolic link ``name`` (of ``owner``) leads, if it may be followed: ``refuse`` it
    (a private folder itself), one of another user than root or ``me``, or the ``links``-th in a
    walk beyond ``_MAX_LINKS``: ``UnsafePath``."""
    if refuse:
        raise UnsafePath(name, f"is a symbolic link owned by {user_name(owner)}; a private folder is never "
                         f"reached through one")
    if owner not in (0, me):
        raise UnsafePath(name, f"is a symbolic link owned by {user_name(owner)}: not followed")
    if links > _MAX_LINKS:
        raise UnsafePath(name, "too many levels of symbolic links")
    return Path(text)


def _open_root(private: bool, me: int) -> tuple[int, Path]:
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check_step(Path("/"), fd, private, False, me)
    except BaseException:
        os.close(fd)
        raise
    return fd, Path("/")


def _check_step(path: Path, fd: int, private: bool, final: bool, me: int) -> None:
    if private and final:
        _check_own_folder(path, fd)
    elif private:
        _check_folder_on_the_way(path, os.fstat(fd), me)
    else:
        _check_chosen(path, os.fstat(fd))


# --- the path-based calls ---------------------------------------------------------------------------
def private_dir(path: str | os.PathLike[str], create: bool = True) -> Path:
    """``path`` as this user's private folder (mode 0700), created with its missing parents.

    Raises ``UnsafePath`` when a folder on the way is unsafe, when ``path`` is a symbolic link,
    not a folder, another user's, or writable by group or others; ``FileNotFoundError`` when it
    is missing and ``create`` is False.
    """
    try:
        open_folder(path, private=True, create=create).close()
    except NotADirectoryError as error:
        raise UnsafePath(error.filename, "is not a folder") from None
    return _absolute(path)


def make_dirs(path: str | os.PathLike[str]) -> Path:
    """Create the missing folders of ``path`` with mode 0700; existing ones are left as they are.

    For folders the user chose (logs, run directories): they may be shared, so a group-writable
    folder or another user's is accepted (the files written there have their own rules). But a
    neighbour must not choose where the files go: ``UnsafePath`` when a symbolic link on the way
    (``path`` included) belongs to another user than root or this one, or a folder on the way
    may be written by every user and has no sticky bit (anyone could plant such a link in it).
    """
    open_folder(path, create=True).close()
    return _absolute(path)


def _parent_and_name(path: str | os.PathLike[str]) -> tuple[Path, str]:
    absolute = _absolute(path)
    if absolute.name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    return absolute.parent, absolute.name


def open_private(path: str | os.PathLike[str], flags: int, private: bool = False) -> tuple[int, bool]:
    """Open a private file with ``flags`` (``O_CREAT`` allowed); return (fd, created). Its folder
    is reached as ``open_folder`` says (``private``: it must be this user's private folder); the
    file as ``Folder.open`` says."""
    parent, name = _parent_and_name(path)
    with open_folder(parent, private=private) as folder:
        return folder.open(name, flags)


def read_private(path: str | os.PathLike[str], limit: int = MAX_PRIVATE_FILE, private: bool = False) -> bytes:
    """The content of a private file (at most ``limit`` bytes); see ``open_private``."""
    parent, name = _parent_and_name(path)
    with open_folder(parent, private=private) as folder:
        return folder.read(name, limit)


def write_private(path: str | os.PathLike[str], data: bytes, private: bool = False) -> None:
    """Replace a private file atomically with ``data`` (a new 0600 file renamed over it); its
    folder as ``open_private`` says.

    ``OSError`` when the folder is gone, the disk is full (the error names ``path``) or ``path``
    is a folder; nothing is left behind then.
    """
    parent, name = _parent_and_name(path)
    with open_folder(parent, private=private) as folder:
        folder.write(name, data)


def entry_stat(path: str | os.PathLike[str], private: bool = False) -> os.stat_result | None:
    """The ``lstat`` of ``path`` reached as ``open_private`` says; None if it, or a folder on the
    way, is missing or refused."""
    parent, name = _parent_and_name(path)
    try:
        with open_folder(parent, private=private) as folder:
            return folder.lstat(name)
    except OSError:
        return None


def is_open_file(fd: int, path: str | os.PathLike[str], private: bool = False) -> bool:
    """Whether ``path`` (reached as ``open_private`` says) still names the file open as ``fd``."""
    return _same(entry_stat(path, private), os.fstat(fd))


def remove_private(path: str | os.PathLike[str], private: bool = False, open_as: int | None = None) -> bool:
    """Remove the entry ``path`` (never what a link points at), in its folder reached as
    ``open_private`` says; with ``open_as`` only while it is still the file open as that
    descriptor. Whether it was removed; ``OSError`` when it cannot be."""
    parent, name = _parent_and_name(path)
    try:
        folder = open_folder(parent, private=private)
    except (FileNotFoundError, NotADirectoryError):
        return False
    with folder:
        if open_as is not None and not _same(folder.lstat(name), os.fstat(open_as)):
            return False
        return folder.remove(name)


def _same(entry: os.stat_result | None, held: os.stat_result) -> bool:
    return entry is not None and (entry.st_dev, entry.st_ino) == (held.st_dev, held.st_ino)
