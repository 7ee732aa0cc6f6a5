"""Shared fixtures: every test that touches IPC gets its own namespace and folders."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drbalance.ipc import objects
from drbalance.ipc.names import SHM_DIR, IpcNames

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
_counter = itertools.count()


def leftovers(names: IpcNames) -> list[str]:
    """Entries in /dev/shm that belong to this namespace (segments and semaphores)."""
    stem = names.prefix[1:]
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(stem) or e.startswith("sem." + stem))


def remove_leftovers(names: IpcNames) -> None:
    stem = names.prefix[1:]
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(stem):
            objects.unlink_shared_memory("/" + entry)
        elif entry.startswith("sem." + stem):
            objects.unlink_semaphore("/" + entry[4:])
    objects.unlink_queue(names.inbox())


@pytest.fixture
def ipc_env(monkeypatch, tmp_path) -> IpcNames:
    """A private namespace, runtime dir and log dir; everything left in it is removed after."""
    namespace = f"t{os.getpid()}x{next(_counter)}"
    monkeypatch.setenv("DRBALANCE_NAMESPACE", namespace)
    monkeypatch.setenv("DRBALANCE_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("DRBALANCE_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("DRBALANCE_PROFILES", str(tmp_path / "profiles.json"))
    monkeypatch.delenv("DRBALANCE_PROFILE_OUTPUT", raising=False)
    monkeypatch.delenv("DRBALANCE_NO_MANAGER", raising=False)
    names = IpcNames.current(namespace)
    yield names
    remove_leftovers(names)


def python_process(module: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start ``python -m module args`` from the repository root with the current environment."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = str(ROOT) + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env["PYTHONUNBUFFERED"] = "1"
    if env:
        child_env.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=child_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )
