"""The fault campaign (benchmarks/fault_campaign.py) runs against the real code, so it goes stale
when a name or protocol changes (an inbox name it no longer knows makes its corrupt-input section
fail at its start, unnoticed outside the suite). Its quick corrupt section, and its quick system
manager section, run here, check that they still reach the manager and what they measure holds."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, python_process
from tests.helpers.neighbour import needs_second_user


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_quick_corrupt_input_section_runs_and_the_manager_survives_it():
    process = python_process("benchmarks.fault_campaign", "--quick", "--only", "corrupt", "--no-write", cwd=ROOT)
    out, err = process.communicate(timeout=200)
    assert process.returncode == 0, err[-3000:]
    section = json.loads(out[out.index("{"):])  # after its 'corrupt ...' line: the section's JSON
    assert section["records_corrupted"] == 60 and section["messages_sent"] == 60
    assert section["manager_alive"] and section["still_answering_a_good_job"]
    assert section["bad_dr_sent"] == 0 and section["live_records_removed"] == 0
    assert section["leaks_after"] == [], section["leaks_after"]


def served_cleanly(run: dict) -> None:
    """What every system manager of the section must show: no bad DR, no fault, no traceback, a clean stop."""
    assert run["bad_dr_sent"] == 0 and run["faults"] == [] and run["tracebacks_on_stderr"] == 0, run
    assert run["exit_status"] == 0, run


@pytest.mark.slow
@pytest.mark.second_user
@needs_second_user
@pytest.mark.timeout(900)
def test_the_quick_system_manager_section_runs_and_every_attack_fails(tmp_path):
    out = tmp_path / "system.json"
    process = python_process("benchmarks.fault_campaign", "--quick", "--only", "system", "--out", str(out), cwd=ROOT)
    _, err = process.communicate(timeout=840)
    assert process.returncode == 0, err[-3000:]
    section = json.loads(out.read_text())["system"]
    for run in section["job_kill9"]:  # every killed job dropped, its descriptors and its limits freed
        served_cleanly(run)
        assert run["manager_alive_throughout"] and run["descriptors_left_over"] == 0, run
        assert run["limits_freed (2 jobs of each user attach, limit 2)"], run
    assert section["job_kill9"][1]["capabilities"] == "0000000000000000"  # the service user has none
    for run in section["manager_kill9"]:
        served_cleanly(run)
        assert run["every_job_trained_while_no_manager"] and run["connect_while_dead"] == "ConnectionRefusedError"
        assert run["socket_left_by_the_killed_manager"] and run["socket_listened_by_the_restarted_manager"], run
        assert run["invalid_dr_applied"] == 0 and run["descriptors_left_over"] == 0, run
    stopped = section["manager_sigstop"]
    served_cleanly(stopped)
    assert stopped["steps_while_stopped_min"] > 0 and stopped["detached_events"] == 0, stopped
    assert stopped["backlog_filled_by_another_user"] > 0
    for late in (stopped["job_started_while_stopped"], stopped["job_started_while_stopped_and_backlog_full"]):
        assert not late["attached_at_start"] and late["steps_while_stopped"] > 0, late  # it trained meanwhile
    corrupt = section["corrupt"]
    served_cleanly(corrupt)
    answers = corrupt["answers"]
    singles = {what: answer for what, answer in answers.items() if isinstance(answer, str)}
    assert singles["an empty message"] == "closed"
    assert all(answer.startswith("REFUSED (INVALID)") for what, answer in singles.items()
               if what != "an empty message"), singles
    assert answers["her own record corrupted while attached"]["invalid_commands_read"] == 0
    assert corrupt["manager_alive"] and corrupt["still_answering_user_a"] and corrupt["user_a_invalid_dr"] == 0
    assert corrupt["user_a_removed_while_alive"] == 0 and corrupt["descriptors_left_over"] == 0, corrupt
    flood = section["flood"]
    served_cleanly(flood)
    assert flood["manager_alive"] and flood["user_a_invalid_dr"] == 0
    assert all(phase["user_a_answered"] > 0 for phase in flood["phases"].values()), flood["phases"]
    assert set(flood["refusals_logged_per_reason"].values()) == {1}, flood["refusals_logged_per_reason"]
    assert flood["problem_lines_withheld_for_user_b"] > 0 and flood["descriptors_left_over"] == 0
    hostile = section["hostile"]
    for who in ("root", "service user"):
        planted = hostile[f"planting in the system folder ({who}'s)"]
        times = planted.pop("change manager.sock's times")  # the socket is 0666 (connect needs it): harmless
        assert set(planted.values()) == {"PermissionError"}, planted
        assert times == "done"
        served_cleanly({**hostile[f"manager ({who})"], "exit_status": 0})
    assert set(hostile["exit_status"].values()) == {0}
    names = hostile["names"]
    assert names["first ATTACH of b-dup"] == "WELCOME"
    assert names["the first connection's notice afterwards"] == "COMMAND"
    assert names["second ATTACH of b-dup on another connection"].startswith("REFUSED (NAME_IN_USE)")
    for idle in ("connections that sent nothing", "connections that asked the status once, then nothing"):
        assert hostile[idle]["closed"] == hostile[idle]["opened"], hostile[idle]
    look_alike = hostile["look-alike system dir in /tmp"]
    assert look_alike["connections her listener got"] == 0
    folder, link = look_alike["her folder"], look_alike["her link to it"]
    assert folder["attached"] == 0 and "anyone may make folders" in folder["warning"], folder
    assert link["attached"] == 0 and "symbolic link" in link["warning"], link
    assert hostile["user_a_job_of_the_shared_name"]["answered"] > 0
    assert section["leftovers"] == [], section["leftovers"]
