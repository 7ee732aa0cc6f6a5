"""Where a training step's host time goes: ``BalancedDataParallel`` beside ``nn.DataParallel``,
each under cProfile, on one device (CUDA when there is one, else the CPU path).

The GPU comparison of ``benchmarks/bench_parallel.py`` gives the wrapper's overhead as a ratio;
this says which of the wrapper's Python functions make it (cumulative and own seconds per step,
the top rows of each). Usage:

    python -m benchmarks.profile_wrapper [--model resnet18] [--batch 32] [--image 64] [--steps 300] [--top 25]

Prints the tables; nothing is written (record results in docs/gpu-results.md with the command).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch import nn

from benchmarks.bench_parallel import build, make_batch
from drbalance.argtypes import positive_int
from drbalance.client import BalancedDataParallel


def profile_steps(runner: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, top: int) -> tuple[float, str]:
    """Seconds per step (wall, unprofiled, median-free mean over ``steps``) and the profile's top rows."""
    def step() -> None:
        nn.functional.cross_entropy(runner(x), y).backward()
        if x.is_cuda:
            torch.cuda.synchronize()

    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - started) / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("drbalance", top)
    return seconds, out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="torchvision model name, or 'mlp' (default resnet18)")
    parser.add_argument("--batch", type=positive_int, default=32, help="samples per step (default 32)")
    parser.add_argument("--image", type=positive_int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--steps", type=positive_int, default=300, help="steps timed, then profiled (default 300)")
    parser.add_argument("--top", type=positive_int, default=25, help="rows of each table (default 25)")
    args = parser.parse_args(argv)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build(args.model).to(device)
    x, y = make_batch(args.model, args.batch, args.image, device)
    runners = {"nn.DataParallel": nn.DataParallel(model, device_ids=[0]) if device != "cpu" else model,
               "BalancedDataParallel": BalancedDataParallel(model, device_ids=[0], ratio=[10])}
    for name, runner in runners.items():
        seconds, table = profile_steps(runner, x, y, args.steps, args.top)
        print(f"===== {name} on {device}: {seconds * 1e3:.3f} ms per step (unprofiled mean over {args.steps})")
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
