"""What tests/helpers/lightning_job.py and accelerate_job.py share: options, data, what a rank records and writes.

Both train ``nn.Linear(4, 2)`` with an MSE loss on ``TensorDataset(ids, x, y)`` (``x``, ``y`` drawn
with seed 0), so a test can recompute every step's gradient in one process
(tests/helpers/integration_checks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def flat(tensors) -> list[float]:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


def parser_with_common_options(default_app: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--app", default=default_app)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch", type=int, default=5, help="the loader's batch size (per rank, as for plain DDP)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume-epochs", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--ratio", default=None)
    parser.add_argument("--exchange-every", type=int, default=None)
    parser.add_argument("--decide-every", type=int, default=None)
    parser.add_argument("--report-every", type=int, default=5)
    parser.add_argument("--exchange-timeout", type=float, default=0.5)
    parser.add_argument("--sleep", type=float, default=0.0)
    return parser


def balance_options(args: argparse.Namespace) -> dict:
    """The keyword arguments both integrations take for the job's model and session."""
    return {"app": args.app, "ratio": [int(x) for x in args.ratio.split(",")] if args.ratio else None,
            "exchange_every": args.exchange_every,
            "session_options": {"report_every": args.report_every, "decide_every": args.decide_every,
                                "exchange_timeout": args.exchange_timeout}}


def dataset(args: argparse.Namespace) -> TensorDataset:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 4, generator=generator)
    y = torch.randn(args.samples, 2, generator=generator)
    return TensorDataset(torch.arange(args.samples), x, y)


def step_record(epoch: int, ids: list[int], model: torch.nn.Module, counted: object, rank: int, done: int) -> dict:
    """What an optimizer step used (``counted``: the DDP model, whose ``last_chunk_sizes`` drbalance's has),
    after saying ``{"rank", "pid", "step"}`` on stdout (the kill test reads it)."""
    counts = getattr(counted, "last_chunk_sizes", None)
    sys.stdout.write(json.dumps({"rank": rank, "pid": os.getpid(), "step": done + 1}) + "\n")
    sys.stdout.flush()
    return {"epoch": epoch, "ids": ids, "counts": None if counts is None else list(counts),
            "params": flat(model.parameters()), "grads": flat(p.grad for p in model.parameters())}


def write_findings(args: argparse.Namespace, found: dict, data: TensorDataset) -> None:
    """This rank's findings and the data, as ``<out>/rank<r>.json``."""
    found["data"] = {"x": data.tensors[1].tolist(), "y": data.tensors[2].tolist()}
    Path(args.out, f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(found))
