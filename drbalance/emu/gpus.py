"""Emulated GPUs: exclusive device slots shared by every process of a namespace on this host.

An emulated GPU is a lock file, a small shared-memory segment and a second lock file on which
waiting jobs hold a shared ``flock`` (the holder tries an exclusive one to see whether anyone
waits; the kernel drops a dead waiter's lock, where a semaphore's count would stay one too high
after a ``kill -9``). A replica *occupies* it for a device time: it takes an exclusive ``flock`` on the lock
file (waiting while another process holds it), sleeps, and releases it. The time is served in
slices (``DEFAULT_QUANTUM``): when another job waits, the holder steps aside after each slice,
so co-located jobs take turns as on a time-sliced GPU; while shared, a slice serves
``CO_LOCATION_CAPACITY`` times its length of device work (kernels of co-located jobs overlap),
as in the simulator's model. ``flock`` is released by the kernel when its holder dies, even by ``kill -9``,
so a dead job never wedges an emulated GPU. The holder (and only the holder, so there is one
writer) accounts busy seconds in the segment; ``EmulatedSource`` turns them into the percentage
of each sample period during which the GPU was busy, as NVML's ``utilization.gpu`` reports.

An emulated GPU also has a memory size (default 24 GiB, the paper's Quadro RTX 6000) and a UUID.
Its creator records the size in the segment, and a process asking for another size while another
process uses the GPU is refused. Every process (every backend object, in fact) that keeps memory on
it records its reservation in a table in the segment, under a POSIX record lock; a reservation
that would exceed the size
minus what the others hold raises ``EmulatedOutOfMemory``, worded like CUDA's. Entries of dead
processes do not count (a process is named by pid and start time: a later process that reuses a
killed job's pid does not inherit its memory). ``memory_info()`` reports total / used / free as NVML's
``nvmlDeviceGetMemoryInfo`` does, and ``uuid`` is a stable ``GPU-...`` name derived from the GPU's
home, namespace and index, so the manager's UUID mapping is exercised on CPU-only machines.

Where a GPU's files and segment are, who owns them and who makes them is its *home*
(``drbalance.emu.home``): the user's own GPUs, or the machine's, made by a system manager and
shared by every user's jobs (``drbalance.emu.machine``). Which of them a job sees is
``drbalance.emu.view``.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from drbalance import env
from drbalance.clock import Clock, SystemClock
from drbalance.emu.home import GpuHome, UserHome, emulated_uuid, remove_user_gpu
from drbalance.emu.layout import (
    ACCOUNT,
    DEFAULT_MEMORY_BYTES,
    MAX_MEMORY_BYTES,
    MEMORY_ENTRIES,
    MEMORY_ENTRY,
    MEMORY_OFFSET,
    MEMORY_TABLE_SIZE,
    check_memory_size,
    size_text,
)
from drbalance.ipc import objects
from drbalance.ipc.layout import STATUS_OFFSET, RecordError
from drbalance.ipc.names import IpcNames
from drbalance.ipc.system import SystemPlace
from drbalance.manager.nvml import MemoryInfo
from drbalance.workload.models import CO_LOCATION_CAPACITY

__all__ = [
    "ACCOUNT", "DEFAULT_MEMORY_BYTES", "MAX_MEMORY_BYTES", "Account", "EmulatedGpu", "EmulatedOutOfMemory",
    "EmulatedSource", "EmulatedSpec", "GpuHome", "UserHome", "check_memory_size", "emulated_spec", "emulated_uuid",
    "open_emulated_gpus", "parse_memory_size", "release_at_exit", "release_emulated_gpu", "release_emulated_gpus",
    "remove_emulated_gpus",
]

DEFAULT_QUANTUM = 0.05  # seconds of device time between chances for another job to take its turn
YIELD_SECONDS = 0.002  # how long a holder steps aside after its turn when another job waits
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
              "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class EmulatedOutOfMemory(RuntimeError):
    """An emulated GPU has not enough free memory (the client raises it as torch's OutOfMemoryError)."""

    def __init__(self, index: int, requested: int, total: int, free: int) -> None:
        self.index, self.requested, self.total, self.free = index, requested, total, free
        super().__init__(
            f"Emulated GPU out of memory. Tried to allocate {size_text(requested)}. GPU {index} has a total capacity "
            f"of {size_text(total)} of which {size_text(max(0, free))} is free (emulated by drbalance: no real GPU "
            f"memory is used)"
        )


def parse_memory_size(text: str) -> int:
    """Bytes from ``24GiB``, ``512MiB``, ``16G`` (binary units), ``16GB`` (decimal) or a plain integer."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(f"emulated GPU memory {text!r} is not a size: use e.g. 24GiB, 512MiB or a number of bytes")
    scaled = float(match.group(1)) * SIZE_UNITS[unit]  # infinity for 309 digits or more
    value = int(scaled) if math.isfinite(scaled) else MAX_MEMORY_BYTES + 1
    check_memory_size(value, repr(text))
    return value


@dataclass(frozen=True)
class Occupancy:
    """One occupation of an emulated GPU (seconds): ``waited``, for the GPU while other jobs had
    their turns (the steps aside included); ``served``, the GPU's time for this job's work as
    modelled (at the co-location capacity while shared). What the occupation took beyond their sum
    was this machine's: threads waking late, waiting for a core."""

    waited: float
    served: float


@dataclass(frozen=True)
class Account:
    busy_total: float
    busy_since: float
    holder: int
    acquisitions: int
    holder_ticks: int = 0  # the low 32 bits of the holder's start time (0 = unknown)


_OWN_TICKS: dict[int, int] = {}  # pid -> its start time, for this process (a forked child has its own pid)


def _own_ticks() -> int:
    """This process's start time (clock ticks since boot; 0 where /proc cannot tell)."""
    pid = os.getpid()
    if pid not in _OWN_TICKS:
        _OWN_TICKS[pid] = objects.process_start_ticks(pid) or 0
    return _OWN_TICKS[pid]


def _same_process(pid: int, ticks: int, bits: int = 64) -> bool:
    """Whether ``pid`` is alive and still the process that started at ``ticks`` (the low ``bits``
    bits; 0 = unknown, then the pid alone decides): a later process that reuses a killed job's pid
    must not take over its memory reservation or its turn on the GPU."""
    if not objects.pid_alive(pid):
        return False
    if ticks <= 0:
        return True
    current = objects.process_start_ticks(pid)
    return current is None or current & ((1 << bits) - 1) == ticks


class EmulatedGpu:
    """One emulated GPU of a home (``drbalance.emu.home``): the user's own of a namespace (given
    its ``IpcNames``: created on first use, shared by all the user's processes), or the machine's.

    ``index``: the GPU's index in its home. ``memory_bytes``: the memory size this process asks
    for; a home that fixes one (the machine's) gives its own.
    """

    def __init__(self, home: GpuHome | IpcNames, index: int, clock: Clock | None = None,
                 co_location_capacity: float = CO_LOCATION_CAPACITY, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if index < 0:
            raise ValueError(f"emulated GPU index must be >= 0; got {index}")
        check_memory_size(memory_bytes)
        self.home = home if isinstance(home, GpuHome) else UserHome(home)
        self.index = index
        self.clock = clock or SystemClock()
        self.co_location_capacity = co_location_capacity
        fixed = self.home.memory_bytes
        self.memory_bytes = int(memory_bytes if fixed is None else fixed)
        self.uuid = self.home.uuid(index)
        with self.home.guard(exclusive=False):  # not removed while we open its files and map it
            self._lock_fd, self._wait_fd = self.home.open_files(index)
            try:
                self.segment = self.home.open_segment(index, self._lock_fd, self.memory_bytes)
            except BaseException:
                os.close(self._lock_fd)
                os.close(self._wait_fd)
                raise
        self.area = self.segment.area(STATUS_OFFSET, ACCOUNT.size, f"emulated GPU {index}")
        self.memory_area = self.segment.area(MEMORY_OFFSET, MEMORY_TABLE_SIZE, f"emulated GPU {index} memory")
        self._memory_thread_lock = threading.Lock()
        self.closed = False
        _OPEN.add(self)

    def read(self) -> Account | None:
        try:
            busy_total, busy_since, holder, holder_ticks, count = ACCOUNT.unpack(self.area.read())
        except RecordError:
            return None
        return Account(busy_total, busy_since, holder, count, holder_ticks)

    def busy_seconds(self, now: float) -> float:
        """Busy seconds accumulated up to ``now``, the current occupation included."""
        account = self.read()
        if account is None:
            return 0.0
        ongoing = 0.0
        if account.busy_since > 0 and _same_process(account.holder, account.holder_ticks, bits=32):
            ongoing = max(0.0, now - account.busy_since)
        return account.busy_total + ongoing

    def occupy(self, seconds: float, quantum: float = DEFAULT_QUANTUM, cancel: threading.Event | None = None) -> float:
        """Hold this GPU for ``seconds`` of device time; return how long we waited for it (seconds):
        :meth:`occupy_measured`'s ``waited``."""
        return self.occupy_measured(seconds, quantum, cancel).waited

    def occupy_measured(self, seconds: float, quantum: float = DEFAULT_QUANTUM,
                        cancel: threading.Event | None = None) -> Occupancy:
        """Hold this GPU for ``seconds`` of device time; how long we waited for it and how long it
        served us, as modelled (:class:`Occupancy`).

        The time is served in slices of ``quantum`` seconds. After a slice, a holder that sees
        another job waiting lets it go first, so co-located jobs share the GPU in turns (as a
        time-sliced GPU does) instead of one waiting for another's whole chunk. A holder that
        steps aside says it waits *before* it lets go, so the job taking its turn sees the GPU
        shared from its first slice on (and serves it at the co-location capacity).

        ``cancel``: once set (the job was interrupted: Ctrl-C, SIGTERM), the rest of the device
        time is abandoned at the end of the current slice (at most ``quantum`` seconds), as a
        killed process's kernels stop; the busy time served so far is accounted.
        """
        remaining, waited, served = max(0.0, seconds), 0.0, 0.0
        fcntl.flock(self._wait_fd, fcntl.LOCK_SH)  # we wait (the kernel drops this if we die)
        try:
            asked = self.clock.monotonic()
            while remaining > 1e-9 and not (cancel is not None and cancel.is_set()):
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                try:
                    fcntl.flock(self._wait_fd, fcntl.LOCK_UN)  # our turn: we no longer wait
                    start = self.clock.monotonic()
                    waited += start - asked
                    remaining, turn = self._serve(remaining, quantum, start, cancel)
                    served += turn
                    if cancel is not None and cancel.is_set():
                        break
                    if remaining > 1e-9:
                        fcntl.flock(self._wait_fd, fcntl.LOCK_SH)  # we wait again, from before we let go
                finally:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                if remaining > 1e-9:
                    asked = self.clock.monotonic()  # the turn given to the waiting job is a wait too
                    time.sleep(YIELD_SECONDS)
        finally:
            fcntl.flock(self._wait_fd, fcntl.LOCK_UN)  # nothing to undo unless an error came while we waited
        return Occupancy(waited, served)

    def _serve(self, remaining: float, quantum: float, start: float,
               cancel: threading.Event | None = None) -> tuple[float, float]:
        """One turn on this GPU (held since ``start``, monotonic seconds): serve ``remaining``
        seconds of device work in slices until it is done, ``cancel`` is set or, after a slice
        while another job waits, that job's turn comes; account the busy time. Returns the device
        seconds left and the seconds the turn lasted as modelled (its slices' lengths: a sleep
        that this machine ends late does not lengthen the turn's work)."""
        previous = self.read()
        total = previous.busy_total if previous is not None else 0.0  # a dead holder's time is lost
        count = previous.acquisitions + 1 if previous is not None else 1
        self.area.write(ACCOUNT.pack(total, start, os.getpid(), _own_ticks() & 0xFFFFFFFF, count))
        served = 0.0
        try:
            while remaining > 1e-9 and not (cancel is not None and cancel.is_set()):
                shared = self._others_waiting()
                gain = self.co_location_capacity if shared else 1.0
                piece = min(quantum, remaining / gain)
                time.sleep(piece)
                served += piece
                remaining -= piece * gain  # while shared, kernels overlap: more work per second
                if remaining > 1e-9 and shared:
                    break
        finally:
            end = self.clock.monotonic()
            self.area.write(ACCOUNT.pack(total + (end - start), 0.0, 0, 0, count))
        return remaining, served

    # --- memory ---------------------------------------------------------------------------------
    @contextmanager
    def _memory_locked(self) -> Iterator[None]:
        """Exclusive access to the reservation table: threads of this process, then processes.

        A POSIX record lock (``lockf``) on the lock file: independent of the ``flock`` that
        serialises device time on Linux, and released by the kernel when its holder dies.
        """
        with self._memory_thread_lock:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, 1, 0)
            try:
                yield
            finally:
                fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, 0)

    def _entries(self) -> list[tuple[int, int, int, int]]:
        """The reservation table: (pid, token, bytes, start ticks) of every entry holding memory."""
        try:
            raw = self.memory_area.read()
        except RecordError:  # never written (RecordEmpty), or unreadable: nobody holds memory we can see
            return []
        entries = [MEMORY_ENTRY.unpack_from(raw, i * MEMORY_ENTRY.size) for i in range(MEMORY_ENTRIES)]
        return [entry for entry in entries if entry[0] > 0 and entry[2] > 0]

    def _live_entries(self) -> list[tuple[int, int, int, int]]:
        """The entries of processes still alive (not of later processes that reuse a dead one's pid)."""
        return [entry for entry in self._entries() if _same_process(entry[0], entry[3])]

    def holders(self) -> set[int]:
        """The pids of the live processes holding memory on this GPU (those with a replica on it,
        as NVML lists a GPU's compute processes)."""
        return {entry[0] for entry in self._live_entries()}

    def memory_info(self) -> MemoryInfo:
        """Total, used (by live processes) and free bytes, as NVML reports them."""
        used = sum(entry[2] for entry in self._live_entries())
        used = min(used, self.memory_bytes)
        return MemoryInfo(self.memory_bytes, used, self.memory_bytes - used)

    def reserve(self, token: int, nbytes: int) -> None:
        """Hold ``nbytes`` on this GPU for ``token`` (of this process), replacing its reservation.

        Raises ``EmulatedOutOfMemory`` (and keeps the old reservation) when ``nbytes`` exceeds the
        memory size minus what other live holders keep. ``nbytes`` 0 releases.
        """
        pid = os.getpid()
        with self._memory_locked():
            live = self._live_entries()
            others = sum(n for p, t, n, _ticks in live if (p, t) != (pid, token))
            mine = sum(n for p, t, n, _ticks in live if (p, t) == (pid, token))
            if nbytes > mine and nbytes > self.memory_bytes - others:
                free = self.memory_bytes - others - mine
                raise EmulatedOutOfMemory(self.index, nbytes - mine, self.memory_bytes, free)
            kept = [entry for entry in live if entry[:2] != (pid, token)]
            if nbytes > 0:
                kept.append((pid, token, int(nbytes), _own_ticks()))
            if len(kept) > MEMORY_ENTRIES:
                raise EmulatedOutOfMemory(self.index, nbytes, self.memory_bytes, 0)  # the table is full
            payload = bytearray(MEMORY_TABLE_SIZE)
            for position, entry in enumerate(kept):
                MEMORY_ENTRY.pack_into(payload, position * MEMORY_ENTRY.size, *entry)
            self.memory_area.write(bytes(payload))

    def _others_waiting(self) -> bool:
        """Whether another job waits for this GPU: one holds a shared lock on the wait file."""
        try:
            fcntl.flock(self._wait_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._wait_fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        """Unmap the segment and close the lock files (a second call does nothing)."""
        if self.closed:
            return
        self.closed = True
        self.segment.close()
        os.close(self._wait_fd)
        os.close(self._lock_fd)


_OPEN: weakref.WeakSet[EmulatedGpu] = weakref.WeakSet()
"""This process's open emulated GPUs, for :func:`_close_inherited`."""


def _close_inherited() -> None:
    """In a forked child (a data-loader worker): close the emulated GPUs inherited from the parent,
    and their homes' descriptors.

    The child's copy of a mapping shows in /proc as a user of the GPU, so the parent, releasing
    its GPUs at exit while a worker still lives, would leave them to a process that never removes
    them (``release_at_exit``): every run with data-loader workers would leave its GPUs in /dev/shm. Closing
    drops only the child's copies: ``flock``s stay with the parent, whose descriptors remain open.
    """
    for gpu in list(_OPEN):
        gpu.close()
        gpu.home.close()


os.register_at_fork(after_in_child=_close_inherited)


def release_emulated_gpus(gpus: Sequence[EmulatedGpu]) -> dict[int, list[int]]:
    """Close ``gpus`` (opened through one home) and let go of their home (``GpuHome.release``):
    this user's own are removed when nothing maps them any more (the last user cleans up, whether
    a job or the manager); the machine's only by their system manager. Returns, for each GPU
    index still in use, the pids using it."""
    if not gpus:
        return {}
    return gpus[0].home.release(gpus)


def open_emulated_gpus(home: GpuHome | IpcNames, indices: Sequence[int], clock: Clock | None = None,
                       memory_bytes: int = DEFAULT_MEMORY_BYTES) -> list[EmulatedGpu]:
    """Open emulated GPUs ``indices`` of a home (this user's of a namespace, given its ``IpcNames``;
    ``memory_bytes`` each where the home does not fix a size), all or none: when one cannot be
    opened (another process uses it with another memory size, an unsafe file), those opened
    before it are released (``release_emulated_gpus``: removed unless another process uses
    them) and the error is raised."""
    home = home if isinstance(home, GpuHome) else UserHome(home)
    opened: list[EmulatedGpu] = []
    try:
        for index in indices:
            opened.append(EmulatedGpu(home, index, clock, memory_bytes=memory_bytes))
    except BaseException:
        try:
            release_emulated_gpus(opened)
        except OSError:  # the folder or the objects went away meanwhile: nothing more to release
            pass
        raise
    return opened


def release_emulated_gpu(gpu: EmulatedGpu) -> list[int]:
    """``release_emulated_gpus`` for one GPU: the pids still using it."""
    return release_emulated_gpus([gpu]).get(gpu.index, [])


def release_at_exit(gpus: Sequence[EmulatedGpu]) -> Callable[[], None]:
    """Register the release of ``gpus`` (``release_emulated_gpu``) at this process's exit, so a job
    that never closes its backend leaves no emulated GPU behind; returns the registered callable,
    for ``atexit.unregister`` once the GPUs are released earlier. A forked child (a data-loader
    worker) that reaches its own exit releases nothing: the GPUs are its parent's."""
    handle = functools.partial(_release_if_owner, tuple(gpus), os.getpid())
    atexit.register(handle)
    return handle


def _release_if_owner(gpus: tuple[EmulatedGpu, ...], owner: int) -> None:
    if os.getpid() != owner:
        return
    try:
        release_emulated_gpus(gpus)
    except OSError:  # the folder or the objects went away: nothing more to do at exit
        pass


def remove_emulated_gpus(names: IpcNames, count: int) -> None:
    """Remove the shared objects of this user's emulated GPUs 0..count-1 of a namespace (after a run)."""
    for index in range(count):
        remove_user_gpu(names, index, ignored=FileNotFoundError)


@dataclass(frozen=True)
class EmulatedSpec:
    """How many emulated GPUs, and the memory of each (bytes)."""

    count: int
    memory_bytes: int = DEFAULT_MEMORY_BYTES


def emulated_spec(argument: str | None = None) -> EmulatedSpec:
    """Parse ``N`` or ``N:MEMORY`` (e.g. ``4``, ``4:16GiB``): ``argument`` (from ``--source
    emulated:4:16GiB``) or ``DRBALANCE_EMULATED_GPUS``. Every process of a namespace should use
    the same memory size (a different one is refused while another process uses the GPU)."""
    raw = argument or env.emulated_gpus()
    if not raw:
        raise ValueError("how many emulated GPUs? use --source emulated:N or set DRBALANCE_EMULATED_GPUS=N")
    count_text, _, memory_text = raw.partition(":")
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(f"emulated GPU count must be an integer (N or N:MEMORY, e.g. 4:16GiB); got {raw!r}") from None
    if not 1 <= count <= 32:
        raise ValueError(f"emulated GPU count must be 1..32; got {count}")
    memory = parse_memory_size(memory_text) if memory_text else DEFAULT_MEMORY_BYTES
    return EmulatedSpec(count, memory)


class EmulatedSource:
    """Utilisation of emulated GPUs: percent of each sample period during which one was occupied.

    A per-user manager's (``open``) are its user's GPUs of its namespace: when it is closed (the
    manager stops), it removes the objects of its emulated GPUs unless another process still maps
    one (a job training on): those are left for the last user (``remove_emulated_gpus``). A system
    manager's (``for_machine``) are the machine's, which every user's jobs share: it makes them,
    and removes them when it is closed unless a job still uses one (then the next system manager
    adopts them).
    """

    name = "emulated"

    def __init__(self, home: GpuHome | IpcNames, indices: Sequence[int], clock: Clock | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.clock = clock or SystemClock()
        self.home = home if isinstance(home, GpuHome) else UserHome(home)
        self.gpus = open_emulated_gpus(self.home, indices, self.clock, memory_bytes)
        self._last: tuple[float, list[float]] | None = None
        self.left_in_use: dict[int, list[int]] = {}  # after close: GPU index -> pids still using it

    @classmethod
    def open(cls, argument: str, gpus: Sequence[int] | None = None, namespace: str | None = None) -> EmulatedSource:
        """This user's emulated GPUs of ``namespace``: ``argument`` is ``N`` or ``N:MEMORY`` (empty:
        ``DRBALANCE_EMULATED_GPUS``); ``gpus``: the indices reported (default all). Where the
        machine's system folder publishes emulated GPUs (``emulated.json``), the jobs of the
        namespace train on those, so the source reads them: the load of every user's jobs, as NVML
        reads a real GPU's (it never makes or removes the machine's GPUs)."""
        from drbalance.emu.machine import MachineHome
        from drbalance.emu.view import machine_place

        spec = emulated_spec(argument)
        names = IpcNames.current(namespace)
        place = machine_place(names.namespace)
        home = MachineHome.open(place) if place is not None else None
        if home is not None:
            try:
                return cls(home, _reported(gpus, home.spec.count), memory_bytes=home.spec.memory_bytes)
            except BaseException:
                home.close()
                raise
        return cls(names, _reported(gpus, spec.count), memory_bytes=spec.memory_bytes)

    @classmethod
    def for_machine(cls, place: SystemPlace, argument: str | None, gpus: Sequence[int] | None,
                    clock: Clock | None = None) -> EmulatedSource:
        """The machine's emulated GPUs in the system manager's folder ``place`` (``system.create``):
        ``argument`` is ``N`` or ``N:MEMORY`` (None or empty: ``DRBALANCE_EMULATED_GPUS``); all N
        are made, with ``emulated.json`` (``drbalance.emu.machine``), and ``gpus`` are reported
        (default all). GPUs a previous system manager left while jobs still use them are adopted
        (``ValueError`` unless they are N of MEMORY). ``UnsafePath`` unless this process is
        ``place``'s owner."""
        from drbalance.emu.machine import MachineHome

        spec = emulated_spec(argument)
        indices = _reported(gpus, spec.count)
        home = MachineHome.create(place, spec.count, spec.memory_bytes)
        try:
            return cls(home, indices, clock, spec.memory_bytes)
        except BaseException:
            home.release([])  # removes what it made, unless jobs use GPUs it adopted
            raise

    def gpu_uuids(self) -> tuple[str | None, ...]:
        """Each reported GPU's UUID (``GPU-...``), in report order."""
        return tuple(gpu.uuid for gpu in self.gpus)

    def memory(self) -> tuple[MemoryInfo | None, ...]:
        """Each reported GPU's memory (bytes), as ``nvmlDeviceGetMemoryInfo`` gives it."""
        return tuple(gpu.memory_info() for gpu in self.gpus)

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
        """Release the GPUs (``GpuHome.release``); ``left_in_use`` then names those still in use."""
        gpus, self.gpus = self.gpus, []
        self.left_in_use.update(self.home.release(gpus))


def _reported(gpus: Sequence[int] | None, count: int) -> list[int]:
    """The indices a source reports (``--gpus``; default all ``count``), checked."""
    indices = list(range(count)) if gpus is None else list(gpus)
    if any(not 0 <= g < count for g in indices):
        raise ValueError(f"--gpus {indices} outside the {count} emulated GPUs")
    return indices
