"""drbalance/runs/train_ddp.py: a DDP job beside a DataParallel job under ``drbalance launch`` (emulated GPUs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from drbalance.jsonlog import read_json_lines
from drbalance.runs.launch import LaunchOptions, app_command, launch
from drbalance.workload.scenarios import AppSpec, Scenario, load_scenario, scenario_from_json
from tests.conftest import ROOT, leftovers, python_process, torchrun_args, wait_for
from tests.helpers.processes import running

MIXED = {
    "name": "mixed", "gpus": 2, "placement": "round-robin",
    "apps": [
        {"name": "dd", "model": "alexnet", "batch": 32, "epochs": 2, "iterations_per_epoch": 4, "ratio": [5, 5],
         "ddp": True},
        {"name": "dp", "model": "alexnet", "batch": 32, "epochs": 2, "iterations_per_epoch": 6, "ratio": [0, 10]},
    ],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ddp_job_runs_beside_a_dataparallel_job_under_the_launcher(ipc_env, tmp_path):
    scenario = scenario_from_json(json.dumps(MIXED))
    run_dir = tmp_path / "run"
    launch(LaunchOptions(scenario, "paper", run_dir, "emulated", decide_every=2, report_every=2))
    info = json.loads((run_dir / "run.json").read_text())
    assert {name: app["returncode"] for name, app in info["apps"].items()} == {"dd": 0, "dp": 0}
    assert "torch.distributed.run" in info["apps"]["dd"]["command"]
    rank_dirs = list((run_dir / "apps" / "dd.torchrun").glob("*/attempt_0/*"))  # torchrun's, in the run directory
    assert sorted(path.name for path in rank_dirs) == ["0", "1"], rank_dirs
    sd_log = list(read_json_lines(run_dir / "apps" / "dd.sd.jsonl"))
    assert [e["iteration"] for e in sd_log if e["event"] == "finish"] == [8]
    assert {e["dr_total"] for e in sd_log} == {10} and {len(e["dr"]) for e in sd_log} == {2}
    events = list(read_json_lines(run_dir / "manager.jsonl"))
    assert [e["pid"] for e in events if e["event"] == "app_added" and e["app"] == "dd"]  # one app for the job
    decisions = [e for e in events if e["event"] == "decision" and e["app"] == "dd"]
    assert decisions and all(min(e["new_dr"]) >= 1 for e in decisions)  # never a rank left out
    assert leftovers(ipc_env) == []


def test_the_launcher_starts_a_ddp_app_with_one_rank_per_gpu_of_its_initial_ratio(tmp_path):
    apps = (AppSpec("d", "resnet50", 32, 1, 4, (0, 6, 0, 4), ddp=True), AppSpec("p", "resnet50", 32, 1, 4))
    scenario = Scenario("s", 4, apps)
    command = app_command(LaunchOptions(scenario, "paper", tmp_path, "emulated"), 0, "emulated:4")
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert command[command.index("--gpus") + 1] == "1,3" and command[command.index("--ratio") + 1] == "6,4"
    assert command[command.index("--log-dir") + 1] == str(tmp_path.resolve() / "apps" / "d.torchrun")
    plain = app_command(LaunchOptions(scenario, "paper", tmp_path, "emulated"), 1, "emulated:4")
    assert plain[1:3] == ["-m", "drbalance.runs.train"] and plain[plain.index("--ratio") + 1] == "0,10,0,0"
    assert json.loads(scenario.to_json())["apps"][0]["ddp"] is True
    with pytest.raises(ValueError, match="ddp must be true or false"):
        AppSpec("d", "resnet50", 32, 1, 4, ddp="yes")


def test_the_shipped_ddp_scenario_loads_with_one_ddp_job_on_every_gpu(tmp_path):
    scenario = load_scenario(str(ROOT / "examples" / "scenarios" / "ddp-beside-dp.json"))
    (ddp,) = [index for index, app in enumerate(scenario.apps) if app.ddp]
    command = app_command(LaunchOptions(scenario, "paper", tmp_path, "emulated"), ddp, "emulated:4")
    assert command[command.index("--nproc_per_node") + 1] == "4" and command[command.index("--gpus") + 1] == "0,1,2,3"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_ddp_outside_torchrun_says_how_to_start_it():
    process = python_process("drbalance.runs.train_ddp", "--solo-time", "1", env={"RANK": "", "MASTER_ADDR": ""})
    out, err = process.communicate(timeout=100)
    assert process.returncode != 0 and "start it with torchrun" in err


def children_of(pid: int) -> list[int]:
    """The pids of a process's children (Linux /proc)."""
    found: list[int] = []
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_ranks_die_with_their_torchrun_agent(ipc_env, tmp_path):
    """torchrun starts each rank in a session of its own: when the agent was killed (SIGKILL, or
    the launcher's SIGKILL after its stop grace, shorter than torchrun's own), the ranks ran on,
    waiting for each other until the process group's timeout."""
    agent = python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                           "-m", "drbalance.runs.train_ddp", "--devices", "cpu", "--model", "alexnet",
                           "--batch-size", "4", "--iterations", "100000", "--epochs", "1", "--solo-time", "1000",
                           "--app", "orphan", "--no-progress", "--timeout", "600", "--report-every", "1",
                           "--image-size", "64",
                           env={"DRBALANCE_NO_MANAGER": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "logs" / "orphan.sd.jsonl"  # rank 0's session: written after both ranks set up
    try:
        wait_for(lambda: log.exists() and "report" in log.read_text(), timeout=180)  # training, past its start
        ranks = children_of(agent.pid)
        assert len(ranks) == 2, ranks
    finally:
        agent.kill()
        agent.wait(timeout=30)
    try:
        assert wait_for(lambda: not any(running(pid) for pid in ranks), timeout=90), ranks
    finally:  # had they outlived it, they would train on for good
        for pid in ranks:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
