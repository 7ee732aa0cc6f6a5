"""The integrations without a training job: optional imports, settings, plans, names, the session's opening."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from drbalance.integrations.accelerate import shuffles
from drbalance.integrations.job import JobSettings, app_name_from, with_pid
from drbalance.integrations.lightning import DrBalanceStrategy, planned_epochs
from drbalance.ipc.discovery import AppClaim
from tests.conftest import ROOT
from tests.helpers import job_session_ranks

pytestmark = pytest.mark.timeout(180)


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_import_drbalance_and_its_client_import_neither_framework():
    result = python("import sys, drbalance, drbalance.client, drbalance.integrations, drbalance.integrations.job\n"
                    "print(sorted(name for name in ('lightning', 'accelerate', 'pytorch_lightning') "
                    "if name in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("extra, blocked", [("lightning", "lightning"), ("accelerate", "accelerate")])
def test_an_integration_without_its_framework_names_the_extra_to_install(extra, blocked):
    result = python(f"import sys\nsys.modules[{blocked!r}] = None  # as if not installed\n"
                    f"import drbalance.integrations.{extra}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: drbalance.integrations.{extra} needs ") and \
        last.endswith(f"install it with: pip install 'drbalance[{extra}]'"), last


def test_the_strategy_is_registered_by_name_and_a_trainer_builds_it():
    assert "drbalance" in StrategyRegistry
    trainer = Trainer(strategy="drbalance", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is DrBalanceStrategy


@pytest.mark.parametrize("option", ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"])
def test_the_strategy_refuses_what_needs_ddps_one_communication_hook(option):
    with pytest.raises(ValueError, match=f"does not take \\['{option}'\\]"):
        DrBalanceStrategy(**{option: 1})


def test_job_settings_refuse_a_bad_app_name_and_an_unknown_session_option_when_given():
    with pytest.raises(ValueError, match="app name 'a b' is not valid"):
        DrBalanceStrategy(app="a b")
    with pytest.raises(TypeError, match=r"unknown Session argument\(s\) \['epochs'\]"):
        JobSettings(options={"epochs": 3})
    assert JobSettings(options={"decide_every": 2}).options == {"decide_every": 2}


@pytest.mark.parametrize("max_epochs, max_steps, accumulate, batches, expected", [
    (10, -1, 1, 8, 10),      # max_epochs alone
    (10, 20, 1, 8, 3),       # 20 steps of 8 batches per epoch end in epoch 3
    (10, 20, 2, 8, 5),       # 2 batches per optimizer step: 40 batches
    (2, 100, 1, 8, 2),       # max_epochs comes first
    (-1, 16, 1, 8, 2),       # max_steps alone
    (None, -1, 1, 8, None),  # neither: unknown
])
def test_the_lightning_plan_in_epochs(max_epochs, max_steps, accumulate, batches, expected):
    assert planned_epochs(max_epochs, max_steps, accumulate, batches) == expected


def test_derived_app_names_are_valid_and_keep_their_length_with_a_pid():
    assert app_name_from("lightning_logs-3") == "lightning_logs-3"
    assert app_name_from("my run/v 2") == "my-run-v-2"
    assert app_name_from(".hidden") == "hidden" and app_name_from("") == "job"
    assert len(app_name_from("x" * 80)) == 48
    assert with_pid("x" * 48, 12345) == "x" * 42 + "-12345"


def test_shuffled_loaders_are_the_ones_accelerate_balances():
    data = TensorDataset(torch.arange(8))
    assert shuffles(DataLoader(data, batch_size=2, shuffle=True))
    assert not shuffles(DataLoader(data, batch_size=2))
    assert shuffles(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0)))
    assert not shuffles(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0,
                                                                                   shuffle=False)))


def spawn_sessions(tmp_path, app, default_app) -> list[dict]:
    mp.spawn(job_session_ranks.open_session, args=(2, str(tmp_path), app, default_app), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_a_derived_name_that_is_taken_gets_rank_zeros_pid_on_every_rank(ipc_env, tmp_path):
    holder = AppClaim.take(ipc_env, "taken")  # a live job of that name
    try:
        ranks = spawn_sessions(tmp_path, None, "taken")
    finally:
        holder.release()
    assert ranks[0]["app"] == ranks[1]["app"] == f"taken-{ranks[0]['pid']}"


@pytest.mark.slow
def test_a_name_given_that_is_taken_fails_on_every_rank_saying_why(ipc_env, tmp_path):
    holder = AppClaim.take(ipc_env, "taken")
    try:
        ranks = spawn_sessions(tmp_path, "taken", "unused")
    finally:
        holder.release()
    assert ranks[0]["error"] == "AppNameInUse" and "'taken' is already running" in ranks[0]["message"]
    assert ranks[1]["error"] == "RuntimeError"
    assert ranks[1]["message"].startswith("drbalance: rank 0 could not open the job's session")
    assert "AppNameInUse: an app named 'taken' is already running" in ranks[1]["message"]


def test_balanced_accelerator_needs_a_plan_and_with_one_process_trains_as_accelerator_says_why():
    result = python(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from drbalance.integrations.accelerate import BalancedAccelerator\n"
        "for epochs in (0, 2.5, True):\n"
        "    try:\n"
        "        BalancedAccelerator(epochs=epochs, cpu=True)\n"
        "    except ValueError as error:\n"
        "        print('refused', str(error).split(';')[0])\n"
        "accelerator = BalancedAccelerator(epochs=1, cpu=True)\n"
        "model, loader = accelerator.prepare(torch.nn.Linear(2, 1), DataLoader(TensorDataset(torch.ones(4, 2)), "
        "batch_size=2, shuffle=True))\n"
        "print(accelerator.balancing, type(model).__name__, accelerator.session)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "refused epochs (the epochs this script trains: the session's plan) must be a positive integer"] * 3 + [
        "False Linear None"]
    assert "drbalance: one process has no ranks to balance; BalancedAccelerator trains as Accelerator does" \
        in result.stderr
