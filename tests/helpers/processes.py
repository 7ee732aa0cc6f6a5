"""Real processes for the tests: the manager daemon and the toy training app.

Their output goes to files, not pipes: a process that logs much to a pipe nobody reads would
block when the pipe fills, and a test would hang instead of failing.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from drbalance.ipc.names import IpcNames
from drbalance.jsonlog import read_json_lines
from tests.conftest import python_process, wait_for


def write_util(path: Path, util) -> None:
    path.write_text(json.dumps({"gpus": len(util), "steps": [{"at": 0, "util": list(util)}]}))


class LoggedProcess:
    """A manager process the tests started: ``process``, its JSON-lines log at ``log_path`` and
    its stderr in the file ``err_path`` (opened as ``_err``)."""

    process: subprocess.Popen
    log_path: Path
    err_path: Path
    _err: IO[str]

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text()

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [e for e in read_json_lines(self.log_path) if kind is None or e["event"] == kind]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, signal_it: bool = True) -> tuple[int, str]:
        """SIGTERM (unless ``signal_it`` is False: then wait for it to exit by itself); (code, stderr)."""
        if signal_it and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self._err.close()
        return self.process.returncode, self.err_path.read_text()


class ManagerProcess(LoggedProcess):
    """``python -m drbalance.manager.cli`` in the test's namespace, stopped with SIGTERM.

    The policy is the paper's unless ``extra`` names one: these tests are about the daemon's
    mechanics, and the paper's answers (exclusive placement, the utilisation branch) follow from
    the scripted utilisation alone.
    """

    def __init__(self, tmp_path: Path, names: IpcNames, util=(90, 80, 20, 50), *extra: str,
                 wait: bool = True, env: dict | None = None, **popen) -> None:
        self.names = names
        stamp = time.monotonic_ns()
        self.util_file = tmp_path / "util.json"
        write_util(self.util_file, util)
        self.log_path = tmp_path / f"manager-{stamp}.jsonl"
        self.err_path = tmp_path / f"manager-{stamp}.err"
        self._err = open(self.err_path, "w")
        args = ["--source", f"scripted:{self.util_file}", "--sample-period", "0.1", *extra]
        if "--policy" not in extra:  # the paper's answers follow from the scripted utilisation alone
            args += ["--policy", "paper"]
        if "--log" not in extra:
            args += ["--log", str(self.log_path)]
        self.process = python_process("drbalance.manager.cli", *args, env=env, stdout=subprocess.DEVNULL,
                                      stderr=self._err, **popen)
        if wait:
            wait_for(lambda: names.manager_status().exists() or self.process.poll() is not None)
            assert self.process.poll() is None, self.stderr()


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped, as orphans in a container may stay, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def toy_app(name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The toy app, with ``faulthandler`` on: :func:`stop_app` can have it print its threads' stacks."""
    return python_process("tests.helpers.toy_app", "--app", name, *args, env={"PYTHONFAULTHANDLER": "1", **(env or {})})


def long_app(name: str) -> subprocess.Popen:
    """A job with a boundary every 3 iterations that runs until the test kills it."""
    return toy_app(name, "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--exchange-timeout", "1.0")


def decisions_for(manager: ManagerProcess, app: str) -> int:
    """How many decisions ``manager`` has logged for the job ``app``."""
    return len([e for e in manager.events("decision") if e["app"] == app])


def stop_all(manager: ManagerProcess, *apps: subprocess.Popen | None) -> tuple[int, str]:
    """Kill each app (None: one never started) and stop the manager; the manager's (code, stderr)."""
    for app in apps:
        if app is not None:
            app.kill()
            app.wait(timeout=30)
    return manager.stop()


def stop_app(app: subprocess.Popen, timeout: float = 90.0) -> int:
    """SIGTERM ``app`` and wait ``timeout`` seconds for it to exit; its exit status.

    An app that is still alive then has hung on its way out: it is made to print every thread's
    stack (SIGABRT through ``faulthandler``) and the test fails with them, so the hang can be found.
    """
    if app.poll() is None:
        app.terminate()
    try:
        return app.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        app.send_signal(signal.SIGABRT)
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
        err = app.stderr.read() if app.stderr is not None else ""  # stdout may have a drain thread
        raise AssertionError(f"the app (pid {app.pid}) did not exit within {timeout:.0f} s of SIGTERM; "
                             f"its threads:\n{err}") from None


def drain(process: subprocess.Popen) -> threading.Thread:
    """Read (and drop) the rest of ``process``'s stdout in a thread, so that a long-running process
    never blocks on a full pipe (e.g. while it handles SIGTERM)."""
    reader = threading.Thread(target=process.stdout.read, daemon=True)
    reader.start()
    return reader


def first_line(process: subprocess.Popen) -> dict:
    return json.loads(process.stdout.readline())


def kill_running(*processes: subprocess.Popen | None) -> None:
    """Kill (SIGKILL) each of ``processes`` that still runs, and reap it."""
    for process in processes:
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
