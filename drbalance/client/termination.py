"""What a session does with SIGTERM: unwind the script, then die of SIGTERM, within a bounded time.

A session's SIGTERM handler raises :class:`SessionTerminated` in the main thread, so the script's
``with`` blocks and ``finally`` clauses run and the session closes in normal flow; at interpreter
exit, after every exit hook registered since drbalance's client was imported, the process
re-raises SIGTERM on itself and dies of it, as it would without drbalance.

Unwinding can hang where a plain SIGTERM would not: a non-daemon thread that never ends (the
interpreter waits for it before exiting), a ``finally`` clause that blocks, a write to a full
pipe nobody reads. So the first SIGTERM also wakes a watchdog thread: if the process is still
alive ``DRBALANCE_EXIT_GRACE`` seconds later, the watchdog prints every thread's stack to stderr
and ends the process with exit status 143 (128 + SIGTERM), the status a shell shows for a death
by SIGTERM.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time

from drbalance import defaults

EXIT_STATUS = 128 + signal.SIGTERM
"""What a process ended by SIGTERM reports to a shell; the watchdog exits with it."""

STDERR_WRITE_SECONDS = 5.0
"""How long the watchdog lets its report to stderr take (a full stderr pipe would block it for ever)."""


class SessionTerminated(SystemExit):
    """Raised in the main thread by a session's SIGTERM handler (exit status 143).

    The handler itself does no I/O: it raises, the script unwinds as for any exception (its
    ``with`` blocks and ``finally`` clauses run, the session closes in normal flow), and at
    interpreter exit the process re-raises SIGTERM on itself, so it still dies of SIGTERM as
    it would without drbalance.
    """

    def __init__(self) -> None:
        super().__init__(EXIT_STATUS)


class Termination:
    """Process-wide: whether SIGTERM was turned into ``SessionTerminated`` (signals are per process).

    ``arm`` (from the main thread, when a session installs its handler) registers the exit hook
    and starts the watchdog thread, which sleeps until ``requested`` wakes it. ``requested`` is
    what the signal handler calls: it sets a flag and an event, nothing else.
    """

    pending = False
    armed = False
    grace = defaults.EXIT_GRACE_SECONDS  # seconds; set again by every ``arm``
    _requested = threading.Event()

    @classmethod
    def arm(cls, grace: float) -> None:
        """Start the watchdog once (the exit hook is registered when this module is imported).

        ``grace``: seconds from the first SIGTERM until the watchdog ends a process still alive.
        """
        cls.grace = grace
        if cls.armed:
            return
        cls.armed = True
        threading.Thread(target=cls._watch, name="drbalance-exit-watchdog", daemon=True).start()

    @classmethod
    def requested(cls) -> None:
        """SIGTERM arrived: die of it at exit, and at the latest ``grace`` seconds from now."""
        cls.pending = True
        if not cls._requested.is_set():  # a lock-free read: a second SIGTERM handled while the first
            cls._requested.set()  # is inside ``set()`` (which holds the event's lock) must not wait on it

    @classmethod
    def die_if_pending(cls) -> None:
        """The exit hook: after a SIGTERM, flush the standard streams and die of SIGTERM."""
        if not cls.pending:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(EXIT_STATUS)  # only reached if SIGTERM is blocked

    @classmethod
    def _watch(cls) -> None:
        while True:
            cls._requested.wait()
            time.sleep(cls.grace)
            cls._requested.clear()
            if cls.pending:  # still to die (only a test in this process takes a SIGTERM back)
                break
        report = threading.Thread(target=_report_hang, args=(cls.grace,), daemon=True)
        report.start()
        report.join(STDERR_WRITE_SECONDS)
        os._exit(EXIT_STATUS)


# Registered when drbalance's client is imported, before any of its exit hooks (atexit runs them
# last first): a session's ``close``, and the release of the emulated GPUs of a backend, which a
# script builds before its session. Registered later (when the first session arms it), the hook
# would re-raise SIGTERM before that release runs, and a job stopped with SIGTERM would leave its
# emulated GPU in /dev/shm.
atexit.register(Termination.die_if_pending)


def _report_hang(grace: float) -> None:
    """Say on stderr (file descriptor 2) why the process ends now, and print every thread's stack."""
    message = (f"drbalance: this process was still running {grace:g} s after SIGTERM (a thread that never "
               f"ends, a blocked write or a hung cleanup); its threads follow, then it exits with status "
               f"{EXIT_STATUS}. DRBALANCE_EXIT_GRACE sets the wait.\n")
    try:
        os.write(2, message.encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
    except (OSError, ValueError):
        pass
