"""Binary layouts of everything that crosses process boundaries, and their validation.

One shared-memory segment per app holds two areas: the *status* (written only by the app: SD,
DR, progress, pid) and the *command* (written only by the manager: the new DR and the generation
it answers). The manager's own segment holds its heartbeat. Each area is guarded by a seqlock
(an even/odd counter) and a CRC32 of its payload, so a reader never accepts a torn or corrupted
record. Everything decoded is validated: magic, version, sizes, NaN/inf, DR sum, names, pids.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

from drbalance.ipc.names import APP_NAME_PATTERN
from drbalance.ratio import DataRatio

LAYOUT_VERSION = 1
MAX_GPUS = 32
SEGMENT_SIZE = 4096
SEGMENT_HEADER = struct.Struct("<4sHHII")  # magic, version, kind, status offset, command offset
SEGMENT_MAGIC = b"DRBR"
STATUS_OFFSET = 64
COMMAND_OFFSET = 1024
AREA_HEADER = struct.Struct("<II")  # seqlock counter, CRC32 of the payload


class SegmentKind(enum.IntEnum):
    APP = 1
    MANAGER = 2
    EMULATED_GPU = 3


class RecordError(ValueError):
    """A record or message failed validation; the text says which and why."""


class AppState(enum.IntEnum):
    STARTING = 0  # registered, no iteration finished yet
    RUNNING = 1
    FINISHED = 2


def _finite(value: float, what: str, where: str, minimum: float | None = None) -> float:
    if not math.isfinite(value):
        raise RecordError(f"{where}: {what} is {value} (must be finite)")
    if minimum is not None and value < minimum:
        raise RecordError(f"{where}: {what} is {value} (must be >= {minimum})")
    return value


def _name(raw: bytes, where: str) -> str:
    try:
        name = raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise RecordError(f"{where}: app name is not ASCII ({raw!r})") from None
    if not APP_NAME_PATTERN.match(name):
        raise RecordError(f"{where}: app name {name!r} is not valid")
    return name


def _ratio(count: int, total: int, shares: tuple[int, ...], where: str) -> DataRatio:
    if not 1 <= count <= MAX_GPUS:
        raise RecordError(f"{where}: GPU count {count} outside 1..{MAX_GPUS}")
    if any(shares[count:]):
        raise RecordError(f"{where}: shares beyond GPU {count - 1} are not zero: {list(shares)}")
    try:
        return DataRatio(shares[:count], total)
    except ValueError as error:
        raise RecordError(f"{where}: bad DR: {error}") from None


def _shares(ratio: DataRatio) -> list[int]:
    if len(ratio) > MAX_GPUS:
        raise ValueError(f"a DR of {len(ratio)} GPUs does not fit the record (at most {MAX_GPUS})")
    if ratio.total > 0xFFFF:
        raise ValueError(f"a DR total of {ratio.total} does not fit the record (at most 65535)")
    return list(ratio.shares) + [0] * (MAX_GPUS - len(ratio))


FLAG_SD_KNOWN = 1
FLAG_ITER_TIME_KNOWN = 2


@dataclass(frozen=True)
class AppStatus:
    """What an app publishes: progress, SD, DR. Times in seconds; SD is a ratio (1 = as alone)."""

    pid: int
    app: str
    state: AppState
    ratio: DataRatio
    epoch: int  # epochs completed
    epochs: int
    iteration: int  # iterations completed in the whole run
    iterations_total: int
    iterations_per_epoch: int
    notice_seq: int  # sequence number of the app's latest notice
    slowdown: float | None  # None until an iteration time is known
    iteration_time: float | None  # mean seconds per iteration in the current window
    solo_time: float  # seconds
    start_wall: float
    updated_wall: float
    updated_mono: float

    STRUCT = struct.Struct(f"<i48sBBBBHH{MAX_GPUS}HIIQQQQdddddd")

    def encode(self) -> bytes:
        flags = (FLAG_SD_KNOWN if self.slowdown is not None else 0) | (
            FLAG_ITER_TIME_KNOWN if self.iteration_time is not None else 0
        )
        return self.STRUCT.pack(
            self.pid, self.app.encode("ascii"), int(self.state), flags, len(self.ratio), 0,
            self.ratio.total, 0, *_shares(self.ratio),
            self.epoch, self.epochs, self.iteration, self.iterations_total, self.iterations_per_epoch,
            self.notice_seq, self.slowdown if self.slowdown is not None else 0.0,
            self.iteration_time if self.iteration_time is not None else 0.0,
            self.solo_time, self.start_wall, self.updated_wall, self.updated_mono,
        )

    @classmethod
    def decode(cls, payload: bytes, where: str) -> AppStatus:
        fields = cls.STRUCT.unpack(payload)
        pid, raw_name, state, flags, count, _, total, _ = fields[:8]
        shares = fields[8:8 + MAX_GPUS]
        (epoch, epochs, iteration, iterations_total, per_epoch, notice_seq,
         slowdown, iteration_time, solo_time, start_wall, updated_wall, updated_mono) = fields[8 + MAX_GPUS:]
        if pid <= 0:
            raise RecordError(f"{where}: pid {pid} is not a process id")
        try:
            app_state = AppState(state)
        except ValueError:
            raise RecordError(f"{where}: unknown app state {state}") from None
        ratio = _ratio(count, total, shares, where)
        if iterations_total < 1 or per_epoch < 1 or epochs < 1:
            raise RecordError(
                f"{where}: empty iteration plan ({epochs} epochs x {per_epoch}, total {iterations_total})"
            )
        if iteration > iterations_total or epoch > epochs:
            raise RecordError(
                f"{where}: progress {iteration}/{iterations_total} (epoch {epoch}/{epochs}) is past the end"
            )
        sd = _finite(slowdown, "SD", where, 0.0) if flags & FLAG_SD_KNOWN else None
        it = _finite(iteration_time, "iteration time", where, 0.0) if flags & FLAG_ITER_TIME_KNOWN else None
        if solo_time <= 0 or not math.isfinite(solo_time):
            raise RecordError(f"{where}: solo-run time {solo_time} must be finite and > 0")
        times = (("start time", start_wall), ("update time", updated_wall), ("monotonic time", updated_mono))
        for what, value in times:
            _finite(value, what, where)
        return cls(pid, _name(raw_name, where), app_state, ratio, epoch, epochs, iteration, iterations_total,
                   per_epoch, notice_seq, sd, it, solo_time, start_wall, updated_wall, updated_mono)


@dataclass(frozen=True)
class AppCommand:
    """What the manager tells an app: use ``ratio``; ``generation`` is the notice it answers."""

    manager_pid: int
    generation: int
    ratio: DataRatio
    branch: str  # the policy branch that decided (for logs), at most 16 ASCII characters
    written_wall: float

    STRUCT = struct.Struct(f"<iQBBH{MAX_GPUS}H16sd")

    def encode(self) -> bytes:
        return self.STRUCT.pack(
            self.manager_pid, self.generation, len(self.ratio), 0, self.ratio.total, *_shares(self.ratio),
            self.branch.encode("ascii", "replace")[:16], self.written_wall,
        )

    @classmethod
    def decode(cls, payload: bytes, where: str) -> AppCommand:
        fields = cls.STRUCT.unpack(payload)
        manager_pid, generation, count, _, total = fields[:5]
        shares = fields[5:5 + MAX_GPUS]
        raw_branch, written_wall = fields[5 + MAX_GPUS:]
        if manager_pid <= 0:
            raise RecordError(f"{where}: manager pid {manager_pid} is not a process id")
        ratio = _ratio(count, total, shares, where)
        try:
            branch = raw_branch.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise RecordError(f"{where}: branch name is not ASCII") from None
        return cls(manager_pid, generation, ratio, branch, _finite(written_wall, "write time", where))


@dataclass(frozen=True)
class ManagerBeat:
    """The manager's heartbeat: who it is, its GPU count and DR total, when it last looped."""

    pid: int
    gpu_count: int
    dr_total: int
    started_wall: float
    beat_mono: float

    STRUCT = struct.Struct("<iHHdd")

    def encode(self) -> bytes:
        return self.STRUCT.pack(self.pid, self.gpu_count, self.dr_total, self.started_wall, self.beat_mono)

    @classmethod
    def decode(cls, payload: bytes, where: str) -> ManagerBeat:
        pid, gpus, total, started, beat = cls.STRUCT.unpack(payload)
        if pid <= 0 or not 1 <= gpus <= MAX_GPUS or total < 1:
            raise RecordError(f"{where}: implausible manager record (pid {pid}, {gpus} GPUs, DR total {total})")
        return cls(pid, gpus, total, _finite(started, "start time", where), _finite(beat, "heartbeat", where))


class NoticeKind(enum.IntEnum):
    REGISTER = 1  # a new app (or one re-attaching to a new manager)
    BOUNDARY = 2  # an epoch (or decision interval) ended: please decide my DR
    FINISH = 3  # the app is done (or leaving): forget it


@dataclass(frozen=True)
class Notice:
    """A small fixed message to the manager's inbox: which app, what happened, which sequence number."""

    kind: NoticeKind
    pid: int
    seq: int
    app: str
    sent_wall: float

    MAGIC = b"DRBN"
    STRUCT = struct.Struct("<4sHBBiQ48sd")

    def encode(self) -> bytes:
        return self.STRUCT.pack(self.MAGIC, LAYOUT_VERSION, int(self.kind), 0, self.pid, self.seq,
                                self.app.encode("ascii"), self.sent_wall)

    @classmethod
    def decode(cls, message: bytes) -> Notice:
        if len(message) != cls.STRUCT.size:
            raise RecordError(f"notice: {len(message)} bytes, expected {cls.STRUCT.size}")
        magic, version, kind, _, pid, seq, raw_name, sent_wall = cls.STRUCT.unpack(message)
        if magic != cls.MAGIC:
            raise RecordError(f"notice: bad magic {magic!r} (expected {cls.MAGIC!r})")
        if version != LAYOUT_VERSION:
            raise RecordError(f"notice: version {version}, this build speaks {LAYOUT_VERSION}")
        try:
            notice_kind = NoticeKind(kind)
        except ValueError:
            raise RecordError(f"notice: unknown kind {kind}") from None
        if pid <= 0:
            raise RecordError(f"notice: pid {pid} is not a process id")
        return cls(notice_kind, pid, seq, _name(raw_name, "notice"), _finite(sent_wall, "send time", "notice"))
