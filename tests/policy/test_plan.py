"""The ``plan`` policy and its performance model on hand-written snapshots, and properties on random ones.

Times are seconds. Records are written as BalancedDataParallel's session writes them: an iteration
time and per-GPU chunk times and sizes of the app's last window.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drbalance.policy import POLICIES, AppView, PolicyConfig, Snapshot, violations
from drbalance.policy.base import Planner
from drbalance.policy.model import Model, ModelConfig
from drbalance.policy.plan import Layout, PlanConfig, PlanPolicy, Programme, options
from drbalance.ratio import DataRatio

BATCH = 32


class Truth:
    """Apps that follow the model's equations with known parameters (the test's own fixed point)."""

    def __init__(self, host, fixed, solo, speed, kappa, replica=0.0):
        self.host, self.fixed, self.solo, self.speed = host, fixed, solo, speed
        self.kappa, self.replica = kappa, replica

    def measure(self, layout: dict[str, DataRatio]) -> dict[str, tuple[float, list[float | None], tuple[int, ...]]]:
        """Per app: iteration seconds, chunk seconds per GPU and samples per GPU in ``layout``."""
        names = list(layout)
        samples = {name: layout[name].split(BATCH) for name in names}
        alone = {name: [(self.fixed[name] + (self.solo[name] - self.host[name] - self.fixed[name]) / BATCH * n)
                        / self.speed[g] if n else 0.0 for g, n in enumerate(samples[name])] for name in names}
        duty = {name: [0.0] * len(self.speed) for name in names}
        for _ in range(200):
            seconds, chunks = {}, {}
            for name in names:
                chunks[name] = [a * (1 + sum(self.kappa.get((name, other), 1.0) * duty[other][g]
                                             for other in names if other != name)) for g, a in enumerate(alone[name])]
                used = sum(1 for n in samples[name] if n)
                seconds[name] = self.host[name] + self.replica * (used - 1) + max(chunks[name])
            duty = {name: [c / seconds[name] for c in chunks[name]] for name in names}
        return {name: (seconds[name], [c if n else None for c, n in zip(chunks[name], samples[name])],
                       samples[name]) for name in names}


def views(truth: Truth, layout: dict[str, DataRatio], iteration: int, iterations: int = 10_000) -> list[AppView]:
    found = truth.measure(layout)
    result = []
    for name, (seconds, chunks, samples) in found.items():
        solo = truth.solo[name] * iterations
        sd = (iteration * seconds + (iterations - iteration) * seconds) / solo
        result.append(AppView(name, layout[name], sd, iteration=iteration, iterations_total=iterations,
                              iteration_time=seconds, solo_time=solo, batch=BATCH, chunk_seconds=tuple(chunks),
                              chunk_samples=tuple(float(n) for n in samples)))
    return result


def test_the_model_recovers_known_parameters_from_synthetic_measurements():
    truth = Truth(host={"a": 0.04, "b": 0.06}, fixed={"a": 0.03, "b": 0.05}, solo={"a": 0.2, "b": 0.3},
                  speed=[1.0, 0.5, 1.0], kappa={("a", "b"): 0.6, ("b", "a"): 0.8}, replica=0.02)
    model = Model(3, ModelConfig(history=12))
    b_apart = DataRatio([0, 0, 10])
    layouts = [{"a": DataRatio([10, 0, 0]), "b": b_apart}, {"a": DataRatio([0, 10, 0]), "b": b_apart},
               {"a": DataRatio([5, 5, 0]), "b": b_apart},
               {"a": DataRatio([10, 0, 0]), "b": DataRatio([10, 0, 0])}, {"a": DataRatio([3, 7, 0]), "b": b_apart}]
    iteration = 100
    for _ in range(5):  # the fits alternate (speeds, kappas, host and chunk times) and settle over a few rounds
        for layout in layouts:
            iteration += 50
            model.learn(views(truth, layout, iteration))
    a, b = model.apps["a"], model.apps["b"]
    assert a.host == pytest.approx(0.04, rel=0.05) and b.host == pytest.approx(0.06, rel=0.05)
    # from a's chunks of 16 and of 10 / 22 samples, through the GPU speeds' estimates (each prior pulls a little)
    assert a.fixed == pytest.approx(0.03, rel=0.15)
    assert a.replica == pytest.approx(0.02, rel=0.1)
    assert model.speed[0] == pytest.approx(1.0, rel=0.02) and model.speed[1] == pytest.approx(0.5, rel=0.05)
    assert model.kappa["a", "b"] == pytest.approx(0.6, abs=0.08)
    assert model.kappa["b", "a"] == pytest.approx(0.8, abs=0.08)
    # and it predicts a layout it never measured
    unseen = {"a": DataRatio([0, 0, 10]), "b": DataRatio([0, 0, 10])}
    seconds, _ = model.times(["a", "b"], np.array([unseen[n].split(BATCH) for n in ("a", "b")], dtype=float))
    measured = truth.measure(unseen)
    assert seconds[0] == pytest.approx(measured["a"][0], rel=0.05) and seconds[1] == pytest.approx(
        measured["b"][0], rel=0.05)


def _snapshot(truth, layout, iteration, gpus=2, iterations=10_000):
    return Snapshot(tuple(views(truth, layout, iteration, iterations)), (50.0,) * gpus, PolicyConfig(gpus))


def _learned(truth, layout, iteration=500, config=None):
    """A policy whose model has learned ``truth`` in ``layout``, and the layout's snapshot."""
    policy = PlanPolicy(config)
    snapshot = _snapshot(truth, layout, iteration)
    policy.model = Model(2, policy.config.model)
    for step in range(4):
        policy.model.learn(_snapshot(truth, layout, iteration - 40 + 10 * step).apps)
    return policy, snapshot


THREE = Truth(host={"a": 0.04, "b": 0.05, "c": 0.02}, fixed={"a": 0.03, "b": 0.04, "c": 0.01},
              solo={"a": 0.2, "b": 0.25, "c": 0.1}, speed=[1.0, 0.8], kappa={})


@pytest.mark.parametrize("gpus_of", list(itertools.product((0, 1), repeat=3)))
def test_the_solve_equals_brute_force_on_every_layout_of_3_apps_on_2_gpus(gpus_of):
    layout = {name: DataRatio.single(2, gpu) for name, gpu in zip("abc", gpus_of)}
    policy, snapshot = _learned(THREE, layout)
    plan_layout = Layout(snapshot, policy.model, policy.config.change_cost)
    choices = [options(view, ratio, snapshot.config, plan_layout.ratios)
               for view, ratio in zip(plan_layout.views, plan_layout.ratios)]
    programme = Programme.build(plan_layout, choices)
    best = min(value for value in (programme.value(columns) for columns in _covers(programme)) if value is not None)
    solved = programme.value(programme.solve(nodes=100_000, seconds=60.0))
    assert solved is not None and solved == pytest.approx(best, abs=1e-9)


def _covers(programme: Programme):
    """Every set of columns that changes each app exactly once (an option of its own is a column)."""
    count = len(programme.sd)
    def extend(start_app, used, chosen):
        if start_app == count:
            yield list(chosen)
            return
        if start_app in used:
            yield from extend(start_app + 1, used, chosen)
            return
        for column, movers in enumerate(programme.movers):
            if movers[0] == start_app and not used.intersection(movers):
                yield from extend(start_app + 1, used | set(movers), chosen + [column])
    yield from extend(0, set(), [])


def test_nothing_moves_without_the_margin():
    # a and b share GPU 0 while GPU 1 is idle: moving one of them there pays, by the model
    truth = Truth(host={"a": 0.05, "b": 0.05}, fixed={"a": 0.03, "b": 0.03}, solo={"a": 0.2, "b": 0.2},
                  speed=[1.0, 1.0], kappa={})
    layout = {"a": DataRatio([10, 0]), "b": DataRatio([10, 0])}
    policy, snapshot = _learned(truth, layout)
    policy.model.misses.clear()  # no prediction measured yet: the error is unknown
    assert math.isinf(policy.model.error)
    assert policy.plan("period", snapshot).changes == {}
    policy.model.misses.extend([0.01] * 5)  # a precise model: the move is made
    plan = policy.plan("period", snapshot)
    assert len(plan.changes) == 1 and next(iter(plan.changes.values())) == DataRatio([0, 10])
    assert policy.decide(next(iter(plan.changes)), "boundary", snapshot).ratio == DataRatio([0, 10])  # a lookup
    shaky, snapshot = _learned(truth, layout)
    shaky.model.misses.extend([0.9] * 5)  # a model that misses by 90%: its predicted gain is not enough
    plan = shaky.plan("period", snapshot)
    assert plan.changes == {} and plan.details["margin"] > plan.details["max_sd"][0] - plan.details["max_sd"][1]


def test_a_short_job_near_its_end_is_not_moved_for_a_small_gain():
    truth = Truth(host={"a": 0.05, "b": 0.05}, fixed={"a": 0.03, "b": 0.03}, solo={"a": 0.2, "b": 0.2},
                  speed=[1.0, 0.9, 1.0], kappa={})
    layout = {"a": DataRatio([0, 10, 0]), "b": DataRatio([10, 0, 0])}  # a alone on the slower GPU 1; GPU 2 idle
    config = PlanConfig(change_cost=20.0)  # a move costs 20 iterations' worth (a cold GPU, say)
    policy = PlanPolicy(config)
    policy.model = Model(3, config.model)
    for step in range(4):
        policy.model.learn(views(truth, layout, 9_950 + 5 * step))
    policy.model.misses.extend([0.001] * 5)

    def at(iteration):
        return Snapshot(tuple(views(truth, layout, iteration)), (50.0,) * 3, PolicyConfig(3))

    assert policy.plan("period", at(9_990)).changes == {}  # 10 iterations left: 0.15 s to win, 4 s to pay
    moved = policy.plan("period", at(1_000)).changes  # 9,000 left: a share on the idle GPU 2 pays
    assert set(moved) == {"a"} and moved["a"][2] > 0


def test_the_plan_policy_is_registered_as_a_planner():
    policy = POLICIES["plan"]()
    assert isinstance(policy, Planner) and policy.plan_period == PlanConfig().plan_period
    assert policy.plan("period", Snapshot((), (None, None), PolicyConfig(2))).changes == {}
    with pytest.raises(ValueError, match="plan_period"):
        PlanConfig(plan_period=0)
    with pytest.raises(ValueError, match="change_cost"):
        PlanConfig(change_cost=-1)


@st.composite
def servers(draw):
    gpus = draw(st.integers(2, 4))
    count = draw(st.integers(1, 6))
    apps = []
    for index in range(count):
        shares = draw(st.lists(st.integers(0, 10), min_size=gpus, max_size=gpus).filter(lambda s: sum(s) > 0))
        ratio = DataRatio.from_weights(shares, 10)
        allowed = draw(st.none() | st.just(tuple(ratio.used)))
        caps = draw(st.none() | st.lists(st.none() | st.integers(0, 10), min_size=gpus, max_size=gpus))
        minimum = 1 if allowed is not None and draw(st.booleans()) else 0
        view = AppView(f"a{index}", ratio, None, iteration=0, iterations_total=1000, solo_time=100.0, batch=32,
                       allowed=allowed, max_share=None if caps is None else tuple(caps), min_share=minimum)
        if violations(view, ratio, PolicyConfig(gpus)):
            continue  # the app's own DR must fit its constraints, as a record's does
        iteration_time = draw(st.floats(0.05, 1.0))
        chunks = tuple(draw(st.floats(0.01, 1.0)) if share else None for share in ratio.shares)
        apps.append(AppView(view.name, ratio, draw(st.floats(0.5, 5.0)), iteration=draw(st.integers(1, 900)),
                            iterations_total=1000, iteration_time=iteration_time, solo_time=100.0, batch=32,
                            chunk_seconds=chunks, chunk_samples=tuple(float(n) for n in ratio.split(32)),
                            allowed=allowed, max_share=view.max_share, min_share=minimum))
    return Snapshot(tuple(apps), (50.0,) * gpus, PolicyConfig(gpus))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(servers())
def test_every_planned_dr_respects_every_constraint(snapshot):
    policy = PlanPolicy()
    policy.plan("period", snapshot)
    policy.model.misses.extend([0.0] * 5)  # trust it: every plan the solve finds is applied
    for trigger in ("period", "arrival"):
        plan = policy.plan(trigger, snapshot)
        for name, ratio in plan.changes.items():
            view = snapshot.app(name)
            assert ratio != view.ratio and ratio.total == 10 and violations(view, ratio, snapshot.config) == []
    for view in snapshot.apps:
        decision = policy.decide(view.name, "boundary", snapshot)
        assert violations(view, decision.ratio, snapshot.config) == []
