"""Two "nodes" on one machine for the tests of DDP jobs spanning nodes.

A node is an environment: its name (``SLURMD_NODENAME``, as slurmd sets it on a node), its own
system folder (``DRBALANCE_SYSTEM_DIR``), runtime and log folders. Each node's part of a job is
one torchrun agent started in that environment (``--nnodes 2``, a c10d rendezvous on localhost);
a node's manager is a real system manager started in its system folder: ``drbalance-manager
--system`` (``SystemManagerProcess``), or ``ScriptedSystemManager`` below, the same
``SystemManager`` in a process of its own with a scripted policy. Output goes to files, not
pipes (a full pipe would block a rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT, wait_for

JOB_MODULE = "tests.helpers.ddp_nodes_app"


@dataclass
class Node:
    """One node's environment (see the module docstring)."""

    name: str
    base: Path  # its own folder: run/, logs/, torchrun/, its agent's output
    system_dir: Path  # its system folder (below a root-owned 0755 folder, as a system folder must be)
    namespace: str

    def __post_init__(self) -> None:
        for folder in (self.base / "run", self.base / "logs", self.base / "torchrun"):
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o700)

    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("SLURM", "DRBALANCE_", "TORCHELASTIC_")) and key not in ("GROUP_RANK",)}
        env.update({"SLURMD_NODENAME": self.name, "DRBALANCE_SYSTEM_DIR": str(self.system_dir),
                    "DRBALANCE_NAMESPACE": self.namespace, "DRBALANCE_RUNTIME_DIR": str(self.base / "run"),
                    "DRBALANCE_LOG_DIR": str(self.base / "logs"),
                    "DRBALANCE_PROFILES": str(self.base / "profiles.json"),
                    "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
        return env

    def sd_log(self, app: str) -> Path:
        return self.base / "logs" / f"{app}@{self.name}.sd.jsonl"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Agent:
    """One node's torchrun agent running ``tests.helpers.ddp_nodes_app`` (its stdout and stderr in files)."""

    def __init__(self, node: Node, host: bool, port: int, run_id: str, ranks: int, *job_args: str) -> None:
        self.node = node
        self.out_path, self.err_path = node.base / "agent.out", node.base / "agent.err"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(ranks),
                   "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
                   "--rdzv_conf", f"is_host={str(host).lower()},join_timeout=120", "--max_restarts", "0",
                   "--log-dir", str(node.base / "torchrun"), "-m", JOB_MODULE, *job_args]
        self.process = subprocess.Popen(command, env=node.env(), cwd=ROOT, stdout=self._out, stderr=self._err,
                                        text=True)

    def lines(self) -> list[dict]:
        text = self.out_path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{") and line.endswith("}")]

    def steps(self) -> list[dict]:
        return [line for line in self.lines() if "step" in line]

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._out.close()
            self._err.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def two_node_job(nodes: list[Node], ranks: int, *job_args: str) -> list[Agent]:
    """The job's two agents, one per node; the first hosts the rendezvous."""
    port, run_id = free_port(), f"span{os.getpid()}x{time.monotonic_ns()}"
    return [Agent(node, index == 0, port, run_id, ranks, *job_args) for index, node in enumerate(nodes)]


def wait_for_lines(agents: list[Agent], predicate: Callable[[list[dict]], object], timeout: float):
    """Poll every agent's output until ``predicate(all their lines)`` is true; fail early if an agent ended."""
    def look():
        for agent in agents:
            if agent.process.poll() is not None:
                raise AssertionError(f"the agent of {agent.node.name} ended ({agent.process.returncode}):\n"
                                     f"{agent.stderr()[-3000:]}")
        return predicate([line for agent in agents for line in agent.lines()])
    return wait_for(look, timeout)


# --- a system manager with a scripted policy, in a process of its own -----------------------------------


class ScriptedSystemManager:
    """``SystemManager`` on two scripted GPUs whose policy answers each app's boundaries with the
    next DR of ``answers``, then keeps (``python -m tests.helpers.ddp_nodes``); stopped with SIGTERM."""

    def __init__(self, node: Node, answers: list[list[int]]) -> None:
        self.node = node
        self.util_file = node.base / "util.json"
        self.util_file.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [50, 50]}]}))
        self.log_path = node.system_dir / node.namespace / "manager.jsonl"
        self.err_path = node.base / "manager.err"
        self._err = open(self.err_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.ddp_nodes", "--util", str(self.util_file), "--answers",
             json.dumps(answers)], env=node.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._err, text=True)
        socket_path = node.system_dir / node.namespace / "manager.sock"
        wait_for(lambda: socket_path.exists() or self.process.poll() is not None, timeout=60)
        assert self.process.poll() is None, self.stderr()

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text()

    def events(self, kind: str | None = None) -> list[dict]:
        from drbalance.jsonlog import read_json_lines

        if not self.log_path.exists():
            return []
        return [e for e in read_json_lines(self.log_path) if kind is None or e["event"] == kind]

    def stop(self) -> tuple[int, str]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self._err.close()
        return self.process.returncode, self.err_path.read_text()


class AnswerBoundaries:
    """A real policy object for the daemon: at each app's boundary the next DR of a script, else keep."""

    name = "script"

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = list(answers)

    def decide(self, app, trigger, snapshot):
        from drbalance.policy.base import Decision
        from drbalance.ratio import DataRatio

        view = snapshot.app(app)
        if trigger == "boundary" and self.answers:
            return Decision(app, DataRatio(self.answers.pop(0)), "script")
        return Decision(app, view.ratio, "keep")


def main() -> None:
    from drbalance.manager.daemon import ManagerSettings
    from drbalance.manager.system import SystemManager
    from drbalance.manager.utilization import ScriptedSource

    parser = argparse.ArgumentParser()
    parser.add_argument("--util", required=True)
    parser.add_argument("--answers", required=True, help="JSON list of DRs")
    args = parser.parse_args()
    settings = ManagerSettings(sample_period=0.1)
    policy = AnswerBoundaries(json.loads(args.answers))
    manager = SystemManager(settings, ScriptedSource(Path(args.util)), policy=policy)
    signal.signal(signal.SIGTERM, lambda *_: manager.request_stop("SIGTERM"))
    manager.start()
    try:
        manager.run()
    finally:
        manager.stop()


if __name__ == "__main__":
    main()
