"""The manager's table of live apps (the paper's APP_Info), built from their shared records."""

from __future__ import annotations

import math
from dataclasses import dataclass

import posix_ipc

from drbalance.ipc import objects
from drbalance.ipc.endpoint import AppChannel
from drbalance.ipc.layout import AppState, AppStatus, RecordError
from drbalance.ipc.names import IpcNames
from drbalance.policy.base import AppView
from drbalance.ratio import DataRatio


@dataclass
class AppEntry:
    """One live app: its channel, its last valid status, and the DR last sent to it.

    Liveness: ``token`` names the app's objects (from its claim); ``quiet_since`` is the manager's
    monotonic time since when the app has not updated its record for the quiet period (None =
    active). A quiet app whose process runs is shown as quiet, never removed.
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

    def alive(self) -> bool:
        """Whether the app's process runs: its pid, and its start time when the record has one."""
        return objects.process_alive(self.status.pid, self.status.start_ticks)

    def effective_ratio(self) -> DataRatio:
        """The DR the app uses now: the one just sent, until the app publishes a newer status."""
        if self.assigned is not None and self.assigned_mono > self.status.updated_mono:
            return self.assigned
        return self.status.ratio

    def view(self, dr_total: int | None = None) -> AppView:
        """The app as a policy sees it, per server GPU (slot g of the app = GPU g of the server).

        ``dr_total`` is the manager's DR granularity, in which the minimum share is expressed.
        """
        status = self.status
        slots = status.slots
        total = dr_total or status.ratio.total
        return AppView(
            name=self.name, ratio=self.effective_ratio(), slowdown=status.slowdown, pid=status.pid,
            epoch=status.epoch, iteration=status.iteration, iterations_total=status.iterations_total,
            iteration_time=status.iteration_time, solo_time=status.solo_time,
            min_share=math.ceil(status.min_share * total / status.ratio.total),
            chunk_seconds=tuple(slot.chunk_seconds for slot in slots) if slots else None,
            chunk_samples=tuple(slot.chunk_samples for slot in slots) if slots else None,
            batch=status.batch or None,
        )


class AppTable:
    """Apps by name. ``admit`` opens an app's record and checks it; ``refresh`` re-reads it."""

    def __init__(self, names: IpcNames) -> None:
        self.names = names
        self.entries: dict[str, AppEntry] = {}

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
            if expected_pid is not None and status.pid != expected_pid:
                raise RecordError(f"app {name!r} is claimed by pid {expected_pid}, but its record belongs to "
                                  f"pid {status.pid}")
            if expected_ticks and status.start_ticks and status.start_ticks != expected_ticks:
                raise RecordError(f"app {name!r}: its record's process start time {status.start_ticks} is not "
                                  f"its claim's ({expected_ticks})")
        except Exception:
            channel.close()
            raise
        entry = AppEntry(name, channel, status, now, token=channel.token)
        self.entries[name] = entry
        return entry

    def refresh(self, entry: AppEntry) -> None:
        """Re-read the record (RecordError leaves the last valid status in place)."""
        entry.status = entry.channel.read_status()

    def remove(self, name: str, unlink: bool) -> AppEntry | None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            entry.channel.close()
            if unlink:
                entry.channel.remove_objects()
        return entry

    def live(self) -> list[AppEntry]:
        return [e for e in self.entries.values() if e.status.state != AppState.FINISHED]

    def views(self, dr_total: int | None = None) -> tuple[AppView, ...]:
        return tuple(entry.view(dr_total) for entry in self.live())
