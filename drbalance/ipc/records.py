"""Shared-memory records: seqlocked areas in a named segment (see ``layout`` for the bytes).

Writer protocol (one writer per area): bump the counter to odd, write the payload and its CRC,
bump the counter to even. Reader: read the counter, the payload and the CRC, read the counter
again; accept only if both counter reads are equal and even and the CRC matches. A reader never
blocks: after a bounded number of attempts it reports the area busy.
"""

from __future__ import annotations

import mmap
import os
import time
import zlib
from typing import TypeVar

import posix_ipc

from drbalance.ipc import objects
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
from drbalance.ipc.names import SHM_DIR, IpcNames

T = TypeVar("T")


class RecordEmpty(RecordError):
    """The area has never been written."""


class RecordBusy(RecordError):
    """The area was being rewritten on every attempt (or its writer died mid-write)."""


class SeqlockArea:
    """One area of a segment: a seqlock counter, a CRC32 and a fixed-size payload.

    The counter and CRC are read and written through a ``uint32`` memoryview, i.e. as single
    aligned 4-byte loads and stores (``struct.pack_into('<I')`` writes byte by byte, and a
    reader could then see a half-updated counter).
    """

    def __init__(self, words: memoryview, mapping: mmap.mmap, offset: int, payload_size: int, where: str) -> None:
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
        self.last_counter = -1  # the counter value of the last payload returned by read()

    def write(self, payload: bytes) -> None:
        if len(payload) != self.end - self.start:
            raise ValueError(f"{self.where}: payload of {len(payload)} bytes, area holds {self.end - self.start}")
        words, index = self.words, self.counter_index
        counter = words[index]
        odd = (counter + 1 if counter % 2 == 0 else counter + 2) & 0xFFFFFFFF
        words[index] = odd
        self.mapping[self.start:self.end] = payload
        words[self.crc_index] = zlib.crc32(payload)
        words[index] = (odd + 1) & 0xFFFFFFFF

    def read(self, attempts: int = 200) -> bytes:
        words, index = self.words, self.counter_index
        zero_counters = 0
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
        raise RecordBusy(f"{self.where}: still being written after {attempts} attempts")


class Segment:
    """A named shared-memory segment with a header and up to two seqlocked areas."""

    def __init__(self, name: str, mapping: mmap.mmap, kind: SegmentKind) -> None:
        self.name = name
        self.mapping = mapping
        self.kind = kind
        self.words = memoryview(mapping).cast("I")  # native uint32: atomic aligned loads/stores

    @classmethod
    def create(cls, name: str, kind: SegmentKind) -> Segment:
        _, mapping = objects.create_shared_memory(name, SEGMENT_SIZE)
        SEGMENT_HEADER.pack_into(mapping, 0, SEGMENT_MAGIC, LAYOUT_VERSION, int(kind), STATUS_OFFSET, COMMAND_OFFSET)
        return cls(name, mapping, kind)

    @classmethod
    def open(cls, name: str, kind: SegmentKind) -> Segment:
        """Open an existing segment and check its header; RecordError if it is not ours."""
        try:
            _, mapping = objects.open_shared_memory(name)
        except ValueError as error:
            raise RecordError(f"{name}: {error}") from None
        try:
            if len(mapping) < SEGMENT_SIZE:
                raise RecordError(f"{name}: {len(mapping)} bytes, expected {SEGMENT_SIZE}")
            magic, version, found, status, command = SEGMENT_HEADER.unpack_from(mapping, 0)
            if magic != SEGMENT_MAGIC:
                raise RecordEmpty(f"{name}: bad magic {magic!r} (not initialised, or not a drbalance record)")
            if version != LAYOUT_VERSION:
                raise RecordError(f"{name}: layout version {version}, this build reads {LAYOUT_VERSION}")
            if found != kind or status != STATUS_OFFSET or command != COMMAND_OFFSET:
                raise RecordError(f"{name}: segment kind {found} / offsets {status},{command} unexpected")
        except Exception:
            mapping.close()
            raise
        return cls(name, mapping, kind)

    def area(self, offset: int, payload_size: int, label: str) -> SeqlockArea:
        return SeqlockArea(self.words, self.mapping, offset, payload_size, f"{self.name} ({label})")

    def close(self) -> None:
        if not self.mapping.closed:
            self.words.release()
            self.mapping.close()

    def unlink(self) -> bool:
        return objects.unlink_shared_memory(self.name)


class AppRecord:
    """An app's record: the status area (app writes) and the command area (manager writes)."""

    def __init__(self, names: IpcNames, app: str, segment: Segment) -> None:
        self.names = names
        self.app = app
        self.segment = segment
        self.status_area = segment.area(STATUS_OFFSET, AppStatus.STRUCT_SIZE, "status")
        self.command_area = segment.area(COMMAND_OFFSET, AppCommand.STRUCT.size, "command")
        self._status_counter = -1
        self._status: AppStatus | None = None

    @classmethod
    def create(cls, names: IpcNames, app: str) -> AppRecord:
        """Create the record for ``app``, removing a stale one a dead process left behind.

        Raises ``AppNameInUse`` when a live process already runs an app of that name.
        """
        name = names.app_record(app)
        for _ in range(3):
            try:
                return cls(names, app, Segment.create(name, SegmentKind.APP))
            except posix_ipc.ExistentialError:
                remove_stale_app(names, app)
        raise AppNameInUse(f"could not create {name}: another process keeps creating it")

    @classmethod
    def open(cls, names: IpcNames, app: str) -> AppRecord:
        return cls(names, app, Segment.open(names.app_record(app), SegmentKind.APP))

    def write_status(self, status: AppStatus) -> None:
        self.status_area.write(status.encode())

    def read_status(self) -> AppStatus:
        """The app's status; decoded again only when the seqlock counter shows a new write."""
        area = self.status_area
        counter = area.words[area.counter_index]
        if counter == self._status_counter and counter % 2 == 0:
            return self._status
        status = AppStatus.decode(area.read(), area.where)
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


class AppNameInUse(RuntimeError):
    """A live process already runs an app of this name in this namespace."""


def remove_stale_app(names: IpcNames, app: str, grace_seconds: float = 5.0) -> bool:
    """Remove ``app``'s record and semaphore if its owner is dead; raise if it is alive.

    A record that was never written is left alone while younger than ``grace_seconds`` (its
    creator may still be starting), and removed after that.
    """
    name = names.app_record(app)
    try:
        record = AppRecord.open(names, app)
    except posix_ipc.ExistentialError:
        objects.unlink_semaphore(names.app_signal(app))
        return False
    except RecordEmpty:
        record = None
    except RecordError:
        record = None  # not a readable drbalance record: nobody can use it, remove it
    owner = None
    if record is not None:
        try:
            owner = record.read_status().pid
        except RecordEmpty:
            owner = None
        except RecordBusy:
            raise AppNameInUse(f"the record of app {app!r} is being written right now") from None
        except RecordError:
            owner = -1  # corrupt beyond use: nobody can read it, so nobody can be using it
        finally:
            record.close()
    if owner is None and _age_seconds(name) < grace_seconds:
        raise AppNameInUse(f"an app named {app!r} is being started by another process (record {name})")
    if owner is not None and owner > 0 and owner != os.getpid() and objects.pid_alive(owner):
        raise AppNameInUse(
            f"an app named {app!r} is already running as pid {owner} in namespace {names.namespace!r}; "
            f"choose another name or namespace"
        )
    removed = objects.unlink_shared_memory(name)
    objects.unlink_semaphore(names.app_signal(app))
    return removed


def _age_seconds(shm_name: str) -> float:
    try:
        return time.time() - (SHM_DIR / shm_name.lstrip("/")).stat().st_mtime
    except OSError:
        return float("inf")


class ManagerRecord:
    """The manager's heartbeat segment (written by the manager, read by apps)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.area = segment.area(STATUS_OFFSET, ManagerBeat.STRUCT.size, "heartbeat")

    @classmethod
    def create(cls, names: IpcNames) -> ManagerRecord:
        """Create the heartbeat segment; the caller holds the manager lock, so an old one is stale."""
        name = names.manager_record()
        objects.unlink_shared_memory(name)
        return cls(Segment.create(name, SegmentKind.MANAGER))

    @classmethod
    def open(cls, names: IpcNames) -> ManagerRecord:
        return cls(Segment.open(names.manager_record(), SegmentKind.MANAGER))

    def write(self, beat: ManagerBeat) -> None:
        self.area.write(beat.encode())

    def read(self) -> ManagerBeat:
        return ManagerBeat.decode(self.area.read(), self.area.where)

    def close(self) -> None:
        self.segment.close()
