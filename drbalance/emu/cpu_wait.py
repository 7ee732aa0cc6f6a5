"""How long the calling thread has waited for a CPU core: the run-queue delay Linux keeps per thread.

Emulated GPUs put every job of a multi-GPU server on this machine's few cores. A real server gives
each GPU's job cores of its own, so a job that waits here for a core its neighbours hold would
not wait there. The emulated backend reads this delay around its host phase and leaves the part
that overran the modelled host time out of the job's SD (``EmulatedBackend.uncounted_seconds``).

The delay is the second field of ``/proc/thread-self/schedstat`` (nanoseconds the thread was
runnable but not running, since it started); ``/proc/thread-self`` is Linux 3.17 or later, and the
field needs a kernel built with scheduler statistics (``CONFIG_SCHED_INFO``, set by every major
distribution). Where it cannot be read, :func:`thread_cpu_wait` returns None and nothing is left out.
"""

from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_cpu_wait(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has spent waiting for a CPU core since it started, or None where
    the kernel does not say (no such file, or not three numbers in it)."""
    try:
        with open(path, "rb") as stats:
            fields = stats.read().split()
        waited = int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
    return waited / 1e9 if len(fields) == 3 and waited >= 0 else None
