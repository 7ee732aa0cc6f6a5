"""benchmarks.lookahead: the look-ahead oracle, and the simulator's stepping that it relies on."""

from __future__ import annotations

import pytest

from benchmarks.lookahead import LookAhead, candidate_ratios, main, predicted_sds, run_oracle
from drbalance.ratio import DataRatio
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.model import make_interference
from drbalance.workload.scenarios import load_scenario

pytestmark = pytest.mark.timeout(240)


def test_advancing_in_steps_ends_exactly_where_one_run_ends():
    scenario = load_scenario("a").scaled(0.02)
    whole = Simulation(scenario, SimConfig(policy="fair")).run()
    stepped = Simulation(scenario, SimConfig(policy="fair"))
    stepped.start()
    for until in (1.0, 5.0, 12.5, 30.0):
        stepped.advance(until)
        assert stepped.now <= until
    stepped.advance()
    result = stepped._result()
    assert result.final_sd == whole.final_sd
    assert result.decisions == whole.decisions


def test_candidates_are_the_current_dr_then_singles_pairs_and_all_without_repeats():
    current = DataRatio([10, 0, 0, 0])
    found = candidate_ratios(4, 10, current)
    assert found[0] == current
    assert len(found) == len(set(found)) == 4 + 6 + 1  # the current DR is one of the singles
    assert DataRatio([5, 0, 5, 0]) in found and DataRatio.even(4, 10) in found
    assert candidate_ratios(4, 10, DataRatio([7, 3, 0, 0]))[0] == DataRatio([7, 3, 0, 0])


def test_a_copy_run_ahead_leaves_the_simulation_it_was_copied_from_untouched():
    scenario = load_scenario("b").scaled(0.05)
    oracle = LookAhead(horizon=20.0)
    simulation = Simulation(scenario, SimConfig(policy="observe"), policy=oracle)
    oracle.attach(simulation)
    simulation.start()
    simulation.advance(30.0)
    before = (simulation.now, [app.tracker.done for app in simulation.apps], len(simulation.events))
    sds = oracle._look(simulation.apps[0].name, DataRatio([5, 5, 0], simulation.scenario.dr_total))
    assert (simulation.now, [app.tracker.done for app in simulation.apps], len(simulation.events)) == before
    assert len(sds) == len(simulation.apps) and all(sd > 0.5 for sd in sds)


def test_predicted_sds_of_a_finished_run_are_its_final_sds():
    simulation = Simulation(load_scenario("c").scaled(0.02), SimConfig(policy="observe"))
    result = simulation.run()
    assert sorted(predicted_sds(simulation, {})) == pytest.approx(sorted(result.final_sd.values()))


def test_the_oracle_beats_doing_nothing_where_crowding_is_plain():
    """(b) from spread, scaled down: every app on every GPU under Gavel's pairs is far from the
    best; an oracle that sees 30 s ahead must find a lower max SD than leaving it so."""
    scenario = load_scenario("b").scaled(0.05)
    gavel = make_interference("gavel")
    nothing = Simulation(scenario, SimConfig(policy="observe", placement="spread", contention=gavel)).run()
    oracle = LookAhead(horizon=30.0)
    simulation = Simulation(scenario, SimConfig(policy="observe", placement="spread", contention=gavel), policy=oracle)
    oracle.attach(simulation)
    result = simulation.run()
    assert oracle.moves >= 1
    assert result.max_sd < nothing.max_sd - 0.1


def test_bad_horizons_are_refused():
    with pytest.raises(ValueError, match="horizon"):
        LookAhead(horizon=0)
    with pytest.raises(SystemExit):
        main(["a", "--horizon", "-5"])


def test_run_oracle_reports_what_the_tables_show():
    found = run_oracle("c", "round-robin", "calibrated", 10.0, None, scale=0.02)
    assert set(found) >= {"max_sd", "mean_sd", "spread", "utilisation", "moves", "copies"}
    assert found["spread"] == pytest.approx(max(found["final_sd"].values()) - min(found["final_sd"].values()))
    assert found["copies"] > 0
