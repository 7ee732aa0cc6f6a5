"""benchmarks.rule_elimination: every rule switched off, the lockstep shortcut, the noise band."""

from __future__ import annotations

import json

import pytest

from benchmarks import rule_elimination
from benchmarks.random_mixes import Run
from benchmarks.rule_elimination import RULES, heldout, label, run_task, simulate, variant_policy, within_band
from drbalance.policy.fair import FairConfig, FairPolicy

pytestmark = pytest.mark.timeout(300)


def test_every_rule_has_a_variant_that_differs_from_fair():
    plain = FairPolicy()
    for name, rule in RULES.items():
        policy = variant_policy([name])
        knobs = policy.config != plain.config
        overrides = any(getattr(type(policy), method) is not getattr(FairPolicy, method, None)
                        for method in vars(rule.policy or object) if not method.startswith("__"))
        assert knobs or overrides or rule.search or rule.predictor, name
        assert rule.neutral, name
    together = variant_policy(["swaps", "tie-band", "locks"])
    assert together.config.swap_partners == 0 and together.config.noise == 0.0
    assert together._locked_gpus("a", {"a", "b"}) == set()
    assert variant_policy([]).config == FairConfig()
    assert label(None) == "observe" and label([]) == "fair" and label(["b", "a"]) == "off-a+b"
    many = sorted(RULES)[:24]  # a later round's reference: every rule removed so far, off together
    assert len(label(many)) < 40 and label(many) == label(reversed(many)) != label(many[:23])
    assert label(many).startswith("off-24-rules-")


@pytest.mark.slow
def test_a_shadow_that_decides_as_the_reference_throughout_had_the_references_run():
    """Seed 2 of the default draw: two GPUs, three apps. Each rule off is also simulated on its
    own: its run is the one the lockstep gave it, whether it diverged or not."""
    rules = ("swaps", "untangle", "closing", "tie-band")
    row = run_task(("default", 2, "calibrated", (), rules, True))
    assert set(row["runs"]) == {"observe", "fair", *(f"off-{rule}" for rule in rules)}
    assert set(row["diverged"]) < {f"off-{rule}" for rule in rules}  # some shadow went its own way, some not
    for rule in rules:
        alone = simulate(("default", 2, "calibrated", (rule,)))
        got = row["runs"][f"off-{rule}"]
        assert (got["max_sd"], got["mean_sd"], tuple(got["churn"])) == (alone.max_sd, alone.mean_sd, alone.churn)
    observe = simulate(("default", 2, "calibrated", None))
    assert row["runs"]["observe"]["max_sd"] == observe.max_sd


@pytest.mark.slow
def test_a_round_stopped_goes_on_with_only_what_its_journal_lacks(tmp_path):
    """Rules run one group at a time; a variant's file is written when its runs are in; run again
    (a last line cut short, one more rule), only the new rule's runs are simulated."""
    sets = {"default": range(2, 3)}
    rule_elimination.run_round(str(tmp_path), (), ("swaps", "untangle"), sets, workers=1, group=1)
    journal = tmp_path / "round-fair.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    first, second = ["fair", "observe", "off-swaps"], ["fair", "off-untangle"]
    assert [sorted(row["runs"]) for row in rows] == [first, first, second, second]
    names = {"observe", "fair", "off-swaps", "off-untangle"}
    assert {path.name for path in tmp_path.glob("*.json")} == {f"{name}-default.json" for name in names}
    before = (tmp_path / "off-swaps-default.json").read_text()
    with journal.open("a") as sink:
        sink.write('{"draw": "default", "se')
    rule_elimination.run_round(str(tmp_path), (), ("swaps", "untangle", "closing"), sets, workers=1, group=2)
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [sorted(row["runs"]) for row in rows[4:]] == [["fair", "off-closing"]] * 2
    assert (tmp_path / "off-swaps-default.json").read_text() == before
    closing = json.loads((tmp_path / "off-closing-default.json").read_text())
    assert [run["seed"] for run in closing["runs"]] == [2, 2]
    model = closing["runs"][0]["interference"]
    assert closing["runs"][0]["max_sd"] == simulate(("default", 2, model, ("closing",))).max_sd


def test_the_noise_band_is_the_issues():
    reference = {"worse": 10, "median_max_sd": 1.300, "churn_median": 20.0}
    assert within_band({"worse": 12, "median_max_sd": 1.305, "churn_median": 22.0}, reference)
    assert not within_band({"worse": 13, "median_max_sd": 1.300, "churn_median": 20.0}, reference)
    assert not within_band({"worse": 10, "median_max_sd": 1.3051, "churn_median": 20.0}, reference)
    assert not within_band({"worse": 10, "median_max_sd": 1.300, "churn_median": 22.1}, reference)


def _sweep(path, policy, rows):
    """A random_mixes --json file: observe at max / mean SD 1.3 / 1.2 and ``policy``'s runs."""
    observe = [vars(Run(seed, model, "observe", 0.0, 1.3, 1.2)) for seed, model, *_ in rows]
    runs = [vars(Run(seed, model, policy, 0.0, max_sd, 1.2, 0, churn)) for seed, model, max_sd, churn in rows]
    path.write_text(json.dumps({"draw": "default", "observe": observe, "runs": runs}))
    return str(path)


def test_heldout_compares_fair_now_with_fair_before_by_the_acceptance(tmp_path):
    before = _sweep(tmp_path / "before.json", "fair",
                    [(0, "calibrated", 1.31, (10.0,)), (1, "gavel", 1.40, (20.0,)), (2, "gavel", 1.32, (30.0,))])
    after = _sweep(tmp_path / "after.json", "fair",  # one more worse run, a median 0.005 higher
                   [(0, "calibrated", 1.325, (5.0,)), (1, "gavel", 1.33, (20.0,)), (2, "gavel", 1.20, (30.0,))])
    table = heldout({"before": [before], "after": [after]})
    assert table["before fair"]["pooled"]["worse"] == 1 and table["after fair"]["pooled"]["worse"] == 2
    assert table["after fair"]["default gavel"]["runs"] == 2
    assert table["after fair"]["accepted"] == {"worse": True, "median_max_sd": True, "churn_median": True,
                                               "churn_p90": True}
    worse = _sweep(tmp_path / "worse.json", "fair",
                   [(0, "calibrated", 1.45, (50.0,)), (1, "gavel", 1.45, (50.0,)), (2, "gavel", 1.45, (50.0,))])
    verdict = heldout({"before": [before], "worse": [worse]})["worse fair"]["accepted"]
    assert verdict == {"worse": True, "median_max_sd": False, "churn_median": False, "churn_p90": False}
    assert rule_elimination.main(["heldout", f"before={before}", f"after={after}",
                                  "--json", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["after fair"]["accepted"]["worse"]
