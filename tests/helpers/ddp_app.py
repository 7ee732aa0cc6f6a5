"""A tiny real DDP training job for the tests, started by torchrun: gloo on the CPU, a Session on every rank.

Prints one JSON line per rank and step: {"rank", "pid", "step", "batch", "ratio", "sizes", "local"},
where ``batch`` is the global batch index the sampler gave that step, ``ratio`` the DR that split
it and ``sizes`` every rank's samples in it; and {"rank", "done": true} at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from drbalance.client import BalancedBatchSampler, BalancedDistributedDataParallel, Session


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")  # one write: the ranks share torchrun's stdout
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=6, help="global batches per epoch")
    parser.add_argument("--batch", type=int, default=10, help="samples per global batch")
    parser.add_argument("--ratio", default=None, help="initial DR over the ranks, e.g. 5,5")
    parser.add_argument("--decide-every", type=int, default=None)
    parser.add_argument("--report-every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--exchange-timeout", type=float, default=2.0)
    parser.add_argument("--exchange-every", type=int, default=None, help="pin K (default: agreed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = torch.randn(args.iterations * args.batch, 4)
    target = torch.randn(args.iterations * args.batch, 2)
    ratio = [int(x) for x in args.ratio.split(",")] if args.ratio else None
    model = BalancedDistributedDataParallel(nn.Linear(4, 2), ratio=ratio, exchange_every=args.exchange_every)
    sampler = BalancedBatchSampler(len(data), args.batch, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session(model, args.app, args.epochs, len(sampler), 1.0, report_every=args.report_every,
                      decide_every=args.decide_every, exchange_timeout=args.exchange_timeout)
    say(rank=rank, pid=os.getpid(), ready=True, ratio=model.ratio.to_list())
    step = 0
    with session:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for indices in sampler:
                optimizer.zero_grad()
                functional.mse_loss(model(data[indices]), target[indices]).backward()
                optimizer.step()
                index, used, sizes = sampler.last
                step += 1
                say(rank=rank, pid=os.getpid(), step=step, batch=index, ratio=used.to_list(), sizes=list(sizes),
                    local=len(indices), counts=list(model.last_chunk_sizes))
                time.sleep(args.sleep)
                session.step()
    say(rank=rank, done=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
