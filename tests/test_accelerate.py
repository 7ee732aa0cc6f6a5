"""drbalance in Hugging Face Accelerate: ``BalancedAccelerator`` on 2 gloo processes under torchrun.

The jobs are tests/helpers/accelerate_job.py (a real Accelerate training loop: ``prepare``,
``accumulate``, ``backward``, ``gather_for_metrics``, ``save_state``/``load_state``); the manager is
the real daemon (in this process, with a scripted policy, or as its command-line program).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import leftovers, python_process, torchrun_args
from tests.helpers.integration_checks import (
    applied_ratios,
    check_each_sample_once_per_epoch,
    check_global_mean_gradients,
    expected_counts,
    finished,
    kill_a_rank_and_check_the_manager,
    read_manager_events,
    read_sd_log,
    scripted_manager,
)
from tests.test_ddp import ManagerProcess

pytestmark = pytest.mark.timeout(300)


def accelerate_job(tmp_path: Path, *args: str):
    return python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                          "-m", "tests.helpers.accelerate_job", "--out", str(tmp_path), *args)


def test_every_process_gets_the_global_batch_gradient_for_an_uneven_ratio_and_after_a_manager_change(
        ipc_env, tmp_path):
    manager, loop = scripted_manager(tmp_path, "acjob", [[2, 8], [6, 4]])
    try:
        # 60 samples, 5 per process in the user's loader: global batches of 10, 6 per epoch, split [3, 7] at first
        job = accelerate_job(tmp_path, "--ratio", "3,7", "--samples", "60", "--epochs", "2", "--decide-every", "2",
                             "--report-every", "1", "--exchange-every", "1", "--exchange-timeout", "60")
        ranks = finished(job, tmp_path)
    finally:
        manager.request_stop("test over")
        loop.join(timeout=30)
        manager.stop()
    steps = [found["balanced"]["steps"] for found in ranks]
    assert len(steps[0]) == len(steps[1]) == 12
    assert all(found["balanced"]["session_was_open"] for found in ranks)
    check_global_mean_gradients(steps, ranks[0]["data"])
    check_each_sample_once_per_epoch(steps, 60)
    applied = applied_ratios("acjob")
    assert [shares for _, shares in applied] == [[2, 8], [6, 4]]
    assert [step["counts"] for step in steps[0]] == expected_counts([3, 7], applied, 12, 10)
    assert [3, 7] in [step["counts"] for step in steps[0]] and [6, 4] in [step["counts"] for step in steps[0]]
    events = read_manager_events(tmp_path)
    assert [e["app"] for e in events if e["event"] == "app_added"] == ["acjob"]
    assert [e["reason"] for e in events if e["event"] == "app_removed"] == ["finished"]
    assert leftovers(ipc_env) == []


def test_equal_shares_train_as_plain_accelerate_with_accumulation_evaluation_and_a_restored_state(ipc_env, tmp_path):
    # both in the same two processes, from the same weights: 5 global batches per epoch, accumulate() over 2
    # (the last step of an epoch over 1), an in-order evaluation loader through gather_for_metrics, 2 epochs,
    # then save_state, and new accelerators that load_state and train to epoch 3
    job = accelerate_job(tmp_path, "--kind", "balanced,plain", "--samples", "50", "--epochs", "2",
                         "--resume-epochs", "3", "--accumulate", "2")
    ranks = finished(job, tmp_path)
    for found in ranks:
        ours, theirs = found["balanced"], found["plain"]
        assert len(ours["steps"]) == len(theirs["steps"]) == 6 and len(ours["resumed_steps"]) == 3
        for mine, plain in zip(ours["steps"] + ours["resumed_steps"], theirs["steps"] + theirs["resumed_steps"]):
            assert sorted(mine["ids"]) == sorted(plain["ids"])  # the same samples each step
            assert max(abs(a - b) for a, b in zip(mine["params"], plain["params"])) < 1e-6
            assert max(abs(a - b) for a, b in zip(mine["grads"], plain["grads"])) < 1e-6
        for name in ("params", "resumed"):
            assert max(abs(a - b) for a, b in zip(ours[name], theirs[name])) < 1e-6
        assert ours["val"] + ours["resumed_val"] == pytest.approx(theirs["val"] + theirs["resumed_val"], abs=1e-6)
    # the restored job's session starts at epoch 2 of 3 (the loader's epoch: set_epoch)
    starts = [e for e in read_sd_log("acjob") if e["event"] == "start"]
    assert [(e["epochs"], e["iterations_per_epoch"], e["start_epoch"]) for e in starts] == [(2, 5, 0), (3, 5, 2)]
    assert leftovers(ipc_env) == []


def test_a_process_killed_mid_run_leaves_the_manager_free_for_other_jobs(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    job = accelerate_job(tmp_path, "--epochs", "50", "--sleep", "0.05", "--decide-every", "2")
    kill_a_rank_and_check_the_manager(job, manager, "acjob", victim=1)
    assert leftovers(ipc_env) == []
