"""Rank functions for tests/client/test_distributed.py, run with ``torch.multiprocessing.spawn`` over gloo on the CPU.

Each writes its findings as JSON to ``<out>/<name>-rank<r>.json``; the tests assert on them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.sampler import BalancedBatchSampler
from drbalance.ratio import DataRatio


def init(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)


def write(out: str, name: str, rank: int, data: dict) -> None:
    Path(out, f"{name}-rank{rank}.json").write_text(json.dumps(data))


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def deep_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def dataset(samples: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(samples, 6, generator=generator), torch.randint(0, 3, (samples,), generator=generator)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def gradients(rank: int, world: int, out: str) -> None:
    """Uneven DRs, a local DR change mid-epoch and an agreed one: compare with one process on the whole batch.

    K is pinned to 4: steps 0 and 4 run the control exchange, the others are counting steps (the
    counts ride in the first gradient bucket), among them the epoch's folded last batch (step 3,
    14 samples after 12), the first batch of the set_ratio change (step 3) and of the agreed one (step 5).
    """
    init(rank, world, out)
    x, y = dataset()
    model = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 7], exchange_every=4)
    reference = copy.deepcopy(small_net())
    sampler = BalancedBatchSampler(len(x), 12, model=model, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    steps, seen = [], {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen[epoch] = []
        for step, indices in enumerate(sampler):
            if epoch == 0 and step == 2:
                model.set_ratio([5, 3, 2])  # every rank alike, mid-epoch
            if epoch == 1 and step == 1:
                # rank 0's proposal wins; the others' are ignored
                model.agree_ratio(DataRatio([2, 2, 6]) if rank == 0 else DataRatio([8, 1, 1]))
            everyone = [None] * world
            dist.all_gather_object(everyone, indices)
            batch = [i for part in everyone for i in part]
            seen[epoch].extend(batch)
            optimizer.zero_grad()
            functional.cross_entropy(model(x[indices]), y[indices]).backward()
            reference_optimizer.zero_grad()
            functional.cross_entropy(reference(x[batch]), y[batch]).backward()
            index, ratio, sizes = sampler.last
            steps.append({"epoch": epoch, "step": step, "index": index, "ratio": ratio.to_list(),
                          "sizes": list(sizes), "local": len(indices), "counts": list(model.last_chunk_sizes),
                          "exchanged": model.last_step_exchanged,
                          "error": max_difference(grads(model.module), grads(reference)),
                          "scale": max(float(g.abs().max()) for g in grads(reference))})
            optimizer.step()
            reference_optimizer.step()
    parameters = max(float((p - q).detach().abs().max())
                     for p, q in zip(model.module.parameters(), reference.parameters()))
    timings = [[t.slot, t.samples, t.seconds] for t in model.last_replica_timings()]
    write(out, "gradients", rank, {"steps": steps, "seen": seen, "parameters": parameters, "timings": timings,
                                   "batches_per_epoch": len(sampler)})
    dist.destroy_process_group()


def plain_ddp(rank: int, world: int, out: str) -> None:
    """Equal shares match plain DDP bit for bit; unequal batches under plain DDP do not match the full-batch mean."""
    init(rank, world, out)
    x, y = dataset(48)
    balanced = BalancedDistributedDataParallel(small_net(), exchange_every=3)  # even; steps 1 and 2 count in-bucket
    plain = nn.parallel.DistributedDataParallel(small_net())
    sampler = BalancedBatchSampler(len(x), 12, model=balanced, shuffle=False)
    identical, exchanged = [], []
    for indices in sampler:
        for model in (balanced, plain):
            model.zero_grad()
            functional.cross_entropy(model(x[indices]), y[indices]).backward()
        identical.append(max_difference(grads(balanced.module), grads(plain.module)))
        exchanged.append(balanced.last_step_exchanged)
    # plain DDP fed uneven local batches (the wrong gradient this library exists to fix)
    sizes = [2, 3, 7][:world]
    start = sum(sizes[:rank])
    local = list(range(start, start + sizes[rank]))
    plain.zero_grad()
    functional.cross_entropy(plain(x[local]), y[local]).backward()
    reference = small_net()
    whole = list(range(sum(sizes)))
    functional.cross_entropy(reference(x[whole]), y[whole]).backward()
    write(out, "plain", rank, {"identical": identical, "exchanged": exchanged,
                               "naive_error": max_difference(grads(plain.module), grads(reference))})
    dist.destroy_process_group()


def agreement(rank: int, world: int, out: str) -> None:
    """agree_ratio when the ranks' loaders ran ahead by different amounts; mismatched ratios; no_sync."""
    init(rank, world, out)
    found: dict = {}
    try:
        BalancedDistributedDataParallel(small_net(), ratio=[7, 1, 1, 1] if rank == 2 else [1, 1, 1, 7])
    except ValueError as error:
        found["mismatch"] = str(error)
    try:  # a DR that starves a rank, given to rank 3 only: every rank raises, none waits for the others
        BalancedDistributedDataParallel(small_net(), ratio=[10, 0, 0, 0] if rank == 3 else [1, 1, 1, 7])
    except ValueError as error:
        found["starved"] = str(error)
    model = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 3, 4])
    found["uuids"] = list(model.device_uuids())
    found["labels"] = list(model.device_labels)
    sampler = BalancedBatchSampler(400, 20, model=model)
    batches = iter(sampler)
    for _ in range(2 + rank):  # rank r has produced 2 + r batches (deeper prefetch on higher ranks)
        next(batches)
    ratio, start = model.agree_ratio(DataRatio([4, 3, 2, 1]) if rank == 0 else DataRatio([1, 1, 1, 7]))
    found["agreed"] = [ratio.to_list(), start]
    used = {}
    while sampler.last[0] < start + 1:
        next(batches)
        used[sampler.last[0]] = sampler.last[1].to_list()
    found["used"] = sorted(used.items())
    found["kept"] = list(model.agree_ratio(None))[1]  # nothing proposed: no change
    # propose_ratio on every rank (only rank 0's counts); it travels with the next step's sample counts
    model.propose_ratio([2, 2, 3, 3] if rank == 0 else [1, 1, 1, 7])
    for _ in range(rank):  # every rank had produced up to batch 6; now rank r up to 6 + r
        next(batches)
    x, y = dataset(40)
    functional.cross_entropy(model(x[:3]), y[:3]).backward()
    found["proposed"] = [[r.to_list(), start] for r, start in model.take_agreed()]
    found["after_proposal"] = model.ratio.to_list()
    # gradient accumulation: two micro-batches per rank under no_sync, then a synchronising one
    sizes = [2, 4, 6, 8]
    start_at = sum(sizes[:rank])
    mine = list(range(start_at, start_at + sizes[rank]))
    halves = [mine[: len(mine) // 2], mine[len(mine) // 2:]]
    model.zero_grad()
    with model.no_sync():
        functional.cross_entropy(model(x[halves[0]]), y[halves[0]], reduction="sum").div(len(mine)).backward()
    functional.cross_entropy(model(x[halves[1]]), y[halves[1]], reduction="sum").div(len(mine)).backward()
    reference = small_net()
    whole = list(range(sum(sizes)))
    functional.cross_entropy(reference(x[whole]), y[whole]).backward()
    found["accumulated_counts"] = list(model.last_chunk_sizes)
    found["accumulated_error"] = max_difference(grads(model.module), grads(reference))
    # loss_reduction="sum": each rank's loss is a sum over its samples
    summed = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 3, 4], loss_reduction="sum")
    functional.cross_entropy(summed(x[mine]), y[mine], reduction="sum").backward()
    found["sum_error"] = max_difference(grads(summed.module), grads(reference))
    found["between"] = proposal_between_exchanges(rank)
    write(out, "agreement", rank, found)
    dist.destroy_process_group()


def proposal_between_exchanges(rank: int) -> dict:
    """K pinned to 3: rank 0 proposes at step 1 (a counting step); the exchange of step 3 carries it."""
    x, y = dataset(400)
    model = BalancedDistributedDataParallel(small_net(), ratio=[1, 2, 3, 4], exchange_every=3)
    sampler = BalancedBatchSampler(400, 20, model=model)
    batches = iter(sampler)
    steps = []
    for step in range(4):
        indices = next(batches)
        if step == 1:
            model.propose_ratio([4, 3, 2, 1] if rank == 0 else [1, 1, 1, 7])
        if step == 3:
            for _ in range(rank):  # every rank had produced batches 0-3; now rank r up to 3 + r
                next(batches)
        model.zero_grad()
        functional.cross_entropy(model(x[indices]), y[indices]).backward()
        steps.append({"exchanged": model.last_step_exchanged, "agreed": [[r.to_list(), i] for r, i in
                                                                         model.take_agreed()],
                      "ratio": model.ratio.to_list(), "plan": [model.exchange_plan.step, model.exchange_plan.interval]})
    used = {}
    while sampler.last[0] < 9:
        next(batches)
        used[sampler.last[0]] = sampler.last[1].to_list()
    return {"steps": steps, "used": sorted(used.items())}


def draw_sizes(generator: torch.Generator, world: int, low: int = 1, high: int = 6) -> list[int]:
    return torch.randint(low, high + 1, (world,), generator=generator).tolist()


def counting(rank: int, world: int, out: str) -> None:
    """Counting steps with uneven, changing counts: an agreed K, then K pinned with summed losses and an empty rank."""
    init(rank, world, out)
    count_and_compare(rank, world, out, torch.device("cpu"))


def counting_nccl(rank: int, world: int, out: str) -> None:
    """The same on NCCL, one CUDA GPU per rank (tests/client/test_distributed_cuda.py; needs 2 GPUs)."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{out}/store", rank=rank, world_size=world)
    count_and_compare(rank, world, out, torch.device("cuda", rank))


def count_and_compare(rank: int, world: int, out: str, device: torch.device) -> None:
    x, y = (t.to(device) for t in dataset(400))
    generator = torch.Generator().manual_seed(7)  # the same draws on every rank
    ids = [device.index] if device.type == "cuda" else None

    def wrap(net: nn.Module, **kwargs) -> BalancedDistributedDataParallel:
        return BalancedDistributedDataParallel(net.to(device), device_ids=ids, **kwargs)

    def one_step(model: BalancedDistributedDataParallel, sizes: list[int], reduction: str, net=small_net) -> dict:
        start = sum(sizes[:rank])
        mine = list(range(start, start + sizes[rank]))
        whole = list(range(sum(sizes)))
        model.zero_grad()
        functional.cross_entropy(model(x[mine]), y[mine], reduction=reduction).backward()
        reference = net().to(device)
        functional.cross_entropy(reference(x[whole]), y[whole]).backward()
        plan = model.exchange_plan
        return {"sizes": sizes, "counts": list(model.last_chunk_sizes), "exchanged": model.last_step_exchanged,
                "plan": [plan.step, plan.interval, plan.step_seconds, plan.cost_seconds, plan.wall_seconds],
                "error": max_difference(grads(model.module), grads(reference)),
                "scale": max(float(g.abs().max()) for g in grads(reference))}

    adaptive = wrap(small_net())  # K agreed from rank 0's measurements
    agreed = [one_step(adaptive, draw_sizes(generator, world), "mean") for _ in range(40)]
    pinned = wrap(small_net(), exchange_every=3)
    empty = [4, 0, 3][:world] if world >= 2 else [4]
    plan = [draw_sizes(generator, world), empty, draw_sizes(generator, world), draw_sizes(generator, world), empty]
    pinned_steps = [one_step(pinned, sizes, "mean") for sizes in plan]
    summed = wrap(small_net(), exchange_every=3, loss_reduction="sum")
    summed_steps = [one_step(summed, draw_sizes(generator, world), "sum") for _ in range(5)]
    # several gradient buckets (a tiny bucket cap): the first carries the counts, the middle ones wait for
    # it through combined futures, the last is awaited in the hook; gradients as views of the buckets
    deep = wrap(deep_net(), exchange_every=3, bucket_cap_mb=0.0002, gradient_as_bucket_view=True)
    deep_steps = [one_step(deep, draw_sizes(generator, world), "mean", deep_net) for _ in range(6)]
    buckets = len(deep._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    write(out, "counting", rank, {"agreed": agreed, "pinned": pinned_steps, "summed": summed_steps,
                                  "deep": deep_steps, "buckets": buckets})
    dist.destroy_process_group()


def exit_after_backward(rank: int, world: int, out: str) -> None:
    """Leave the process right after the last backward: nothing of the job's may be left to a gloo thread.

    Several buckets (callbacks on gloo threads), counting and exchange steps (K pinned to 2), uneven
    counts; then ``destroy_process_group`` and exit at once. A gloo thread that still had to take the
    GIL for one of the job's callbacks or tensors would abort the process while Python finalises.
    Where that is not guaranteed, about one such run of 3 ranks in eight aborts.
    """
    init(rank, world, out)
    x, y = dataset(40)
    model = BalancedDistributedDataParallel(deep_net(), exchange_every=2, bucket_cap_mb=0.0002)
    for step in range(3):
        sizes = [1 + (rank + step) % 3 for rank in range(world)]
        start = sum(sizes[:rank])
        mine = list(range(start, start + sizes[rank]))
        functional.cross_entropy(model(x[mine]), y[mine]).backward()
    write(out, "exit", rank, {"counts": list(model.last_chunk_sizes)})
    dist.destroy_process_group()


def profile_refused(rank: int, world: int, out: str) -> None:
    """A DDP job of two ranks started by ``drbalance profile`` (its environment): every rank's
    Session refuses it with an error that says to profile one rank; nothing is written."""
    import os

    from drbalance.client.session import Session

    init(rank, world, out)
    output = Path(out, f"measured-rank{rank}.json")
    os.environ["DRBALANCE_PROFILE_OUTPUT"] = str(output)
    model = BalancedDistributedDataParallel(small_net(), ratio=[5, 5])
    found: dict = {"refused": None}
    try:
        Session(model, "profiled-ddp", 1, 5, solo_time=1.0, sd_log=False, handle_sigterm=False)
    except ValueError as error:
        found["refused"] = str(error)
    found["written"] = output.exists()
    write(out, "profile", rank, found)


def refused_inputs(rank: int, world: int, out: str) -> None:
    """Bad input refused on every rank alike, with the ranks still in step afterwards.

    First each rank is given its own ``loss_reduction`` (rank 0 "mean", the others "sum"); then
    rank 0 alone proposes a DR that starves rank 1 to ``agree_ratio``; then a valid proposal and
    a training step, which only run if no rank was left waiting in a collective.
    """
    init(rank, world, out)
    found: dict = {}
    try:
        BalancedDistributedDataParallel(small_net(), loss_reduction="mean" if rank == 0 else "sum")
    except ValueError as error:
        found["reduction"] = str(error)
    model = BalancedDistributedDataParallel(small_net())
    try:
        model.agree_ratio(DataRatio([10, 0]) if rank == 0 else None)
    except ValueError as error:
        found["proposal"] = str(error)
    ratio, start = model.agree_ratio(DataRatio([3, 7]) if rank == 0 else None)
    found["agreed"] = [list(ratio.shares), start]
    x, y = dataset(10)
    sizes = [3, 7]
    mine = list(range(sum(sizes[:rank]), sum(sizes[:rank + 1])))
    functional.cross_entropy(model(x[mine]), y[mine]).backward()
    found["counts"] = list(model.last_chunk_sizes)
    write(out, "refused", rank, found)
    dist.destroy_process_group()


def straggler(rank: int, world: int, out: str) -> None:
    """Rank 1 starts every step 20 ms late (slow data loading): rank 0's exchange latency includes
    that wait. Every exchange plan (K and what it came from) is recorded after each step."""
    import time

    init(rank, world, out)
    model = BalancedDistributedDataParallel(small_net())
    x, y = dataset(8)
    plans = []
    for _ in range(60):
        if rank == 1:
            time.sleep(0.02)
        mine = list(range(4 * rank, 4 * rank + 4))
        functional.cross_entropy(model(x[mine]), y[mine]).backward()
        plan = model.exchange_plan
        plans.append([plan.step, plan.interval, plan.step_seconds, plan.cost_seconds, plan.wall_seconds])
    write(out, "straggler", rank, {"plans": plans})
    dist.destroy_process_group()
