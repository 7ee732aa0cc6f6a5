"""Rank functions for tests/client/test_distributed_control_timeout.py (``mp.spawn``, gloo on the CPU).

The job's process group is made with the backend string ``"cpu:gloo"`` (as ``"cpu:gloo,cuda:nccl"``
or NCCL would be), so its control exchange runs on a gloo group of its own. Rank 1 stops taking part
after two steps (a stuck rank); rank 0 must give up after the process group's timeout.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client.distributed import BalancedDistributedDataParallel

TIMEOUT_SECONDS = 3
"""The process group's timeout: how long rank 0 should wait for the stuck rank."""

STUCK_SECONDS = 60
"""How long rank 1 stays stuck if rank 0 does not give up first."""


def control_timeout(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_SECONDS))
    torch.manual_seed(0)
    model = BalancedDistributedDataParallel(nn.Linear(4, 2), exchange_every=1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for _ in range(2):  # steps 0 and 1 together (at step 1 DDP also rebuilds its buckets, over its own group)
        functional.mse_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
    given_up = Path(out, "rank0-gave-up")
    found: dict = {"separate_group": model._balance.control is not model.process_group}
    if rank == 1:  # stuck: no more steps, until rank 0 gave up (or STUCK_SECONDS passed)
        deadline = time.monotonic() + STUCK_SECONDS
        while not given_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        found["rank0_gave_up_first"] = given_up.exists()
    else:
        try:
            functional.mse_loss(model(x[:2]), y[:2]).backward()  # step 2: a control exchange rank 1 never joins
            found["error"] = None
        except RuntimeError as error:
            found["error"] = f"{type(error).__name__}: {error}"
        given_up.touch()
    Path(out, f"control-rank{rank}.json").write_text(json.dumps(found))
    os._exit(0)  # the other rank is gone or stuck: no process group teardown
