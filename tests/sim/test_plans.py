"""The simulator with a policy that plans (``base.Planner``): asked on its period and at arrivals and
departures, its changes pushed and checked as the daemon does; and what a DR change costs a job."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from drbalance.policy import Decision, Snapshot
from drbalance.policy.base import Plan
from drbalance.ratio import DataRatio
from drbalance.sim import SimConfig, Simulation
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario

TO_GPU_1 = DataRatio([0, 10])


class _Recorder:
    """A planner that moves app ``a`` to GPU 1 at its first period plan and records every call."""

    name = "observe"
    plan_period = 5.0

    def __init__(self, move: DataRatio | None = TO_GPU_1) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.move = move

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        return Decision(app, snapshot.app(app).ratio, "keep")

    def plan(self, trigger: str, snapshot: Snapshot) -> Plan:
        self.calls.append((trigger, tuple(view.name for view in snapshot.apps)))
        first_period = trigger == "period" and not any(call[0] == "period" for call in self.calls[:-1])
        if first_period and self.move is not None and "a" in {view.name for view in snapshot.apps}:
            return Plan(MappingProxyType({"a": self.move}), "plan")
        return Plan(MappingProxyType({}), "keep")


def _scenario() -> Scenario:
    a = AppSpec("a", "resnet50", 32, 2, 200, (10, 0))
    b = AppSpec("b", "resnet50", 32, 1, 100, (0, 10), arrival=12.0)
    return Scenario("plans", 2, (a, b))


@pytest.mark.timeout(60)
def test_a_planner_is_asked_on_its_period_and_at_every_arrival_and_departure():
    planner = _Recorder(move=None)
    result = Simulation(_scenario(), SimConfig(policy="observe"), policy=planner).run()
    triggers = [trigger for trigger, _ in planner.calls]
    assert triggers[0] == "arrival" and ("arrival", ("a", "b")) in planner.calls
    assert triggers.count("departure") == 1  # b ends first; a's end leaves nobody to plan for
    assert triggers.count("period") == pytest.approx(result.makespan / planner.plan_period, abs=1)
    records = [record for record in result.manager_records if record["event"] == "plan"]
    assert len(records) == len(planner.calls)


@pytest.mark.timeout(60)
def test_a_plans_change_reaches_the_app_and_costs_it_the_change():
    free = Simulation(_scenario(), SimConfig(policy="observe", change_cost=0.0), policy=_Recorder()).run()
    charged = Simulation(_scenario(), SimConfig(policy="observe", change_cost=3.0), policy=_Recorder()).run()
    for result in (free, charged):
        updates = [record for record in result.app_records["a"] if record["event"] == "update"]
        assert [record["new_dr"] for record in updates] == [[0, 10]] and updates[0]["branch"] == "push"
        assert result.changes == {"a": 1, "b": 0}
    costs = model_costs("resnet50")
    alone = costs.solo_iteration(32)  # a's first iteration on GPU 1 (b arrives there later)
    assert charged.finish["a"] - free.finish["a"] == pytest.approx(3.0 * alone, rel=0.2)


@pytest.mark.timeout(60)
def test_a_plan_the_daemon_would_refuse_is_not_applied():
    result = Simulation(_scenario(), SimConfig(policy="observe"), policy=_Recorder(DataRatio([0, 5], 5))).run()
    assert result.changes["a"] == 0
    refused = [record for record in result.manager_records if record["event"] == "push"]
    assert refused and "total" in refused[0]["refused"]


def test_the_change_cost_must_be_a_number_of_iterations():
    with pytest.raises(ValueError, match="change_cost"):
        SimConfig(change_cost=-1.0)
    with pytest.raises(ValueError, match="change_cost"):
        SimConfig(change_cost=float("nan"))
