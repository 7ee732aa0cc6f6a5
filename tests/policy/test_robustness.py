"""Every policy on anything a snapshot can legally hold, and on sequences of snapshots.

The manager validates records (``drbalance/ipc/layout.py``) only so far: times finite and >= 0
(a solo-run time > 0), SDs finite and >= 0, chunk samples finite and >= 0, a batch of any 32-bit
count, planned iterations of any 64-bit count, a minimum share up to the DR total; a GPU's
utilisation 0..100 or None. No value within that may make a policy raise, return a DR that breaks
the server or the app's constraints, or leave its learned state infinite or NaN.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drbalance.policy import AppView, PolicyConfig, Snapshot, violations
from drbalance.policy.fair import FairPolicy
from drbalance.policy.fsched import FSchedPolicy
from drbalance.policy.paper import PaperPolicy
from drbalance.ratio import DataRatio

LARGEST = 1.7976931348623157e308
SMALLEST = 5e-324


def measured(name, shares, chunks, iteration_time, sd=1.2, batch=32, **extra):
    """An app of 1000 planned iterations, solo 0.15 s each, measured with these chunk times."""
    ratio = DataRatio(shares)
    sizes = ratio.split(batch)
    return AppView(name, ratio, sd, iteration=100, iterations_total=1000, iteration_time=iteration_time,
                   solo_time=150.0, batch=batch, chunk_seconds=tuple(c if n else None for c, n in zip(chunks, sizes)),
                   chunk_samples=tuple(float(n) for n in sizes), **extra)


def snap(*apps, gpus=2):
    return Snapshot(tuple(apps), (50.0,) * gpus, PolicyConfig(gpus))


def assert_sound(policy):
    predictor = getattr(policy, "predictor", None)
    if predictor is None:
        return
    assert all(math.isfinite(speed) and speed > 0 for speed in predictor.speed), predictor.speed
    for learned in predictor.kappa.values():
        assert all(0.0 <= kappa <= 10.0 for kappa in learned.values()), learned
    for model in predictor.apps.values():
        assert model.solo_iteration > 0 and math.isfinite(model.solo_iteration)
        assert 0 < model.correction < math.inf
    assert 0.0 <= predictor.replica_penalty <= predictor.config.replica_penalty_max
    assert math.isfinite(policy.error) and math.isfinite(policy.novel_error)


@pytest.mark.parametrize("policy", [FairPolicy, FSchedPolicy])
def test_a_chunk_time_tiny_against_the_apps_work_leaves_every_gpu_a_finite_speed(policy):
    policy = policy()
    # a's record: a chunk and an iteration of 5e-324 s alone on GPU 0 (finite and >= 0: valid)
    tiny = measured("a", [10, 0], [SMALLEST, 0], SMALLEST)
    other = measured("c", [0, 10], [0, 0.1], 0.15)
    policy.decide("a", "boundary", snap(tiny, other))
    assert_sound(policy)  # GPU 0's speed is not inf
    # ...and no decision of an app beside a on GPU 0 is a ZeroDivisionError
    policy.decide("b", "boundary", snap(tiny, measured("b", [10, 0], [0.2, 0], 0.3), other))
    assert_sound(policy)


@pytest.mark.parametrize("policy", [FairPolicy, FSchedPolicy])
@pytest.mark.parametrize("solo_time, iterations", [(LARGEST, 1), (SMALLEST, 495)])
def test_a_solo_time_at_the_ends_of_the_floats_gives_a_decision(policy, solo_time, iterations):
    # its decision window was inf or 0 s: the Decision refused it (ValueError) at every decision
    app = AppView("a", DataRatio([10, 0]), 1.5, iteration=10, iterations_total=iterations, solo_time=solo_time)
    decision = policy().decide("a", "boundary", snap(app))
    assert decision.next_boundary is None and decision.ratio == app.ratio
    # a solo iteration that rounds to 0 s divided the consolidation plans' duties by it
    tiny = replace(measured("t", [5, 5], [0.07, 0.07], 0.2), solo_time=SMALLEST, iterations_total=2)
    policy().decide("t", "boundary", snap(tiny, replace(measured("u", [5, 5], [0.07, 0.07], 0.2), solo_time=SMALLEST)))


def test_f_sched_judges_sds_whose_squares_overflow():
    # an SD of 1e300 (finite: valid) made the variance's ** 2 raise OverflowError
    crowd = (measured("b", [10, 0], [0.2, 0], 0.3, sd=1e300), measured("c", [0, 10], [0, 0.1], 0.15, sd=1.0))
    decision = FSchedPolicy().decide("b", "boundary", snap(*crowd))
    assert decision.ratio.total == 10


# --- random snapshot sequences -------------------------------------------------------------------

EXTREMES = st.sampled_from([0.0, SMALLEST, 1e-300, 1e-9, 1e9, 1e300, LARGEST])


def times(low, high, zero=True):
    """A time as a record may hold it: mostly plausible, sometimes anything finite and >= 0."""
    extremes = EXTREMES if zero else EXTREMES.filter(lambda value: value > 0)
    return st.one_of(st.floats(low, high), st.floats(low, high), extremes)


@st.composite
def app_views(draw, name, gpus, total):
    """An app as the manager's table gives it: its DR only on the GPUs it has devices on."""
    allowed = sorted(draw(st.sets(st.integers(0, gpus - 1), min_size=1, max_size=gpus)))
    weights = [draw(st.integers(0, 5)) if gpu in allowed else 0 for gpu in range(gpus)]
    weights[allowed[0]] += 0 if any(weights) else 1
    ratio = DataRatio.from_weights(weights, draw(st.sampled_from([total, total, 1, 4, 100, 65535])))
    planned = draw(st.one_of(st.integers(1, 5000), st.sampled_from([1, 2, 2**40, 2**63])))
    iteration_time = draw(st.one_of(st.none(), times(0.01, 2.0)))
    chunks = samples = None
    if iteration_time is not None and draw(st.booleans()):
        chunks = tuple(draw(st.one_of(st.none(), times(0.001, 1.0))) if gpu in allowed else None
                       for gpu in range(gpus))
        samples = tuple(draw(times(0.0, 64.0)) if gpu in allowed else 0.0 for gpu in range(gpus))
    caps = st.one_of(st.none(), st.integers(0, total))
    return AppView(
        name, ratio, draw(st.one_of(st.none(), times(0.5, 4.0))), pid=draw(st.integers(1, 3)),
        epoch=draw(st.integers(0, 3)), iteration=draw(st.integers(0, min(planned, 10**6))), iterations_total=planned,
        iteration_time=iteration_time, solo_time=draw(times(1.0, 1000.0, zero=False)),
        allowed=None if len(allowed) == gpus else tuple(allowed),
        min_share=draw(st.one_of(st.just(0), st.just(0), st.integers(0, total))),
        max_share=draw(st.one_of(st.none(), st.tuples(*[caps] * gpus))),
        chunk_seconds=chunks, chunk_samples=samples,
        batch=draw(st.one_of(st.none(), st.integers(1, 256), st.sampled_from([1, 2**32 - 1]))),
    )


@st.composite
def sequences(draw):
    """Snapshots of one server, apps coming, going and coming back under the same names."""
    gpus = draw(st.integers(1, 4))
    total = draw(st.sampled_from([10, 10, 1, 4, 100]))
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        names = sorted(draw(st.sets(st.sampled_from("abcde"), min_size=1, max_size=5)))
        apps = tuple(draw(app_views(name, gpus, total)) for name in names)
        util = tuple(draw(st.one_of(st.none(), st.floats(0, 100))) for _ in range(gpus))
        steps.append((Snapshot(apps, util, PolicyConfig(gpus, total)), draw(st.sampled_from(names)),
                      draw(st.sampled_from(["register", "boundary", "boundary"]))))
    return steps


def check_decision(snapshot, name, decision):
    config = snapshot.config
    for app, ratio in ((name, decision.ratio), *decision.others.items()):
        view = snapshot.app(app)
        if ratio != view.ratio:  # a change: of this server and total, within the app's constraints
            assert len(ratio) == config.gpu_count and ratio.total == config.dr_total
            assert not violations(view, ratio, config), (app, ratio, violations(view, ratio, config))
    assert name not in decision.others


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", [FairPolicy, FSchedPolicy, PaperPolicy])
def test_random_snapshot_sequences_with_any_legal_values(policy):
    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(sequences())
    def run(steps):
        deciding = policy()
        for snapshot, name, trigger in steps:
            started = time.perf_counter()
            decision = deciding.decide(name, trigger, snapshot)
            assert time.perf_counter() - started < 1.0
            check_decision(snapshot, name, decision)
            assert_sound(deciding)

    run()
