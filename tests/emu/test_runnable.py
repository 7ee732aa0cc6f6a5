"""Emulated GPUs leave the host-phase time this machine's CPU took past the modelled host time out
of a job's SD (docs/emulation.md): the thread's runnable time from the kernel, and the host phase
that leaves out at most that, only past its modelled time. Real processes pinned to one core."""

from __future__ import annotations

import json
import time

import pytest

from drbalance.emu.runnable import thread_runnable_seconds
from tests.conftest import python_process


def _job(host_seconds: float, burner: bool, sleep: float = 0.0, first_step_cpu: float = 0.0,
         width: int = 512) -> dict:
    process = python_process("tests.helpers.runnable_job", str(host_seconds), "1" if burner else "0", str(sleep),
                             str(first_step_cpu), str(width))
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
    got = _job(0.0, burner=True)
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
    got = _job(0.5, burner=True, width=64)
    assert got["runnable"] > 0.0
    assert got["uncounted"] == 0.0 and got["tracker"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_the_job_is_blocked_counts_even_past_the_modelled_host_time(ipc_env):
    """A loop blocked 0.1 s after each of its 16 steps (as for a manager's answer) overruns a
    host time modelled as 0 s by those 1.6 s too, but they are not CPU work: they count. (What
    is left out is at most the runnable time, which on a loaded core can itself be seconds.)"""
    got = _job(0.0, burner=False, sleep=0.1)
    assert got["uncounted"] <= got["runnable"] + 1e-6
    assert got["wall"] - got["uncounted"] >= 1.6  # the blocked 1.6 s all count


@pytest.mark.timeout(300)
def test_cpu_time_is_left_out_of_the_iteration_that_took_it(ipc_env):
    """An iteration ends inside the next host phase (after its backward and optimizer step): a
    first step that takes 0.3 s of CPU more is left out of the first iteration, as it goes, not
    of the second when that one's host phase ends, which would make the second look shorter
    than its own device phase (counted once at the host phase's end, it did: 0 s)."""
    got = _job(0.0, burner=False, first_step_cpu=0.3)
    assert got["uncounted"] >= 0.3
    assert min(got["iterations"]) >= 0.9 * got["device"], got["iterations"]
