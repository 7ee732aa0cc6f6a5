"""Slow-down (SD) by the paper's Eq. 2, and per-slot replica timings, as the client and the simulator compute them.

    SD = (T_now - T_start + iterations_left * iter_time) / solo_run_time

``iter_time`` is the mean iteration time (seconds) in the current *window*: the current epoch,
or the current decision interval when decisions come every K iterations. A window starts at each
decision boundary, so it also restarts whenever the DR may have changed. Before the first
iteration of a new window finishes, the previous window's mean is used. The first iteration of a
run is warm-up (model set-up, allocator and cuDNN warm-up): it counts for progress and elapsed
time but not for the mean. Once every iteration is done, SD is the actual finish time / solo time.

A run resumed from a checkpoint starts at iteration ``done`` > 0: its SD compares the part this
process runs with the same part run alone (the solo time scaled by the fraction of the plan
left at the start). A plan can be extended (:meth:`SlowdownTracker.extend`); the solo time then
grows in proportion, so the solo time per iteration stays the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class IterationPlan:
    """How long a run is: ``epochs`` x ``iterations_per_epoch`` iterations."""

    epochs: int
    iterations_per_epoch: int

    def __post_init__(self) -> None:
        for name in ("epochs", "iterations_per_epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")

    @property
    def total(self) -> int:
        return self.epochs * self.iterations_per_epoch


def check_solo_time(seconds: float) -> float:
    """A solo-run time must be a finite number of seconds > 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"solo-run time must be a finite number of seconds > 0; got {seconds!r}")
    return float(seconds)


class SlowdownTracker:
    """Progress, the windowed mean iteration time, and SD (Eq. 2). Times in seconds."""

    def __init__(self, plan: IterationPlan, solo_time: float | None, start: float, done: int = 0,
                 uncounted: Callable[[], float] | None = None) -> None:
        """``solo_time``: seconds for the whole plan, or None while not known yet (an estimate
        comes later: :meth:`set_solo_time`; SD is None until then). ``uncounted``: seconds
        (cumulative, read at each call) of the clock's time that count
        neither in iteration times nor in the SD; an emulated job's CPU time past its modelled host time
        (``DeviceBackend.uncounted_seconds``). Times passed in are the clock's; the tracker keeps
        its own run time, the clock's less what became uncounted since the tracker started."""
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done < plan.total:
            raise ValueError(f"a run can start at iteration 0..{plan.total - 1} of its plan; got {done!r}")
        self.plan = plan
        self.solo_time = None if solo_time is None else check_solo_time(solo_time)
        self._uncounted = uncounted
        self._uncounted_at_start = uncounted() if uncounted is not None else 0.0
        self._noted: tuple[float, float] | None = None  # (clock time, seconds left out then): the last step's
        self.start = float(start)
        self.last_mark = float(start)
        self.first = done  # iterations done before this run started (resumed from a checkpoint)
        self.done = done
        self._window_sum = 0.0
        self._window_count = 0
        self._previous_mean: float | None = None

    def iteration_finished(self, now: float) -> float:
        """Record that one more iteration ended at ``now``; return its duration."""
        if self.done >= self.plan.total:
            raise RuntimeError(f"the plan has {self.plan.total} iterations and all are done")
        self._noted = (now, self.uncounted_seconds)  # what is said about this moment, said consistently
        now = self.run_time(now)
        duration = max(0.0, now - self.last_mark)
        self.last_mark = now
        self.done += 1
        if self.done > self.first + 1:  # the first iteration of the run is warm-up
            self._window_sum += duration
            self._window_count += 1
        return duration

    @property
    def uncounted_seconds(self) -> float:
        """Seconds left out of the run so far (``uncounted``; 0 without it)."""
        return self._uncounted() - self._uncounted_at_start if self._uncounted is not None else 0.0

    def uncounted_at(self, now: float) -> float:
        """Seconds left out up to ``now``: as read when the last iteration ended, if ``now`` is that
        moment (a session reports and logs about the moment its step began, some time later:
        the seconds left out meanwhile are not of that moment), else as read now."""
        if self._noted is not None and self._noted[0] == now:
            return self._noted[1]
        return self.uncounted_seconds

    def run_time(self, now: float) -> float:
        """The clock's ``now`` less the seconds left out up to it."""
        return now - self.uncounted_at(now)

    def extend(self, plan: IterationPlan) -> None:
        """Continue with a longer ``plan`` (the solo time grows in proportion to its length)."""
        if plan.total < self.plan.total:
            raise ValueError(f"a plan can only grow: {plan.total} < {self.plan.total} iterations")
        if self.solo_time is not None:
            self.solo_time *= plan.total / self.plan.total
        self.plan = plan

    def set_solo_time(self, seconds: float) -> None:
        """A new solo-run time for the whole plan (an estimate refined as measurements come)."""
        self.solo_time = check_solo_time(seconds)

    @property
    def run_solo_time(self) -> float | None:
        """Solo time of the part of the plan this run covers (all of it unless resumed); None while unknown."""
        if self.solo_time is None:
            return None
        return self.solo_time * (self.plan.total - self.first) / self.plan.total

    def new_window(self) -> None:
        """Start a new averaging window (at a decision boundary)."""
        if self._window_count:
            self._previous_mean = self._window_sum / self._window_count
        self._window_sum, self._window_count = 0.0, 0

    @property
    def mean_iteration_time(self) -> float | None:
        """Mean seconds per iteration in this window (else the last window's; None before any)."""
        if self._window_count:
            return self._window_sum / self._window_count
        return self._previous_mean

    @property
    def iterations_left(self) -> int:
        return self.plan.total - self.done

    @property
    def finished(self) -> bool:
        return self.done >= self.plan.total

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.done // self.plan.iterations_per_epoch

    def slowdown(self, now: float) -> float | None:
        """SD at ``now``; None while no iteration time (or no solo time) is known yet."""
        solo = self.run_solo_time
        if solo is None:
            return None
        if self.finished:
            return (self.last_mark - self.start) / solo
        mean = self.mean_iteration_time
        if mean is None:
            return None
        return (self.run_time(now) - self.start + self.iterations_left * mean) / solo


# --- per-slot replica measurements ---------------------------------------------------------------
# At every report a session samples the model's last forward (``last_replica_timings()``): how long
# each replica took and how many samples it had. ``SlotWindow`` averages those over the current
# decision window, as ``SlowdownTracker`` averages iteration times: a new window starts at each
# decision boundary, and until it has a sample the previous window's means stand (as a whole:
# the result always describes the chunks of one window, so of one DR).


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
        if any(count for _, _, count in self._current):
            self._previous = self.means()
        self._current = [[0.0, 0.0, 0] for _ in range(self.slots)]

    def means(self) -> list[tuple[float, float] | None]:
        """Per slot: (mean seconds, mean samples) of its chunks in this window (None: no chunk there).

        Until the window has a sample on any slot, the last window's means stand as a whole, so
        the result always describes one window: one DR's chunks.
        """
        if any(count for _, _, count in self._current):
            return [(seconds / count, samples / count) if count else None
                    for seconds, samples, count in self._current]
        return list(self._previous)
