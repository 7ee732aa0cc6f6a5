"""A BalancedDataParallel job on 2 emulated GPUs whose chunks each hold their GPU for SECONDS of
device time; prints 'started' before its first forward. For tests of how it stops mid-chunk.

Usage: python -m tests.helpers.emu_long_chunk SECONDS
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.emulated import EmulatedBackend
from drbalance.workload.models import ModelCosts


def main() -> None:
    costs = ModelCosts("long", fixed=float(sys.argv[1]), per_sample=0.0, dp_overhead=0.0, host_ratio=0.0)
    model = BalancedDataParallel(nn.Linear(3, 2), backend=EmulatedBackend(2, costs))
    print("started", flush=True)
    model(torch.randn(4, 3)).sum().backward()
    print("done", flush=True)


if __name__ == "__main__":
    main()
