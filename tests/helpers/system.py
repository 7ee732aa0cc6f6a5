"""A machine's system manager and other users' jobs, as real processes, for the tests.

``SystemManagerProcess`` runs ``drbalance-manager --system`` (as root, or as another uid);
``user_job`` runs the toy training job as a given uid (``setpriv``), with its own home, logs and
runtime folder. Running the project's Python as another uid needs /root (where the Python lives,
mode 0700) to be traversable: ``others_may_run_python`` makes it o+x while any test needs it
(a reference count under a lock: pytest-xdist runs tests in several processes) and puts the mode
back after the last one. Tests that use other uids are marked ``second_user``: only root can.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from drbalance.ipc import system, wire
from drbalance.ipc.layout import AppState, AppStatus, Notice, NoticeKind
from drbalance.ipc.records import AppRecord
from drbalance.jsonlog import read_json_lines
from drbalance.ratio import DataRatio
from tests.conftest import ROOT, wait_for
from tests.helpers.as_user import UserProcess

USER_A = 4201
USER_B = 4202
SERVICE_UID = 4200  # a dedicated service user for the system manager, with no capabilities
ROOT_HOME = Path("/root")
_MODE_LOCK = Path(tempfile.gettempdir()) / "drbalance-tests-root-mode.lock"
_MODE_STATE = Path(tempfile.gettempdir()) / "drbalance-tests-root-mode.json"


@contextlib.contextmanager
def others_may_run_python() -> Iterator[None]:
    """/root made o+x while the block runs (the first of concurrent users saves the mode, the last
    puts it back)."""
    with _mode_state() as state:
        if state["users"] == 0:
            state["mode"] = stat.S_IMODE(os.stat(ROOT_HOME).st_mode)
            os.chmod(ROOT_HOME, state["mode"] | 0o001)
        state["users"] += 1
    try:
        yield
    finally:
        with _mode_state() as state:
            state["users"] -= 1
            if state["users"] == 0:
                os.chmod(ROOT_HOME, state["mode"])


@contextlib.contextmanager
def _mode_state() -> Iterator[dict]:
    with open(_MODE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(_MODE_STATE.read_text()) if _MODE_STATE.exists() else {"users": 0, "mode": None}
        except ValueError:
            state = {"users": 0, "mode": None}
        if state["users"] and not _holders_alive(state):
            state["users"] = 0  # a test process killed mid-way: start afresh
        yield state
        state["pids"] = [pid for pid in state.get("pids", []) if _alive(pid)]
        if state["users"]:
            state["pids"] = sorted(set(state["pids"]) | {os.getpid()})
        _MODE_STATE.write_text(json.dumps(state))


def _holders_alive(state: dict) -> bool:
    return any(_alive(pid) for pid in state.get("pids", []))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def shared_tmp() -> Iterator[Path]:
    """A folder in /tmp that every user may reach (root's, 0755), removed afterwards: a system dir
    below it is trusted (only root could have made it)."""
    base = Path(tempfile.mkdtemp(prefix="drbalance-sys-"))
    try:
        os.chmod(base, 0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def user_home(base: Path, uid: int) -> Path:
    """A home folder of ``uid`` below ``base`` (0700), with the folders drbalance writes to."""
    home = base / f"home-{uid}"
    for folder in (home, home / "run", home / "logs"):
        folder.mkdir(exist_ok=True)
        os.chown(folder, uid, uid)
        os.chmod(folder, 0o700)
    return home


def user_env(base: Path, uid: int, system_dir: Path, namespace: str) -> dict[str, str]:
    """The environment of a job of ``uid``: its own home, runtime and log folders; the shared system dir."""
    home = user_home(base, uid)
    return {"HOME": str(home), "DRBALANCE_RUNTIME_DIR": str(home / "run"), "DRBALANCE_LOG_DIR": str(home / "logs"),
            "DRBALANCE_SYSTEM_DIR": str(system_dir), "DRBALANCE_NAMESPACE": namespace,
            "DRBALANCE_PROFILES": str(home / "profiles.json"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def as_uid(uid: int | None, command: list[str]) -> list[str]:
    """``command`` run as ``uid`` (its own group, no others) through ``setpriv``; as is for None."""
    if uid is None:
        return command
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]


def user_job(uid: int | None, env: dict[str, str], name: str, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """The toy training job ``name`` (tests/helpers/toy_app.py) as ``uid``."""
    command = as_uid(uid, [sys.executable, "-m", "tests.helpers.toy_app", "--app", name, *args])
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True)


class SystemManagerProcess:
    """``drbalance-manager --system`` on a scripted utilisation source, as ``uid`` (None: this user)."""

    def __init__(self, tmp: Path, system_dir: Path, namespace: str, util=(90, 80, 20, 50), *extra: str,
                 uid: int | None = None, policy: str = "paper") -> None:
        self.system_dir, self.namespace = system_dir, namespace
        self.folder = system_dir / namespace
        stamp = time.monotonic_ns()
        self.util_file = tmp / f"util-{stamp}.json"
        self.util_file.write_text(json.dumps({"gpus": len(util), "steps": [{"at": 0, "util": list(util)}]}))
        os.chmod(self.util_file, 0o644)
        self.log_path = self.folder / "manager.jsonl"
        self.err_path = tmp / f"system-manager-{stamp}.err"
        self._err = open(self.err_path, "w")
        env = {**os.environ, "DRBALANCE_SYSTEM_DIR": str(system_dir), "PYTHONPATH": str(ROOT),
               "PYTHONUNBUFFERED": "1"}
        command = as_uid(uid, [sys.executable, "-m", "drbalance.manager.cli", "--system", "--namespace", namespace,
                               "--source", f"scripted:{self.util_file}", "--sample-period", "0.1",
                               "--policy", policy, *extra])
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._err,
                                        text=True)
        wait_for(lambda: (self.folder / "manager.sock").exists() or self.process.poll() is not None, timeout=60)
        assert self.process.poll() is None, self.stderr()

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text()

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [e for e in read_json_lines(self.log_path) if kind is None or e["event"] == kind]

    def stop(self) -> tuple[int, str]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self._err.close()
        return self.process.returncode, self.err_path.read_text()


def as_user(uid: int, function, *args, timeout: float = 120.0):
    """``function(*args)`` run in a forked child as ``uid`` (its own group, no others:
    ``tests.helpers.as_user.UserProcess``); its result (JSON-able), or a ``RuntimeError`` naming what
    it raised. The child is a copy of this process, so the interpreter need not be reachable by ``uid``."""
    result = UserProcess(uid, uid, _call, function, *args).result(timeout)
    if isinstance(result, str):  # "ErrorClass: text": what the function raised
        raise RuntimeError(f"as uid {uid}: {result}")
    return result


def _call(_channel, function, *args):
    return function(*args)


class RawClient:
    """A connection to the system manager that sends whatever a test wants (a job that lies)."""

    def __init__(self, namespace: str) -> None:
        place = system.find(namespace)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(place.socket))
        self.record: AppRecord | None = None

    def attach(self, app: str, fd: int | None = None) -> wire.Message:
        self.record = AppRecord.create_sealed(app)
        wire.send(self.sock, wire.Kind.ATTACH, wire.attach_payload(app),
                  fds=(self.record.segment.memory.fd if fd is None else fd,), timeout=5)
        return self.answer()

    def publish(self, app: str, pid: int | None = None) -> None:
        self.record.write_status(AppStatus(
            pid=pid or os.getpid(), app=app, state=AppState.RUNNING, ratio=DataRatio([1, 1, 1, 1], 4),
            epoch=0, epochs=2, iteration=1, iterations_total=10, iterations_per_epoch=5, notice_seq=1,
            slowdown=1.0, iteration_time=0.1, solo_time=1.0, start_wall=time.time(), updated_wall=time.time(),
            updated_mono=time.monotonic()))

    def notice(self, app: str, pid: int | None = None, seq: int = 1) -> None:
        notice = Notice(NoticeKind.REGISTER, pid or os.getpid(), seq, app, time.time())
        wire.send(self.sock, wire.Kind.NOTICE, notice.encode(), timeout=5)

    def answer(self, timeout: float = 30) -> wire.Message | None:
        if not wire.wait_readable(self.sock, timeout):
            return None
        return wire.receive(self.sock, frozenset({wire.Kind.WELCOME, wire.Kind.REFUSED, wire.Kind.COMMAND}))

    def close(self) -> None:
        self.sock.close()
        if self.record is not None:
            self.record.close()
