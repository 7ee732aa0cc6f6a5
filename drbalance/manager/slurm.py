"""Where Slurm should start the next job: a node's manager publishes the node's ``Weight``.

Slurm allocates nodes of lower ``Weight`` first. A manager started with ``--slurm-weight`` sets
its node's weight, every ``period`` seconds when it changed, to 100 times the slow-down a new
one-GPU job would have on this node (``new_job_slowdown``), so Slurm starts new jobs where they
will be slowed least. The command it runs is ``scontrol update NodeName=<node> Weight=<w>``
(``SLURM_CONF`` as in its environment); each run is logged with its result, and a failure
(``scontrol`` missing, not allowed) is a fault of the task, logged once, not a stop.

The model: on GPU g the live jobs hold a load L_g, the sum of their DR shares there (a job whole
on g counts 1). A new job alone on its GPU runs as alone (SD 1); beside a load L it gets its turn
among L + 1 jobs, at the co-location capacity c (kernels of co-located jobs overlap: the
emulated GPUs' and the simulator's fitted 1.216), so its SD is (L + 1) / c. The new job goes to
the GPU where that is least; the node's SD is that minimum.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from drbalance.policy.base import AppView
from drbalance.workload.models import CO_LOCATION_CAPACITY

WEIGHT_PER_SD = 100
"""A node's weight is this many times the predicted SD (SD 1.00 -> 100; 2.50 -> 250)."""
MIN_WEIGHT, MAX_WEIGHT = 1, 1_000_000
"""The weights set at most and at least: Slurm's ``Weight`` is a 32-bit count, and a bound keeps a
wrong reading from pushing a node out of use for good."""
DEFAULT_PERIOD = 30.0
"""Seconds between weight updates: jobs start and end on a scale of minutes; ``scontrol`` costs
a round trip to slurmctld."""


def new_job_slowdown(views: Sequence[AppView], gpu_count: int, capacity: float = CO_LOCATION_CAPACITY) -> float:
    """The SD a new one-GPU job would have on the best GPU of this node (see the module docstring)."""
    if gpu_count < 1:
        return math.inf
    load = [0.0] * gpu_count
    for view in views:
        total = view.ratio.total
        for gpu, share in enumerate(view.ratio.shares[:gpu_count]):
            load[gpu] += share / total
    return min(1.0 if held <= 0 else (held + 1.0) / capacity for held in load)


def weight_for(slowdown: float) -> int:
    """The node weight for a predicted SD, bounded to ``MIN_WEIGHT``..``MAX_WEIGHT``."""
    if not math.isfinite(slowdown):
        return MAX_WEIGHT
    return max(MIN_WEIGHT, min(MAX_WEIGHT, round(WEIGHT_PER_SD * slowdown)))


@dataclass(frozen=True)
class WeightUpdate:
    """One ``scontrol`` run: the command, the weight it set, its exit status and what it said."""

    command: tuple[str, ...]
    weight: int
    slowdown: float
    returncode: int | None
    output: str


class SlurmWeight:
    """Sets one node's weight with ``scontrol``, never blocking the manager's loop: a run is started
    by ``update`` and collected by ``poll`` at a later turn (``timeout`` seconds at most)."""

    def __init__(self, node: str, scontrol: str = "scontrol", timeout: float = 10.0) -> None:
        if not node:
            raise ValueError("--slurm-weight needs the node's name (NodeName in slurm.conf): give --slurm-node, or run "
                             "it where SLURMD_NODENAME is set")
        self.node = node
        self.scontrol = shutil.which(scontrol) or scontrol
        self.timeout = timeout
        self.weight: int | None = None  # the weight last set (None: none yet)
        self._running: tuple[subprocess.Popen, tuple[str, ...], int, float, float] | None = None

    def update(self, slowdown: float, now: float) -> bool:
        """Start setting the weight for ``slowdown`` if it differs from the one set (and no run is
        under way); whether a run started. ``OSError`` when ``scontrol`` cannot be started."""
        weight = weight_for(slowdown)
        if self._running is not None or weight == self.weight:
            return False
        command = (self.scontrol, "update", f"NodeName={self.node}", f"Weight={weight}")
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        self._running = (process, command, weight, slowdown, now)
        return True

    def poll(self, now: float) -> WeightUpdate | None:
        """The run started by ``update`` once it ended (or was stopped after ``timeout``), else None."""
        if self._running is None:
            return None
        process, command, weight, slowdown, started = self._running
        if process.poll() is None and now - started < self.timeout:
            return None
        if process.poll() is None:
            process.kill()
        output, _ = process.communicate()
        self._running = None
        if process.returncode == 0:
            self.weight = weight
        return WeightUpdate(command, weight, slowdown, process.returncode, (output or "").strip()[:500])

    def close(self) -> None:
        if self._running is not None:
            process = self._running[0]
            if process.poll() is None:
                process.kill()
            process.communicate()
            self._running = None
