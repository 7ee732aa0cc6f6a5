"""A job's solo iteration time estimated online from its own measurements, when no solo-run time is given.

On a busy shared server there is no idle GPU to profile on, so a job may start without a solo-run
time (``Session(solo_time=None)``). Its SD then uses this estimate of what one iteration would take
alone on one GPU, refined at every report (every ``report_every`` iterations) from what the job
measures itself:

- **host seconds**: the part of an iteration no replica's chunk covers: the window's mean
  iteration time less its longest mean chunk time (chunks run at once on their GPUs), or less
  their sum where they run one after another (the CPU path). Windows with a single replica are
  preferred: with several, the host time also holds DataParallel's overhead of the extra
  replicas, which a solo run does not pay.
- **device seconds** of the whole batch on one GPU: from the chunks of slots whose GPU the job had
  *alone* throughout a window (no other process on it at any report, as the backend tells: NVML's
  process list on CUDA, the emulated GPU's memory table on emulated GPUs). Each chunk size's time
  is the median of its last chunks seen alone. A chunk of the whole batch seen alone is the
  answer; else, with two sizes or more, a line ``fixed + per_sample x samples`` is fitted to them
  (the form of the simulator's and the emulated GPUs' model,
  ``drbalance.workload.models.ModelCosts``) and read at the batch size; with one size, the chunk
  time is scaled in proportion to the batch. Without any chunk seen alone, the least of every
  chunk's time scaled to the batch stands: a chunk shared with other jobs is slower than alone.

**Measured or a bound.** The estimate is the solo time itself when its device part is a chunk of
the batch seen alone or a line through two sizes or more, and its host part comes from a window
with one replica. The other ways can only over-estimate it: a chunk scaled in proportion counts the fixed cost once per
replica, a shared chunk holds the others' turns, and a host time from several replicas holds
DataParallel's overhead of the extra ones. Such an estimate is marked ``upper_bound``; the SD
computed from it is then a lower bound, which the record, the SD log, ``drbalance status``, the
report and the metrics say instead of showing it as the SD (docs/profiles.md).

The estimate is ``host + device`` seconds per iteration; the session multiplies it by its plan's
iterations. Its error against the true solo time is measured by ``python -m benchmarks.solo_estimate``
(docs/profiles.md). Framework-free: the client uses it, and the benchmark drives it with the
simulator's timings.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ALONE = "alone"
SHARED = "shared"
MANAGER = "manager"
"""The bases of a solo time estimated online (``AppStatus.solo_basis``, ``AppView.solo_basis``):
the job's own from GPUs it had alone, its own bound from shared ones, the manager's estimate."""

HISTORY = 32
"""Windows of host times kept for the estimate, and chunk sizes seen alone (the line is fitted to
the last ``HISTORY`` sizes): enough to span many DR changes, few enough that the estimate follows
a job whose speed changes (a new phase)."""

PER_SIZE = 8
"""Chunks seen alone kept per chunk size; their median is that size's time (robust to a stray one)."""


@dataclass(frozen=True)
class SlotSample:
    """One slot's chunks over a window: mean seconds, mean samples, and whether the job had the
    slot's GPU alone (None: not known, e.g. on the CPU path)."""

    seconds: float
    samples: float
    alone: bool | None = None


@dataclass(frozen=True)
class SoloEstimate:
    """Estimated seconds of one iteration alone on one GPU (``iteration_seconds`` = ``host_seconds``
    + ``device_seconds``); ``basis`` is ``"alone"`` (device time from GPUs the job had alone) or
    ``"shared"`` (only shared GPUs seen); ``upper_bound``: the estimate can only be too high
    (see the module docstring), so an SD from it is a lower bound."""

    iteration_seconds: float
    host_seconds: float
    device_seconds: float
    basis: str
    upper_bound: bool = True


class SoloEstimator:
    """Keeps a job's measurements and estimates its solo iteration time (see the module docstring).

    ``parallel``: whether the job's chunks run at once (on GPUs, real or emulated) rather than one
    after another (the CPU path).
    """

    def __init__(self, parallel: bool = True, history: int = HISTORY) -> None:
        self.parallel = parallel
        self._single_host: deque[float] = deque(maxlen=history)  # host seconds of windows with one replica
        self._multi_host: deque[float] = deque(maxlen=history)  # ... with several (DataParallel's overhead in)
        self._history = history
        self._alone: dict[float, deque[float]] = {}  # chunk samples -> seconds of chunks of that size seen alone
        self._least_shared: float | None = None  # least chunk time seen, scaled to the batch
        self.estimate: SoloEstimate | None = None

    def observe(self, iteration_seconds: float | None, batch: int,
                slots: Sequence[SlotSample | None]) -> SoloEstimate | None:
        """Add one window's measurements (mean iteration seconds, the global batch in samples, and
        per slot its chunks); return the refined estimate (None while nothing is measured)."""
        used = [slot for slot in slots if slot is not None and slot.samples > 0 and slot.seconds > 0]
        if iteration_seconds is None or batch <= 0 or not used:
            return self.estimate
        busy = max(slot.seconds for slot in used) if self.parallel else sum(slot.seconds for slot in used)
        host = max(0.0, iteration_seconds - busy)
        (self._single_host if len(used) == 1 else self._multi_host).append(host)
        for slot in used:
            if slot.alone:
                self._add_alone(slot.samples, slot.seconds)
            scaled = slot.seconds * batch / slot.samples
            if self._least_shared is None or scaled < self._least_shared:
                self._least_shared = scaled
        host_seconds = statistics.median(self._single_host or self._multi_host)
        if self._alone:
            device, measured = self._device_alone(batch)
            basis = ALONE
        else:
            device, measured, basis = self._least_shared, False, SHARED
        bound = not (measured and self._single_host)
        self.estimate = SoloEstimate(host_seconds + device, host_seconds, device, basis, bound)
        return self.estimate

    def _device_alone(self, batch: int) -> tuple[float, bool]:
        """Device seconds of the whole batch from the chunks seen alone, and whether measured (a
        chunk of the batch, or a line through two sizes or more) rather than scaled."""
        whole = self._alone.get(round(batch, 1))
        if whole is not None:
            return statistics.median(whole), True
        chunks = [(samples, statistics.median(times)) for samples, times in self._alone.items()]
        return device_seconds_at(batch, chunks), line_through(chunks) is not None

    def _add_alone(self, samples: float, seconds: float) -> None:
        """Keep a chunk seen alone under its size (the sizes seen last are kept: ``history`` of them)."""
        size = round(samples, 1)  # a window's mean size: whole numbers but for an epoch's short last batch
        times = self._alone.pop(size, None) or deque(maxlen=PER_SIZE)
        times.append(seconds)
        self._alone[size] = times  # last in the order: seen most recently
        if len(self._alone) > self._history:
            del self._alone[next(iter(self._alone))]


class AloneWindow:
    """Per slot, whether the job had its GPU alone at every look since its window began: the chunk
    means of a window count as alone only if no other process was seen there in it (one that left
    mid-window leaves its slow chunks in the mean). None where the backend cannot tell."""

    def __init__(self) -> None:
        self._flags: list[bool | None] | None = None

    def update(self, alone: Sequence[bool | None]) -> tuple[bool | None, ...]:
        """Add a look (per slot: alone now?); return the flags for the whole window so far."""
        if self._flags is None or len(self._flags) != len(alone):
            self._flags = list(alone)
        else:
            self._flags = [None if was is None or now is None else was and now
                           for was, now in zip(self._flags, alone)]
        return tuple(self._flags)

    def new_window(self) -> None:
        """A decision boundary: the next window's means start afresh."""
        self._flags = None


def device_seconds_at(batch: float, chunks: Sequence[tuple[float, float]]) -> float:
    """Device seconds of a chunk of ``batch`` samples from ``(samples, seconds)`` of chunks run alone:
    a least-squares line ``fixed + per_sample x samples`` when they have two sizes or more and the
    line is plausible (fixed >= 0, per_sample > 0), else the median seconds per sample x ``batch``."""
    line = line_through(chunks)
    if line is not None:
        fixed, slope = line
        return fixed + slope * batch
    return statistics.median(seconds / samples for samples, seconds in chunks) * batch


def line_through(chunks: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(fixed, per_sample)`` seconds of the least-squares line through ``(samples, seconds)`` of
    two sizes or more, or None where there are fewer or the line is not plausible (fixed < 0 or
    per_sample <= 0: noise)."""
    sizes = {samples for samples, _ in chunks}
    if len(sizes) < 2:
        return None
    mean_n = statistics.fmean(samples for samples, _ in chunks)
    mean_t = statistics.fmean(seconds for _, seconds in chunks)
    spread = sum((samples - mean_n) ** 2 for samples, _ in chunks)
    slope = sum((samples - mean_n) * (seconds - mean_t) for samples, seconds in chunks) / spread
    fixed = mean_t - slope * mean_n
    return (fixed, slope) if slope > 0 and fixed >= 0 else None



def chosen_solo(own: SoloEstimate | None, manager_seconds: float | None) -> tuple[float, str] | None:
    """The solo iteration (seconds) a job given no solo time uses for its SD, and its basis: its own
    estimate where it had a GPU alone (``alone``); else the manager's estimate where the manager
    sent one (``manager``: its predictor knows what slows the job on its shared GPUs); else its
    own upper bound (``shared``); None while it has none."""
    if own is not None and own.basis == ALONE:
        return own.iteration_seconds, ALONE
    if manager_seconds is not None and manager_seconds > 0:
        return manager_seconds, MANAGER
    return None if own is None else (own.iteration_seconds, own.basis)
