"""Per-rank shares of each global batch for ``DistributedDataParallel`` jobs (no torch.distributed calls).

A DDP job trains on *global batches*: every step, ``batch_size`` samples of one shuffled epoch
order, split across the job's ranks by the job's data ratio (DR; one share per rank). Rank ``r``
gets the ``r``-th consecutive slice of the global batch, of ``rank_sizes(ratio, len(batch))[r]``
samples. Every rank draws the same permutation (seeded with ``seed + epoch``, as
``torch.utils.data.DistributedSampler`` does), so the ranks' slices never overlap and, over an
epoch, every sample is used exactly once (unless ``drop_last``).

The DR may change while an epoch runs. Which DR splits which global batch is kept in a
:class:`RatioSchedule`: a list of ``(from_batch, ratio)`` entries keyed by the *global batch
index* (the count of global batches produced since the sampler was made, across epochs). As long
as every rank's schedule holds the same entries, every rank splits every global batch with the
same DR, whatever its DataLoader prefetches. ``BalancedDistributedDataParallel.agree_ratio``
makes sure they do: the entry's ``from_batch`` is the largest "next batch" over all ranks.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterator, Sequence, Sized

import torch
from torch.utils.data import Sampler

from drbalance.ratio import DEFAULT_TOTAL, DataRatio, as_ratio

MIN_SAMPLES_PER_RANK = 1
"""Every rank trains on at least this many samples in every step (see :func:`rank_sizes`)."""

MIN_SHARE = 1
"""Every rank keeps at least this many units of the DR total (what a DDP job publishes as ``min_share``)."""


def check_rank_ratio(ratio: DataRatio | Sequence[float], world_size: int, where: str = "DR") -> DataRatio:
    """``ratio`` (a DataRatio, or weights: ``drbalance.ratio.as_ratio``) as a DataRatio over
    ``world_size`` ranks, each with at least ``MIN_SHARE`` units.

    The total is raised to at least 10 as :func:`job_ratio` does (same proportions, same splits).

    Raises ``ValueError`` naming the rule: one share per rank, no rank below the minimum (a rank
    of a DDP job cannot be left out of a step: it would have nothing to contribute to the
    gradient all-reduce that every rank must join).
    """
    try:
        value = job_ratio(as_ratio(ratio))
    except (ValueError, TypeError) as error:
        raise type(error)(f"{where}: {error}") from None
    if len(value) != world_size:
        raise ValueError(
            f"{where} {value} has {len(value)} entries but the job has {world_size} rank(s); give one share per rank"
        )
    starved = [rank for rank, share in enumerate(value) if share < MIN_SHARE]
    if starved:
        raise ValueError(
            f"{where} {value} gives rank(s) {starved} less than {MIN_SHARE} unit(s) of {value.total}; every rank "
            f"of a DistributedDataParallel job must keep at least {MIN_SHARE} (it trains at least "
            f"{MIN_SAMPLES_PER_RANK} sample each step)"
        )
    return value


def whole_number(value: object, name: str) -> int:
    """``value`` as an int if it is a whole number (Python or NumPy integer, not bool); TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    return int(value)


def flag(value: object, name: str) -> bool:
    """``value`` as a bool; a string (``"no"`` would read as True) is a TypeError naming ``name``."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be True or False; got the string {value!r}")
    return bool(value)


def job_ratio(ratio: DataRatio) -> DataRatio:
    """``ratio`` with its total raised to a multiple of itself that is at least ``DEFAULT_TOTAL`` (10).

    The proportions, and so every split, stay exactly the same (``[1, 1]/2`` becomes ``[5, 5]/10``,
    ``[1, 2]/3`` becomes ``[4, 8]/12``). A DDP job keeps its DR in such a total so that its minimum
    share of one unit is at most a tenth of the batch, and converts to exactly one unit of the
    manager's default total.
    """
    factor = -(-DEFAULT_TOTAL // ratio.total)  # ceil
    return ratio if factor <= 1 else DataRatio([share * factor for share in ratio.shares], ratio.total * factor)


def even_ratio(world_size: int) -> DataRatio:
    """Equal shares for every rank (in a total of at least 10): the split of plain DDP."""
    return job_ratio(DataRatio([1] * world_size, world_size))


def rank_sizes(ratio: DataRatio, batch: int) -> tuple[int, ...]:
    """Samples per rank for a global batch of ``batch`` samples under ``ratio`` (sums to ``batch``).

    ``ratio.split(batch)`` (largest remainder, deterministic ties) when that gives every rank at
    least one sample, which it always does when ``batch >= ratio.total`` and every share is >= 1.
    A smaller batch can round a rank down to 0; then every rank gets one sample first and the
    remaining ``batch - ranks`` samples are split by the DR. ``ValueError`` if ``batch`` is
    smaller than the number of ranks.
    """
    ranks = len(ratio)
    if batch < ranks * MIN_SAMPLES_PER_RANK:
        raise ValueError(
            f"a global batch of {batch} sample(s) cannot give each of {ranks} ranks {MIN_SAMPLES_PER_RANK} sample"
        )
    sizes = ratio.split(batch)
    if min(sizes) >= MIN_SAMPLES_PER_RANK:
        return sizes
    rest = ratio.split(batch - ranks * MIN_SAMPLES_PER_RANK)
    return tuple(MIN_SAMPLES_PER_RANK + size for size in rest)


class RatioSchedule:
    """Which DR splits which global batch. Shared by a DDP model (which sets it) and its sampler (which reads it).

    ``set(ratio, from_batch)`` makes ``ratio`` split global batch ``from_batch`` and every later
    one; ``from_batch=None`` means the next batch not produced yet. ``take()`` returns the DR for
    the next batch and counts it as produced. Thread-safe (a DataLoader iterates its sampler in
    the training process, but a user may set the DR from another thread).
    """

    def __init__(self, ratio: DataRatio) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[int, DataRatio]] = [(0, ratio)]
        self._produced = 0

    @property
    def next_batch(self) -> int:
        """Index of the next global batch to be produced (= global batches produced so far)."""
        return self._produced

    @property
    def latest(self) -> DataRatio:
        """The DR of the last entry: the one every batch from now on will use, unless set again."""
        return self._entries[-1][1]

    def set(self, ratio: DataRatio, from_batch: int | None = None) -> int:
        """Use ``ratio`` from global batch ``from_batch`` on; returns the index it starts at.

        A ``from_batch`` before the next batch to be produced (already produced with another DR)
        is moved to the next batch: produced batches are never re-split.
        """
        wanted = None if from_batch is None else whole_number(from_batch, "from_batch")
        with self._lock:
            start = self._produced if wanted is None else max(wanted, self._produced)
            while self._entries and self._entries[-1][0] >= start:
                self._entries.pop()
            self._entries.append((start, ratio))
            return start

    def ratio_for(self, index: int) -> DataRatio:
        """The DR that will split global batch ``index`` (one not produced yet: past entries are dropped)."""
        with self._lock:
            chosen = self._entries[0][1]
            for start, ratio in self._entries:
                if start <= index:
                    chosen = ratio
            return chosen

    def take(self) -> tuple[int, DataRatio]:
        """(index, DR) of the next global batch; the batch counts as produced."""
        with self._lock:
            index = self._produced
            while len(self._entries) > 1 and self._entries[1][0] <= index:
                self._entries.pop(0)  # entries wholly in the past
            self._produced += 1
            return index, self._entries[0][1]


def _dataset_length(data: Sized | int) -> int:
    if isinstance(data, numbers.Integral) and not isinstance(data, bool):
        length = int(data)
    elif isinstance(data, Sized):
        length = len(data)
    else:
        raise TypeError(f"give a dataset with a length, or its number of samples; got {type(data).__name__}")
    if length < 1:
        raise ValueError(f"the dataset is empty ({length} samples)")
    return length


def global_batch_bounds(length: int, batch_size: int, ranks: int, drop_last: bool) -> list[tuple[int, int]]:
    """(start, end) of each global batch in an epoch's order of ``length`` samples.

    Batches hold ``batch_size`` samples; the last holds what is left. With ``drop_last`` a short
    last batch is dropped. Without it, a last batch too small to give every rank a sample (fewer
    than ``ranks`` samples) is folded into the batch before it, so every sample is still used.
    """
    full, tail = divmod(length, batch_size)
    bounds = [(k * batch_size, (k + 1) * batch_size) for k in range(full)]
    if tail and not drop_last:
        if tail >= ranks or not bounds:
            bounds.append((full * batch_size, length))
        else:
            start, _ = bounds.pop()
            bounds.append((start, length))
    if not bounds or bounds[-1][1] - bounds[-1][0] < ranks:
        raise ValueError(
            f"{length} samples in global batches of {batch_size}{' (drop_last)' if drop_last else ''} leave no "
            f"batch that can give each of {ranks} ranks a sample"
        )
    return bounds


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices of every global batch (use as a DataLoader ``batch_sampler``).

    Arguments:

    - ``data``: the dataset (anything with ``len``) or its number of samples.
    - ``batch_size``: samples per *global* batch (all ranks together).
    - ``model``: a ``BalancedDistributedDataParallel``; the sampler follows its DR schedule and
      takes its rank and world size. Or, without a model: ``ratio`` (default: even), ``rank``
      and ``world_size`` (default: from ``torch.distributed``).
    - ``shuffle`` (default True) and ``seed`` (default 0): the epoch order is
      ``torch.randperm(len, generator seeded with seed + epoch)``, the same on every rank; call
      :meth:`set_epoch` at the start of every epoch, as with ``DistributedSampler``.
    - ``drop_last`` (default False): drop a short last global batch instead of training on it.

    Every rank gets the same number of batches per epoch (``len(sampler)``), so no rank runs out
    of data before the others. Every rank's slice has at least one sample (:func:`rank_sizes`).
    """

    def __init__(
        self,
        data: Sized | int,
        batch_size: int,
        *,
        model: object | None = None,
        ratio: DataRatio | Sequence[float] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.length = _dataset_length(data)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size (samples per global batch) must be a positive integer; got {batch_size!r}")
        self.batch_size = int(batch_size)
        if model is not None:
            if ratio is not None or rank is not None or world_size is not None:
                raise ValueError("give either model= (the sampler follows its DR, rank and world size) or "
                                 "ratio=/rank=/world_size=, not both")
            schedule = getattr(model, "ratio_schedule", None)
            if not isinstance(schedule, RatioSchedule):
                raise TypeError(f"model= must be a BalancedDistributedDataParallel; got {type(model).__name__}")
            self.schedule = schedule
            self.rank, self.world_size = int(model.rank), int(model.world_size)  # type: ignore[attr-defined]
        else:
            self.rank, self.world_size = _rank_and_size(rank, world_size)
            initial = even_ratio(self.world_size) if ratio is None else ratio
            self.schedule = RatioSchedule(check_rank_ratio(initial, self.world_size))
        self.shuffle = flag(shuffle, "shuffle")
        self.seed = whole_number(seed, "seed")
        self.drop_last = flag(drop_last, "drop_last")
        self.epoch = 0
        if self.batch_size < self.world_size:
            raise ValueError(f"batch_size {self.batch_size} is smaller than the {self.world_size} ranks: every rank "
                             f"needs at least {MIN_SAMPLES_PER_RANK} sample per global batch")
        self.bounds = global_batch_bounds(self.length, self.batch_size, self.world_size, self.drop_last)
        self.last: tuple[int, DataRatio, tuple[int, ...]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order (seeded with ``seed + epoch``); call it on every rank before each epoch."""
        self.epoch = whole_number(epoch, "epoch")

    def set_ratio(self, ratio: DataRatio | Sequence[float], from_batch: int | None = None) -> int:
        """Split global batches from ``from_batch`` (default: the next one) by ``ratio``; returns that index.

        Call it on every rank with the same arguments (a model-driven sampler follows
        ``model.set_ratio`` / ``model.agree_ratio`` instead).
        """
        return self.schedule.set(check_rank_ratio(ratio, self.world_size), from_batch)

    @property
    def ratio(self) -> DataRatio:
        """The DR of batches from the next one on."""
        return self.schedule.latest

    def order(self) -> torch.Tensor:
        """This epoch's order of sample indices (identical on every rank)."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator)

    def __len__(self) -> int:
        return len(self.bounds)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        rank = self.rank
        for start, end in self.bounds:
            index, ratio = self.schedule.take()
            sizes = rank_sizes(ratio, end - start)
            offset = start + sum(sizes[:rank])
            self.last = (index, ratio, sizes)
            yield order[offset:offset + sizes[rank]].tolist()


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("give rank= and world_size=, or a model=, or initialise torch.distributed first")
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer; got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not within a world of {world_size} rank(s)")
    return int(rank), int(world_size)


def epoch_batches(length: int, batch_size: int, ranks: int, drop_last: bool = False) -> int:
    """Global batches per epoch (what ``len(BalancedBatchSampler(...))`` returns)."""
    return len(global_batch_bounds(length, batch_size, ranks, drop_last))


__all__ = [
    "MIN_SAMPLES_PER_RANK", "MIN_SHARE", "BalancedBatchSampler", "RatioSchedule", "check_rank_ratio",
    "epoch_batches", "even_ratio", "global_batch_bounds", "job_ratio", "rank_sizes",
]
