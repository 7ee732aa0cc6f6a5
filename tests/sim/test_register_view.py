"""What a newcomer's record shows when it registers: no batch yet (no forward has run)."""

from __future__ import annotations

import pytest

from drbalance.policy import Decision, Snapshot
from drbalance.sim import SimConfig, Simulation
from drbalance.workload.scenarios import AppSpec, Scenario


class _Recorder:
    """Keeps every app's view at every decision; never changes a DR."""

    name = "observe"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, int | None]]] = []

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        self.seen.append((app, trigger, {view.name: view.batch for view in snapshot.apps}))
        return Decision(app, snapshot.app(app).ratio, "observe")


@pytest.mark.timeout(60)
def test_a_newcomer_shows_no_batch_until_its_first_iteration_as_the_clients_record():
    apps = (AppSpec("first", "resnet50", 32, 2, 100), AppSpec("late", "alexnet", 128, 2, 10, arrival=5.0))
    recorder = _Recorder()
    Simulation(Scenario("register", 2, apps), SimConfig(policy="observe"), policy=recorder).run()
    registered = {app: batches for app, trigger, batches in recorder.seen if trigger == "register"}
    # the client publishes batch 0 (unknown) at registration: its model has run no forward yet
    assert registered["first"]["first"] is None
    assert registered["late"]["late"] is None
    assert registered["late"]["first"] == 32  # an app that has reported shows the batch of its last forward
    boundaries = [batches for app, trigger, batches in recorder.seen if trigger == "boundary" and app == "late"]
    assert boundaries and boundaries[0]["late"] == 128
