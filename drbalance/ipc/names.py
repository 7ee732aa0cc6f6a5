"""Names of the POSIX IPC objects and of the private files, per user and per drbalance namespace.

Every object name starts with ``/drb.<uid>.<namespace>.`` so two users, or two managers in two
namespaces, never meet. Names in /dev/shm are visible to every user, and any user may create a
name there first; so every object of a manager or an app also ends in a random *token*, chosen
when the object is created and published only in the private runtime directory (see
``discovery``). Nobody can create such a name before its owner does.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from drbalance import env
from drbalance.ipc.objects import SHM_DIR, listed_owner
from drbalance.ipc.private import private_dir, read_private

APP_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,47}$")
TOKEN_PATTERN = re.compile(r"^[0-9a-f]{16}$")
_EMU_TAIL = re.compile(r"^[0-9]+(\.[0-9a-f]{16})?$")


def check_app_name(name: str) -> str:
    """Validate an app name: 1-48 letters, digits, ``_ . - @``, not starting with ``.``, ``-`` or ``@``
    (``@`` joins a job spanning nodes and a node: ``<job>@<node>``)."""
    if not isinstance(name, str) or not APP_NAME_PATTERN.match(name):
        raise ValueError(
            f"app name {name!r} is not valid: use 1-48 letters, digits, '_', '.', '-' or '@', "
            f"starting with a letter, digit or '_'"
        )
    return name


def check_token(token: str) -> str:
    if not isinstance(token, str) or not TOKEN_PATTERN.match(token):
        raise ValueError(f"object token {token!r} is not 16 lower-case hex digits")
    return token


def new_token() -> str:
    """A fresh random token (64 bits) for the names of new objects."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class ListedObject:
    """An entry of /dev/shm under a namespace's prefix: its kind, app (if any), token and owner."""

    entry: str  # the /dev/shm file name
    kind: str  # "app", "sig", "manager", "emu", "emuw", or "" when the rest does not parse
    app: str | None
    token: str | None
    owner: int


@dataclass(frozen=True)
class IpcNames:
    """The names of one namespace's objects for one user."""

    namespace: str
    uid: int

    @classmethod
    def current(cls, namespace: str | None = None) -> IpcNames:
        """Names for this user in ``namespace`` (default: ``DRBALANCE_NAMESPACE``)."""
        chosen = namespace if namespace is not None else env.namespace()
        if not isinstance(chosen, str) or not env.NAMESPACE_PATTERN.match(chosen):
            raise ValueError(f"namespace {chosen!r} is not valid: use 1-32 letters, digits, '_' or '-'")
        return cls(chosen, os.getuid())

    @property
    def prefix(self) -> str:
        return f"/drb.{self.uid}.{self.namespace}."

    # --- objects --------------------------------------------------------------------------------
    def inbox(self, token: str) -> str:
        """The manager's single message queue of notices."""
        return self.prefix + "inbox." + check_token(token)

    def manager_record(self, token: str) -> str:
        """Shared memory with the manager's pid and heartbeat."""
        return self.prefix + "manager." + check_token(token)

    def app_record(self, app: str, token: str) -> str:
        """Shared memory with one app's status (written by the app) and command (by the manager)."""
        return self.prefix + "app." + check_app_name(app) + "." + check_token(token)

    def app_signal(self, app: str, token: str) -> str:
        """Semaphore the manager posts when it has written a new command for the app."""
        return self.prefix + "sig." + check_app_name(app) + "." + check_token(token)

    def emulated_gpu(self, index: int) -> str:
        """Shared memory with the busy-time accounting of emulated GPU ``index``:
        ``emu.<index>.<token>``, the token kept in the GPU's lock file in the private runtime
        directory (``assign_emulated_token``). Where that file holds none (the GPU was never opened,
        or was removed with its files): ``emu.<index>``, the name older releases used, which only a
        cleanup looks for."""
        token = _read_token(self.emulated_lock(index))
        return self.prefix + f"emu.{index}" + (f".{token}" if token is not None else "")

    def emulated_waiters(self, index: int) -> str:
        """Semaphore counting the jobs waiting for emulated GPU ``index``."""
        return self.prefix + f"emuw.{index}"

    # --- what /dev/shm lists -----------------------------------------------------------------
    def listed(self) -> list[ListedObject]:
        """Every /dev/shm entry under this namespace's prefix (segments and semaphores), any owner."""
        return sorted((listed_object(name, rest, owner) for name, rest, owner in self.entries()),
                      key=lambda item: item.entry)

    def entries(self) -> Iterator[tuple[str, str, int]]:
        """Each /dev/shm entry under this namespace's prefix, unparsed and in no order: its file
        name, the name past the prefix, and its owner's uid (entries gone meanwhile are skipped)."""
        stem = self.prefix[1:]
        semaphore = "sem." + stem
        try:
            scan = os.scandir(SHM_DIR)
        except OSError:
            return
        with scan:
            for entry in _until_error(scan):
                name = entry.name
                if name.startswith(stem):
                    rest = name[len(stem):]
                elif name.startswith(semaphore):
                    rest = name[len(semaphore):]
                else:
                    continue
                try:
                    owner = entry.stat(follow_symlinks=False).st_uid
                except OSError:
                    continue
                yield name, rest, owner

    def listed_apps(self) -> list[str]:
        """Names of the apps with a record of this user in /dev/shm now."""
        me = os.geteuid()
        return sorted({o.app for o in self.listed() if o.kind == "app" and o.owner == me and o.app})

    def listed_signals(self) -> list[str]:
        """Names of the apps with a signal semaphore of this user in /dev/shm now."""
        me = os.geteuid()
        return sorted({o.app for o in self.listed() if o.kind == "sig" and o.owner == me and o.app})

    # --- the private runtime directory --------------------------------------------------------
    def runtime_dir(self) -> Path:
        """This namespace's folder for the manager's lock and files and the apps' claims."""
        return env.runtime_dir() / self.namespace

    def private_runtime_dir(self) -> Path:
        """``runtime_dir()``, created if missing and checked (``UnsafePath`` when it is not safe)."""
        private_dir(env.runtime_dir())
        return private_dir(self.runtime_dir())

    def manager_lock(self) -> Path:
        return self.runtime_dir() / "manager.lock"

    def manager_status(self) -> Path:
        return self.runtime_dir() / "status.json"

    def manager_info(self) -> Path:
        """Where the live manager publishes its pid and token (see ``discovery``)."""
        return self.runtime_dir() / "manager.json"

    def claims_dir(self) -> Path:
        return self.runtime_dir() / "apps"

    def app_claim(self, app: str) -> Path:
        """The file an app holds locked while it runs under this name (see ``discovery``)."""
        return self.claims_dir() / f"{check_app_name(app)}.claim"

    def emulated_lock(self, index: int) -> Path:
        return self.runtime_dir() / f"emu.{index}.lock"

    def emulated_wait_lock(self, index: int) -> Path:
        """The file on which jobs waiting for emulated GPU ``index`` hold a shared lock."""
        return self.runtime_dir() / f"emu.{index}.wait"


def _until_error(scan: Iterator[os.DirEntry]) -> Iterator[os.DirEntry]:
    """The entries of a directory scan until reading the directory fails (as if it ended there)."""
    while True:
        try:
            entry = next(scan)
        except (StopIteration, OSError):
            return
        yield entry


def listed_object(entry: str, rest: str, owner: int) -> ListedObject:
    """One of ``IpcNames.entries()`` (file name, the name past the prefix, owner) as a ``ListedObject``."""
    kind, _, tail = rest.partition(".")
    if kind in ("app", "sig"):
        app, _, token = tail.rpartition(".")
        if APP_NAME_PATTERN.match(app) and TOKEN_PATTERN.match(token):
            return ListedObject(entry, kind, app, token, owner)
    elif kind == "manager" and TOKEN_PATTERN.match(tail):
        return ListedObject(entry, kind, None, tail, owner)
    elif kind == "emu" and _EMU_TAIL.match(tail):
        index, _, token = tail.partition(".")
        return ListedObject(entry, kind, None, token or None, owner)
    elif kind == "emuw" and tail.isdigit():
        return ListedObject(entry, kind, None, None, owner)
    return ListedObject(entry, "", None, None, owner)


def _read_token(path: Path) -> str | None:
    """The token in an emulated GPU's lock file, or None (no file, no token, not a private file)."""
    try:
        raw = read_private(path, limit=64, private=True)
    except OSError:
        return None
    token = raw.decode("ascii", "replace").strip()
    return token if TOKEN_PATTERN.match(token) else None


def assign_emulated_token(names: IpcNames, index: int, lock_fd: int) -> str:
    """The name of emulated GPU ``index``'s segment, with the token its lock file (this user's
    private file, open as ``lock_fd``) holds; a new token written there first when it holds none,
    or when the name it gives is another user's object in /dev/shm.

    Any user sees a segment's name in /dev/shm and may create a name there first: without a token
    a neighbour's ``emu.<index>`` would stop every job on that GPU and a manager reading it. The token
    is chosen when the GPU's files are made and is known only from the private lock file; a name
    that another user took after its segment was removed (by RemoveIPC: the lock file stays) is
    never used again. Only a new token is written under the file's exclusive ``flock`` (the GPU's
    turn lock, so that the processes opening the GPU agree on one); a usable one is just read, so
    opening a GPU never waits for another job's turn on it.
    """
    name = _usable_emulated_name(names, index, lock_fd)
    if name is not None:
        return name
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        name = _usable_emulated_name(names, index, lock_fd)  # another process may have chosen one meanwhile
        if name is not None:
            return name
        token = new_token()
        os.pwrite(lock_fd, token.encode("ascii"), 0)  # then cut what an older content had beyond it
        os.ftruncate(lock_fd, len(token))
        return names.prefix + f"emu.{index}.{token}"
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


def _usable_emulated_name(names: IpcNames, index: int, lock_fd: int) -> str | None:
    """The segment name the token in the lock file gives, unless it has none or another user's
    object holds that name."""
    token = os.pread(lock_fd, 64, 0).decode("ascii", "replace").strip()
    if not TOKEN_PATTERN.match(token):
        return None
    name = names.prefix + f"emu.{index}.{token}"
    return name if listed_owner(name) in (None, os.geteuid()) else None
