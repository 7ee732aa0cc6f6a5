"""``drbalance report`` on a user's own logs: no argument, a folder of SD logs, SD
log files one by one, ``--app``, a time window, the running manager's log."""

from __future__ import annotations

import json
import os
import sys
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
    """Two jobs in the user's log folder (one run twice under the same name, a day apart: the second
    run beside the other job), and the manager's log where the last manager wrote it (no manager
    running)."""
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    now = time.time()
    train("resnet-a", now - DAY, 10, 1.0, 5.0)  # SD 2
    train("alexnet-b", now - 20, 10, 1.0, 10.0)  # SD 1
    train("resnet-a", now - 15, 10, 0.5, 2.5)  # the same name again, while alexnet-b runs: SD 2
    write_manager_log(ipc_env.runtime_dir() / "manager.jsonl", now - 40, 60, 50.0)
    return tmp_path / "logs"


def test_report_without_an_argument_reads_the_users_log_folder_and_the_managers_log(jobs, capsys):
    """``drbalance report`` needs no run directory (no "the following arguments are required"),
    and reads a folder of SD logs (no "has no apps/*.sd.jsonl SD logs"). Jobs that never ran at
    the same time are not one run: a column per group of jobs that overlapped, oldest first."""
    earlier, later = report_json(capsys)
    assert earlier["label"].startswith("logs ") and later["label"].startswith("logs ")
    assert earlier["label"] != later["label"]  # each says when its run began
    assert earlier["final_sd"] == {"resnet-a#1": pytest.approx(2.0)} and earlier["final_sd_diff"] is None
    assert later["final_sd"] == {"alexnet-b": pytest.approx(1.0), "resnet-a#2": pytest.approx(2.0)}
    assert later["final_sd_diff"] == pytest.approx(1.0)
    assert later["mean_util"] == pytest.approx(50.0)  # the manager's samples from the jobs' time only
    assert earlier["mean_util"] is None  # none in the day-old run's time
    assert report_json(capsys, str(jobs)) == [earlier, later]  # the folder named: the same columns


def test_sd_log_files_one_by_one_app_names_and_a_time_window_pick_jobs(jobs, capsys):
    earlier, later = report_json(capsys, str(jobs / "alexnet-b.sd.jsonl"), str(jobs / "resnet-a.sd.jsonl"))
    assert earlier["label"].startswith("jobs ") and set(earlier["final_sd"]) == {"resnet-a#1"}
    assert set(later["final_sd"]) == {"alexnet-b", "resnet-a#2"}
    earlier, later = report_json(capsys, "--app", "res*")
    assert set(earlier["final_sd"]) == {"resnet-a#1"} and set(later["final_sd"]) == {"resnet-a#2"}
    summary, = report_json(capsys, "--since", "1h")
    assert set(summary["final_sd"]) == {"alexnet-b", "resnet-a#2"}  # the day-old run is out of the window
    summary, = report_json(capsys, "--until", "1h")
    assert set(summary["final_sd"]) == {"resnet-a#1"} and summary["mean_util"] is None  # no samples then
    earlier, later = report_json(capsys, "--app", "alexnet-b", "--app", "resnet-a#1")
    assert set(earlier["final_sd"]) == {"resnet-a#1"} and set(later["final_sd"]) == {"alexnet-b"}


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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_profiles_measuring_run_is_no_job_of_the_report(ipc_env, tmp_path, capsys, monkeypatch):
    """``drbalance profile`` runs the job in solo-measurement mode, which logs to the job's SD log
    like any run (``"measuring": true``, a placeholder solo time, stopped before its plan's end). The
    report leaves it out and says so: counted as a job it would be ``imnet#1``, not finished, and
    the run's makespan would be unknown."""
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    assert drbalance(["profile", "imnet", "--iterations", "8", "--warmup", "2", "--", sys.executable, "-m",
                      "tests.helpers.toy_app", "--app", "imnet", "--epochs", "2", "--iterations", "10"]) == 0
    capsys.readouterr()
    log = tmp_path / "logs" / "imnet.sd.jsonl"
    assert [r["measuring"] for r in read_json_lines(log) if r["event"] == "start"] == [True]
    train("imnet", time.time(), 10, 0.5, 4.0)  # the job itself, under the same name: SD 1.25
    summary, = report_json(capsys)
    assert summary["final_sd"] == {"imnet": pytest.approx(1.25)}  # one job, not imnet#1 and imnet#2
    assert summary["unfinished"] == [] and summary["makespan"] is not None and summary["profile_runs"] == 1
    assert drbalance(["report", "--no-plots"]) == 0
    assert "left out: 1 measuring run(s) of drbalance profile" in capsys.readouterr().out


def test_an_sd_that_is_only_a_lower_bound_is_shown_as_one_and_counts_in_no_number(tmp_path, capsys):
    """A job without a solo time logs ``sd_bound`` while its estimate can still only be too high:
    that SD is at least the number, not the SD. The report plots and averages only SDs, and shows a
    final SD that is only a bound as ``>=``."""
    logs = tmp_path / "logs"
    logs.mkdir()
    start = time.time() - 100
    for name, rows in (("sure", [(1, 1.0, False), (9, 1.1, False)]),
                       ("bound", [(1, 0.4, True), (5, 1.3, False), (9, 0.8, True)])):
        records = [{"t": start, "elapsed": 0.0, "event": "start", "app": name}]
        records += [{"t": start + t, "elapsed": float(t), "event": "report", "app": name, "sd": sd, "sd_bound": bound}
                    for t, sd, bound in rows]
        records.append({"t": start + 10, "elapsed": 10.0, "event": "finish", "app": name,
                        "sd": rows[-1][1], "sd_bound": rows[-1][2]})
        (logs / f"{name}.sd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary, = report_json(capsys, str(logs))
    assert summary["final_sd"] == {"bound": None, "sure": pytest.approx(1.1)}
    assert summary["final_sd_bound"] == {"bound": pytest.approx(0.8)}
    assert summary["final_sd_diff"] is None and summary["final_mean_sd"] == pytest.approx(1.1)
    assert summary["start_sd_diff"] == pytest.approx(0.3)  # at t=5, the first SD of 'bound': 1.3 - 1.0
    assert drbalance(["report", str(logs), "--no-plots"]) == 0
    table = capsys.readouterr().out
    assert "final SD bound" in table and ">=0.800" in table and "the final SD is at least this" in table
