"""The one call that turns a DDP script's own ``DataLoader`` into one that follows the job's DR.

A torchrun script builds its loader with ``DistributedSampler`` (or ``shuffle=True``) and a
per-rank batch size. Kept as it is under ``BalancedDistributedDataParallel``, every rank trains on
the same number of samples whatever the DR says: the manager's shares change nothing.
:func:`balanced_loader` makes the same loader over a :class:`~drbalance.client.sampler.BalancedBatchSampler`:

    loader = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset), num_workers=4)
    model = BalancedDistributedDataParallel(net, device_ids=[local_rank])
    loader = balanced_loader(loader, model)     # global batch 32 x ranks, split by the DR
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)         # as with DistributedSampler
        for images, labels in loader: ...

It keeps the dataset, the workers, ``collate_fn``, ``pin_memory`` and every other loader setting,
and takes the shuffling, seed and ``drop_last`` from the loader's sampler. See docs/ddp.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from drbalance.client.sampler import BalancedBatchSampler, rank_sizes

# DataLoader settings a balanced loader takes over from the loader it replaces, as attributes of that loader
CARRIED_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class EpochSampler(Sampler[int]):
    """What ``loader.sampler`` is on a balanced loader: ``set_epoch`` (where scripts written for
    ``DistributedSampler`` call it) reaches the loader's :class:`BalancedBatchSampler`, which makes
    the batches. Its length is this rank's samples per epoch under the current DR. It is not
    iterated: the batch sampler counts every global batch it makes, so a second reader would put
    this rank out of step with the others."""

    def __init__(self, batches: BalancedBatchSampler) -> None:
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order (``BalancedBatchSampler.set_epoch``); every rank, before each epoch."""
        self.batches.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    def __len__(self) -> int:
        ratio, rank = self.batches.ratio, self.batches.rank
        return sum(rank_sizes(ratio, end - start)[rank] for start, end in self.batches.bounds)

    def __iter__(self) -> Iterator[int]:
        raise TypeError("a balanced loader's sampler only sets the epoch: iterate the loader itself (its "
                        "batch_sampler makes this rank's share of every global batch)")


class BalancedDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`BalancedBatchSampler` whose ``sampler.set_epoch`` works (see
    :class:`EpochSampler`); made by :func:`balanced_loader`. ``batch_sampler`` is the balanced one."""

    def __init__(self, dataset: Any, batch_sampler: BalancedBatchSampler, **settings: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **settings)
        object.__setattr__(self, "sampler", EpochSampler(batch_sampler))  # DataLoader refuses the plain setattr


def balanced_loader(loader: DataLoader, model: Any, *, global_batch_size: int | None = None,
                    shuffle: bool | None = None, seed: int | None = None,
                    drop_last: bool | None = None) -> BalancedDataLoader:
    """``loader`` remade so that each global batch is split across the job's ranks by ``model``'s DR.

    - ``loader``: the script's ``DataLoader`` (map-style dataset, ``batch_size`` per rank, a
      ``DistributedSampler``, ``shuffle=True`` or none). Its dataset, workers, ``collate_fn``,
      ``pin_memory`` and other settings are kept.
    - ``model``: the job's ``BalancedDistributedDataParallel`` (its DR, rank and world size).
    - ``global_batch_size``: samples per global batch, all ranks together; default: the loader's
      per-rank ``batch_size`` x the ranks (the samples a step trains on stay the same).
    - ``shuffle``, ``seed``, ``drop_last``: default from the loader (a ``DistributedSampler``'s
      ``shuffle`` and ``seed``, a ``RandomSampler``: shuffled, none: in order; ``drop_last`` of the
      loader or its ``DistributedSampler``: a short last global batch is dropped).

    ``ValueError`` naming what cannot be kept: an iterable-style dataset, a loader that makes no
    batches, or a sampler of another kind (a ``WeightedRandomSampler``: its draws cannot be split
    by a DR; build a ``BalancedBatchSampler`` yourself). ``TypeError`` for a model that is not a
    ``BalancedDistributedDataParallel``.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"balanced_loader remakes a torch DataLoader; got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("balanced_loader needs a map-style dataset (with a length): an IterableDataset's "
                         "samples cannot be dealt out to the ranks by index")
    if global_batch_size is None:
        if loader.batch_size is None:
            raise ValueError("the loader has no batch_size (it has a batch_sampler of its own, or makes no "
                             "batches): give global_batch_size=")
        global_batch_size = loader.batch_size * _world_size(model)
    order = _sampler_settings(loader)
    batches = BalancedBatchSampler(
        loader.dataset, global_batch_size, model=model,
        shuffle=order["shuffle"] if shuffle is None else shuffle,
        seed=order["seed"] if seed is None else seed,
        drop_last=order["drop_last"] if drop_last is None else drop_last,
    )
    return BalancedDataLoader(loader.dataset, batches, **carried_settings(loader))


def carried_settings(loader: DataLoader) -> dict[str, Any]:
    """The ``DataLoader`` keyword arguments of ``loader`` that a balanced loader keeps (:data:`CARRIED_SETTINGS`)."""
    settings = {name: getattr(loader, name) for name in CARRIED_SETTINGS if hasattr(loader, name)}
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)  # DataLoader refuses one without workers
    return settings


def _world_size(model: Any) -> int:
    size = getattr(model, "world_size", None)
    if getattr(model, "ratio_schedule", None) is None or not isinstance(size, int):
        raise TypeError(f"model must be a BalancedDistributedDataParallel; got {type(model).__name__}")
    return size


def _sampler_settings(loader: DataLoader) -> dict[str, Any]:
    """Shuffle, seed and drop_last of ``loader``'s sampler, as a balanced loader keeps them."""
    sampler, drop_last = loader.sampler, loader.drop_last
    if loader.batch_size is None:  # a batch_sampler of the user's own: a BatchSampler's sampler decides
        sampler = getattr(loader.batch_sampler, "sampler", loader.batch_sampler)
        drop_last = bool(getattr(loader.batch_sampler, "drop_last", False))
    if isinstance(sampler, DistributedSampler):
        return {"shuffle": sampler.shuffle, "seed": sampler.seed, "drop_last": drop_last or sampler.drop_last}
    if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler.num_samples == len(loader.dataset):
        return {"shuffle": True, "seed": 0, "drop_last": drop_last}
    if isinstance(sampler, SequentialSampler):
        return {"shuffle": False, "seed": 0, "drop_last": drop_last}
    raise ValueError(f"balanced_loader keeps a DistributedSampler, a RandomSampler (each sample once per epoch) "
                     f"or none; this loader's is a {type(sampler).__name__}, whose draws a DR cannot split: build "
                     f"a drbalance.client.BalancedBatchSampler for it yourself (docs/ddp.md)")
