"""The mean utilisation of a simulated run covers the run, not the sample period before it."""

from __future__ import annotations

import pytest

from drbalance.report.metrics import summarise
from drbalance.sim import SimConfig, simulate
from drbalance.sim.command import to_run
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario


@pytest.mark.timeout(60)
def test_one_app_alone_reports_its_busy_fraction_as_mean_utilisation():
    scenario = Scenario("solo", 1, (AppSpec("x", "resnet50", 32, 1, 400),))
    result = simulate(scenario, SimConfig(policy="observe"))
    costs = model_costs("resnet50")
    busy = costs.device_seconds(32) / costs.solo_iteration(32)  # device share of each iteration: 0.735
    assert 100 * result.gpu_busy[0] / result.makespan == pytest.approx(100 * busy, abs=0.01)
    logged = [record["t"] for record in result.manager_records if record["event"] == "util"]
    assert logged[0] > 0  # no reading of the period before the run
    summary = summarise(to_run(result, "observe", scenario), step=1.0)
    assert summary.mean_util == pytest.approx(100 * busy, abs=0.5)  # 72.3 when the t = 0 reading counted
