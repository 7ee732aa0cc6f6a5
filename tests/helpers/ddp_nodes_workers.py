"""Rank functions for tests/client/test_distributed_nodes.py: a job of 4 ranks on two "nodes" of
2 (torchrun's ``GROUP_RANK`` set per rank, as each node's agent sets it), gloo on the CPU, started
with ``torch.multiprocessing.spawn``. Each writes its findings as JSON to ``<out>/<name>-rank<r>.json``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn import functional

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.sampler import BalancedBatchSampler
from tests.helpers.ddp_workers import dataset, grads, init, max_difference, small_net, write


def split_of(model: BalancedDistributedDataParallel) -> dict:
    split = model.node_split
    return {"shares": split.node_shares.to_list(), "total": split.node_shares.total,
            "locals": [[local.to_list(), local.total] for local in split.locals]}


def spanning(rank: int, world: int, out: str) -> None:
    """Uneven shares across and within nodes; node n2's leader (rank 2) proposes its local DR at
    step 1 (rank 1 and 3, not leaders, propose too: ignored); rank 0 proposes a whole-job DR at
    step 5. K pinned to 2. Each step's gradient is compared with one process's on the global batch."""
    os.environ["GROUP_RANK"] = str(rank // 2)
    os.environ["SLURMD_NODENAME"] = f"n{rank // 2 + 1}"
    init(rank, world, out)
    x, y = dataset()
    model = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 3, 4], exchange_every=2, balance_nodes=False)
    reference = small_net()
    sampler = BalancedBatchSampler(len(x), 12, model=model, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    steps = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, indices in enumerate(sampler):
            split = split_of(model)  # in force when the sampler made this batch: the one that split it
            if epoch == 0 and step == 1 and rank != 0:
                model.propose_local_ratio([1, 4] if rank == 2 else [9, 1])
            if epoch == 1 and step == 1:
                model.propose_ratio([4, 3, 2, 1] if rank == 0 else [1, 1, 1, 7])
            everyone = [None] * world
            dist.all_gather_object(everyone, indices)
            batch = [i for part in everyone for i in part]
            optimizer.zero_grad()
            functional.cross_entropy(model(x[indices]), y[indices]).backward()
            reference_optimizer.zero_grad()
            functional.cross_entropy(reference(x[batch]), y[batch]).backward()
            index, ratio, sizes = sampler.last
            steps.append({"index": index, "ratio": [ratio.to_list(), ratio.total], "sizes": list(sizes),
                          "counts": list(model.last_chunk_sizes), "split": split,
                          "error": max_difference(grads(model.module), grads(reference)),
                          "scale": max(float(g.abs().max()) for g in grads(reference))})
            optimizer.step()
            reference_optimizer.step()
    layout = model.node_layout
    write(out, "spanning", rank, {"steps": steps, "names": list(layout.names), "node_of": list(layout.node_of),
                                  "agreed": [[split.locals[1].to_list(), start]
                                             for split, start in model.take_node_agreed()]})
    dist.destroy_process_group()
