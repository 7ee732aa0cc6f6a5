"""benchmarks.frontier: the layouts it tries, the shortened runs, the answer's definition, the CLI input."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import frontier
from benchmarks.random_mixes import random_mix, run

pytestmark = pytest.mark.timeout(180)

SEED = 2  # two GPUs, three apps: about a second per full-length run


def test_two_gpus_try_every_dr_first_and_coarser_grids_when_the_layouts_grow():
    scenario = random_mix(SEED)
    grids = frontier.app_ratio_grids(scenario)
    assert grids[0][0] == "every DR"
    assert len(grids[0][1]) == scenario.dr_total + 1
    assert all(sum(shares) == scenario.dr_total for _, options in grids for shares in options)
    assert [len(options) for _, options in grids] == sorted((len(options) for _, options in grids), reverse=True)
    name, options = frontier.app_ratios(scenario, limit=len(scenario.apps) ** 2)
    assert name == "alone" and len(options) == scenario.gpus  # nothing richer fits the limit


def test_more_gpus_split_over_pairs():
    scenario = next(random_mix(seed) for seed in range(100) if random_mix(seed).gpus == 4)
    grids = dict(frontier.app_ratio_grids(scenario))
    assert "every DR" not in grids
    assert len(grids["alone"]) == 4
    assert len(grids["alone or split 5:5"]) == 4 + 6
    assert len(grids["alone or split 2:8, 5:5, 8:2"]) == 4 + 3 * 6


def test_a_shortened_scenario_keeps_the_order_of_arrivals():
    scenario = next(random_mix(seed) for seed in range(100) if any(app.arrival for app in random_mix(seed).apps))
    short = frontier.shortened(scenario, 0.2)
    for app, shorter in zip(scenario.apps, short.apps):
        assert shorter.arrival == pytest.approx(app.arrival * 0.2)
        assert shorter.iterations < app.iterations
    assert frontier.shortened(scenario, 1.0) is scenario


def test_doing_nothing_is_random_mixes_observe_and_an_answer_meets_its_definition():
    base = frontier.doing_nothing(SEED, "calibrated", 1.0)
    observe = run((SEED, "calibrated", "observe"))
    assert (base.max_sd, base.mean_sd) == (observe.max_sd, observe.mean_sd)
    found = frontier.explore(SEED, "calibrated", 0.05, 0.2, workers=1, limit=27)
    assert found["layouts"] <= 27 and found["doing_nothing"]["max_sd"] == round(base.max_sd, 4)
    answer = found["fairer_without_higher_mean"]
    if answer is not None:
        assert answer["max_sd"] <= round(base.max_sd - 0.05, 4) + 1e-4
        assert answer["mean_sd"] <= round(base.mean_sd + frontier.TOLERANCE, 4) + 1e-4
    fairest = found["fairest"]
    assert fairest is not None and fairest["max_sd"] > 0.99  # a slow-down is never below 1


def test_cases_are_seed_colon_interference_and_bad_ones_are_refused():
    assert frontier.case("165:gavel") == (165, "gavel")
    for bad in ("165", "x:gavel", "165:none", ":calibrated"):
        with pytest.raises(argparse.ArgumentTypeError):
            frontier.case(bad)


def test_bad_options_are_refused_with_a_message(capsys):
    for bad in (["165:calibrated", "--scale", "0"], ["165:calibrated", "--fairer", "-1"],
                ["165:calibrated", "--limit", "0"], ["nonsense"]):
        with pytest.raises(SystemExit) as stopped:
            frontier.main(bad)
        assert stopped.value.code == 2
        assert "error:" in capsys.readouterr().err
