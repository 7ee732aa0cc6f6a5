"""Emulated GPUs: exclusive device slots shared by every process of a namespace on this host.

An emulated GPU is a lock file, a small shared-memory segment and a semaphore counting waiting
jobs. A replica *occupies* it for a device time: it takes an exclusive ``flock`` on the lock
file (waiting while another process holds it), sleeps, and releases it. The time is served in
slices (``DEFAULT_QUANTUM``): when another job waits, the holder steps aside after each slice,
so co-located jobs take turns as on a time-sliced GPU; while shared, a slice serves
``CO_LOCATION_CAPACITY`` times its length of device work (kernels of co-located jobs overlap),
as in the simulator's model. ``flock`` is released by the kernel when its holder dies, even by ``kill -9``,
so a dead job never wedges an emulated GPU. The holder (and only the holder, so there is one
writer) accounts busy seconds in the segment; ``EmulatedSource`` turns them into the percentage
of each sample period during which the GPU was busy, as NVML's ``utilization.gpu`` reports.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc

from drbalance import env
from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.layout import STATUS_OFFSET, RecordError, SegmentKind
from drbalance.ipc.names import IpcNames
from drbalance.ipc.records import RecordEmpty, Segment
from drbalance.models import CO_LOCATION_CAPACITY

ACCOUNT = struct.Struct("<ddiiQ")  # busy seconds so far, busy since (monotonic, 0 = idle), holder pid, pad, count
DEFAULT_QUANTUM = 0.05  # seconds of device time between chances for another job to take its turn
YIELD_SECONDS = 0.002  # how long a holder steps aside after its turn when another job waits


def _acquire_nowait(semaphore: posix_ipc.Semaphore) -> None:
    try:
        semaphore.acquire(0)
    except posix_ipc.BusyError:
        pass


@dataclass(frozen=True)
class Account:
    busy_total: float
    busy_since: float
    holder: int
    acquisitions: int


class EmulatedGpu:
    """One emulated GPU of a namespace (created on first use, shared by all its processes)."""

    def __init__(self, names: IpcNames, index: int, clock: Clock | None = None,
                 co_location_capacity: float = CO_LOCATION_CAPACITY) -> None:
        if index < 0:
            raise ValueError(f"emulated GPU index must be >= 0; got {index}")
        self.names = names
        self.index = index
        self.clock = clock or SystemClock()
        self.co_location_capacity = co_location_capacity
        lock_path = names.emulated_lock(index)
        objects.ensure_private_dir(lock_path.parent.parent)
        objects.ensure_private_dir(lock_path.parent)
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self.segment = _open_or_create(names.emulated_gpu(index))
        self.area = self.segment.area(STATUS_OFFSET, ACCOUNT.size, f"emulated GPU {index}")
        self._waiting = objects.create_or_open_semaphore(names.emulated_waiters(index))

    def read(self) -> Account | None:
        try:
            busy_total, busy_since, holder, _pad, count = ACCOUNT.unpack(self.area.read())
        except RecordError:
            return None
        return Account(busy_total, busy_since, holder, count)

    def busy_seconds(self, now: float) -> float:
        """Busy seconds accumulated up to ``now``, the current occupation included."""
        account = self.read()
        if account is None:
            return 0.0
        ongoing = 0.0
        if account.busy_since > 0 and objects.pid_alive(account.holder):
            ongoing = max(0.0, now - account.busy_since)
        return account.busy_total + ongoing

    def occupy(self, seconds: float, quantum: float = DEFAULT_QUANTUM) -> float:
        """Hold this GPU for ``seconds`` of device time; return how long we waited for it.

        The time is served in slices of ``quantum`` seconds. After a slice, a holder that sees
        another job waiting lets it go first, so co-located jobs share the GPU in turns (as a
        time-sliced GPU does) instead of one waiting for another's whole chunk.
        """
        remaining, waited = max(0.0, seconds), 0.0
        while remaining > 1e-9:
            asked = self.clock.monotonic()
            self._waiting.release()  # count ourselves as waiting
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            finally:
                _acquire_nowait(self._waiting)
            start = self.clock.monotonic()
            waited += start - asked
            try:
                previous = self.read()
                total = previous.busy_total if previous is not None else 0.0  # a dead holder's time is lost
                count = previous.acquisitions + 1 if previous is not None else 1
                self.area.write(ACCOUNT.pack(total, start, os.getpid(), 0, count))
                try:
                    while remaining > 1e-9:
                        shared = self._others_waiting()
                        gain = self.co_location_capacity if shared else 1.0
                        piece = min(quantum, remaining / gain)
                        time.sleep(piece)
                        remaining -= piece * gain  # while shared, kernels overlap: more work per second
                        if remaining > 1e-9 and shared:
                            break
                finally:
                    end = self.clock.monotonic()
                    self.area.write(ACCOUNT.pack(total + (end - start), 0.0, 0, 0, count))
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            if remaining > 1e-9:
                time.sleep(YIELD_SECONDS)  # give the waiting job its turn
        return waited

    def _others_waiting(self) -> bool:
        try:
            return self._waiting.value > 0
        except (AttributeError, posix_ipc.Error):  # no sem_getvalue on this platform: take turns always
            return True

    def close(self) -> None:
        self.segment.close()
        self._waiting.close()
        os.close(self._lock_fd)


def _open_or_create(name: str) -> Segment:
    for _ in range(50):
        try:
            return Segment.create(name, SegmentKind.EMULATED_GPU)
        except posix_ipc.ExistentialError:
            pass
        try:
            return Segment.open(name, SegmentKind.EMULATED_GPU)
        except RecordEmpty:
            time.sleep(0.01)  # another process is initialising it right now
        except posix_ipc.ExistentialError:
            continue  # removed between our two calls: create it again
    raise RuntimeError(f"could not open emulated GPU segment {name}")


def remove_emulated_gpus(names: IpcNames, count: int) -> None:
    """Remove the shared objects of emulated GPUs 0..count-1 (after a run)."""
    for index in range(count):
        objects.unlink_shared_memory(names.emulated_gpu(index))
        objects.unlink_semaphore(names.emulated_waiters(index))
        try:
            names.emulated_lock(index).unlink()
        except FileNotFoundError:
            pass


def emulated_gpu_count(argument: str | None = None) -> int:
    """The number of emulated GPUs: ``argument`` (e.g. from ``emulated:4``) or DRBALANCE_EMULATED_GPUS."""
    raw = argument or env.emulated_gpus()
    if not raw:
        raise ValueError("how many emulated GPUs? use --source emulated:N or set DRBALANCE_EMULATED_GPUS=N")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"emulated GPU count must be an integer; got {raw!r}") from None
    if not 1 <= count <= 32:
        raise ValueError(f"emulated GPU count must be 1..32; got {count}")
    return count


class EmulatedSource:
    """Utilisation of emulated GPUs: percent of each sample period during which one was occupied.

    It belongs to one namespace (the manager's ``--namespace``). When it is closed (the manager
    stops), it removes the objects of its emulated GPUs unless another process still maps one
    (a job training on): those are left for the last user (``remove_emulated_gpus``).
    """

    name = "emulated"

    def __init__(self, names: IpcNames, indices: Sequence[int], clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self.names = names
        self.gpus = [EmulatedGpu(names, index, self.clock) for index in indices]
        self._last: tuple[float, list[float]] | None = None
        self.left_in_use: dict[int, list[int]] = {}  # after close: GPU index -> pids still using it

    @classmethod
    def open(cls, argument: str, gpus: Sequence[int] | None = None, namespace: str | None = None) -> EmulatedSource:
        count = emulated_gpu_count(argument)
        indices = list(range(count)) if gpus is None else list(gpus)
        if any(not 0 <= g < count for g in indices):
            raise ValueError(f"--gpus {indices} outside the {count} emulated GPUs")
        return cls(IpcNames.current(namespace), indices)

    def gpu_count(self) -> int:
        return len(self.gpus)

    def sample(self) -> tuple[float | None, ...]:
        now = self.clock.monotonic()
        busy = [gpu.busy_seconds(now) for gpu in self.gpus]
        last, self._last = self._last, (now, busy)
        if last is None or now <= last[0]:
            return (None,) * len(self.gpus)
        period = now - last[0]
        return tuple(min(100.0, max(0.0, 100.0 * (b - a) / period)) for a, b in zip(last[1], busy))

    def close(self) -> None:
        me = os.getpid()
        for gpu in self.gpus:
            gpu.close()
            users = [pid for pid in objects.shm_users(self.names.emulated_gpu(gpu.index)) if pid != me]
            if users:
                self.left_in_use[gpu.index] = users
                continue
            objects.unlink_shared_memory(self.names.emulated_gpu(gpu.index))
            objects.unlink_semaphore(self.names.emulated_waiters(gpu.index))
            try:
                self.names.emulated_lock(gpu.index).unlink()
            except OSError:
                pass
        self.gpus = []
