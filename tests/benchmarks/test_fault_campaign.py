"""The fault campaign (benchmarks/fault_campaign.py) runs against the real code, so it goes stale
when a name or protocol changes (an inbox name it no longer knows makes its corrupt-input section
fail at its start, unnoticed outside the suite). Its quick corrupt section, run here, checks that
it still reaches the manager and what it measures holds."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, python_process

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_the_quick_corrupt_input_section_runs_and_the_manager_survives_it():
    process = python_process("benchmarks.fault_campaign", "--quick", "--only", "corrupt", "--no-write", cwd=ROOT)
    out, err = process.communicate(timeout=200)
    assert process.returncode == 0, err[-3000:]
    section = json.loads(out[out.index("{"):])  # after its 'corrupt ...' line: the section's JSON
    assert section["records_corrupted"] == 60 and section["messages_sent"] == 60
    assert section["manager_alive"] and section["still_answering_a_good_job"]
    assert section["bad_dr_sent"] == 0 and section["live_records_removed"] == 0
    assert section["leaks_after"] == [], section["leaks_after"]
