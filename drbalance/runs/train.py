"""Train one of the paper's torchvision models with BalancedDataParallel and a drbalance Session.

Data: ``torchvision.datasets.FakeData`` (default) or an ImageFolder path. Devices: CUDA GPUs,
emulated GPUs (``--devices emulated:4``; no GPU needed), or the CPU. Run it alone, or let
``drbalance launch`` / ``drbalance demo`` start several of it beside a manager.

    python -m drbalance.runs.train --model resnet50 --epochs 2 --iterations 20 --solo-time 120
    python -m drbalance.runs.train --model densenet121 --devices emulated:4 --time-scale 10 --solo-time auto
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

from drbalance import defaults, env
from drbalance.argtypes import non_negative_int, positive_float, positive_float_up_to, positive_int
from drbalance.client import BalancedDataParallel, CpuBackend, Session
from drbalance.client.session import RatioTarget
from drbalance.emu.gpus import EmulatedSpec, emulated_spec
from drbalance.ipc.discovery import AppNameInUse
from drbalance.profiling.store import ProfileNotFound
from drbalance.ratio import as_ratio
from drbalance.workload.models import MIN_IMAGE_SIZE

if TYPE_CHECKING:
    from tqdm import tqdm

MODELS = tuple(MIN_IMAGE_SIZE)  # the models these scripts train


def check_image_size(parser: argparse.ArgumentParser, args: argparse.Namespace, one_sample: bool) -> None:
    """A usage error (exit status 2) for an ``--image-size`` on which ``--model`` cannot train
    (``MIN_IMAGE_SIZE``), instead of a traceback from its first forward. ``one_sample``: a chunk
    (a replica's or a rank's share of a batch) may hold a single sample."""
    shared, alone = MIN_IMAGE_SIZE[args.model]
    if args.image_size < shared:
        parser.error(f"argument --image-size: {args.model} trains on images of at least {shared} pixels a side; "
                     f"got {args.image_size}")
    if one_sample and args.image_size < alone:
        parser.error(f"argument --image-size: {args.model} trains a chunk of one sample on images of at least "
                     f"{alone} pixels a side; got {args.image_size}")


def seed(text: str) -> int:
    """``--seed``: a signed 64-bit integer (``torch.manual_seed`` takes no more, and the DDP sampler
    seeds each epoch with ``seed + epoch``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -2**63 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer within -2**63..2**63-1; got {text}")
    return value


def thread_count(text: str) -> int:
    """``--threads``: CPU threads for torch, 1 up to this machine's CPU count (``torch.set_num_threads``
    fails with a MemoryError far above it, and threads beyond the CPUs only slow it down)."""
    value = positive_int(text)
    cpus = os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be at most {cpus} (this machine's CPUs); got {text}")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The first options train.py and train_ddp.py share word for word: the model, the data, the
    classes of FakeData and the epochs."""
    parser.add_argument("--model", choices=MODELS, default="resnet50", help="torchvision model (no pretrained weights)")
    parser.add_argument("--data", default="fake", help="'fake' (FakeData) or an ImageFolder directory")
    parser.add_argument("--classes", type=positive_int, default=10, help="classes of FakeData (default 10)")
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs (default 2)")


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The options train.py and train_ddp.py share word for word: reporting, decisions, the
    learning rate, and the emulated GPUs' time and sample scales."""
    parser.add_argument("--report-every", type=positive_int, default=5,
                        help="iterations between SD reports (default 5)")
    parser.add_argument("--decide-every", type=non_negative_int, default=None,
                        help="iterations between DR decisions (default: epoch ends only)")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument("--time-scale", type=positive_float_up_to(defaults.MAX_TIME_SCALE), default=1.0,
                        help=f"emulated GPUs: multiply modelled times by this (default 1, at most "
                        f"{defaults.MAX_TIME_SCALE:g})")
    parser.add_argument("--sample-scale", type=positive_float, default=1.0,
                        help="emulated GPUs: modelled samples per real sample (default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--iterations", type=positive_int, default=None,
                        help="iterations per epoch (default: the whole dataset; FakeData then has 20 batches)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per iteration (default 8)")
    parser.add_argument("--image-size", type=positive_int, default=defaults.IMAGE_SIZE,
                        help="image side in pixels (default 64: the smallest at which every model trains "
                        "with 1-sample chunks)")
    parser.add_argument("--devices", default="auto",
                        help="'cuda', 'emulated:N[:MEMORY]' (e.g. emulated:4:16GiB), 'cpu', or 'auto' (CUDA if "
                        "present, else DRBALANCE_EMULATED_GPUS, else the CPU)")
    parser.add_argument("--gpus", default=None, help="CUDA device ids, e.g. 0,1,2,3 (default: all); CUDA only")
    parser.add_argument("--ratio", default=None,
                        help="initial DR as whole-number weights, e.g. 3,3,2,2 or 3,1 (default: even)")
    parser.add_argument("--solo-time", default=None,
                        help="solo-run seconds, a stored profile name, or 'auto' (emulated GPUs only: from the "
                        "model's cost table); default: estimated by the job from its own measurements")
    parser.add_argument("--checkpoint", default=None, metavar="PATH",
                        help="after every epoch save model, optimizer and epochs done here; at start, resume from it "
                        "when it exists (a requeued Slurm job goes on where it stopped)")
    parser.add_argument("--app", default=None, help="app name for the manager (default: in a Slurm job "
                        "<SLURM_JOB_NAME>-<SLURM_JOB_ID>, else <model>-<pid>)")
    add_training_options(parser)
    parser.add_argument("--threads", type=thread_count, default=1,
                        help="CPU threads for torch, at most the CPU count (default 1)")
    parser.add_argument("--seed", type=seed, default=0, help="random seed, a signed 64-bit integer (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--start-gate", default=None, metavar="PATH",
                        help="set up (model, data, optimizer), write PATH.ready, then wait until PATH exists "
                        "before the session and training start: 'drbalance launch' starts jobs launched "
                        "together together, however long each took to import and build")
    parser.add_argument("--start-gate-timeout", type=positive_float, default=900.0,
                        help="seconds to wait at --start-gate before giving up (default 900)")
    return parser


def pass_start_gate(gate: str, timeout: float, poll: float = 0.05) -> None:
    """Say this job is set up (``GATE.ready``, a new private file), then wait until ``gate``
    exists (its existence is the signal; nothing is read from it). Exits with a message after
    ``timeout`` seconds."""
    from drbalance.ipc.private import write_private

    try:
        write_private(f"{gate}.ready", b"ready\n")
    except OSError as error:
        raise SystemExit(f"train.py: --start-gate {gate!r}: cannot write {gate}.ready: {error}") from None
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise SystemExit(f"train.py: --start-gate {gate!r}: no start signal after {timeout:.0f} s")
        time.sleep(poll)


def choose_devices(spec: str, program: str = "train.py",
                   without_cuda: str = "emulated:4") -> tuple[str, EmulatedSpec | None]:
    """('cuda'|'emulated'|'cpu', the emulated GPUs' count and memory) from ``--devices``. Bad values
    exit with a message that starts with ``program``; ``without_cuda`` is the ``--devices`` it
    suggests when CUDA is asked for but not available."""
    given = f"--devices {spec!r}"  # what a bad value is blamed on
    if spec == "auto":
        if torch.cuda.is_available():
            return "cuda", None
        emulated = env.emulated_gpus()
        spec = f"emulated:{emulated}" if emulated else "cpu"
        given = f"--devices auto (no CUDA): DRBALANCE_EMULATED_GPUS={emulated!r}"
    kind, colon, count = spec.partition(":")
    if kind in ("cuda", "cpu") and colon:  # 'cuda:1' must not pass for every CUDA GPU, without a word
        raise SystemExit(f"{program}: --devices {spec!r}: '{kind}' takes nothing after it; choose GPUs with "
                         f"--gpus (e.g. --devices cuda --gpus {count or '0,1'})")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{program}: --devices cuda, but CUDA is not available; try --devices {without_cuda}")
        return "cuda", None
    if kind == "emulated":  # N or N:MEMORY, as DRBALANCE_EMULATED_GPUS takes it
        try:
            return "emulated", emulated_spec(count or None)
        except ValueError as error:
            raise SystemExit(f"{program}: {given}: {error}") from None
    if kind == "cpu":
        return "cpu", None
    raise SystemExit(f"{program}: unknown --devices {spec!r}; use cuda, emulated:N[:MEMORY], cpu or auto")


def build_dataset(args: argparse.Namespace,
                  program: str = "train.py") -> torchvision.datasets.FakeData | torchvision.datasets.ImageFolder:
    """``--data``: FakeData of ``--iterations`` batches (default 20) of ``--batch-size`` images, or
    the ImageFolder at that path, resized and cropped to ``--image-size``. A path that is not a
    directory exits with a message that starts with ``program``."""
    tensor = transforms.ToTensor()
    if args.data == "fake":
        batches = args.iterations or 20
        return torchvision.datasets.FakeData(size=batches * args.batch_size, image_size=(3, args.image_size,
                                             args.image_size), num_classes=args.classes, transform=tensor)
    if not os.path.isdir(args.data):
        raise SystemExit(f"{program}: --data {args.data!r} is neither 'fake' nor a directory")
    size = args.image_size
    resize = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), tensor])
    return torchvision.datasets.ImageFolder(args.data, transform=resize)


def build_loader(args: argparse.Namespace) -> tuple[DataLoader, int]:
    """The shuffled loader of whole ``--batch-size`` batches, and the number of classes."""
    dataset = build_dataset(args)
    classes = args.classes if args.data == "fake" else len(dataset.classes)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=0)
    if len(loader) == 0:
        raise SystemExit(f"train.py: the dataset has fewer than --batch-size {args.batch_size} samples")
    return loader, classes


def parse_integers(text: str, option: str, example: str) -> list[int]:
    """``3,3,2,2`` -> [3, 3, 2, 2]; ValueError naming ``option`` for anything else."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, e.g. {example}; got {text!r}") from None


def build_model(args: argparse.Namespace, classes: int, kind: str,
                emulated_gpus: EmulatedSpec | None) -> BalancedDataParallel:
    network = getattr(torchvision.models, args.model)(weights=None, num_classes=classes)
    ratio = as_ratio(parse_integers(args.ratio, "--ratio", "3,3,2,2")) if args.ratio else None
    if args.gpus is not None and kind != "cuda":  # refused, not ignored without a word
        raise ValueError(f"--gpus {args.gpus} chooses CUDA GPUs, but this job trains on the {kind}; leave --gpus "
                         f"out or use --devices cuda")
    if kind == "cuda":
        count = torch.cuda.device_count()
        gpus = parse_integers(args.gpus, "--gpus", "0,1") if args.gpus is not None else list(range(count))
        missing = [gpu for gpu in gpus if not 0 <= gpu < count]
        if missing:  # before network.cuda(), whose "invalid device ordinal" is a traceback
            raise ValueError(f"--gpus {args.gpus}: device {missing[0]} does not exist ({count} CUDA GPUs: "
                             f"0..{count - 1})")
        return BalancedDataParallel(network.cuda(gpus[0]), device_ids=gpus, ratio=ratio)
    if kind == "emulated":
        from drbalance.client.emulated import EmulatedBackend
        from drbalance.workload.models import model_costs

        backend = EmulatedBackend(emulated_gpus.count, model_costs(args.model), args.time_scale, args.sample_scale,
                                  memory_bytes=emulated_gpus.memory_bytes)
        return BalancedDataParallel(network, ratio=ratio, backend=backend)
    return BalancedDataParallel(network, ratio=ratio, backend=CpuBackend())  # --devices cpu means the CPU


def solo_time(args: argparse.Namespace, kind: str, iterations: int,
              program: str = "train.py") -> float | str | None:
    """The job's solo-run time in seconds from ``--solo-time`` (a number, ``auto`` with emulated
    GPUs, or a profile name, returned as is); None without one (the session estimates it). Bad
    values exit with a message that starts with ``program``."""
    value = args.solo_time
    if value is None:
        return None
    if value == "auto":
        if kind != "emulated":
            raise SystemExit(f"{program}: --solo-time auto needs emulated GPUs (their timing model is known)")
        from drbalance.workload.models import model_costs

        per_iteration = model_costs(args.model).solo_iteration(args.batch_size * args.sample_scale)
        return iterations * args.epochs * per_iteration * args.time_scale
    try:
        seconds = float(value)
    except ValueError:
        return value  # a profile name
    if not (math.isfinite(seconds) and seconds > 0):
        raise SystemExit(f"{program}: --solo-time must be > 0 seconds; got {value!r}")
    return seconds


def open_progress(args: argparse.Namespace, total: int, app: str, shown: bool = True) -> tqdm | None:
    """A progress bar of ``total`` iterations when ``shown``, ``--no-progress`` is not given and
    stderr is a terminal; else None."""
    if not shown or args.no_progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=app, unit="it")


def advance_progress(progress: tqdm | None, session: Session, epoch: int, loss: torch.Tensor,
                     model: RatioTarget) -> None:
    """One iteration more on ``progress`` (None: nothing), showing the epoch, the loss, the job's SD
    and the model's DR."""
    if progress is None:
        return
    sd = session.slowdown
    progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", sd="-" if sd is None else f"{sd:.2f}",
                         dr=str(model.ratio))
    progress.update()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_image_size(parser, args, one_sample=args.batch_size == 1)  # larger batches: no chunk of one sample
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    try:  # bad input found while setting up (a DR, a profile name, ...) is one line, not a traceback
        kind, emulated_gpus = choose_devices(args.devices)
        loader, classes = build_loader(args)
        iterations = min(args.iterations or len(loader), len(loader))
        model = build_model(args, classes, kind, emulated_gpus)
        app = args.app or env.slurm_app_name() or f"{args.model}-{os.getpid()}"
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        start_epoch = resume(args.checkpoint, model, optimizer, args.epochs)
        if start_epoch >= args.epochs:
            print(f"{app}: the checkpoint {args.checkpoint} holds all {args.epochs} epochs; nothing to train",
                  file=sys.stderr)
            return 0
        if args.start_gate:
            pass_start_gate(args.start_gate, args.start_gate_timeout)
        session = Session(model, app, args.epochs, iterations, solo_time(args, kind, iterations),
                          start_epoch=start_epoch, report_every=args.report_every,
                          decide_every=args.decide_every or None)
    except (ValueError, ProfileNotFound, OSError, AppNameInUse) as error:  # OSError: e.g. an SD log path that is a
        # symbolic link; AppNameInUse: --app names a job that is running
        print(f"drbalance.runs.train: error: {error}", file=sys.stderr)
        return 2
    criterion = nn.CrossEntropyLoss()
    device = torch.device("cuda", model.device_ids[0]) if kind == "cuda" else torch.device("cpu")
    progress = open_progress(args, iterations * args.epochs, app)
    started = time.monotonic()
    with session:
        for epoch in range(start_epoch, args.epochs):
            for index, (images, labels) in enumerate(loader):
                if index >= iterations:
                    break
                images = images.to(device, non_blocking=True)

                def closure(images: torch.Tensor = images, labels: torch.Tensor = labels) -> torch.Tensor:
                    output = model(images)
                    loss = criterion(output, labels.to(output.device))
                    loss.backward()
                    return loss

                optimizer.zero_grad(set_to_none=True)
                loss = model.train_step(closure)  # an out-of-memory error after a DR change is undone and re-run
                optimizer.step()
                session.step()
                advance_progress(progress, session, epoch, loss, model)
            save_checkpoint(args.checkpoint, model, optimizer, epoch + 1)
    if progress is not None:
        progress.close()
    print(f"{app}: {iterations * (args.epochs - start_epoch)} iterations in {time.monotonic() - started:.1f} s, "
          f"final DR {model.ratio}", file=sys.stderr)
    return 0


def resume(path: str | None, model: nn.Module, optimizer: torch.optim.Optimizer, epochs: int) -> int:
    """Epochs already done, from the checkpoint at ``path`` (model and optimizer loaded from it);
    0 without one. ``ValueError`` for a file that is not this script's checkpoint."""
    if path is None or not os.path.exists(path):
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        done = int(state["epochs_done"])
    except (KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as error:
        raise ValueError(f"--checkpoint {path} is not a checkpoint of this model ({error})") from None
    if not 0 <= done <= epochs:
        raise ValueError(f"--checkpoint {path} holds {done} epochs; this run has {epochs}")
    return done


def save_checkpoint(path: str | None, model: nn.Module, optimizer: torch.optim.Optimizer, done: int) -> None:
    """Write model, optimizer and epochs done to ``path``, whole or not at all (a new file renamed over it)."""
    if path is None:
        return
    partial = f"{path}.partial"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_done": done}, partial)
    os.replace(partial, path)


def exit_status(main: Callable[[], int], program: str) -> int:
    """``main()``'s exit status; Ctrl-C is one line and 130 (128 + SIGINT), not torch's traceback of
    the frame it interrupted. The job's session, data and emulated GPUs are released as it unwinds."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{program}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(exit_status(main, "train.py"))
