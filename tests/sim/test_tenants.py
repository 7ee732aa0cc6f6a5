"""Per-user managers in the simulator: each user's policy sees and moves only its user's apps."""

from __future__ import annotations

from collections import Counter

import pytest

from drbalance.policy import Decision, PolicyConfig, Snapshot
from drbalance.policy.base import AppView
from drbalance.policy.fair import FairPolicy
from drbalance.ratio import DataRatio
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.tenants import PerUserPolicy, deal
from drbalance.workload.scenarios import SCENARIOS

pytestmark = pytest.mark.timeout(120)

SHORT_A = SCENARIOS["a"].scaled(0.1, name="a-short")  # (a) with a tenth of its iterations: under a second


class Recording:
    """A real FairPolicy whose every input and answer is kept (what one user's manager saw and did)."""

    name = "fair"

    def __init__(self) -> None:
        self.inner = FairPolicy()
        self.seen: list[tuple[str, Snapshot, Decision]] = []

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        decision = self.inner.decide(app, trigger, snapshot)
        self.seen.append((app, snapshot, decision))
        return decision


class Grabbing:
    """A policy that pushes its user's GPU to every app of the server, its own user's or not
    (as if it knew their names): what the wrapper must not let through."""

    name = "grabbing"

    def __init__(self, gpu: int, every_app: list[str]) -> None:
        self.gpu, self.every_app = gpu, every_app

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        config = snapshot.config
        mine = DataRatio.single(config.gpu_count, self.gpu, config.dr_total)
        others = {name: mine for name in self.every_app if name != app}
        return Decision(app, snapshot.app(app).ratio, "grab", others=others)


def _view(name: str, gpu: int, gpus: int = 4) -> AppView:
    return AppView(name, DataRatio.single(gpus, gpu), 1.2, iteration=10, iterations_total=100, iteration_time=0.1,
                   solo_time=10.0, chunk_seconds=tuple(0.05 if g == gpu else None for g in range(gpus)),
                   chunk_samples=tuple(32.0 if g == gpu else 0.0 for g in range(gpus)), batch=32)


def test_each_user_sees_only_its_apps_and_every_gpus_utilisation():
    snapshot = Snapshot((_view("a1", 0), _view("b1", 1), _view("a2", 2), _view("b2", 3)), (90.0, 80.0, 10.0, 70.0),
                        PolicyConfig(4))
    wrapper = PerUserPolicy({"a1": "alice", "a2": "alice", "b1": "bob", "b2": "bob"}, Recording)
    wrapper.decide("a1", "boundary", snapshot)
    wrapper.decide("b2", "boundary", snapshot)
    alice, bob = wrapper.policies["alice"], wrapper.policies["bob"]
    assert [(app, [view.name for view in seen.apps]) for app, seen, _ in alice.seen] == [("a1", ["a1", "a2"])]
    assert [(app, [view.name for view in seen.apps]) for app, seen, _ in bob.seen] == [("b2", ["b1", "b2"])]
    for policy in (alice, bob):
        assert policy.seen[0][1].utilization == snapshot.utilization  # NVML sees all load
        assert policy.seen[0][1].config == snapshot.config


def test_a_push_to_another_users_app_is_refused_and_named():
    snapshot = Snapshot((_view("a1", 0), _view("b1", 1), _view("a2", 2)), (50.0, 50.0, 50.0, 0.0), PolicyConfig(4))
    users = {"a1": "alice", "a2": "alice", "b1": "bob"}
    wrapper = PerUserPolicy(users, lambda: Grabbing(3, ["a1", "a2", "b1"]))
    decision = wrapper.decide("a1", "boundary", snapshot)
    assert dict(decision.others) == {"a2": DataRatio.single(4, 3)}  # its own user's app: pushed
    assert decision.details["refused_pushes"] == ["b1"]


def test_in_a_run_no_user_moves_another_users_app():
    users = deal(SHORT_A, 2)
    gpu_of = {"user0": 0, "user1": 1}
    names = [app.name for app in SHORT_A.apps]
    wrapper = PerUserPolicy(users, iter([Grabbing(0, names), Grabbing(1, names)]).__next__)
    result = Simulation(SHORT_A, SimConfig(policy="fair"), policy=wrapper).run()
    moved = Counter()
    for name, records in result.app_records.items():
        for record in records:
            if record["event"] == "update":
                assert record["new_dr"] == DataRatio.single(4, gpu_of[users[name]]).to_list(), (name, record)
                moved[users[name]] += 1
    assert moved["user0"] > 0 and moved["user1"] > 0  # pushes within a user do go through


def test_with_fair_each_user_decides_only_its_apps_from_its_apps():
    users = deal(SHORT_A, 2)
    wrapper = PerUserPolicy(users, Recording)
    Simulation(SHORT_A, SimConfig(policy="fair", record=False), policy=wrapper).run()
    pushes = 0
    for user, policy in wrapper.policies.items():
        assert policy.seen
        for app, snapshot, decision in policy.seen:
            assert users[app] == user
            assert {users[view.name] for view in snapshot.apps} == {user}
            assert {users[name] for name in decision.others} <= {user}
            pushes += len(decision.others)
    assert pushes > 0  # fair did swap or place within a user, so the check above had pushes to look at


def test_with_one_user_it_is_plain_fair():
    config = SimConfig(policy="fair")
    plain = Simulation(SHORT_A, config).run()
    wrapped = Simulation(SHORT_A, config, policy=PerUserPolicy({app.name: "u" for app in SHORT_A.apps},
                                                                FairPolicy)).run()
    assert wrapped.final_sd == plain.final_sd
    assert wrapped.changes == plain.changes and sum(plain.changes.values()) > 0
    decisions = [[(r["app"], r["branch"], r["new_dr"]) for r in result.manager_records if r["event"] == "decision"]
                 for result in (plain, wrapped)]
    assert decisions[0] == decisions[1]


def test_deal_gives_every_app_to_one_user_evenly_and_the_same_every_time():
    for name, scenario in SCENARIOS.items():
        for users in range(1, 8):
            dealt = deal(scenario, users)
            assert sorted(dealt) == sorted(app.name for app in scenario.apps)
            counts = Counter(dealt.values())
            assert set(counts) <= {f"user{index}" for index in range(users)}
            assert max(counts.values()) - min(counts.values()) <= 1
            assert len(counts) == min(users, len(scenario.apps))
            assert dealt == deal(scenario, users), name


def test_deal_is_not_round_robin_by_index():
    """Round-robin placement puts app i on GPU i mod 4: dealing by index would give each of two users
    only its own GPUs in (a); the shuffle gives some user apps on both parities."""
    dealt = deal(SCENARIOS["a"], 2)
    parities = {user: {index % 2 for index, app in enumerate(SCENARIOS["a"].apps) if dealt[app.name] == user}
                for user in set(dealt.values())}
    assert any(len(found) == 2 for found in parities.values())


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="users must be a positive integer"):
        deal(SCENARIOS["a"], 0)
    wrapper = PerUserPolicy({"a1": "alice"}, FairPolicy)
    snapshot = Snapshot((_view("a1", 0), _view("stranger", 1)), (0.0,) * 4, PolicyConfig(4))
    with pytest.raises(ValueError, match="'stranger' has no user"):
        wrapper.decide("a1", "boundary", snapshot)
    with pytest.raises(ValueError, match="'nobody' has no user"):
        wrapper.decide("nobody", "boundary", snapshot)

    class Impostor(FairPolicy):
        def decide(self, app, trigger, snapshot):
            return Decision(snapshot.apps[-1].name, snapshot.apps[-1].ratio, "keep")

    wrapper = PerUserPolicy({"a1": "alice", "a2": "alice"}, Impostor)
    with pytest.raises(ValueError, match="answered for app 'a2', not 'a1'"):
        wrapper.decide("a1", "boundary", Snapshot((_view("a1", 0), _view("a2", 1)), (0.0,) * 4, PolicyConfig(4)))
