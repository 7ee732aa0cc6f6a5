"""The two-node Slurm test cluster itself (tests/slurm/cluster.sh, docs/slurm.md): its nodes, the
GPUs and shards it gives jobs, what each node puts in its tasks' environment, scancel, and jobs of
unprivileged users. The drbalance-side Slurm tests build on what these establish.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers.slurm import (
    GPUS_PER_NODE,
    KILL_WAIT,
    NODES,
    SHARDS_PER_GPU,
    SlurmCluster,
    SlurmUser,
    free_port_base,
    run_script,
    user_folder,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first test installs and starts the cluster

HOLD = "sleep 600"  # a job that runs until the test cancels it


def env_lines(text: str) -> dict[str, str]:
    """``env``'s output as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def gpu_set(value: str) -> set[int]:
    """A comma-separated list of GPU indexes (``CUDA_VISIBLE_DEVICES``) as a set."""
    return {int(index) for index in value.split(",")}


def held_job(cluster: SlurmCluster, folder: Path, user: SlurmUser, *options: str) -> tuple[int, dict[str, str]]:
    """A batch job of ``user`` that writes its environment to a file and holds its grant until cancelled;
    its id and that environment, once it runs."""
    ready = folder / f"held-{time.monotonic_ns()}.env"
    job = cluster.sbatch(f"#!/bin/bash\nenv > {ready}.part && mv {ready}.part {ready}\n{HOLD}\n", *options,
                         user=user, folder=folder)
    cluster.wait_job(job, ("RUNNING",))
    wait_for(ready.exists, timeout=60)
    return job, env_lines(ready.read_text())


def test_both_nodes_are_idle_with_four_gpus_and_eight_shards(slurm_cluster):
    def all_idle() -> bool:
        return all(state == "idle" for state, _ in slurm_cluster.node_states().values())

    with contextlib.suppress(AssertionError):  # a node may still be completing the last test's job
        wait_for(all_idle, timeout=60)
    gres = f"gpu:{GPUS_PER_NODE},shard:{GPUS_PER_NODE * SHARDS_PER_GPU}"
    assert slurm_cluster.node_states() == {node: ("idle", gres) for node in NODES}


def test_start_when_running_says_so_and_changes_nothing(slurm_cluster):
    pids = [(slurm_cluster.folder / node / "slurmd.pid").read_text() for node in NODES]
    again = run_script("start", slurm_cluster.script_env(), 120)
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stderr
    assert [(slurm_cluster.folder / node / "slurmd.pid").read_text() for node in NODES] == pids
    status = run_script("status", slurm_cluster.script_env(), 120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"cluster in {slurm_cluster.folder}: running" in status.stdout


def test_srun_over_both_nodes_runs_one_task_on_each(slurm_cluster, slurm_users):
    done = slurm_cluster.run(["srun", "-N2", "--ntasks-per-node=1", "bash", "-c",
                              'echo "$SLURMD_NODENAME $SLURM_PROCID $(id -u)"'], user=slurm_users[0])
    tasks = sorted(line.split() for line in done.stdout.splitlines())
    assert [node for node, _, _ in tasks] == list(NODES)
    assert sorted(rank for _, rank, _ in tasks) == ["0", "1"]
    assert {uid for _, _, uid in tasks} == {str(slurm_users[0].uid)}


def test_a_node_gives_two_jobs_disjoint_gpus_and_a_third_waits_for_them(slurm_cluster, slurm_users, job_folders):
    first_user, second_user = slurm_users
    job, first = held_job(slurm_cluster, job_folders[first_user.name], first_user, "-w", "n1", "--gres=gpu:2")
    assert first["SLURMD_NODENAME"] == "n1"
    assert len(gpu_set(first["CUDA_VISIBLE_DEVICES"])) == 2

    step = slurm_cluster.run(["srun", "-w", "n1", "--gres=gpu:2", "env"], user=second_user,
                             cwd=job_folders[second_user.name])
    second = env_lines(step.stdout)
    assert second["SLURM_STEP_GPUS"] == second["CUDA_VISIBLE_DEVICES"]
    assert gpu_set(second["CUDA_VISIBLE_DEVICES"]).isdisjoint(gpu_set(first["CUDA_VISIBLE_DEVICES"]))
    assert gpu_set(second["CUDA_VISIBLE_DEVICES"]) | gpu_set(first["CUDA_VISIBLE_DEVICES"]) == set(range(4))

    # three GPUs of n1 wait for the first job's two: pending for resources until it ends
    third = slurm_cluster.sbatch("#!/bin/bash\ntrue\n", "-w", "n1", "--gres=gpu:3", user=second_user,
                                 folder=job_folders[second_user.name])
    waiting = slurm_cluster.wait_job(third, ("PENDING",))
    wait_for(lambda: slurm_cluster.job(third).get("Reason") == "Resources", timeout=60)
    assert waiting["JobState"] == "PENDING" and slurm_cluster.job(job)["JobState"] == "RUNNING"
    slurm_cluster.run(["scancel", str(job)], user=first_user)
    slurm_cluster.wait_job(third, ("COMPLETED",))


def test_a_batch_job_sees_slurm_job_gpus_and_no_step_gpus(slurm_cluster, slurm_users, job_folders):
    user = slurm_users[0]
    folder = job_folders[user.name]
    job = slurm_cluster.sbatch("#!/bin/bash\nenv\n", "--gres=gpu:2", user=user, folder=folder)
    slurm_cluster.wait_job(job, ("COMPLETED",))
    seen = env_lines((folder / f"job-{job}.out").read_text())
    assert len(gpu_set(seen["SLURM_JOB_GPUS"])) == 2
    assert seen["CUDA_VISIBLE_DEVICES"] == seen["SLURM_JOB_GPUS"]
    assert "SLURM_STEP_GPUS" not in seen


def test_a_job_given_no_gpu_has_no_cuda_visible_devices_not_even_the_submitters(slurm_cluster, slurm_users):
    env = slurm_cluster.client_env(slurm_users[0], CUDA_VISIBLE_DEVICES="3")
    seen = env_lines(slurm_cluster.run(["srun", "env"], user=slurm_users[0], env=env).stdout)
    assert "CUDA_VISIBLE_DEVICES" not in seen and "SLURM_STEP_GPUS" not in seen
    assert seen["SLURM_JOB_ID"]  # it did run under Slurm


def test_shards_of_one_gpu_go_to_jobs_of_two_users_at_once(slurm_cluster, slurm_users, job_folders):
    first_user, second_user = slurm_users
    job, first = held_job(slurm_cluster, job_folders[first_user.name], first_user, "-w", "n2", "--gres=shard:2")
    assert first["SLURM_SHARDS_ON_NODE"] == "2"
    assert len(gpu_set(first["CUDA_VISIBLE_DEVICES"])) == 1  # two shards of one GPU

    step = slurm_cluster.run(["srun", "-w", "n2", "--gres=shard:1", "--immediate=30", "env"], user=second_user,
                             cwd=job_folders[second_user.name])
    second = env_lines(step.stdout)
    assert second["SLURM_SHARDS_ON_NODE"] == "1"
    assert len(gpu_set(second["CUDA_VISIBLE_DEVICES"])) == 1
    assert slurm_cluster.job(job)["JobState"] == "RUNNING"  # both held shards of n2 at once


def test_each_node_gives_its_tasks_its_own_system_folder_over_the_submitters(slurm_cluster, slurm_users):
    stale = {"DRBALANCE_SYSTEM_DIR": "/stale/from/the/submitting/shell"}
    done = slurm_cluster.run(["srun", "-N2", "--ntasks-per-node=1", "bash", "-c",
                              'echo "$SLURMD_NODENAME $DRBALANCE_SYSTEM_DIR"'], user=slurm_users[0],
                             env=slurm_cluster.client_env(slurm_users[0], **stale))
    seen = dict(line.split() for line in done.stdout.splitlines())
    assert seen == {node: str(slurm_cluster.folder / node / "system") for node in NODES}


def user_processes(user: SlurmUser) -> list[str]:
    """The processes running as ``user`` (pid and command)."""
    listing = subprocess.run(["ps", "-u", str(user.uid), "-o", "pid=,args="], capture_output=True, text=True)
    return listing.stdout.splitlines()


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["sleep", "ignores-SIGTERM"])
def test_scancel_ends_a_running_job_by_sigterm_then_sigkill_after_killwait(slurm_cluster, slurm_users, job_folders,
                                                                          ignores_sigterm):
    user = slurm_users[0]
    folder = job_folders[user.name]
    got_term, trapping = folder / "got-sigterm", folder / "trapping"
    on_term = f"touch {got_term}" if ignores_sigterm else f"touch {got_term}; exit 143"
    work = "while true; do sleep 0.2; done" if ignores_sigterm else f"{HOLD} & wait"
    job = slurm_cluster.sbatch(f"#!/bin/bash\ntrap '{on_term}' TERM\ntouch {trapping}\n{work}\n", "-w", "n1",
                               user=user, folder=folder)
    slurm_cluster.wait_job(job, ("RUNNING",))
    wait_for(trapping.exists, timeout=60)  # the trap is set

    slurm_cluster.run(["scancel", str(job)], user=user)
    ended = slurm_cluster.wait_job(job, ("CANCELLED",), timeout=KILL_WAIT + 60)
    assert ended["JobState"] == "CANCELLED"
    assert got_term.exists()  # SIGTERM came first, also to a job that goes on after it
    wait_for(lambda: not user_processes(user), timeout=KILL_WAIT + 60)


def test_a_requeued_job_runs_again(slurm_cluster, slurm_users, job_folders):
    user = slurm_users[0]
    folder = job_folders[user.name]
    runs = folder / "runs"
    job = slurm_cluster.sbatch(f"#!/bin/bash\necho \"run ${{SLURM_RESTART_COUNT:-0}}\" >> {runs}\n{HOLD}\n",
                               "--requeue", user=user, folder=folder)
    slurm_cluster.wait_job(job, ("RUNNING",))
    wait_for(runs.exists, timeout=60)
    slurm_cluster.run(["scontrol", "requeue", str(job)], user=user)
    wait_for(lambda: runs.read_text().splitlines() == ["run 0", "run 1"], timeout=120)
    assert slurm_cluster.job(job)["Restarts"] == "1"


def test_jobs_of_two_users_run_as_those_users_side_by_side(slurm_cluster, slurm_users, job_folders):
    jobs = {}
    for user in slurm_users:
        folder = job_folders[user.name]
        jobs[user] = slurm_cluster.sbatch(
            f"#!/bin/bash\nid -u > {folder}/uid\n{HOLD}\n", "-w", "n1", user=user, folder=folder)
    for user, job in jobs.items():
        fields = slurm_cluster.wait_job(job, ("RUNNING",))  # both at once, on one node
        assert fields["UserId"] == f"{user.name}({user.uid})"
        assert fields["NodeList"] == "n1"
        uid_file = job_folders[user.name] / "uid"
        wait_for(uid_file.exists, timeout=60)
        assert uid_file.read_text().strip() == str(user.uid)
        assert user.uid != 0


def test_stop_ends_every_process_and_job_of_a_cluster_and_stop_again_is_fine(slurm_cluster, slurm_users):
    """A second cluster of its own (other folder and ports), with a node manager per node (a shell
    and its child): stopped with a job running, and once more with its controller killed first, so
    the job's slurmstepd is left for stop to find."""
    user = slurm_users[1]
    other = SlurmCluster(Path(f"/tmp/drbalance-slurm-stoptest-{os.getpid()}"), free_port_base(1 + len(NODES)))
    manager = "env > m.part && mv m.part manager-%n.env; sleep 600 & wait"  # writes its environment, waits
    env = {**other.script_env(), "DRBALANCE_NODE_MANAGER_CMD": manager}
    try:
        for kill_controller in (False, True):
            started = run_script("start", env, 300)
            assert started.returncode == 0, started.stderr
            for node in NODES:  # each node's manager runs in its node's folder with its node's variables
                wait_for((other.folder / node / f"manager-{node}.env").exists, timeout=30)
                seen = env_lines((other.folder / node / f"manager-{node}.env").read_text())
                assert seen["DRBALANCE_SYSTEM_DIR"] == str(other.folder / node / "system")
                assert seen["SLURM_CONF"] == str(other.conf)
            with user_folder(user) as folder:
                job = other.sbatch(f"#!/bin/bash\n{HOLD}\n", user=user, folder=folder)
                other.wait_job(job, ("RUNNING",))
                wait_for(lambda: user_processes(user), timeout=60)
                if kill_controller:
                    controller = int((other.folder / "ctld" / "slurmctld.pid").read_text())
                    os.kill(controller, signal.SIGKILL)
                stopped = run_script("stop", env, 300)
                assert stopped.returncode == 0, stopped.stderr
                assert all(f"stopped node manager {node}" in stopped.stderr for node in NODES)
                if kill_controller:
                    assert "ending processes left behind" in stopped.stderr
                assert not cluster_processes(other.folder)
                wait_for(lambda: not user_processes(user), timeout=30)
            again = run_script("stop", env, 60)
            assert again.returncode == 0 and "not running" in again.stderr
            status = run_script("status", env, 60)
            assert status.returncode == 3, status.stdout
    finally:
        run_script("stop", env, 300)
        shutil.rmtree(other.folder, ignore_errors=True)


def cluster_processes(folder: Path) -> list[int]:
    """Live processes that belong to the cluster in ``folder``: its marker in their environment, or
    a working directory inside it (slurmstepd)."""
    found = []
    marker = f"DRBALANCE_SLURM_CLUSTER={folder}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            inside = os.readlink(entry / "cwd").startswith(f"{folder}/")
            if inside or marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
