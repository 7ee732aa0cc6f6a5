"""Shared by the simulator tests."""

from __future__ import annotations

from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.interference import GavelInterference
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario


def shares_while_both_run(gavel: GavelInterference, first: tuple[str, int], second: tuple[str, int],
                          iterations: int = 200) -> tuple[float, ...]:
    """Share of its solo speed each job keeps (dimensionless), both running until each has done
    ``iterations`` iterations, under the model the simulator uses."""
    apps = tuple(AppSpec(name, model, batch, 1, 10**5, (10,)) for name, (model, batch) in zip("xy", (first, second)))
    simulation = Simulation(Scenario("pair", 1, apps), SimConfig(policy="observe", record=False, contention=gavel))
    simulation.start()
    while min(app.tracker.done for app in simulation.apps) < iterations:
        simulation.advance(simulation.now + 10.0)
    return tuple(app.tracker.done * model_costs(app.spec.model).solo_iteration(app.spec.batch)
                 / (app.tracker.last_mark - app.tracker.start) for app in simulation.apps)
