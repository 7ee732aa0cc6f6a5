"""benchmarks.compare_mixes: runs fixed and broken between two random-mix sweeps, McNemar's exact test."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.compare_mixes import MixFileError, compare, load_runs, main, mcnemar_exact, pool

pytestmark = pytest.mark.timeout(60)


def sweep(path, fair, observe):
    """A random_mixes --json file: ``fair`` and ``observe`` map (seed, model) to (max SD, mean SD)."""
    def runs(policy, ends):
        return [{"seed": seed, "interference": model, "policy": policy, "spread": 0.0, "max_sd": top,
                 "mean_sd": mean, "noise": 0} for (seed, model), (top, mean) in ends.items()]
    path.write_text(json.dumps({"command": "test", "runs": runs("fair", fair), "observe": runs("observe", observe)}))
    return str(path)


OBSERVE = {(0, "calibrated"): (1.30, 1.20), (1, "calibrated"): (1.50, 1.40), (2, "gavel"): (2.00, 1.60),
           (3, "gavel"): (1.10, 1.05)}


def test_the_exact_test_matches_the_binomial_by_hand():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)  # 2 x (1/2)^5
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(3, 4) == 1.0  # capped: both tails overlap in the middle
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(30, 10) < 0.01 < mcnemar_exact(12, 6)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        mcnemar_exact(-1, 2)


def test_a_run_is_judged_against_observe_in_its_own_file(tmp_path):
    runs = load_runs(sweep(tmp_path / "a.json", {(0, "calibrated"): (1.31, 1.21), (1, "calibrated"): (1.40, 1.42),
                                                 (2, "gavel"): (2.05, 1.50)}, OBSERVE))
    assert not runs[(0, "calibrated", "fair", 0)].worse  # both within the 0.01 margin
    assert runs[(1, "calibrated", "fair", 0)].worse  # the mean 0.02 above
    assert runs[(2, "gavel", "fair", 0)].worse  # the max 0.05 above, whatever the mean
    assert math.isclose(runs[(2, "gavel", "fair", 0)].max_sd, 2.05)


def test_fixed_broken_and_unchanged_are_counted_per_model_over_the_runs_in_common(tmp_path):
    before = load_runs(sweep(tmp_path / "before.json", {
        (0, "calibrated"): (1.40, 1.20),  # worse
        (1, "calibrated"): (1.40, 1.30),  # not worse
        (2, "gavel"): (2.10, 1.50),  # worse
        (3, "gavel"): (1.00, 1.00),  # only in this file
    }, OBSERVE))
    after = load_runs(sweep(tmp_path / "after.json", {
        (0, "calibrated"): (1.29, 1.20),  # fixed
        (1, "calibrated"): (1.60, 1.30),  # broken
        (2, "gavel"): (2.10, 1.50),  # still worse, ends unchanged
    }, OBSERVE))
    tallies = compare(before, after)
    everything, calibrated, gavel = tallies["all"], tallies["calibrated"], tallies["gavel"]
    assert (everything.runs, everything.worse_before, everything.worse_after) == (3, 2, 2)
    assert (calibrated.fixed, calibrated.broken, calibrated.unchanged) == (1, 1, 0)
    assert (gavel.runs, gavel.fixed, gavel.broken, gavel.unchanged) == (1, 0, 0, 1)
    assert everything.fixed_runs == ["0 calibrated fair"] and everything.broken_runs == ["1 calibrated fair"]
    assert everything.max_change / everything.runs == pytest.approx((-0.11 + 0.20 + 0.0) / 3)
    assert everything.p_value == 1.0
    pooled = pool([tallies, tallies])
    assert (pooled["all"].runs, pooled["all"].fixed, pooled["all"].broken) == (6, 2, 2)
    assert pooled["calibrated"].max_change == pytest.approx(2 * calibrated.max_change)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    (json.dumps([1, 2]), "expected an object with lists 'runs' and 'observe'"),
    (json.dumps({"runs": [{"seed": 0}], "observe": []}), r"runs\[0\] is not a run"),
    (json.dumps({"runs": [{"seed": 0, "interference": "gavel", "policy": "fair", "max_sd": "NaN", "mean_sd": 1}],
                 "observe": []}), "not a finite number"),
    (json.dumps({"runs": [{"seed": 0, "interference": "gavel", "policy": "fair", "max_sd": 1, "mean_sd": 1}],
                 "observe": []}), "has no observe run"),
])
def test_a_file_that_is_not_a_sweep_gets_an_error_that_names_it(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(MixFileError, match=message) as caught:
        load_runs(str(path))
    assert str(path) in str(caught.value)


def test_the_command_prints_each_pair_and_the_pool_and_writes_json(tmp_path, capsys):
    before = sweep(tmp_path / "before.json", {(0, "calibrated"): (1.40, 1.20)}, OBSERVE)
    after = sweep(tmp_path / "after.json", {(0, "calibrated"): (1.30, 1.20)}, OBSERVE)
    out = tmp_path / "comparison.json"
    assert main([before, after, before, after, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pooled over every pair" in text
    assert "fixed 2, broken 0 (McNemar exact p = 0.5: cannot be told from chance)" in text
    document = json.loads(out.read_text())
    assert [pair["tallies"]["all"]["fixed"] for pair in document["pairs"]] == [1, 1]
    assert document["pairs"][0]["tallies"]["all"]["p_value"] == 1.0


def test_the_command_refuses_unpaired_missing_and_disjoint_files(tmp_path, capsys):
    before = sweep(tmp_path / "before.json", {(0, "calibrated"): (1.40, 1.20)}, OBSERVE)
    other = sweep(tmp_path / "other.json", {(3, "gavel"): (1.00, 1.00)}, OBSERVE)
    with pytest.raises(SystemExit) as caught:
        main([before])
    assert caught.value.code == 2
    assert "files come in pairs" in capsys.readouterr().err
    assert main([before, str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main([before, other]) == 2
    assert "no run in common" in capsys.readouterr().err
