"""What a DR change costs a job: the extra seconds of its first steps after the change.

A changed DR can cost a training job time that the steps before it did not pay: a replica's first
use of a device (allocation, a cold caching allocator) and, with ``cudnn.benchmark`` on, an
autotuning pass for every chunk shape not seen before. This benchmark trains a torchvision model
in ``BalancedDataParallel`` and changes its DR again and again, in two kinds of change:

- ``reshape``: the same devices, chunk sizes never seen before (``[a, b]`` of total 32);
- ``new_device``: a device the job has not used yet (a fresh wrapper for each, so each is a
  real first use in this process: on CUDA the second GPU's context and allocator).

For each change it times the first two steps after it against the median of the steps that
follow them under the same DR (warm: what the new DR costs every step is not counted), and
reports the medians of the extra seconds and of the extra as a share of a step. Devices: ``cpu``
(the CPU path), ``emulated`` (two emulated GPUs, ``DRBALANCE_EMULATED_GPUS``'s backend) and
``cuda`` (two GPUs, ``cudnn.benchmark`` on; one GPU: reshape only). The simulator charges the
figure in ``drbalance/defaults.py`` (``CHANGE_COST_ITERATIONS``, in steps) per change;
docs/simulator.md says which measurement it comes from.

    python -m benchmarks.change_cost                       # cpu and emulated (and cuda if present)
    python -m benchmarks.change_cost --devices cuda --model resnet50 --image 224 --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn

from benchmarks.timing import add_no_write, save, scratch_namespace
from drbalance import DataRatio
from drbalance.argtypes import positive_int
from drbalance.client import BalancedDataParallel
from drbalance.client.backends import CpuBackend, CudaBackend
from drbalance.client.emulated import EmulatedBackend
from drbalance.workload.models import model_costs

TOTAL = 32
"""DR total of the reshape changes: 31 distinct splits of two devices, each a new chunk shape."""


def make_step(runner: nn.Module, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> Callable[[], float]:
    """A training step that returns its own seconds (the device synchronised at its end)."""
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.0)

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(runner(x), y).backward()
        optimizer.step()
        sync()
        return time.perf_counter() - started

    return step


def backend_for(device: str, model_name: str) -> tuple[Callable[[], object], Callable[[], None]]:
    """A factory of fresh backends for ``device``, and the call that waits for the device."""
    if device == "cuda":
        return CudaBackend, torch.cuda.synchronize
    if device == "emulated":
        return (lambda: EmulatedBackend(2, model_costs(model_name))), lambda: None
    return CpuBackend, lambda: None


def measure(device: str, args: argparse.Namespace) -> dict:
    """Extra seconds of the first two steps after each change, per kind of change. With one CUDA
    GPU a DR cannot give a chunk a new shape: the batch's size changes instead (``reshape``: the same
    new shapes for cuDNN), and no device is new."""
    torch.manual_seed(0)
    make_backend, sync = backend_for(device, args.model)
    where = "cuda:0" if device == "cuda" else "cpu"
    x = torch.randn(args.batch, 3, args.image, args.image, device=where)
    y = torch.randint(0, 10, (args.batch,), device=where)
    two = device != "cuda" or torch.cuda.device_count() >= 2
    rows: dict[str, list[tuple[float, float, float]]] = {"reshape": [], "new_device": []}
    splits = [a for a in range(1, TOTAL) if a != TOTAL // 2]
    for change in range(args.changes):
        model = getattr(torchvision.models, args.model)(weights=None, num_classes=10).to(where)
        devices = [0, 1] if two else [0]
        runner = BalancedDataParallel(model, device_ids=devices, ratio=DataRatio([TOTAL, 0] if two else [TOTAL], TOTAL),
                                      backend=make_backend())
        step = make_step(runner, x, y, sync)
        for _ in range(args.warmup):
            step()
        if two:  # first use of device 1
            rows["new_device"].append(_around(step, runner, DataRatio([TOTAL // 2, TOTAL // 2], TOTAL), args.steady))
        for index in range(args.reshapes):
            a = splits[(change * args.reshapes + index) % len(splits)]
            if two:
                rows["reshape"].append(_around(step, runner, DataRatio([a, TOTAL - a], TOTAL), args.steady))
            else:
                size = max(2, round(args.batch * a / TOTAL))
                resized = make_step(runner, x[:size], y[:size], sync)
                rows["reshape"].append(_around(resized, runner, runner.ratio, args.steady))
    return {kind: _summary(values) for kind, values in rows.items() if values}


def _around(step: Callable[[], float], runner: BalancedDataParallel, ratio: DataRatio,
            steady: int) -> tuple[float, float, float]:
    """(median warm step, first step, second step) under ``ratio``, changed to just before the first."""
    runner.set_ratio(ratio)
    first, second = step(), step()
    return statistics.median(step() for _ in range(steady)), first, second


def _summary(values: list[tuple[float, float, float]]) -> dict:
    first = [after - warm for warm, after, _ in values]
    second = [after - warm for warm, _, after in values]
    steps = [warm for warm, _, _ in values]
    return {
        "changes": len(values),
        "median_step_seconds": statistics.median(steps),
        "median_extra_seconds_first_step": statistics.median(first),
        "median_extra_seconds_second_step": statistics.median(second),
        "median_extra_share_of_a_step": statistics.median(e / s for e, s in zip(first, steps)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default=None, help="comma-separated of cpu, emulated, cuda "
                        "(default: cpu,emulated and cuda when available)")
    parser.add_argument("--model", default="resnet18", help="torchvision model (default resnet18)")
    parser.add_argument("--batch", type=positive_int, default=32, help="samples per batch (default 32)")
    parser.add_argument("--image", type=positive_int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--changes", type=positive_int, default=5, help="fresh wrappers, one first use each (5)")
    parser.add_argument("--reshapes", type=positive_int, default=4, help="reshape changes per wrapper (4)")
    parser.add_argument("--steady", type=positive_int, default=3, help="warm steps timed after each change (3)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="steps before the first change (3)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    devices = (args.devices or "cpu,emulated" + (",cuda" if torch.cuda.is_available() else "")).split(",")
    unknown = set(devices) - {"cpu", "emulated", "cuda"}
    if unknown or ("cuda" in devices and not torch.cuda.is_available()):
        parser.error(f"unknown or unavailable devices: {sorted(unknown) or ['cuda']}")
    if "cuda" in devices:
        torch.backends.cudnn.benchmark = True
    payload: dict = {"args": vars(args), "devices": {}}
    with scratch_namespace("changecost"):
        for device in devices:
            payload["devices"][device] = found = measure(device, args)
            for kind, row in found.items():
                print(f"{device:8} {kind:10} step {row['median_step_seconds'] * 1e3:8.1f} ms   extra first step "
                      f"{row['median_extra_seconds_first_step'] * 1e3:+8.1f} ms "
                      f"({row['median_extra_share_of_a_step']:+.2f} of a step), second step "
                      f"{row['median_extra_seconds_second_step'] * 1e3:+8.1f} ms   ({row['changes']} changes)")
    suffix = "_gpu" if "cuda" in devices else "_cpu"
    save(f"change_cost_{args.model}{suffix}", "benchmarks.change_cost", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
