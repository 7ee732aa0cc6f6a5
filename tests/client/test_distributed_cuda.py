"""BalancedDistributedDataParallel on NCCL, one CUDA GPU per rank: the counting steps' device path.

Skipped without two CUDA GPUs (missing hardware). Not run yet: see docs/gpu-results.md.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ddp import check_counting, spawn

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, one per rank)"),
]


def test_counting_steps_on_nccl_give_the_full_batch_mean_and_every_rank_agrees_on_k(tmp_path):
    check_counting(spawn("counting_nccl", 2, tmp_path))
