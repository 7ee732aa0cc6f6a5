"""``fair`` measures the solo time of a job whose own estimate is still a bound (``_measure_solo``):
the job, split over several GPUs, goes whole onto one of them that nobody else uses for a window."""

from __future__ import annotations

from drbalance.policy import AppView, PolicyConfig, Snapshot
from drbalance.policy.fair import FairPolicy
from drbalance.ratio import DataRatio

ITERATIONS = 1000
BATCH = 8
HOST = 0.010  # seconds per iteration of host work, one replica
FIXED, PER_SAMPLE = 0.003, 0.0002  # a chunk's device seconds: fixed + per sample
REPLICA = 0.0115  # DataParallel's seconds per extra replica: a small model, where replicas cost most
SOLO_ITERATION = HOST + FIXED + PER_SAMPLE * BATCH  # 0.0146 s: alone on one GPU


def chunk(samples: int, per_sample: float = PER_SAMPLE) -> float:
    return FIXED + per_sample * samples if samples else 0.0


def measured(name: str, shares: list[int], iteration: int, solo_iteration: float, basis: str | None,
             replica: float = REPLICA, per_sample: float = PER_SAMPLE) -> AppView:
    """The app as its record shows it after a window under ``shares``: the emulated model's times."""
    ratio = DataRatio(shares)
    sizes = ratio.split(BATCH)
    chunks = [chunk(n, per_sample) for n in sizes]
    used = sum(1 for n in sizes if n)
    iteration_time = HOST + replica * (used - 1) + max(chunks)
    solo_time = ITERATIONS * solo_iteration
    slowdown = (iteration * iteration_time + (ITERATIONS - iteration) * iteration_time) / solo_time
    return AppView(name, ratio, slowdown, iteration=iteration, iterations_total=ITERATIONS,
                   iteration_time=iteration_time, solo_time=solo_time, batch=BATCH, solo_basis=basis,
                   chunk_seconds=tuple(c if n else None for c, n in zip(chunks, sizes)),
                   chunk_samples=tuple(float(n) for n in sizes))


def bound(shares: list[int]) -> float:
    """The job's own estimate from equal chunks (``drbalance.solo_estimate``): the host time of
    several replicas plus the chunk scaled to the batch: an upper bound."""
    sizes = DataRatio(shares).split(BATCH)
    used = [n for n in sizes if n]
    iteration = HOST + REPLICA * (len(used) - 1) + chunk(max(used))
    return iteration - chunk(max(used)) + chunk(max(used)) * BATCH / max(used)


def snapshot(*apps: AppView, gpus: int = 4) -> Snapshot:
    return Snapshot(tuple(apps), (0.0,) * gpus, PolicyConfig(gpus))


SPREAD = [3, 3, 2, 2]


def test_a_split_job_whose_solo_time_is_a_bound_goes_whole_onto_one_of_its_gpus_once():
    assert bound(SPREAD) > 3.5 * SOLO_ITERATION  # what the job's estimate says: far too high
    policy = FairPolicy()
    first = policy.decide("a", "boundary", snapshot(measured("a", SPREAD, 100, bound(SPREAD), "shared")))
    assert first.branch == "measure-solo" and first.ratio == DataRatio.single(4, 0, 10)
    # its window alone on GPU 0 measured the solo time: the job's estimate is now the solo iteration
    after = measured("a", [10, 0, 0, 0], 140, SOLO_ITERATION, "alone")
    second = policy.decide("a", "boundary", snapshot(after))
    assert second.ratio == DataRatio.single(4, 0, 10) and second.branch != "revert"
    later = measured("a", [10, 0, 0, 0], 180, SOLO_ITERATION, "alone")
    assert policy.decide("a", "boundary", snapshot(later)).ratio == DataRatio.single(4, 0, 10)


def test_in_its_closing_windows_but_not_in_its_last():
    """A short job is measured in its closing windows (else it ends on its bound), but not with less
    than the window the measurement takes left: the move could not be judged and undone."""
    closing = measured("a", SPREAD, ITERATIONS - 30, bound(SPREAD), "shared")  # 1.5 windows left
    assert FairPolicy().decide("a", "boundary", snapshot(closing)).branch == "measure-solo"
    last = measured("a", SPREAD, ITERATIONS - 15, bound(SPREAD), "shared")  # 0.75 of a window left
    assert FairPolicy().decide("a", "boundary", snapshot(last)).branch != "measure-solo"


def test_a_job_that_runs_faster_split_goes_back_and_is_not_measured_again():
    large = {"replica": 0.0005, "per_sample": 0.02}  # a large model: replicas cost little, samples much
    solo = HOST + chunk(BATCH, large["per_sample"])
    spread = measured("a", SPREAD, 100, 2 * solo, "shared", **large)
    policy = FairPolicy()
    assert policy.decide("a", "boundary", snapshot(spread)).branch == "measure-solo"
    alone = measured("a", [10, 0, 0, 0], 140, solo, "alone", **large)
    assert alone.iteration_time > 2 * spread.iteration_time  # one GPU measured far slower
    back = policy.decide("a", "boundary", snapshot(alone))
    assert back.branch == "revert" and back.ratio == DataRatio(SPREAD)
    for iteration in (180, 220, 260):
        again = measured("a", SPREAD, iteration, solo, "alone", **large)
        assert policy.decide("a", "boundary", snapshot(again)).ratio == DataRatio(SPREAD)
    bound_again = measured("a", SPREAD, 300, 2 * solo, "shared", **large)  # were its estimate a bound again
    assert policy.decide("a", "boundary", snapshot(bound_again)).branch != "measure-solo"


def test_a_job_with_a_solo_time_given_or_measured_is_not_moved_to_measure_it():
    for basis in (None, "alone", "manager"):
        view = measured("a", SPREAD, 100, SOLO_ITERATION, basis, replica=0.0005)
        assert FairPolicy().decide("a", "boundary", snapshot(view)).branch != "measure-solo"


def test_only_onto_a_gpu_that_no_other_app_uses():
    other = measured("b", [0, 0, 10, 0], 100, SOLO_ITERATION, None)
    mine = measured("a", [2, 0, 5, 3], 100, bound([2, 0, 5, 3]), "shared")
    decision = FairPolicy().decide("a", "boundary", snapshot(mine, other))
    assert decision.branch == "measure-solo" and decision.ratio == DataRatio.single(4, 3, 10)  # not GPU 2
    crowded = measured("b", [0, 0, 5, 5], 100, SOLO_ITERATION, None)
    split = measured("a", [0, 0, 5, 5], 100, bound([0, 0, 5, 5]), "shared")
    assert FairPolicy().decide("a", "boundary", snapshot(split, crowded)).branch != "measure-solo"
