"""A small real PyTorch Lightning job for the tests, started by torchrun: gloo on the CPU.

A ``nn.Linear(4, 2)`` LightningModule with an MSE loss trains on ``TensorDataset(ids, x, y)``
(``x``, ``y`` drawn with seed 0), so the test can recompute every step's gradient in one process.
``--strategy drbalance,ddp`` fits with each strategy in turn, in the same processes, from the same
initial weights; ``--resume-epochs N`` then fits again to N epochs from the first fit's last
checkpoint. Each rank writes ``<out>/rank<r>.json``: per strategy, per optimizer step, the epoch,
this rank's sample ids since the step before, every rank's sample counts (drbalance's model
says them), the parameters before the step and the gradients the step uses; the validation
losses; and the data. Prints ``{"rank", "pid", "step"}`` per step (for the kill test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from drbalance.integrations.lightning import DrBalanceStrategy


def flat(tensors) -> list[float]:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


class Probe(pl.LightningModule):
    """Records what every optimizer step used (see the module docstring)."""

    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.sleep = sleep
        self.ids: list[int] = []
        self.steps: list[dict] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.ids.extend(ids.tolist())
        if self.sleep:
            time.sleep(self.sleep)
        return functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        model = self.trainer.strategy.model
        counts = getattr(model, "last_chunk_sizes", None)
        self.steps.append({"epoch": self.current_epoch, "ids": self.ids, "counts": None if counts is None
                           else list(counts), "params": flat(self.parameters()),
                           "grads": flat(p.grad for p in self.parameters())})
        self.ids = []
        sys.stdout.write(json.dumps({"rank": self.global_rank, "pid": os.getpid(), "step": len(self.steps)}) + "\n")
        sys.stdout.flush()

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        loss = functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def strategy_for(name: str, args: argparse.Namespace):
    if name == "ddp":
        return "ddp"
    options = {"report_every": args.report_every, "decide_every": args.decide_every,
               "exchange_timeout": args.exchange_timeout}
    ratio = [int(x) for x in args.ratio.split(",")] if args.ratio else None
    return DrBalanceStrategy(app=args.app, ratio=ratio, exchange_every=args.exchange_every, session_options=options)


def trainer(name: str, args: argparse.Namespace, epochs: int, folder: Path) -> pl.Trainer:
    return pl.Trainer(strategy=strategy_for(name, args), accelerator="cpu", devices=args.devices, max_epochs=epochs,
                      accumulate_grad_batches=args.accumulate, limit_train_batches=args.limit or 1.0,
                      limit_val_batches=1.0 if args.val else 0, num_sanity_val_steps=0 if not args.val else 1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)],
                      default_root_dir=folder)


def run(name: str, args: argparse.Namespace, data: TensorDataset) -> dict:
    torch.manual_seed(0)
    module = Probe(args.sleep)
    folder = Path(args.out) / f"{name}-checkpoints"
    train = DataLoader(data, batch_size=args.batch, shuffle=True)
    val = DataLoader(data, batch_size=args.batch)
    first = trainer(name, args, args.epochs, folder)
    first.fit(module, train, val if args.val else None)
    found = {"steps": module.steps, "first": flat(module.parameters()), "val": list(module.val_losses)}
    if args.resume_epochs:
        resumed = Probe(args.sleep)
        second = trainer(name, args, args.resume_epochs, folder)
        second.fit(resumed, train, val if args.val else None, ckpt_path=str(folder / "last.ckpt"))
        found.update(resumed_steps=resumed.steps, resumed=flat(resumed.parameters()), resumed_val=resumed.val_losses,
                     resumed_from=second.strategy.__class__.__name__)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="drbalance", help="comma-separated: drbalance, ddp")
    parser.add_argument("--app", default="ltjob")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch", type=int, default=5, help="the loader's batch size (per rank, as for ddp)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume-epochs", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="limit_train_batches (0: all)")
    parser.add_argument("--val", action="store_true")
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
    found = {name: run(name, args, data) for name in args.strategy.split(",")}
    found["data"] = {"x": x.tolist(), "y": y.tolist()}
    rank = int(os.environ["RANK"])
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
