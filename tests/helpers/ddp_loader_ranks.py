"""Rank functions for tests/client/test_loader.py (``torch.multiprocessing.spawn``, gloo on the CPU).

Each writes its findings as JSON to ``<out>/<name>-rank<r>.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, WeightedRandomSampler

from drbalance.client import BalancedDistributedDataParallel, balanced_loader

SAMPLES = 64


class Recorder(logging.Handler):
    """Keeps the drbalance.client warnings of this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tagged_collate(batch):
    """The script's own collate_fn: stacks, and says it ran (the balanced loader must keep it)."""
    images = torch.stack([image for image, _ in batch])
    labels = torch.stack([label for _, label in batch])
    return images, labels, "tagged"


def train_epoch(model, loader, optimizer) -> list[dict]:
    steps = []
    for images, labels, tag in loader:
        counts = [0] * dist.get_world_size()
        dist.all_gather_object(counts, len(images))
        ids = [None] * dist.get_world_size()
        dist.all_gather_object(ids, images[:, 0].tolist())
        optimizer.zero_grad()
        functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        steps.append({"counts": counts, "ids": [i for part in ids for i in part], "tag": tag})
    return steps


def loaders(rank: int, world: int, out: str) -> None:
    """The DDP tutorial's loader (per-rank batch 8, DistributedSampler) under a DR of weights [3, 1]:
    first as it is (equal batches: the warning), then remade by balanced_loader."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    recorder = Recorder()
    logging.getLogger("drbalance.client").addHandler(recorder)
    torch.manual_seed(0)
    features = torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1).repeat(1, 4)  # column 0: the sample's id
    data = TensorDataset(features, torch.arange(SAMPLES) % 3)
    model = BalancedDistributedDataParallel(nn.Linear(4, 3), ratio=[3, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    plain = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=5), collate_fn=tagged_collate)
    plain.sampler.set_epoch(0)
    plain_steps = train_epoch(model, plain, optimizer)
    warned_plain = list(recorder.messages)
    found = {"plain_steps": plain_steps, "warned_plain": warned_plain}
    loader = balanced_loader(plain, model)
    found["length"] = len(loader)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)  # where a DistributedSampler script calls it
        epochs.append(train_epoch(model, loader, optimizer))
    found["epochs"] = epochs
    found["rank_samples"] = len(loader.sampler)
    found["ratio"] = model.ratio.to_list()
    found["warned_after"] = recorder.messages[len(warned_plain):]
    refused = {}
    for name, build in (
        ("iterable", lambda: DataLoader(Stream(), batch_size=4)),
        ("weighted", lambda: DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * SAMPLES, 10))),
        ("no_batches", lambda: DataLoader(data, batch_size=None)),
    ):
        try:
            balanced_loader(build(), model)
        except ValueError as error:
            refused[name] = str(error)
    try:
        balanced_loader(plain, nn.Linear(2, 2))
    except TypeError as error:
        refused["model"] = str(error)
    found["refused"] = refused
    shuffled = balanced_loader(DataLoader(data, batch_size=4, shuffle=True, drop_last=True), model,
                               global_batch_size=10)
    found["shuffled"] = {"shuffle": shuffled.batch_sampler.shuffle, "drop_last": shuffled.batch_sampler.drop_last,
                         "batches": len(shuffled)}
    Path(out, f"loaders-rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))
