"""drbalance in PyTorch Lightning: ``Trainer(strategy="drbalance")`` on 2 gloo ranks under torchrun.

The jobs are tests/helpers/lightning_job.py (a real Trainer, a real LightningModule); the manager
is the real daemon (in this process, with a scripted policy, or as its command-line program).
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


def lightning_job(tmp_path: Path, *args: str):
    return python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                          "-m", "tests.helpers.lightning_job", "--out", str(tmp_path), *args)


def test_every_rank_gets_the_global_batch_gradient_for_an_uneven_ratio_and_after_a_manager_change(ipc_env, tmp_path):
    manager, loop = scripted_manager(tmp_path, "ltjob", [[2, 8], [6, 4]])
    try:
        # 60 samples, 5 per rank in the user's loader: global batches of 10, 6 per epoch, split [3, 7] at first;
        # a decision every 2 iterations; the long answer wait makes the schedule independent of the machine's load
        job = lightning_job(tmp_path, "--ratio", "3,7", "--samples", "60", "--epochs", "2", "--decide-every", "2",
                            "--report-every", "1", "--exchange-every", "1", "--exchange-timeout", "60")
        ranks = finished(job, tmp_path)
    finally:
        manager.request_stop("test over")
        loop.join(timeout=30)
        manager.stop()
    steps = [found["drbalance"]["steps"] for found in ranks]
    assert len(steps[0]) == len(steps[1]) == 12
    check_global_mean_gradients(steps, ranks[0]["data"])
    check_each_sample_once_per_epoch(steps, 60)
    applied = applied_ratios("ltjob")
    assert [shares for _, shares in applied] == [[2, 8], [6, 4]]  # both scripted DRs, in order
    # every rank split every global batch by the DR the schedule holds for it, switching at the same batch
    assert [step["counts"] for step in steps[0]] == expected_counts([3, 7], applied, 12, 10)
    assert [3, 7] in [step["counts"] for step in steps[0]] and [6, 4] in [step["counts"] for step in steps[0]]
    events = read_manager_events(tmp_path)
    assert [e["app"] for e in events if e["event"] == "app_added"] == ["ltjob"]
    assert [e["reason"] for e in events if e["event"] == "app_removed"] == ["finished"]
    assert leftovers(ipc_env) == []


def test_equal_shares_train_as_lightnings_ddp_with_accumulation_limits_validation_and_a_resumed_checkpoint(
        ipc_env, tmp_path):
    # both strategies in the same two processes, from the same weights: 4 of 5 batches per epoch (limit),
    # 2 batches per optimizer step, a validation loop, 2 epochs, then a new Trainer resumes to epoch 3
    job = lightning_job(tmp_path, "--strategy", "drbalance,ddp", "--samples", "50", "--epochs", "2",
                        "--resume-epochs", "3", "--accumulate", "2", "--limit", "4", "--val")
    ranks = finished(job, tmp_path)
    for found in ranks:
        ours, theirs = found["drbalance"], found["ddp"]
        assert len(ours["steps"]) == len(theirs["steps"]) == 4 and len(ours["resumed_steps"]) == 2
        for mine, plain in zip(ours["steps"] + ours["resumed_steps"], theirs["steps"] + theirs["resumed_steps"]):
            assert sorted(mine["ids"]) != [] and len(mine["ids"]) == len(plain["ids"])
            assert max(abs(a - b) for a, b in zip(mine["params"], plain["params"])) < 1e-6
            assert max(abs(a - b) for a, b in zip(mine["grads"], plain["grads"])) < 1e-6
        for name in ("first", "resumed"):
            assert max(abs(a - b) for a, b in zip(ours[name], theirs[name])) < 1e-6
        assert len(ours["val"]) == 2 and len(ours["resumed_val"]) == 1
        assert ours["val"] + ours["resumed_val"] == pytest.approx(theirs["val"] + theirs["resumed_val"], abs=1e-6)
        assert ours["resumed_from"] == "DrBalanceStrategy"
    # the resumed fit's session starts at epoch 2 of 3, 4 batches per epoch (limit_train_batches)
    starts = [e for e in read_sd_log("ltjob") if e["event"] == "start"]
    assert [(e["epochs"], e["iterations_per_epoch"], e["start_epoch"]) for e in starts] == [(2, 4, 0), (3, 4, 2)]
    assert leftovers(ipc_env) == []


def test_a_rank_killed_mid_fit_leaves_the_manager_free_for_other_jobs(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    job = lightning_job(tmp_path, "--epochs", "50", "--sleep", "0.05", "--decide-every", "2")
    kill_a_rank_and_check_the_manager(job, manager, "ltjob", victim=1)
    assert leftovers(ipc_env) == []
