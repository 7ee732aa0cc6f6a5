"""The one-call loader for DDP jobs: a DDP script's own DataLoader, remade by
``balanced_loader``, follows the job's DR; a loader that does not is warned about at the first step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from drbalance.client.distributed import warn_if_loader_ignores
from drbalance.ratio import DataRatio
from tests.helpers import ddp_loader_ranks

pytestmark = pytest.mark.timeout(180)


def spawn(name: str, world: int, tmp_path: Path) -> list[dict]:
    mp.spawn(getattr(ddp_loader_ranks, name), args=(world, str(tmp_path)), nprocs=world, join=True)
    return [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_ddp_scripts_loader_remade_in_one_call_follows_the_dr(tmp_path):
    """With the tutorial's DistributedSampler kept, ratio=[3, 1] trains 8 and 8 samples per rank, so
    rank 0 warns at the first step; balanced_loader(loader, model) splits the
    global batch of 8 x 2 as 12 + 4, keeps the collate_fn, every sample once per epoch, and
    loader.sampler.set_epoch (where DDP scripts call it) reshuffles."""
    ranks = spawn("loaders", 2, tmp_path)
    first, second = ranks
    assert all(step["counts"] == [8, 8] for step in first["plain_steps"])
    assert len(first["warned_plain"]) == 1 and "is uneven, but every rank trained on 8 samples" in \
        first["warned_plain"][0] and "balanced_loader" in first["warned_plain"][0]
    assert second["warned_plain"] == []  # rank 0 alone says it
    assert first["ratio"] == [9, 3] and first["length"] == second["length"] == 4  # 64 samples / 16
    for epoch in first["epochs"]:
        assert [step["counts"] for step in epoch] == [[12, 4]] * 4
        assert all(step["tag"] == "tagged" for step in epoch)
        assert sorted(i for step in epoch for i in step["ids"]) == list(range(64))
    orders = [[i for step in epoch for i in step["ids"]] for epoch in first["epochs"]]
    assert orders[0] != orders[1]  # set_epoch chose a new order
    assert first["epochs"] == second["epochs"]  # every rank saw the same global batches
    assert first["rank_samples"] == 48 and second["rank_samples"] == 16
    assert first["warned_after"] == []
    refused = first["refused"]
    assert "needs a map-style dataset" in refused["iterable"]
    assert "WeightedRandomSampler, whose draws a DR cannot split" in refused["weighted"]
    assert "no batch_size" in refused["no_batches"] and "global_batch_size=" in refused["no_batches"]
    assert "must be a BalancedDistributedDataParallel; got Linear" in refused["model"]
    assert first["shuffled"] == {"shuffle": True, "drop_last": True, "batches": 6}  # 64 // 10


def test_the_first_step_warning_only_when_the_dr_would_split_the_batch_unevenly(caplog):
    with caplog.at_level(logging.WARNING, logger="drbalance.client"):
        assert warn_if_loader_ignores(DataRatio([3, 7]), (32, 32))
        assert not warn_if_loader_ignores(DataRatio([5, 5]), (32, 32))  # an even DR: equal batches are right
        assert not warn_if_loader_ignores(DataRatio([3, 7]), (19, 45))  # the loader follows the DR
        assert not warn_if_loader_ignores(DataRatio([3, 7]), (1, 1))  # a batch of 2 splits 1 + 1 under [3, 7] too
    assert len(caplog.records) == 1 and "DR [3, 7]/10 is uneven" in caplog.records[0].getMessage()
