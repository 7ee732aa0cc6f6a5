"""Emulated GPUs leave the host-phase time this machine's CPU took past the modelled host time out
of a job's SD (docs/emulation.md): the job's runnable time from the kernel (every thread of the
process and of its children), and the host phase that leaves out at most that, only past its
modelled time. Real processes pinned to one core."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from drbalance.emu.runnable import job_runnable_seconds, thread_runnable_seconds
from tests.conftest import python_process

BUSY_CHILD = "import sys, time\nend = time.thread_time() + float(sys.argv[1])\nwhile time.thread_time() < end:\n" \
             "    pass\nprint('done', flush=True)\nsys.stdin.read()\n"


def _job(*options: str | float) -> dict:
    process = python_process("tests.helpers.runnable_job", *map(str, options))
    out, err = process.communicate(timeout=150)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_the_kernel_says_how_long_this_thread_has_been_runnable():
    first = thread_runnable_seconds()
    assert first is not None and first > 0.0  # Linux with scheduler statistics, as CI and servers are
    end = time.thread_time() + 0.05
    while time.thread_time() < end:  # 50 ms on a CPU
        pass
    assert thread_runnable_seconds() - first >= 0.045
    slept = thread_runnable_seconds()
    time.sleep(0.5)  # blocked, not runnable (a loaded machine may add a wait for a core on waking)
    assert thread_runnable_seconds() - slept < 0.25


def test_a_jobs_runnable_time_holds_its_other_threads_and_its_children():
    """The thread that calls the forward waits, blocked, for PyTorch's intra-op threads and a data
    loader's worker processes: their CPU work is the job's too."""
    before_job, before_thread = job_runnable_seconds(), thread_runnable_seconds()
    worker = threading.Thread(target=lambda: _burn(0.2))
    worker.start()
    worker.join()  # blocked meanwhile
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD, "0.2"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # 0.2 s of CPU, and the child lives on
        job = job_runnable_seconds() - before_job
    finally:
        child.communicate("", timeout=30)
    assert thread_runnable_seconds() - before_thread < 0.15  # this thread was mostly blocked
    assert job >= 0.2 + 0.2  # the thread's 0.2 s, the child's 0.2 s (and ours)
    assert job_runnable_seconds(pid=2**22 + 1) is None  # no such process: nothing to tell


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_an_unreadable_or_malformed_statistics_file_means_nothing_is_left_out(tmp_path):
    assert thread_runnable_seconds(str(tmp_path / "missing")) is None
    for text in ("", "12 x 3", "1 2", "1 -5 3", "-1 5 3"):
        path = tmp_path / "schedstat"
        path.write_text(text)
        assert thread_runnable_seconds(str(path)) is None, text
    path.write_text("500000000 2000000000 7\n")
    assert thread_runnable_seconds(str(path)) == 2.5


@pytest.mark.timeout(300)
def test_a_host_phase_past_its_modelled_time_is_left_out_of_the_sd(ipc_env):
    """A busy process on the job's only core, and a host phase modelled as 0 s: each phase's CPU
    work and its wait for the core are left out (at most the thread's runnable time), and the
    session's tracker leaves out the same."""
    got = _job("--burner")
    assert got["uncounted"] > 0.05
    assert got["uncounted"] <= got["runnable"] + 1e-6 and got["uncounted"] < got["wall"]
    # all of it after the session began (the host phase under way counts on between the reads; the
    # kernel updates a running thread's time at scheduler ticks, so the reads are usually equal)
    assert got["uncounted"] <= got["tracker"] <= got["uncounted_after"] <= got["uncounted"] + 0.05


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_phase_the_modelled_time_holds_leaves_nothing_out(ipc_env):
    """The modelled host time (0.5 s) holds the CPU work (a narrow model: about a millisecond a
    step alone, tens with the burner and a loaded machine) and its wait for the core: the phase
    sleeps the rest, the job's time is the modelled one, and nothing is left out. (A wide model
    and 0.2 s are too tight under load: a phase can overrun by 0.03 s.)"""
    got = _job("--host", 0.5, "--burner", "--width", 64)
    assert got["runnable"] > 0.0
    assert got["uncounted"] == 0.0 and got["tracker"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_the_job_is_blocked_counts_even_past_the_modelled_host_time(ipc_env):
    """A loop blocked 0.1 s after each of its 16 steps (as for a manager's answer) overruns a
    host time modelled as 0 s by those 1.6 s too, but they are not CPU work: they count. (What
    is left out is at most the runnable time, which on a loaded core can itself be seconds.)"""
    got = _job("--sleep", 0.1)
    assert got["uncounted"] <= got["runnable"] + 1e-6
    assert got["wall"] - got["uncounted"] >= 1.6  # the blocked 1.6 s all count


@pytest.mark.timeout(300)
def test_cpu_time_is_left_out_of_the_iteration_that_took_it(ipc_env):
    """An iteration ends inside the next host phase (after its backward and optimizer step): a
    first step that takes 0.3 s of CPU more is left out of the first iteration, as it goes, not
    of the second when that one's host phase ends, which would make the second look shorter
    than its own device phase (counted once at the host phase's end, it did: 0 s)."""
    got = _job("--first-step-cpu", 0.3)
    assert got["uncounted"] >= 0.3
    assert min(got["iterations"]) >= 0.9 * got["device"], got["iterations"]


@pytest.mark.timeout(300)
def test_cpu_work_of_another_thread_of_the_job_is_left_out_too(ipc_env):
    """A second thread of the job does 0.05 s of CPU work after each of the 16 steps while the
    loop waits for it, blocked, as it waits for PyTorch's intra-op threads: that work is this
    machine's CPU time, left out like the loop's own (the loop's thread alone was runnable for
    less than it: 0.02-0.05 s a step on a loaded machine, against 0.8 s of the second thread's)."""
    got = _job("--thread-work", 0.05, "--width", 64)
    assert got["uncounted"] >= 16 * 0.05
    assert got["uncounted"] <= got["wall"]


@pytest.mark.timeout(300)
def test_the_set_up_before_the_first_forward_is_host_work_too(ipc_env):
    """1 s of CPU work between the session's start and the first forward (the first batch, a cost
    measurement): this machine's, left out like any host phase's overrun, so the job, alone on
    its emulated GPU, reads SD 1 against its modelled solo time; counted, it read 1 + 1 / 1.6."""
    got = _job("--setup-cpu", 1.0, "--host", 0.05, "--device", 0.05, "--width", 64)
    assert got["uncounted"] >= 1.0
    assert got["sd"] == pytest.approx(1.0, abs=0.15)
