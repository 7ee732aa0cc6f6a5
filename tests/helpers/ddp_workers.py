"""Rank functions for tests/test_ddp.py, run with ``torch.multiprocessing.spawn`` over gloo on the CPU.

Each writes its findings as JSON to ``<out>/<name>-rank<r>.json``; the tests assert on them.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.sampler import BalancedBatchSampler
from drbalance.ratio import DataRatio


def init(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)


def write(out: str, name: str, rank: int, data: dict) -> None:
    Path(out, f"{name}-rank{rank}.json").write_text(json.dumps(data))


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def dataset(samples: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(samples, 6, generator=generator), torch.randint(0, 3, (samples,), generator=generator)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def gradients(rank: int, world: int, out: str) -> None:
    """Uneven DRs, a local DR change mid-epoch and an agreed one: compare with one process on the whole batch."""
    init(rank, world, out)
    x, y = dataset()
    model = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 7])
    reference = copy.deepcopy(small_net())
    sampler = BalancedBatchSampler(len(x), 12, model=model, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    steps, seen = [], {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen[epoch] = []
        for step, indices in enumerate(sampler):
            if epoch == 0 and step == 2:
                model.set_ratio([5, 3, 2])  # every rank alike, mid-epoch
            if epoch == 1 and step == 1:
                # rank 0's proposal wins; the others' are ignored
                model.agree_ratio(DataRatio([2, 2, 6]) if rank == 0 else DataRatio([8, 1, 1]))
            everyone = [None] * world
            dist.all_gather_object(everyone, indices)
            batch = [i for part in everyone for i in part]
            seen[epoch].extend(batch)
            optimizer.zero_grad()
            functional.cross_entropy(model(x[indices]), y[indices]).backward()
            reference_optimizer.zero_grad()
            functional.cross_entropy(reference(x[batch]), y[batch]).backward()
            index, ratio, sizes = sampler.last
            steps.append({"epoch": epoch, "step": step, "index": index, "ratio": ratio.to_list(),
                          "sizes": list(sizes), "local": len(indices), "counts": list(model.last_chunk_sizes),
                          "error": max_difference(grads(model.module), grads(reference)),
                          "scale": max(float(g.abs().max()) for g in grads(reference))})
            optimizer.step()
            reference_optimizer.step()
    parameters = max(float((p - q).abs().max()) for p, q in zip(model.module.parameters(), reference.parameters()))
    timings = [[t.slot, t.samples, t.seconds] for t in model.last_replica_timings()]
    write(out, "gradients", rank, {"steps": steps, "seen": seen, "parameters": parameters, "timings": timings,
                                   "batches_per_epoch": len(sampler)})
    dist.destroy_process_group()


def plain_ddp(rank: int, world: int, out: str) -> None:
    """Equal shares match plain DDP bit for bit; unequal batches under plain DDP do not match the full-batch mean."""
    init(rank, world, out)
    x, y = dataset(48)
    balanced = BalancedDistributedDataParallel(small_net())  # even: [1, 1, 1]
    plain = nn.parallel.DistributedDataParallel(small_net())
    sampler = BalancedBatchSampler(len(x), 12, model=balanced, shuffle=False)
    identical = []
    for indices in sampler:
        for model in (balanced, plain):
            model.zero_grad()
            functional.cross_entropy(model(x[indices]), y[indices]).backward()
        identical.append(max_difference(grads(balanced.module), grads(plain.module)))
    # plain DDP fed uneven local batches (the wrong gradient this library exists to fix)
    sizes = [2, 3, 7][:world]
    start = sum(sizes[:rank])
    local = list(range(start, start + sizes[rank]))
    plain.zero_grad()
    functional.cross_entropy(plain(x[local]), y[local]).backward()
    reference = small_net()
    whole = list(range(sum(sizes)))
    functional.cross_entropy(reference(x[whole]), y[whole]).backward()
    write(out, "plain", rank, {"identical": identical,
                               "naive_error": max_difference(grads(plain.module), grads(reference))})
    dist.destroy_process_group()


def run(function, world: int, out: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``: ``function`` is the name of one of the above."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    globals()[function](0, world, out)
