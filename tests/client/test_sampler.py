"""BalancedBatchSampler and RatioSchedule: every rank's share of every global batch, in one process.

The ranks of a job are simulated by one sampler per rank (rank=r, world_size=W): they share no
state, exactly as in separate processes, so agreement between them comes only from the rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from drbalance.client.sampler import (
    BalancedBatchSampler,
    RatioSchedule,
    check_rank_ratio,
    epoch_batches,
    even_ratio,
    job_ratio,
    rank_sizes,
)
from drbalance.ratio import DataRatio

pytestmark = pytest.mark.timeout(120)


def run_epochs(samplers, epochs, changes=()):
    """Iterate every rank's sampler in lockstep; ``changes`` = [(epoch, step, ratio)] set on every rank.

    Returns per epoch a list of global batches, each a list of (rank, indices, (index, ratio, sizes)).
    """
    plan = {(epoch, step): ratio for epoch, step, ratio in changes}
    result = []
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = []
        for step, parts in enumerate(zip(*samplers)):
            batches.append([(rank, indices, samplers[rank].last) for rank, indices in enumerate(parts)])
            if (epoch, step) in plan:
                for sampler in samplers:
                    sampler.set_ratio(plan[(epoch, step)])
        result.append(batches)
    return result


def ratios(world):
    shares = st.lists(st.integers(1, 9), min_size=world, max_size=world)
    return shares.map(lambda s: DataRatio(s, sum(s)))


@st.composite
def jobs(draw):
    world = draw(st.integers(1, 4))
    batch = draw(st.integers(world, 40))
    length = draw(st.integers(world, 160))
    epochs = draw(st.integers(1, 3))
    initial = draw(ratios(world))
    steps = epoch_batches(length, batch, world)
    changes = draw(st.lists(st.tuples(st.integers(0, epochs - 1), st.integers(0, steps - 1), ratios(world)),
                            max_size=6))
    return world, batch, length, epochs, initial, changes


@settings(max_examples=150, deadline=None)
@given(jobs(), st.integers(0, 2**16), st.booleans())
def test_every_sample_once_per_epoch_for_any_ratio_sequence(job, seed, shuffle):
    world, batch, length, epochs, initial, changes = job
    samplers = [BalancedBatchSampler(length, batch, ratio=initial, rank=r, world_size=world, seed=seed,
                                     shuffle=shuffle) for r in range(world)]
    for batches in run_epochs(samplers, epochs, changes):
        seen = [i for parts in batches for _, indices, _ in parts for i in indices]
        assert sorted(seen) == list(range(length))  # every sample, exactly once
        assert len(batches) == len(samplers[0]) == epoch_batches(length, batch, world)
        for parts in batches:
            (index, ratio, sizes), = {last for _, _, last in parts}  # one DR, one split for all ranks
            assert [len(indices) for _, indices, _ in parts] == list(sizes)
            assert min(sizes) >= 1 and sizes == rank_sizes(ratio, sum(sizes))
            assert sum(sizes) >= batch or parts is batches[-1]  # only the last batch may be short


def test_a_change_takes_effect_at_the_next_global_batch_on_every_rank():
    samplers = [BalancedBatchSampler(40, 10, ratio=[5, 5], rank=r, world_size=2, seed=1) for r in range(2)]
    batches = run_epochs(samplers, 2, changes=[(0, 1, DataRatio([2, 8])), (1, 0, DataRatio([9, 1]))])
    used = [(parts[0][2][0], parts[0][2][1].to_list(), parts[0][2][2]) for epoch in batches for parts in epoch]
    assert used == [
        (0, [5, 5], (5, 5)), (1, [5, 5], (5, 5)), (2, [2, 8], (2, 8)), (3, [2, 8], (2, 8)),
        (4, [2, 8], (2, 8)), (5, [9, 1], (9, 1)), (6, [9, 1], (9, 1)), (7, [9, 1], (9, 1)),
    ]


def test_the_order_is_distributed_samplers_seeded_permutation():
    sampler = BalancedBatchSampler(30, 6, rank=0, world_size=3, seed=7)
    sampler.set_epoch(4)
    expected = torch.randperm(30, generator=torch.Generator().manual_seed(7 + 4))
    assert torch.equal(sampler.order(), expected)
    again = BalancedBatchSampler(30, 6, rank=0, world_size=3, seed=7)
    again.set_epoch(4)
    assert list(again) == list(sampler)  # deterministic
    again.set_epoch(5)
    assert list(again) != list(sampler)  # a new order each epoch
    assert torch.equal(BalancedBatchSampler(30, 6, rank=0, world_size=3, shuffle=False).order(), torch.arange(30))


def test_a_tail_too_small_for_every_rank_joins_the_batch_before_it():
    # 50 samples, batches of 12, 3 ranks: 4 batches of 12 leave 2 < 3 samples: the last batch has 14
    samplers = [BalancedBatchSampler(50, 12, rank=r, world_size=3, shuffle=False) for r in range(3)]
    (batches,) = run_epochs(samplers, 1)
    assert [sum(len(indices) for _, indices, _ in parts) for parts in batches] == [12, 12, 12, 14]
    # a tail of at least one sample per rank is its own (short) batch
    samplers = [BalancedBatchSampler(51, 12, rank=r, world_size=3, shuffle=False) for r in range(3)]
    (batches,) = run_epochs(samplers, 1)
    assert [sum(len(indices) for _, indices, _ in parts) for parts in batches] == [12, 12, 12, 12, 3]
    # drop_last drops a short tail (those samples wait for another epoch's order)
    sampler = BalancedBatchSampler(51, 12, rank=0, world_size=3, drop_last=True)
    assert len(sampler) == 4 and all(len(part) == 4 for part in sampler)


def test_rank_sizes_follow_the_split_and_never_starve_a_rank():
    assert rank_sizes(DataRatio([1, 2, 7]), 20) == DataRatio([1, 2, 7]).split(20) == (2, 4, 14)
    # a batch so small that the DR's split rounds rank 0 down to nothing: one sample each first
    assert DataRatio([1, 9]).split(5) == (0, 5)
    assert rank_sizes(DataRatio([1, 9]), 5) == (1, 4)
    assert rank_sizes(DataRatio([1, 1, 1, 7]), 4) == (1, 1, 1, 1)
    for total in range(2, 40):
        for shares in ([1, total - 1], [total // 2, total - total // 2]):
            ratio = DataRatio(shares, total)
            for batch in range(2, 3 * total):
                sizes = rank_sizes(ratio, batch)
                assert sum(sizes) == batch and min(sizes) >= 1
                if batch >= total:
                    assert sizes == ratio.split(batch)
    with pytest.raises(ValueError, match="cannot give each of 3 ranks"):
        rank_sizes(DataRatio([3, 3, 4]), 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 200))
def test_a_job_keeps_its_ratio_in_a_total_of_at_least_ten_with_the_same_splits(shares, batch):
    ratio = DataRatio(shares, sum(shares))
    kept = job_ratio(ratio)
    assert kept.total >= 10 and kept.total % ratio.total == 0
    assert kept.split(batch) == ratio.split(batch)
    if batch >= len(shares):
        assert rank_sizes(kept, batch) == rank_sizes(ratio, batch)
    assert even_ratio(3) == DataRatio([4, 4, 4], 12) and even_ratio(2) == DataRatio([5, 5])


def test_bad_ratios_and_sizes_are_rejected_with_the_rule():
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] less than 1 unit"):
        check_rank_ratio([10, 0], 2)
    with pytest.raises(ValueError, match="has 3 entries but the job has 2 rank"):
        check_rank_ratio([3, 3, 4], 2)
    with pytest.raises(ValueError, match="smaller than the 4 ranks"):
        BalancedBatchSampler(100, 3, rank=0, world_size=4)
    with pytest.raises(ValueError, match="leave no batch"):
        BalancedBatchSampler(2, 8, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank 3 is not within a world of 3"):
        BalancedBatchSampler(100, 9, rank=3, world_size=3)
    with pytest.raises(ValueError, match="positive integer"):
        BalancedBatchSampler(100, 0, rank=0, world_size=1)
    with pytest.raises(TypeError, match="BalancedDistributedDataParallel"):
        BalancedBatchSampler(100, 8, model=torch.nn.Linear(2, 2))
    sampler = BalancedBatchSampler(100, 10, rank=0, world_size=2)
    with pytest.raises(ValueError, match="less than 1 unit"):
        sampler.set_ratio([10, 0])
    assert sampler.ratio == DataRatio([5, 5])  # unchanged after a rejected DR (the even default, in tenths)
    # arguments of the wrong type are named, never truncated or read as true
    with pytest.raises(TypeError, match=r"from_batch must be an integer; got 2\.7"):
        sampler.set_ratio([3, 7], from_batch=2.7)
    with pytest.raises(TypeError, match="from_batch must be an integer; got 'x'"):
        sampler.set_ratio([3, 7], from_batch="x")
    with pytest.raises(TypeError, match=r"epoch must be an integer; got 1\.5"):
        sampler.set_epoch(1.5)
    with pytest.raises(TypeError, match="seed must be an integer"):
        BalancedBatchSampler(100, 10, rank=0, world_size=2, seed="x")
    with pytest.raises(TypeError, match="shuffle must be True or False; got the string 'no'"):
        BalancedBatchSampler(100, 10, rank=0, world_size=2, shuffle="no")
    assert sampler.ratio == DataRatio([5, 5])
    assert sampler.set_ratio([3, 7], from_batch=np.int64(2)) == 2  # NumPy integers are whole numbers
    with pytest.raises(ValueError, match=r"^DR: DR shares \[0, 0\] are all zero"):
        check_rank_ratio([0, 0], 2)  # the rule of as_ratio itself, prefixed with where it was given
    with pytest.raises(ValueError, match=r"^--ratio: DR shares"):
        check_rank_ratio([-1, 1], 2, where="--ratio")
    # weights: [1, 1] is kept as [5, 5]/10 as the docstring says, [3, 1] as [9, 3]/12
    assert check_rank_ratio([1, 1], 2) == DataRatio([5, 5], 10)
    assert check_rank_ratio([3, 1], 2) == DataRatio([9, 3], 12)
    assert check_rank_ratio([0.3, 0.7], 2) == DataRatio([3, 7], 10)


def test_the_schedule_never_resplits_a_produced_batch():
    schedule = RatioSchedule(DataRatio([5, 5]))
    assert [schedule.take()[0] for _ in range(3)] == [0, 1, 2]
    assert schedule.set(DataRatio([2, 8]), from_batch=1) == 3  # batches 1, 2 were produced already
    assert schedule.set(DataRatio([7, 3]), from_batch=6) == 6
    assert [schedule.take()[1].to_list() for _ in range(5)] == [[2, 8], [2, 8], [2, 8], [7, 3], [7, 3]]
    assert schedule.ratio_for(8) == schedule.latest == DataRatio([7, 3]) and schedule.next_batch == 8
    # a later entry that starts no later than a pending one replaces it
    assert schedule.set(DataRatio([1, 9]), from_batch=20) == 20
    assert schedule.set(DataRatio([4, 6]), from_batch=12) == 12
    assert schedule.ratio_for(30) == DataRatio([4, 6])


def test_ranks_with_prefetching_loaders_switch_at_the_same_global_batch():
    """Two ranks' DataLoaders with worker processes run ahead of training by the same number of batches."""
    data = TensorDataset(torch.arange(96))
    samplers = [BalancedBatchSampler(96, 8, ratio=[5, 5], rank=r, world_size=2, seed=2) for r in range(2)]
    loaders = [DataLoader(data, batch_sampler=s, num_workers=1, prefetch_factor=2) for s in samplers]
    seen, sizes = [], []
    for step, parts in enumerate(zip(*loaders)):
        seen.extend(i for (part,) in parts for i in part.tolist())
        sizes.append([len(part) for (part,) in parts])
        if step == 3:
            for sampler in samplers:  # every rank at the same training step
                sampler.set_ratio([3, 7])
    assert sorted(seen) == list(range(96))  # no overlap, no gap: both ranks split every batch alike
    switch = sizes.index([2, 6])
    assert sizes == [[4, 4]] * switch + [[2, 6]] * (len(sizes) - switch)  # never a mix of the two DRs
    assert switch > 4  # the loaders had produced batches 4.. already with the old DR
