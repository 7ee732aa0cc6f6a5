"""Rank functions for tests/client/test_distributed_dead_peer.py (``torch.multiprocessing.spawn``, gloo on the CPU).

Rank 1 dies (``os._exit``) before step 3; K is pinned to 100, so step 3 is a counting step (the
counts ride in the gradient all-reduce, no control exchange). Rank 0 writes what its backward raised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client.distributed import BalancedDistributedDataParallel


def dead_peer(rank: int, world: int, out: str, buckets: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    extra = {"bucket_cap_mb": 0.0002} if buckets == "several" else {}
    model = BalancedDistributedDataParallel(net, ratio=[3, 7], exchange_every=100, **extra)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    part = slice(0, 3) if rank == 0 else slice(3, 10)
    found: dict = {"exchanged": [], "error": None}
    for step in range(5):
        if rank == 1 and step == 3:
            os._exit(0)  # dies without a word
        try:
            functional.cross_entropy(model(x[part]), y[part]).backward()
        except RuntimeError as error:
            found["error"] = f"{type(error).__name__}: {error}"
            break
        found["exchanged"].append(model.last_step_exchanged)
    Path(out, f"dead-{buckets}-rank{rank}.json").write_text(json.dumps(found))
    os._exit(0)  # its peer is gone: no process group teardown
