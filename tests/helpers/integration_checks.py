"""What the integrations' tests share: running their jobs beside a manager, and checking what the jobs recorded.

A job's model is ``nn.Linear(4, 2)`` with an MSE loss; a step's record holds the parameters
before the step (weight then bias, flattened), the gradient the step used, this rank's sample
ids and every rank's sample counts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch.nn import functional

from drbalance.client.sampler import rank_sizes
from drbalance.jsonlog import read_json_lines
from drbalance.manager.daemon import Manager, ManagerSettings
from drbalance.manager.utilization import ScriptedSource
from drbalance.ratio import DataRatio
from tests.conftest import python_process, wait_for
from tests.helpers.ddp import ScriptPolicy, read_ready
from tests.helpers.processes import kill_running


def global_mean_gradient(data: dict, params: list[float], ids: list[int]) -> torch.Tensor:
    """One process: the gradient of the mean MSE over the samples ``ids`` at ``params``."""
    weight = torch.tensor(params[:8], dtype=torch.float64).view(2, 4).requires_grad_()
    bias = torch.tensor(params[8:10], dtype=torch.float64).requires_grad_()
    x = torch.tensor(data["x"], dtype=torch.float64)[ids]
    y = torch.tensor(data["y"], dtype=torch.float64)[ids]
    functional.mse_loss(x @ weight.T + bias, y).backward()
    return torch.cat([weight.grad.reshape(-1), bias.grad])


def check_global_mean_gradients(steps_by_rank: list[list[dict]], data: dict) -> None:
    """Every rank's gradient at every step is the one-process gradient of the mean loss over the
    step's global batch (all ranks' samples), and every rank counted the same samples."""
    for index, steps in enumerate(zip(*steps_by_rank)):
        ids = [i for step in steps for i in step["ids"]]
        counts = [len(step["ids"]) for step in steps]
        expected = global_mean_gradient(data, steps[0]["params"], ids)
        for rank, step in enumerate(steps):
            assert step["counts"] == counts, (index, rank, step["counts"], counts)
            assert step["params"] == steps[0]["params"], (index, rank)  # the ranks stay in step
            error = (torch.tensor(step["grads"], dtype=torch.float64) - expected).abs().max().item()
            assert error < 1e-6, (index, rank, error)


def check_each_sample_once_per_epoch(steps_by_rank: list[list[dict]], samples: int) -> None:
    epochs = {step["epoch"] for steps in steps_by_rank for step in steps}
    for epoch in epochs:
        seen = sorted(i for steps in steps_by_rank for step in steps if step["epoch"] == epoch for i in step["ids"])
        assert seen == list(range(samples)), epoch


def expected_counts(initial: list[int], applied: list[tuple[int, list[int]]], steps: int,
                    batch: int) -> list[list[int]]:
    """Every rank's samples at each step (= global batch) under ``initial`` and then the DRs the SD
    log says were applied from their first global batch on."""
    counts = []
    for index in range(steps):
        ratio = initial
        for start, shares in applied:
            if start <= index:
                ratio = shares
        counts.append(list(rank_sizes(DataRatio(ratio), batch)))
    return counts


def finished(job, tmp_path: Path) -> list[dict]:
    """Wait for a job of 2 ranks to succeed; what each rank wrote to ``tmp_path/rank<r>.json``."""
    _, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def scripted_manager(tmp_path: Path, app: str, ratios: list[list[int]]) -> tuple[Manager, threading.Thread]:
    """The real daemon in this process, on 2 scripted GPUs, answering ``app``'s boundaries with ``ratios`` in turn."""
    util = tmp_path / "util.json"
    util.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [50, 50]}]}))
    manager = Manager(ManagerSettings(log_path=tmp_path / "manager.jsonl", sample_period=0.2), ScriptedSource(util),
                      policy=ScriptPolicy(app, ratios))
    manager.start()
    loop = threading.Thread(target=manager.run, daemon=True)
    loop.start()
    return manager, loop


def read_sd_log(app: str) -> list[dict]:
    """The SD log of ``app`` in the test's log folder (``DRBALANCE_LOG_DIR``, set by ``ipc_env``)."""
    return list(read_json_lines(Path(os.environ["DRBALANCE_LOG_DIR"]) / f"{app}.sd.jsonl"))


def read_manager_events(folder: Path) -> list[dict]:
    """The log of the manager :func:`scripted_manager` ran in ``folder``."""
    return list(read_json_lines(folder / "manager.jsonl"))


def applied_ratios(app: str) -> list[tuple[int, list[int]]]:
    """(first global batch, DR) of every DR the job applied, from its SD log."""
    return [(event["from_batch"], event["applied_dr"]) for event in read_sd_log(app) if event["event"] == "applied"]


def kill_a_rank_and_check_the_manager(job, manager, app: str, victim: int) -> None:
    """Kill rank ``victim`` of the running ``job`` (SIGKILL) once ``manager`` (tests.helpers.processes.ManagerProcess)
    has added ``app``: the job ends with an error, the manager removes the app, and it then answers
    another job (a toy app) that starts after the kill; the manager stops cleanly."""
    neighbour = None
    try:
        pids = read_ready(job, 2, timeout=120)
        wait_for(lambda: [e for e in manager.events("app_added") if e["app"] == app], 60)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.time()
        job.communicate(timeout=120)  # the other rank's next collective fails, or torchrun stops it
        assert job.returncode != 0
        removed = wait_for(lambda: [e for e in manager.events("app_removed") if e["app"] == app], 60)
        assert removed[0]["reason"] in {"finished", "process gone"}
        neighbour = python_process("tests.helpers.toy_app", "--app", "neighbour", "--gpus", "2", "--epochs", "3",
                                   "--iterations", "2", "--sleep", "0.05")
        wait_for(lambda: [e for e in manager.events("decision") if e["app"] == "neighbour" and e["t"] > killed], 60)
        _, err = neighbour.communicate(timeout=120)
        assert neighbour.returncode == 0, err[-2000:]
    finally:
        kill_running(job, neighbour)
        assert manager.stop()[0] == 0
