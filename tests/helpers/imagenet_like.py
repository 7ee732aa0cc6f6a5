"""A training script shaped like the well-known public ImageNet example, written for the drop-in tests.

Same structure as that script in its ``torch.accelerator`` wording (argument parser, a torchvision
architecture by name, the device branches with ``nn.DataParallel`` only when a CUDA accelerator is
there, train / validate / checkpoint / resume, state dicts saved from the wrapper),
with FakeData instead of an ImageNet folder and small sizes.
The tests apply the edit docs/client.md shows to it (textually, its ``diff`` block on the marked
lines) and run it unchanged otherwise.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms


def parse(argv=None):
    parser = argparse.ArgumentParser(description="ImageNet-style training on FakeData")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("--lr", default=0.05, type=float)
    parser.add_argument("--image-size", default=32, type=int)
    parser.add_argument("--batches", default=3, type=int, help="batches per epoch")
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar")
    parser.add_argument("--gpu", default=None, type=int)
    return parser.parse_args(argv)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


def accuracy(output, target):
    with torch.no_grad():
        return (output.argmax(dim=1) == target).float().mean().item() * 100


def main(argv=None):
    args = parse(argv)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(weights=None, num_classes=10)

    use_accel = torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
    if not use_accel:
        print('using CPU, this will be slow')  # drop-in: CPU line
    elif args.gpu is not None:
        torch.accelerator.set_device_index(args.gpu)
        model = model.to(device)
    elif device.type == 'cuda':
        model = torch.nn.DataParallel(model).cuda()  # drop-in: CUDA line
    else:
        model.to(device)

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    best = 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=False)
        args.start_epoch = checkpoint["epoch"]
        best = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        print(f"=> resumed from '{args.resume}' (epoch {checkpoint['epoch']})")

    size = (3, args.image_size, args.image_size)
    train_set = torchvision.datasets.FakeData(args.batches * args.batch_size, size, 10, transforms.ToTensor())
    val_set = torchvision.datasets.FakeData(2 * args.batch_size, size, 10, transforms.ToTensor(), random_offset=7)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    if args.evaluate:
        print(f"eval acc1 {validate(val_loader, model, criterion, device):.2f}")
        return
    for epoch in range(args.start_epoch, args.epochs):
        train(train_loader, model, criterion, optimizer, device)
        scheduler.step()
        acc1 = validate(val_loader, model, criterion, device)
        best = max(acc1, best)
        torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(), "best_acc1": best,
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, args.checkpoint)
        print(f"epoch {epoch} acc1 {acc1:.2f} best {best:.2f}")
    print(f"model {type(model).__name__} keys {next(iter(model.state_dict()))} pid {os.getpid()}")


def train(loader, model, criterion, optimizer, device):
    losses = AverageMeter()
    model.train()
    started = time.time()
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"train loss {losses.avg:.4f} in {time.time() - started:.1f} s")


def validate(loader, model, criterion, device):
    top1 = AverageMeter()
    model.eval()
    with torch.no_grad():
        for images, target in loader:
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(images)
            criterion(output, target)
            top1.update(accuracy(output, target), images.size(0))
    return top1.avg


if __name__ == "__main__":
    main()
