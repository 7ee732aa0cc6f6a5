"""The launcher's start gate: apps set up first, then start together (docs/emulation.md, "Under CPU load").

Started at their arrival times, the apps of a scenario would register as far apart as their
imports take (15 to 43 s on a loaded 2-core machine): the first would train alone meanwhile, and
the policy would move them onto GPUs whose apps had not registered yet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drbalance import cli
from drbalance.runs.launch import _wait_for_setup, earlier_run
from drbalance.runs.train import pass_start_gate
from tests.conftest import python_process
from tests.helpers.processes import running

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_a_job_says_it_is_set_up_and_trains_only_after_the_gate_opens(tmp_path):
    gate = tmp_path / "job"
    job = python_process("drbalance.runs.train", "--model", "alexnet", "--devices", "cpu", "--epochs", "1",
                         "--iterations", "1", "--batch-size", "2", "--solo-time", "10", "--no-progress",
                         "--start-gate", str(gate), env={"DRBALANCE_NO_MANAGER": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "job.ready").exists():
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job never said it was set up"
            time.sleep(0.05)
        time.sleep(1.0)
        assert job.poll() is None  # set up, and waiting at the gate
        gate.write_text("start\n")
        out, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
        assert "1 iterations in" in err
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_gate_that_never_opens_ends_the_job_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="no start signal after 0 s"):
        pass_start_gate(str(tmp_path / "never"), timeout=0.2, poll=0.01)
    assert (tmp_path / "never.ready").read_text() == "ready\n"
    assert (tmp_path / "never.ready").stat().st_mode & 0o077 == 0  # private, as every file of a run


def test_the_launcher_names_an_app_that_died_while_setting_up(tmp_path):
    died = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    ready = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    (tmp_path / "ok.ready").write_text("ready\n")
    try:
        died.wait(timeout=60)
        with pytest.raises(RuntimeError, match="'bad' exited with status 3 while setting up"):
            _wait_for_setup({"ok": ready, "bad": died}, {"ok": tmp_path / "ok", "bad": tmp_path / "bad"}, 60)
        with pytest.raises(RuntimeError, match=r"apps \['slow'\] not set up after 0 s"):
            _wait_for_setup({"slow": ready}, {"slow": tmp_path / "slow"}, 0.1)
    finally:
        ready.kill()
        ready.wait()


def test_sigterm_to_a_launch_stops_its_manager_and_jobs_and_removes_its_emulated_gpus(tmp_path):
    """``kill``, ``timeout`` and systemd send SIGTERM; it must not kill the launcher alone and leave
    the manager and every job running (waiting at the start gate) and the emulated GPUs in /dev/shm."""
    run_dir = tmp_path / "run"
    launcher = python_process("drbalance", "launch", "e2e-a", "--devices", "emulated", "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / ".runtime").glob("*/status.json")):  # the manager is up; jobs are starting
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        launcher.terminate()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + 15, err
    assert "Traceback" not in err, err
    # stopped while its jobs set up (as a rule here): what it wrote is set aside and the folder is free
    started = (run_dir / "run.json").exists()
    info = json.loads((run_dir / ("run.json" if started else "failed-start.1/run.json")).read_text())
    assert started or (info["failed_at_start"] and earlier_run(run_dir) is None), info
    assert info["manager_returncode"] is not None  # stopped and waited for
    assert all(app["returncode"] is not None for app in info["apps"].values()), info["apps"]
    namespace = info["namespace"]
    assert not [entry for entry in os.listdir("/dev/shm") if f".{namespace}." in entry]



def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc's children lists)."""
    found: set[int] = set()
    queue = [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            queue.extend(children - found)
            found |= children
    return found


class _SigtermInDel:
    """Takes a SIGTERM inside ``__del__``, where Python prints an exception and goes on (as in
    the at-fork handler where a launch under load once lost its ``Terminated``)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # the handler runs here and raises; the exception ends this __del__ only


def test_a_sigterm_whose_exception_was_swallowed_still_stops_the_waits(tmp_path, monkeypatch):
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    previous = cli._stop_on_sigterm()
    try:
        _SigtermInDel()  # collected at once
        assert [type(u.exc_value) for u in swallowed] == [cli.Terminated]  # lost, as in the failed run
        never_ready = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(cli.Terminated):  # the launcher's waits see it at their next poll
                _wait_for_setup({"app": never_ready}, {"app": tmp_path / "app"}, 60)
        finally:
            never_ready.kill()
            never_ready.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        cli._Sigterm.received = False


def test_a_sigterm_inside_logging_is_left_to_the_next_poll(monkeypatch):
    """Inside the logging module the SIGTERM handler only remembers the signal; elsewhere it raises
    at once. SIGTERM's ``Terminated`` raised inside logging's lock release, run as an at-fork hook
    while a child starts, is dropped (and a release cut short leaves the lock held): a launch
    stopped under load would print "Exception ignored in: <function _releaseLock>" and a traceback."""
    inside: dict = {}
    exec("import sys\nframe = sys._getframe()", {"__name__": "logging"}, inside)  # a frame of logging's
    previous = cli._stop_on_sigterm()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, inside["frame"])  # no exception
        assert cli._Sigterm.received
        with pytest.raises(cli.Terminated):
            cli.raise_if_terminated()  # the launcher's next poll
        cli._stop_on_sigterm()
        with pytest.raises(cli.Terminated):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, sys._getframe())
    finally:
        signal.signal(signal.SIGTERM, previous)
        cli._Sigterm.received = False


def test_a_launcher_killed_outright_takes_its_manager_and_jobs_with_it(tmp_path):
    """SIGKILL (the out-of-memory killer, kill -9) gives the launcher no chance to stop anything, yet
    the manager, which never ends by itself, must not run on for good, nor the jobs train on without it."""
    run_dir = tmp_path / "run"
    launcher = python_process("drbalance", "launch", "e2e-a", "--devices", "emulated", "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 120
        while len(_descendants(launcher.pid)) < 2:  # the manager and at least one job
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        while not list((run_dir / ".runtime").glob("*/status.json")):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        children = _descendants(launcher.pid)
        namespace = next((run_dir / ".runtime").glob("*/status.json")).parent.name
    finally:
        launcher.kill()
        launcher.communicate(timeout=60)
    deadline = time.monotonic() + 180
    while any(running(pid) for pid in children):  # none runs on (the manager would, for good)
        assert time.monotonic() < deadline, [pid for pid in children if running(pid)]
        time.sleep(0.2)
    assert not [entry for entry in os.listdir("/dev/shm") if f".{namespace}." in entry]
