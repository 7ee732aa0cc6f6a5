"""The two-node Slurm test cluster (``tests/slurm/cluster.sh``) as the Slurm tests use it.

One cluster serves a whole pytest run: the first test that asks starts it in a folder and on
ports of its own (not the developer's ``/tmp/drbalance-slurm``), so that runs in other worktrees
of this machine do not meet, and the last xdist worker to finish stops it (a count in the run's
common temporary folder, under a lock). Tests that use it hold a second lock while they run, so
no two of them share its nodes at once: each test sees the GPUs and CPUs it asks for free.

Jobs run as unprivileged users made with ``useradd`` (``ensure_user``; left on the machine for
the next run), submitted with ``setpriv --reuid``; their files go to a folder of their own
under /tmp (``user_folder``): pytest's own folders are private to root.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT, wait_for

CLUSTER_SCRIPT = ROOT / "tests" / "slurm" / "cluster.sh"
NODES = ("n1", "n2")
GPUS_PER_NODE = 4
SHARDS_PER_GPU = 2
KILL_WAIT = 5.0  # seconds: cluster.sh's KillWait, scancel's SIGTERM to SIGKILL
EXIT_UNSUPPORTED = 3  # cluster.sh: this machine cannot host the cluster
START_LIMIT = 600.0  # seconds for `cluster.sh start`, an installation of the packages included
STOP_LIMIT = 180.0  # seconds for `cluster.sh stop`
COMMAND_LIMIT = 120.0  # seconds for one Slurm client command (srun waits for its job)
PORTS = range(20000, 60000)  # where a run's cluster looks for three free TCP ports
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


class ClusterUnavailable(RuntimeError):
    """The machine cannot host the cluster (not root, no apt-get, no mknod): a reason to skip."""


@dataclass(frozen=True)
class SlurmUser:
    name: str
    uid: int
    gid: int


def ensure_user(name: str) -> SlurmUser:
    """The local user ``name``, made (a system user, no home, no login shell) if absent."""
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(name)
        return SlurmUser(name, entry.pw_uid, entry.pw_gid)
    made = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", name], capture_output=True, text=True)
    try:  # a concurrent useradd of the same name fails, and the user exists all the same
        entry = pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(f"useradd {name} failed (status {made.returncode}): {made.stderr.strip()}") from None
    return SlurmUser(name, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def user_folder(user: SlurmUser) -> Iterator[Path]:
    """A new folder under /tmp that only ``user`` (and root) can use, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="drbalance-slurm-job-", dir="/tmp"))
    try:
        os.chown(folder, user.uid, user.gid)
        os.chmod(folder, 0o700)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_script(command: str, env: dict[str, str], limit: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SCRIPT), command], env=env, capture_output=True, text=True,
                          timeout=limit)


def free_port_base(count: int) -> int:
    """A port p with p..p+count-1 free on every address now (a guess: nothing holds them for us)."""
    for _ in range(200):
        base = random.randrange(PORTS.start, PORTS.stop - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    probe.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free TCP ports found in {PORTS.start}..{PORTS.stop}")


class SlurmCluster:
    """A running test cluster: its folder, and Slurm's client commands against it."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.conf = folder / "etc" / "slurm.conf"

    def script_env(self) -> dict[str, str]:
        """The environment ``cluster.sh`` runs in for this cluster."""
        return {**os.environ, "DRBALANCE_SLURM_DIR": str(self.folder), "DRBALANCE_SLURM_PORT": str(self.port),
                "DRBALANCE_PYTHON": sys.executable}  # the node managers' (drbalance's system manager)

    def client_env(self, user: SlurmUser | None = None, **extra: str) -> dict[str, str]:
        """This environment plus what ``cluster.sh env`` prints (and ``extra``), HOME the user's."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), "DRBALANCE_SLURM_DIR": str(self.folder), **extra}
        if user is not None:
            env["HOME"] = "/nonexistent"
            env["USER"] = env["LOGNAME"] = user.name
        return env

    def run(self, args: Sequence[str], user: SlurmUser | None = None, cwd: Path | None = None,
            env: dict[str, str] | None = None, limit: float = COMMAND_LIMIT,
            check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (``srun``, ``sbatch``...), as ``user`` if given; its output as text."""
        prefix = [] if user is None else ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
        done = subprocess.run([*prefix, *args], env=env or self.client_env(user), cwd=cwd or "/tmp",
                              capture_output=True, text=True, timeout=limit)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                                 + self.log_tails())
        return done

    def sbatch(self, script: str, *options: str, user: SlurmUser | None = None, folder: Path,
               env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (its text) from ``folder``; its output goes to ``folder/job-<id>.out``."""
        path = folder / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        path.chmod(0o755)
        if user is not None:
            os.chown(path, user.uid, user.gid)
        done = self.run(["sbatch", "--parsable", f"--chdir={folder}", f"--output={folder}/job-%j.out", *options,
                         str(path)], user=user, cwd=folder, env=env)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, NodeList, UserId...); {} once Slurm forgot it."""
        done = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if done.returncode != 0:
            return {}
        return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)

    def wait_job(self, job_id: int, states: Sequence[str], timeout: float = 60.0) -> dict[str, str]:
        """Poll until the job's state is one of ``states``; its fields then."""
        def reached() -> dict[str, str] | None:
            fields = self.job(job_id)
            return fields if fields.get("JobState") in states else None
        try:
            return wait_for(reached, timeout=timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"job {job_id} not {'/'.join(states)} within {timeout} s: {self.job(job_id)}\n"
                                 + self.log_tails()) from None

    def cancel_all(self, timeout: float = KILL_WAIT + 60) -> None:
        """Cancel every job and wait until Slurm lists none (nodes free for the next test)."""
        jobs = self.run(["squeue", "-h", "-o", "%A"]).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
        wait_for(lambda: not self.run(["squeue", "-h", "-o", "%A"]).stdout.split(), timeout=timeout, interval=0.2)

    def node_states(self) -> dict[str, tuple[str, str]]:
        """Each node's (state, GRES) as sinfo says, e.g. {"n1": ("idle", "gpu:4,shard:8")}."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t %G"])
        return {name: (state, gres) for name, state, gres in (line.split() for line in done.stdout.splitlines())}

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of the daemons' logs, for a failure's message."""
        logs = [self.folder / "ctld" / "slurmctld.log", *(self.folder / node / "slurmd.log" for node in NODES)]
        parts = []
        for log in logs:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log} ---\n" + "\n".join(log.read_text().splitlines()[-lines:]))
        return "\n".join(parts)


class SharedCluster:
    """One cluster for every xdist worker of a run: started by the first ``acquire``, stopped by
    the last ``release``. ``root`` is a folder all workers share; the cluster's folder is under
    /tmp, named after it (every user must reach the configuration; pytest's folders are root's)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_path = root / "slurm-cluster.json"
        self.lock_path = root / "slurm-cluster.lock"
        digest = hashlib.sha256(str(root).encode()).hexdigest()[:10]
        self.folder = Path(f"/tmp/drbalance-slurm-{digest}")
        self.start_seconds: float | None = None  # how long this worker's start took, if it started it

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        with open(self.lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"users": 0}
            yield state
            self.state_path.write_text(json.dumps(state))

    def acquire(self) -> SlurmCluster:
        """The running cluster, started if no worker has it; ``ClusterUnavailable`` with the reason
        when this machine cannot host it, ``RuntimeError`` with the logs when it fails to start."""
        if os.geteuid() != 0:
            raise ClusterUnavailable("the Slurm test cluster needs root (slurmd, munged); CI runs the suite as root")
        with self._locked() as state:
            if state["users"] == 0:
                cluster = SlurmCluster(self.folder, free_port_base(1 + len(NODES)))
                began = time.monotonic()
                done = run_script("start", cluster.script_env(), START_LIMIT)
                if done.returncode == EXIT_UNSUPPORTED:
                    raise ClusterUnavailable(done.stderr.strip().splitlines()[-1])
                if done.returncode != 0:
                    raise RuntimeError(f"cluster.sh start exited {done.returncode}:\n{done.stderr}")
                self.start_seconds = time.monotonic() - began
                state["port"] = cluster.port
            state["users"] += 1
            return SlurmCluster(self.folder, state["port"])

    def release(self) -> subprocess.CompletedProcess | None:
        """This worker is done with it; the last one stops it and removes its folder. ``stop``'s
        result when this call stopped it."""
        with self._locked() as state:
            state["users"] -= 1
            if state["users"] > 0:
                return None
            cluster = SlurmCluster(self.folder, state["port"])
            done = run_script("stop", cluster.script_env(), STOP_LIMIT)
            if done.returncode == 0:
                shutil.rmtree(self.folder, ignore_errors=True)
            return done

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by a test while it uses the cluster: one test at a time on its nodes."""
        with open(self.root / "slurm-tests.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
