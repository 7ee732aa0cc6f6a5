"""A stuck rank of a job whose control exchange has a gloo group of its own (NCCL, "cpu:gloo,cuda:nccl").

The control group takes the timeout ``init_process_group`` was given (train_ddp.py's
``--timeout``), not ``new_group``'s default (30 minutes): the other ranks fail after the job's
timeout instead of waiting half an hour for a stuck rank in the control exchange.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers import ddp_stuck

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_the_control_exchange_gives_up_on_a_stuck_rank_after_the_process_groups_timeout(tmp_path):
    mp.spawn(ddp_stuck.control_timeout, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"control-rank{r}.json").read_text()) for r in range(2)]
    assert all(found["separate_group"] for found in ranks)  # the exchange runs on a gloo group of its own
    error = ranks[0]["error"]
    assert error is not None and error.startswith("RatioSyncError") and "rank 0" in error, error
    assert "timed out" in error.lower(), error  # the group's timeout, not rank 1 leaving at last
    assert ranks[1]["rank0_gave_up_first"]  # rank 0 did not wait for rank 1 to give up
