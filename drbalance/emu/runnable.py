"""How long the calling thread has been runnable: on a CPU core, or waiting for one.

Emulated GPUs run every job of a multi-GPU server on this machine's few cores, and a job's real
CPU work (each chunk's forward and backward, the optimizer step) stands for work the modelled
server does on its GPU, which the emulated device phase already charges. The emulated backend
reads this time around its host phase and leaves the part that overran the modelled host time
out of the job's SD (``EmulatedBackend.uncounted_seconds``). Time the thread is blocked (an
answer from the manager, a data-loader worker, a sleep) is not runnable time, and counts.

Both numbers are the first two fields of ``/proc/thread-self/schedstat`` (nanoseconds on a CPU,
nanoseconds runnable but waiting for one, since the thread started); ``/proc/thread-self`` is
Linux 3.17 or later, and the file needs a kernel with scheduler statistics (``CONFIG_SCHED_INFO``,
set by every major distribution). Where it cannot be read, :func:`thread_runnable_seconds`
returns None and nothing is left out.
"""

from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_runnable_seconds(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has run on a CPU core or waited for one since it started, or
    None where the kernel does not say (no such file, or not three whole numbers in it)."""
    try:
        with open(path, "rb") as stats:
            fields = stats.read().split()
        running, waiting = int(fields[0]), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
    if len(fields) != 3 or running < 0 or waiting < 0:
        return None
    return (running + waiting) / 1e9
