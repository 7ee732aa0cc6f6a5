"""train_ddp.py refuses ``--gpus`` that put two ranks of a node on one device, on every rank, before any collective.

Started anyway, such a job fails on CUDA at NCCL's first collective ("Duplicate GPU detected"); on
emulated GPUs it trains, but the manager can never steer it (its record names one GPU for two
slots: "unmapped").
"""

from __future__ import annotations

import pytest

from tests.conftest import python_process, torchrun_args

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_two_ranks_on_one_device_are_refused_by_every_rank(ipc_env, tmp_path):
    job = python_process("torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                         "-m", "drbalance.runs.train_ddp", "--devices", "emulated:2", "--gpus", "0,0",
                         "--model", "alexnet", "--batch-size", "4", "--iterations", "2", "--epochs", "1",
                         "--solo-time", "auto", "--time-scale", "0.01", "--no-progress")
    _, err = job.communicate(timeout=200)
    assert job.returncode != 0, err[-3000:]
    assert "--gpus 0,0 gives device(s) [0] to more than one rank of this node" in err, err[-3000:]
