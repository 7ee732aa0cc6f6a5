"""drbalance on the two-node Slurm test cluster: each node runs its system manager on its emulated
GPUs (cluster.sh's default node manager); jobs are real training processes of two unprivileged
users, submitted with sbatch, as a user of a Slurm cluster submits them (docs/slurm.md)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest

from drbalance.jsonlog import read_json_lines
from tests.conftest import ROOT, wait_for
from tests.helpers.slurm import SlurmCluster, SlurmUser
from tests.helpers.system import others_may_run_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
COLLECTED_WITHIN = 10.0  # seconds from a job's end (scancel, time limit) until its node's manager removed it


@pytest.fixture(autouse=True)
def users_may_run_python():
    with others_may_run_python():
        yield


def train_script(*options: str, epochs: int = 1000, iterations: int = 5, model: str = "alexnet") -> str:
    """A batch script: the repository's training script on the node's emulated GPUs."""
    return ("#!/bin/bash\necho \"CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-}\"\n"
            f"exec {sys.executable} -m drbalance.runs.train --model {model} --epochs {epochs} "
            f"--iterations {iterations} --batch-size 8 --sample-scale 4 --time-scale 10 --no-progress "
            f"--solo-time auto {' '.join(options)}\n")


def submit(cluster: SlurmCluster, user: SlurmUser, folder: Path, *options: str, script: str | None = None) -> int:
    env = cluster.client_env(user, PYTHONPATH=str(ROOT), DRBALANCE_LOG_DIR=str(folder / "logs"))
    return cluster.sbatch(script or train_script(), *options, user=user, folder=folder, env=env)


def manager_log(cluster: SlurmCluster, node: str) -> Path:
    return cluster.folder / node / "system" / "default" / "manager.jsonl"


def events(cluster: SlurmCluster, node: str, kind: str) -> list[dict]:
    path = manager_log(cluster, node)
    return [e for e in read_json_lines(path) if e.get("event") == kind] if path.exists() else []


def decided(cluster: SlurmCluster, node: str, user: SlurmUser, job_id: int) -> list[dict]:
    """The decisions of ``node``'s manager for the job (its app: ``<uid>:<SLURM_JOB_NAME>-<SLURM_JOB_ID>``)."""
    return [e for e in events(cluster, node, "decision")
            if e["app"].startswith(f"{user.uid}:") and e["app"].endswith(f"-{job_id}")]


def running(cluster: SlurmCluster, job_id: int) -> dict[str, str]:
    return cluster.wait_job(job_id, ("RUNNING",), timeout=120)


def output(folder: Path, job_id: int) -> str:
    path = folder / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""


def test_two_users_jobs_on_one_node_are_balanced_by_its_manager(slurm_cluster, slurm_users, job_folders):
    first, second = slurm_users
    jobs = [(first, submit(slurm_cluster, first, job_folders[first.name], "-w", "n1", "--gres=gpu:2")),
            (second, submit(slurm_cluster, second, job_folders[second.name], "-w", "n1", "--gres=gpu:2"))]
    for user, job in jobs:
        running(slurm_cluster, job)
        wait_for(lambda user=user, job=job: decided(slurm_cluster, "n1", user, job), timeout=180)
    attached = {e["app"]: e["uid"] for e in events(slurm_cluster, "n1", "attached")}
    assert {uid for uid in attached.values()} == {first.uid, second.uid}
    assert not events(slurm_cluster, "n2", "attached")  # two "nodes" of one machine do not meet


def test_a_job_trains_only_on_the_gpus_slurm_gave_it(slurm_cluster, slurm_users, job_folders):
    user = slurm_users[0]
    folder = job_folders[user.name]
    holder = submit(slurm_cluster, user, folder, "-w", "n1", "--gres=gpu:2")
    running(slurm_cluster, holder)
    job = submit(slurm_cluster, user, folder, "-w", "n1", "--gres=gpu:2")
    running(slurm_cluster, job)
    wait_for(lambda: len(decided(slurm_cluster, "n1", user, job)) >= 3, timeout=240)
    granted = {int(gpu) for gpu in output(folder, job).splitlines()[0].split("=", 1)[1].split(",")}
    mine = [e["dr"][e["app"]] for e in decided(slurm_cluster, "n1", user, job)]
    used = {gpu for dr in mine for gpu, share in enumerate(dr) if share}
    assert len(granted) == 2 and used <= granted  # the manager never moved its data to another GPU
    holders = [e["dr"][e["app"]] for e in decided(slurm_cluster, "n1", user, holder)]
    assert not used & {gpu for dr in holders for gpu, share in enumerate(dr) if share}
    log = folder / "logs"
    lines = [json.loads(line) for path in log.glob(f"*-{job}.sd.jsonl") for line in path.read_text().splitlines()]
    assert lines and all(len(line["dr"]) == 2 for line in lines)  # the job's DR has the two granted GPUs


def test_jobs_given_shards_of_one_gpu_contend_there_and_are_balanced(slurm_cluster, slurm_users, job_folders):
    jobs = [(user, submit(slurm_cluster, user, job_folders[user.name], "-w", "n2", "--gres=shard:1",
                          script=train_script("--decide-every", "5", model="resnet50")))
            for user in slurm_users]
    for user, job in jobs:
        running(slurm_cluster, job)
        wait_for(lambda user=user, job=job: decided(slurm_cluster, "n2", user, job), timeout=240)
    keys = [decided(slurm_cluster, "n2", user, job)[0]["app"] for user, job in jobs]

    def contended() -> dict | None:  # a decision that saw both slowed by the other on their one GPU
        for event in reversed(events(slurm_cluster, "n2", "decision")):
            if all(key in event["sd"] and (event["sd"][key] or 0) > 1.1 for key in keys):
                return event
        return None

    seen = wait_for(contended, timeout=300)
    gpus = [{gpu for gpu, share in enumerate(seen["dr"][key]) if share} for key in keys]
    assert gpus[0] == gpus[1] and len(gpus[0]) == 1  # both on the one GPU whose shards they hold


def test_scancel_and_a_time_limit_are_collected_within_seconds_and_the_rest_rebalanced(slurm_cluster, slurm_users,
                                                                                        job_folders):
    user = slurm_users[1]
    folder = job_folders[user.name]
    stays = submit(slurm_cluster, user, folder, "-w", "n1", script=train_script("--decide-every", "5"))
    cancelled = submit(slurm_cluster, user, folder, "-w", "n1")
    timed = submit(slurm_cluster, user, folder, "-w", "n1", "--time=1")  # one minute
    for job in (stays, cancelled, timed):
        running(slurm_cluster, job)
        wait_for(lambda job=job: decided(slurm_cluster, "n1", user, job), timeout=240)
    slurm_cluster.run(["scancel", str(cancelled)])
    cancelled_at = time.time()
    removed = wait_for(lambda: next((e for e in events(slurm_cluster, "n1", "app_removed")
                                     if e["app"].endswith(f"-{cancelled}")), None), timeout=60)
    assert removed["t"] - cancelled_at <= COLLECTED_WITHIN
    ended = slurm_cluster.wait_job(timed, ("TIMEOUT",), timeout=240)
    removed = wait_for(lambda: next((e for e in events(slurm_cluster, "n1", "app_removed")
                                     if e["app"].endswith(f"-{timed}")), None), timeout=60)
    end = time.mktime(time.strptime(ended["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert removed["t"] - end <= COLLECTED_WITHIN + 1.0  # EndTime has whole seconds
    after = removed["t"]
    wait_for(lambda: [e for e in decided(slurm_cluster, "n1", user, stays) if e["t"] > after], timeout=120)
    latest = [e for e in decided(slurm_cluster, "n1", user, stays) if e["t"] > after][-1]
    assert not any(key.endswith((f"-{cancelled}", f"-{timed}")) for key in latest["sd"])  # they are gone


def test_a_requeued_job_resumes_from_its_checkpoint(slurm_cluster, slurm_users, job_folders):
    user = slurm_users[0]
    folder = job_folders[user.name]
    checkpoint = folder / "model.pt"
    job = submit(slurm_cluster, user, folder, "-w", "n2", "--requeue",
                 script=train_script("--checkpoint", str(checkpoint), epochs=4, iterations=4))
    running(slurm_cluster, job)
    wait_for(checkpoint.exists, timeout=300)
    slurm_cluster.run(["scontrol", "requeue", str(job)])
    slurm_cluster.wait_job(job, ("COMPLETED",), timeout=600)
    log = next((folder / "logs").glob(f"*-{job}.sd.jsonl"))
    starts = [json.loads(line) for line in log.read_text().splitlines() if '"event": "start"' in line
              or '"event":"start"' in line]
    assert len(starts) == 2 and starts[0]["start_epoch"] == 0 and starts[1]["start_epoch"] >= 1
    attached = [e for e in events(slurm_cluster, "n2", "attached") if e["app"].endswith(f"-{job}")]
    assert len(attached) == 2 and attached[0]["pid"] != attached[1]["pid"]  # the same app, a new process


def node_weight(cluster: SlurmCluster, node: str) -> int:
    shown = cluster.run(["scontrol", "-o", "show", "node", node]).stdout
    return int(dict(f.split("=", 1) for f in shown.split() if "=" in f)["Weight"])


def logged_weight(cluster: SlurmCluster, node: str) -> int | None:
    """The weight of the last update ``node``'s manager logged as done (``None``: none yet)."""
    updates = [e for e in events(cluster, node, "slurm_weight") if e["returncode"] == 0]
    if not updates:
        return None
    assert updates[-1]["command"].endswith(f"NodeName={node} Weight={updates[-1]['weight']}"), updates[-1]
    return int(updates[-1]["weight"])


def test_slurm_weight_sends_the_next_job_to_the_quieter_node(slurm_cluster, slurm_users, job_folders):
    user = slurm_users[1]
    folder = job_folders[user.name]
    wait_for(lambda: node_weight(slurm_cluster, "n1") == node_weight(slurm_cluster, "n2") == 100, timeout=60)
    first = submit(slurm_cluster, user, folder)  # equal weights: Slurm takes the first node
    assert running(slurm_cluster, first)["NodeList"] == "n1"
    crowd = [submit(slurm_cluster, user, folder, "-w", "n1") for _ in range(2)]
    for job in crowd:
        running(slurm_cluster, job)
        wait_for(lambda job=job: decided(slurm_cluster, "n1", user, job), timeout=240)
    wait_for(lambda: node_weight(slurm_cluster, "n1") > node_weight(slurm_cluster, "n2"), timeout=60)
    # the manager logs an update when it collects scontrol's exit, a turn after Slurm shows it
    wait_for(lambda: logged_weight(slurm_cluster, "n1") == node_weight(slurm_cluster, "n1"), timeout=60)
    following = submit(slurm_cluster, user, folder)
    assert running(slurm_cluster, following)["NodeList"] == "n2"
    with contextlib.suppress(AssertionError):
        slurm_cluster.cancel_all()
