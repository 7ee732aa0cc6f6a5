"""A DistributedDataParallel job in the simulator is held to what its record tells the daemon:
its DR stays on its ranks' GPUs, each rank keeping at least one unit (docs/ddp.md)."""

from __future__ import annotations

import pytest

from drbalance import cli
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("ratio", "total", "expected"), [
    ((1, 9), 3, (1, 2)),  # plain largest remainder gave (0, 3): rank 0 dropped
    ((1, 9), 20, (2, 18)),  # no rank near zero: the plain rescale
    ((1, 1, 98), 5, (1, 1, 3)),
    ((0, 1, 9), 2, (0, 1, 1)),  # a GPU without a rank stays empty
])
def test_dr_total_keeps_one_unit_on_each_rank_of_a_ddp_job(ratio, total, expected):
    apps = (AppSpec("d", "resnet50", 64, 1, 5, ratio, ddp=True),
            AppSpec("p", "resnet50", 64, 1, 5, ratio))  # a DataParallel job may lose a GPU
    scenario = Scenario("s", len(ratio), apps, dr_total=sum(ratio)).with_dr_total(total)
    assert scenario.apps[0].ratio == expected
    assert sum(scenario.apps[1].ratio) == total


@pytest.mark.timeout(60)
def test_dr_total_below_a_ddp_jobs_ranks_is_refused_naming_the_app(tmp_path, capsys):
    apps = (AppSpec("d", "resnet50", 64, 1, 5, (3, 3, 4), ddp=True),)
    with pytest.raises(ValueError, match=r"app 'd': a DDP job of 3 ranks needs a DR total of at least 3"):
        Scenario("s", 3, apps).with_dr_total(2)
    path = tmp_path / "ddp.json"
    path.write_text(Scenario("s", 3, apps).to_json())
    assert cli.main(["simulate", str(path), "--policy", "observe", "--dr-total", "2"]) == 1
    error = capsys.readouterr().err
    assert f"{path}: --dr-total: app 'd': a DDP job of 3 ranks needs a DR total of at least 3" in error
