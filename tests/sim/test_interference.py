"""The ``gavel`` model keeps Gavel's measured speed shares while both jobs of a pair run.

Gavel measured each pair with both jobs running throughout. A fit that compares those shares
with runs of equal iteration counts lets the faster job finish first and the slower one run its
last iterations alone, which pushes its rate far down (DenseNet-121 beside ResNet-50 would keep
0.14 of its speed where Gavel measured 0.37).
"""

from __future__ import annotations

import pytest

from drbalance.sim.interference import GavelInterference, measured_shares
from tests.helpers.simulation import shares_while_both_run

PAIRS = [(("densenet121", 32), ("resnet50", 32)), (("densenet121", 16), ("resnet50", 16)),
         (("resnet50", 32), ("alexnet", 128)), (("densenet121", 32), ("alexnet", 128)),
         (("resnet50", 32), ("resnet50", 32))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first, second", PAIRS)
def test_the_stored_gavel_rates_keep_the_measured_shares_while_both_jobs_run(first, second):
    gavel = GavelInterference.load()
    wanted = measured_shares(gavel.table, first, second)
    got = shares_while_both_run(gavel, first, second)
    assert got == pytest.approx(wanted, rel=0.03), (first, second, got, wanted)


@pytest.mark.timeout(120)
def test_a_pair_the_fit_cannot_bring_within_tolerance_is_a_warning_naming_it(caplog):
    from drbalance.sim.interference import GavelTable, fit_pair

    table = GavelTable.load()
    pair = (("densenet121", 32), ("resnet50", 32))
    with caplog.at_level("WARNING", logger="drbalance.sim.interference"):
        fit_pair(table, *pair)  # converges within 2%: nothing to say
        assert not caplog.records
        fit_pair(table, *pair, rounds=0, tolerance=0.0)  # the closed form alone is never exact
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "densenet121" in message and "resnet50" in message and "did not converge in 0 rounds" in message
