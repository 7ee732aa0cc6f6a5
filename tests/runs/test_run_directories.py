"""A run directory holds one run: ``launch`` refuses one with an earlier run's logs (they would be
appended to, and a report would mix both runs), and ``demo`` moves an earlier demo's runs aside."""

from __future__ import annotations

import json

import pytest

from drbalance import cli
from drbalance.runs.demo import set_aside_earlier_runs
from drbalance.runs.launch import LaunchOptions, RunDirectoryInUse, earlier_run, launch
from drbalance.workload.scenarios import load_scenario

pytestmark = pytest.mark.timeout(60)


def _a_run(folder, name="alex1"):
    """What ``launch`` leaves in a run directory: run.json, the manager's log, an app's SD log."""
    (folder / "apps").mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"label": folder.name}))
    (folder / "manager.jsonl").write_text('{"event": "start", "t": 1.0}\n')
    (folder / "apps" / f"{name}.sd.jsonl").write_text('{"t": 1.0, "sd": 1.0}\n')


def test_an_earlier_run_is_found_by_any_of_its_logs(tmp_path):
    assert earlier_run(tmp_path / "missing") is None
    assert earlier_run(tmp_path) is None
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "alex1.out").write_text("output only: no SD log, no run")
    assert earlier_run(tmp_path) is None
    (tmp_path / "apps" / "alex1.sd.jsonl").write_text("{}\n")
    assert earlier_run(tmp_path) == tmp_path / "apps" / "alex1.sd.jsonl"
    (tmp_path / "manager.jsonl").write_text("{}\n")
    assert earlier_run(tmp_path) == tmp_path / "manager.jsonl"


def test_launch_refuses_a_run_directory_that_holds_a_run_and_starts_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _a_run(run_dir)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    with pytest.raises(RunDirectoryInUse, match="already holds an earlier run"):
        launch(LaunchOptions(load_scenario("e2e-a"), "observe", run_dir, "emulated"))
    assert cli.main(["launch", "e2e-a", "--devices", "emulated", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert "drbalance launch: error: run directory" in err and "Nothing was started" in err, err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # nothing added, nothing lost
    assert (run_dir / "apps" / "alex1.sd.jsonl").read_text() == '{"t": 1.0, "sd": 1.0}\n'


def test_the_demo_moves_an_earlier_demos_runs_aside_and_keeps_them(tmp_path):
    out = tmp_path / "drbalance-demo"
    _a_run(out / "observe")
    _a_run(out / "fair", "res1")
    (out / "paper").mkdir()  # a folder with no run in it stays where it is
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("the earlier table")
    moved = set_aside_earlier_runs(out, ("observe", "paper", "fair"))
    assert moved == [(out / "observe", out / "observe.1"), (out / "fair", out / "fair.1"),
                     (out / "report", out / "report.1")]
    assert (out / "observe.1" / "apps" / "alex1.sd.jsonl").exists()
    assert (out / "fair.1" / "apps" / "res1.sd.jsonl").exists()
    assert (out / "report.1" / "report.md").read_text() == "the earlier table"
    assert (out / "paper").is_dir() and not (out / "observe").exists()
    assert set_aside_earlier_runs(out, ("observe", "paper", "fair")) == []  # nothing left in the way
    _a_run(out / "observe")  # a third demo: the first number free for every folder it moves
    (out / "report").mkdir()
    (out / "report.2").mkdir()  # observe.2 is free, report.2 is not: both go to .3
    assert set_aside_earlier_runs(out, ("observe", "fair")) == [(out / "observe", out / "observe.3"),
                                                                 (out / "report", out / "report.3")]


def test_a_launch_that_fails_while_starting_keeps_its_logs_aside_and_a_retry_is_not_refused(ipc_env, tmp_path):
    run_dir = tmp_path / "run-dir"
    bad_manager = ["--sample-period", "0"]  # the manager refuses it and exits before any app starts
    for attempt in (1, 2):
        options = LaunchOptions(load_scenario("e2e-a"), "observe", run_dir, "emulated", extra_manager_args=bad_manager)
        with pytest.raises(RuntimeError, match="drbalance-manager: the process exited with status 2"):
            launch(options)
        assert earlier_run(run_dir) is None, attempt  # nothing in the way of the next launch
        aside = run_dir / f"failed-start.{attempt}"
        recorded = json.loads((aside / "run.json").read_text())
        assert recorded["failed_at_start"] is True and "started" not in recorded
        assert recorded["manager_returncode"] == 2
        assert "--sample-period" in (aside / "manager.out").read_text()  # the reason is kept
    assert not (run_dir / "run.json").exists() and (run_dir / "failed-start.1").is_dir()


def test_run_json_is_replaced_whole_or_not_at_all_when_the_disk_fills_up(tmp_path):
    import resource

    from drbalance.report.metrics import _read_run_info
    from drbalance.runs.launch import _write

    info = {"label": "observe", "started": 1700000000.0, "apps": {f"app{i}": {"command": ["x"] * 50} for i in range(6)}}
    _write(tmp_path, info)  # when every app has set up
    size = (tmp_path / "run.json").stat().st_size
    info["ended"] = 1700000100.0  # at the end the record is larger, and the disk is full
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))  # no file may grow past `size` bytes (EFBIG)
    try:
        with pytest.raises(OSError):
            _write(tmp_path, info)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert _read_run_info(tmp_path / "run.json")["started"] == 1700000000.0  # the earlier record, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no temporary file left behind
