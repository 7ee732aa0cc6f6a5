"""The manager's table of live apps (the paper's APP_Info), built from their shared records.

An app's DR is indexed by its *slots* (its ``device_ids``, after ``CUDA_VISIBLE_DEVICES``); the
manager's GPUs by NVML index. Each record carries the GPU UUID of every slot, and
:meth:`AppEntry.view` maps slots to the manager's GPUs by UUID (``ServerGpus``), so a job under
Slurm, in a container or with any renumbering is steered by its own GPUs' utilisation. Policies
see every app in the server's GPU order; :meth:`AppEntry.to_app_ratio` turns their DR back into
the app's slot order for the command. Without UUIDs on either side, slot g is GPU g when the
counts agree.

The view also carries the app's memory caps (``AppView.max_share``, in the manager's DR units):
the largest chunk that fitted after an out-of-memory error (``SlotStatus.max_samples``), and the
chunk the GPU's free memory allows given the app's peak memory per sample
(``SlotStatus.memory_per_sample``, NVML's free memory, ``MEMORY_HEADROOM``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc

from drbalance.ipc import objects
from drbalance.ipc.endpoint import AppChannel
from drbalance.ipc.layout import AppState, AppStatus, RecordError
from drbalance.ipc.names import IpcNames
from drbalance.manager.nvml import MemoryInfo, normalize_uuid
from drbalance.policy.base import AppView
from drbalance.ratio import DataRatio

logger = logging.getLogger("drbalance.manager")

MEMORY_HEADROOM = 0.9
"""The fraction of a GPU's free memory an app's larger chunk may take (the rest absorbs allocator
fragmentation and other jobs' growth)."""


class Unmapped(ValueError):
    """The app's devices cannot be placed among the manager's GPUs (the text says why)."""


@dataclass(frozen=True)
class ServerGpus:
    """The manager's GPUs in its order: UUIDs (None = unknown) and memory now (None = unknown)."""

    count: int
    uuids: tuple[str | None, ...] = ()
    memory: tuple[MemoryInfo | None, ...] = ()

    def __post_init__(self) -> None:
        if self.uuids and len(self.uuids) != self.count:
            raise ValueError(f"{len(self.uuids)} GPU UUIDs for {self.count} GPUs")
        if self.memory and len(self.memory) != self.count:
            raise ValueError(f"{len(self.memory)} memory readings for {self.count} GPUs")

    def index(self) -> dict[str, int]:
        """Normalised UUID -> GPU index (unknown UUIDs left out)."""
        return {normalize_uuid(u): g for g, u in enumerate(self.uuids) if normalize_uuid(u)}

    def memory_of(self, gpu: int) -> MemoryInfo | None:
        return self.memory[gpu] if self.memory else None


@dataclass
class AppEntry:
    """One live app: its channel, its last valid status, and the DR last sent to it.

    Liveness: ``token`` names the app's objects (from its claim); ``owner_pid`` and
    ``owner_ticks`` are the process (pid, start time in clock ticks; 0 = unknown) its claim named
    when it was admitted, or its first valid record when no claim named it: a record can carry
    any pid, so one that names another process is invalid (``AppTable.refresh``), never a reason
    to think the app dead. ``quiet_since`` is the manager's monotonic time since when the app has
    not updated its record for the quiet period (None = active). A quiet app whose process runs
    is shown as quiet, never removed.
    """

    name: str
    channel: AppChannel
    status: AppStatus
    added_mono: float
    assigned: DataRatio | None = None
    assigned_mono: float = -math.inf
    last_complaint_mono: float = -math.inf
    token: str = ""
    quiet_since: float | None = None
    full_batch: int = 0  # the largest batch the app has published (samples per iteration)
    owner_pid: int = 0
    owner_ticks: int = 0

    def __post_init__(self) -> None:
        self.note_batch()

    def note_batch(self) -> None:
        """Keep the largest batch seen: a record written after an epoch's short last batch
        names that batch, and memory caps computed from it would let the next full batch overflow."""
        self.full_batch = max(self.full_batch, self.status.batch)

    def alive(self) -> bool:
        """Whether the app's process runs: the pid and start time its claim named (never its record's)."""
        return objects.process_alive(self.owner_pid, self.owner_ticks)

    def effective_ratio(self) -> DataRatio:
        """The DR the app uses now: the one just sent, until the app publishes a newer status (or
        one with another number of GPUs, which that DR could not be for)."""
        assigned = self.assigned
        if assigned is not None and self.assigned_mono > self.status.updated_mono and len(assigned) == len(
                self.status.ratio):
            return assigned
        return self.status.ratio

    def view(self, dr_total: int | None = None, server: ServerGpus | None = None) -> AppView:
        """The app as a policy sees it, per server GPU.

        ``dr_total`` is the manager's DR granularity, in which the DR (whatever total the record
        carries: the manager decides at its own), the minimum share and the memory caps are
        expressed. ``server``: the manager's GPUs; with it, slots are mapped by UUID
        (:class:`Unmapped` if that cannot be done); without it, slot g of the app is GPU g.
        """
        status = self.status
        slots = status.slots
        total = dr_total or status.ratio.total
        app_ratio = self.effective_ratio()
        ratio = app_ratio.rescale(total)
        common = dict(
            name=self.name, slowdown=status.slowdown, pid=status.pid, epoch=status.epoch,
            iteration=status.iteration, iterations_total=status.iterations_total,
            iteration_time=status.iteration_time, solo_time=status.solo_time, solo_basis=status.solo_basis,
            min_share=math.ceil(status.min_share * total / status.ratio.total), batch=status.batch or None,
        )
        if server is None:
            return AppView(
                ratio=ratio, **common,
                chunk_seconds=tuple(slot.chunk_seconds for slot in slots) if slots else None,
                chunk_samples=tuple(slot.chunk_samples for slot in slots) if slots else None,
            )
        mapping = self.slot_map(server)
        shares = [0] * server.count
        for slot, gpu in enumerate(mapping):
            if gpu is not None:
                shares[gpu] = ratio[slot]
        allowed = tuple(sorted(gpu for gpu in mapping if gpu is not None))
        return AppView(
            ratio=DataRatio(shares, total), **common,
            allowed=None if len(allowed) == server.count else allowed,
            max_share=self._max_share(mapping, server, total, app_ratio),
            chunk_seconds=_per_gpu(mapping, server.count, [s.chunk_seconds for s in slots], None) if slots else None,
            chunk_samples=_per_gpu(mapping, server.count, [s.chunk_samples for s in slots], 0.0) if slots else None,
        )

    def slot_map(self, server: ServerGpus) -> tuple[int | None, ...]:
        """The server GPU of each of the app's slots (None: not among the manager's GPUs).

        By UUID when the app published any and the server knows its own (a slot without one is on
        no server GPU); else slot g = GPU g when the counts agree. A slot that is not found may not
        hold a share (:class:`Unmapped`).
        """
        status = self.status
        count = len(status.ratio)
        uuids = [normalize_uuid(slot.uuid) for slot in status.slots] if status.slots else [""] * count
        index = server.index()
        if index and any(uuids):  # a slot without a UUID (a CPU rank, say) is then on no server GPU
            mapping: list[int | None] = [index.get(uuid) if uuid else None for uuid in uuids]
            placed = [gpu for gpu in mapping if gpu is not None]
            if len(set(placed)) != len(placed):
                raise Unmapped(f"app {self.name!r} names one GPU for two of its slots ({status.slots})")
            lost = [slot for slot, gpu in enumerate(mapping) if gpu is None and self.effective_ratio()[slot]]
            if lost or not placed:
                missing = ", ".join(f"slot {slot} ({uuids[slot]})" for slot in lost) or "all of its slots"
                raise Unmapped(f"app {self.name!r} uses GPUs this manager does not see: {missing}")
            return tuple(mapping)
        if count == server.count:
            return tuple(range(count))
        raise Unmapped(f"app {self.name!r} has {count} GPU slots without UUIDs; the manager has {server.count} GPUs")

    def to_app_ratio(self, ratio: DataRatio, server: ServerGpus | None = None) -> DataRatio:
        """A DR over the server's GPUs, as the app's slots see it (for the command it is sent)."""
        if server is None:
            return ratio
        mapping = self.slot_map(server)
        shares = [ratio[gpu] if gpu is not None else 0 for gpu in mapping]
        if sum(shares) != ratio.total:
            raise ValueError(f"DR {ratio} puts shares on GPUs that app {self.name!r} has no device on")
        return DataRatio(shares, ratio.total)

    def _max_share(self, mapping: Sequence[int | None], server: ServerGpus, total: int,
                   app_ratio: DataRatio) -> tuple[int | None, ...] | None:
        """Per server GPU, the largest share (of ``total``) that fits its memory; None = no cap."""
        status = self.status
        batch = max(status.batch, self.full_batch) if status.batch > 0 else 0  # 0: unknown
        if batch <= 0 or not status.slots:
            return None
        measured = [slot.memory_per_sample for slot in status.slots if slot.memory_per_sample]
        fallback = max(measured) if measured else None  # a GPU the app has no replica on yet
        chunks = app_ratio.split(batch)
        current = app_ratio.rescale(total)
        caps: list[int | None] = [None] * server.count
        for slot, gpu in enumerate(mapping):
            if gpu is None:
                continue
            limit = status.slots[slot].max_samples
            per_sample = status.slots[slot].memory_per_sample or fallback
            memory = server.memory_of(gpu)
            if per_sample and memory is not None:
                room = MEMORY_HEADROOM * memory.free / per_sample  # samples more that fit (inf if tiny)
                fits = chunks[slot] + (math.floor(room) if room < batch else batch)  # a whole batch caps nothing
                limit = fits if limit is None else min(limit, fits)
            if limit is not None:
                held = current[slot]  # kept only if its chunk fits at the manager's total too (rescaling rounds)
                fits_now = chunks[slot] <= limit and math.ceil(held * batch / total) <= limit
                caps[gpu] = max_share_for(limit, batch, total, held if fits_now else 0)
        return tuple(caps) if any(cap is not None for cap in caps) else None


def _check_owner(name: str, status: AppStatus, pid: int, ticks: int) -> None:
    """RecordError when ``status`` names another process than (``pid``, start time ``ticks``; 0 =
    unknown), the one that holds the app's claim."""
    if status.pid != pid:
        raise RecordError(f"app {name!r} is claimed by pid {pid}, but its record names pid {status.pid}: the "
                          f"record is ignored, the app kept")
    if ticks and status.start_ticks and status.start_ticks != ticks:
        raise RecordError(f"app {name!r}: its record's process start time {status.start_ticks} is not its "
                          f"claim's ({ticks}): the record is ignored, the app kept")


def max_share_for(max_samples: int, batch: int, total: int, keeps: int = 0) -> int:
    """The largest share of ``total`` whose chunk of a ``batch``-sample batch is at most
    ``max_samples`` samples, and at least ``keeps`` (a share the app already holds within the limit).

    Largest-remainder rounding gives a share s at most ceil(s * batch / total) samples, so every
    s <= max_samples * total / batch fits.
    """
    return max(keeps, min(total, math.floor(max_samples * total / batch)))


def _per_gpu(mapping: Sequence[int | None], count: int, values: Sequence, missing: object) -> tuple:
    result = [missing] * count
    for slot, gpu in enumerate(mapping):
        if gpu is not None:
            result[gpu] = values[slot]
    return tuple(result)


class AppTable:
    """Apps by name. ``admit`` opens an app's record and checks it; ``refresh`` re-reads it."""

    def __init__(self, names: IpcNames) -> None:
        self.names = names
        self.entries: dict[str, AppEntry] = {}
        self._unviewable: set[str] = set()  # apps already reported as left out of the views

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, name: str) -> AppEntry | None:
        return self.entries.get(name)

    def admit(self, name: str, now: float, expected_pid: int | None = None, token: str | None = None,
              expected_ticks: int = 0) -> AppEntry:
        """Open ``name``'s record (objects under ``token``; default: its claim's) and add it.

        RecordError if missing, unreadable, or owned by another pid (or another process with that
        pid: ``expected_ticks``, 0 = unknown); ``objects.ForeignObject`` if not this user's.
        """
        try:
            channel = AppChannel(self.names, name, token)
        except posix_ipc.ExistentialError:
            raise RecordError(f"app {name!r} has no record in namespace {self.names.namespace!r}") from None
        try:
            status = channel.read_status()
            if expected_pid is None:  # no claim names it: its first valid record says who it is
                expected_pid, expected_ticks = status.pid, status.start_ticks
            _check_owner(name, status, expected_pid, expected_ticks)
        except Exception:
            channel.close()
            raise
        entry = AppEntry(name, channel, status, now, token=channel.token, owner_pid=expected_pid,
                         owner_ticks=expected_ticks)
        self.entries[name] = entry
        return entry

    def refresh(self, entry: AppEntry) -> None:
        """Re-read the record. RecordError leaves the last valid status in place: a record that
        cannot be read, or one that names another process than the app's claim."""
        status = entry.channel.read_status()
        _check_owner(entry.name, status, entry.owner_pid, entry.owner_ticks)
        entry.status = status
        entry.note_batch()

    def remove(self, name: str, unlink: bool) -> AppEntry | None:
        self._unviewable.discard(name)  # a later app of that name is reported afresh
        entry = self.entries.pop(name, None)
        if entry is not None:
            entry.channel.close()
            if unlink:
                entry.channel.remove_objects()
        return entry

    def live(self) -> list[AppEntry]:
        return [e for e in self.entries.values() if e.status.state != AppState.FINISHED]

    def views(self, dr_total: int | None = None, server: ServerGpus | None = None) -> tuple[AppView, ...]:
        """Every live app's view; an app that cannot be mapped to the server's GPUs is left out,
        and so is one whose record holds values no view can be built from (logged once per app:
        one bad record must not stop the decisions for every other app)."""
        views = []
        for entry in self.live():
            try:
                views.append(entry.view(dr_total, server))
            except Unmapped:
                continue
            except (ArithmeticError, ValueError) as error:
                if entry.name not in self._unviewable:
                    self._unviewable.add(entry.name)
                    logger.warning("drbalance-manager: app %r left out of the decisions: its record gives no "
                                   "usable view (%s: %s)", entry.name, type(error).__name__, error)
        return tuple(views)
