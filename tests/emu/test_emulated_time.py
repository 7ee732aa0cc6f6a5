"""An emulated job's time is the emulated server's: each host phase's modelled host time and each
device phase's waits and service. What this machine adds (CPU work past the modelled host time on
any of the job's threads, waits for a core, blocked waits, threads waking late) is left out of the
job's SD (docs/emulation.md). Real processes pinned to one core."""

from __future__ import annotations

import json

import pytest

from tests.conftest import python_process


def _job(*options: str | float) -> dict:
    process = python_process("tests.helpers.emulated_time_job", *map(str, options))
    out, err = process.communicate(timeout=150)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_host_phase_past_its_modelled_time_is_left_out_of_the_sd(ipc_env):
    """A busy process on the job's only core, and a host phase modelled as 0 s: each phase's CPU
    work and its wait for the core are left out, and the session's tracker leaves out the same."""
    got = _job("--burner")
    assert got["uncounted"] > 0.05 and got["uncounted"] < got["wall"]
    # all of it after the session began (the host phase under way counts on between the reads)
    assert got["uncounted"] <= got["tracker"] <= got["uncounted_after"] <= got["uncounted"] + 0.05
    # what is left is the emulated time: 16 device phases of 0.01 s, and threads waking late left out
    assert got["wall"] - got["uncounted"] < 16 * 0.01 + 0.1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_phase_the_modelled_time_holds_leaves_nothing_out_of_it(ipc_env):
    """The modelled host time (0.5 s) holds the CPU work (a narrow model: about a millisecond a
    step alone, tens with the burner and a loaded machine) and its wait for the core: the phase
    sleeps the rest, and the job's time is the modelled one (only sleeps that end late, a few
    milliseconds each, are left out, and the set-up before the first forward)."""
    got = _job("--host", 0.5, "--burner", "--width", 64)
    assert sum(got["iterations"]) / len(got["iterations"]) == pytest.approx(0.5 + 0.01, rel=0.02)
    assert got["sd"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_the_job_is_blocked_is_left_out_too(ipc_env):
    """A loop blocked 0.1 s after each of its 16 steps (as for a manager's answer, which on a
    loaded machine waits for a core itself, or for a data loader's workers) overruns a host time
    modelled as 0.05 s: the emulated server's host time is the modelled one, and the blocked time
    past it (0.8 s) is left out like CPU work. (Counted, it made the job, alone on its emulated
    GPU, read SD 1.5 against its modelled 1.6 s.)"""
    got = _job("--sleep", 0.1, "--host", 0.05, "--device", 0.05, "--width", 64)
    assert got["uncounted"] >= 16 * (0.1 - 0.05)
    assert got["sd"] == pytest.approx(1.0, abs=0.15)


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
    machine's time, left out like the loop's own (the loop's thread alone was runnable for less
    than it: 0.02-0.05 s a step on a loaded machine, against 0.8 s of the second thread's)."""
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


@pytest.mark.timeout(300)
def test_device_phases_count_as_modelled_beside_a_busy_process(ipc_env):
    """With a busy process on the job's only core, the emulated GPU's threads and the loop wake
    late after every slice (a scheduler tick or more): those delays are this machine's, left out,
    so 16 device phases of 0.05 s take the emulated job 0.8 s, not 0.8 s and the delays."""
    got = _job("--burner", "--device", 0.05, "--width", 64)
    emulated = got["wall"] - got["uncounted"]
    assert emulated == pytest.approx(16 * 0.05, rel=0.05)
    assert all(iteration == pytest.approx(0.05, rel=0.1) for iteration in got["iterations"]), got["iterations"]


@pytest.mark.timeout(300)
def test_a_dr_change_that_shortens_the_host_time_never_runs_the_jobs_time_backwards(ipc_env):
    """Spread over 4 emulated GPUs, each host phase models 0.09 s of DataParallel overhead; after
    iteration 8 the batch goes whole on one GPU (none). The host phase under way when the DR
    changes was counted at the old phase's 0.09 s; counting it then at its own 0 s took time
    back, and the iteration after the change read 0 s (an SD extrapolated from it, far too low).
    Every iteration takes at least its device phase."""
    # 0.1 s of CPU work before each step: the host phase under way has passed the old 0.09 s then
    got = _job("--gpus", 4, "--overhead", 0.03, "--device", 0.02, "--consolidate-at", 8, "--thread-work", 0.1,
               "--width", 64)
    iterations = got["iterations"]  # from the second on
    assert min(iterations) >= 0.9 * 0.02, iterations
    # spread: the overhead and a device phase (a step ends part-way through a host phase, so one
    # iteration may take some of the next one's: their mean is exact); whole: a device phase
    assert sum(iterations[:6]) / 6 == pytest.approx(0.09 + 0.02, rel=0.05), iterations
    assert iterations[-1] == pytest.approx(0.02, rel=0.1)
