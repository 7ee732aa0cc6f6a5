"""benchmarks.move_misses: how far `fair`'s predictions of its own moves miss, by kind of move."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.move_misses import kind_of, main, run

pytestmark = pytest.mark.timeout(240)


def test_moves_are_told_apart_by_their_replica_counts():
    assert [kind_of(1, 2), kind_of(3, 1), kind_of(1, 1), kind_of(2, 2)] == ["split", "join", "one GPU", "several"]


def test_without_the_replica_penalty_splits_miss_their_predictions_more_than_one_gpu_moves():
    misses = run(("c", "calibrated", 0.0))  # docs/policy.md: the reason the penalty exists
    assert len(misses["split"]) >= 5 and len(misses["one GPU"]) >= 5
    # splits ran slower than predicted, and by more than moves from one GPU to another; since a job's
    # measurement windows restart at a DR change (no window mixes two DRs) by about 2% (1.019 against
    # 1.002), where mixed windows made it 5% and more
    assert statistics.median(misses["split"]) > 1.0
    assert statistics.median(misses["split"]) > statistics.median(misses["one GPU"])
    learned = run(("c", "calibrated", None))  # with it, the policy splits less
    assert len(learned.get("split", [])) < len(misses["split"])


@pytest.mark.parametrize("argv", [["a", "--step", "2"], ["no-such-scenario"], ["a", "--workers", "0"]])
def test_bad_arguments_are_refused_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert "error" in capsys.readouterr().err


def test_by_branch_tells_a_swaps_mover_from_its_pushed_partner():
    misses = run(("c", "calibrated", None), by_branch=True)
    assert {key.split("/")[1] for key in misses} <= {"move", "swap", "plan", "pushed"}
    swapped, pushed = misses["one GPU/swap"], misses["one GPU/pushed"]
    assert swapped and pushed
    # a swap's mover is predicted with every change of the swap (docs/policy.md, "A swap's mover
    # is predicted with its partner gone"): before, as if its partner stayed, its median was
    # under 0.9 (it ran faster than predicted), its pushed partner's above
    assert 0.9 < statistics.median(swapped) < 1.1
    assert 0.9 < statistics.median(pushed) < 1.1
