"""How apps and the manager find each other: small files in the private runtime directory.

Object names in /dev/shm are visible to every user, and any user may create a name there first.
So every object name ends in a random token (see ``names``), and the tokens are published only
in files of this user's private runtime directory (``<runtime>/<namespace>``, mode 0700, owner
checked, never reached through another user's link, every file opened relative to the checked
folder's descriptor: see ``private``):

- ``manager.json``: the live manager's pid, process start time and token (which name its inbox
  and heartbeat). Written atomically by the manager while it holds ``manager.lock``, *before* it
  creates the objects, so that a manager killed at any point leaves objects its successor finds.
- ``apps/<app>.claim``: an app's pid, start time and token. The app holds an exclusive ``flock``
  on it while it runs; the kernel releases the lock when the app dies, even by ``kill -9``.
  Taking that lock is how a new app takes the name (a second live app of that name is refused),
  and only whoever holds it may remove the app's objects. The claim names the token before the
  app creates its objects, so every object can be traced to its owner.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from drbalance.ipc import objects
from drbalance.ipc.names import IpcNames, check_app_name, check_token, new_token
from drbalance.ipc.private import (
    entry_stat,
    is_open_file,
    open_folder,
    open_private,
    private_dir,
    read_private,
    remove_private,
    write_private,
)

INFO_VERSION = 1
CLAIM_ATTEMPTS = 25
CLAIM_RETRY_SECONDS = 0.02


class DiscoveryError(ValueError):
    """A discovery or claim file that does not hold what it must; the text says which and why."""


class AppNameInUse(RuntimeError):
    """A live process already runs an app of this name in this namespace."""


MAX_PID = 2**31 - 1
"""The largest pid a discovery or claim file may name (``pid_t``: a larger one would make
``os.kill`` raise ``OverflowError`` in the reader)."""
MAX_TICKS = 2**63 - 1
"""The largest process start time (clock ticks) a discovery or claim file may hold."""


def _int(data: dict[str, Any], key: str, where: Path, minimum: int, maximum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise DiscoveryError(f"{where}: {key!r} must be an integer from {minimum} to {maximum}; got {_shown(value)}")
    return value


def _process(data: dict[str, Any], where: Path) -> tuple[int, int]:
    """The pid and start time (clock ticks) a file names its process by."""
    return _int(data, "pid", where, 1, MAX_PID), _int(data, "start_ticks", where, 0, MAX_TICKS)


def _seconds(data: dict[str, Any], key: str, where: Path) -> float:
    """``data[key]``: a wall-clock time in seconds, a finite number (a 400-digit integer would
    overflow ``float`` and crash the reader)."""
    value = data.get(key)
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise ValueError
    except (OverflowError, ValueError):
        raise DiscoveryError(f"{where}: {key!r} must be a finite number of seconds; got {_shown(value)}") from None
    return float(value)


def _shown(value: Any) -> str:
    """``repr(value)``, at most 60 characters (a file may hold anything)."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long for ``repr``
        return "a number too long to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _optional_token(data: dict[str, Any], key: str, where: Path) -> str:
    """``data[key]``: a valid token, or "" when absent (files written before the key existed)."""
    token = data.get(key, "")
    try:
        if token != "":
            check_token(token)
    except ValueError as error:
        raise DiscoveryError(f"{where}: {error}") from None
    return token


def _decode(raw: bytes, where: Path) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep, a number too long
        raise DiscoveryError(f"{where}: not JSON ({type(error).__name__}: {str(error)[:200]})") from None
    if not isinstance(data, dict) or data.get("version") != INFO_VERSION:
        raise DiscoveryError(f"{where}: not a version {INFO_VERSION} drbalance file")
    return data


# --- the manager -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManagerInfo:
    """The live manager as ``manager.json`` describes it (``started``: wall-clock seconds):
    ``token`` names its heartbeat, ``inbox_token`` its inbox. Two tokens, because a name is public
    the moment it exists (the inbox in /dev/mqueue where that is mounted): with one, a neighbour who
    saw the inbox appear could create the heartbeat's name first. ``inbox_token`` "" (files of
    older releases, which name one token): ``token``."""

    pid: int
    start_ticks: int
    token: str
    started: float
    inbox_token: str = ""

    @property
    def inbox(self) -> str:
        """The token of the manager's inbox."""
        return self.inbox_token or self.token

    def alive(self) -> bool:
        return objects.process_alive(self.pid, self.start_ticks)

    def encode(self) -> bytes:
        return json.dumps({"version": INFO_VERSION, **asdict(self)}).encode()

    @classmethod
    def decode(cls, raw: bytes, where: Path) -> ManagerInfo:
        data = _decode(raw, where)
        token = data.get("token")
        try:
            check_token(token)
        except ValueError as error:
            raise DiscoveryError(f"{where}: {error}") from None
        started = _seconds(data, "started", where)
        inbox_token = _optional_token(data, "inbox_token", where)
        pid, ticks = _process(data, where)
        return cls(pid, ticks, token, started, inbox_token)


def this_process(token: str, inbox_token: str = "") -> ManagerInfo:
    """A ``ManagerInfo`` for the calling process with ``token`` (its heartbeat's) and
    ``inbox_token`` (its inbox's; "" = ``token``)."""
    pid = os.getpid()
    return ManagerInfo(pid, objects.process_start_ticks(pid) or 0, check_token(token), time.time(),
                       check_token(inbox_token) if inbox_token else "")


def publish_manager(names: IpcNames, info: ManagerInfo) -> None:
    """Write ``manager.json`` (atomically). Call only while holding the namespace's manager lock."""
    names.private_runtime_dir()
    write_private(names.manager_info(), info.encode(), private=True)


def read_manager(names: IpcNames) -> ManagerInfo | None:
    """The manager ``manager.json`` names, or None when there is none.

    ``UnsafePath`` when the file is not this user's private file, ``DiscoveryError`` when it is
    malformed. Whether that manager still runs is for the caller to check (``info.alive()``).
    """
    path = names.manager_info()
    try:
        raw = read_private(path, limit=4096, private=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return ManagerInfo.decode(raw, path)


def withdraw_manager(names: IpcNames, token: str) -> None:
    """Remove ``manager.json`` if it still names ``token`` (a successor's is left alone)."""
    try:
        current = read_manager(names)
    except (OSError, DiscoveryError):
        return
    if current is not None and current.token == token:
        try:
            remove_private(names.manager_info(), private=True)
        except OSError:
            pass


# --- apps --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClaimInfo:
    """Who holds an app name: pid, process start time, the token of its record and that of its
    signal semaphore (``claimed``: wall s). Two tokens, because a name in /dev/shm is public the
    moment it exists: with one, a neighbour who saw the record appear could create the semaphore's
    name before the app did. ``signal_token`` "" (claims of older releases, which name one token):
    ``token``."""

    app: str
    pid: int
    start_ticks: int
    token: str
    claimed: float
    signal_token: str = ""

    @property
    def signal(self) -> str:
        """The token of the app's signal semaphore."""
        return self.signal_token or self.token

    def alive(self) -> bool:
        return objects.process_alive(self.pid, self.start_ticks)

    def encode(self) -> bytes:
        return json.dumps({"version": INFO_VERSION, **asdict(self)}).encode()

    @classmethod
    def decode(cls, raw: bytes, where: Path) -> ClaimInfo:
        data = _decode(raw, where)
        try:
            app, token = check_app_name(data.get("app")), check_token(data.get("token"))
        except ValueError as error:
            raise DiscoveryError(f"{where}: {error}") from None
        claimed = _seconds(data, "claimed", where)
        signal_token = _optional_token(data, "signal_token", where)
        pid, ticks = _process(data, where)
        return cls(app, pid, ticks, token, claimed, signal_token)


def remove_app_objects(names: IpcNames, app: str, token: str, signal_token: str | None = None) -> bool:
    """Unlink the record of ``app`` made with ``token`` and its signal made with ``signal_token``
    (default: ``token``); True if anything was removed."""
    removed = objects.unlink_shared_memory(names.app_record(app, token))
    return objects.unlink_semaphore(names.app_signal(app, signal_token or token)) or removed


def _read_fd(fd: int, where: Path) -> ClaimInfo | None:
    """The claim in an open claim file; None when empty (being created) or malformed."""
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return None
    if not raw:
        return None
    try:
        return ClaimInfo.decode(raw, where)
    except DiscoveryError:
        return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether the claim ``path`` still names the file open as ``fd`` (not removed or replaced meanwhile)."""
    return is_open_file(fd, path, private=True)


class AppClaim:
    """This process's claim on an app name in a namespace (see the module docstring)."""

    def __init__(self, names: IpcNames, app: str, fd: int, info: ClaimInfo) -> None:
        self.names = names
        self.app = app
        self.path = names.app_claim(app)
        self.fd: int | None = fd
        self.info = info
        self.previous: ClaimInfo | None = None  # the dead holder whose leftovers this claim removed

    @property
    def token(self) -> str:
        return self.info.token

    @property
    def signal_token(self) -> str:
        return self.info.signal

    @classmethod
    def take(cls, names: IpcNames, app: str, attempts: int = CLAIM_ATTEMPTS) -> AppClaim:
        """Take the name ``app``: lock its claim, remove a dead holder's objects, pick a new token.

        ``AppNameInUse`` when a live process holds it. ``UnsafePath`` when the runtime
        directory is not safe, ``OSError`` when it cannot be written.
        """
        check_app_name(app)
        names.private_runtime_dir()
        private_dir(names.claims_dir())
        path = names.app_claim(app)
        holder: ClaimInfo | None = None
        for _ in range(max(1, attempts)):
            fd, _created = open_private(path, os.O_RDWR | os.O_CREAT, private=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_fd(fd, path)
                os.close(fd)
                if holder is not None and holder.alive():
                    break
                time.sleep(CLAIM_RETRY_SECONDS)  # being started, or a dead holder being collected right now
                continue
            if not _same_file(fd, path):  # collected between our open and our lock: use the new file
                os.close(fd)
                continue
            try:
                claim = cls(names, app, fd, _placeholder(app))
                claim.previous = _read_fd(fd, path)
                pid = os.getpid()
                claim._write(ClaimInfo(app, pid, objects.process_start_ticks(pid) or 0, new_token(), time.time(),
                                       new_token()))
                if claim.previous is not None:  # its owner is dead: we hold the lock
                    remove_app_objects(names, app, claim.previous.token, claim.previous.signal)
            except BaseException:
                os.close(fd)
                raise
            return claim
        if holder is not None and holder.pid == os.getpid():
            raise AppNameInUse(
                f"this process already runs an app named {app!r} in namespace {names.namespace!r}: close its "
                f"session first (or choose another name)"
            )
        if holder is not None and holder.alive():
            raise AppNameInUse(
                f"an app named {app!r} is already running as pid {holder.pid} in namespace "
                f"{names.namespace!r}; choose another name or namespace"
            )
        raise AppNameInUse(
            f"an app named {app!r} is being started by another process in namespace {names.namespace!r} "
            f"(its claim {path} stayed locked); if no such job runs, a process it forked may still hold it"
        )

    def _write(self, info: ClaimInfo) -> None:
        _write_fd(self.fd, info)
        self.info = info

    def move_to(self, token: str, signal_token: str) -> None:
        """Name ``token`` and ``signal_token`` in the claim from now on (this process's record and
        signal are made again under them). ``OSError`` as writing the file gives it; the claim then
        names the old tokens still."""
        self._write(ClaimInfo(self.app, self.info.pid, self.info.start_ticks, check_token(token), time.time(),
                              check_token(signal_token)))

    def held(self) -> bool:
        """Whether the claim file is still in place (the runtime directory may have been removed)."""
        return self.fd is not None and _same_file(self.fd, self.path)

    def renew(self) -> bool:
        """Put the claim file back if it was removed; False if another process took the name meanwhile."""
        if self.fd is None:
            return False
        if self.held():
            return True
        try:
            self.names.private_runtime_dir()
            private_dir(self.names.claims_dir())
            fd, _ = open_private(self.path, os.O_RDWR | os.O_CREAT, private=True)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if not _same_file(fd, self.path) or _read_fd(fd, self.path) is not None:
            os.close(fd)  # someone else's claim (or it moved again): keep our old lock, try later
            return False
        try:
            _write_fd(fd, self.info)
        except OSError:  # e.g. a full disk: an empty claim would hide the job for good; try again later
            try:
                remove_private(self.path, private=True, open_as=fd)  # still locked by us: nobody else uses it
            except OSError:
                pass
            os.close(fd)
            return False
        old, self.fd = self.fd, fd
        os.close(old)
        return True

    def release(self) -> None:
        """Give the name back: remove the claim file (while still holding it) and unlock."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            remove_private(self.path, private=True, open_as=fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def _placeholder(app: str) -> ClaimInfo:
    return ClaimInfo(app, os.getpid(), 0, "0" * 16, 0.0)


# --- the manager's side of the claims ---------------------------------------------------------
def claimed_apps(names: IpcNames) -> list[str]:
    """Names of the apps with a claim file (held or left over by a dead app)."""
    try:
        with open_folder(names.claims_dir(), private=True) as claims:
            entries = os.listdir(claims.fd)
    except OSError:
        return []
    apps = []
    for entry in entries:
        if entry.endswith(".claim"):
            try:
                apps.append(check_app_name(entry[: -len(".claim")]))
            except ValueError:
                continue
    return sorted(apps)


def read_claim(names: IpcNames, app: str) -> ClaimInfo | None:
    """The claim of ``app`` (None if there is none, or it is still empty). ``DiscoveryError`` if
    malformed, ``UnsafePath`` if it is not this user's private file."""
    path = names.app_claim(app)
    try:
        raw = read_private(path, limit=4096, private=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not raw:
        return None
    return ClaimInfo.decode(raw, path)


def claim_age(names: IpcNames, app: str) -> float:
    """Seconds since ``app``'s claim file last changed (infinity if it is missing)."""
    info = entry_stat(names.app_claim(app), private=True)
    return float("inf") if info is None else time.time() - info.st_mtime


def collect_claim(names: IpcNames, app: str, expected_token: str | None = None) -> ClaimInfo | None:
    """Remove a dead app's claim and objects; return the claim removed (None if nothing was).

    Succeeds only when nobody holds the claim's lock (its holder is dead), and, if
    ``expected_token`` is given, when the claim still names that token. Never blocks.
    """
    path = names.app_claim(app)
    try:
        fd, _ = open_private(path, os.O_RDWR, private=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # held: alive (or its forked child still holds it)
            raise
        if not _same_file(fd, path):
            return None
        info = _read_fd(fd, path)
        if info is not None:
            if expected_token is not None and info.token != expected_token:
                return None
            remove_app_objects(names, app, info.token, info.signal)
        remove_private(path, private=True, open_as=fd)
        return info or _placeholder(app)
    finally:
        os.close(fd)


def _write_fd(fd: int, info: ClaimInfo) -> None:
    """Replace the claim file's content with ``info`` (OSError as the file system gives it; a
    short write, as at a file size limit, is finished or fails: never half a claim)."""
    data = info.encode()
    os.ftruncate(fd, 0)
    written = 0
    while written < len(data):
        count = os.pwrite(fd, data[written:], written)
        if count <= 0:
            raise OSError(errno.ENOSPC, "no room to write the claim")
        written += count
