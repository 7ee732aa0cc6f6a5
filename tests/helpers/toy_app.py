"""A tiny real training job for the protocol tests: BalancedDataParallel on the CPU + a Session.

Prints one JSON line per iteration: {"iteration": n, "ratio": [...], "attached": bool}.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.session import Session


def stuck_forever() -> None:
    threading.Event().wait()


class SlowFinalizer:
    """An object whose ``__del__`` takes a while (as a DataLoader iterator's, joining its workers)."""

    def __del__(self) -> None:
        print(json.dumps({"finalizing": True}), flush=True)
        time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5, help="iterations per epoch")
    parser.add_argument("--sleep", type=float, default=0.01, help="extra seconds per iteration")
    parser.add_argument("--solo", default="1.0", help="seconds, a profile name, or 'estimate' (none given)")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--decide-every", type=int, default=None)
    parser.add_argument("--exchange-timeout", type=float, default=0.5)
    parser.add_argument("--hang-after", type=int, default=None, help="sleep forever after N iterations")
    parser.add_argument("--fail-after", type=int, default=None, help="raise after N iterations")
    parser.add_argument("--extra-iterations", type=int, default=0, help="iterations past the plan")
    parser.add_argument("--stuck-thread", action="store_true",
                        help="start a non-daemon thread that never ends (the interpreter waits for it at exit)")
    parser.add_argument("--slow-finalizer-at", type=int, default=None,
                        help="at iteration N, drop an object whose __del__ prints a line and sleeps 5 s")
    args = parser.parse_args()
    if args.stuck_thread:
        threading.Thread(target=stuck_forever, name="stuck-forever").start()
    solo = float(args.solo) if args.solo.replace(".", "", 1).isdigit() else args.solo
    solo = None if solo == "estimate" else solo
    torch.manual_seed(0)
    model = BalancedDataParallel(nn.Linear(4, 2), device_ids=list(range(args.gpus)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session(model, args.app, args.epochs, args.iterations, solo, decide_every=args.decide_every,
                      exchange_timeout=args.exchange_timeout)
    print(json.dumps({"iteration": 0, "ratio": model.ratio.to_list(), "attached": session.attached}), flush=True)
    started = time.monotonic()
    with session:
        for iteration in range(1, args.epochs * args.iterations + args.extra_iterations + 1):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            time.sleep(args.sleep)
            if iteration == args.slow_finalizer_at:
                SlowFinalizer()  # dropped at once: its __del__ runs here
            session.step()
            print(json.dumps({"iteration": iteration, "ratio": model.ratio.to_list(),
                              "attached": session.attached}), flush=True)
            if args.hang_after is not None and iteration >= args.hang_after:
                time.sleep(3600)
            if args.fail_after is not None and iteration >= args.fail_after:
                raise RuntimeError("failing on purpose")
    print(json.dumps({"done": True, "elapsed": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    main()
