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
from dataclasses import dataclass, field

from drbalance.ipc.names import APP_NAME_PATTERN
from drbalance.ratio import MAX_TOTAL, DataRatio
from drbalance.solo_estimate import ALONE, MANAGER, SHARED

LAYOUT_VERSION = 5  # 3: the status flag FLAG_SOLO_ESTIMATED; 4: FLAG_SD_BOUND; 5: FLAG_SOLO_MANAGER,
# AppCommand.solo_iteration
MAX_GPUS = 32
SEGMENT_SIZE = 8192
SEGMENT_HEADER = struct.Struct("<4sHHII")  # magic, version, kind, status offset, command offset
SEGMENT_MAGIC = b"DRBR"
STATUS_OFFSET = 64
COMMAND_OFFSET = 4096
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
    if ratio.total > MAX_TOTAL:
        raise ValueError(f"a DR total of {ratio.total} does not fit the record (at most {MAX_TOTAL})")
    return list(ratio.shares) + [0] * (MAX_GPUS - len(ratio))


FLAG_SD_KNOWN = 1
FLAG_ITER_TIME_KNOWN = 2
FLAG_SOLO_ESTIMATED = 4  # the solo time (and so the SD) is estimated online, not given (layout version 3)
FLAG_SD_BOUND = 8  # ...by the job, and can only be too high: the SD is a lower bound (layout version 4)
FLAG_SOLO_MANAGER = 16  # ...by the manager (``AppCommand.solo_iteration``; layout version 5)
STATUS_FLAGS = FLAG_SD_KNOWN | FLAG_ITER_TIME_KNOWN | FLAG_SOLO_ESTIMATED | FLAG_SD_BOUND | FLAG_SOLO_MANAGER
SOLO_BASIS_FLAGS = {ALONE: 0, SHARED: FLAG_SD_BOUND, MANAGER: FLAG_SOLO_MANAGER}
"""``AppStatus.solo_basis`` -> its status flag (with ``FLAG_SOLO_ESTIMATED``)."""
COMMAND_PUSHED = 1  # AppCommand flag: a DR the manager pushed without a notice of the app's
UUID_BYTES = 64  # a GPU UUID ("GPU-" or "MIG-" + 36 hex and dashes) fits with room to spare
SLOT_FIELDS = struct.Struct(f"<{UUID_BYTES}sdddq")  # uuid, chunk s, chunk samples, bytes/sample, max samples
UNKNOWN = -1.0  # stored for a per-slot measurement that is not known


@dataclass(frozen=True)
class SlotStatus:
    """What an app measured on one slot of its DR (one entry of ``device_ids``).

    ``uuid``: the GPU UUID of the slot's device ("" = unknown). ``chunk_seconds``: mean seconds of
    the slot's replica per iteration in the current window (None = not measured). ``chunk_samples``:
    mean samples per chunk over those measurements. ``memory_per_sample``: bytes of peak device
    memory per sample (None = unknown). ``max_samples``: the largest chunk, in samples, known to fit
    on the slot after an out-of-memory error (None = no known limit).
    """

    uuid: str = ""
    chunk_seconds: float | None = None
    chunk_samples: float = 0.0
    memory_per_sample: float | None = None
    max_samples: int | None = None

    def encode(self) -> bytes:
        raw = self.uuid.encode("ascii")
        if len(raw) >= UUID_BYTES:
            raise ValueError(f"GPU UUID {self.uuid!r} is longer than {UUID_BYTES - 1} characters")
        return SLOT_FIELDS.pack(
            raw, _or_unknown(self.chunk_seconds), float(self.chunk_samples), _or_unknown(self.memory_per_sample),
            -1 if self.max_samples is None else int(self.max_samples),
        )

    @classmethod
    def decode(cls, payload: bytes, where: str) -> SlotStatus:
        raw, seconds, samples, memory, max_samples = SLOT_FIELDS.unpack(payload)
        try:
            uuid = raw.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise RecordError(f"{where}: GPU UUID is not ASCII ({raw!r})") from None
        if uuid and not uuid.isprintable():
            raise RecordError(f"{where}: GPU UUID {uuid!r} has unprintable characters")
        _finite(samples, "chunk samples", where, 0.0)
        return cls(uuid, _known(seconds, "chunk seconds", where), samples,
                   _known(memory, "memory per sample", where), None if max_samples < 0 else max_samples)


def _or_unknown(value: float | None) -> float:
    return UNKNOWN if value is None else float(value)


def _known(value: float, what: str, where: str) -> float | None:
    """A stored measurement: UNKNOWN means None; anything else must be finite and >= 0."""
    if value == UNKNOWN:
        return None
    return _finite(value, what, where, 0.0)


@dataclass(frozen=True)
class AppStatus:
    """What an app publishes: progress, SD, DR, and per-slot measurements.

    Times in seconds; SD is a ratio (1 = as alone). ``start_ticks``: the process's start time
    (field 22 of /proc/<pid>/stat, clock ticks since boot; 0 = unknown), which tells the app from
    a later process that reuses its pid. ``batch``: samples in the last global mini-batch (0 =
    unknown). ``min_share``: the smallest share, in units of the DR total, that every slot must
    keep (0 = a slot may be emptied, as DataParallel allows; DDP ranks need >= 1). ``slots``: one
    ``SlotStatus`` per DR entry, or empty when nothing is known. ``solo_estimated``: the solo time
    is estimated online, not a given or profiled one; ``solo_basis`` then says by whom: the job's
    own estimate (``drbalance.solo_estimate``), ``alone`` when measured on GPUs it had alone, or
    ``shared`` while it can still only be too high (from GPUs it shared only, or not yet measured
    alone at its batch: ``sd_bound``, the SD is a lower bound, shown as such, never as the SD), or
    the ``manager``'s (``AppCommand.solo_iteration``).
    """

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
    start_ticks: int = 0
    batch: int = 0
    min_share: int = 0
    slots: tuple[SlotStatus, ...] = field(default=())
    solo_estimated: bool = False
    solo_basis: str | None = None  # "alone", "shared" or "manager" when solo_estimated, else None

    HEAD = struct.Struct(f"<i48sBBBBHH{MAX_GPUS}HIIQQQQddddddQIHH")
    STRUCT_SIZE = HEAD.size + MAX_GPUS * SLOT_FIELDS.size

    def __post_init__(self) -> None:
        if self.slots and len(self.slots) != len(self.ratio):
            raise ValueError(f"{len(self.slots)} slot entries for a DR of {len(self.ratio)} GPUs")
        if (self.solo_basis is None) == self.solo_estimated or (self.solo_estimated
                                                                and self.solo_basis not in SOLO_BASIS_FLAGS):
            raise ValueError(f"solo_basis must be one of {', '.join(SOLO_BASIS_FLAGS)} for an estimated solo time "
                             f"and None otherwise; got {self.solo_basis!r} (estimated: {self.solo_estimated})")

    @property
    def sd_bound(self) -> bool:
        """Whether the SD is a lower bound: the job's own solo-time estimate can still only be too
        high (``solo_basis`` ``shared``)."""
        return self.solo_basis == SHARED

    def encode(self) -> bytes:
        flags = ((FLAG_SD_KNOWN if self.slowdown is not None else 0)
                 | (FLAG_ITER_TIME_KNOWN if self.iteration_time is not None else 0)
                 | (FLAG_SOLO_ESTIMATED | SOLO_BASIS_FLAGS[self.solo_basis] if self.solo_estimated else 0))
        head = self.HEAD.pack(
            self.pid, self.app.encode("ascii"), int(self.state), flags, len(self.ratio), 0,
            self.ratio.total, 0, *_shares(self.ratio),
            self.epoch, self.epochs, self.iteration, self.iterations_total, self.iterations_per_epoch,
            self.notice_seq, self.slowdown if self.slowdown is not None else 0.0,
            self.iteration_time if self.iteration_time is not None else 0.0,
            self.solo_time, self.start_wall, self.updated_wall, self.updated_mono,
            self.start_ticks, self.batch, self.min_share, len(self.slots),
        )
        slots = b"".join(slot.encode() for slot in self.slots)
        return head + slots + bytes(self.STRUCT_SIZE - len(head) - len(slots))

    @classmethod
    def decode(cls, payload: bytes, where: str) -> AppStatus:
        if len(payload) != cls.STRUCT_SIZE:
            raise RecordError(f"{where}: status of {len(payload)} bytes, expected {cls.STRUCT_SIZE}")
        fields = cls.HEAD.unpack_from(payload)
        pid, raw_name, state, flags, count, _, total, _ = fields[:8]
        shares = fields[8:8 + MAX_GPUS]
        (epoch, epochs, iteration, iterations_total, per_epoch, notice_seq,
         slowdown, iteration_time, solo_time, start_wall, updated_wall, updated_mono,
         start_ticks, batch, min_share, slot_count) = fields[8 + MAX_GPUS:]
        if pid <= 0:
            raise RecordError(f"{where}: pid {pid} is not a process id")
        try:
            app_state = AppState(state)
        except ValueError:
            raise RecordError(f"{where}: unknown app state {state}") from None
        if flags & ~STATUS_FLAGS:
            raise RecordError(f"{where}: unknown status flags {flags:#x}")
        basis = _solo_basis(flags, where)
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
        if min_share > ratio.total:
            raise RecordError(f"{where}: minimum share {min_share} exceeds the DR total {ratio.total}")
        if slot_count not in (0, count):
            raise RecordError(f"{where}: {slot_count} slot entries for a DR of {count} GPUs")
        slots = tuple(
            SlotStatus.decode(payload[start:start + SLOT_FIELDS.size], f"{where}, slot {index}")
            for index, start in enumerate(range(cls.HEAD.size, cls.HEAD.size + slot_count * SLOT_FIELDS.size,
                                                SLOT_FIELDS.size))
        )
        return cls(pid, _name(raw_name, where), app_state, ratio, epoch, epochs, iteration, iterations_total,
                   per_epoch, notice_seq, sd, it, solo_time, start_wall, updated_wall, updated_mono,
                   start_ticks, batch, min_share, slots, basis is not None, basis)


def _solo_basis(flags: int, where: str) -> str | None:
    """``AppStatus.solo_basis`` from a status's flags (None: the solo time is not estimated)."""
    found = [basis for basis, flag in SOLO_BASIS_FLAGS.items() if flag and flags & flag]
    if found and not flags & FLAG_SOLO_ESTIMATED or len(found) > 1:
        raise RecordError(f"{where}: status flags {flags:#x} give a solo time's basis without an estimate, "
                          f"or two bases")
    if not flags & FLAG_SOLO_ESTIMATED:
        return None
    return found[0] if found else ALONE


@dataclass(frozen=True)
class AppCommand:
    """What the manager tells an app: use ``ratio``; ``generation`` is the notice it answers.

    ``next_boundary``: seconds after which the app should send its next boundary notice even if
    no epoch has ended (None: only at its own boundaries). ``pushed``: the manager changed the DR
    without a notice of the app's (its part of a decision about several apps); ``generation`` is
    then the app's latest notice, and the app applies it after its current iteration.
    ``solo_iteration``: the manager's estimate of the app's solo iteration time (seconds of one
    iteration alone on one GPU; None: it has none), for a job given no solo time that had no GPU
    alone (``drbalance.solo_estimate.chosen_solo``).
    """

    manager_pid: int
    generation: int
    ratio: DataRatio
    branch: str  # the policy branch that decided (for logs), at most 16 ASCII characters
    written_wall: float
    next_boundary: float | None = None
    pushed: bool = False
    solo_iteration: float | None = None

    STRUCT = struct.Struct(f"<iQBBH{MAX_GPUS}H16sddd")

    def encode(self) -> bytes:
        return self.STRUCT.pack(
            self.manager_pid, self.generation, len(self.ratio), COMMAND_PUSHED if self.pushed else 0,
            self.ratio.total, *_shares(self.ratio), self.branch.encode("ascii", "replace")[:16], self.written_wall,
            self.next_boundary if self.next_boundary is not None else 0.0,
            self.solo_iteration if self.solo_iteration is not None else 0.0,
        )

    @classmethod
    def decode(cls, payload: bytes, where: str) -> AppCommand:
        fields = cls.STRUCT.unpack(payload)
        manager_pid, generation, count, flags, total = fields[:5]
        shares = fields[5:5 + MAX_GPUS]
        raw_branch, written_wall, next_boundary, solo_iteration = fields[5 + MAX_GPUS:]
        if flags & ~COMMAND_PUSHED:
            raise RecordError(f"{where}: unknown command flags {flags:#x}")
        if manager_pid <= 0:
            raise RecordError(f"{where}: manager pid {manager_pid} is not a process id")
        ratio = _ratio(count, total, shares, where)
        try:
            branch = raw_branch.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise RecordError(f"{where}: branch name is not ASCII") from None
        _finite(next_boundary, "next boundary", where, 0.0)
        _finite(solo_iteration, "solo iteration", where, 0.0)
        return cls(manager_pid, generation, ratio, branch, _finite(written_wall, "write time", where),
                   next_boundary if next_boundary > 0 else None, bool(flags & COMMAND_PUSHED),
                   solo_iteration if solo_iteration > 0 else None)


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
