"""Clocks under a test's control."""

from __future__ import annotations

import time


class ManualClock:
    """A ``drbalance.clock`` clock that moves only when told to (seconds)."""

    def __init__(self, start: float = 0.0, wall_offset: float = 1.7e9) -> None:
        self.now = float(start)
        self.wall_offset = wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset


class MonotonicClock:
    """Stands in for ``drbalance.jsonlog``'s ``time`` module: ``monotonic`` under the test's
    control, ``time`` as it is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()
