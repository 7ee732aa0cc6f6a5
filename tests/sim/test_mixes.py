"""drbalance.sim.mixes: the policies start from --placement, doing nothing always from round-robin."""

from __future__ import annotations

import pytest

from drbalance.sim import SimConfig, simulate
from drbalance.sim.mixes import MIXES, main, table

pytestmark = pytest.mark.timeout(300)


def _cells(text: str, mix: str) -> dict[str, list[str]]:
    """Per interference model, the row's cells after the mix name (observe first)."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and cells[1] == mix:
            rows[cells[0]] = cells[2:]
    return rows


def _cell(result) -> str:
    return f"{result.sd_spread:.3f} / {result.max_sd:.3f} / {result.mean_sd:.3f}"


@pytest.mark.slow
def test_from_spread_the_policy_starts_spread_and_doing_nothing_stays_round_robin():
    text = table(["hetero"], ["fair"], workers=1, placement="spread")
    assert "fair (from spread)" in text.splitlines()[0]
    row = _cells(text, "hetero")["calibrated"]
    observe = simulate(MIXES["hetero"](), SimConfig(policy="observe", placement="round-robin", record=False))
    fair = simulate(MIXES["hetero"](), SimConfig(policy="fair", placement="spread", record=False))
    assert row[0] == _cell(observe)
    assert row[1].rsplit(" ", 1)[0] == _cell(fair)
    from_spread = simulate(MIXES["hetero"](), SimConfig(policy="observe", placement="spread", record=False))
    assert _cell(from_spread) != _cell(observe)  # so the check above tells the two starts apart


def test_an_unknown_placement_is_refused_before_simulating(capsys):
    with pytest.raises(ValueError, match="placement must be one of"):
        table(["hetero"], ["fair"], placement="diagonal")
    with pytest.raises(SystemExit) as stopped:
        main(["--placement", "diagonal"])
    assert stopped.value.code == 2
    assert "--placement: invalid choice: 'diagonal'" in capsys.readouterr().err
