"""A session's plan — from the loader, resumed at a later epoch, and run past."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from drbalance.client import BalancedDataParallel, Session
from drbalance.ipc.private import UnsafePath
from drbalance.jsonlog import read_json_lines
from tests.conftest import ROOT, leftovers
from tests.helpers.processes import ManagerProcess, toy_app

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def alone(ipc_env, monkeypatch):
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    return ipc_env


def model():
    return BalancedDataParallel(nn.Linear(2, 1), device_ids=[0, 1])


def events(tmp_path, app):
    return list(read_json_lines(tmp_path / "logs" / f"{app}.sd.jsonl"))


def test_running_past_the_plan_extends_it_and_warns_once(alone, tmp_path, caplog):
    session = Session(model(), "past", epochs=2, iterations_per_epoch=3, solo_time=1.0)
    with caplog.at_level(logging.WARNING, logger="drbalance.client"), session:
        for _ in range(10):  # the plan says 6
            session.step()
        assert session.tracker.done == 10 and session.plan.epochs == 4 and session.plan.total == 12
        status = session._status(session.clock.monotonic())
        assert status.iteration == 10 and status.iterations_total == 12 and status.epoch == 3
    warnings = [r.getMessage() for r in caplog.records if "ran past its plan" in r.getMessage()]
    assert len(warnings) == 1 and "2 epochs x 3 iterations" in warnings[0]
    kinds = [e["event"] for e in events(tmp_path, "past")]
    assert kinds.count("finish") == 2 and kinds.count("extended") == 2 and kinds[-1] == "closed"  # at 6 and 9
    assert [e["epochs"] for e in events(tmp_path, "past") if e["event"] == "extended"] == [3, 4]
    assert leftovers(alone) == []


def test_step_after_close_warns_once_and_does_nothing(alone, caplog):
    session = Session(model(), "closed-early", epochs=1, iterations_per_epoch=2, solo_time=1.0)
    session.close()
    with caplog.at_level(logging.WARNING, logger="drbalance.client"):
        session.step()
        session.step()
    assert sum("is closed" in r.getMessage() for r in caplog.records) == 1
    assert session.tracker.done == 0


def test_the_plan_can_come_from_the_loader(alone):
    loader = DataLoader(TensorDataset(torch.randn(20, 2)), batch_size=4, drop_last=True)
    session = Session(model(), "from-loader", epochs=3, iterations_per_epoch=loader, solo_time=1.0)
    assert session.plan.iterations_per_epoch == 5 and session.plan.total == 15
    session.close()

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(2)])

    with pytest.raises(ValueError, match="has none .*IterableDataset.*give the number of iterations"):
        Session(model(), "stream", epochs=1, iterations_per_epoch=DataLoader(Stream()), solo_time=1.0)
    empty = DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="has 0 batches"):
        Session(model(), "empty", epochs=1, iterations_per_epoch=empty, solo_time=1.0)


def test_numpy_integers_count_as_integers_and_numpy_bools_and_fractions_do_not(alone):
    """A plan read from a config or an array arrives as numpy integers: ``iterations_per_epoch``
    of ``np.int64(5)`` is a count, not "a loader with no length (IterableDataset)", and the other
    counts are integers too."""
    import numpy as np

    session = Session(model(), "numpy-plan", epochs=np.int64(4), iterations_per_epoch=np.int32(5),
                      solo_time=np.float32(40.0), start_epoch=np.int64(1), report_every=np.int16(2),
                      decide_every=np.uint8(3))
    try:
        assert session.plan.total == 20 and session.tracker.done == 5 and session.start_epoch == 1
        assert (session.report_every, session.decide_every) == (2, 3)
        assert all(type(value) is int for value in (session.plan.epochs, session.plan.iterations_per_epoch,
                                                    session.start_epoch, session.report_every))
    finally:
        session.close()
    with pytest.raises(ValueError, match="iterations_per_epoch must be a positive integer"):
        Session(model(), "numpy-zero", epochs=1, iterations_per_epoch=np.int64(0), solo_time=1.0)
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        Session(model(), "numpy-bool", epochs=np.bool_(True), iterations_per_epoch=5, solo_time=1.0)
    with pytest.raises(ValueError, match="report_every must be a positive integer"):
        Session(model(), "numpy-half", epochs=1, iterations_per_epoch=5, solo_time=1.0, report_every=np.float64(2.5))

def test_a_resumed_session_starts_at_its_epoch_and_measures_the_rest(alone, tmp_path):
    class Ticks:
        def __init__(self):
            self.now = 100.0

        def monotonic(self):
            return self.now

        def wall(self):
            return 1e9 + self.now

    clock = Ticks()
    session = Session(model(), "resumed", epochs=4, iterations_per_epoch=5, solo_time=40.0, start_epoch=3,
                      clock=clock)
    assert session.tracker.done == 15 and session.tracker.epoch == 3
    for _ in range(5):  # the last epoch only; 1 s per iteration, the first is warm-up
        clock.now += 1.0
        session.step()
    # the resumed part (5 of 20 iterations) alone takes 40 * 5 / 20 = 10 s; it took 5 s: SD 0.5
    assert session.tracker.finished and session.slowdown == pytest.approx(0.5)
    assert [e["event"] for e in events(tmp_path, "resumed")][-1] == "finish"
    start = events(tmp_path, "resumed")[0]
    assert start["start_epoch"] == 3 and start["iteration"] == 15
    session.close()
    for bad in (4, -1, 1.5):
        with pytest.raises(ValueError, match=r"start_epoch must be an integer in 0..3"):
            Session(model(), "bad-start", epochs=4, iterations_per_epoch=5, solo_time=1.0, start_epoch=bad)


def test_past_the_plan_with_a_real_manager_the_job_finishes_and_comes_back(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50))
    try:
        app = toy_app("overrun", "--epochs", "2", "--iterations", "3", "--extra-iterations", "4", "--sleep", "0.02")
        out, err = app.communicate(timeout=90)
        assert app.returncode == 0, err
    finally:
        code, manager_err = manager.stop()
    assert code == 0, manager_err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["done"] and lines[-2]["iteration"] == 10
    assert err.count("ran past its plan") == 1
    removed = [e["reason"] for e in manager.events("app_removed") if e["app"] == "overrun"]
    added = [e["via"] for e in manager.events("app_added") if e["app"] == "overrun"]
    # plan 6: FINISH at 6, back at 7 (plan 9), FINISH at 9, back at 10 (plan 12), FINISH at close
    assert removed == ["finished"] * 3 and added == ["notice"] * 3
    assert leftovers(ipc_env) == []


def test_a_session_that_cannot_start_leaves_no_ipc_object_and_frees_its_name(ipc_env, tmp_path, monkeypatch):
    linked = tmp_path / "linked.sd.jsonl"
    linked.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="symbolic link"):  # refused before any IPC object exists
        Session(model(), "retry", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=linked)
    assert leftovers(ipc_env) == [] and not list(ipc_env.runtime_dir().glob("**/*.claim"))

    def fails(self, now):
        raise RuntimeError("registration failed")

    with monkeypatch.context() as patched:  # a fault after the record and the claim were made
        patched.setattr(Session, "_synchronize", fails)
        with pytest.raises(RuntimeError, match="registration failed"):
            Session(model(), "retry", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=False)
    assert leftovers(ipc_env) == [] and not list(ipc_env.runtime_dir().glob("**/*.claim"))
    with Session(model(), "retry", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=False) as session:
        session.step()  # the name is free: no "this process already runs an app named 'retry'"
    assert leftovers(ipc_env) == []


def test_an_sd_log_below_a_folder_every_user_may_write_is_a_clear_error_and_leaves_nothing(ipc_env, tmp_path):
    """A log folder under a world-writable, non-sticky folder (anyone could swap what lies below
    it) stops the job at Session() with an error that names that folder, the SD log and what to
    do; the job's name and objects are left free."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    log = open_dir / "logs" / "job.sd.jsonl"
    with pytest.raises(UnsafePath) as refused:
        Session(model(), "unsafe", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=log)
    message = str(refused.value)
    assert message.startswith(f"{open_dir}: is writable by others (mode 0777) and not sticky"), message
    assert f"The SD log {log} is not written there" in message and "DRBALANCE_LOG_DIR" in message, message
    assert os.listdir(open_dir) == []  # nothing made below it
    assert leftovers(ipc_env) == [] and not list(ipc_env.runtime_dir().glob("**/*.claim"))


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, "0.5", True])
def test_session_timeouts_must_be_finite_seconds(alone, value):
    for option in ("exchange_timeout", "send_timeout"):
        with pytest.raises(ValueError, match=f"{option} must be a finite number of seconds >= 0"):
            Session(model(), "bounded", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=False,
                    **{option: value})


FULL_DISK_JOB = """
import resource, signal, sys
import torch
from torch import nn
from drbalance.client import BalancedDataParallel, Session
from drbalance.ipc.private import UnsafePath
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (600, resource.RLIM_INFINITY))  # room for a few lines only
model = BalancedDataParallel(nn.Linear(2, 1), device_ids=[0, 1])
with Session(model, "full", epochs=1, iterations_per_epoch=40, solo_time=1.0, sd_log=sys.argv[1],
             report_every=1) as session:
    for _ in range(40):
        model(torch.randn(4, 2)).sum().backward()
        session.step()
"""


def test_an_sd_log_that_stays_full_is_warned_about_once_and_its_lost_lines_counted(alone, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FULL_DISK_JOB)
    log = tmp_path / "full.sd.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.run([sys.executable, str(script), str(log)], env=env, capture_output=True, text=True,
                             timeout=120)
    err = process.stderr
    assert process.returncode == 0, err  # training went on
    assert err.count("cannot write the SD log") == 1, err
    lost = int(err.split(" line(s) of the SD log")[0].rsplit(" ", 1)[-1])
    written = len(log.read_text().splitlines())
    assert lost > 0 and written >= 1 and log.stat().st_size <= 600, (lost, written)


def test_a_job_says_why_it_found_no_manager(ipc_env, tmp_path, caplog):
    manager = ManagerProcess(tmp_path, ipc_env)
    manager.process.kill()  # its manager.json stays, naming a dead pid
    manager.process.wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="drbalance"):
        with Session(model(), "why", epochs=1, iterations_per_epoch=2, solo_time=1.0, sd_log=False) as session:
            session.step()
    assert f"(the manager named in {ipc_env.manager_info()} (pid {manager.process.pid}) is gone)" in caplog.text
    assert "none is running" not in caplog.text


def test_a_sessions_report_lines_reach_the_sd_log_two_seconds_after_its_last_write(alone, tmp_path, monkeypatch):
    # SD_LOG_FLUSH_SECONDS: a slow job's reports are not held back until 64 of them are buffered
    from drbalance import jsonlog
    from drbalance.client.session import SD_LOG_FLUSH_SECONDS
    from tests.helpers.clock import MonotonicClock

    clock = MonotonicClock()  # jsonlog's clock only: the session keeps its own
    monkeypatch.setattr(jsonlog, "time", clock)
    with Session(model(), "tailed", epochs=1, iterations_per_epoch=50, solo_time=1.0, report_every=1) as session:
        session.step()
        session.step()
        assert [e["event"] for e in events(tmp_path, "tailed")] == ["start"]  # reports buffered
        clock.now += SD_LOG_FLUSH_SECONDS
        session.step()
        reports = [e for e in events(tmp_path, "tailed") if e["event"] == "report"]
        assert [r["iteration"] for r in reports] == [1, 2, 3]  # written before the session ends
