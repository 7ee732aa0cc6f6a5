"""The training scripts when their app name is taken: one line saying so, not a traceback."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import python_process, torchrun_args

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_a_ddp_job_whose_app_name_is_taken_says_so_in_one_line(ipc_env, tmp_path):
    holder = python_process("tests.helpers.idle_app", "taken")  # a live app of that name, same namespace
    try:
        assert holder.stdout.readline().split()[0] == "ready"
        job = python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                             "-m", "drbalance.runs.train_ddp", "--devices", "cpu", "--model", "alexnet",
                             "--batch-size", "4", "--iterations", "2", "--epochs", "1", "--solo-time", "10",
                             "--app", "taken", "--no-progress")
        _, err = job.communicate(timeout=200)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert job.returncode != 0
    assert "train_ddp: error (rank 0): an app named 'taken' is already running" in err, err[-3000:]
    assert "AppNameInUse" not in err, err[-3000:]  # no traceback of rank 0's refusal


@pytest.mark.slow
def test_a_dataparallel_job_whose_app_name_is_taken_says_so_in_one_line(ipc_env):
    holder = python_process("tests.helpers.idle_app", "taken-dp")
    try:
        assert holder.stdout.readline().split()[0] == "ready"
        job = python_process("drbalance.runs.train", "--devices", "cpu", "--model", "alexnet", "--batch-size", "4",
                             "--iterations", "2", "--epochs", "1", "--solo-time", "10", "--app", "taken-dp",
                             "--no-progress")
        _, err = job.communicate(timeout=200)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert job.returncode == 2
    assert "drbalance.runs.train: error: an app named 'taken-dp' is already running" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
