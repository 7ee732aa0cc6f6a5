"""Shared-memory records: seqlocked areas in a named segment (see ``layout`` for the bytes).

Writer protocol (one writer per area): bump the counter to odd, write the payload and its CRC,
bump the counter to even. Reader: read the counter, the payload and the CRC, read the counter
again; accept only if both counter reads are equal and even and the CRC matches. A reader never
blocks: after a bounded number of attempts it reports the area busy.

A segment's descriptor stays open and its size is checked (``fstat``) before every access of
the mapping: touching the mapping of a segment that someone truncated would kill the process
with SIGBUS. A truncated segment is a ``SegmentTruncated`` error; its creator can ``repair`` it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
import zlib
from collections.abc import Callable

import posix_ipc

from drbalance.ipc import objects
from drbalance.ipc.discovery import AppNameInUse, read_claim
from drbalance.ipc.layout import (
    AREA_HEADER,
    COMMAND_OFFSET,
    LAYOUT_VERSION,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_SIZE,
    STATUS_OFFSET,
    AppCommand,
    AppStatus,
    ManagerBeat,
    RecordError,
    SegmentKind,
)
from drbalance.ipc.names import IpcNames, new_token

__all__ = [
    "AppNameInUse", "AppRecord", "ManagerRecord", "RecordBusy", "RecordEmpty", "Segment", "SegmentTruncated",
    "SeqlockArea",
]


class RecordEmpty(RecordError):
    """The area has never been written."""


class RecordBusy(RecordError):
    """The area was being rewritten on every attempt (or its writer died mid-write)."""


class SegmentTruncated(RecordError):
    """The segment is smaller than its layout: reading its mapping would raise SIGBUS."""


class SeqlockArea:
    """One area of a segment: a seqlock counter, a CRC32 and a fixed-size payload.

    The counter and CRC are read and written through a ``uint32`` memoryview, i.e. as single
    aligned 4-byte loads and stores (``struct.pack_into('<I')`` writes byte by byte, and a
    reader could then see a half-updated counter). ``guard`` is called before every access; it
    raises when the mapping may not be touched (see ``Segment.check_size``).
    """

    def __init__(self, words: memoryview, mapping: mmap.mmap, offset: int, payload_size: int, where: str,
                 guard: Callable[[], None] | None = None) -> None:
        if offset % 4:
            raise ValueError(f"{where}: area offset {offset} is not 4-byte aligned")
        self.words = words
        self.mapping = mapping
        self.offset = offset
        self.counter_index = offset // 4
        self.crc_index = offset // 4 + 1
        self.start = offset + AREA_HEADER.size
        self.end = self.start + payload_size
        self.where = where
        self.guard = guard or (lambda: None)
        self.last_counter = -1  # the counter value of the last payload returned by read()
        self.stuck_counter = -1  # an odd counter that a whole read() waited on in vain

    def counter(self) -> int:
        """The seqlock counter now (after checking that the mapping may be read)."""
        self.guard()
        return self.words[self.counter_index]

    def write(self, payload: bytes) -> None:
        if len(payload) != self.end - self.start:
            raise ValueError(f"{self.where}: payload of {len(payload)} bytes, area holds {self.end - self.start}")
        self.guard()
        words, index = self.words, self.counter_index
        counter = words[index]
        odd = (counter + 1 if counter % 2 == 0 else counter + 2) & 0xFFFFFFFF
        words[index] = odd
        self.mapping[self.start:self.end] = payload
        words[self.crc_index] = zlib.crc32(payload)
        words[index] = (odd + 1) & 0xFFFFFFFF

    def read(self, attempts: int = 200) -> bytes:
        """The payload of the last complete write. Raises ``RecordEmpty`` if the area was never
        written, ``RecordError`` on a checksum mismatch, and ``RecordBusy`` while a write is under
        way: after ``attempts`` tries (about 20 ms), or at once if the counter still shows the
        write that the last read waited for in vain (its writer was killed mid-write; the next
        write recovers the area), so a dead writer does not cost every later read its wait."""
        self.guard()
        words, index = self.words, self.counter_index
        if words[index] == self.stuck_counter:
            raise RecordBusy(f"{self.where}: still being written (counter {self.stuck_counter} unchanged since "
                             "the last read waited for it: its writer stopped mid-write?)")
        zero_counters, before = 0, -1
        for attempt in range(attempts):
            before = words[index]
            if before == 0:
                zero_counters += 1
                if zero_counters >= 3:
                    raise RecordEmpty(f"{self.where}: never written")
                continue
            if before % 2 == 0:
                payload = self.mapping[self.start:self.end]
                crc = words[self.crc_index]
                if words[index] == before:
                    if zlib.crc32(payload) == crc:
                        self.last_counter = before
                        return payload
                    if attempt >= 3:  # stable counter, wrong CRC: not a race, corrupted bytes
                        raise RecordError(f"{self.where}: checksum mismatch (corrupted record)")
            if attempt > 20:
                time.sleep(0.0001)
                self.guard()
        now = words[index]
        if now % 2 and now == before:
            self.stuck_counter = now
        raise RecordBusy(f"{self.where}: still being written after {attempts} attempts")


def _check_header(mapping: mmap.mmap, name: str, kind: SegmentKind) -> None:
    """``RecordError`` (``RecordEmpty`` before it is written) unless the segment's header is this
    layout's, of ``kind``."""
    magic, version, found, status, command = SEGMENT_HEADER.unpack_from(mapping, 0)
    if magic != SEGMENT_MAGIC:
        raise RecordEmpty(f"{name}: bad magic {magic!r} (not initialised, or not a drbalance record)")
    if version != LAYOUT_VERSION:
        raise RecordError(f"{name}: layout version {version}, this build reads {LAYOUT_VERSION}")
    if found != kind or status != STATUS_OFFSET or command != COMMAND_OFFSET:
        raise RecordError(f"{name}: segment kind {found} / offsets {status},{command} unexpected")


class DescriptorMemory:
    """The descriptor of a segment with no name (a memfd): what ``Segment`` uses of a
    ``posix_ipc.SharedMemory``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._closed = False

    def close_fd(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)


class Segment:
    """A shared-memory segment with a header and up to two seqlocked areas: named (in /dev/shm)
    or a sealed memfd passed between processes (``create_sealed``, ``adopt``)."""

    def __init__(self, name: str, memory: posix_ipc.SharedMemory | DescriptorMemory, mapping: mmap.mmap,
                 kind: SegmentKind) -> None:
        self.name = name
        self.memory = memory
        self.mapping = mapping
        self.kind = kind
        self.words = memoryview(mapping).cast("I")  # native uint32: atomic aligned loads/stores

    @classmethod
    def create(cls, name: str, kind: SegmentKind, mode: int = objects.PRIVATE_MODE) -> Segment:
        """Create the segment ``name`` (``posix_ipc.ExistentialError`` if it exists), mode 0600 or ``mode``."""
        memory, mapping = objects.create_shared_memory(name, SEGMENT_SIZE, mode)
        segment = cls(name, memory, mapping, kind)
        segment._write_header()
        return segment

    @classmethod
    def open(cls, name: str, kind: SegmentKind, owner: int | None = None) -> Segment:
        """Open an existing segment and check its header.

        ``RecordError`` if it is not a readable segment of this layout, ``objects.ForeignObject``
        if it is not this user's (``owner``: that user's or root's), ``posix_ipc.ExistentialError``
        if it does not exist.
        """
        try:
            memory, mapping = objects.open_shared_memory(name, owner=owner)
        except ValueError as error:
            raise SegmentTruncated(f"{name}: {error}") from None
        try:
            if len(mapping) < SEGMENT_SIZE:
                raise SegmentTruncated(f"{name}: {len(mapping)} bytes, expected {SEGMENT_SIZE}")
            _check_header(mapping, name, kind)
        except BaseException:
            mapping.close()
            memory.close_fd()
            raise
        return cls(name, memory, mapping, kind)

    @classmethod
    def create_sealed(cls, label: str, kind: SegmentKind) -> Segment:
        """A new segment with no name: a memfd sealed at its size, so a mapping of it can never
        fault (what a job passes to a system manager, ``drbalance.ipc.peer``). ``label`` names it in
        messages and in /proc (``memfd:<label>``). ``OSError`` when there is no memory for its pages."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SEGMENT_SIZE)
            objects.back_pages(fd, SEGMENT_SIZE, fresh=True)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, SEGMENT_SIZE)
        except BaseException:
            os.close(fd)
            raise
        segment = cls(f"memfd:{label}", DescriptorMemory(fd), mapping, kind)
        segment._write_header()
        return segment

    @classmethod
    def adopt(cls, fd: int, label: str, kind: SegmentKind) -> Segment:
        """The segment open as ``fd`` (passed by its creator and checked by the caller: a sealed
        memfd of ``SEGMENT_SIZE`` bytes), mapped; ``RecordError`` unless its header is this
        layout's. The descriptor is the segment's from now on (closed with it, or here on error)."""
        try:
            mapping = mmap.mmap(fd, SEGMENT_SIZE)
        except BaseException:
            os.close(fd)
            raise
        try:
            _check_header(mapping, label, kind)
        except BaseException:
            mapping.close()
            os.close(fd)
            raise
        return cls(label, DescriptorMemory(fd), mapping, kind)

    def _write_header(self) -> None:
        SEGMENT_HEADER.pack_into(self.mapping, 0, SEGMENT_MAGIC, LAYOUT_VERSION, int(self.kind), STATUS_OFFSET,
                                 COMMAND_OFFSET)

    def check_size(self) -> None:
        """``SegmentTruncated`` unless the whole layout is still backed (then the mapping may be touched)."""
        try:
            size = os.fstat(self.memory.fd).st_size
        except (OSError, ValueError):
            raise SegmentTruncated(f"{self.name}: closed") from None
        if size < SEGMENT_SIZE:
            raise SegmentTruncated(f"{self.name}: truncated to {size} bytes, expected {SEGMENT_SIZE}")

    def header_intact(self) -> bool:
        """Whether the header still says what ``create`` wrote (call after ``check_size``)."""
        return SEGMENT_HEADER.unpack_from(self.mapping, 0) == (
            SEGMENT_MAGIC, LAYOUT_VERSION, int(self.kind), STATUS_OFFSET, COMMAND_OFFSET)

    def repair(self) -> bool:
        """Give a truncated segment its size and header back, and an overwritten header its
        values (for its creator: readers refuse a segment whose header is wrong); True if it was
        needed.

        The areas of a truncated one read as never written until their writers write them again.
        ``OSError`` (with the segment left as it was found) if /dev/shm has no room for its pages.
        """
        try:
            self.check_size()
        except SegmentTruncated:
            objects.back_pages(self.memory.fd, SEGMENT_SIZE)  # grows the file too, or raises
            self._write_header()
            return True
        if self.header_intact():
            return False
        self._write_header()
        return True

    def area(self, offset: int, payload_size: int, label: str) -> SeqlockArea:
        return SeqlockArea(self.words, self.mapping, offset, payload_size, f"{self.name} ({label})",
                           guard=self.check_size)

    def close(self) -> None:
        if not self.mapping.closed:
            self.words.release()
            self.mapping.close()
            self.memory.close_fd()

    def unlink(self) -> bool:
        return objects.unlink_shared_memory(self.name)


class AppRecord:
    """An app's record: the status area (app writes) and the command area (manager writes)."""

    def __init__(self, names: IpcNames | None, app: str, token: str, segment: Segment) -> None:
        self.names = names
        self.app = app
        self.token = token
        self.segment = segment
        self.status_area = segment.area(STATUS_OFFSET, AppStatus.STRUCT_SIZE, "status")
        self.command_area = segment.area(COMMAND_OFFSET, AppCommand.STRUCT.size, "command")
        self._status_counter = -1
        self._status: AppStatus | None = None

    @classmethod
    def create(cls, names: IpcNames, app: str, token: str | None = None) -> AppRecord:
        """Create the record of ``app`` under ``token`` (a new one by default).

        Taking the app's name is the caller's business (``discovery.AppClaim``): a record with a
        fresh token never exists yet, so ``posix_ipc.ExistentialError`` here means a clash.
        """
        token = token or new_token()
        return cls(names, app, token, Segment.create(names.app_record(app, token), SegmentKind.APP))

    @classmethod
    def create_sealed(cls, app: str) -> AppRecord:
        """A new record of ``app`` with no name in /dev/shm (``Segment.create_sealed``), for a
        system manager: only processes it is passed to can reach it."""
        return cls(None, app, "", Segment.create_sealed(f"drbalance-record.{app}", SegmentKind.APP))

    @classmethod
    def adopt(cls, fd: int, app: str, label: str) -> AppRecord:
        """The record of ``app`` passed as ``fd`` (checked by the caller, ``peer.check_record_descriptor``)."""
        return cls(None, app, "", Segment.adopt(fd, label, SegmentKind.APP))

    @classmethod
    def open(cls, names: IpcNames, app: str, token: str | None = None) -> AppRecord:
        """Open the record of ``app`` under ``token`` (default: the token its claim names now).

        ``posix_ipc.ExistentialError`` if there is no such record (or no claim).
        """
        if token is None:
            claim = read_claim(names, app)
            if claim is None:
                raise posix_ipc.ExistentialError(f"app {app!r} has no claim in {names.claims_dir()}")
            token = claim.token
        return cls(names, app, token, Segment.open(names.app_record(app, token), SegmentKind.APP))

    @property
    def name(self) -> str:
        return self.segment.name

    def write_status(self, status: AppStatus) -> None:
        self.status_area.write(status.encode())

    def read_status(self, attempts: int = 200) -> AppStatus:
        """The app's status; decoded again only when the seqlock counter shows a new write.
        ``attempts``: as for ``SeqlockArea.read`` (20 or fewer never sleep)."""
        area = self.status_area
        counter = area.counter()
        if counter == self._status_counter and counter % 2 == 0:
            return self._status
        status = AppStatus.decode(area.read(attempts), area.where)
        if status.app != self.app:
            raise RecordError(f"{area.where}: record names app {status.app!r}, not {self.app!r}")
        self._status_counter, self._status = area.last_counter, status
        return status

    def write_command(self, command: AppCommand) -> None:
        self.command_area.write(command.encode())

    def read_command(self) -> AppCommand | None:
        try:
            return AppCommand.decode(self.command_area.read(), self.command_area.where)
        except RecordEmpty:
            return None

    def close(self) -> None:
        self.segment.close()


class ManagerRecord:
    """The manager's heartbeat segment (written by the manager, read by apps)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.area = segment.area(STATUS_OFFSET, ManagerBeat.STRUCT.size, "heartbeat")

    @classmethod
    def create(cls, names: IpcNames, token: str) -> ManagerRecord:
        return cls(Segment.create(names.manager_record(token), SegmentKind.MANAGER))

    @classmethod
    def open(cls, names: IpcNames, token: str) -> ManagerRecord:
        return cls(Segment.open(names.manager_record(token), SegmentKind.MANAGER))

    def write(self, beat: ManagerBeat) -> None:
        self.area.write(beat.encode())

    def read(self) -> ManagerBeat:
        return ManagerBeat.decode(self.area.read(), self.area.where)

    def close(self) -> None:
        self.segment.close()
