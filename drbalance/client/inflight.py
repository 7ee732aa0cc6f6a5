"""Keeping a DDP job's collectives out of the way of interpreter shutdown.

A gloo worker thread takes the GIL to run a Python callback, to drop one, and to let go of a tensor
or of thread-local state that Python made. If the interpreter is already finalising by then, Python
ends that thread in the middle of a C++ destructor and the whole process aborts ("terminate called
without an active exception", SIGABRT after an otherwise good run). Plain DDP never meets this: its
reducer's buffers and callbacks are C++ only. A Python communication hook does, when the process
exits within a few milliseconds of a collective completing (a thread waiting for the GIL is handed
it after at most ``sys.getswitchinterval()``).

So, for every job:

- every Work it starts stays referenced from Python (:class:`InFlight`) for the current and the
  previous step, so that a gloo thread is not the one that frees it;
- every Python callback handed to a future is counted until the future drops it;
- when the job's model is freed, its last Works are kept a moment longer (``RETIRE_SECONDS``);
- at interpreter exit (``atexit``, while the GIL can still be handed to other threads),
  :func:`settle_all` waits until every kept Work has completed and every callback was dropped,
  then sleeps ``RELEASE_SECONDS`` so the worker threads let go of their own references.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger("drbalance.client")

EXIT_SETTLE_SECONDS = 30.0
"""At interpreter exit, the longest the process waits for its jobs' collectives (a dead rank's peers)."""

RELEASE_SECONDS = 0.05
"""At exit, once everything completed: the time given to worker threads to drop their references."""

RETIRE_SECONDS = 1.0
"""How long the last Works of a freed model are kept (its worker threads let go within microseconds)."""


class _Kept:
    """The Works of a job's current and previous step."""

    __slots__ = ("current", "previous")

    def __init__(self) -> None:
        self.current: list[Any] = []
        self.previous: list[Any] = []

    def completed(self) -> bool:
        return all(work.is_completed() for work in self.previous + self.current)


class InFlight:
    """One job's collectives and callbacks that its process groups' worker threads may still hold."""

    __slots__ = ("condition", "callbacks", "kept", "__weakref__")

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.callbacks = 0  # callbacks handed to futures and not dropped yet
        self.kept = _Kept()
        _shutdown.track(self)

    def started(self, work: Any) -> Any:
        """Keep ``work`` (a ``dist.Work``) for the rest of this step and the next; return it."""
        self.kept.current.append(work)
        return work

    def next_step(self) -> None:
        """A new step: the Works of two steps ago completed a step ago; their reference goes here."""
        kept = self.kept
        kept.previous, kept.current = kept.current, []

    def callback(self, function: Any) -> CountedCallback:
        """``function`` wrapped so that it is counted until the future that runs it drops it."""
        return CountedCallback(function, self)

    def dropped(self) -> None:
        with self.condition:
            self.callbacks -= 1
            self.condition.notify_all()

    def settle(self, deadline: float) -> bool:
        """Wait until every kept Work completed and every callback was dropped; False at ``deadline``.

        ``deadline`` is a ``time.monotonic()`` value in seconds.
        """
        with self.condition:
            while self.callbacks > 0 or not self.kept.completed():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.condition.wait(min(left, 0.01))
        return True


class CountedCallback:
    """A future's callback that tells its :class:`InFlight` when the future has dropped it."""

    __slots__ = ("function", "inflight")

    def __init__(self, function: Any, inflight: InFlight) -> None:
        self.function = function
        self.inflight = inflight
        with inflight.condition:
            inflight.callbacks += 1

    def __call__(self, future: Any) -> Any:
        return self.function(future)

    def __del__(self) -> None:
        self.inflight.dropped()


class _Shutdown:
    """The process's view of every job's in-flight work: ``atexit`` is process-wide, so this is too.

    Live jobs are held weakly; a freed job's last Works are held ``RETIRE_SECONDS`` and then let go.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self.retired: list[_Kept] = []  # the last Works of freed jobs, each for RETIRE_SECONDS
        self.registered = False

    def track(self, inflight: InFlight) -> None:
        with self.lock:
            self.live.add(inflight)
            if not self.registered:
                atexit.register(self.settle_all)
                self.registered = True
        finalizer = weakref.finalize(inflight, self.retire, inflight.kept)
        finalizer.atexit = False  # settle_all sees live jobs itself

    def retire(self, kept: _Kept) -> None:
        """A job's model was freed: keep its last Works ``RETIRE_SECONDS`` (runs on whichever thread freed it).

        A daemon timer lets go of them then, so a freed model's buffers do not stay until the process ends.
        """
        with self.lock:
            self.retired.append(kept)
        timer = threading.Timer(RETIRE_SECONDS, self.release, (kept,))
        timer.daemon = True
        timer.start()

    def release(self, kept: _Kept) -> None:
        """Let go of a freed job's Works (their time is up)."""
        with self.lock:
            self.retired.remove(kept)

    def settle_all(self, timeout: float = EXIT_SETTLE_SECONDS) -> bool:
        """Wait (seconds, at most) for every job's collectives and callbacks, then for the threads to let go."""
        deadline = time.monotonic() + timeout
        with self.lock:
            live = list(self.live)
            retired = list(self.retired)
        if not live and not retired:
            return True
        settled = all(inflight.settle(deadline) for inflight in live)
        while settled and not all(kept.completed() for kept in retired):
            settled = time.monotonic() < deadline
            time.sleep(0.01)
        if not settled:
            logger.warning("drbalance: collectives still in flight at exit after %.0f s (a rank died?); the "
                           "process may abort while the interpreter finalises", timeout)
            return False
        time.sleep(RELEASE_SECONDS)
        return True


_shutdown = _Shutdown()


def settle_all(timeout: float = EXIT_SETTLE_SECONDS) -> bool:
    """Wait for every job's collectives in this process as the exit handler does; True when all settled."""
    return _shutdown.settle_all(timeout)
