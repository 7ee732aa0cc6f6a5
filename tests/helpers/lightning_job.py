"""A small real PyTorch Lightning job for the tests, started by torchrun: gloo on the CPU.

The model and data of tests/helpers/integration_job.py in a LightningModule. ``--strategy
drbalance,ddp`` fits with each strategy in turn, in the same processes, from the same initial
weights; ``--resume-epochs N`` then fits again to N epochs from the first fit's last checkpoint.
Each rank writes ``<out>/rank<r>.json``: per strategy, per optimizer step, the epoch, this rank's
sample ids since the step before, every rank's sample counts (drbalance's model says them), the
parameters before the step and the gradients the step uses; the validation losses; the data.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from drbalance.integrations.lightning import DrBalanceStrategy
from tests.helpers import integration_job as common


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
        self.steps.append(common.step_record(self.current_epoch, self.ids, self, self.trainer.strategy.model,
                                      self.global_rank, len(self.steps)))
        self.ids = []

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


def trainer(name: str, args: argparse.Namespace, epochs: int, folder: Path) -> pl.Trainer:
    strategy = "ddp" if name == "ddp" else DrBalanceStrategy(**common.balance_options(args))
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
                      accumulate_grad_batches=args.accumulate, limit_train_batches=args.limit or 1.0,
                      limit_val_batches=1.0 if args.val else 0, num_sanity_val_steps=1 if args.val else 0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)],
                      default_root_dir=folder)


def run(name: str, args: argparse.Namespace, data: TensorDataset) -> dict:
    torch.manual_seed(0)
    module = Probe(args.sleep)
    folder = Path(args.out) / f"{name}-checkpoints"
    train = DataLoader(data, batch_size=args.batch, shuffle=True)
    val = DataLoader(data, batch_size=args.batch) if args.val else None
    trainer(name, args, args.epochs, folder).fit(module, train, val)
    found = {"steps": module.steps, "first": common.flat(module.parameters()), "val": list(module.val_losses)}
    if args.resume_epochs:
        resumed = Probe(args.sleep)
        second = trainer(name, args, args.resume_epochs, folder)
        second.fit(resumed, train, val, ckpt_path=str(folder / "last.ckpt"))
        found.update(resumed_steps=resumed.steps, resumed=common.flat(resumed.parameters()),
                     resumed_val=resumed.val_losses, resumed_from=type(second.strategy).__name__)
    return found


def main() -> None:
    parser = common.parser_with_common_options("ltjob")
    parser.add_argument("--strategy", default="drbalance", help="comma-separated: drbalance, ddp")
    parser.add_argument("--limit", type=int, default=0, help="limit_train_batches (0: all)")
    parser.add_argument("--val", action="store_true")
    args = parser.parse_args()
    data = common.dataset(args)
    common.write_findings(args, {name: run(name, args, data) for name in args.strategy.split(",")}, data)


if __name__ == "__main__":
    main()
