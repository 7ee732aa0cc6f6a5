"""The manager's listing of /dev/shm, made in a thread of its own (no torch).

Every rescan the manager lists the /dev/shm entries under its namespace's prefix: this user's
records and semaphores left by dead jobs are collected, and other users' entries reported. Any
local user can create names there, and empty entries cost no space: 300,000 of them take 7 s
to list (a ``stat`` and a parse each). On the manager's only thread, at every rescan, that
would leave it sending no heartbeat and answering no notice, and every job would lose it. So a
thread lists, and the manager's loop takes the finished listing:

- ``ShmLister.start`` begins a listing unless one is running or the last one ended less than
  twice its own duration ago, so a flooded /dev/shm costs the manager at most about a third of a
  core, and a normal one (a few hundred entries, about a millisecond) nothing.
- Only this user's entries come back whole (``ShmListing.own``). Other users' are counted per
  owner, and only the first ``keep`` of them by name are kept, so memory does not grow with a
  neighbour's flood.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from drbalance.ipc.names import IpcNames, ListedObject, listed_object


@dataclass(frozen=True)
class ShmListing:
    """One listing of a namespace's /dev/shm entries (``seconds``: how long it took)."""

    own: tuple[ListedObject, ...]  # this user's entries, by name
    foreign_first: tuple[tuple[str, int], ...]  # other users' entries, the first by name: (entry, owner uid)
    foreign_counts: Mapping[int, int] = field(default_factory=dict)  # per owner uid: how many entries
    seconds: float = 0.0


def list_namespace(names: IpcNames, keep: int, me: int | None = None) -> ShmListing:
    """List ``names``'s entries in /dev/shm: this user's (``me``, default the effective uid) parsed,
    the others counted per owner and the first ``keep`` by name kept."""
    started = time.monotonic()
    me = os.geteuid() if me is None else me
    own: list[ListedObject] = []
    foreign: list[tuple[str, int]] = []
    counts: dict[int, int] = {}
    for name, rest, owner in names.entries():
        if owner == me:
            own.append(listed_object(name, rest, owner))
        else:
            counts[owner] = counts.get(owner, 0) + 1
            foreign.append((name, owner))
    own.sort(key=lambda listed: listed.entry)
    return ShmListing(tuple(own), tuple(heapq.nsmallest(keep, foreign)), counts, time.monotonic() - started)


class ShmLister:
    """Lists a namespace's /dev/shm entries in a background thread, one listing at a time.

    ``start()`` begins one (if allowed), ``take()`` returns it once it has ended (and raises what
    the listing raised), ``list_now()`` lists on the calling thread (at start-up, before the
    manager serves anyone).
    """

    PACE = 2.0
    """A listing starts no sooner than this many times the last one's duration after it ended."""

    def __init__(self, names: IpcNames, keep: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.names = names
        self.keep = keep
        self._clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False  # a listing is under way (set by ``start``, cleared as it hands over its result)
        self._result: ShmListing | None = None
        self._error: BaseException | None = None
        self._not_before = -float("inf")

    def list_now(self) -> ShmListing:
        """A listing made on the calling thread."""
        return list_namespace(self.names, self.keep)

    def start(self) -> bool:
        """Begin a listing in the background; False if one is running, one has ended and not been
        taken, or the last ended too recently (``PACE``)."""
        with self._lock:
            if self._running or self._result is not None or self._error is not None or self._clock() < self._not_before:
                return False
            self._running = True
            self._thread = threading.Thread(target=self._run, name="drbalance-shm-listing", daemon=True)
            thread = self._thread
        thread.start()
        return True

    def ready(self) -> bool:
        """Whether a listing (or its error) waits to be taken."""
        with self._lock:
            return self._result is not None or self._error is not None

    def take(self) -> ShmListing | None:
        """The listing that ended since the last take (None if none did); raises its error if it failed."""
        with self._lock:
            result, error = self._result, self._error
            self._result = self._error = None
        if error is not None:
            raise error
        return result

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for a listing under way (at shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        started = self._clock()
        result: ShmListing | None = None
        error: BaseException | None = None
        try:
            result = list_namespace(self.names, self.keep)
        except Exception as caught:  # handed to the manager's loop, which logs it as a fault of the rescan
            error = caught
        ended = self._clock()
        with self._lock:
            self._result, self._error, self._running = result, error, False
            self._not_before = ended + self.PACE * (ended - started)
