"""A small real Hugging Face Accelerate job for the tests, started by torchrun: gloo on the CPU.

The same model and data as lightning_job.py (``nn.Linear(4, 2)``, MSE, ``TensorDataset(ids, x, y)``
with seed 0). ``--kind balanced,plain`` trains with ``BalancedAccelerator`` and with plain
``Accelerator`` in turn, in the same processes, from the same initial weights, with Accelerate's
seedable sampler (``data_seed=0``: the epoch orders drbalance's sampler draws too), an in-order
evaluation loader joined by ``gather_for_metrics``, ``accumulate()``, and, with ``--resume-epochs
N``, ``save_state`` after the first epochs and a new accelerator that ``load_state``s it and
trains on to epoch N. Each rank writes ``<out>/rank<r>.json`` as lightning_job.py does; prints
``{"rank", "pid", "step"}`` per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from drbalance.integrations.accelerate import BalancedAccelerator
from tests.helpers.lightning_job import flat


def accelerator_for(kind: str, args: argparse.Namespace, epochs: int) -> Accelerator:
    common = {"cpu": True, "gradient_accumulation_steps": args.accumulate,
              "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)}
    if kind == "plain":
        return Accelerator(**common)
    options = {"report_every": args.report_every, "decide_every": args.decide_every,
               "exchange_timeout": args.exchange_timeout}
    ratio = [int(x) for x in args.ratio.split(",")] if args.ratio else None
    return BalancedAccelerator(epochs=epochs, app=args.app, ratio=ratio, exchange_every=args.exchange_every,
                               session_options=options, **common)


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
                    counts = getattr(model, "last_chunk_sizes", None)
                    steps.append({"epoch": epoch, "ids": ids, "counts": None if counts is None else list(counts),
                                  "params": flat(model.parameters()),
                                  "grads": flat(p.grad for p in model.parameters())})
                    ids = []
                    sys.stdout.write(json.dumps({"rank": accelerator.process_index, "pid": os.getpid(),
                                                 "step": len(steps)}) + "\n")
                    sys.stdout.flush()
                optimizer.step()
                optimizer.zero_grad()
            if args.sleep:
                time.sleep(args.sleep)
        with torch.no_grad():
            losses = [accelerator.gather_for_metrics(functional.mse_loss(model(x), y, reduction="none").mean(1))
                      for _, x, y in evaluation]
        val.append(torch.cat(losses).mean().item())
    return {"steps": steps, "val": val, "params": flat(model.parameters())}


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", default="balanced", help="comma-separated: balanced, plain")
    parser.add_argument("--app", default="acjob")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch", type=int, default=5, help="the loader's batch size (per process, as for plain)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume-epochs", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--ratio", default=None)
    parser.add_argument("--exchange-every", type=int, default=None)
    parser.add_argument("--decide-every", type=int, default=None)
    parser.add_argument("--report-every", type=int, default=5)
    parser.add_argument("--exchange-timeout", type=float, default=0.5)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 4, generator=generator)
    y = torch.randn(args.samples, 2, generator=generator)
    data = TensorDataset(torch.arange(args.samples), x, y)
    found = {kind: run(kind, args, data) for kind in args.kind.split(",")}
    found["data"] = {"x": x.tolist(), "y": y.tolist()}
    Path(args.out, f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(found))
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
