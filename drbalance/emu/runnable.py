"""How long a job's threads have been runnable: on a CPU core, or waiting for one.

Emulated GPUs run every job of a multi-GPU server on this machine's few cores, and a job's real
CPU work (each chunk's forward and backward, the optimizer step, data loading) stands for work the
modelled server does on its GPU or its many cores, which the emulated device phase and the
modelled host time already charge. The emulated backend reads this time around its host phase and
leaves the part that overran the modelled host time out of the job's SD
(``EmulatedBackend.uncounted_seconds``). Time in which no thread of the job is runnable (an answer
from the manager, a file, a sleep) is not runnable time, and counts.

A job's CPU work runs on more threads than the one that calls the forward: PyTorch's intra-op
threads (the caller waits for them at the end of each parallel operator, blocked while a busy
machine keeps them off a core) and the data loader's worker processes (the caller waits for the
next batch). :func:`job_runnable_seconds` sums every thread of this process and of its child
processes (one level: a data loader's workers); :func:`thread_runnable_seconds` is the calling
thread's alone. The sum over threads that ran at once exceeds the wall time they covered: it is a
cap on what is left out, never a share of it.

Each thread's numbers are the first two fields of its ``schedstat`` (nanoseconds on a CPU,
nanoseconds runnable but waiting for one, since the thread started); the file needs a kernel with
scheduler statistics (``CONFIG_SCHED_INFO``, set by every major distribution), and the child
processes ``/proc/<pid>/task/<tid>/children`` (``CONFIG_PROC_CHILDREN``, likewise; without it the
children are not counted). Where this process's own files cannot be read, both functions return
None and nothing is left out. A thread or child that ended since an earlier read takes its time
with it: the sum then grows less, and less is left out.
"""

from __future__ import annotations

import os

SCHEDSTAT = "/proc/thread-self/schedstat"
PROC = "/proc"


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


def job_runnable_seconds(pid: int | None = None, proc: str = PROC) -> float | None:
    """Seconds every thread of process ``pid`` (default: this one) and of its child processes
    has run on a CPU core or waited for one (summed over threads), or None where the process's
    own threads cannot be read."""
    pid = os.getpid() if pid is None else pid
    own, children = _process_runnable(pid, proc, with_children=True)
    if own is None:
        return None
    for child in children:
        seconds, _ = _process_runnable(child, proc, with_children=False)
        own += seconds or 0.0  # a child that ended meanwhile counts nothing
    return own


def _process_runnable(pid: int, proc: str, with_children: bool) -> tuple[float | None, list[int]]:
    """The summed runnable seconds of ``pid``'s threads (None if none could be read) and, if
    asked, the pids of its children."""
    tasks = f"{proc}/{pid}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None, []
    total: float | None = None
    children: list[int] = []
    for tid in tids:
        seconds = thread_runnable_seconds(f"{tasks}/{tid}/schedstat")
        if seconds is not None:
            total = (total or 0.0) + seconds
        if with_children:
            children.extend(_children(f"{tasks}/{tid}/children"))
    return total, children


def _children(path: str) -> list[int]:
    """The child pids listed in a thread's ``children`` file (none where it cannot be read)."""
    try:
        with open(path, "rb") as listing:
            return [int(field) for field in listing.read().split() if field.isdigit()]
    except OSError:
        return []
