"""The time-slicing baseline: finish-time fairness on whole GPUs (Themis / Gavel's rho).

A cluster scheduler does not split mini-batches: it leases whole GPUs for rounds. At every round
(and whenever a GPU frees up) the ``m`` live apps with the largest rho get one GPU each; the rest
wait. rho is finish-time fairness, the predicted finish time over the solo-run time: the same
quantity as SD (Eq. 2), so it is computed by the same tracker. An app that has not run yet has
an unknown rho and goes first. A resumed app pays ``switch_seconds`` (checkpoint restore) before
its next iteration; an app keeps its GPU across rounds when it stays selected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def rho(app: Any, now: float) -> float:
    sd = app.tracker.slowdown(now)
    return math.inf if sd is None else sd


def plan_round(apps: Sequence[Any], now: float, gpu_count: int) -> dict[str, int]:
    """Which app runs on which GPU this round (apps not in the result wait)."""
    ranked = sorted(apps, key=lambda a: (-rho(a, now), a.spec.arrival, a.index))
    chosen = ranked[:gpu_count]
    assignment: dict[str, int] = {}
    for app in chosen:  # stay where you are, if selected again
        if app.gpu is not None and app.gpu not in assignment.values():
            assignment[app.name] = app.gpu
    free = [g for g in range(gpu_count) if g not in assignment.values()]
    for app in chosen:
        if app.name not in assignment:
            assignment[app.name] = free.pop(0)
    return assignment
