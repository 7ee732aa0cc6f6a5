"""A PyTorch Lightning training script steered by drbalance: ``strategy="drbalance"`` where it said "ddp".

Copy it and put your own model, data and loop in. It is Lightning's usual DDP script (a
LightningModule, plain DataLoaders, ``Trainer(strategy="ddp", devices=N)``) with drbalance's one
change: the import of ``drbalance.integrations.lightning``, which registers the ``"drbalance"``
strategy, named in the Trainer. Lightning still builds DDP and the per-rank loader; drbalance then
splits every global batch (the loader's batch size x the ranks) by the job's DR, which a running
``drbalance-manager`` steers, and weights the gradients by each rank's share. Without a manager the
job trains on with equal shares. The job's name for the manager follows the logger
(``lightning_logs-<version>``). ``pip install 'drbalance[lightning]'``; see docs/integrations.md.

    torchrun --standalone --nproc_per_node 2 examples/lightning_train.py     # 2 ranks: CUDA (NCCL) or CPU (gloo)
    python examples/lightning_train.py --devices 2                          # Lightning starts the ranks itself
    DRBALANCE_EMULATED_GPUS=2 torchrun --standalone --nproc_per_node 2 examples/lightning_train.py
    torchrun --standalone --nproc_per_node 4 examples/lightning_train.py --epochs 10 --iterations 100 \\
        --batch-size 16 --image-size 64
"""

import argparse
import os

import lightning.pytorch as pl
import torch
import torchvision
from torch.nn import functional
from torch.utils.data import DataLoader
from torchvision import transforms

import drbalance.integrations.lightning  # noqa: F401  (drbalance: registers strategy="drbalance")
from drbalance.argtypes import positive_int


class Classifier(pl.LightningModule):
    """A torchvision ResNet-18 for 10 classes, trained with SGD on the cross-entropy."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = torchvision.models.resnet18(weights=None, num_classes=10)
        self.lr = lr
        self.last_loss = float("nan")

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = functional.cross_entropy(self.net(images), labels)  # the mean over this rank's samples
        self.log("train_loss", loss)
        self.last_loss = loss.item()
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_accuracy", (self.net(images).argmax(1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_end(self) -> None:
        print(f"rank {self.global_rank}: done: {self.trainer.global_step} steps, final loss {self.last_loss:.4f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--iterations", type=positive_int, default=4, help="global batches per epoch")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per rank and step, as for "
                        "strategy='ddp' (the global batch is this x the ranks, split by the DR)")
    parser.add_argument("--image-size", type=positive_int, default=32, help="image side, pixels")
    parser.add_argument("--devices", type=positive_int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                        help="ranks on this machine (default: torchrun's --nproc_per_node, else 2)")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    torch.manual_seed(0)  # the same initial weights on every rank

    images = (3, args.image_size, args.image_size)
    train = torchvision.datasets.FakeData(size=args.batch_size * args.devices * args.iterations, image_size=images,
                                          num_classes=10, transform=transforms.ToTensor())
    held_out = torchvision.datasets.FakeData(size=args.batch_size * args.devices, image_size=images, num_classes=10,
                                             transform=transforms.ToTensor(), random_offset=len(train))
    trainer = pl.Trainer(
        strategy="drbalance",  # drbalance: was "ddp"
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        log_every_n_steps=1,
    )
    trainer.fit(Classifier(args.lr), DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(held_out, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
