"""examples/lightning_train.py and examples/accelerate_train.py, started as their users start them.

On the CPU with their default sizes: under torchrun, under ``accelerate launch``, without a
manager, and on emulated GPUs (``DRBALANCE_EMULATED_GPUS``) beside a real manager that samples
those emulated GPUs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from drbalance.jsonlog import read_json_lines
from tests.conftest import ROOT, leftovers, python_process, torchrun_args, wait_for
from tests.helpers.integration_checks import read_sd_log
from tests.helpers.processes import free_port

EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.timeout(300)


def run(command: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an example's command in ``cwd`` (Lightning writes its logs and checkpoints there); it must succeed."""
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, env=child_env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def torchrun(tmp_path: Path, script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
            str(EXAMPLES / script)]


def accelerate_launch(*options: str, script: str = "accelerate_train.py") -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLES / script)]


def planned_and_finished(app: str) -> dict:
    """The session's start line, after checking that it finished its plan and closed."""
    events = read_sd_log(app)
    assert [e["event"] for e in events][-2:] == ["finish", "closed"], [e["event"] for e in events]
    return events[0]


class EmulatedManager:
    """``drbalance-manager`` sampling 2 emulated GPUs of the test's namespace every 0.1 s."""

    def __init__(self, tmp_path: Path, names) -> None:
        self.log = tmp_path / "manager.jsonl"
        self.process = python_process("drbalance.manager.cli", "--source", "emulated:2", "--log", str(self.log),
                                      "--sample-period", "0.1", "--util-log-period", "0.2")
        wait_for(lambda: names.manager_status().exists() or self.process.poll() is not None, 60)
        assert self.process.poll() is None, self.process.communicate()

    def stop(self) -> list[dict]:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=60)
        assert self.process.returncode == 0
        return list(read_json_lines(self.log))


def check_the_manager_saw_both_emulated_gpus_busy(events: list[dict], app: str) -> None:
    assert [e["app"] for e in events if e["event"] == "app_added"] == [app]
    assert [e["reason"] for e in events if e["event"] == "app_removed"] == ["finished"]
    busiest = [max((e["util"][gpu] or 0) for e in events if e["event"] == "util") for gpu in (0, 1)]
    assert min(busiest) > 0, busiest  # each rank held its own emulated GPU for its modelled time


@pytest.mark.slow
def test_the_lightning_example_trains_two_ranks_under_torchrun_without_a_manager(ipc_env, tmp_path):
    result = run(torchrun(tmp_path, "lightning_train.py"), tmp_path)
    done = sorted(re.findall(r"rank (\d): done: 8 steps, final loss [0-9.]+", result.stdout))
    assert done == ["0", "1"], result.stdout[-3000:]
    start = planned_and_finished("lightning_logs-0")  # the app's name follows Lightning's logger
    assert (start["epochs"], start["iterations_per_epoch"]) == (2, 4)
    assert "none is running" in result.stderr  # trained on without a manager, and said so
    assert leftovers(ipc_env) == []


@pytest.mark.slow
@pytest.mark.parametrize("script, app", [("lightning_train.py", "lightning_logs-0"),
                                         ("accelerate_train.py", "accelerate_train")])
def test_an_example_on_emulated_gpus_under_torchrun_beside_a_manager(ipc_env, tmp_path, script, app):
    manager = EmulatedManager(tmp_path, ipc_env)
    try:
        run(torchrun(tmp_path, script), tmp_path, env={"DRBALANCE_EMULATED_GPUS": "2"})
    finally:
        events = manager.stop()
    check_the_manager_saw_both_emulated_gpus_busy(events, app)
    planned_and_finished(app)
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_the_accelerate_example_trains_two_processes_under_accelerate_launch(ipc_env, tmp_path):
    result = run(accelerate_launch("--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())),
                 tmp_path)
    shares = {int(m.group(1)): int(m.group(2)) for m in re.finditer(
        r"process (\d): done: 8 batches, final loss [0-9.]+, (\d+) samples in its last training batch", result.stdout)}
    assert set(shares) == {0, 1} and sum(shares.values()) == 16, result.stdout[-3000:]  # each global batch of 16
    assert len(re.findall(r"epoch \d: accuracy [0-9.]+ on held-out data", result.stdout)) == 2  # the main process
    start = planned_and_finished("accelerate_train")
    assert (start["epochs"], start["iterations_per_epoch"]) == (2, 4)
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_the_accelerate_example_started_as_one_cpu_process_trains_alone_and_says_so(ipc_env, tmp_path):
    # 'accelerate launch --cpu --num_processes 2' starts one process unless mpirun starts the others
    result = run(accelerate_launch("--cpu", "--num_processes", "2"), tmp_path)
    assert re.search(r"process 0: done: 8 batches, final loss [0-9.]+, 8 samples in its last training batch",
                     result.stdout), result.stdout[-3000:]
    assert "drbalance: one process has no ranks to balance" in result.stderr
    assert not (tmp_path / "logs" / "accelerate_train.sd.jsonl").exists()  # no session without ranks to balance
