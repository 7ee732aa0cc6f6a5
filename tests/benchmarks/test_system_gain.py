"""benchmarks.system_gain: the runs it makes, how it counts worse runs and gaps, its output file."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import system_gain
from benchmarks.system_gain import Job, Outcome, jobs_for, summary
from drbalance.sim.mixes import NOT_WORSE_MARGIN

pytestmark = pytest.mark.timeout(180)


def test_every_scenario_gets_observe_once_and_every_other_arm_from_each_placement():
    jobs = jobs_for(["paper", "default"], range(200, 202), range(0), [2, 3])
    assert len(jobs) == len(set(jobs))
    paper = [job for job in jobs if job.set == "paper"]
    # 3 scenarios x 2 models x (observe from round-robin + 3 arms x 2 placements)
    assert len(paper) == 3 * 2 * (1 + 3 * 2)
    assert {job.placement for job in paper if job.arm == "observe"} == {"round-robin"}
    default = [job for job in jobs if job.set == "default"]
    assert len(default) == 2 * 2 * 4 and {job.placement for job in default} == {"round-robin"}
    assert {job.arm for job in jobs} == {"observe", "system", "per-user 2", "per-user 3"}


def test_summary_counts_worse_runs_by_the_never_worse_rule_and_gaps_to_the_system_arm():
    def job(seed, arm):
        return Job("default", str(seed), "round-robin", "calibrated", arm)

    outcomes = {
        job(1, "observe"): Outcome(0.3, 1.30, 1.20, 0.0),
        job(1, "system"): Outcome(0.1, 1.25, 1.20, 0.0),
        job(1, "per-user 2"): Outcome(0.2, 1.30 + 2 * NOT_WORSE_MARGIN, 1.19, 0.0),  # worse on max
        job(2, "observe"): Outcome(0.3, 1.40, 1.20, 0.0),
        job(2, "system"): Outcome(0.1, 1.40, 1.20 + 2 * NOT_WORSE_MARGIN, 0.0),  # worse on mean
        job(2, "per-user 2"): Outcome(0.2, 1.30, 1.20, 0.0),
    }
    rows = {(row["set"], row["arm"]): row for row in summary(outcomes, [2])}
    assert rows[("default", "system")]["worse"] == 1 and rows[("default", "per-user 2")]["worse"] == 1
    assert rows[("default", "observe")]["worse"] is None
    per_user = rows[("default", "per-user 2")]
    assert per_user["median_max_sd"] == pytest.approx((1.32 + 1.30) / 2)
    assert per_user["median_gap_to_system"] == pytest.approx(((1.32 - 1.25) + (1.30 - 1.40)) / 2)
    assert (per_user["above_system"], per_user["below_system"]) == (1, 1)
    assert rows[("all", "system")]["runs"] == 2
    text = system_gain.tables(summary(outcomes, [2]))
    assert "| default | calibrated | 2 | 1.350 / 1.350 | 1.325 / 1.325, 1 worse | 1.310 / 1.310, 1 worse |" in text
    assert "| default | calibrated | -0.015; 1 above, 1 below |" in text


def test_user_counts_are_distinct_positive_integers():
    assert system_gain._user_counts("2,3") == [2, 3]
    for bad in ("0", "2,2", "two", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            system_gain._user_counts(bad)


@pytest.mark.slow
def test_a_small_sweep_writes_its_table_and_every_run(tmp_path, capsys):
    out = tmp_path / "gain.json"
    assert system_gain.main(["--sets", "default", "--seeds", "2:3", "--users", "2", "--workers", "2",
                             "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("python -m benchmarks.system_gain --sets default")
    assert len(data["runs"]) == 2 * 3  # two models x (observe, system, per-user 2)
    by_arm = {(run["interference"], run["arm"]): run for run in data["runs"]}
    for interference in ("calibrated", "gavel"):
        base = by_arm[(interference, "observe")]
        for arm in ("system", "per-user 2"):
            got = by_arm[(interference, arm)]
            assert got["worse"] == (got["max_sd"] > base["max_sd"] + NOT_WORSE_MARGIN
                                    or got["mean_sd"] > base["mean_sd"] + NOT_WORSE_MARGIN)
    assert "| default | gavel | 1 | " in capsys.readouterr().out
