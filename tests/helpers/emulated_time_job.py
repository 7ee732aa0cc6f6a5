"""A training loop on one emulated GPU, pinned to one CPU core, with (or without) a busy process
pinned to the same core: prints JSON with what the emulated backend left uncounted, what the
session's SD tracker left out, the loop's wall time (seconds) and the session's final SD.

Usage: python -m tests.helpers.emulated_time_job [options]; every option in seconds unless said:
--host: the modelled host time of an iteration (0: every host phase overruns it).
--device: the modelled device time of an iteration (default 0.01).
--burner: a busy process on the job's core.
--sleep: the loop sleeps this long after each step (a blocking wait, as for a manager's answer).
--first-step-cpu: extra CPU work in the first iteration's optimizer step (a slow first step, as
when momentum buffers are made), before that iteration ends.
--setup-cpu: CPU work after the session starts and before the first forward (the first batch,
a cost measurement).
--thread-work: CPU work per step done by a second thread of the job while the loop waits for it
(as PyTorch's intra-op threads and a data loader's workers do).
--width: the model's width (default 512: tens of milliseconds of CPU work a step beside the burner).
--gpus: emulated GPUs the batch is spread over, evenly (default 1); --overhead: DataParallel's
modelled host time per extra replica (default 0); --consolidate-at N: after iteration N the whole
batch goes on the first GPU (a DR change that shortens the modelled host time).
Also prints each iteration's time as the session's tracker counted it (but the first's).
The session's solo time is the modelled one: iterations x (host + device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.emulated import EmulatedBackend
from drbalance.client.session import Session
from drbalance.ipc.link import DetachedLink
from drbalance.workload.models import ModelCosts

BURNER = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
ITERATIONS = 16


def burn(seconds: float) -> None:
    """``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Worker:
    """A second thread of the job that does CPU work when asked, while the asking thread waits
    (blocked) for it: it lives as long as the job, as a thread pool's threads do."""

    def __init__(self) -> None:
        self._asked = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            self._asked.acquire()
            burn(self._seconds)
            self._done.release()

    def run(self, seconds: float) -> None:
        self._seconds = seconds
        self._asked.release()
        self._done.acquire()


def main() -> None:
    parser = argparse.ArgumentParser()
    for option, default in (("--host", 0.0), ("--device", 0.01), ("--sleep", 0.0), ("--first-step-cpu", 0.0),
                            ("--setup-cpu", 0.0), ("--thread-work", 0.0)):
        parser.add_argument(option, type=float, default=default)
    parser.add_argument("--overhead", type=float, default=0.0)
    parser.add_argument("--burner", action="store_true")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--consolidate-at", type=int, default=None)
    args = parser.parse_args()
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    burner = subprocess.Popen([sys.executable, "-c", BURNER, str(core)]) if args.burner else None
    worker = Worker() if args.thread_work else None
    try:
        time.sleep(0.2)  # the burner pinned and spinning
        costs = ModelCosts("emulated-time", fixed=args.device, per_sample=0.0, dp_overhead=args.overhead,
                           host_ratio=args.host / args.device)
        backend = EmulatedBackend(args.gpus, costs)
        model = BalancedDataParallel(nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                                                   nn.Linear(args.width, args.width)), backend=backend)
        started = time.monotonic()  # the session's time, and so what it leaves out, starts here
        session = Session(model, "emulated-time", epochs=1, iterations_per_epoch=ITERATIONS,
                          solo_time=ITERATIONS * (args.host + args.device), link=DetachedLink(), sd_log=False,
                          handle_sigterm=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(256, args.width)
        burn(args.setup_cpu)
        marks = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
            burn(args.first_step_cpu if iteration == 0 else 0.0)
            if worker is not None:
                worker.run(args.thread_work)
            session.step()
            marks.append(session.tracker.last_mark)
            if iteration + 1 == args.consolidate_at:
                model.set_ratio([1] + [0] * (args.gpus - 1))
            time.sleep(args.sleep)
        wall = time.monotonic() - started
        # the phase under way keeps counting between reads: the tracker's is read between two of the backend's
        before = backend.uncounted_seconds()
        tracker = session.tracker.uncounted_seconds
        after = backend.uncounted_seconds()
        print(json.dumps({"uncounted": before, "tracker": tracker, "uncounted_after": after,
                          "wall": wall,
                          "iterations": [b - a for a, b in zip(marks, marks[1:])], "device": args.device,
                          "sd": session.slowdown}))
        session.close()
        backend.close()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    main()
