"""What a CUDA chunk time covers: ``last_replica_timings`` against the step's own device time.

The manager's predictor reads a replica's chunk time as the GPU work of its chunk for one
iteration, forward and backward (docs/policy.md). On ``cuda:0`` with ``device_ids=[0]`` this
times each training step of a torchvision model with CUDA events of its own (the forward
alone, and the forward through the end of the backward) and reads the wrapper's chunk time
of the same step: with the backward timed on every step, on one step in 8 (the default; the
others scale their forward by the measured share), and not at all (the forward alone).
Reported: medians over the steps and the ratios
``chunk / (forward + backward)`` and ``chunk / forward``.

Usage: python -m benchmarks.cuda_chunk_time [--model resnet50] [--batch 64] [--steps 40]
Needs CUDA; results in benchmarks/results/cuda_chunk_time_<model>.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torchvision
from torch import nn

from benchmarks.timing import add_no_write, save
from drbalance.argtypes import positive_int
from drbalance.client import BalancedDataParallel, CudaBackend


def measure(model_name: str, batch: int, image: int, steps: int, backend: CudaBackend) -> dict[str, float]:
    """Medians (seconds) over ``steps`` training steps on cuda:0, after three warm-up steps."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).cuda()
    wrapped = BalancedDataParallel(model, device_ids=[0], ratio=[10], backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, image, image, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    rows: dict[str, list[float]] = {"forward": [], "forward_backward": [], "chunk": []}
    for step in range(steps + 3):
        start, forward_end, backward_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = wrapped(x)
        forward_end.record()
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        backward_end.record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        chunk = wrapped.last_replica_timings()[0].seconds
        if step >= 3:
            rows["forward"].append(start.elapsed_time(forward_end) / 1000.0)
            rows["forward_backward"].append(start.elapsed_time(backward_end) / 1000.0)
            rows["chunk"].append(chunk)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    medians["chunk_over_forward_backward"] = statistics.median(
        c / fb for c, fb in zip(rows["chunk"], rows["forward_backward"]))
    medians["chunk_over_forward"] = statistics.median(c / f for c, f in zip(rows["chunk"], rows["forward"]))
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="torchvision model name (default resnet50)")
    parser.add_argument("--batch", type=positive_int, default=64, help="samples per step (default 64)")
    parser.add_argument("--image", type=positive_int, default=224, help="image side in pixels (default 224)")
    parser.add_argument("--steps", type=positive_int, default=40, help="timed steps per variant (default 40)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    payload: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name(0)}
    variants = {
        "backward_timed_every_step": CudaBackend(backward_every=1),
        "backward_timed_every_8th_step_default": CudaBackend(),
        "forward_only_timed": CudaBackend(time_backward=False),
    }
    for label, backend in variants.items():
        payload[label] = result = measure(args.model, args.batch, args.image, args.steps, backend)
        print(f"{label}: chunk {result['chunk'] * 1e3:.2f} ms; the step's forward {result['forward'] * 1e3:.2f} ms, "
              f"forward + backward {result['forward_backward'] * 1e3:.2f} ms; chunk / (forward + backward) "
              f"{result['chunk_over_forward_backward']:.3f}, chunk / forward {result['chunk_over_forward']:.3f}")
    save(f"cuda_chunk_time_{args.model}", "benchmarks.cuda_chunk_time", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
