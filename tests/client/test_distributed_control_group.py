"""The control exchange's own gloo group (NCCL jobs, or "cpu:gloo,cuda:nccl"): one per process group, not per model.

A job whose process group is not plain gloo gets a gloo group of its ranks for the control
exchange, one per process group: a new one for every model wrapped would be kept (with its
threads and connections) until ``destroy_process_group``, so re-wrapping models in one process
would leak a gloo group each time. The backend string "cpu:gloo" takes that path on the CPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from drbalance.client import BalancedDistributedDataParallel

pytestmark = pytest.mark.timeout(120)


def wrap_and_step() -> BalancedDistributedDataParallel:
    model = BalancedDistributedDataParallel(nn.Linear(3, 2), exchange_every=1)
    model(torch.randn(4, 3)).sum().backward()  # a control exchange over the control group
    assert model.last_chunk_sizes == (4,)
    return model


@pytest.mark.slow
def test_models_wrapped_one_after_another_share_one_control_group(tmp_path):
    for run in range(2):  # the second time after destroy_process_group: a destroyed group is not reused
        dist.init_process_group("cpu:gloo", init_method=f"file://{tmp_path}/store{run}", rank=0, world_size=1)
        try:
            first = wrap_and_step()
            control = first._balance.control
            assert control is not first.process_group  # the path of a non-gloo process group
            assert control in dist.distributed_c10d._world.pg_map  # a live group of this run
            del first
            gc.collect()
            groups = dist.get_pg_count()  # the default group and the control group
            for _ in range(4):
                model = wrap_and_step()
                assert model._balance.control is control
                del model
                gc.collect()
            assert groups == 2 and dist.get_pg_count() == groups  # no gloo group (threads, sockets) per model
        finally:
            dist.destroy_process_group()
