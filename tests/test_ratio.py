"""The data-ratio value type and the batch split (property tests)."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drbalance.ratio import DataRatio, apportion, as_ratio


@st.composite
def ratios(draw, max_gpus=8, max_total=40):
    total = draw(st.integers(1, max_total))
    gpus = draw(st.integers(1, max_gpus))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=gpus - 1, max_size=gpus - 1)))
    bounds = [0, *cuts, total]
    return DataRatio([b - a for a, b in zip(bounds, bounds[1:])], total)


@given(ratios(), st.integers(0, 5000))
def test_split_sums_exactly_and_is_proportional(ratio, batch):
    sizes = ratio.split(batch)
    assert len(sizes) == len(ratio)
    assert sum(sizes) == batch
    for size, share in zip(sizes, ratio.shares):
        exact = Fraction(batch * share, ratio.total)
        assert abs(size - exact) < 1, (ratio, batch, sizes)  # largest remainder: within one sample
        if share == 0:
            assert size == 0


@given(ratios(), st.integers(0, 500))
def test_split_is_deterministic(ratio, batch):
    assert ratio.split(batch) == DataRatio(list(ratio.shares), ratio.total).split(batch)


def test_worked_examples():
    assert DataRatio([1, 2, 7, 0]).split(10) == (1, 2, 7, 0)
    assert DataRatio([1, 2, 7, 0]).split(1) == (0, 0, 1, 0)
    assert DataRatio([3, 3, 3, 1]).split(5) == (2, 2, 1, 0)  # ties: larger share, then lower index
    assert DataRatio([5, 5, 0, 0]).split(3) == (2, 1, 0, 0)
    assert DataRatio([10, 0, 0, 0]).split(1) == (1, 0, 0, 0)
    assert DataRatio([3, 3, 3, 1]).split(0) == (0, 0, 0, 0)


def test_batch_smaller_than_used_gpus_leaves_some_empty():
    sizes = DataRatio([2, 2, 2, 2, 2]).split(3)
    assert sum(sizes) == 3 and sizes.count(0) == 2


def test_constructors():
    assert DataRatio.even(4).shares == (3, 3, 2, 2)
    assert DataRatio.even(4, total=4).shares == (1, 1, 1, 1)
    assert DataRatio.single(4, 2).shares == (0, 0, 10, 0)
    # the paper's DR_Update_Util example: remaining utilisation 10/20/80 -> [1, 2, 7, 0]
    assert DataRatio.from_weights([10, 20, 80, 0]).shares == (1, 2, 7, 0)
    assert DataRatio([1, 2, 7, 0]).used == (0, 1, 2)
    assert DataRatio([5, 5], 10).rescale(4).shares == (2, 2)
    assert DataRatio([1, 1, 1, 1], 4).rescale(10).shares == (3, 3, 2, 2)


@pytest.mark.parametrize(
    ("shares", "total", "message"),
    [
        ([3, 3, 3, 2], 10, "sum to 11, but the DR total is 10"),
        ([-1, 11], 10, "entry 0 of [-1, 11] is -1"),
        ([1.5, 8.5], 10, "entry 0 of [1.5, 8.5] is 1.5"),
        ([True, 9], 10, "entry 0"),
        ([], 10, "at least one GPU"),
        ([0, 0], 0, "total must be a positive integer"),
        ("55", 10, "sequence of integer shares"),
    ],
)
def test_bad_ratios_raise_clear_errors(shares, total, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DataRatio(shares, total)


def test_bad_split_and_helpers():
    with pytest.raises(ValueError, match="batch size must be >= 0"):
        DataRatio([10]).split(-1)
    with pytest.raises(ValueError, match="GPU index 4 is outside"):
        DataRatio.single(4, 4)
    with pytest.raises(ValueError, match="entry 0 of \\[nan, 1.0\\] is nan"):
        DataRatio.from_weights([float("nan"), 1.0])
    with pytest.raises(ValueError, match="sum > 0"):
        apportion([0, 0], 3)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=10).filter(any), st.integers(0, 10000))
def test_apportion_integer_and_fraction_paths_agree(weights, amount):
    assert apportion(weights, amount) == apportion([Fraction(w, 7) for w in weights], amount)


# --- a list of numbers is a set of weights ------------------------------------------------------------

@pytest.mark.parametrize(("weights", "expected"), [
    ([1, 2, 7, 0], DataRatio([1, 2, 7, 0], 10)),  # summing to 10: the DR as given
    ([1, 1, 1, 1], DataRatio([1, 1, 1, 1], 4)),  # what a default four-slot wrapper shows
    ([3, 1], DataRatio([3, 1], 4)),  # whole numbers keep their exact proportions
    ([0.7, 0.3], DataRatio([7, 3], 10)),  # other numbers are apportioned to 10
    ([1 / 3, 1 / 3, 1 / 3], DataRatio([4, 3, 3], 10)),  # by largest remainder, ties to the lower index
    ([70000, 1], DataRatio([10, 0], 10)),  # a sum beyond what the record carries: apportioned to 10
    (DataRatio([1, 1], 2), DataRatio([1, 1], 2)),
])
def test_weights_become_a_data_ratio(weights, expected):
    ratio = as_ratio(weights)
    assert ratio == expected
    assert ratio.split(40) == expected.split(40)


def test_weights_with_a_total_are_apportioned_to_it():
    assert as_ratio([1, 1], total=10) == DataRatio([5, 5], 10)
    assert as_ratio([5, 5], total=10) == DataRatio([5, 5], 10)
    assert as_ratio([2, 1], total=10) == DataRatio([7, 3], 10)


@pytest.mark.parametrize(("weights", "message"), [
    ([-1, 11], "entry 0 of [-1, 11] is -1"),
    ([float("nan"), 1], "entry 0 of [nan, 1] is nan"),
    ([float("inf"), 1], "entry 0 of [inf, 1] is inf"),
    ([0, 0], "DR shares [0, 0] are all zero"),
    ([True, 9], "entry 0 of [True, 9] is True (bool)"),
    (["3", 7], "entry 0 of ['3', 7] is '3' (str)"),
    ([], "at least one GPU"),
    ("55", "sequence of shares"),
])
def test_bad_weights_raise_clear_errors(weights, message):
    with pytest.raises(ValueError) as raised:
        as_ratio(weights)
    assert message in str(raised.value)
