"""Where emulated GPUs live: their lock files, their segment's name, who owns them, who makes them.

An emulated GPU (``drbalance.emu.gpus.EmulatedGpu``) is two lock files and a shared-memory
segment in a *home*, which says where they are and who may make them (``GpuHome``):

- ``UserHome``: one user's emulated GPUs of one namespace. The lock files are private files in
  the user's runtime directory, the segment is ``/drb.<uid>.<ns>.emu.<i>.<token>`` (mode 0600,
  its token kept in the lock file) and every process of the user creates a GPU on first use and
  removes it when it is the last to let go.
- ``drbalance.emu.machine.MachineHome``: the machine's emulated GPUs, made by its system manager
  and shared by every user's jobs.

A UUID names each GPU of a home the same way in every process, so the manager maps a job's
devices to its own GPUs by UUID as it does with NVML.
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid as uuidlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import posix_ipc

from drbalance.emu.layout import DEFAULT_MEMORY_BYTES, SPEC, SPEC_OFFSET, size_text
from drbalance.ipc import objects
from drbalance.ipc.layout import RecordError, SegmentKind
from drbalance.ipc.names import IpcNames, assign_emulated_token
from drbalance.ipc.private import open_private, remove_private
from drbalance.ipc.records import RecordEmpty, Segment

if TYPE_CHECKING:
    from drbalance.emu.gpus import EmulatedGpu

GUARD_PATIENCE = 2.0  # seconds to wait for the namespace guard before going on without it
SPEC_PATIENCE = 1.0  # seconds to wait for a creator to write the memory size before taking it as unset
UUID_NAMESPACE = uuidlib.UUID("6f0b1d7e-3c1a-5b7e-9d2f-4a8c0e5b2d11")  # fixed: the same UUIDs in every process


class GpuHome(ABC):
    """Where a set of emulated GPUs lives, and who may make them.

    ``namespace``: the drbalance namespace of the GPUs. ``owner``: the uid that must own every
    file and segment of them (root's are accepted too where others' GPUs are opened). ``makes``:
    whether this process creates missing GPUs and removes those nobody uses any more.
    """

    namespace: str
    owner: int
    makes: bool

    @property
    def memory_bytes(self) -> int | None:
        """The memory size (bytes) of every GPU here when the home fixes it; None when each
        process asks for one and the GPU's creator's is agreed on."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """Whose GPUs these are, for messages."""

    @abstractmethod
    def uuid(self, index: int) -> str:
        """GPU ``index``'s UUID in NVML's form (``GPU-xxxxxxxx-...``)."""

    @abstractmethod
    def lock_path(self, index: int) -> Path:
        """GPU ``index``'s lock file: an exclusive ``flock`` is its turn, a ``lockf`` its memory table's lock."""

    @abstractmethod
    def wait_path(self, index: int) -> Path:
        """The file on which jobs waiting for GPU ``index`` hold a shared ``flock``."""

    @abstractmethod
    def segment_name(self, index: int) -> str:
        """GPU ``index``'s shared-memory segment (busy time, memory table, memory size)."""

    @abstractmethod
    def open_files(self, index: int) -> tuple[int, int]:
        """Descriptors of GPU ``index``'s lock file (open for writing: ``lockf`` needs it) and wait
        file, each checked to be the owner's regular file."""

    @abstractmethod
    def open_segment(self, index: int, lock_fd: int, memory_bytes: int) -> Segment:
        """GPU ``index``'s segment, mapped and checked; ``memory_bytes``: the size this process asks
        for (refused where the home's processes must agree on another)."""

    def guard(self, exclusive: bool) -> AbstractContextManager[bool]:
        """Held while a process opens a GPU's files and maps its segment (shared) or checks that
        nobody maps it and removes it (exclusive); yields whether the lock was taken."""
        return nullcontext(True)

    @abstractmethod
    def release(self, gpus: Sequence[EmulatedGpu]) -> dict[int, list[int]]:
        """Close ``gpus`` (opened through this home) and let go of the home; remove the GPUs nobody
        else uses where this process makes them. Returns, per GPU index still in use, the pids
        known to use it."""

    @abstractmethod
    def close(self) -> None:
        """Let go of what the home holds open; a second call does nothing."""


# --- one user's emulated GPUs ----------------------------------------------------------------------
def emulated_uuid(names: IpcNames, index: int) -> str:
    """The UUID of this user's emulated GPU ``index`` of a namespace (``GPU-xxxxxxxx-...``)."""
    return f"GPU-{uuidlib.uuid5(UUID_NAMESPACE, f'{names.uid}/{names.namespace}/{index}')}"


class UserHome(GpuHome):
    """One user's emulated GPUs of a namespace: private files in the runtime directory, segments
    ``/drb.<uid>.<ns>.emu.<i>.<token>``, made by the first process to use a GPU and removed by the
    last to let go of it."""

    makes = True

    def __init__(self, names: IpcNames) -> None:
        self.names = names
        self.namespace = names.namespace
        self.owner = os.geteuid()

    def describe(self) -> str:
        return f"this user's emulated GPUs of namespace {self.namespace!r}"

    def uuid(self, index: int) -> str:
        return emulated_uuid(self.names, index)

    def lock_path(self, index: int) -> Path:
        return self.names.emulated_lock(index)

    def wait_path(self, index: int) -> Path:
        return self.names.emulated_wait_lock(index)

    def segment_name(self, index: int) -> str:
        return self.names.emulated_gpu(index)

    def open_files(self, index: int) -> tuple[int, int]:
        lock_fd, _ = open_private(self.lock_path(index), os.O_RDWR | os.O_CREAT, private=True)  # no link, ours, 0600
        try:
            wait_fd, _ = open_private(self.wait_path(index), os.O_RDWR | os.O_CREAT, private=True)
        except BaseException:
            os.close(lock_fd)
            raise
        return lock_fd, wait_fd

    def open_segment(self, index: int, lock_fd: int, memory_bytes: int) -> Segment:
        segment, created = _open_or_create_owned(self.names, index, lock_fd)
        try:
            _agree_on_memory(segment, self.names, index, memory_bytes, created)
        except BaseException:
            segment.close()
            raise
        return segment

    def guard(self, exclusive: bool) -> AbstractContextManager[bool]:
        """The namespace guard (``_namespace_guard``); an opener first makes the runtime directory
        (private, 0700) where missing."""
        if not exclusive:
            self.names.private_runtime_dir()
        return _namespace_guard(self.names, exclusive)

    def close(self) -> None:
        """Nothing to let go of: a user's home holds nothing open."""

    def release(self, gpus: Sequence[EmulatedGpu]) -> dict[int, list[int]]:
        """Close ``gpus`` and remove the shared objects of each that nothing maps any more: the
        last user cleans up, whether a job or the manager. This process counts as a user while
        another of its objects (a second model's backend) still maps a GPU: ``gpus`` are unmapped
        first, so only such others show."""
        for gpu in gpus:
            gpu.close()
        with self.guard(exclusive=True) as guarded:
            mapping = objects.shm_users_of([self.segment_name(gpu.index) for gpu in gpus])  # one pass over /proc
            in_use = {}
            for gpu in gpus:
                users = mapping[self.segment_name(gpu.index)]
                if users:
                    in_use[gpu.index] = users
                elif guarded:
                    remove_user_gpu(self.names, gpu.index, ignored=OSError)
        return in_use


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
                f"emulated GPU {index} of namespace {names.namespace!r} has {size_text(recorded)} of memory "
                f"({recorded} bytes) for the processes using it ({', '.join(map(str, users[:8]))}), but this "
                f"process asks for {size_text(memory_bytes)} ({memory_bytes} bytes): give every process of the "
                f"namespace the same spec (DRBALANCE_EMULATED_GPUS=N:MEMORY, --source emulated:N:MEMORY, "
                f"--devices emulated:N:MEMORY; default {size_text(DEFAULT_MEMORY_BYTES)})")
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
        yield fd is not None and flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, patience)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def flock_within(fd: int, operation: int, patience: float) -> bool:
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


def remove_user_gpu(names: IpcNames, index: int, ignored: type[OSError]) -> None:
    """Unlink this user's emulated GPU ``index``'s segment, lock file and wait file (and the waiter
    semaphore that older releases made); a file that cannot be removed for an ``ignored`` reason stays."""
    objects.unlink_shared_memory(names.emulated_gpu(index))
    objects.unlink_semaphore(names.emulated_waiters(index))
    for path in (names.emulated_lock(index), names.emulated_wait_lock(index)):
        try:
            remove_private(path, private=True)  # False when it is gone already
        except ignored:
            pass
