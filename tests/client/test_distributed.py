"""BalancedDistributedDataParallel across real processes: gloo on the CPU, 2-4 ranks.

The gradient tests run ranks with ``torch.multiprocessing.spawn`` (tests/helpers/ddp_workers.py);
the manager tests run a real job under ``torchrun`` (tests/helpers/ddp_app.py) beside a real
manager over real POSIX IPC.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from drbalance.client.distributed import MAX_EXCHANGE_DELAY, MAX_EXCHANGE_INTERVAL, exchange_interval
from drbalance.jsonlog import read_json_lines
from drbalance.manager.daemon import Manager, ManagerSettings
from drbalance.manager.utilization import ScriptedSource
from tests.conftest import leftovers, python_process, torchrun_args, wait_for
from tests.helpers.ddp import ScriptPolicy, check_counting, read_ready, spawn
from tests.helpers.processes import ManagerProcess, kill_running

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_gradients_equal_the_full_batch_mean_for_uneven_and_changing_ratios(tmp_path):
    ranks = spawn("gradients", 3, tmp_path)
    steps = ranks[0]["steps"]
    # what ran: [1, 2, 7], then [5, 3, 2] set mid-epoch 0, then rank 0's [2, 2, 6] agreed mid-epoch 1
    assert [s["ratio"] for s in steps] == [[1, 2, 7]] * 3 + [[5, 3, 2]] * 3 + [[2, 2, 6]] * 2
    assert [s["sizes"] for s in steps][:4] == [[1, 2, 9]] * 3 + [[7, 4, 3]]  # 50 samples: the tail of 2 folded in
    # K pinned to 4: control exchanges at steps 0 and 4; at the others the counts rode in the gradients,
    # among them both DR changes and the change of global batch (12 -> 14 at step 3, back to 12 at 4)
    assert [s["exchanged"] for s in steps] == [True, False, False, False, True, False, False, False]
    for rank, found in enumerate(ranks):
        for step, mine in zip(steps, found["steps"]):
            assert (mine["index"], mine["ratio"], mine["sizes"], mine["exchanged"]) == (
                step["index"], step["ratio"], step["sizes"], step["exchanged"])
            assert mine["local"] == step["sizes"][rank] and mine["counts"] == step["sizes"]
            # the gradient after DDP's all-reduce is the gradient of the mean loss over the global batch
            assert mine["error"] <= 1e-6 * max(1.0, mine["scale"]), (rank, mine)
        assert found["parameters"] < 1e-5  # and 8 SGD steps later the weights still agree
        for epoch, seen in found["seen"].items():
            assert sorted(seen) == list(range(50)), epoch  # every sample once per epoch
        timings = found["timings"]  # carried by the last control exchange (step 4): of step 3
        assert [t[0] for t in timings] == [0, 1, 2] and [t[1] for t in timings] == steps[3]["sizes"]
        assert all(t[2] > 0 for t in timings)


@pytest.mark.slow
def test_equal_shares_match_plain_ddp_bit_for_bit_and_plain_ddp_gets_uneven_batches_wrong(tmp_path):
    ranks = spawn("plain_ddp", 2, tmp_path)
    for found in ranks:
        assert found["exchanged"] == [True, False, False, True]  # K pinned to 3: two counting steps
        assert found["identical"] == [0.0] * 4  # max |difference| of every gradient, four steps
        assert found["naive_error"] > 1e-3  # plain DDP's average of unequal local means: the wrong gradient


@pytest.mark.slow
def test_ranks_agree_on_rank_zeros_ratio_after_every_ranks_prefetch(tmp_path):
    ranks = spawn("agreement", 4, tmp_path)
    for rank, found in enumerate(ranks):
        assert "rank 2 was given ratio [7, 1, 1, 1]/10" in found["mismatch"] or rank == 2
        assert "give every rank" in found["mismatch"]
        assert found["starved"].startswith("rank 3 of the job: ratio [10, 0, 0, 0]/10 gives rank(s) [1, 2, 3] less")
        # rank r had produced 2 + r batches: the agreed DR starts after the furthest one, batch 5
        assert found["agreed"] == [[4, 3, 2, 1], 5]
        used = {index: ratio for index, ratio in found["used"]}
        assert used[5] == used[6] == [4, 3, 2, 1] and all(used[i] == [1, 2, 3, 4] for i in used if i < 5)
        assert found["kept"] is None
        # propose_ratio: rank 0's DR rides on the next step's counts; rank 3 had produced up to batch 9
        assert found["proposed"] == [[[2, 2, 3, 3], 10]] and found["after_proposal"] == [2, 2, 3, 3]
        assert found["uuids"] == [""] * 4 and found["labels"] == ["cpu"] * 4  # CPU ranks have no GPU UUID
        assert found["accumulated_counts"] == [2, 4, 6, 8]  # no_sync micro-batches counted together
        assert found["accumulated_error"] < 1e-6 and found["sum_error"] < 1e-6
        # K pinned to 3: rank 0 proposes at step 1, a counting step; nothing changes until the control
        # exchange of step 3, where every rank takes it from batch 7 (rank 3 had produced up to batch 6)
        between = found["between"]
        assert [s["exchanged"] for s in between["steps"]] == [True, False, False, True]
        assert [s["agreed"] for s in between["steps"]] == [[], [], [], [[[4, 3, 2, 1], 7]]]
        assert [s["ratio"] for s in between["steps"]] == [[1, 2, 3, 4]] * 3 + [[4, 3, 2, 1]]
        assert [s["plan"] for s in between["steps"]] == [[0, 3]] * 3 + [[3, 3]]
        used = dict((index, ratio) for index, ratio in between["used"])
        assert used[7] == used[8] == [4, 3, 2, 1] and all(used[i] == [1, 2, 3, 4] for i in used if i < 7)
    assert len({json.dumps(found["between"]["steps"]) for found in ranks}) == 1  # the same on every rank


@pytest.mark.slow
def test_counting_steps_give_the_full_batch_mean_and_every_rank_agrees_on_k(tmp_path):
    check_counting(spawn("counting", 3, tmp_path))


@pytest.mark.slow
def test_ranks_may_exit_right_after_their_last_backward(tmp_path):
    # A race, not a certainty: before drbalance.client.inflight, 4 of 30 such runs of 3 ranks aborted
    # (SIGABRT from a gloo thread that needed the GIL while Python finalised). Three runs here.
    for run in range(3):
        out = tmp_path / f"run{run}"
        out.mkdir()
        ranks = spawn("exit_after_backward", 3, out)  # raises ProcessExitedException on an abort
        assert [found["counts"] for found in ranks] == [[3, 1, 2]] * 3  # step 2's sizes, on every rank


def torchrun(log_dir: Path, ranks: int, *args: str):
    return python_process("torch.distributed.run", *torchrun_args(log_dir, ranks),
                          "-m", "tests.helpers.ddp_app", *args)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_a_manager_decision_reaches_every_rank_at_the_same_global_batch(ipc_env, tmp_path):
    util = tmp_path / "util.json"
    util.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [50, 50]}]}))
    settings = ManagerSettings(log_path=tmp_path / "manager.jsonl", sample_period=0.2)
    policy = ScriptPolicy("ddpjob", [[2, 8], [0, 10], [7, 3], [6, 4]])  # [0, 10] would starve rank 0
    manager = Manager(settings, ScriptedSource(util), policy=policy)
    manager.start()
    loop = threading.Thread(target=manager.run, daemon=True)
    loop.start()
    try:
        # the schedule below holds when each answer arrives within rank 0's bounded wait at its boundary;
        # the helper's 2 s wait ran out once in a full suite run beside other work (the DR then applied one
        # batch later). The wait ends as soon as the manager answers, so a long bound costs nothing here.
        job = torchrun(tmp_path / "torchrun", 2, "--app", "ddpjob", "--ratio", "5,5", "--epochs", "2",
                       "--iterations", "6", "--decide-every", "2", "--report-every", "1", "--exchange-every", "1",
                       "--exchange-timeout", "60")
        out, err = job.communicate(timeout=150)
    finally:
        manager.request_stop("test over")
        loop.join(timeout=30)
        manager.stop()
    assert job.returncode == 0, err[-3000:]
    lines = json_lines(out)
    steps = {rank: [line for line in lines if line.get("rank") == rank and "step" in line] for rank in (0, 1)}
    assert len(steps[0]) == len(steps[1]) == 12
    used = [(s["batch"], s["ratio"], s["sizes"]) for s in steps[0]]
    assert used == [(s["batch"], s["ratio"], s["sizes"]) for s in steps[1]]  # the same DR for every batch
    for s in steps[0] + steps[1]:
        assert s["counts"] == s["sizes"] and s["local"] == s["sizes"][s["rank"]]
    # K pinned to 1 (a control exchange every step): decisions at the boundaries after steps 2, 6 and 8
    # travel with the next step's exchange and apply from the next global batch not yet produced then
    # (steps 4, 8, 10); the daemon refused the
    # policy's [0, 10] at step 4 (the job's minimum share is 1), so [2, 8] stayed
    assert [ratio for _, ratio, _ in used] == [[5, 5]] * 3 + [[2, 8]] * 4 + [[7, 3]] * 2 + [[6, 4]] * 3
    events = list(read_json_lines(settings.log_path))
    added = [e for e in events if e["event"] == "app_added"]
    assert [(e["app"], e["pid"]) for e in added] == [("ddpjob", steps[0][0]["pid"])]  # one app: rank 0's record
    decided = [(e["branch"], e["new_dr"]) for e in events if e["event"] == "decision" and e["trigger"] == "boundary"]
    assert decided[:4] == [("script", [2, 8]), ("policy-error", [2, 8]), ("script", [7, 3]), ("script", [6, 4])]
    sd_log = list(read_json_lines(Path(os.environ["DRBALANCE_LOG_DIR"]) / "ddpjob.sd.jsonl"))
    applied = [e for e in sd_log if e["event"] == "applied"]
    assert [(e["from_batch"], e["applied_dr"]) for e in applied] == [(3, [2, 8]), (7, [7, 3]), (9, [6, 4])]
    # what the manager saw: one app, every rank at least 1 unit, the global batch, per-rank chunk times
    late = policy.views[-1]
    assert late.min_share == 1 and late.batch == 10
    assert late.chunk_samples is not None and len(late.chunk_samples) == 2 and min(late.chunk_samples) > 0
    assert all(seconds is not None and seconds > 0 for seconds in late.chunk_seconds)
    assert {e["pid"] for e in sd_log} == {steps[0][0]["pid"]}  # only rank 0 writes the SD log
    assert [e["reason"] for e in events if e["event"] == "app_removed"] == ["finished"]
    assert leftovers(ipc_env) == []


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_job_leaves_neither_the_manager_nor_other_jobs_stuck(ipc_env, tmp_path, victim):
    manager = ManagerProcess(tmp_path, ipc_env, (60, 40), "--policy", "observe")
    job = torchrun(tmp_path / "torchrun", 2, "--app", "ddpjob", "--epochs", "50", "--iterations", "10",
                   "--sleep", "0.05", "--decide-every", "2")
    neighbour = None
    try:
        pids = read_ready(job, 2, timeout=90)
        wait_for(lambda: [e for e in manager.events("app_added") if e["app"] == "ddpjob"], 30)
        neighbour = python_process("tests.helpers.toy_app", "--app", "neighbour", "--gpus", "2", "--epochs", "60",
                                   "--iterations", "2", "--sleep", "0.05")
        wait_for(lambda: [e for e in manager.events("decision") if e["app"] == "neighbour"], 60)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.time()
        job.communicate(timeout=90)  # torchrun notices, stops the other rank and exits
        assert job.returncode != 0
        removed = wait_for(lambda: [e for e in manager.events("app_removed") if e["app"] == "ddpjob"], 30)
        # rank 0 killed: its record is collected as "process gone"; rank 1 killed: rank 0 is stopped
        # by torchrun (SIGTERM) or fails in its next collective, and says goodbye ("finished")
        assert removed[0]["reason"] in ({"process gone"} if victim == 0 else {"finished", "process gone"})
        out, err = neighbour.communicate(timeout=120)
        assert neighbour.returncode == 0, err[-2000:]
        late = [e for e in manager.events("decision") if e["app"] == "neighbour" and e["t"] > killed]
        assert late, "the manager did not answer the other job after the kill"
        assert json_lines(out)[-1]["done"]
    finally:
        kill_running(job, neighbour)
        assert manager.stop()[0] == 0
    assert leftovers(ipc_env) == []


def test_drbalance_profile_refuses_a_job_of_several_ranks_on_every_rank(tmp_path):
    # the environment `drbalance profile` sets, around a real two-rank job over gloo: a solo-run
    # profile is one process on one GPU, so every rank's Session refuses, and no profile is written
    ranks = spawn("profile_refused", 2, tmp_path)
    for found in ranks:
        assert found["refused"] is not None and "single rank" in found["refused"], found
        assert "nproc_per_node 1" in found["refused"] and not found["written"]


@pytest.mark.slow
def test_a_bad_proposal_or_mixed_loss_reductions_are_refused_on_every_rank_and_the_ranks_stay_in_step(tmp_path):
    ranks = spawn("refused_inputs", 2, tmp_path)
    for found in ranks:
        assert "loss_reduction='sum' but rank" in found["reduction"] or "loss_reduction='mean'" in found["reduction"]
        assert "same loss_reduction" in found["reduction"]
        assert found["agreed"] == [[3, 7], 0]  # the valid proposal after the refused one reached every rank
        assert found["counts"] == [3, 7]  # and a training step ran: no rank was left inside a collective
    assert "agree_ratio's proposal" in ranks[0]["proposal"] and "less than 1 unit" in ranks[0]["proposal"]
    assert "refused on rank 0" in ranks[1]["proposal"] and "keeps" in ranks[1]["proposal"]


@pytest.mark.slow
def test_a_slow_rank_does_not_stretch_the_exchange_interval_past_about_a_second_of_steps(tmp_path):
    # rank 1 starts each step 20 ms late: rank 0's measured exchange cost includes that wait, and the
    # cost rule alone (cost / (0.5% of a ~1 ms compute step)) asked for K = 256 steps, over 5 s
    ranks = spawn("straggler", 2, tmp_path)
    assert ranks[0]["plans"] == ranks[1]["plans"]  # every rank agreed on the same K from the same values
    measured = [plan for plan in ranks[0]["plans"] if plan[4] > 0]
    assert measured, ranks[0]["plans"]
    for _step, interval, step_seconds, cost_seconds, wall_seconds in measured:
        # rank 0's steps last about as long as the late rank makes them (~21 ms against ~1 ms of its own
        # compute); not >= 0.02: a window that opens while rank 1 is mid-sleep measured 19.98 ms in CI
        assert wall_seconds >= 0.015
        assert interval == exchange_interval(step_seconds, cost_seconds, wall_seconds)
        assert interval <= max(1, MAX_EXCHANGE_DELAY / wall_seconds)  # K steps of rank 0 last at most ~1 s
        # so with steps of at least 15 ms, K is at most 66, far below the 256 the cost rule asked for
        assert interval <= MAX_EXCHANGE_DELAY / 0.015 < MAX_EXCHANGE_INTERVAL


def test_the_exchange_interval_rule_by_hand():
    assert exchange_interval(0.0, 0.004) == 1 and exchange_interval(0.004, 0.0) == 1  # unknown: every step
    assert exchange_interval(0.8, 0.004) == 1  # a 0.8 s step: 4 ms is 0.5% of it
    assert exchange_interval(0.004, 0.004) == 200  # a 4 ms step and a 4 ms exchange: 0.5% budget
    assert exchange_interval(0.004, 0.004, wall_seconds=0.004) == 200  # 200 steps of 4 ms: 0.8 s
    assert exchange_interval(0.002, 0.024) == MAX_EXCHANGE_INTERVAL  # a straggler's wait counted as cost
    assert exchange_interval(0.002, 0.024, wall_seconds=0.022) == 45  # ... bounded by 1 s of 22 ms steps
    assert exchange_interval(0.002, 0.024, wall_seconds=2.0) == 1  # steps over a second: every step


@pytest.mark.slow
def test_a_managers_dr_reaches_a_job_whose_own_dr_total_is_not_the_managers(ipc_env, tmp_path):
    """Weights ``[3, 1]`` make a DDP job's DR ``[9, 3]/12``; the manager decides at total 10. Its
    ``[4, 6]`` is proposed to the ranks and rides on the next control exchange, K steps later. The
    record showed the DR in force meanwhile, so the manager, deciding again before that exchange,
    saw ``[9, 3]`` still, kept it, and its keep (sent as the job has it, ``[9, 3]/12``) withdrew the
    proposal: the job trained 3:1 throughout, logging no ``applied``. The timing, not the total,
    lost it (a job at ``[5, 5]/10`` lost it the same way). The record now shows the proposal while
    it is on its way."""
    util = tmp_path / "util.json"
    util.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [50, 50]}]}))
    settings = ManagerSettings(log_path=tmp_path / "manager.jsonl", sample_period=0.2)
    policy = ScriptPolicy("ddpjob", [[4, 6]])  # then "keep": the DR the record shows
    manager = Manager(settings, ScriptedSource(util), policy=policy)
    manager.start()
    loop = threading.Thread(target=manager.run, daemon=True)
    loop.start()
    try:
        # K pinned above the steps between decisions: every decision comes before the exchange
        job = torchrun(tmp_path / "torchrun", 2, "--app", "ddpjob", "--ratio", "3,1", "--epochs", "2",
                       "--iterations", "8", "--decide-every", "2", "--report-every", "1", "--exchange-every", "5",
                       "--exchange-timeout", "60")
        out, err = job.communicate(timeout=150)
    finally:
        manager.request_stop("test over")
        loop.join(timeout=30)
        manager.stop()
    assert job.returncode == 0, err[-3000:]
    steps = [line for line in json_lines(out) if line.get("rank") == 0 and "step" in line]
    assert steps[0]["ratio"] == [9, 3]  # the job's own DR, at its own total
    sd_log = list(read_json_lines(Path(os.environ["DRBALANCE_LOG_DIR"]) / "ddpjob.sd.jsonl"))
    assert [e["applied_dr"] for e in sd_log if e["event"] == "applied"] == [[4, 6]]
    assert steps[-1]["ratio"] == [4, 6] and steps[-1]["sizes"] == [4, 6]
    events = list(read_json_lines(settings.log_path))
    kept = [e for e in events if e["event"] == "decision" and e["branch"] == "keep" and e["trigger"] == "boundary"]
    assert kept and all(e["old_dr"] == [4, 6] for e in kept)  # the manager counted the proposal as the job's
