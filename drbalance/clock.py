"""Clocks: the protocol the manager and the client take, and the host's clock. The simulator
has its own virtual clock; tests pass a clock that moves only when told to.

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

