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
