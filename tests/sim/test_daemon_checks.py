"""The simulator checks every decision and push as the daemon does (``Manager._check_ratio``):
a DR the daemon would refuse is not applied, and a push to the deciding app itself is refused."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from drbalance.policy import Decision, Snapshot
from drbalance.ratio import DataRatio
from drbalance.sim import SimConfig, Simulation
from drbalance.workload.scenarios import AppSpec, Scenario


class _PushesToItself:
    name = "observe"

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        view = snapshot.app(app)
        if trigger == "boundary" and app == "a":
            return Decision(app, view.ratio, "keep", others=MappingProxyType({app: DataRatio([0, 10])}))
        return Decision(app, view.ratio, "keep")


class _WrongTotal:
    name = "observe"

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        if trigger == "boundary":
            return Decision(app, DataRatio([0, 5], 5), "bad")  # the daemon's total is 10
        return Decision(app, snapshot.app(app).ratio, "keep")


def _scenario() -> Scenario:
    return Scenario("checks", 2, (AppSpec("a", "resnet50", 32, 2, 20), AppSpec("b", "resnet50", 32, 2, 20)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", [_PushesToItself, _WrongTotal])
def test_a_dr_the_daemon_would_refuse_is_never_applied(policy):
    result = Simulation(_scenario(), SimConfig(policy="observe"), policy=policy()).run()
    assert {tuple(record["dr"]) for record in result.app_records["a"]} == {(10, 0)}
    assert {tuple(record["dr"]) for record in result.app_records["b"]} == {(0, 10)}


class _PushesThenTakesBack:
    """At a's registration, pushes b onto GPU 0; at b's own registration, answers b with the DR
    it started with: the daemon's answer replaces the push in b's command record."""

    name = "observe"

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        if trigger == "register" and app == "a":
            return Decision(app, snapshot.app(app).ratio, "keep", others=MappingProxyType({"b": DataRatio([10, 0])}))
        if trigger == "register" and app == "b":
            assert snapshot.app(app).ratio == DataRatio([10, 0])  # the manager's view: the pushed DR
            return Decision(app, DataRatio([0, 10]), "take-back")
        return Decision(app, snapshot.app(app).ratio, "keep")


@pytest.mark.timeout(60)
def test_a_decision_for_an_app_replaces_a_dr_pushed_to_it_before():
    result = Simulation(_scenario(), SimConfig(policy="observe"), policy=_PushesThenTakesBack()).run()
    assert {tuple(record["dr"]) for record in result.app_records["b"]} == {(0, 10)}
    assert {tuple(record["dr"]) for record in result.app_records["a"]} == {(10, 0)}


class _PushesThenRefused(_PushesThenTakesBack):
    """As above, but b's own answer is one the daemon refuses: it sends b the DR pushed to it."""

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        if trigger == "register" and app == "b":
            return Decision(app, DataRatio([0, 5], 5), "bad")  # the daemon's total is 10
        return super().decide(app, trigger, snapshot)


@pytest.mark.timeout(60)
def test_a_refused_decision_sends_the_app_the_dr_pushed_to_it_at_once():
    result = Simulation(_scenario(), SimConfig(policy="observe"), policy=_PushesThenRefused()).run()
    updates = [record for record in result.app_records["b"] if record["event"] == "update"]
    assert [(record["t"], record["new_dr"]) for record in updates] == [(0.0, [10, 0])]  # before its first iteration
