"""drbalance in PyTorch Lightning and Hugging Face Accelerate: real jobs of 2 gloo ranks under torchrun.

The jobs are tests/helpers/lightning_job.py (a real ``Trainer`` with ``strategy="drbalance"``) and
tests/helpers/accelerate_job.py (a real Accelerate loop with ``BalancedAccelerator``); the manager
is the real daemon (in this process, with a scripted policy, or as its command-line program).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import leftovers, python_process, torchrun_args
from tests.helpers import integration_checks as checks
from tests.helpers.processes import ManagerProcess

pytestmark = pytest.mark.timeout(300)

JOBS = {"lightning": ("tests.helpers.lightning_job", "ltjob"), "accelerate": ("tests.helpers.accelerate_job", "acjob")}


def start(framework: str, tmp_path: Path, *args: str):
    """The framework's test job on 2 ranks under torchrun, writing its findings into ``tmp_path``."""
    return python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                          "-m", JOBS[framework][0], "--out", str(tmp_path), *args)


@pytest.mark.slow
@pytest.mark.parametrize("framework", JOBS)
def test_every_rank_gets_the_global_batch_gradient_for_an_uneven_ratio_and_after_a_manager_change(
        ipc_env, tmp_path, framework):
    app = JOBS[framework][1]
    manager, loop = checks.scripted_manager(tmp_path, app, [[2, 8], [6, 4]])
    try:
        # 60 samples, 5 per rank in the user's loader: global batches of 10, 6 per epoch, split [3, 7] at first;
        # a decision every 2 iterations; the long answer wait makes the schedule independent of the machine's load
        job = start(framework, tmp_path, "--ratio", "3,7", "--samples", "60", "--epochs", "2", "--decide-every", "2",
                    "--report-every", "1", "--exchange-every", "1", "--exchange-timeout", "60")
        ranks = checks.finished(job, tmp_path)
    finally:
        manager.request_stop("test over")
        loop.join(timeout=30)
        manager.stop()
    steps = [found["drbalance"]["steps"] for found in ranks]
    assert len(steps[0]) == len(steps[1]) == 12
    checks.check_global_mean_gradients(steps, ranks[0]["data"])
    checks.check_each_sample_once_per_epoch(steps, 60)
    applied = checks.applied_ratios(app)
    assert [shares for _, shares in applied] == [[2, 8], [6, 4]]  # both scripted DRs, in order
    # every rank split every global batch by the DR the schedule holds for it, switching at the same batch
    counts = [step["counts"] for step in steps[0]]
    assert counts == checks.expected_counts([3, 7], applied, 12, 10)
    assert [3, 7] in counts and [2, 8] in counts and [6, 4] in counts
    events = checks.read_manager_events(tmp_path)
    assert [e["app"] for e in events if e["event"] == "app_added"] == [app]
    assert [e["reason"] for e in events if e["event"] == "app_removed"] == ["finished"]
    assert leftovers(ipc_env) == []


@pytest.mark.slow
@pytest.mark.parametrize("framework", JOBS)
def test_a_rank_killed_mid_run_leaves_the_manager_free_for_other_jobs(ipc_env, tmp_path, framework):
    manager = ManagerProcess(tmp_path, ipc_env, (60, 40), "--policy", "observe")
    job = start(framework, tmp_path, "--epochs", "50", "--sleep", "0.05", "--decide-every", "2")
    checks.kill_a_rank_and_check_the_manager(job, manager, JOBS[framework][1], victim=1)
    assert leftovers(ipc_env) == []


def check_same_training(ours: dict, theirs: dict, final: str) -> None:
    """Every step's parameters and gradients, the final parameters and the validation losses agree to 1e-6."""
    assert len(ours["steps"]) == len(theirs["steps"]) and len(ours["resumed_steps"]) == len(theirs["resumed_steps"])
    for mine, plain in zip(ours["steps"] + ours["resumed_steps"], theirs["steps"] + theirs["resumed_steps"]):
        assert len(mine["ids"]) == len(plain["ids"]) > 0
        assert max(abs(a - b) for a, b in zip(mine["params"], plain["params"])) < 1e-6
        assert max(abs(a - b) for a, b in zip(mine["grads"], plain["grads"])) < 1e-6
    for name in (final, "resumed"):
        assert max(abs(a - b) for a, b in zip(ours[name], theirs[name])) < 1e-6
    assert ours["val"] + ours["resumed_val"] == pytest.approx(theirs["val"] + theirs["resumed_val"], abs=1e-6)


@pytest.mark.slow
def test_equal_shares_train_as_lightnings_ddp_with_accumulation_limits_validation_and_a_resumed_checkpoint(
        ipc_env, tmp_path):
    # both strategies in the same two processes, from the same weights: 4 of 5 batches per epoch (limit),
    # 2 batches per optimizer step, a validation loop, 2 epochs, then a new Trainer resumes to epoch 3
    job = start("lightning", tmp_path, "--strategy", "drbalance,ddp", "--samples", "50", "--epochs", "2",
                "--resume-epochs", "3", "--accumulate", "2", "--limit", "4", "--val")
    for found in checks.finished(job, tmp_path):
        ours, theirs = found["drbalance"], found["ddp"]
        assert len(ours["steps"]) == 4 and len(ours["resumed_steps"]) == 2
        assert len(ours["val"]) == 2 and len(ours["resumed_val"]) == 1
        assert ours["resumed_from"] == "DrBalanceStrategy"
        check_same_training(ours, theirs, "first")
    # the resumed fit's session starts at epoch 2 of 3, 4 batches per epoch (limit_train_batches)
    starts = [e for e in checks.read_sd_log("ltjob") if e["event"] == "start"]
    assert [(e["epochs"], e["iterations_per_epoch"], e["start_epoch"]) for e in starts] == [(2, 4, 0), (3, 4, 2)]
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_equal_shares_train_as_plain_accelerate_with_accumulation_evaluation_and_a_restored_state(ipc_env, tmp_path):
    # both in the same two processes, from the same weights: 5 global batches per epoch, accumulate() over 2
    # (the last step of an epoch over 1), an in-order evaluation loader through gather_for_metrics, 2 epochs,
    # then save_state, and new accelerators that load_state and train to epoch 3
    job = start("accelerate", tmp_path, "--kind", "drbalance,plain", "--samples", "50", "--epochs", "2",
                "--resume-epochs", "3", "--accumulate", "2")
    for found in checks.finished(job, tmp_path):
        ours, theirs = found["drbalance"], found["plain"]
        assert len(ours["steps"]) == 6 and len(ours["resumed_steps"]) == 3 and ours["session_was_open"]
        for mine, plain in zip(ours["steps"], theirs["steps"]):
            assert sorted(mine["ids"]) == sorted(plain["ids"])  # the same samples each step
        check_same_training(ours, theirs, "params")
    # the restored job's session starts at epoch 2 of 3 (the loader's epoch: set_epoch)
    starts = [e for e in checks.read_sd_log("acjob") if e["event"] == "start"]
    assert [(e["epochs"], e["iterations_per_epoch"], e["start_epoch"]) for e in starts] == [(2, 5, 0), (3, 5, 2)]
    assert leftovers(ipc_env) == []
