"""A small real DDP job spanning nodes for the tests, started by one torchrun agent per "node":
gloo on the CPU, a Session on every rank, each step's gradient compared with one process's.

Prints JSON lines: at the start {"rank", "pid", "node", "leader", "app"}, where ``node`` is the
node's name as the job knows it and ``app`` the app this rank's session is to its node's manager;
then one per rank and step: {"rank", "node", "step", "batch", "ratio": [shares, total], "sizes",
"counts", "split", "error", "scale"}, where ``split`` holds the node shares and every node's local
DR in force when the sampler made the batch (``nodes``: their names), ``error`` the largest
difference of the gradient from the gradient of the mean loss over the whole global batch; and
{"rank", "done": true} at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client import BalancedBatchSampler, BalancedDistributedDataParallel, Session

PAUSE_LIMIT = 120.0  # seconds a rank waits for the pause file at most (then goes on)


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")  # one write: the ranks share their agent's stdout
    sys.stdout.flush()


class SlowerPerSample(nn.Module):
    """``net`` that sleeps ``delay`` seconds per sample of each forward: a slower device."""

    def __init__(self, net: nn.Module, delay: float) -> None:
        super().__init__()
        self.net = net
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay * x.shape[0])
        return self.net(x)


def split_of(model: BalancedDistributedDataParallel) -> dict:
    split = model.node_split
    return {"shares": split.node_shares.to_list(), "total": split.node_shares.total,
            "locals": [[local.to_list(), local.total] for local in split.locals],
            "nodes": list(model.node_layout.names)}


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + PAUSE_LIMIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=6, help="global batches per epoch")
    parser.add_argument("--batch", type=int, default=16, help="samples per global batch")
    parser.add_argument("--ratio", default=None, help="initial DR over the job's ranks, e.g. 1,3,2,6")
    parser.add_argument("--decide-every", type=int, default=None)
    parser.add_argument("--report-every", type=int, default=5)
    parser.add_argument("--exchange-timeout", type=float, default=2.0)
    parser.add_argument("--exchange-every", type=int, default=None, help="pin K (default: agreed)")
    parser.add_argument("--balance-nodes", choices=("on", "off"), default="on")
    parser.add_argument("--slow-node", default="", help="the node name whose ranks sleep per sample")
    parser.add_argument("--sleep-per-sample", type=float, default=0.0)
    parser.add_argument("--pause-at", type=int, default=None, help="every rank waits at this step's start ...")
    parser.add_argument("--pause-file", type=Path, default=None, help="... until this file exists")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    samples = args.iterations * args.batch
    data, target = torch.randn(samples, 4), torch.randn(samples, 2)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(net)
    node_name = os.environ.get("SLURMD_NODENAME", "")
    slow = SlowerPerSample(net, args.sleep_per_sample if node_name == args.slow_node else 0.0)
    ratio = [int(x) for x in args.ratio.split(",")] if args.ratio else None
    model = BalancedDistributedDataParallel(slow, ratio=ratio, exchange_every=args.exchange_every,
                                            balance_nodes=args.balance_nodes == "on")
    sampler = BalancedBatchSampler(samples, args.batch, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    session = Session(model, args.app, args.epochs, len(sampler), 1.0, report_every=args.report_every,
                      decide_every=args.decide_every, exchange_timeout=args.exchange_timeout)
    node = model.node_layout.names[model.node_layout.node_of[rank]]
    say(rank=rank, pid=os.getpid(), node=node, leader=session.job.leader, app=session.app)
    step = 0
    with session:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for indices in sampler:
                split = split_of(model)  # in force when the sampler made this batch: the one that split it
                if step == args.pause_at and args.pause_file is not None:
                    wait_for_file(args.pause_file)
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, indices)
                whole = [i for part in everyone for i in part]
                optimizer.zero_grad()
                functional.mse_loss(model(data[indices]), target[indices]).backward()
                reference_optimizer.zero_grad()
                functional.mse_loss(reference(data[whole]), target[whole]).backward()
                mine = [p.grad for p in net.parameters()]
                theirs = [p.grad for p in reference.parameters()]
                error = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
                optimizer.step()
                reference_optimizer.step()
                index, used, sizes = sampler.last
                say(rank=rank, node=node, step=step, batch=index, ratio=[used.to_list(), used.total],
                    sizes=list(sizes), counts=list(model.last_chunk_sizes), split=split, error=error,
                    scale=max(float(g.abs().max()) for g in theirs))
                step += 1
                session.step()
    say(rank=rank, done=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
