"""Emulated GPUs leave a job's waits for this machine's CPU cores out of its SD (docs/emulation.md):
the run-queue delay read from the kernel, and the host phase that counts it only past its
modelled time. Real processes pinned to one core, no stand-ins."""

from __future__ import annotations

import json

import pytest

from drbalance.emu.cpu_wait import thread_cpu_wait
from tests.conftest import python_process


def _job(host_seconds: float, burner: bool) -> dict:
    process = python_process("tests.helpers.cpu_wait_job", str(host_seconds), "1" if burner else "0")
    out, err = process.communicate(timeout=150)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_the_kernel_says_how_long_this_thread_waited_for_a_core():
    first = thread_cpu_wait()
    assert first is not None and first >= 0.0  # Linux with scheduler statistics, as CI and servers are
    assert thread_cpu_wait() >= first


def test_an_unreadable_or_malformed_statistics_file_means_nothing_is_left_out(tmp_path):
    assert thread_cpu_wait(str(tmp_path / "missing")) is None
    for text in ("", "12 x 3", "1 2", "1 -5 3"):
        path = tmp_path / "schedstat"
        path.write_text(text)
        assert thread_cpu_wait(str(path)) is None, text
    path.write_text("100 2500000000 7\n")
    assert thread_cpu_wait(str(path)) == 2.5


@pytest.mark.timeout(300)
def test_a_host_phase_past_its_modelled_time_leaves_its_cpu_wait_out_of_the_sd(ipc_env):
    """A busy process on the job's only core: each host phase (modelled as 0 s) waits for the
    core; that wait, at most the overrun, is left out, and the session's tracker leaves out the same."""
    got = _job(0.0, burner=True)
    assert got["uncounted"] > 0.05  # the burner takes about half the core
    assert got["uncounted"] <= got["waited"] + 1e-6 and got["uncounted"] < got["wall"]
    assert got["tracker"] == pytest.approx(got["uncounted"], abs=1e-9)  # all of it after the session began


@pytest.mark.timeout(300)
def test_a_wait_the_modelled_host_time_absorbs_is_not_left_out(ipc_env):
    """A host phase modelled long enough to hold the CPU work and its wait sleeps the rest: the
    job's time is the modelled one, nothing is left out even though the thread waited."""
    got = _job(0.2, burner=True)
    assert got["waited"] > 0.0
    assert got["uncounted"] == 0.0 and got["tracker"] == 0.0
