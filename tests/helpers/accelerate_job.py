"""A small real Hugging Face Accelerate job for the tests, started by torchrun: gloo on the CPU.

The model and data of tests/helpers/integration_job.py. ``--kind drbalance,plain`` trains with
``BalancedAccelerator`` and with plain ``Accelerator`` in turn, in the same processes, from the
same initial weights, with Accelerate's seedable sampler (``data_seed=0``: the epoch orders
drbalance's sampler draws too), an in-order evaluation loader joined by ``gather_for_metrics``,
``accumulate()``, and, with ``--resume-epochs N``, ``save_state`` after the first epochs and new
accelerators that ``load_state`` it and train on to epoch N. Each rank writes
``<out>/rank<r>.json`` as lightning_job.py does.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from drbalance.integrations.accelerate import BalancedAccelerator
from tests.helpers import integration_job as common


def accelerator_for(kind: str, args: argparse.Namespace, epochs: int) -> Accelerator:
    settings = {"cpu": True, "gradient_accumulation_steps": args.accumulate,
                "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)}
    if kind == "plain":
        return Accelerator(**settings)
    return BalancedAccelerator(epochs=epochs, **common.balance_options(args), **settings)


def train(accelerator: Accelerator, args: argparse.Namespace, data: TensorDataset, epochs: range,
          model: nn.Module) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = DataLoader(data, batch_size=args.batch, shuffle=True)
    model, optimizer, loader, evaluation = accelerator.prepare(model, optimizer, training,
                                                               DataLoader(data, batch_size=args.batch))
    if epochs.start:
        accelerator.load_state(str(Path(args.out) / f"{type(accelerator).__name__}-state"))
    steps: list[dict] = []
    val: list[float] = []
    ids: list[int] = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for index, x, y in loader:
            ids.extend(index.tolist())
            with accelerator.accumulate(model):
                accelerator.backward(functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    steps.append(common.step_record(epoch, ids, model, model, accelerator.process_index, len(steps)))
                    ids = []
                optimizer.step()
                optimizer.zero_grad()
            if args.sleep:
                time.sleep(args.sleep)
        with torch.no_grad():
            losses = [accelerator.gather_for_metrics(functional.mse_loss(model(x), y, reduction="none").mean(1))
                      for _, x, y in evaluation]
        val.append(torch.cat(losses).mean().item())
    return {"steps": steps, "val": val, "params": common.flat(model.parameters())}


def run(kind: str, args: argparse.Namespace, data: TensorDataset) -> dict:
    torch.manual_seed(0)
    accelerator = accelerator_for(kind, args, args.epochs)
    found = train(accelerator, args, data, range(args.epochs), nn.Linear(4, 2))
    if isinstance(accelerator, BalancedAccelerator):
        found["session_was_open"] = accelerator.session is not None
        accelerator.close_session()
    if args.resume_epochs:
        accelerator.save_state(str(Path(args.out) / f"{type(accelerator).__name__}-state"))
        torch.manual_seed(1)  # other initial weights: load_state must bring the saved ones back
        resumed = accelerator_for(kind, args, args.resume_epochs)
        later = train(resumed, args, data, range(args.epochs, args.resume_epochs), nn.Linear(4, 2))
        found.update(resumed_steps=later["steps"], resumed_val=later["val"], resumed=later["params"])
        if isinstance(resumed, BalancedAccelerator):
            resumed.close_session()
    return found


def main() -> None:
    parser = common.parser_with_common_options("acjob")
    parser.add_argument("--kind", default="drbalance", help="comma-separated: drbalance, plain")
    args = parser.parse_args()
    data = common.dataset(args)
    common.write_findings(args, {kind: run(kind, args, data) for kind in args.kind.split(",")}, data)
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
