"""Rank function for tests/integrations/test_wrappers.py: two gloo ranks open a job's session as the integrations do.

Each rank writes ``<out>/rank<r>.json``: the app name its session got, or the error it raised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.integrations.job import JobPlan, JobSettings, open_job_session


def broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def open_session(rank: int, world: int, out: str, app: str | None, default_app: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    model = BalancedDistributedDataParallel(nn.Linear(2, 1))
    try:
        session = open_job_session(model, JobPlan(1, 4), JobSettings(app, 10.0, {"sd_log": False}), default_app,
                                   broadcast)
        found = {"app": session.app, "pid": os.getpid()}
        session.close()
    except Exception as error:  # what the rank raised, for the test to read
        found = {"error": type(error).__name__, "message": str(error)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
