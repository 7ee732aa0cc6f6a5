"""Shared by the DDP tests: ranks run by ``torch.multiprocessing.spawn``, their findings checked, a
manager on two scripted GPUs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import ModuleType

import torch.multiprocessing as mp

from drbalance.client.distributed import MAX_EXCHANGE_INTERVAL, exchange_interval
from drbalance.policy.base import Decision
from drbalance.ratio import DataRatio
from tests.helpers import ddp_workers


def spawn(name: str, world: int, tmp_path: Path, module: ModuleType = ddp_workers) -> list[dict]:
    """Run ``<module>.<name>`` (default ``ddp_workers``) on ``world`` ranks; their JSON findings, in rank order."""
    mp.spawn(getattr(module, name), args=(world, str(tmp_path)), nprocs=world, join=True)
    return [json.loads((tmp_path / f"{name.split('_')[0]}-rank{r}.json").read_text()) for r in range(world)]


def check_counting(ranks: list[dict]) -> None:
    """What tests/helpers/ddp_workers.count_and_compare found on every rank (also used on NCCL)."""
    for rank, found in enumerate(ranks):
        for part in ("agreed", "pinned", "summed", "deep"):
            for step in found[part]:
                assert step["counts"] == step["sizes"], (rank, part, step)
                assert step["error"] <= 1e-6 * max(1.0, step["scale"]), (rank, part, step)
        # K pinned to 3: exchanges at steps 0 and 3; an empty rank (mean loss NaN) at counting step 1 and 4
        assert [s["exchanged"] for s in found["pinned"]] == [True, False, False, True, False]
        assert [s["sizes"][1] for s in found["pinned"]][1::3] == [0, 0]
        assert [s["exchanged"] for s in found["summed"]] == [True, False, False, True, False]
        assert [s["exchanged"] for s in found["deep"]] == [True, False, False, True, False, False]
        assert found["buckets"] >= 3 and len({tuple(s["sizes"]) for s in found["deep"]}) > 1
    agreed = [[(s["exchanged"], s["plan"]) for s in found["agreed"]] for found in ranks]
    assert all(other == agreed[0] for other in agreed[1:])  # the same K, from the same values, everywhere
    plans = {tuple(plan) for _, plan in agreed[0]}
    for _, interval, step_seconds, cost_seconds, wall_seconds in plans:
        assert interval == exchange_interval(step_seconds, cost_seconds, wall_seconds)
        assert 1 <= interval <= MAX_EXCHANGE_INTERVAL
    # step 0 and 1 always exchange (nothing measured yet); then every exchange is K steps after the one before
    exchanges = [index for index, (exchanged, _) in enumerate(agreed[0]) if exchanged]
    assert exchanges[:2] == [0, 1]
    by_step = {plan[0]: plan[1] for _, plan in agreed[0]}
    assert all(later - earlier == by_step[earlier] for earlier, later in zip(exchanges, exchanges[1:]))


# --- with a manager, under torchrun -----------------------------------------------------------------


class ScriptPolicy:
    """A real policy object for the daemon: at each boundary of ``app`` the next DR of a script."""

    name = "script"

    def __init__(self, app: str, ratios: list[list[int]]) -> None:
        self.app = app
        self.ratios = [DataRatio(r) for r in ratios]
        self.views = []

    def decide(self, app, trigger, snapshot):
        view = snapshot.app(app)
        self.views.append(view)
        if app == self.app and trigger == "boundary" and self.ratios:
            return Decision(app, self.ratios.pop(0), "script")
        return Decision(app, view.ratio, "keep")


def read_ready(process, ranks: int, timeout: float) -> dict[int, int]:
    """Read the job's stdout until every rank has said it is ready and trained a step: {rank: pid}."""
    pids: dict[int, int] = {}
    stepped: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(stepped) < ranks:
        if time.monotonic() > deadline or process.poll() is not None:
            raise AssertionError(f"the job did not start: {process.poll()}")
        line = process.stdout.readline()
        if line.startswith("{"):
            fields = json.loads(line)
            pids[fields["rank"]] = fields["pid"]
            if "step" in fields:
                stepped.add(fields["rank"])
    return pids
