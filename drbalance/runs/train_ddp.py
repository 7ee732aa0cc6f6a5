"""Train a torchvision model with BalancedDistributedDataParallel under torchrun, steered by drbalance.

One process per rank, started by torchrun; each rank trains on its share of every global batch
(BalancedBatchSampler), and rank 0 talks to the drbalance manager. Devices: one CUDA GPU per rank
with NCCL (``--devices cuda``), one emulated GPU per rank with gloo (``--devices emulated:N``; no
GPU needed), or the CPU with gloo. Data: FakeData (default) or an ImageFolder path.

    torchrun --standalone --nproc_per_node 2 -m drbalance.runs.train_ddp --model resnet50 --solo-time 120
    torchrun --standalone --nproc_per_node 2 -m drbalance.runs.train_ddp --devices emulated:4 --gpus 2,3 \\
        --model alexnet --batch-size 16 --time-scale 10 --solo-time auto

``--batch-size`` is the global batch (all ranks together); ``--ratio`` the initial DR over the
ranks (default: equal shares). ``--gpus`` maps local rank i to device ``gpus[i]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader

from drbalance import defaults
from drbalance.argtypes import non_negative_int, positive_float, positive_int
from drbalance.client import BalancedBatchSampler, BalancedDistributedDataParallel, Session
from drbalance.client.sampler import check_rank_ratio
from drbalance.emu.gpus import EmulatedSpec
from drbalance.ipc.discovery import AppNameInUse
from drbalance.profiling.store import ProfileNotFound
from drbalance.runs import train as train_py
from drbalance.runs.launch import follow_parent
from drbalance.runs.train import (
    add_model_options,
    add_training_options,
    advance_progress,
    build_dataset,
    check_image_size,
    exit_status,
    open_progress,
    parse_integers,
    seed,
    solo_time,
    thread_count,
)

PROGRAM = "train_ddp.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--iterations", type=positive_int, default=None,
                        help="global batches per epoch (default: the whole dataset; FakeData then has 20)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="samples per global batch, all ranks (default 16)")
    parser.add_argument("--image-size", type=positive_int, default=defaults.IMAGE_SIZE,
                        help="image side in pixels (default 64)")
    parser.add_argument("--devices", default="auto",
                        help="'cuda' (NCCL), 'emulated:N[:MEMORY]' (gloo), 'cpu' (gloo), or 'auto' (CUDA if "
                        "present, else DRBALANCE_EMULATED_GPUS, else the CPU)")
    parser.add_argument("--gpus", default=None,
                        help="device of each local rank, e.g. 2,3 (default: local rank i on device i)")
    parser.add_argument("--ratio", default=None,
                        help="initial DR over the ranks as whole-number weights, e.g. 3,7 or 1,2 (default even)")
    parser.add_argument("--solo-time", default=None,
                        help="solo-run seconds, a stored profile name, or 'auto' (emulated GPUs: from the model's "
                        "cost table); default: estimated by the job from its own measurements")
    parser.add_argument("--app", default=None, help="app name for the manager (default: <model>-ddp-<pid of rank 0>)")
    parser.add_argument("--workers", type=non_negative_int, default=0,
                        help="DataLoader worker processes per rank (default 0)")
    add_training_options(parser)
    parser.add_argument("--threads", type=thread_count, default=1,
                        help="CPU threads for torch per rank, at most the CPU count (default 1)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="random seed, a signed 64-bit integer (default 0; the same on every rank)")
    parser.add_argument("--timeout", type=positive_float, default=300.0,
                        help="seconds a collective may wait for another rank before failing (default 300)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def fail(message: str) -> SystemExit:
    return SystemExit(f"{PROGRAM}: {message}")


def torchrun_environment() -> tuple[int, int, int]:
    """(rank, local rank, world size) from the variables torchrun sets."""
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if not os.environ.get(name)]
    if missing:
        raise fail(f"{', '.join(missing)} not set: start it with torchrun, e.g. "
                   f"'torchrun --standalone --nproc_per_node 2 -m drbalance.runs.train_ddp ...'")
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def choose_devices(spec: str) -> tuple[str, EmulatedSpec | None]:
    """('cuda'|'emulated'|'cpu', the emulated GPUs' count and memory), as train.py chooses them;
    bad values exit with a message that starts with train_ddp.py."""
    return train_py.choose_devices(spec, PROGRAM, without_cuda="emulated:4 or cpu")


def rank_device(args: argparse.Namespace, kind: str, local_rank: int, emulated: EmulatedSpec | None) -> int | None:
    """The device index of this rank (CUDA or emulated GPU), None on the CPU."""
    if kind == "cpu":
        return None
    if kind == "cuda":
        available = torch.cuda.device_count()
    else:  # the emulated GPUs this process sees: the machine's or its user's, as CUDA_VISIBLE_DEVICES shows them
        from drbalance.emu.view import emulated_view

        available = emulated_view(emulated.count, emulated.memory_bytes).count
    try:
        gpus = [int(x) for x in args.gpus.split(",")] if args.gpus else list(range(available))
    except ValueError:
        raise fail(f"--gpus must be comma-separated device indices; got {args.gpus!r}") from None
    if local_rank >= len(gpus):
        raise fail(f"local rank {local_rank} has no device: --gpus gives {len(gpus)} for more ranks on this node")
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")  # set by torchrun: every local rank checks alike
    used = gpus[:int(local_world)] if local_world.isdigit() else []
    shared = sorted({index for index in used if used.count(index) > 1})
    if shared:
        raise fail(f"--gpus {args.gpus} gives device(s) {shared} to more than one rank of this node; give every "
                   f"rank a GPU of its own (NCCL refuses two ranks on one GPU, and the manager cannot steer a job "
                   f"whose ranks share one)")
    gpu = gpus[local_rank]
    if not 0 <= gpu < available:
        raise fail(f"device {gpu} of --gpus does not exist ({available} {kind} GPUs)")
    return gpu


def build_loader(args: argparse.Namespace, model: BalancedDistributedDataParallel, pin: bool):
    dataset = build_dataset(args, PROGRAM)
    sampler = BalancedBatchSampler(dataset, args.batch_size, model=model, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers, pin_memory=pin)
    return loader, sampler


def classes_of(args: argparse.Namespace) -> int:
    if args.data == "fake":
        return args.classes
    return len(torchvision.datasets.folder.find_classes(args.data)[0])


def app_name(args: argparse.Namespace, rank: int) -> str:
    """The app name, the same on every rank (rank 0's pid goes to the others through the process group)."""
    if args.app:
        return args.app
    names = [f"{args.model}-ddp-{os.getpid()}"]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_image_size(parser, args, one_sample=True)  # a rank's share of a global batch can be one sample
    rank, local_rank, world_size = torchrun_environment()
    follow_parent()  # a rank dies with its torchrun agent instead of waiting for a peer that never comes
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    try:  # bad input found while setting up is one line per rank, not a traceback from each
        return train(args, rank, local_rank, world_size)
    except (ValueError, ProfileNotFound, OSError, AppNameInUse) as error:  # AppNameInUse: rank 0's --app is taken
        print(f"drbalance.runs.train_ddp: error (rank {rank}): {error}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int) -> int:
    """Set up this rank (process group, model, loader, session) and train; ValueError, OSError,
    ``ProfileNotFound`` or ``AppNameInUse`` for bad input found while setting up."""
    kind, emulated_gpus = choose_devices(args.devices)
    gpu = rank_device(args, kind, local_rank, emulated_gpus)
    memory_bytes = emulated_gpus.memory_bytes if emulated_gpus is not None else None
    timeout = timedelta(seconds=args.timeout)
    ratio = parse_integers(args.ratio, "--ratio", "5,5") if args.ratio else None
    if ratio is not None:
        check_rank_ratio(ratio, world_size, where="--ratio")  # every rank refuses it alike, before any collective
    if kind == "cuda":
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", gpu))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    network = getattr(torchvision.models, args.model)(weights=None, num_classes=classes_of(args))
    emulated = None
    if kind == "cuda":
        model = BalancedDistributedDataParallel(network.cuda(gpu), device_ids=[gpu], ratio=ratio)
        device = torch.device("cuda", gpu)
    elif kind == "emulated":
        from drbalance.client.emulated_rank import EmulatedRankDevice
        from drbalance.workload.models import model_costs

        emulated = EmulatedRankDevice(gpu, model_costs(args.model), args.time_scale, args.sample_scale,
                                      memory_bytes=memory_bytes, count=emulated_gpus.count)
        emulated.attach(network)
        model = BalancedDistributedDataParallel(network, ratio=ratio, device_label=emulated.label,
                                                device_uuid=emulated.uuid)
        device = torch.device("cpu")
    else:
        model = BalancedDistributedDataParallel(network, ratio=ratio)
        device = torch.device("cpu")
    loader, sampler = build_loader(args, model, pin=kind == "cuda")
    iterations = min(args.iterations or len(loader), len(loader))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()  # the mean over this rank's samples: the hook weights it by its share
    app = app_name(args, rank)
    session = Session(model, app, args.epochs, iterations, solo_time(args, kind, iterations, PROGRAM),
                      report_every=args.report_every, decide_every=args.decide_every or None)
    progress = open_progress(args, iterations * args.epochs, app, shown=rank == 0)
    started = time.monotonic()
    with session:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for index, (images, labels) in enumerate(loader):
                if index >= iterations:
                    break
                output = model(images.to(device, non_blocking=True))
                loss = criterion(output, labels.to(device, non_blocking=True))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                session.step()
                advance_progress(progress, session, epoch, loss, model)
    if progress is not None:
        progress.close()
    if rank == 0:
        print(f"{app}: {iterations * args.epochs} iterations on {world_size} ranks in "
              f"{time.monotonic() - started:.1f} s, final DR {model.ratio}", file=sys.stderr)
    if emulated is not None:
        emulated.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main, PROGRAM))
