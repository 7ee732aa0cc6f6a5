"""Only dead processes are collected, and every dead one is:

- a live job quiet for longer than --quiet-after stays (shown as quiet), and its name stays taken;
- a job killed during its first status write is collected, and its name is free again;
- a dead job whose pid now belongs to another process counts as dead (pid + start time);
- the rescan never deletes a live job's record, however unreadable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import time

import pytest

from drbalance import DataRatio
from drbalance.cli import main as drbalance
from drbalance.ipc import discovery, objects
from drbalance.ipc.layout import AREA_HEADER, SEGMENT_HEADER, STATUS_OFFSET, AppState, AppStatus
from drbalance.ipc.names import SHM_DIR
from drbalance.ipc.records import AppNameInUse, AppRecord
from drbalance.manager.daemon import Manager, ManagerSettings
from drbalance.manager.table import AppEntry
from drbalance.manager.utilization import ScriptedSource
from tests.conftest import leftovers, python_process, wait_for
from tests.helpers.processes import ManagerProcess, first_line, toy_app


def idle_app(name: str, *flags: str):
    process = python_process("tests.helpers.idle_app", name, *flags)
    ready, token = process.stdout.readline().split()
    assert ready == "ready"
    return process, token


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def status_ticks(pid: int) -> int:
    ticks = objects.process_start_ticks(pid)
    assert ticks is not None
    return ticks


@pytest.mark.slow
def test_a_quiet_live_job_stays_and_keeps_its_name_until_its_process_dies(ipc_env, tmp_path, capsys):
    manager = ManagerProcess(tmp_path, ipc_env, (50, 50, 50, 50), "--quiet-after", "1")
    app = toy_app("thinker", "--epochs", "5", "--iterations", "3", "--hang-after", "1")  # a long evaluation
    try:
        first_line(app)
        wait_for(lambda: manager.events("app_quiet"))
        status = wait_for(lambda: [a for a in json.loads(ipc_env.manager_status().read_text())["apps"]
                                   if a["quiet_for"] is not None])
        assert status[0]["name"] == "thinker"
        assert drbalance(["status"]) == 0
        assert "quiet" in capsys.readouterr().out
        time.sleep(2.5)  # several GC periods (1 s) past --quiet-after: still there
        assert ipc_env.listed_apps() == ["thinker"] and not manager.events("app_removed")
        with pytest.raises(AppNameInUse, match="already running as pid"):
            discovery.AppClaim.take(ipc_env, "thinker")  # a second job of that name is refused
        kill(app)
        removed = wait_for(lambda: manager.events("app_removed"))
        wait_for(lambda: ipc_env.listed_apps() == [])
    finally:
        kill(app)
        code, err = manager.stop()
    assert code == 0, err
    assert [e["event"] for e in manager.events() if e["event"].startswith("app_")] == \
        ["app_added", "app_quiet", "app_removed"]
    assert removed[0]["reason"] == "process gone"


@pytest.mark.slow
def test_a_job_killed_during_its_first_status_write_is_collected(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        half, token = idle_app("halfway", "--half")
        assert ipc_env.listed_apps() == ["halfway"]
        kill(half)
        removed = wait_for(lambda: manager.events("app_removed"))
        assert removed[0]["app"] == "halfway" and removed[0]["reason"] == "leftovers of a dead process"
        wait_for(lambda: ipc_env.listed_apps() == [] and ipc_env.listed_signals() == [])
        assert not ipc_env.app_claim("halfway").exists()
        again = toy_app("halfway", "--epochs", "1", "--iterations", "2")
        assert first_line(again)["attached"]  # the name is free again
        again.communicate(timeout=120)
        assert again.returncode == 0
    finally:
        code, err = manager.stop()
    assert code == 0, err
    assert not [e for e in manager.events("invalid") if e.get("app") == "halfway"]


@pytest.mark.slow
def test_without_a_manager_the_next_job_takes_a_half_written_name(ipc_env):
    half, token = idle_app("halfway", "--half")
    kill(half)
    app = toy_app("halfway", "--epochs", "1", "--iterations", "2")
    out, err = app.communicate(timeout=120)
    assert app.returncode == 0, err  # not AppNameInUse
    assert leftovers(ipc_env) == [] and not ipc_env.app_claim("halfway").exists()


def test_liveness_is_pid_and_start_time():
    other = subprocess.Popen(["sleep", "60"])
    try:
        ticks = status_ticks(other.pid)
        status = AppStatus(other.pid, "x", AppState.RUNNING, DataRatio([10]), 0, 1, 0, 10, 10, 0, None, None, 1.0,
                           0.0, 0.0, 0.0, start_ticks=ticks)
        entry = AppEntry("x", None, status, 0.0, owner_pid=other.pid, owner_ticks=ticks)
        assert entry.alive()
        entry.owner_ticks = ticks + 1  # the pid its claim named now names another process
        assert not entry.alive()
        entry.owner_ticks = 0  # unknown (an old client): the pid decides
        assert entry.alive()
        entry.status = dataclasses.replace(status, pid=1, start_ticks=ticks + 1)  # a record's word changes nothing
        assert entry.alive()
    finally:
        kill(other)
    assert not objects.process_alive(other.pid, ticks) and not objects.process_alive(other.pid)


def plant_dead_app_with_a_reused_pid(names, app: str, pid: int, ticks: int) -> str:
    """The claim and record a job left when it died, naming ``pid``, which another process now has."""
    token = discovery.new_token()
    names.private_runtime_dir()
    names.claims_dir().mkdir(mode=0o700, exist_ok=True)
    (names.claims_dir() / f"{app}.claim").write_bytes(
        discovery.ClaimInfo(app, pid, ticks, token, time.time()).encode())
    record = AppRecord.create(names, app, token)
    record.write_status(AppStatus(pid, app, AppState.RUNNING, DataRatio([1, 1, 1, 1], 4), 0, 10, 1, 100, 10, 0, 1.5,
                                  0.1, 10.0, time.time(), time.time(), time.monotonic(), start_ticks=ticks))
    record.close()
    objects.create_semaphore(names.app_signal(app, token)).close()
    return token


def test_a_dead_job_whose_pid_was_reused_is_collected_not_kept(ipc_env, tmp_path):
    reuser = subprocess.Popen(["sleep", "120"])  # a process that now has the dead job's pid
    try:
        plant_dead_app_with_a_reused_pid(ipc_env, "ghost", reuser.pid, status_ticks(reuser.pid) - 1)
        manager = ManagerProcess(tmp_path, ipc_env)
        try:
            removed = wait_for(lambda: manager.events("app_removed"))
            wait_for(lambda: ipc_env.listed_apps() == [] and ipc_env.listed_signals() == [])
        finally:
            manager.stop()
        assert removed[0]["app"] == "ghost" and removed[0]["pid"] == reuser.pid
        assert not manager.events("app_added")  # never took part in a decision
        assert not ipc_env.app_claim("ghost").exists() and reuser.poll() is None
    finally:
        kill(reuser)


def test_a_registered_job_whose_pid_is_reused_is_removed(ipc_env, tmp_path):
    """The pid its claim named, once the job is registered, now names another process (its start
    time differs): the manager's GC removes the job. The start time is the claim's, kept when the
    job was admitted; a pid cannot be made to be reused here, so the kept one is changed."""
    reuser = subprocess.Popen(["sleep", "120"])
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    try:
        ticks = status_ticks(reuser.pid)
        plant_dead_app_with_a_reused_pid(ipc_env, "ghost", reuser.pid, ticks)  # alive, for now
        manager.start()  # its first rescan adopts the job
        entry = manager.table.get("ghost")
        assert entry is not None and entry.alive()
        entry.owner_ticks = ticks + 7  # what the kept start time is once another process has the pid
        manager._collect_garbage(time.monotonic())
        assert "ghost" not in manager.table
        assert ipc_env.listed_apps() == [] and ipc_env.listed_signals() == []
    finally:
        manager.stop()
        kill(reuser)
    removed = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()
               if '"event":"app_removed"' in line]
    assert [(e["app"], e["reason"]) for e in removed] == [("ghost", f"pid {reuser.pid} now belongs to another process")]


@pytest.mark.slow
@pytest.mark.parametrize("forged", ["pid", "start time"])
def test_a_well_formed_record_naming_another_process_is_invalid_never_a_reason_to_collect(ipc_env, tmp_path, forged):
    """One CRC-correct write of a wrong pid or start time into a live job's record (by a process of
    the same user) must not make the manager remove the job's record and semaphore ("process gone",
    "pid N now belongs to another process"). Liveness comes from the claim: the record is invalid,
    logged, and the job stays, objects and all."""
    manager = ManagerProcess(tmp_path, ipc_env)
    process, token = idle_app("forged")  # publishes once, then sits still: nothing overwrites the forgery
    try:
        wait_for(lambda: manager.events("app_added"))
        gone = subprocess.Popen(["true"])
        gone.wait()  # a pid nobody has now
        record = AppRecord.open(ipc_env, "forged", token)
        status = record.read_status()
        change = {"pid": gone.pid} if forged == "pid" else {"start_ticks": status.start_ticks + 7}
        record.write_status(dataclasses.replace(status, **change))  # well-formed, checksum and all
        record.close()
        seen = wait_for(lambda: [e for e in manager.events() if e.get("app") == "forged"
                                 and e["event"] in ("invalid", "app_removed")])
        assert seen[0]["event"] == "invalid" and "the record is ignored, the app kept" in seen[0]["error"], seen
        written = seen[0]["t"]
        shown = wait_for(lambda: (status := json.loads(ipc_env.manager_status().read_text()))["updated"] > written + 2
                         and status)  # GC passes after the forgery
        assert [app["name"] for app in shown["apps"]] == ["forged"]
        assert ipc_env.listed_apps() == ["forged"] and ipc_env.listed_signals() == ["forged"]
        assert not manager.events("app_removed")
    finally:
        kill(process)
        code, err = manager.stop()
    assert code == 0 and "Traceback" not in err, err


def break_header(mapping, field_format: str, offset: int, value) -> None:
    struct.pack_into(field_format, mapping, offset, value)


PAYLOAD = STATUS_OFFSET + AREA_HEADER.size
CORRUPTIONS = {
    "newer layout": lambda m: break_header(m, "<H", 4, 99),
    "bad magic": lambda m: break_header(m, "<4s", 0, b"XXXX"),
    "wrong kind": lambda m: break_header(m, "<H", 6, 7),
    "wrong offsets": lambda m: break_header(m, "<I", 8, 128),
    "checksum": lambda m: m.__setitem__(PAYLOAD + 70, m[PAYLOAD + 70] ^ 0xFF),
    "odd counter": lambda m: break_header(m, "<I", STATUS_OFFSET, 7),
    "garbage status": lambda m: m.__setitem__(slice(STATUS_OFFSET + 8, STATUS_OFFSET + 108), b"\xff" * 100),
}


@pytest.mark.slow
def test_the_rescan_never_deletes_a_live_jobs_unreadable_record(ipc_env, tmp_path):
    apps = {}
    try:
        for index, (kind, corrupt) in enumerate(CORRUPTIONS.items()):
            name = f"live{index}"
            process, token = idle_app(name)
            apps[name] = (process, token, kind)
            record = AppRecord.open(ipc_env, name, token)
            corrupt(record.segment.mapping)
            record.close()
        truncated, token = idle_app("short")
        apps["short"] = (truncated, token, "truncated")
        os.truncate(SHM_DIR / ipc_env.app_record("short", token).lstrip("/"), 100)
        before = leftovers(ipc_env)
        assert len(before) == 2 * len(apps)
        manager = ManagerProcess(tmp_path, ipc_env)
        try:
            invalid = wait_for(lambda: len({e["app"] for e in manager.events("invalid")}) == len(apps)
                               and manager.events("invalid"))
            time.sleep(2.5)  # more rescans: nothing is deleted, nothing is reported twice
            assert [e for e in leftovers(ipc_env) if ".manager." not in e] == before
            assert not manager.events("app_removed") and not manager.events("app_added")
            assert all("its process runs: kept" in e["error"] for e in invalid)
            assert len(manager.events("invalid")) == len(apps)
            for process, _, _ in apps.values():
                kill(process)
            removed = wait_for(lambda: len(manager.events("app_removed")) == len(apps)
                               and manager.events("app_removed"))
            wait_for(lambda: ipc_env.listed_apps() == [] and ipc_env.listed_signals() == [])
        finally:
            code, err = manager.stop()
        assert code == 0 and "Traceback" not in err, err
        assert {e["reason"] for e in removed} == {"leftovers of a dead process"}
    finally:
        for process, _, _ in apps.values():
            kill(process)
    assert SEGMENT_HEADER.size == 16  # the offsets the corruptions above write to


def test_a_claim_that_is_a_folder_or_a_link_stops_no_other_apps_collection(ipc_env, tmp_path):
    half, _token = idle_app("halfway", "--half")
    kill(half)  # its record, semaphore and claim are left
    claims = ipc_env.app_claim("halfway").parent
    (claims / "folder.claim").mkdir()
    (claims / "linked.claim").symlink_to("/dev/null")
    for odd in ("folder.claim", "linked.claim"):  # older than the grace period for unfinished claims
        os.utime(claims / odd, (time.time() - 60, time.time() - 60), follow_symlinks=False)
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        removed = wait_for(lambda: manager.events("app_removed"))
        assert removed[0]["app"] == "halfway"
        wait_for(lambda: ipc_env.listed_apps() == [] and ipc_env.listed_signals() == [])
        reported = wait_for(lambda: [e for e in manager.events("invalid") if e.get("what") == "claim"])
        assert {e["app"] for e in reported} <= {"folder", "linked"} and manager.alive()
        assert not [e for e in manager.events("fault") if e.get("task") == "rescan"], manager.events("fault")
    finally:
        code, err = manager.stop()
    assert code == 0, err
    assert (claims / "folder.claim").is_dir() and (claims / "linked.claim").is_symlink()  # left as they are


@pytest.mark.slow
def test_records_left_mid_write_that_no_claim_names_cost_the_managers_loop_no_waiting(ipc_env, tmp_path,
                                                                                      monkeypatch):
    from drbalance.ipc import records
    from drbalance.ipc.names import new_token
    from drbalance.manager.daemon import Manager, ManagerSettings
    from drbalance.manager.listing import ShmLister
    from drbalance.manager.utilization import ScriptedSource

    for index in range(30):  # writers killed mid-write, their claims gone (e.g. with the runtime directory)
        ghost = AppRecord.create(ipc_env, f"ghost{index}", new_token())
        ghost.segment.words[ghost.status_area.counter_index] = 1
        ghost.close()
    time.sleep(5.5)  # past the grace period for records being created (their ctime cannot be set)
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 2, "steps": [{"at": 0, "util": [0, 0]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    sleeps = []
    monkeypatch.setattr(records.time, "sleep", lambda seconds: sleeps.append(seconds))
    monkeypatch.setattr(ShmLister, "PACE", 0.0)  # each rescan below may begin its listing at once
    try:
        manager.start()  # its first rescan
        for _ in range(3):  # later rescans: each lists /dev/shm in a thread, taken by the loop
            manager._rescan(time.monotonic())
            assert manager._lister._thread is not None
            manager._lister.join(60)
            assert manager._lister.ready()
            manager._take_listing(time.monotonic())
    finally:
        manager.stop()
    assert sleeps == []  # no waits: 200-attempt reads would take about 20 ms each, every rescan
    reported = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    invalid = [e for e in reported if e["event"] == "invalid" and e.get("app", "").startswith("ghost")]
    assert len(invalid) == 30 and all("still being written" in e["error"] for e in invalid)  # once each
    assert len(leftovers(ipc_env)) == 30  # kept: no claim says whose they are


def test_what_the_manager_keeps_about_jobs_stays_bounded_as_jobs_come_and_go(ipc_env, tmp_path, monkeypatch, caplog):
    """A long-running manager kept, for every job that ever had a problem, the problem reported
    (``_reported``), the claim it could not collect (``_claims_left``) and the record it could
    not view (the table's ``_unviewable``): sets that grew with the jobs that came and went.
    Here 100 jobs come and go: each is adopted, cannot be viewed, dies while a new job takes its
    name, and a stray notice comes from a name nobody claims."""
    from drbalance.ipc.layout import Notice, NoticeKind
    from drbalance.manager import table
    from drbalance.manager.daemon import REPORT_FORGET_SECONDS, Manager, ManagerSettings
    from drbalance.manager.utilization import ScriptedSource
    from tests.helpers.clock import ManualClock

    real_view = table.AppEntry.view

    def view(entry, *args, **kwargs):  # what a record no view can be built from does
        if entry.name.startswith("job"):
            raise ValueError(f"no view of {entry.name}")
        return real_view(entry, *args, **kwargs)

    monkeypatch.setattr(table.AppEntry, "view", view)
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [0, 0, 0, 0]}]}')
    clock = ManualClock()
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script, clock), clock=clock)
    owner = subprocess.Popen(["sleep", "300"])  # the process the jobs' records name
    sizes = []

    def die(name: str, token: str) -> None:  # the pid its claim named now belongs to another process
        entry = manager.table.get(name)
        assert entry.token == token
        entry.owner_ticks = ticks + 7

    try:
        ticks = status_ticks(owner.pid)
        manager.start()
        for index in range(100):
            name = f"job{index}"
            token = plant_dead_app_with_a_reused_pid(ipc_env, name, owner.pid, ticks)  # alive: owner runs
            manager._rescan(clock.monotonic())
            assert name in manager.table
            manager.table.views(4, manager.server)
            manager.handle(Notice(NoticeKind.BOUNDARY, owner.pid, 1, f"stray{index}", 0.0))  # no claim: refused
            die(name, token)
            successor = plant_dead_app_with_a_reused_pid(ipc_env, name, owner.pid, ticks)  # a new job takes the name
            manager._collect_garbage(clock.monotonic())  # the first one's claim is not its own any more: kept
            manager._rescan(clock.monotonic())  # the successor adopted: that claim is forgotten
            assert manager.table.get(name).token == successor
            sizes.append((len(manager._reported), len(manager._claims_left), len(manager.table._unviewable)))
            die(name, successor)
            ipc_env.app_claim(name).unlink()  # before the manager collects it
            manager._collect_garbage(clock.monotonic())
            assert name not in manager.table
            clock.advance(REPORT_FORGET_SECONDS / 10)
            manager._rescan(clock.monotonic())
            sizes.append((len(manager._reported), len(manager._claims_left), len(manager.table._unviewable)))
        manager.handle(Notice(NoticeKind.BOUNDARY, owner.pid, 1, "stray99", 0.0))  # seen again soon: not again
        clock.advance(REPORT_FORGET_SECONDS * 2)
        manager._rescan(clock.monotonic())
        manager.handle(Notice(NoticeKind.BOUNDARY, owner.pid, 1, "stray99", 0.0))  # long after: reported again
    finally:
        manager.stop()
        kill(owner)
    assert max(size[0] for size in sizes) <= 12, sizes  # the last minute's stray notices: 10, give or take
    assert max(size[1] for size in sizes) == 0, sizes
    assert max(size[2] for size in sizes) <= 1, sizes  # the successor, while it runs
    warned = [r.getMessage() for r in caplog.records if "cannot admit 'stray99'" in r.getMessage()]
    assert len(warned) == 2, warned


def test_a_boundary_notice_from_a_job_whose_record_says_finished_gets_no_policy_decision(ipc_env, tmp_path,
                                                                                           caplog):
    """A process of the same user writes ``state=FINISHED`` (CRC-correct) into a live job's record,
    and the job then sends a boundary notice. The snapshot leaves finished apps out, so ``fair``
    asked about it failed (``KeyError: "app 'cj' is not in the snapshot"``), logged as the policy's
    error with a traceback. The manager keeps the job's DR without asking the policy (branch
    ``finished``) and writes no traceback."""
    from torch import nn

    from drbalance.client import BalancedDataParallel, Session
    from drbalance.ipc.layout import Notice, NoticeKind

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    session = None
    try:
        manager.start()
        session = Session(BalancedDataParallel(nn.Linear(4, 1), device_ids=[0, 1, 2, 3]), app="cj", epochs=1,
                          iterations_per_epoch=100, solo_time=10.0, sd_log=False, exchange_timeout=0.0,
                          handle_sigterm=False)
        manager.handle(Notice(NoticeKind.REGISTER, os.getpid(), session.notice_seq, "cj", time.time()))
        for _ in range(12):
            session.step()
        forged = dataclasses.replace(session._status(time.monotonic()), state=AppState.FINISHED,
                                     notice_seq=session.notice_seq + 1)
        session.link.publish(forged)  # as the neighbour's write: CRC-correct, in the job's own record
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), session.notice_seq + 1, "cj", time.time()))
    finally:
        if session is not None:
            session.close()
        manager.stop()
    decisions = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()
                 if '"event":"decision"' in line]
    assert [d["branch"] for d in decisions][-1] == "finished", decisions
    assert decisions[-1]["new_dr"] == decisions[-1]["old_dr"]
    assert "policy-error" not in {d["branch"] for d in decisions}
    assert "Traceback" not in caplog.text and "failed" not in caplog.text
