"""A DistributedDataParallel job in the simulator is held to what its record tells the daemon:
its DR stays on its ranks' GPUs, each rank keeping at least one unit (docs/ddp.md)."""

from __future__ import annotations

import pytest

from drbalance.sim import SimConfig, simulate
from drbalance.workload.scenarios import AppSpec, Scenario


def _scenario() -> Scenario:
    apps = (AppSpec("d", "resnet50", 64, 2, 60, (5, 5, 0, 0), ddp=True),
            AppSpec("a", "densenet121", 32, 2, 60, (10, 0, 0, 0)),
            AppSpec("b", "densenet121", 32, 2, 60, (0, 10, 0, 0)),
            AppSpec("c", "alexnet", 128, 2, 60, (10, 0, 0, 0)),
            AppSpec("e", "resnet50", 32, 2, 60, (0, 10, 0, 0)))
    return Scenario("ddp", 4, apps)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["fair", "paper", "f-sched"])
def test_a_ddp_job_keeps_a_share_on_each_rank_and_none_elsewhere(policy):
    result = simulate(_scenario(), SimConfig(policy=policy))
    drs = {tuple(record["dr"]) for record in result.app_records["d"]}
    assert all(dr[0] >= 1 and dr[1] >= 1 and dr[2] == dr[3] == 0 for dr in drs), drs
