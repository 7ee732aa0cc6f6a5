"""Per-step overhead of BalancedDistributedDataParallel against plain DDP with equal shares.

Ranks are spawned processes (gloo on the CPU; NCCL on CUDA GPUs when there are enough) that
train side by side, interleaved step by step (A B C A B C ...), each candidate on its own copy of
the model and the same sequence of local batches (8 global batches in turn, this rank's 1/W of
each, which is what the sampler gives with equal shares), so every candidate keeps the same
weights and none computes on numerically different data:

- ``plain``: ``torch.nn.parallel.DistributedDataParallel``.
- ``balanced``: ``BalancedDistributedDataParallel`` with equal shares on the same slices
  (the weighting hook, the counts riding in the first gradient bucket, the control exchange
  every K steps with K agreed as in a real job; bit-identical gradients on 2 ranks).
- ``balanced_session``: the same, fed by ``BalancedBatchSampler`` and with a ``Session`` on every
  rank (no manager; a manager's DR would ride on the same control exchange).
- ``python_hook`` (with ``--hook-floor``): plain DDP with the smallest Python communication hook
  (scale the bucket, all-reduce it through the process group, wait): what any Python hook costs
  against DDP's built-in C++ one, the floor under ``balanced``.

One step = zero_grad, forward, cross-entropy, backward, optimizer step. The order of the three
rotates every round (the same on every rank), so none always runs right after another. Target:
<= 2% overhead. Reported: the ratio of medians, and the median of the per-round ratios (each
candidate's step over plain DDP's step of the same round: drift of the machine's load cancels).
Also: the sampler and ``Session.step()`` alone (no model), per step, and the K the balanced
models agreed. Figures are rank 0's; results in benchmarks/results/ddp_overhead_*.json.

Usage: python -m benchmarks.bench_ddp [--model resnet18] [--batch 32] [--ranks 2] [--repeats 30] [--hook-floor]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.bench_parallel import build, make_batch
from benchmarks.timing import add_no_write, percentile, save, summary
from drbalance.argtypes import non_negative_int, positive_int


def smallest_python_hook(scale: float, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by 1/W and all-reduce it through the process group (plain DDP's maths, in Python)."""
    buffer = bucket.buffer()
    buffer.mul_(scale)
    dist.distributed_c10d._get_default_group().allreduce([buffer]).wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks a hook's annotations against the real objects; this module's are strings (PEP 563).
smallest_python_hook.__annotations__ = {
    "scale": float, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def rank_main(rank: int, args: argparse.Namespace, folder: str, cuda: bool) -> None:
    os.environ.update({"DRBALANCE_NO_MANAGER": "1", "DRBALANCE_LOG_DIR": folder})
    torch.set_num_threads(args.threads)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=args.ranks)
    from drbalance.client import BalancedBatchSampler, BalancedDistributedDataParallel, Session

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ids = [rank] if cuda else None
    torch.manual_seed(0)
    x, y = make_batch(args.model, args.batch * 8, args.image, str(device))
    local = args.batch // args.ranks
    # this rank's slice of global batch k, as the sampler gives it with equal shares and no shuffle:
    # every candidate trains on the same sequence of batches, so all keep the same weights (their
    # gradients are bit-identical on 2 ranks) and none runs on numerically different data
    slices = [list(range(k * args.batch + rank * local, k * args.batch + (rank + 1) * local)) for k in range(8)]
    turns = {"plain": 0, "balanced": 0, "python_hook": 0}

    def fixed_slice(name: str, model: nn.Module) -> None:
        indices = slices[turns[name] % len(slices)]
        turns[name] += 1
        step(name, model, x[indices], y[indices])

    def copy() -> nn.Module:
        torch.manual_seed(0)
        return build(args.model).to(device)

    plain = nn.parallel.DistributedDataParallel(copy(), device_ids=ids)
    balanced = BalancedDistributedDataParallel(copy(), device_ids=ids)
    managed = BalancedDistributedDataParallel(copy(), device_ids=ids)
    sampler = BalancedBatchSampler(args.batch * 8, args.batch, model=managed, shuffle=False)
    session = Session(managed, "bench-ddp", 10**6, len(sampler), 1.0, sd_log=False, handle_sigterm=False)
    models = {"plain": plain, "balanced": balanced, "balanced_session": managed}
    if args.hook_floor:
        models["python_hook"] = nn.parallel.DistributedDataParallel(copy(), device_ids=ids)
        models["python_hook"].register_comm_hook(1.0 / args.ranks, smallest_python_hook)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, model in models.items()}
    batches = iter(())

    def step(name: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        optimizer = optimizers[name]
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def with_session() -> None:
        nonlocal batches
        indices = next(batches, None)
        if indices is None:
            batches = iter(sampler)
            indices = next(batches)
        step("balanced_session", managed, x[indices], y[indices])
        session.step()

    candidates = {
        "plain": lambda: fixed_slice("plain", plain),
        "balanced": lambda: fixed_slice("balanced", balanced),
        "balanced_session": with_session,
    }
    if args.hook_floor:
        candidates["python_hook"] = lambda: fixed_slice("python_hook", models["python_hook"])
    samples = rotating_rounds(candidates, repeats=args.repeats, warmup=args.warmup)
    samples["exchange_interval"] = [float(model.exchange_plan.interval) for model in (balanced, managed)]
    samples["sampler_session_alone"] = [sampler_and_session_seconds(sampler, session)]
    session.close()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(samples))
    dist.destroy_process_group()


def rotating_rounds(candidates: Mapping[str, Callable[[], object]], repeats: int,
                    warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each candidate; round i runs them in the order rotated by i (all ranks alike)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - started)
    return samples


def sampler_and_session_seconds(sampler, session, steps: int = 2000) -> float:
    """Seconds per step of taking this rank's next batch and ``session.step()``, without a model."""
    batches = iter(sampler)
    started = time.perf_counter()
    for _ in range(steps):
        if next(batches, None) is None:
            batches = iter(sampler)
            next(batches)
        session.step()
    return (time.perf_counter() - started) / steps


def ratios(samples: dict[str, list[float]]) -> dict:
    samples = dict(samples)
    alone = samples.pop("sampler_session_alone", None)
    intervals = samples.pop("exchange_interval", None)
    stats = {name: summary(values) for name, values in samples.items()}
    base = stats["plain"]["median"]
    candidates = tuple(name for name in ("balanced", "balanced_session", "python_hook") if name in samples)
    per_round = {name: [c / p for c, p in zip(samples[name], samples["plain"])] for name in candidates}
    paired = {name: statistics.median(values) for name, values in per_round.items()}
    spread = {name: [percentile(values, 0.25), percentile(values, 0.75)] for name, values in per_round.items()}
    return {
        "seconds": stats,
        "median_ratio": {name: stats[name]["median"] / base for name in candidates},
        "overhead_percent": {name: 100 * (stats[name]["median"] / base - 1) for name in candidates},
        "paired_median_ratio": paired,
        "paired_overhead_percent": {name: 100 * (paired[name] - 1) for name in candidates},
        "paired_ratio_quartiles": spread,
        "agreed_exchange_interval": None if intervals is None else dict(zip(candidates[:2], map(int, intervals))),
        "sampler_session_alone_us": None if alone is None else alone[0] * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="torchvision model name, or 'mlp' (default resnet18)")
    parser.add_argument("--batch", type=positive_int, default=32, help="samples per global batch (default 32)")
    parser.add_argument("--image", type=positive_int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--ranks", type=positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per rank (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed steps per candidate (default 30)")
    parser.add_argument("--warmup", type=non_negative_int, default=5,
                        help="untimed steps per candidate first (default 5)")
    parser.add_argument("--hook-floor", action="store_true",
                        help="also time plain DDP with the smallest Python comm hook (what any such hook costs)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    if args.batch % args.ranks:
        parser.error(f"--batch {args.batch} must be a multiple of --ranks {args.ranks} (equal shares)")
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks
    with tempfile.TemporaryDirectory(prefix="drbalance-bench-ddp-") as folder:
        mp.spawn(rank_main, args=(args, folder, cuda), nprocs=args.ranks, join=True)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    result = ratios(per_rank[0])
    payload = {"args": vars(args), "backend": "nccl" if cuda else "gloo (CPU)", "rank0": result,
               "other_ranks_median_ratio": [ratios(s)["median_ratio"] for s in per_rank[1:]]}
    where = f"{args.ranks} ranks, {'NCCL on CUDA' if cuda else 'gloo on the CPU'}"
    plain = result["seconds"]["plain"]["median"]
    print(f"{args.model}, global batch {args.batch}, {where}: plain DDP median step {plain * 1000:.2f} ms")
    for name in result["median_ratio"]:
        print(f"  {name} / plain = {result['median_ratio'][name]:.4f} "
              f"(overhead {result['overhead_percent'][name]:+.2f}%, target <= 2%); median of per-round ratios "
              f"{result['paired_median_ratio'][name]:.4f} ({result['paired_overhead_percent'][name]:+.2f}%, quartiles "
              f"{result['paired_ratio_quartiles'][name][0]:.3f}-{result['paired_ratio_quartiles'][name][1]:.3f})")
    print(f"  agreed K (steps between control exchanges): {result['agreed_exchange_interval']}")
    print(f"  sampler + Session.step() alone: {result['sampler_session_alone_us']:.1f} us per step")
    suffix = "gpu" if cuda else "cpu"
    save(f"ddp_overhead_{args.model}_{suffix}", "benchmarks.bench_ddp", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
