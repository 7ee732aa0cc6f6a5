"""SD without a solo-run time: the online estimate of a job's solo iteration time,
its marks in the record and the SD log, and a session on emulated GPUs that estimates its own."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from drbalance.client import BalancedDataParallel, Session
from drbalance.client.emulated import EmulatedBackend
from drbalance.emu.gpus import remove_emulated_gpus
from drbalance.ipc.layout import AppState, AppStatus, SlotStatus
from drbalance.ratio import DataRatio
from drbalance.runs.launch import LaunchOptions, app_command
from drbalance.slowdown import IterationPlan, SlowdownTracker
from drbalance.solo_estimate import ALONE, SHARED, SlotSample, SoloEstimator, device_seconds_at
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario
from tests.conftest import python_process

COSTS = model_costs("resnet50")  # device time = fixed + per_sample x samples; host = 0.36 x device(batch)


def window(batch: int, sizes: list[int], stretch: list[float] | None = None,
           alone: list[bool | None] | None = None, parallel: bool = True) -> tuple[float, list[SlotSample | None]]:
    """One window of a job run by the cost model: its iteration time and its slots' chunks, each
    chunk stretched by ``stretch`` (sharing its GPU) and flagged ``alone``."""
    stretch = stretch or [1.0] * len(sizes)
    alone = alone or [True] * len(sizes)
    chunks = [COSTS.device_seconds(n) * factor for n, factor in zip(sizes, stretch)]
    replicas = sum(1 for n in sizes if n)
    busy = max(chunks) if parallel else sum(chunks)
    iteration = COSTS.host_seconds(batch) + COSTS.overhead_seconds(replicas) + busy
    slots = [SlotSample(seconds, n, flag) if n else None for seconds, n, flag in zip(chunks, sizes, alone)]
    return iteration, slots


def test_a_job_alone_on_one_gpu_measures_its_solo_iteration_exactly():
    iteration, slots = window(64, [64, 0])
    estimate = SoloEstimator().observe(iteration, 64, slots)
    assert estimate.basis == ALONE and not estimate.upper_bound  # measured: the SD is the SD
    assert estimate.iteration_seconds == pytest.approx(COSTS.solo_iteration(64))
    assert estimate.host_seconds == pytest.approx(COSTS.host_seconds(64))


def test_chunks_of_two_sizes_seen_alone_give_the_fixed_and_per_sample_cost():
    """Split over two GPUs, the job's chunks are half the batch: scaled in proportion they count
    the fixed cost twice; a second DR (other sizes) lets the line through them find it."""
    estimator = SoloEstimator()
    iteration, slots = window(64, [32, 32])
    first = estimator.observe(iteration, 64, slots)
    assert first.device_seconds == pytest.approx(2 * COSTS.device_seconds(32))  # proportional: too high
    assert first.upper_bound  # and marked so
    iteration, slots = window(64, [48, 16])
    second = estimator.observe(iteration, 64, slots)
    assert second.device_seconds == pytest.approx(COSTS.device_seconds(64))
    # the host time still holds DataParallel's overhead of the second replica: no single-replica window yet
    assert second.host_seconds == pytest.approx(COSTS.host_seconds(64) + COSTS.overhead_seconds(2))
    assert second.upper_bound
    iteration, slots = window(64, [0, 64])
    third = estimator.observe(iteration, 64, slots)
    assert third.iteration_seconds == pytest.approx(COSTS.solo_iteration(64)) and not third.upper_bound


def test_without_a_gpu_alone_the_least_contended_chunk_is_an_upper_bound():
    estimator = SoloEstimator()
    for stretch in (1.8, 1.3, 1.6):
        iteration, slots = window(64, [64, 0], stretch=[stretch, 1.0], alone=[False, None])
        estimate = estimator.observe(iteration, 64, slots)
    assert estimate.basis == SHARED and estimate.upper_bound
    assert estimate.device_seconds == pytest.approx(1.3 * COSTS.device_seconds(64))
    assert estimate.iteration_seconds > COSTS.solo_iteration(64)
    # a window alone replaces the bound by the measurement
    iteration, slots = window(64, [64, 0], alone=[True, None])
    measured = estimator.observe(iteration, 64, slots)
    assert measured.iteration_seconds == pytest.approx(COSTS.solo_iteration(64)) and not measured.upper_bound


def test_a_batch_seen_alone_is_the_device_time_and_the_cpu_path_stays_a_bound():
    """A chunk of the whole batch seen alone is measured, whatever other sizes say (a line through
    noisy small chunks could miss it); on the CPU path the backend cannot tell whether the device
    was shared, so the estimate stays an upper bound."""
    estimator = SoloEstimator()
    for sizes, stretch in (([16, 48], [1.0, 1.0]), ([64, 0], [1.0, 1.0]), ([40, 24], [1.5, 0.7])):
        iteration, slots = window(64, sizes, stretch=stretch)
        estimate = estimator.observe(iteration, 64, slots)
    assert estimate.device_seconds == pytest.approx(COSTS.device_seconds(64)) and not estimate.upper_bound
    cpu = SoloEstimator(parallel=False)
    iteration, slots = window(64, [64, 0], alone=[None, None], parallel=False)
    assert cpu.observe(iteration, 64, slots).upper_bound


def test_chunks_run_one_after_another_on_the_cpu_path():
    estimator = SoloEstimator(parallel=False)
    iteration, slots = window(64, [32, 32], alone=[None, None], parallel=False)
    estimate = estimator.observe(iteration, 64, slots)
    assert estimate.host_seconds == pytest.approx(COSTS.host_seconds(64) + COSTS.overhead_seconds(2))


def test_nothing_measured_gives_no_estimate_and_an_implausible_line_is_not_used():
    estimator = SoloEstimator()
    assert estimator.observe(None, 64, [SlotSample(0.1, 64, True)]) is None
    assert estimator.observe(0.2, 0, [SlotSample(0.1, 64, True)]) is None
    assert estimator.observe(0.2, 64, [None, SlotSample(0.0, 0.0, True)]) is None
    # times that fall with the chunk size (noise) give no negative per-sample cost: the median rate
    assert device_seconds_at(10, [(4, 0.5), (6, 0.4)]) == pytest.approx(10 * (0.5 / 4 + 0.4 / 6) / 2)


def test_a_tracker_without_a_solo_time_has_no_sd_until_it_gets_one():
    tracker = SlowdownTracker(IterationPlan(1, 10), None, start=0.0)
    tracker.iteration_finished(1.0)
    tracker.iteration_finished(2.0)
    assert tracker.mean_iteration_time == 1.0 and tracker.slowdown(2.0) is None
    tracker.set_solo_time(5.0)
    assert tracker.slowdown(2.0) == pytest.approx((2.0 + 8 * 1.0) / 5.0)
    tracker.extend(IterationPlan(2, 10))
    assert tracker.solo_time == pytest.approx(10.0)


def test_the_record_carries_the_estimated_flag():
    status = AppStatus(pid=1, app="a", state=AppState.RUNNING, ratio=DataRatio([10]), epoch=0, epochs=1,
                       iteration=3, iterations_total=10, iterations_per_epoch=10, notice_seq=1, slowdown=1.5,
                       iteration_time=0.2, solo_time=2.0, start_wall=1.0, updated_wall=2.0, updated_mono=3.0,
                       slots=(SlotStatus("GPU-x", 0.1, 8.0),), solo_estimated=True, solo_basis=SHARED)
    decoded = AppStatus.decode(status.encode(), "test")
    assert decoded.solo_estimated and decoded.sd_bound and decoded == status
    plain = AppStatus.decode(status.__class__(**{**status.__dict__, "solo_estimated": False,
                                                  "solo_basis": None}).encode(), "test")
    assert not plain.solo_estimated and not plain.sd_bound
    measured = AppStatus.decode(status.__class__(**{**status.__dict__, "solo_basis": ALONE}).encode(), "test")
    assert measured.solo_estimated and not measured.sd_bound


# --- a real session on emulated GPUs ------------------------------------------------------------------

TIME_SCALE = 10.0  # the modelled times x 10: about 0.07 s of host and 0.3 s of device time per iteration
BATCH = 16


@pytest.fixture
def emu(ipc_env, monkeypatch):
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    yield ipc_env
    remove_emulated_gpus(ipc_env, 2)


def train_estimating(app: str, log, ratio: list[int], iterations: int) -> Session:
    """A session without a solo time, training a small network on 2 emulated GPUs priced as ResNet-50."""
    torch.manual_seed(0)
    backend = EmulatedBackend(2, COSTS, time_scale=TIME_SCALE)
    model = BalancedDataParallel(nn.Linear(8, 2), ratio=ratio, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session(model, app, 1, iterations, sd_log=log, handle_sigterm=False, report_every=2)
    for _ in range(iterations):
        loss = model(torch.randn(BATCH, 8)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        session.step()
    session.close()
    backend.close()
    return session


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_session_without_a_solo_time_estimates_it_on_an_emulated_gpu_it_has_alone(emu, tmp_path):
    log = tmp_path / "alone.sd.jsonl"
    session = train_estimating("alone", log, [10, 0], 12)
    true_solo = 12 * COSTS.solo_iteration(BATCH) * TIME_SCALE
    assert session.estimator.estimate.basis == ALONE
    assert session.tracker.solo_time == pytest.approx(true_solo, rel=0.10)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["solo_time_source"] == "estimated"
    assert all(record["solo_estimated"] for record in records)
    assert records[0]["sd_bound"] and not records[-1]["sd_bound"]  # nothing measured yet; then the batch alone
    reports = [record for record in records if record["event"] == "report"]
    assert reports and reports[0]["solo_basis"] == ALONE and reports[0]["sd"] is not None
    final = records[-1]
    assert final["event"] == "closed" and final["solo_time"] == pytest.approx(true_solo, rel=0.10)
    # the SD is the real run time over the estimate: about 1 alone (the network's CPU work is left out)
    assert final["sd"] == pytest.approx(1.0, abs=0.15)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_emulated_gpu_another_process_holds_gives_a_shared_estimate(emu, tmp_path):
    holder = python_process("tests.helpers.emu_memory_holder", "0", str(2**20), str(24 * 2**30))
    try:
        assert holder.stdout.readline().strip() == "holding"
        session = train_estimating("beside", tmp_path / "beside.sd.jsonl", [10, 0], 6)
    finally:
        holder.kill()
        holder.wait()
    assert session.estimator.estimate.basis == SHARED and session.sd_bound
    # the holder runs nothing: the least chunk time is the solo one, marked as a bound
    assert session.tracker.solo_time == pytest.approx(6 * COSTS.solo_iteration(BATCH) * TIME_SCALE, rel=0.10)


def test_launch_estimate_solo_starts_the_apps_without_a_solo_time(tmp_path):
    scenario = Scenario("s", 2, (AppSpec("p", "resnet50", 32, 1, 4),))
    given = app_command(LaunchOptions(scenario, "fair", tmp_path, "emulated"), 0, "emulated:2")
    estimating = app_command(LaunchOptions(scenario, "fair", tmp_path, "emulated", estimate_solo=True), 0,
                             "emulated:2")
    solo = given.index("--solo-time")
    assert given[:solo] + given[solo + 2:] == estimating and "--solo-time" not in estimating
