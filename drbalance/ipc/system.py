"""Where a machine's system manager lives: one folder per namespace that every user's jobs find.

A *system manager* (``drbalance-manager --system``) is started once per machine by the
administrator and balances every user's jobs together. Its folder is
``<system dir>/<namespace>/`` (system dir: ``DRBALANCE_SYSTEM_DIR``, default ``/run/drbalance``):

- ``manager.lock``: its ``flock`` (one system manager per namespace);
- ``manager.sock``: the Unix socket every user's jobs connect to (``drbalance.ipc.wire``);
- ``emulated.json`` and ``emu.<i>.lock`` / ``emu.<i>.wait``: the machine's emulated GPUs,
  when the system manager emulates them (``drbalance.emu``).

**Who may own it.** The system dir and the namespace folder belong to one *system owner*: root,
or a service user to whom root gave the folder (systemd's ``RuntimeDirectory=`` in
``/run``). A job trusts the folder only if only root could have chosen that owner: every folder
on the way belongs to root, no link on the way belongs to anyone else, nothing on the way may be
written by others unless sticky (as ``/tmp``), and the system dir itself belongs to root, or to
another user while its parent belongs to root and no one else may write that parent. The
namespace folder belongs to the system owner and nobody else may write it. So a user cannot
plant a system manager: ``/run`` is root's. The socket's peer is checked too, by the kernel
(``SO_PEERCRED``): its uid must be the system owner's or root's.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from drbalance import env
from drbalance.ipc.private import UnsafePath, user_name

SOCKET_NAME = "manager.sock"
LOCK_NAME = "manager.lock"
EMULATED_NAME = "emulated.json"
FOLDER_MODE = 0o755  # every user may look up the socket; only the system owner may write
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 16


@dataclass(frozen=True)
class SystemPlace:
    """The system manager's folder for one namespace, checked as the module says.

    ``owner``: the system owner's uid (root or a service user). Paths are for messages and for
    ``connect``: the folder's entries can be changed only by their owner, never by another user.
    """

    root: Path
    namespace: str
    owner: int

    @property
    def folder(self) -> Path:
        return self.root / self.namespace

    @property
    def socket(self) -> Path:
        return self.folder / SOCKET_NAME

    @property
    def lock(self) -> Path:
        return self.folder / LOCK_NAME

    @property
    def emulated(self) -> Path:
        """The machine's emulated GPUs, as the system manager publishes them (absent: none)."""
        return self.folder / EMULATED_NAME

    def emulated_lock(self, index: int) -> Path:
        return self.folder / f"emu.{index}.lock"

    def emulated_wait_lock(self, index: int) -> Path:
        return self.folder / f"emu.{index}.wait"

    def shm_prefix(self) -> str:
        """The prefix of the names of this place's objects in /dev/shm (emulated GPUs)."""
        return f"/drb.machine.{self.namespace}."

    def open_folder(self) -> int:
        """A descriptor of the namespace folder, walked to and checked again (``UnsafePath``,
        ``FileNotFoundError``): read its files relative to it."""
        fd, owner = _walk(self.folder, self.namespace)
        if owner != self.owner:
            os.close(fd)
            raise UnsafePath(self.folder, f"now belongs to {user_name(owner)}, not to {user_name(self.owner)}")
        return fd

    def trusted_entry(self, name: str, kind: int = stat.S_IFREG) -> os.stat_result:
        """The ``lstat`` of the entry ``name`` in the folder, which must be of ``kind`` (a
        ``stat.S_IF*``) and the system owner's (``UnsafePath``; ``FileNotFoundError`` if missing)."""
        fd = self.open_folder()
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        if stat.S_IFMT(info.st_mode) != kind:
            raise UnsafePath(self.folder / name, "is not what the system manager makes there (a link, or another "
                             "kind of file)")
        if info.st_uid not in (self.owner, 0):
            raise UnsafePath(self.folder / name, f"belongs to {user_name(info.st_uid)}, not to the system "
                             f"manager's {user_name(self.owner)}")
        return info


def system_root() -> Path:
    """``DRBALANCE_SYSTEM_DIR`` (an absolute path), default ``/run/drbalance``."""
    return env.system_dir()


def find(namespace: str | None = None) -> SystemPlace | None:
    """The system manager's folder of ``namespace`` (default ``DRBALANCE_NAMESPACE``) if it exists;
    None when it does not (no system manager was ever started there). ``UnsafePath`` when it exists
    but a job must not trust it (the text says why)."""
    chosen = namespace if namespace is not None else env.namespace()
    folder = system_root() / chosen
    try:
        fd, owner = _walk(folder, chosen)
    except (FileNotFoundError, NotADirectoryError):
        return None
    os.close(fd)
    return SystemPlace(system_root(), chosen, owner)


def create(namespace: str | None = None) -> SystemPlace:
    """The system manager's own folder of ``namespace``, made (mode 0755) where missing, for the
    calling user as system owner. ``UnsafePath`` when it, or the system dir, exists and belongs to
    another user, or the way there is not root's; ``PermissionError`` when the system dir cannot be
    made (a service user needs root to make it first, as systemd's ``RuntimeDirectory=`` does)."""
    chosen = namespace if namespace is not None else env.namespace()
    root = system_root()
    me = os.geteuid()
    for folder in (root, root / chosen):
        try:
            os.mkdir(folder, FOLDER_MODE)
        except FileExistsError:
            continue
        info = os.lstat(folder)
        if info.st_uid == me and stat.S_ISDIR(info.st_mode):
            os.chmod(folder, FOLDER_MODE, follow_symlinks=False)  # mkdir's mode is cut by the umask
    fd, owner = _walk(root / chosen, chosen)
    os.close(fd)
    if owner != me:
        raise UnsafePath(root / chosen, f"belongs to {user_name(owner)}: a system manager runs as the owner of its "
                         f"folder ({user_name(me)} is not)")
    return SystemPlace(root, chosen, owner)


# --- the walk ------------------------------------------------------------------------------------
def _walk(folder: Path, namespace: str) -> tuple[int, int]:
    """Open ``folder`` (the system dir / namespace) one descriptor at a time and check it as the
    module says; (descriptor, system owner)."""
    if not folder.is_absolute():
        raise UnsafePath(folder, "is not an absolute path")
    parts = list(folder.parts[1:])
    if len(parts) < 2 or parts[-1] != namespace:
        raise UnsafePath(folder, "is not a system dir and a namespace below it")
    fd = os.open("/", _DIR_FLAGS)
    current = Path("/")
    owners: list[tuple[Path, os.stat_result]] = [(current, os.fstat(fd))]
    pending = list(reversed(parts))
    links = 0
    try:
        while pending:
            part = pending.pop()
            if part == "..":
                step = os.open("..", _DIR_FLAGS, dir_fd=fd)
                name = current.parent
            else:
                name = current / part
                step = _open_child(fd, part, name)
            if isinstance(step, str):  # a root-owned symbolic link: its parts go on the stack
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafePath(name, "too many levels of symbolic links")
                target = Path(step)
                if target.is_absolute():
                    os.close(fd)
                    fd = -1
                    fd, current = os.open("/", _DIR_FLAGS), Path("/")
                pending.extend(reversed(target.parts[1 if target.is_absolute() else 0:]))
                continue
            os.close(fd)
            fd, current = step, name
            owners.append((current, os.fstat(fd)))
        return fd, _check_owners(owners)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _open_child(parent: int, name: str, shown: Path) -> int | str:
    """The folder ``name`` below ``parent`` (a descriptor), or the text of the symbolic link it
    is when root owns that link (``UnsafePath`` for anyone else's)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(shown)) from None
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(shown))
    if info.st_uid != 0:
        raise UnsafePath(shown, f"is a symbolic link owned by {user_name(info.st_uid)}: not followed")
    return os.readlink(name, dir_fd=parent)


def _check_owners(walked: list[tuple[Path, os.stat_result]]) -> int:
    """The system owner of a walk ``/ ... system dir / namespace`` (each with its ``fstat``), or
    ``UnsafePath`` naming the first folder that breaks the rules."""
    *way, (root_path, root), (folder_path, folder) = walked
    for path, info in way:
        if info.st_uid != 0:
            raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, who could replace the system manager's "
                             f"folder below it")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise UnsafePath(path, f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}) and not sticky")
    owner = root.st_uid
    if owner != 0:
        parent_path, parent = way[-1]
        if stat.S_IMODE(parent.st_mode) & 0o022:  # sticky or not: anyone may have made it there
            raise UnsafePath(root_path, f"belongs to {user_name(owner)} in {parent_path}, where anyone may make "
                             f"folders: only a system dir of root, or one in a folder only root may write, is trusted")
    for path, info in ((root_path, root), (folder_path, folder)):
        if info.st_uid != owner:
            raise UnsafePath(path, f"belongs to {user_name(info.st_uid)}, not to the system dir's owner "
                             f"{user_name(owner)}")
        if stat.S_IMODE(info.st_mode) & 0o022:
            raise UnsafePath(path, f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")
    return owner
