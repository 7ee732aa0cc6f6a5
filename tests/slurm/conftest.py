"""Fixtures of the Slurm tests: the two-node test cluster (``cluster.sh``) and unprivileged users.

``slurm_cluster`` gives a test the run's cluster (started by the first test that asks, stopped
after the last: ``tests/helpers/slurm.py``) and the cluster to itself while it runs. Without root,
apt-get or mknod, the tests skip with the reason; packages that fail to install and a cluster that
fails to start fail them with the logs.

Under ``pytest -n 2`` both xdist workers may run Slurm tests: they share the one cluster (a count
of its users in the run's common folder) and take turns on it (a lock each test holds). xdist's
``--dist loadgroup``, which would keep them on one worker, does not group with pytest 9
(xdist 3.8 marks a group by rewriting ``item._nodeid``, which pytest 9 no longer reads).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.slurm import ClusterUnavailable, SharedCluster, SlurmCluster, SlurmUser, ensure_user, user_folder

USER_NAMES = ("drbslurm1", "drbslurm2")  # made on first use, left on the machine


@pytest.fixture(scope="session")
def shared_slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>/, above every worker's popen-gw<i>
    yield SharedCluster(root)


@pytest.fixture(scope="session")
def _slurm_cluster_for_run(shared_slurm_cluster: SharedCluster) -> Iterator[SlurmCluster]:
    try:
        cluster = shared_slurm_cluster.acquire()
    except ClusterUnavailable as reason:
        pytest.skip(f"no Slurm test cluster on this machine: {reason}")
    yield cluster
    stopped = shared_slurm_cluster.release()
    if stopped is not None and stopped.returncode != 0:
        raise RuntimeError(f"cluster.sh stop exited {stopped.returncode}:\n{stopped.stderr}")


@pytest.fixture
def slurm_cluster(_slurm_cluster_for_run: SlurmCluster, shared_slurm_cluster: SharedCluster) -> Iterator[SlurmCluster]:
    """The run's Slurm test cluster, this test's alone while it runs; every job cancelled after."""
    with shared_slurm_cluster.exclusive():
        yield _slurm_cluster_for_run
        _slurm_cluster_for_run.cancel_all()


@pytest.fixture(scope="session")
def slurm_users(_slurm_cluster_for_run: SlurmCluster) -> tuple[SlurmUser, ...]:
    """Two unprivileged local users that jobs run as (made with useradd if absent)."""
    return tuple(ensure_user(name) for name in USER_NAMES)


@pytest.fixture
def job_folders(slurm_users) -> Iterator[dict[str, Path]]:
    """A private folder under /tmp per user, by name: the jobs' scripts and output go there."""
    with user_folder(slurm_users[0]) as first, user_folder(slurm_users[1]) as second:
        yield {slurm_users[0].name: first, slurm_users[1].name: second}
