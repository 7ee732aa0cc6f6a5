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
``nvmlDeviceGetMemoryInfo`` does, and ``uuid`` is a stable ``GPU-...`` name derived from the user,
the namespace and the index, so the manager's UUID mapping is exercised on CPU-only machines.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import math
import os
import re
import struct
import threading
import time
import uuid as uuidlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import posix_ipc

from drbalance import env
from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.layout import STATUS_OFFSET, RecordError, SegmentKind
from drbalance.ipc.names import IpcNames, assign_emulated_token
from drbalance.ipc.private import open_private, remove_private
from drbalance.ipc.records import RecordEmpty, Segment
from drbalance.manager.nvml import MemoryInfo
from drbalance.workload.models import CO_LOCATION_CAPACITY

# busy seconds so far, busy since (monotonic, 0 = idle), holder pid, the low 32 bits of its start time
# (clock ticks since boot, 0 = unknown: see _same_process), count
ACCOUNT = struct.Struct("<ddiIQ")
DEFAULT_QUANTUM = 0.05  # seconds of device time between chances for another job to take its turn
GUARD_PATIENCE = 2.0  # seconds to wait for the namespace guard before going on without it
YIELD_SECONDS = 0.002  # how long a holder steps aside after its turn when another job waits
DEFAULT_MEMORY_BYTES = 24 * 2**30  # the paper's Quadro RTX 6000 (24 GB)
MAX_MEMORY_BYTES = 2**50  # 1 PiB: what the segment records in 8 bytes, with room to spare
MEMORY_OFFSET = 256  # the reservation table's area in the segment (after the busy-time account)
MEMORY_ENTRIES = 32  # processes (backends) that can hold memory on one emulated GPU at once
# pid, token (one per backend object), reserved bytes, the process's start time (clock ticks since boot)
MEMORY_ENTRY = struct.Struct("<iIQQ")
MEMORY_TABLE_SIZE = MEMORY_ENTRIES * MEMORY_ENTRY.size
SPEC_OFFSET = 2048  # the memory size area (after the reservation table), written by the GPU's creator
SPEC = struct.Struct("<Q")  # the emulated GPU's memory size, bytes
SPEC_PATIENCE = 1.0  # seconds to wait for a creator to write the memory size before taking it as unset
UUID_NAMESPACE = uuidlib.UUID("6f0b1d7e-3c1a-5b7e-9d2f-4a8c0e5b2d11")  # fixed: the same UUIDs in every process
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
              "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class EmulatedOutOfMemory(RuntimeError):
    """An emulated GPU has not enough free memory (the client raises it as torch's OutOfMemoryError)."""

    def __init__(self, index: int, requested: int, total: int, free: int) -> None:
        self.index, self.requested, self.total, self.free = index, requested, total, free
        super().__init__(
            f"Emulated GPU out of memory. Tried to allocate {_size(requested)}. GPU {index} has a total capacity of "
            f"{_size(total)} of which {_size(max(0, free))} is free (emulated by drbalance: no real GPU memory is used)"
        )


def _size(nbytes: float) -> str:
    """Bytes as CUDA's messages write them (GiB, MiB), or plain bytes below a MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{int(nbytes)} bytes"


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


def check_memory_size(nbytes: int, shown: str | None = None) -> None:
    """``ValueError`` unless ``nbytes`` is a possible emulated GPU memory size: 1 byte to 1 PiB."""
    if not 1 <= nbytes <= MAX_MEMORY_BYTES:
        raise ValueError(f"emulated GPU memory must be > 0 bytes and at most 1 PiB ({MAX_MEMORY_BYTES} bytes); "
                         f"got {shown or nbytes}")


def emulated_uuid(names: IpcNames, index: int) -> str:
    """The UUID of emulated GPU ``index`` of a namespace, in NVML's form (``GPU-xxxxxxxx-...``)."""
    return f"GPU-{uuidlib.uuid5(UUID_NAMESPACE, f'{os.getuid()}/{names.namespace}/{index}')}"


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
    """One emulated GPU of a namespace (created on first use, shared by all its processes)."""

    def __init__(self, names: IpcNames, index: int, clock: Clock | None = None,
                 co_location_capacity: float = CO_LOCATION_CAPACITY, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if index < 0:
            raise ValueError(f"emulated GPU index must be >= 0; got {index}")
        check_memory_size(memory_bytes)
        self.names = names
        self.index = index
        self.clock = clock or SystemClock()
        self.co_location_capacity = co_location_capacity
        self.memory_bytes = int(memory_bytes)
        self.uuid = emulated_uuid(names, index)
        lock_path = names.emulated_lock(index)
        objects.ensure_private_dir(lock_path.parent.parent)
        objects.ensure_private_dir(lock_path.parent)
        with _namespace_guard(names, exclusive=False):  # not removed while we open its files and map it
            self._lock_fd, _ = open_private(lock_path, os.O_RDWR | os.O_CREAT, private=True)  # no link, ours, 0600
            segment = None
            try:
                segment, created = _open_or_create_owned(names, index, self._lock_fd)
                _agree_on_memory(segment, names, index, self.memory_bytes, created)
                self._wait_fd, _ = open_private(names.emulated_wait_lock(index), os.O_RDWR | os.O_CREAT,
                                                private=True)
            except BaseException:
                os.close(self._lock_fd)
                if segment is not None:
                    segment.close()
                raise
            self.segment = segment
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
    """In a forked child (a data-loader worker): close the emulated GPUs inherited from the parent.

    The child's copy of a mapping shows in /proc as a user of the GPU, so the parent, releasing
    its GPUs at exit while a worker still lives, would leave them to a process that never removes
    them (``release_at_exit``): every run with data-loader workers would leave its GPUs in /dev/shm. Closing
    drops only the child's copies: ``flock``s stay with the parent, whose descriptors remain open.
    """
    for gpu in list(_OPEN):
        gpu.close()


os.register_at_fork(after_in_child=_close_inherited)


def _open_or_create(name: str) -> tuple[Segment, bool]:
    """The segment ``name``, and whether this call created it."""
    for _ in range(50):
        try:
            return Segment.create(name, SegmentKind.EMULATED_GPU), True
        except posix_ipc.ExistentialError:
            pass
        try:
            return Segment.open(name, SegmentKind.EMULATED_GPU), False
        except RecordEmpty:
            time.sleep(0.01)  # another process is initialising it right now
        except posix_ipc.ExistentialError:
            continue  # removed between our two calls: create it again
    raise RuntimeError(f"could not open emulated GPU segment {name}")


def _open_or_create_owned(names: IpcNames, index: int, lock_fd: int, attempts: int = 5) -> tuple[Segment, bool]:
    """``_open_or_create`` for emulated GPU ``index`` under the name its lock file gives
    (``assign_emulated_token``); a name another user took between that and the opening is left
    to them, and the next attempt chooses another."""
    for _ in range(attempts - 1):
        try:
            return _open_or_create(assign_emulated_token(names, index, lock_fd))
        except objects.ForeignObject:
            continue
    return _open_or_create(assign_emulated_token(names, index, lock_fd))


def _agree_on_memory(segment: Segment, names: IpcNames, index: int, memory_bytes: int, created: bool) -> None:
    """Make every process of the namespace use one memory size (bytes) for emulated GPU ``index``.

    Its creator records its size in the segment; a process that asks for another size while
    another process maps the GPU gets a ``ValueError`` naming both (with a size per process, a manager
    would cap shares by one size while its jobs reserve up to another). A GPU that
    nobody else maps (left behind by a killed job), or that no creator has sized yet within
    ``SPEC_PATIENCE`` seconds (one made by a release that records no size), takes this process's
    size.
    Call with the namespace guard held (shared), so that no remover runs meanwhile.
    """
    area = segment.area(SPEC_OFFSET, SPEC.size, f"emulated GPU {index} memory size")
    if created:
        area.write(SPEC.pack(memory_bytes))
        return
    deadline = time.monotonic() + SPEC_PATIENCE
    while True:
        try:
            recorded = SPEC.unpack(area.read())[0]
            break
        except RecordError:  # its creator has not written it yet (or never will: a release that records no size)
            if time.monotonic() >= deadline:
                recorded = None
                break
            time.sleep(0.01)
    if recorded == memory_bytes:
        return
    if recorded is not None:
        users = [pid for pid in objects.shm_users(segment.name) if pid != os.getpid()]
        if users:
            raise ValueError(
                f"emulated GPU {index} of namespace {names.namespace!r} has {_size(recorded)} of memory "
                f"({recorded} bytes) for the processes using it ({', '.join(map(str, users[:8]))}), but this "
                f"process asks for {_size(memory_bytes)} ({memory_bytes} bytes): give every process of the "
                f"namespace the same spec (DRBALANCE_EMULATED_GPUS=N:MEMORY, --source emulated:N:MEMORY, "
                f"--devices emulated:N:MEMORY; default {_size(DEFAULT_MEMORY_BYTES)})")
    area.write(SPEC.pack(memory_bytes))


@contextmanager
def _namespace_guard(names: IpcNames, exclusive: bool, patience: float = GUARD_PATIENCE) -> Iterator[bool]:
    """Hold a ``flock`` on the namespace's runtime folder: shared while a process opens an emulated
    GPU's files and maps its segment, exclusive while one checks that nobody maps it and removes it,
    so a GPU is never removed between another process's opening and its mapping (which would leave
    two jobs on two different copies of "the same" GPU). Yields whether the lock was taken: after
    ``patience`` seconds (a holder stopped with SIGSTOP) or without the folder it goes on unguarded
    rather than hang."""
    try:
        fd: int | None = os.open(names.runtime_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = None
    try:
        yield fd is not None and _flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, patience)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _flock_within(fd: int, operation: int, patience: float) -> bool:
    """Take ``flock(fd, operation)``, trying for up to ``patience`` seconds; whether it was taken."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def release_emulated_gpus(gpus: Sequence[EmulatedGpu]) -> dict[int, list[int]]:
    """Close ``gpus`` (of one namespace) and remove the shared objects of each that nothing maps
    any more: the last user cleans up, whether a job or the manager. This process counts as a
    user while another of its objects (a second model's backend) still maps a GPU: ``gpus`` are
    unmapped first, so only such others show. Returns, for each GPU index still in use, the pids
    using it."""
    if not gpus:
        return {}
    for gpu in gpus:
        gpu.close()
    names = gpus[0].names
    with _namespace_guard(names, exclusive=True) as guarded:
        mapping = objects.shm_users_of([names.emulated_gpu(gpu.index) for gpu in gpus])  # one pass over /proc
        in_use = {}
        for gpu in gpus:
            users = mapping[names.emulated_gpu(gpu.index)]
            if users:
                in_use[gpu.index] = users
            elif guarded:
                _remove_gpu(names, gpu.index, ignored=OSError)
    return in_use


def open_emulated_gpus(names: IpcNames, indices: Sequence[int], clock: Clock | None = None,
                       memory_bytes: int = DEFAULT_MEMORY_BYTES) -> list[EmulatedGpu]:
    """Open emulated GPUs ``indices`` of a namespace (``memory_bytes`` each), all or none: when one
    cannot be opened (another process uses it with another memory size, an unsafe file), those
    opened before it are released (``release_emulated_gpus``: removed unless another process
    uses them) and the error is raised."""
    opened: list[EmulatedGpu] = []
    try:
        for index in indices:
            opened.append(EmulatedGpu(names, index, clock, memory_bytes=memory_bytes))
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
    """Remove the shared objects of emulated GPUs 0..count-1 (after a run)."""
    for index in range(count):
        _remove_gpu(names, index, ignored=FileNotFoundError)


def _remove_gpu(names: IpcNames, index: int, ignored: type[OSError]) -> None:
    """Unlink emulated GPU ``index``'s segment, lock file and wait file (and the waiter semaphore
    that older releases made); a file that cannot be removed for an ``ignored`` reason stays."""
    objects.unlink_shared_memory(names.emulated_gpu(index))
    objects.unlink_semaphore(names.emulated_waiters(index))
    for path in (names.emulated_lock(index), names.emulated_wait_lock(index)):
        try:
            remove_private(path, private=True)  # False when it is gone already
        except ignored:
            pass


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

    It belongs to one namespace (the manager's ``--namespace``). When it is closed (the manager
    stops), it removes the objects of its emulated GPUs unless another process still maps one
    (a job training on): those are left for the last user (``remove_emulated_gpus``).
    """

    name = "emulated"

    def __init__(self, names: IpcNames, indices: Sequence[int], clock: Clock | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.clock = clock or SystemClock()
        self.names = names
        self.gpus = open_emulated_gpus(names, indices, self.clock, memory_bytes)
        self._last: tuple[float, list[float]] | None = None
        self.left_in_use: dict[int, list[int]] = {}  # after close: GPU index -> pids still using it

    @classmethod
    def open(cls, argument: str, gpus: Sequence[int] | None = None, namespace: str | None = None) -> EmulatedSource:
        spec = emulated_spec(argument)
        count = spec.count
        indices = list(range(count)) if gpus is None else list(gpus)
        if any(not 0 <= g < count for g in indices):
            raise ValueError(f"--gpus {indices} outside the {count} emulated GPUs")
        return cls(IpcNames.current(namespace), indices, memory_bytes=spec.memory_bytes)

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
        self.left_in_use.update(release_emulated_gpus(self.gpus))
        self.gpus = []
