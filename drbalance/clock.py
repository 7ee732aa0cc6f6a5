"""Clocks: the real one, and a manual one for tests. The simulator has its own virtual clock.

``monotonic()`` is for durations and freshness (CLOCK_MONOTONIC is host-wide on Linux, so
values compare across processes); ``wall()`` is for logs (seconds since the epoch).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic, host-wide clock."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch."""
        ...


class SystemClock:
    """The host's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, and the simulator's virtual time)."""

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
