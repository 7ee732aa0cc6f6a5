"""A DistributedDataParallel job under torchrun, steered by drbalance (docs/ddp.md).

Copy it and put your own model, data and loop in. It is a plain DDP script (a DataLoader with a
DistributedSampler and a per-rank batch size) with drbalance's three changes:
``BalancedDistributedDataParallel`` in place of ``DistributedDataParallel``, the loader remade by
``balanced_loader(loader, model)`` (it splits every GLOBAL batch into the ranks' current shares;
``loader.sampler.set_epoch`` still works), and a ``Session`` on every rank with the same arguments
(rank 0 talks to the manager, the others follow). Without ``--solo-time`` the job estimates its
solo-run time itself (docs/profiles.md).

    torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py              # CUDA (NCCL) or CPU (gloo)
    torchrun --standalone --nproc_per_node 4 examples/torchrun_ddp.py --epochs 10 --batch-size 16 \\
        --image-size 64 --iterations 100 --solo-time resnet18
"""

import argparse
import os

import torch
import torch.distributed as dist
import torchvision
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

from drbalance.argtypes import app_name, check_stored_profile, positive_int, seconds_or_profile_name
from drbalance.client import BalancedDistributedDataParallel, Session, balanced_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", type=app_name, default="torchrun-ddp", help="this job's name for the manager")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--iterations", type=positive_int, default=4, help="global batches per epoch")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per rank and step, as in plain "
                        "DDP (the global batch is this x the ranks, split by the DR)")
    parser.add_argument("--image-size", type=positive_int, default=32, help="image side, pixels")
    parser.add_argument("--solo-time", type=seconds_or_profile_name, default=None,
                        help="seconds alone (a number > 0), or a stored profile's name (default: estimated by the "
                        "job from its own measurements)")
    args = parser.parse_args()
    check_stored_profile(parser, args.solo_time)  # a name no profile has: a usage error, before any work
    missing = [name for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if name not in os.environ]  # set by torchrun
    if missing:
        parser.error(f"{', '.join(missing)} not set: start it with torchrun, e.g. "
                     f"torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py")
    torch.manual_seed(0)  # the same initial weights on every rank

    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")

    net = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    model = BalancedDistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
    data = torchvision.datasets.FakeData(size=args.batch_size * dist.get_world_size() * args.iterations,
                                         num_classes=10, image_size=(3, args.image_size, args.image_size),
                                         transform=transforms.ToTensor())
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))  # as plain DDP has it
    loader = balanced_loader(loader, model)  # the same loader, each global batch split by the job's DR
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.CrossEntropyLoss()  # the mean over this rank's samples

    iterations = 0
    with Session(model, app=args.app, epochs=args.epochs, iterations_per_epoch=loader,
                 solo_time=args.solo_time) as session:  # on EVERY rank, with the same arguments
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for images, labels in loader:
                loss = criterion(model(images.to(device)), labels.to(device))
                optimizer.zero_grad()
                loss.backward()  # a sample-weighted all-reduce: the gradient of the global batch's mean loss
                optimizer.step()
                session.step()
                iterations += 1
    print(f"rank {dist.get_rank()}: done: {iterations} iterations, final loss {loss.item():.4f}, "
          f"{len(images)} of {loader.batch_sampler.batch_size} samples in the last batch", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
