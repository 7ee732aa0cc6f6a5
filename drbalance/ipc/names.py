"""Names of the POSIX IPC objects, namespaced per user and per drbalance namespace.

Every object name starts with ``/drb.<uid>.<namespace>.`` so two users, or two managers in two
namespaces, never meet; the objects are also created with mode 0600 (see ``objects``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from drbalance import env

APP_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,47}$")
SHM_DIR = Path("/dev/shm")


def check_app_name(name: str) -> str:
    """Validate an app name: 1-48 letters, digits, ``_ . -``, not starting with ``.`` or ``-``."""
    if not isinstance(name, str) or not APP_NAME_PATTERN.match(name):
        raise ValueError(
            f"app name {name!r} is not valid: use 1-48 letters, digits, '_', '.' or '-', "
            f"starting with a letter, digit or '_'"
        )
    return name


def _listed(marker: str) -> list[str]:
    """What follows ``marker`` in the names of /dev/shm entries that start with it."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(entry[len(marker):] for entry in entries if entry.startswith(marker))


@dataclass(frozen=True)
class IpcNames:
    """The names of one namespace's objects for one user."""

    namespace: str
    uid: int

    @classmethod
    def current(cls, namespace: str | None = None) -> IpcNames:
        """Names for this user in ``namespace`` (default: ``DRBALANCE_NAMESPACE``)."""
        chosen = namespace if namespace is not None else env.namespace()
        if not env.NAMESPACE_PATTERN.match(chosen):
            raise ValueError(f"namespace {chosen!r} is not valid: use 1-32 letters, digits, '_' or '-'")
        return cls(chosen, os.getuid())

    @property
    def prefix(self) -> str:
        return f"/drb.{self.uid}.{self.namespace}."

    def inbox(self) -> str:
        """The manager's single message queue of notices."""
        return self.prefix + "inbox"

    def manager_record(self) -> str:
        """Shared memory with the manager's pid and heartbeat."""
        return self.prefix + "manager"

    def app_record(self, app: str) -> str:
        """Shared memory with one app's status (written by the app) and command (by the manager)."""
        return self.prefix + "app." + check_app_name(app)

    def app_signal(self, app: str) -> str:
        """Semaphore the manager posts when it has written a new command for the app."""
        return self.prefix + "sig." + check_app_name(app)

    def emulated_gpu(self, index: int) -> str:
        """Shared memory with the busy-time accounting of emulated GPU ``index``."""
        return self.prefix + f"emu.{index}"

    def emulated_waiters(self, index: int) -> str:
        """Semaphore counting the jobs waiting for emulated GPU ``index``."""
        return self.prefix + f"emuw.{index}"

    def listed_apps(self) -> list[str]:
        """Names of the apps whose records exist now (Linux lists shared memory in /dev/shm)."""
        return _listed(self.prefix[1:] + "app.")

    def listed_signals(self) -> list[str]:
        """Names of the apps whose signal semaphores exist now (``/dev/shm/sem.<name>``)."""
        return _listed("sem." + self.prefix[1:] + "sig.")

    def runtime_dir(self) -> Path:
        """This namespace's folder for the manager's lock and status files."""
        return env.runtime_dir() / self.namespace

    def manager_lock(self) -> Path:
        return self.runtime_dir() / "manager.lock"

    def manager_status(self) -> Path:
        return self.runtime_dir() / "status.json"

    def emulated_lock(self, index: int) -> Path:
        return self.runtime_dir() / f"emu.{index}.lock"
