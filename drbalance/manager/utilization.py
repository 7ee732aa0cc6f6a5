"""GPU utilisation sources behind one interface, and the smoothing window.

A source reports, per GPU, the percentage of recent time during which the GPU was busy (NVML's
``utilization.gpu``: at least one kernel running), or None where no reading could be had; and,
for the mapping of jobs' devices and the memory caps, each GPU's UUID and memory (None where
unknown).

- ``NvmlSource``: real GPUs through NVML.
- ``ScriptedSource``: utilisations from a JSON file that may change while the manager runs
  (tests and demos of the policy without GPUs).
- ``EmulatedSource`` (``drbalance.emu``): busy time of emulated GPUs, reported as NVML would.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from drbalance.clock import Clock, SystemClock
from drbalance.manager.nvml import MemoryInfo, Nvml, NvmlUnavailable

if TYPE_CHECKING:
    from drbalance.ipc.system import SystemPlace


class UtilizationUnavailable(RuntimeError):
    """The source cannot be used at all (e.g. no NVIDIA driver)."""


class UtilizationSource(Protocol):
    def gpu_count(self) -> int:
        """Number of GPUs this source reports on."""
        ...

    def sample(self) -> tuple[float | None, ...]:
        """Percent busy per GPU (0-100), None where unavailable this time."""
        ...

    def gpu_uuids(self) -> tuple[str | None, ...]:
        """Each GPU's UUID (``GPU-...``), None where unknown; fixed for the source's life."""
        ...

    def memory(self) -> tuple[MemoryInfo | None, ...]:
        """Each GPU's memory now (bytes), None where unknown."""
        ...

    def close(self) -> None: ...


class NvmlSource:
    """``utilization.gpu`` of real GPUs; ``gpus`` selects indices (default: all)."""

    name = "nvml"

    def __init__(self, gpus: Sequence[int] | None = None, nvml: Nvml | None = None) -> None:
        self.nvml = nvml or Nvml()
        try:
            count = self.nvml.call("nvmlDeviceGetCount")
        except NvmlUnavailable as error:
            raise UtilizationUnavailable(str(error)) from None
        indices = list(range(count)) if gpus is None else list(gpus)
        if not indices:
            raise UtilizationUnavailable("NVML reports no GPUs")
        bad = [g for g in indices if not 0 <= g < count]
        if bad:
            raise UtilizationUnavailable(f"GPU indices {bad} do not exist (NVML sees {count} GPUs)")
        self.indices = indices
        self.handles = [self._handle(g) for g in indices]
        self._uuids: tuple[str | None, ...] | None = None

    def _handle(self, gpu: int) -> object:
        """NVML's handle of GPU ``gpu``; ``UtilizationUnavailable`` (NVML shut down) when NVML
        counts the GPU but cannot open it (fallen off the bus, no permission on its device node)."""
        try:
            return self.nvml.call("nvmlDeviceGetHandleByIndex", gpu)
        except NvmlUnavailable as error:
            self.nvml.shutdown()
            raise UtilizationUnavailable(f"GPU {gpu}: {error} (leave it out with --gpus)") from None

    def gpu_count(self) -> int:
        return len(self.handles)

    def gpu_uuids(self) -> tuple[str | None, ...]:
        if self._uuids is None or None in self._uuids:
            self._uuids = tuple(self.nvml.uuid(handle) for handle in self.handles)
        return self._uuids

    def memory(self) -> tuple[MemoryInfo | None, ...]:
        return tuple(self.nvml.memory(handle) for handle in self.handles)

    def sample(self) -> tuple[float | None, ...]:
        readings: list[float | None] = []
        for handle in self.handles:
            try:
                readings.append(float(self.nvml.call("nvmlDeviceGetUtilizationRates", handle).gpu))
            except NvmlUnavailable:
                readings.append(None)
        return tuple(readings)

    def close(self) -> None:
        self.nvml.shutdown()


_READABLE = object()  # ScriptedSource._unreadable when the last read succeeded


class ScriptedSource:
    """Utilisations from a JSON file: ``{"gpus": 4, "steps": [{"at": 0, "util": [..]}, ...]}``.

    ``at`` is seconds since the source started; the last step at or before now applies. The file
    is re-read whenever it changes, so a test can steer utilisation while the manager runs. A
    ``null`` entry is an unavailable reading. Optional: ``"uuids": ["GPU-...", ...]`` (the GPUs'
    UUIDs), ``"memory_total": [bytes, ...]`` and, per step, ``"free": [bytes, ...]``.

    A file that cannot be read or decoded once is taken to be being rewritten (the last good
    script stays); found so again unchanged at the next read, or decoded but invalid, it makes
    ``sample`` and ``memory`` raise ``UtilizationUnavailable`` until it is fixed (the manager
    shows that as a fault of its ``sample`` task).
    """

    name = "scripted"

    def __init__(self, path: str | Path, clock: Clock | None = None) -> None:
        self.path = Path(path)
        self.clock = clock or SystemClock()
        self.start = self.clock.monotonic()
        self._stamp: tuple[float, int] | None = None
        self._gpus = 0
        self._steps: list[tuple[float, tuple[float | None, ...]]] = []
        self._uuids: tuple[str | None, ...] = ()
        self._memory_total: tuple[int | None, ...] = ()
        self._free: list[tuple[float, tuple[int | None, ...]]] = []
        self._unreadable: object = _READABLE  # the stamp of the file when its last read failed (None: no file)
        self._load()

    def _load(self, judge: bool = True) -> None:
        """Read the file if it changed. ``judge``: this read counts as the next look at a file that
        could not be read (``memory`` reads right after ``sample``: too soon to tell a rewrite)."""
        try:
            info = self.path.stat()
            stamp = (info.st_mtime, info.st_size)
            if stamp == self._stamp:
                return
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
            if self._stamp is None:
                raise UtilizationUnavailable(f"scripted utilisation file {self.path}: {error}") from None
            unreadable = stamp if isinstance(error, ValueError) else None
            if not judge:
                return
            if unreadable == self._unreadable:  # unchanged since the last read failed: broken, not being rewritten
                raise UtilizationUnavailable(f"scripted utilisation file {self.path}: {error}") from None
            self._unreadable = unreadable
            return  # keep the last good script while the file is being rewritten
        gpus, steps = _parse_script(data, self.path)
        uuids, totals, free = _parse_gpu_info(data, gpus, self.path)
        self._gpus, self._steps, self._stamp, self._unreadable = gpus, steps, stamp, _READABLE
        self._uuids, self._memory_total, self._free = uuids, totals, free

    def gpu_count(self) -> int:
        return self._gpus

    def gpu_uuids(self) -> tuple[str | None, ...]:
        return self._uuids

    def memory(self) -> tuple[MemoryInfo | None, ...]:
        self._load(judge=False)
        elapsed = self.clock.monotonic() - self.start
        free: tuple[int | None, ...] = (None,) * self._gpus
        for at, values in self._free:
            if at <= elapsed:
                free = values
        infos: list[MemoryInfo | None] = []
        for total, left in zip(self._memory_total, free):
            infos.append(None if total is None or left is None else MemoryInfo(total, total - min(left, total),
                                                                                min(left, total)))
        return tuple(infos)

    def sample(self) -> tuple[float | None, ...]:
        self._load()
        elapsed = self.clock.monotonic() - self.start
        current = self._steps[0][1]
        for at, util in self._steps:
            if at <= elapsed:
                current = util
        return current

    def close(self) -> None:
        pass


def _parse_script(data: object, path: Path) -> tuple[int, list[tuple[float, tuple[float | None, ...]]]]:
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list) or not data["steps"]:
        raise UtilizationUnavailable(f"{path}: expected {{'gpus': N, 'steps': [{{'at': s, 'util': [...]}}]}}")
    gpus = data.get("gpus")
    if not isinstance(gpus, int) or gpus < 1:
        raise UtilizationUnavailable(f"{path}: 'gpus' must be a positive integer")
    steps = []
    for step in data["steps"]:
        util = step.get("util") if isinstance(step, dict) else None
        at = step.get("at", 0) if isinstance(step, dict) else None
        if not isinstance(util, list) or len(util) != gpus or not isinstance(at, (int, float)):
            raise UtilizationUnavailable(f"{path}: bad step {step!r} (need 'at' and {gpus} 'util' values)")
        for value in util:
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 100):
                raise UtilizationUnavailable(f"{path}: utilisation {value!r} outside 0..100")
        steps.append((float(at), tuple(None if v is None else float(v) for v in util)))
    return gpus, sorted(steps, key=lambda item: item[0])


def _parse_gpu_info(data: dict, gpus: int, path: Path) -> tuple[
        tuple[str | None, ...], tuple[int | None, ...], list[tuple[float, tuple[int | None, ...]]]]:
    """The optional ``uuids``, ``memory_total`` and per-step ``free`` of a script."""
    uuids = data.get("uuids", [None] * gpus)
    if not isinstance(uuids, list) or len(uuids) != gpus or not all(u is None or isinstance(u, str) for u in uuids):
        raise UtilizationUnavailable(f"{path}: 'uuids' must be a list of {gpus} strings (or nulls)")
    totals = data.get("memory_total", [None] * gpus)
    if not isinstance(totals, list) or len(totals) != gpus or not all(_is_bytes(t) for t in totals):
        raise UtilizationUnavailable(f"{path}: 'memory_total' must be a list of {gpus} byte counts (or nulls)")
    free = []
    for step in data["steps"]:
        values = step.get("free", [None] * gpus)
        if not isinstance(values, list) or len(values) != gpus or not all(_is_bytes(v) for v in values):
            raise UtilizationUnavailable(f"{path}: a step's 'free' must be a list of {gpus} byte counts (or nulls)")
        free.append((float(step.get("at", 0)), tuple(values)))
    return tuple(uuids), tuple(totals), sorted(free, key=lambda item: item[0])


def _is_bytes(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


MAX_WINDOW = 10_000
"""Samples a smoothing window holds at most (83 minutes at the default 0.5 s period): every status
write and every decision averages the whole window, and a size past ``sys.maxsize`` would crash the
manager with OverflowError."""


class UtilizationWindow:
    """Mean of the last ``size`` readings per GPU, ignoring unavailable ones (None if none)."""

    def __init__(self, gpu_count: int, size: int) -> None:
        if not 1 <= size <= MAX_WINDOW:
            raise ValueError(f"the smoothing window (--window) must hold 1..{MAX_WINDOW} samples; got {size}")
        self.gpu_count = gpu_count
        self._history: deque[tuple[float | None, ...]] = deque(maxlen=size)

    def add(self, reading: Sequence[float | None]) -> None:
        if len(reading) != self.gpu_count:
            raise ValueError(f"a reading of {len(reading)} GPUs for a window of {self.gpu_count}")
        self._history.append(tuple(_clean(v) for v in reading))

    def values(self) -> tuple[float | None, ...]:
        means: list[float | None] = []
        for gpu in range(self.gpu_count):
            known = [sample[gpu] for sample in self._history if sample[gpu] is not None]
            means.append(sum(known) / len(known) if known else None)
        return tuple(means)


def _clean(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return min(100.0, max(0.0, float(value)))


def _emulated(argument: str, gpus: Sequence[int] | None, namespace: str | None = None) -> UtilizationSource:
    from drbalance.emu.gpus import EmulatedSource

    return EmulatedSource.open(argument, gpus, namespace)


SOURCES: Mapping[str, Callable[[str, Sequence[int] | None], UtilizationSource]] = MappingProxyType({
    "nvml": lambda argument, gpus: NvmlSource(gpus),
    "scripted": lambda argument, gpus: ScriptedSource(argument),
    "emulated": _emulated,
})


def open_source(spec: str, gpus: Sequence[int] | None = None, namespace: str | None = None,
                machine: SystemPlace | None = None) -> UtilizationSource:
    """A source from ``nvml``, ``emulated[:N]`` or ``scripted:FILE``.

    ``namespace``: the manager's (emulated GPUs belong to a namespace; default DRBALANCE_NAMESPACE).
    ``machine``: a system manager's folder: emulated GPUs are then the machine's, every user's jobs
    share them (``EmulatedSource.for_machine``).
    """
    kind, _, argument = spec.partition(":")
    if kind not in SOURCES:
        raise ValueError(f"unknown utilisation source {spec!r}; use one of: nvml, emulated[:N], scripted:FILE")
    if kind == "scripted" and not argument:
        raise ValueError("the scripted source needs a file: --source scripted:PATH.json")
    if kind == "emulated" and machine is not None:
        from drbalance.emu.gpus import EmulatedSource

        return EmulatedSource.for_machine(machine, argument or None, gpus)
    if kind == "emulated":
        return _emulated(argument, gpus, namespace)
    return SOURCES[kind](argument, gpus)
