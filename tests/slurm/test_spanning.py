"""A DDP job spanning both nodes of the Slurm test cluster (cluster.sh): ``sbatch -N2`` runs one
torchrun agent per node with ``srun`` (a c10d rendezvous at the first node of
``SLURM_JOB_NODELIST``), two gloo ranks on the CPU each; every node runs its system manager (the
cluster's default node manager), and each node's leader registers the job there as
``<app>@<SLURMD_NODENAME>`` (docs/ddp.md, "Jobs spanning nodes")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from drbalance.jsonlog import read_json_lines
from tests.conftest import ROOT
from tests.helpers.ddp_nodes import free_port
from tests.helpers.slurm import SlurmCluster
from tests.helpers.system import others_may_run_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def users_may_run_python():
    with others_may_run_python():
        yield


def spanning_script(folder: Path, port: int) -> str:
    return f"""#!/bin/bash
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
address=$(scontrol show node "$head" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
exec srun --kill-on-bad-exit=1 {sys.executable} -m torch.distributed.run --nnodes "$SLURM_JOB_NUM_NODES" \\
    --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint "$address:{port}" --rdzv_id "$SLURM_JOB_ID" \\
    --max_restarts 0 --log-dir {folder}/torchrun -m tests.helpers.ddp_nodes_app --app spanjob --ratio 1,3,2,6 \\
    --epochs 2 --iterations 6 --report-every 1 --decide-every 2 --exchange-every 1 --balance-nodes off
"""


def attached(cluster: SlurmCluster, node: str, name: str) -> list[str]:
    """The apps named ``name`` or ``name@<node>`` that ``node``'s manager added (the cluster is the
    run's: other tests' jobs are in its log too)."""
    path = cluster.folder / node / "system" / "default" / "manager.jsonl"
    added = [e["app"] for e in read_json_lines(path) if e.get("event") == "app_added"] if path.exists() else []
    return [app for app in added if app.split(":", 1)[-1].split("@", 1)[0] == name]


def test_a_job_over_both_nodes_trains_with_the_whole_batch_gradient_and_both_managers_list_it(
        slurm_cluster, slurm_users, job_folders):
    user = slurm_users[0]
    folder = job_folders[user.name]
    env = slurm_cluster.client_env(user, PYTHONPATH=str(ROOT), DRBALANCE_LOG_DIR=str(folder / "logs"))
    job = slurm_cluster.sbatch(spanning_script(folder, free_port()), "-N2", "--ntasks-per-node=1", user=user,
                               folder=folder, env=env)
    done = slurm_cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=600)
    output = (folder / f"job-{job}.out").read_text()
    assert done["JobState"] == "COMPLETED", output[-4000:]
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{") and line.endswith("}")]
    leaders = sorted((line["app"], line["node"]) for line in lines if line.get("leader"))
    assert leaders == [("spanjob@n1", "n1"), ("spanjob@n2", "n2")]
    steps = [line for line in lines if "step" in line]
    assert len(steps) == 4 * 12 and {line["rank"] for line in steps} == {0, 1, 2, 3}
    for step in steps:
        assert step["counts"] == step["sizes"] and step["error"] <= 1e-6 * max(1.0, step["scale"]), step
    assert {tuple(step["sizes"]) for step in steps if step["batch"] == 0} == {(1, 4, 3, 8)}  # 16 as 1:3:2:6
    for node in ("n1", "n2"):  # each node's manager lists its part of the job
        assert attached(slurm_cluster, node, "spanjob") == [f"{user.uid}:spanjob@{node}"]
