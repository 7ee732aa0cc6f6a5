"""A rank that dies between control exchanges: its peers say so as they do in a control exchange.

A dead peer found in a counting step's gradient all-reduce raises ``RatioSyncError`` naming the
rank, as one found in a control exchange does, not gloo's raw ``RuntimeError`` ("Connection closed
by peer [127.0.0.1]:port") from the backward.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers import ddp_dead_peer

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
@pytest.mark.parametrize("buckets", ["one", "several"])
def test_a_peer_that_dies_between_exchanges_is_reported_as_a_ratio_sync_error_naming_the_rank(tmp_path, buckets):
    mp.spawn(ddp_dead_peer.dead_peer, args=(2, str(tmp_path), buckets), nprocs=2, join=True)
    found = json.loads((tmp_path / f"dead-{buckets}-rank0.json").read_text())
    assert found["exchanged"] == [True, False, False]  # step 3, where rank 1 was gone, was a counting step
    error = found["error"]
    assert error is not None and error.startswith("RatioSyncError: "), error
    assert "rank 0 could not all-reduce its gradients" in error and "another rank of the job probably died" in error
