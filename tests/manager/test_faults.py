"""File-system faults are logged and survived, and the manager recovers.

The runtime directory removed, the status file replaced by a folder, a full disk (a real small
tmpfs where mounting is allowed, and a real file-size limit everywhere), and segments truncated
under a reader (which must not kill the reader with SIGBUS).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from drbalance.cli import main as drbalance
from drbalance.ipc import discovery
from drbalance.ipc.names import SHM_DIR
from tests.conftest import wait_for
from tests.helpers.disk import fill_up, mount_small_tmpfs
from tests.helpers.processes import ManagerProcess, decisions_for, first_line, long_app, stop_all, toy_app


@pytest.mark.slow
def test_the_runtime_directory_removed_under_a_running_manager(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = long_app("survivor")
    try:
        first_line(app)
        wait_for(lambda: decisions_for(manager, "survivor") >= 2)
        shutil.rmtree(ipc_env.runtime_dir().parent)  # the whole runtime directory, as a cleaner would
        repaired = wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "runtime files"])
        wait_for(lambda: ipc_env.manager_status().exists() and ipc_env.manager_info().exists())
        after = decisions_for(manager, "survivor")
        wait_for(lambda: decisions_for(manager, "survivor") > after + 2)  # the job talks to it again
        wait_for(lambda: ipc_env.app_claim("survivor").exists())  # and put its claim back
        newcomer = toy_app("newcomer", "--epochs", "1", "--iterations", "2")
        assert first_line(newcomer)["attached"]
        newcomer.communicate(timeout=120)
        assert manager.alive() and app.poll() is None
    finally:
        code, err = stop_all(manager, app)
    assert code == 0 and "Traceback" not in err, err
    assert repaired and discovery.read_manager(ipc_env) is None  # withdrawn at the clean stop


def test_the_manager_log_removed_under_a_running_manager_is_written_again(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        wait_for(lambda: manager.events("util"))
        manager.log_path.unlink()  # an rm, or a rotation by another tool: its lines would go to a deleted file
        repaired = wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "manager log"])
        assert manager.alive()
    finally:
        code, err = manager.stop()
    assert code == 0 and "Traceback" not in err, err
    assert repaired and manager.events("stop")  # the stop record is in the file at the log's path


@pytest.mark.slow
def test_the_status_file_replaced_by_a_folder(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = long_app("steady")
    status = ipc_env.manager_status()
    try:
        first_line(app)
        status.unlink()
        status.mkdir()
        fault = wait_for(lambda: [e for e in manager.events("fault") if e["task"] == "status"])
        before = decisions_for(manager, "steady")
        wait_for(lambda: decisions_for(manager, "steady") > before + 2)  # still serving
        status.rmdir()
        wait_for(lambda: [e for e in manager.events("recovered") if e["task"] == "status"])
        assert json.loads(status.read_text())["apps"][0]["name"] == "steady"
    finally:
        code, err = stop_all(manager, app)
    assert code == 0 and "Traceback" not in err, err
    assert "IsADirectoryError" in fault[0]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tmpfs", "file-size limit"])
def test_a_full_disk_is_survived_and_nothing_logged_is_lost(ipc_env, tmp_path, kind):
    """``tmpfs``: the log and the runtime directory on a real 512 KiB file system, filled up (ENOSPC).
    ``file-size limit``: RLIMIT_FSIZE on the running manager (EFBIG), lifted afterwards; needs no mount."""
    small = tmp_path / "small"
    extra_env = {}
    if kind == "tmpfs":
        if os.geteuid() != 0 or not mount_small_tmpfs(small):
            pytest.skip("mounting a small tmpfs needs root with CAP_SYS_ADMIN; the file-size limit case covers it")
        extra_env["DRBALANCE_RUNTIME_DIR"] = str(small / "run")
    log = (small if kind == "tmpfs" else tmp_path) / "manager.jsonl"
    manager = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50), "--log", str(log), env=extra_env, wait=False)
    manager.log_path = log
    app = None
    try:
        wait_for(lambda: manager.events("start"))
        app = toy_app("writer", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", env=extra_env)
        assert first_line(app)["attached"]
        wait_for(lambda: decisions_for(manager, "writer") >= 2)
        if kind == "tmpfs":
            filler = small / "filler"
            fill_up(filler)
        else:
            soft, hard = resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE, (log.stat().st_size, hard))
        fault = wait_for(lambda: "cannot write the manager log" in manager.stderr() and manager.stderr())
        during = [json.loads(app.stdout.readline()) for _ in range(12)]  # 4 boundaries while the disk is full
        assert all(line["attached"] for line in during) and manager.alive()
        if kind == "tmpfs":
            filler.unlink()
        else:
            resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE, (soft, hard))
        wait_for(lambda: "the manager log works again" in manager.stderr())
    finally:
        try:
            if app is not None:
                app.kill()
                app.wait()
            code, err = manager.stop()
            events = manager.events()
        finally:  # whatever failed above, the mount does not outlive the test
            if kind == "tmpfs" and small.is_mount():
                subprocess.run(["umount", "-l", str(small)], check=False)
    assert code == 0 and "Traceback" not in err, err
    assert "No space left" in fault or "File too large" in fault
    assert events[0]["event"] == "start" and events[-1]["event"] == "stop"
    decisions = [e for e in events if e["event"] == "decision"]
    assert len(decisions) == events[-1]["decisions"]  # every decision made during the fault is in the log
    assert not [e for e in events if e["event"] == "log_gap"]


@pytest.mark.slow
def test_segments_truncated_under_their_readers_cause_no_sigbus(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = long_app("shaky")
    try:
        first_line(app)
        wait_for(lambda: decisions_for(manager, "shaky") >= 2)
        token = discovery.read_manager(ipc_env).token
        os.truncate(SHM_DIR / ipc_env.manager_record(token).lstrip("/"), 0)  # the heartbeat, under the app
        wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "heartbeat"])
        claim = discovery.read_claim(ipc_env, "shaky")
        record = SHM_DIR / ipc_env.app_record("shaky", claim.token).lstrip("/")
        os.truncate(record, 0)  # the app's record, under the manager
        wait_for(lambda: record.stat().st_size > 0)  # the app restored its own record
        before = decisions_for(manager, "shaky")
        wait_for(lambda: decisions_for(manager, "shaky") > before + 2)
        assert manager.alive() and app.poll() is None
    finally:
        code, err = stop_all(manager, app)
    assert code == 0 and "Traceback" not in err, err
    _, app_err = app.communicate()
    assert "Traceback" not in app_err and "restored it" in app_err


BROKEN_SCRIPTS = {
    "garbage": "this is not JSON {",  # e.g. an editor's half-saved buffer, left so
    "a reading out of range": json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [150, 0, 0, 0]}]}),
}


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` at once (a rename): the manager never reads it half-written, so each change
    is one error or one recovery, whatever the load."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BROKEN_SCRIPTS))
def test_a_failing_utilisation_source_is_one_fault_shown_in_the_status_not_a_warning_per_sample(
        ipc_env, tmp_path, capsys, kind):
    manager = ManagerProcess(tmp_path, ipc_env)  # samples every 0.1 s
    status = ipc_env.manager_status()
    try:
        wait_for(lambda: manager.events("util"))
        replace_text(manager.util_file, BROKEN_SCRIPTS[kind])
        fault = wait_for(lambda: json.loads(status.read_text())["faults"].get("sample"))
        wait_for(lambda: json.loads(status.read_text())["fault_counts"].get("sample", 0) >= 20)  # 2 s of samples
        assert "scripted utilisation file" in fault or "outside 0..100" in fault, fault
        assert drbalance(["status"]) == 0
        assert "WARNING: the manager's sample is failing" in capsys.readouterr().out
        during = manager.stderr()
        replace_text(manager.util_file, json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [10, 20, 30, 40]}]}))
        recovered = wait_for(lambda: [e for e in manager.events("recovered") if e["task"] == "sample"])
        wait_for(lambda: "sample" not in json.loads(status.read_text())["faults"])
        assert json.loads(status.read_text())["util"] == [10, 20, 30, 40]
    finally:
        code, err = manager.stop()
    assert code == 0 and "Traceback" not in err, err
    assert during.count("sample failed") == 1, during  # once, not once per sample period
    assert err.count("sample works again") == 1, err
    assert len([e for e in manager.events("fault") if e["task"] == "sample"]) == 1
    assert recovered[0]["failures"] >= 20


def test_a_scripted_file_caught_mid_rewrite_keeps_its_last_script_and_one_left_broken_fails(tmp_path):
    from drbalance.manager.utilization import ScriptedSource, UtilizationUnavailable
    from tests.helpers.clock import ManualClock

    path = tmp_path / "util.json"
    path.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [10, 20]}]}))
    source = ScriptedSource(path, ManualClock())
    path.write_text("")  # truncated by a rewrite that has not written yet
    assert source.sample() == (10.0, 20.0) and source.memory() == (None, None)
    path.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [30, 40]}]}))
    assert source.sample() == (30.0, 40.0)
    path.write_bytes(b"\xff\xfe not text")
    assert source.sample() == (30.0, 40.0)  # the first look: perhaps being rewritten
    with pytest.raises(UtilizationUnavailable, match="scripted utilisation file"):
        source.sample()  # the same bytes at the next look: broken
    path.unlink()
    source.sample()
    with pytest.raises(UtilizationUnavailable, match="No such file"):
        source.sample()
    path.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [50, 60]}]}))
    assert source.sample() == (50.0, 60.0)


class _FailingLog:
    """A manager log whose writes fail while ``error`` is set (as JsonLinesWriter reports a full disk)."""

    def __init__(self) -> None:
        self.error: OSError | None = None
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> int:
        return 0


def _in_process_manager(ipc_env, tmp_path, clock=None):
    from drbalance.manager.daemon import Manager, ManagerSettings
    from drbalance.manager.utilization import ScriptedSource

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script), clock=clock)
    manager.start()
    manager._log.close()
    manager._log = _FailingLog()
    return manager


@pytest.mark.timeout(60)
def test_the_manager_log_failing_is_counted_in_fault_counts_like_other_faults(ipc_env, tmp_path):
    """status.json's fault_counts counts the log's failed writes in a row, as it counts every other
    failing task (drbalance status says "N times in a row"), not 1 however many failed."""
    from drbalance.manager.status import fault_lines

    manager = _in_process_manager(ipc_env, tmp_path)
    try:
        manager._log.error = OSError(28, "No space left on device")
        for _ in range(3):
            manager.log("decision", app="x")
        manager._write_status(manager.clock.monotonic())
        status = json.loads(ipc_env.manager_status().read_text())
        assert status["faults"]["log"] == "[Errno 28] No space left on device"
        assert status["fault_counts"]["log"] == 3
        assert "the manager's log is failing (3 times in a row)" in fault_lines(status)[0]
        manager._log.error = None
        manager.log("decision", app="x")
        manager._write_status(manager.clock.monotonic())
        status = json.loads(ipc_env.manager_status().read_text())
        assert "log" not in status["faults"] and "log" not in status["fault_counts"]
        manager._log.error = OSError(28, "No space left on device")
        manager.log("decision", app="x")  # a new run of failures counts from 1
        assert manager.fault_counts["log"] == 1
    finally:
        manager.stop()


@pytest.mark.timeout(60)
def test_a_persisting_fault_is_logged_again_once_a_minute_of_the_managers_own_clock(ipc_env, tmp_path):
    """The once-a-minute reminder read time.monotonic, not the manager's clock: on an injected
    clock a fault that persisted for minutes was never logged again."""
    from drbalance.manager.balancer import FAULT_REPEAT_SECONDS
    from tests.helpers.clock import ManualClock

    clock = ManualClock(start=1000.0)
    manager = _in_process_manager(ipc_env, tmp_path, clock)

    def broken(now: float) -> None:
        raise OSError(5, "Input/output error")

    def faults_logged() -> int:
        return len([r for r in manager._log.records if r["event"] == "fault" and r["task"] == "gc"])

    try:
        manager._run_task("gc", broken, clock.monotonic())
        assert faults_logged() == 1
        clock.advance(FAULT_REPEAT_SECONDS / 2)
        manager._run_task("gc", broken, clock.monotonic())
        assert faults_logged() == 1  # the same error within a minute: counted, not logged
        clock.advance(FAULT_REPEAT_SECONDS / 2)
        manager._run_task("gc", broken, clock.monotonic())
        assert faults_logged() == 2  # a minute on the manager's clock: logged again
        assert manager.fault_counts["gc"] == 3
    finally:
        manager.stop()
