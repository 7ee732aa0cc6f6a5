"""benchmarks.fair_sensitivity: the "not worse than doing nothing" rule, the variants, the CLI."""

from __future__ import annotations

import pytest

from benchmarks import fair_sensitivity
from benchmarks.fair_sensitivity import Variant, not_worse, short_table, variants
from drbalance.sim.reproduce import Outcome, measure

pytestmark = pytest.mark.timeout(120)


def outcome(max_sd: float, mean_sd: float) -> Outcome:
    return Outcome(spread=0.0, max_sd=max_sd, mean_sd=mean_sd, util=80.0, mean_sd_time=mean_sd, start=0.0)


def test_not_worse_allows_a_hundredth_on_max_and_on_mean_and_no_more():
    base = outcome(1.30, 1.20)
    assert not_worse(outcome(1.31, 1.21), base)
    assert not not_worse(outcome(1.32, 1.10), base)  # lower mean does not excuse a higher max
    assert not not_worse(outcome(1.00, 1.215), base)


def test_variants_are_the_defaults_then_windows_then_report_periods_at_one_cadence():
    chosen = variants(2)
    assert chosen[0] == Variant(decide_every=2) and all(v.decide_every == 2 for v in chosen)
    assert [v.label for v in chosen[:2]] == ["defaults, decide every 2", "window x0.98, decide every 2"]
    assert len(chosen) == 1 + len(fair_sensitivity.WINDOW_FACTORS) + len(fair_sensitivity.REPORT_PERIODS)


def test_short_table_compares_fair_with_observe_of_the_same_scenario():
    table = short_table(1, ("e2e-a",), (None,))
    rows = [line for line in table.splitlines() if line.startswith("| e2e-a")]
    assert [row.split(" | ")[1] for row in rows] == ["calibrated", "gavel"]
    base = measure("e2e-a", "round-robin", "observe", "calibrated")
    assert f"{base.max_sd:.3f} / {base.mean_sd:.3f}" in rows[0]
    counted = int(rows[0].split(" | ")[5])
    assert 0 <= counted <= len(variants())


@pytest.mark.parametrize("cadences", ["", "own,0", "sometimes"])
def test_bad_cadences_are_refused_with_a_usage_error(cadences, capsys):
    with pytest.raises(SystemExit) as raised:
        fair_sensitivity.main(["--short", "e2e-a", "--cadences", cadences])
    assert raised.value.code == 2 and "--cadences" in capsys.readouterr().err
