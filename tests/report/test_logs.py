"""``drbalance report`` on a user's own logs: no argument, a folder of SD logs, SD
log files one by one, ``--app``, a time window, the running manager's log."""

from __future__ import annotations

import json
import os
import time

import pytest
from torch import nn

from drbalance.cli import main as drbalance
from drbalance.client import BalancedDataParallel, Session
from drbalance.jsonlog import read_json_lines
from tests.conftest import wait_for
from tests.helpers.clock import ManualClock
from tests.helpers.processes import ManagerProcess, drain, first_line, stop_app, toy_app

DAY = 86400.0


def train(name: str, start_wall: float, iterations: int, seconds: float, solo_time: float) -> None:
    """A real session of ``iterations`` iterations of ``seconds`` each (a manual clock whose wall time
    starts at ``start_wall``), logging to ``$DRBALANCE_LOG_DIR/<name>.sd.jsonl``."""
    clock = ManualClock(0.0, wall_offset=start_wall)
    with Session(BalancedDataParallel(nn.Linear(2, 2)), name, 1, iterations, solo_time, clock=clock,
                 handle_sigterm=False, report_every=2) as session:
        for _ in range(iterations):
            clock.advance(seconds)
            session.step()


def write_manager_log(path, start_wall: float, seconds: int, util: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        for t in range(seconds):
            log.write(json.dumps({"t": start_wall + t, "event": "util", "util": [util, util]}) + "\n")


def report_json(capsys, *args: str) -> list[dict]:
    assert drbalance(["report", *args, "--no-plots", "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def jobs(ipc_env, tmp_path, monkeypatch):
    """Two jobs in the user's log folder (one run twice under the same name, a day apart), and the
    manager's log where the last manager wrote it (no manager running)."""
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    now = time.time()
    train("resnet-a", now - DAY, 10, 1.0, 5.0)  # SD 2
    train("alexnet-b", now - 20, 10, 1.0, 10.0)  # SD 1
    train("resnet-a", now - 10, 10, 0.5, 2.5)  # the same name again: SD 2
    write_manager_log(ipc_env.runtime_dir() / "manager.jsonl", now - 40, 60, 50.0)
    return tmp_path / "logs"


def test_report_without_an_argument_reads_the_users_log_folder_and_the_managers_log(jobs, capsys):
    """``drbalance report`` needs no run directory (no "the following arguments are required"),
    and reads a folder of SD logs (no "has no apps/*.sd.jsonl SD logs")."""
    summary, = report_json(capsys)
    assert summary["label"] == "logs"
    assert summary["final_sd"] == {"alexnet-b": pytest.approx(1.0), "resnet-a#1": pytest.approx(2.0),
                                   "resnet-a#2": pytest.approx(2.0)}
    assert summary["mean_util"] == pytest.approx(50.0)  # the manager's samples from the jobs' time only
    assert report_json(capsys, str(jobs)) == [summary]  # the folder named: the same column


def test_sd_log_files_one_by_one_app_names_and_a_time_window_pick_jobs(jobs, capsys):
    summary, = report_json(capsys, str(jobs / "alexnet-b.sd.jsonl"), str(jobs / "resnet-a.sd.jsonl"))
    assert summary["label"] == "jobs" and set(summary["final_sd"]) == {"alexnet-b", "resnet-a#1", "resnet-a#2"}
    summary, = report_json(capsys, "--app", "res*")
    assert set(summary["final_sd"]) == {"resnet-a#1", "resnet-a#2"}
    summary, = report_json(capsys, "--since", "1h")
    assert set(summary["final_sd"]) == {"alexnet-b", "resnet-a#2"}  # the day-old run is out of the window
    summary, = report_json(capsys, "--until", "1h")
    assert set(summary["final_sd"]) == {"resnet-a#1"} and summary["mean_util"] is None  # no samples then
    summary, = report_json(capsys, "--app", "alexnet-b", "--app", "resnet-a#1")
    assert set(summary["final_sd"]) == {"alexnet-b", "resnet-a#1"}


def test_a_selection_that_leaves_no_job_and_bad_windows_are_clear_errors(jobs, capsys):
    assert drbalance(["report", "--app", "bert", "--no-plots"]) == 1
    assert "no jobs in" in capsys.readouterr().err
    for window, message in ((["--since", "yesterday"], "expected a date and time (2026-12-04, 2026-12-04T09:30) or "
                                                        "a time ago"),
                            (["--since", "1h", "--until", "2h"], "--since is after --until")):
        with pytest.raises(SystemExit) as exited:
            drbalance(["report", *window, "--no-plots"])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert drbalance(["report", str(jobs / "nope.sd.jsonl"), "--no-plots"]) == 1
    assert "no such run directory or SD log" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_running_managers_own_log_is_read_wherever_it_writes_it(ipc_env, tmp_path, capsys):
    """A manager started with ``--log`` elsewhere: its status file names the log, and the report of
    the user's log folder takes the utilisation from it."""
    manager = ManagerProcess(tmp_path, ipc_env, (40, 60, 40, 60), "--util-log-period", "0.2")
    app = None
    try:
        app = toy_app("measured", "--epochs", "1", "--iterations", "30", "--sleep", "0.05")
        first_line(app)
        drain(app)
        wait_for(lambda: any(r.get("event") == "finish" for r in read_json_lines(tmp_path / "logs" /
                                                                                    "measured.sd.jsonl")),
                 timeout=120)
        assert json.loads(ipc_env.manager_status().read_text())["log"] == str(manager.log_path)
        assert not (ipc_env.runtime_dir() / "manager.jsonl").exists()
        summary, = report_json(capsys)
        assert set(summary["final_sd"]) == {"measured"} and summary["mean_util"] == pytest.approx(50.0)
    finally:
        if app is not None:
            stop_app(app)
        code, err = manager.stop()
    assert code == 0, err
    assert os.path.exists(manager.log_path)
