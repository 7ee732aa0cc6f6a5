"""Wrapper overhead of BalancedDataParallel, measured side by side in one process.

- CPU path: BalancedDataParallel over 4 CPU slots vs the bare module running the very same
  chunks (split, forward each, concatenate) — forward + backward. Target: <= 5% overhead. The
  wrapper's cost includes merging batch-norm buffers once per step (ResNet-18 has 20 batch-norm
  layers); ``balanced_train_step`` is the same step through ``model.train_step(closure)`` (the
  out-of-memory protection; with a proven DR it only checks and calls).
- GPU: BalancedDataParallel vs ``nn.DataParallel`` at an equal split over the same GPUs.
  Target: <= 2% overhead. Needs CUDA; reported as not measured otherwise.

Usage: python -m benchmarks.bench_parallel [--repeats 30] [--model resnet18] [--batch 32]
Medians over interleaved repeats, printed as ratios; results in benchmarks/results/.
"""

from __future__ import annotations

import argparse

import torch
import torchvision
from torch import nn

from benchmarks.timing import add_no_write, interleaved_medians, save, summary
from drbalance import DataRatio
from drbalance.argtypes import positive_int
from drbalance.client import BalancedDataParallel, CudaBackend
from drbalance.client.buffers import BufferMerge, tracked_buffers


def build(model_name: str) -> nn.Module:
    if model_name == "mlp":
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    return getattr(torchvision.models, model_name)(weights=None, num_classes=10)


def make_batch(model_name: str, batch: int, image: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (batch, 256) if model_name == "mlp" else (batch, 3, image, image)
    return torch.randn(*shape, device=device), torch.randint(0, 10, (batch,), device=device)


def train_step(runner: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(runner(x), y)
    loss.backward()


def bench_cpu(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = build(args.model)
    x, y = make_batch(args.model, args.batch, args.image, "cpu")
    ratio = DataRatio([1, 2, 3, 4])
    sizes = list(ratio.split(args.batch))
    wrapped = BalancedDataParallel(model, device_ids=[0, 1, 2, 3], ratio=ratio)

    def bare_same_chunks() -> None:
        out = torch.cat([model(chunk) for chunk in torch.split(x, sizes)])
        nn.functional.cross_entropy(out, y).backward()

    def guarded() -> None:
        wrapped.train_step(lambda: train_step(wrapped, x, y))

    samples = interleaved_medians(
        {"bare_same_chunks": bare_same_chunks, "balanced": lambda: train_step(wrapped, x, y),
         "balanced_train_step": guarded},
        repeats=args.repeats,
    )
    result = _ratios(samples, baseline="bare_same_chunks", candidate="balanced")
    guarded_ratio = result["seconds"]["balanced_train_step"]["median"] / result["seconds"]["bare_same_chunks"]["median"]
    result["train_step_median_ratio"] = guarded_ratio
    return result


def fixed_costs(args: argparse.Namespace, repeats: int = 200) -> dict:
    """Microseconds of the wrapper's two fixed per-step costs, measured alone (less noisy than a
    whole step on a busy machine): merging the buffers of a 4-chunk training forward (each chunk
    given copies of the buffers, as the CPU and emulated paths do, beside the
    bare merge of values), and a ``train_step`` call with a proven DR (a closure that does nothing)."""
    model = build(args.model)
    model.train()

    def merge() -> None:  # the sequential path (CPU, emulated GPUs): each chunk on copies of the buffers
        state = BufferMerge.for_forward(model, 4)
        if state is None:
            return
        for _ in range(4):
            state.install_copies()
            state.add_module_values(0.25)
        state.put_back()
        state.finish()

    def merge_values_only() -> None:  # the floor: each chunk's values added and merged, no copies, no slots
        buffers = tracked_buffers(model)
        state = BufferMerge(buffers) if buffers else None
        if state is None:
            return
        for _ in range(4):
            state.add(state.floats, state.others, 0.25)
        state.finish()

    wrapped = BalancedDataParallel(nn.Linear(2, 2), device_ids=[0, 1, 2, 3], ratio=[1, 2, 3, 4])
    wrapped(torch.randn(8, 2)).sum().backward()
    wrapped.train_step(lambda: None)  # the DR is proven now
    samples = interleaved_medians({"buffer_merge": merge, "buffer_merge_values_only": merge_values_only,
                                   "train_step_call": lambda: wrapped.train_step(lambda: None)}, repeats=repeats)
    return {name: summary(values)["median"] * 1e6 for name, values in samples.items()}


def bench_gpu(args: argparse.Namespace) -> dict:
    devices = list(range(torch.cuda.device_count()))
    torch.manual_seed(0)
    model = build(args.model).cuda(devices[0])
    x, y = make_batch(args.model, args.batch, args.image, f"cuda:{devices[0]}")
    data_parallel = nn.DataParallel(model, device_ids=devices)
    even = DataRatio([1] * len(devices), len(devices))
    wrapped = BalancedDataParallel(model, device_ids=devices, ratio=even)
    forward_timed = BalancedDataParallel(model, device_ids=devices, ratio=even,
                                         backend=CudaBackend(time_backward=False))
    every_step = BalancedDataParallel(model, device_ids=devices, ratio=even, backend=CudaBackend(backward_every=1))

    def synced(runner: nn.Module):
        def run() -> None:
            train_step(runner, x, y)
            torch.cuda.synchronize()

        return run

    samples = interleaved_medians(
        {"data_parallel": synced(data_parallel), "balanced": synced(wrapped),
         "balanced_forward_timed_only": synced(forward_timed),
         "balanced_backward_timed_every_step": synced(every_step)},
        repeats=args.repeats,
    )
    result = _ratios(samples, baseline="data_parallel", candidate="balanced")
    result["gpus"] = len(devices)
    # the cost of timing each replica's backward (an output hook, an end-of-backward callback and two events per replica
    # on a timed step; the default times one step in 8)
    for variant in ("forward_timed_only", "backward_timed_every_step"):
        result[f"{variant}_median_ratio"] = (
            result["seconds"][f"balanced_{variant}"]["median"] / result["seconds"]["data_parallel"]["median"])
    return result


def _ratios(samples: dict[str, list[float]], baseline: str, candidate: str) -> dict:
    stats = {name: summary(values) for name, values in samples.items()}
    ratio = stats[candidate]["median"] / stats[baseline]["median"]
    return {"seconds": stats, "median_ratio": ratio, "overhead_percent": 100 * (ratio - 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="torchvision model name, or 'mlp' (default resnet18)")
    parser.add_argument("--batch", type=positive_int, default=32, help="samples per batch (default 32)")
    parser.add_argument("--image", type=positive_int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed repeats per candidate (default 30)")
    parser.add_argument("--fixed-costs-only", action="store_true",
                        help="measure only the per-step fixed costs (buffer merge, train_step call), not whole steps")
    parser.add_argument("--gpu-only", action="store_true",
                        help="measure only the GPU comparison (skips the CPU path, which is slow for big models)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.gpu_only:
        return _gpu_only(args, argv)
    costs = fixed_costs(args)
    print(f"fixed costs ({args.model}): buffer merge of a 4-chunk forward {costs['buffer_merge']:.1f} us "
          f"({costs['buffer_merge_values_only']:.1f} us merging the values alone), "
          f"train_step call {costs['train_step_call']:.2f} us (medians)")
    if args.fixed_costs_only:
        return 0
    payload: dict = {"args": vars(args), "cpu_path": bench_cpu(args), "fixed_costs_us": costs}
    print(f"CPU path ({args.model}, batch {args.batch}): BalancedDataParallel / bare module on the same chunks "
          f"= {payload['cpu_path']['median_ratio']:.4f} (overhead {payload['cpu_path']['overhead_percent']:+.2f}%, "
          f"target <= 5%); through train_step: {payload['cpu_path']['train_step_median_ratio']:.4f}")
    if torch.cuda.is_available():
        payload["gpu"] = bench_gpu(args)
        _print_gpu(payload["gpu"])
    else:
        payload["gpu"] = "not measured: CUDA is not available on this machine"
        print("GPU: not measured (CUDA is not available on this machine)")
    name = f"parallel_overhead_{args.model}" + ("_gpu" if torch.cuda.is_available() else "_cpu")
    save(name, "benchmarks.bench_parallel", argv, payload, args.no_write)
    return 0


def _print_gpu(gpu: dict) -> None:
    print(f"GPU ({gpu['gpus']} GPU(s)): BalancedDataParallel / nn.DataParallel = {gpu['median_ratio']:.4f} "
          f"(overhead {gpu['overhead_percent']:+.2f}%, target <= 2%); with the forward alone timed: "
          f"{gpu['forward_timed_only_median_ratio']:.4f}; with the backward timed on every step: "
          f"{gpu['backward_timed_every_step_median_ratio']:.4f}")


def _gpu_only(args: argparse.Namespace, argv: list[str] | None) -> int:
    if not torch.cuda.is_available():
        print("GPU: not measured (CUDA is not available on this machine)")
        return 2
    payload = {"args": vars(args), "gpu": bench_gpu(args)}
    _print_gpu(payload["gpu"])
    save(f"parallel_overhead_{args.model}_gpu", "benchmarks.bench_parallel", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
