"""The README's integration, runnable: a plain torchvision model, FakeData, and drbalance.

Copy it and put your own model, data and loop in. What drbalance adds is three lines: wrap the
model in ``BalancedDataParallel`` (a drop-in for ``nn.DataParallel``), open a ``Session``, call
``session.step()`` once per iteration. A running ``drbalance-manager`` then steers how each
mini-batch is split over the GPUs; without one the job trains on with its own split.

    python examples/integrate.py                                   # all CUDA GPUs, or the CPU
    DRBALANCE_EMULATED_GPUS=4 python examples/integrate.py         # four emulated GPUs, no GPU needed
    python examples/integrate.py --epochs 90 --batch-size 256 --image-size 224 --solo-time resnet50

Without ``--solo-time`` the job estimates its run time alone from its own measurements (its SD is
then marked as estimated; docs/profiles.md). ``--solo-time`` gives it: seconds (any number > 0:
``5400``, ``5.4e3``), or the name of a time stored with ``drbalance profile NAME -- python
examples/integrate.py ...`` (scaled to this run's epochs x iterations); a number that is not finite
and positive, an invalid name, or a name with no stored profile (unless ``drbalance profile`` is
measuring this run) is a usage error.
"""

import argparse

import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms

from drbalance.argtypes import app_name, check_stored_profile, positive_int, seconds_or_profile_name
from drbalance.client import BalancedDataParallel, Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", type=app_name, default="integrate", help="this job's name for the manager")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--iterations", type=positive_int, default=4, help="iterations per epoch")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--image-size", type=positive_int, default=32, help="image side, pixels")
    parser.add_argument("--solo-time", type=seconds_or_profile_name, default=None,
                        help="seconds alone (a number > 0), or a stored profile's name (default: estimated by the "
                        "job from its own measurements)")
    args = parser.parse_args()
    check_stored_profile(parser, args.solo_time)  # a name no profile has: a usage error, before any work
    torch.manual_seed(0)

    net = torchvision.models.resnet18(weights=None, num_classes=10)
    if torch.cuda.is_available():
        gpus = list(range(torch.cuda.device_count()))
        model = BalancedDataParallel(net.cuda(gpus[0]), device_ids=gpus)  # a drop-in for nn.DataParallel
        target_device = torch.device("cuda", gpus[0])
    else:  # CPU (or emulated GPUs, with DRBALANCE_EMULATED_GPUS=N)
        model = BalancedDataParallel(net)
        target_device = torch.device("cpu")

    data = torchvision.datasets.FakeData(size=args.batch_size * args.iterations, num_classes=10,
                                         image_size=(3, args.image_size, args.image_size),
                                         transform=transforms.ToTensor())
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    iterations = 0
    with Session(model, app=args.app, epochs=args.epochs, iterations_per_epoch=loader,
                 solo_time=args.solo_time) as session:
        for _epoch in range(args.epochs):
            for images, labels in loader:
                loss = criterion(model(images), labels.to(target_device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step()
                iterations += 1
    print(f"done: {iterations} iterations, final loss {loss.item():.4f}, DR {model.ratio}")


if __name__ == "__main__":
    main()
