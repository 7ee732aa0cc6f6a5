"""A training loop on one emulated GPU, pinned to one CPU core, with (or without) a busy process
pinned to the same core: prints JSON with what the emulated backend left uncounted, what the
session's SD tracker left out, the thread's runnable time and the loop's wall time (seconds).

Usage: python -m tests.helpers.runnable_job HOST_SECONDS BURNER(0|1) SLEEP_SECONDS [FIRST_STEP_CPU [WIDTH]]
HOST_SECONDS: the modelled host time of an iteration (0: every host phase overruns it).
SLEEP_SECONDS: the loop sleeps this long after each step (a blocking wait, as for a manager's answer).
FIRST_STEP_CPU: seconds of extra CPU work in the first iteration's optimizer step (a slow first
step, as when momentum buffers are made), before that iteration ends.
WIDTH: the model's width (default 512: tens of milliseconds of CPU work a step beside the burner).
Also prints each iteration's time as the session's tracker counted it (but the first's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.emulated import EmulatedBackend
from drbalance.client.session import Session
from drbalance.emu.runnable import thread_runnable_seconds
from drbalance.ipc.link import DetachedLink
from drbalance.workload.models import ModelCosts

BURNER = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
ITERATIONS = 16


def main() -> None:
    host_seconds, with_burner, sleep = float(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])
    first_step_cpu = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    width = int(sys.argv[5]) if len(sys.argv) > 5 else 512
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    burner = subprocess.Popen([sys.executable, "-c", BURNER, str(core)]) if with_burner else None
    try:
        time.sleep(0.2)  # the burner pinned and spinning
        device = 0.01  # seconds of modelled device time per iteration (one chunk, fixed)
        costs = ModelCosts("runnable", fixed=device, per_sample=0.0, dp_overhead=0.0, host_ratio=host_seconds / device)
        backend = EmulatedBackend(1, costs)
        model = BalancedDataParallel(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)),
                                     backend=backend)
        session = Session(model, "runnable", epochs=1, iterations_per_epoch=ITERATIONS, solo_time=1.0,
                          link=DetachedLink(), sd_log=False, handle_sigterm=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(256, width)
        runnable, started = thread_runnable_seconds(), time.monotonic()
        marks = []
        for iteration in range(ITERATIONS):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
            end = time.thread_time() + (first_step_cpu if iteration == 0 else 0.0)
            while time.thread_time() < end:
                pass
            session.step()
            marks.append(session.tracker.last_mark)
            time.sleep(sleep)
        wall = time.monotonic() - started
        # the phase under way keeps counting between reads: the tracker's is read between two of the backend's
        before = backend.uncounted_seconds()
        tracker = session.tracker.uncounted_seconds
        after = backend.uncounted_seconds()
        print(json.dumps({"uncounted": before, "tracker": tracker, "uncounted_after": after,
                          "runnable": thread_runnable_seconds() - runnable, "wall": wall,
                          "iterations": [b - a for a, b in zip(marks, marks[1:])], "device": device}))
        session.close()
        backend.close()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    main()
