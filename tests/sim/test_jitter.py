"""The simulator's jitter (``SimConfig.jitter``, ``drbalance simulate --jitter``): every host phase
and GPU chunk stretched by a random factor of mean 1, reproducible by seed, and nothing drawn
without it (a run without jitter is unchanged by it)."""

import json
import math
import statistics

import pytest

from drbalance.cli import main as drbalance
from drbalance.sim import SimConfig, Simulation, simulate
from drbalance.workload.scenarios import DEMO_SCENARIOS, AppSpec, Scenario

DEMO = DEMO_SCENARIOS["demo-a"]


def _decisions(config: SimConfig) -> tuple[dict[str, float], list[tuple]]:
    simulation = Simulation(DEMO, config)
    result = simulation.run()
    decisions = [(r["app"], r["branch"], tuple(r["new_dr"])) for r in simulation.manager_records
                 if r.get("event") == "decision"]
    return result.final_sd, decisions


def test_no_jitter_draws_nothing_and_leaves_the_run_as_it_was():
    plain = _decisions(SimConfig(policy="fair", decide_every=2))
    assert _decisions(SimConfig(policy="fair", decide_every=2, jitter=0.0, seed=7)) == plain


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first = _decisions(SimConfig(policy="fair", decide_every=2, jitter=0.1, seed=1))
    assert _decisions(SimConfig(policy="fair", decide_every=2, jitter=0.1, seed=1)) == first
    other = _decisions(SimConfig(policy="fair", decide_every=2, jitter=0.1, seed=2))
    assert other[0] != first[0]
    assert first[0] != _decisions(SimConfig(policy="fair", decide_every=2))[0]


def _iteration_times(jitter: float) -> tuple[list[float], float]:
    """Each iteration's time of one app alone on one GPU (a boundary after every iteration), and its SD."""
    scenario = Scenario("alone", 1, (AppSpec("solo", "resnet50", 32, 4, 100),))
    result = simulate(scenario, SimConfig(policy="observe", decide_every=1, jitter=jitter, seed=3))
    ends = [r["t"] for r in result.app_records["solo"] if r.get("event") == "boundary"]
    return [later - earlier for earlier, later in zip(ends, ends[1:])], result.final_sd["solo"]


def test_jitter_spreads_iteration_times_around_the_same_mean():
    plain, plain_sd = _iteration_times(0.0)
    assert max(plain) - min(plain) < 1e-9 and plain_sd == pytest.approx(1.0, abs=1e-9)
    jittered, sd = _iteration_times(0.2)
    assert len(jittered) > 300
    mean = statistics.fmean(jittered)
    assert mean == pytest.approx(plain[0], rel=0.05)  # a factor of mean 1: no app is slower on average
    spread = statistics.stdev(jittered) / mean  # host and device phases jittered apart: below 0.2, well above 0
    assert 0.08 < spread < 0.22
    assert sd == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("jitter", [-0.1, 2.5, math.nan, math.inf])
def test_a_jitter_out_of_range_is_refused(jitter):
    with pytest.raises(ValueError, match="jitter"):
        SimConfig(jitter=jitter)


def test_the_command_takes_jitter_and_seed_and_reports_them(capsys):
    assert drbalance(["simulate", "e2e-a", "--policy", "observe", "--jitter", "0.1", "--seed", "4", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["jitter"] == 0.1 and shown["seed"] == 4
    for bad in ("3", "-0.1", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            drbalance(["simulate", "e2e-a", "--jitter", bad])
        assert exit_info.value.code == 2
        assert "--jitter" in capsys.readouterr().err
