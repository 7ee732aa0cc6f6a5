"""Per-slot replica measurements a session publishes for the manager (framework-free).

At every report the session samples the model's last forward (``last_replica_timings()``): how
long each replica took and how many samples it had. ``SlotWindow`` averages those samples over
the current decision window, as ``SlowdownTracker`` averages iteration times: a new window starts
at each decision boundary, and until it has a sample the previous window's means stand.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Timing(Protocol):
    """One replica's timing (``drbalance.client.timing.ReplicaTiming`` fits)."""

    slot: int
    samples: int
    seconds: float


class SlotWindow:
    """Mean seconds and samples per slot over the sampled forwards of the current window."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._current = [[0.0, 0.0, 0] for _ in range(slots)]  # seconds, samples, count
        self._previous: list[tuple[float, float] | None] = [None] * slots

    def add(self, timings: Iterable[Timing]) -> None:
        """Add one forward's timings (slots out of range or with no samples are ignored)."""
        for timing in timings:
            if 0 <= timing.slot < self.slots and timing.samples > 0 and timing.seconds >= 0:
                entry = self._current[timing.slot]
                entry[0] += timing.seconds
                entry[1] += timing.samples
                entry[2] += 1

    def new_window(self) -> None:
        """Start a new window (at a decision boundary); the last means stand until replaced."""
        for slot, (seconds, samples, count) in enumerate(self._current):
            if count:
                self._previous[slot] = (seconds / count, samples / count)
        self._current = [[0.0, 0.0, 0] for _ in range(self.slots)]

    def means(self) -> list[tuple[float, float] | None]:
        """Per slot: (mean seconds, mean samples) of its chunks in this window, else the last one's."""
        result: list[tuple[float, float] | None] = []
        for slot, (seconds, samples, count) in enumerate(self._current):
            result.append((seconds / count, samples / count) if count else self._previous[slot])
        return result
