"""A Hugging Face Accelerate training script steered by drbalance: ``BalancedAccelerator`` for ``Accelerator``.

Copy it and put your own model, data and loop in. It is Accelerate's usual script (plain
DataLoaders, ``accelerator.prepare(model, optimizer, loaders)``, ``accelerator.backward``,
``gather_for_metrics``) with drbalance's one change: ``BalancedAccelerator(epochs=...)`` in place of
``Accelerator()``. ``prepare`` then builds drbalance's DDP model, splits every global batch of the
shuffled (training) loader by the job's DR, which a running ``drbalance-manager`` steers, and
opens the job's session; the in-order evaluation loader stays as Accelerate shards it. Without a
manager the job trains on with equal shares. The job's name for the manager is the script's
(``accelerate_train``). ``pip install 'drbalance[accelerate]'``; see docs/integrations.md.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py          # 2 processes, CUDA or CPU
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py   # the same (on CPUs too)
    DRBALANCE_EMULATED_GPUS=2 torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py

``accelerate launch --cpu --num_processes 2`` starts one process (Accelerate starts CPU processes
through mpirun only): it trains alone, as plain Accelerate would, and says so.
"""

import argparse

import torch
import torchvision
from torch.nn import functional
from torch.utils.data import DataLoader
from torchvision import transforms

from drbalance.argtypes import positive_int
from drbalance.integrations.accelerate import BalancedAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--iterations", type=positive_int, default=4, help="global batches per epoch")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per process and step, as "
                        "for Accelerator (the global batch is this x the processes, split by the DR)")
    parser.add_argument("--image-size", type=positive_int, default=32, help="image side, pixels")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    # drbalance: was Accelerator(cpu=...); cpu=True makes processes without CUDA a gloo job
    accelerator = BalancedAccelerator(epochs=args.epochs, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    images = (3, args.image_size, args.image_size)
    train = torchvision.datasets.FakeData(size=args.batch_size * accelerator.num_processes * args.iterations,
                                          image_size=images, num_classes=10, transform=transforms.ToTensor())
    held_out = torchvision.datasets.FakeData(size=args.batch_size * accelerator.num_processes, image_size=images,
                                             num_classes=10, transform=transforms.ToTensor(), random_offset=len(train))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(held_out, batch_size=args.batch_size))

    batches = 0
    for epoch in range(args.epochs):
        model.train()
        for inputs, labels in train_loader:
            loss = functional.cross_entropy(model(inputs), labels)  # the mean over this process's samples
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches, last_batch = batches + 1, len(inputs)
        model.eval()
        correct = []
        with torch.no_grad():
            for inputs, labels in eval_loader:
                correct.append(accelerator.gather_for_metrics(model(inputs).argmax(1) == labels))
        accelerator.print(f"epoch {epoch}: accuracy {torch.cat(correct).float().mean().item():.3f} on held-out data")
    print(f"process {accelerator.process_index}: done: {batches} batches, final loss {loss.item():.4f}, "
          f"{last_batch} samples in its last training batch", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
