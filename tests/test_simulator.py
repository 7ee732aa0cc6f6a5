"""The simulator: model invariants, the bound, shared code with the daemon, the command."""

import json
from dataclasses import replace

import pytest

from drbalance import policy as policy_package
from drbalance import sim as sim_package
from drbalance.cli import main as drbalance
from drbalance.models import CO_LOCATED_SPEED, CO_LOCATION_CAPACITY
from drbalance.report.metrics import load_run, summarise
from drbalance.scenarios import SCENARIOS, AppSpec, Scenario, load_scenario, scenario_from_json
from drbalance.sim import SimConfig, Simulation, simulate
from drbalance.sim.bound import lower_bound
from drbalance.sim.calibration import fit_capacity, simulated_pair_speed
from drbalance.sim.command import to_run
from drbalance.slowdown import SlowdownTracker

VARIANTS = {
    "paper": SimConfig(policy="paper", record=False),
    "observe": SimConfig(policy="observe", record=False),
    "dataparallel": SimConfig(policy="observe", placement="spread", record=False),
    "themis": SimConfig(scheduler="themis", record=False),
}


def small(name="s", gpus=2, specs=(("resnet50", 32, 40), ("densenet121", 32, 30), ("alexnet", 128, 60))):
    apps = tuple(AppSpec(f"{model[:5]}{i}", model, batch, 2, iterations // 2, arrival=float(i))
                 for i, (model, batch, iterations) in enumerate(specs))
    return Scenario(name, gpus, apps)


@pytest.fixture(scope="module")
def paper_results():
    return {name: {label: simulate(SCENARIOS[name], config) for label, config in VARIANTS.items()}
            for name in ("a", "b", "c")}


def test_gpu_busy_time_never_exceeds_capacity(paper_results):
    for name, results in paper_results.items():
        for label, result in results.items():
            for busy, served in zip(result.gpu_busy, result.gpu_served):
                assert 0 <= busy <= result.makespan + 1e-6, (name, label)
                assert served <= CO_LOCATION_CAPACITY * busy + 1e-6, (name, label)
                assert served >= busy - 1e-6  # a busy GPU always serves at least one second per second


def test_one_app_alone_on_one_gpu_has_sd_exactly_one():
    for model in ("densenet121", "resnet50", "alexnet"):
        scenario = Scenario("alone", 1, (AppSpec("solo", model, 32, 3, 17, (10,)),))
        for config in (SimConfig(policy="observe"), SimConfig(policy="paper")):
            assert simulate(scenario, config).final_sd["solo"] == pytest.approx(1.0, abs=1e-9)
    four = Scenario("alone4", 4, (AppSpec("solo", "resnet50", 32, 3, 17),))  # paper: exclusive mode, one GPU
    assert simulate(four, SimConfig(policy="paper")).final_sd["solo"] == pytest.approx(1.0, abs=1e-9)


def test_identical_apps_under_symmetric_placement_get_identical_sds():
    apps = tuple(AppSpec(f"r{i}", "resnet50", 32, 2, 40) for i in range(4))
    scenario = Scenario("sym", 2, apps)  # round-robin: two apps on each GPU
    for config in (SimConfig(policy="observe"), SimConfig(policy="observe", placement="spread")):
        sds = list(simulate(scenario, config).final_sd.values())
        assert max(sds) - min(sds) < 1e-9 and sds[0] > 1.0


@pytest.mark.parametrize("scenario", [*SCENARIOS.values(), small(), small("one-gpu", 1),
                                      small("late", 3, (("resnet50", 32, 50), ("resnet50", 64, 20)))])
def test_no_policy_run_beats_the_bound(scenario):
    bound = lower_bound(scenario)
    assert bound >= 0.0
    for label, config in VARIANTS.items():
        result = simulate(scenario, config)
        assert result.max_sd >= bound - 1e-9, (scenario.name, label, result.max_sd, bound)


def test_the_daemon_and_the_simulator_share_the_registry_and_the_sd_code():
    assert sim_package.POLICIES is policy_package.POLICIES
    simulation = Simulation(SCENARIOS["a"], SimConfig(policy="paper"))
    assert type(simulation.policy) is policy_package.POLICIES["paper"]
    assert isinstance(simulation.apps[0].tracker, SlowdownTracker)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        Simulation(SCENARIOS["a"], SimConfig(policy="nope"))


def test_balancing_in_scenario_a_lowers_the_spread_and_raises_utilisation(paper_results):
    results = paper_results["a"]
    assert results["paper"].sd_spread < results["observe"].sd_spread
    runs = {label: summarise(to_run(simulate(SCENARIOS["a"], replace(VARIANTS[label], record=True)), label,
                                    SCENARIOS["a"]), step=5.0) for label in ("paper", "observe")}
    assert runs["paper"].mean_util > runs["observe"].mean_util
    assert runs["paper"].final_sd_diff == pytest.approx(results["paper"].sd_spread, abs=1e-9)


def test_the_time_slicing_baseline_equalises_sds(paper_results):
    themis = paper_results["a"]["themis"]
    assert themis.sd_spread < 0.1 and themis.sd_spread < paper_results["a"]["observe"].sd_spread


def test_calibration_reproduces_gavels_median_pair_speed():
    assert simulated_pair_speed("resnet50", CO_LOCATION_CAPACITY) == pytest.approx(CO_LOCATED_SPEED, abs=0.005)
    assert fit_capacity(CO_LOCATED_SPEED) == pytest.approx(CO_LOCATION_CAPACITY, abs=0.01)
    assert simulated_pair_speed("resnet50", 1.0) < CO_LOCATED_SPEED - 0.05  # pure time slicing would not


def test_simulate_command_prints_the_table_and_writes_logs_report_reads(tmp_path, capsys):
    assert drbalance(["simulate", "e2e-a", "--compare", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SD_max^diff final" in out and "lower bound for any DR policy" in out and "themis" in out
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["DataParallel", "f-sched", "fair", "observe", "paper", "themis"]
    summary = summarise(load_run(tmp_path / "paper"))
    assert summary.makespan is not None and len(summary.final_sd) == 6
    assert drbalance(["report", *map(str, runs), "--out", str(tmp_path / "report")]) == 0
    for name in ("sd_max_diff", "mean_sd", "mean_util", "summary"):
        assert (tmp_path / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scenarios_round_trip_through_json_and_bad_ones_are_rejected(tmp_path):
    scenario = load_scenario("c")
    assert scenario_from_json(scenario.to_json()) == scenario
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "gpus": 2, "apps": [
        {"name": "x", "model": "resnet50", "batch": 16, "epochs": 1, "iterations_per_epoch": 10, "ratio": [5, 5]}]}))
    mine = load_scenario(str(path))
    assert mine.apps[0].ratio == (5, 5) and simulate(mine).final_sd["x"] > 0
    bad = {"name": "bad", "gpus": 2, "apps": [{"name": "x", "model": "vgg", "batch": 1, "epochs": 1,
                                                "iterations_per_epoch": 1}]}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="no timing profile for model 'vgg'"):
        load_scenario(str(path))
    with pytest.raises(ValueError, match="unknown scenario"):
        load_scenario("zz")
