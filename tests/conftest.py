"""Shared fixtures: every test that touches IPC gets its own namespace and folders.

Busy-machine rules for this suite (see docs/testing.md): every test has a time limit
(pytest-timeout, pyproject.toml); hypothesis runs under the ``drbalance`` profile below, whose
deadline is deliberate; tests that involve timing assert order and eventual outcome with
generous bounds (``wait_for``), never tight wall-clock windows.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings

from drbalance.ipc import discovery, objects
from drbalance.ipc.names import SHM_DIR, IpcNames

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
_counter = itertools.count()
T = TypeVar("T")

# Each example of our property tests takes milliseconds. On a loaded 2-core CI machine one can
# stall for a second when the scheduler runs something else; a deadline that short would make the
# outcome depend on the machine's load. 5 s still catches a real slowdown (an accidental
# quadratic loop, a sleep), and pytest-timeout catches a hang. too_slow is suppressed for the same
# reason: data generation time is load, not a defect.
settings.register_profile("drbalance", deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "drbalance"))


# Time limits (pytest-timeout): pyproject.toml sets the default for every test. Tests that run a
# whole scenario (real training processes for minutes) get a longer one here unless they set
# their own with @pytest.mark.timeout(...). On a loaded 2-core machine the end-to-end demo takes
# about 5 minutes.
LONG_TEST_LIMITS = {"test_demo.py": 900}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        limit = LONG_TEST_LIMITS.get(item.path.name)
        if limit is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


def computed_once(tmp_path_factory: pytest.TempPathFactory, key: str, compute: Callable[[], T]) -> T:
    """``compute()``'s result, computed once per pytest run however many xdist workers ask for it:
    the first to ask computes it while holding a lock file and pickles it into the run's temporary
    folder (the workers' common parent); the others wait on the lock and read it. For a module
    fixture that simulates for tens of seconds: per worker, a module fixture is computed again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>/, above every worker's popen-gw<i>
    path = root / f"{key}.pickle"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an exception
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        written = path.with_name(path.name + ".part")
        written.write_bytes(pickle.dumps(value))
        os.replace(written, path)  # whole or absent
        return value


def leftovers(names: IpcNames) -> list[str]:
    """Entries in /dev/shm that belong to this namespace (segments and semaphores)."""
    stem = names.prefix[1:]
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(stem) or e.startswith("sem." + stem))


def remove_leftovers(names: IpcNames) -> None:
    stem = names.prefix[1:]
    try:
        info = discovery.read_manager(names)
    except (OSError, discovery.DiscoveryError):
        info = None
    if info is not None:
        objects.unlink_queue(names.inbox(info.inbox))
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(stem):
            objects.unlink_shared_memory("/" + entry)
        elif entry.startswith("sem." + stem):
            objects.unlink_semaphore("/" + entry[4:])


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true; AssertionError after ``timeout`` seconds.

    The bound is generous on purpose: it is how long a busy machine may take, not how long the
    thing should take. Tests assert the outcome (and its order), not the time.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


@pytest.fixture
def ipc_env(monkeypatch, tmp_path) -> IpcNames:
    """A private namespace, runtime dir and log dir; everything left in it is removed after."""
    namespace = f"t{os.getpid()}x{next(_counter)}"
    monkeypatch.setenv("DRBALANCE_NAMESPACE", namespace)
    monkeypatch.setenv("DRBALANCE_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("DRBALANCE_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(tmp_path / "system"))  # no system manager unless a test makes one
    monkeypatch.setenv("DRBALANCE_PROFILES", str(tmp_path / "profiles.json"))
    monkeypatch.delenv("DRBALANCE_PROFILE_OUTPUT", raising=False)
    monkeypatch.delenv("DRBALANCE_NO_MANAGER", raising=False)
    names = IpcNames.current(namespace)
    yield names
    remove_leftovers(names)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="a system dir is trusted only in folders root owns (drbalance.ipc.system); CI runs the suite as root",
)


@pytest.fixture
def machine(ipc_env, monkeypatch):
    """A system manager's folder (``drbalance.ipc.system.SystemPlace``) of the test's namespace, in a
    root-owned 0755 folder under /tmp that every user can reach (tests using it are marked
    ``needs_root``); it, and the machine's emulated GPUs' segments, are removed after."""
    from drbalance.ipc import system

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = Path(tempfile.mkdtemp(prefix="drbalance-system-"))
    os.chmod(base, 0o755)
    monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(base / "system"))
    place = system.create(ipc_env.namespace)
    yield place
    shutil.rmtree(base, ignore_errors=True)
    stem = place.shm_prefix()[1:]
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(stem):
            objects.unlink_shared_memory("/" + entry)


def torchrun_args(log_dir: Path, ranks: int) -> list[str]:
    """torchrun's options for a standalone job of ``ranks`` ranks on this node that keeps its
    per-rank directories under ``log_dir`` (a test's own): without ``--log-dir`` every run leaves
    an empty ``torchelastic_*`` directory in the system's temporary directory."""
    return ["--standalone", "--nproc_per_node", str(ranks), "--log-dir", str(log_dir)]


def python_process(module: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start ``python -m module args`` from the repository root with the current environment."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = str(ROOT) + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env["PYTHONUNBUFFERED"] = "1"
    if env:
        child_env.update(env)
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("cwd", ROOT)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=child_env, text=True, **kwargs)
