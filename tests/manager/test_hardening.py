"""Smaller hardening checks: clear errors for bad paths, limits and status files, private files, signals,
log rotation and log paths; one test each (or a few per test where they share a run)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import stat
import time
from pathlib import Path

import posix_ipc
import pytest
from torch import nn

from drbalance.cli import main as drbalance
from drbalance.client import BalancedDataParallel
from drbalance.client.session import Session, SessionTerminated
from drbalance.client.termination import Termination
from drbalance.ipc import discovery, objects
from drbalance.ipc.layout import Notice, NoticeKind
from drbalance.ipc.private import write_private
from drbalance.ipc.records import AppRecord
from drbalance.jsonlog import JsonLinesWriter, read_json_lines, rotated_files
from drbalance.profiling.store import Profile, save_profile
from tests.conftest import leftovers, python_process, wait_for
from tests.helpers.processes import ManagerProcess, first_line, toy_app

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR|DEBUG) ")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_bad_log_path_is_a_clear_error_and_leaks_nothing(ipc_env, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    manager = ManagerProcess(tmp_path, ipc_env, (50,), "--log", str(blocker / "manager.jsonl"), wait=False)
    code, err = manager.stop(signal_it=False)
    assert code == 1 and "cannot write the manager log" in err and "Traceback" not in err, err
    assert leftovers(ipc_env) == [] and not ipc_env.manager_info().exists()
    again = ManagerProcess(tmp_path, ipc_env, (50,))  # nothing held: the lock was never taken
    assert again.stop()[0] == 0


def test_a_message_queue_limit_names_the_limit_and_how_to_raise_it(ipc_env, tmp_path):
    def tiny_queue_budget() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, hard))

    manager = ManagerProcess(tmp_path, ipc_env, (50,), wait=False, preexec_fn=tiny_queue_budget)
    code, err = manager.stop(signal_it=False)
    assert code == 1 and "Traceback" not in err, err
    assert "cannot create message queue" in err and "RLIMIT_MSGQUEUE is 0 bytes" in err and "ulimit -q" in err
    assert leftovers(ipc_env) == [] and not ipc_env.manager_info().exists()


@pytest.mark.parametrize("content", [
    b"not json", b"[1, 2]", b'{"pid": "12"}', b"{}",
    json.dumps({"pid": os.getpid(), "namespace": "x", "policy": "p", "decisions": 0, "util": [1],
                "updated": time.time(), "apps": [{"name": 3}]}).encode(),
    json.dumps({"pid": os.getpid(), "namespace": "x", "policy": "p", "decisions": 0, "util": ["high"],
                "updated": time.time(), "apps": []}).encode(),
    # these three must not end in a traceback (OverflowError, TypeError) or a bare "error: 0"
    json.dumps({"pid": 2 ** 70, "namespace": "x", "policy": "p", "decisions": 0, "util": [1],
                "updated": time.time(), "apps": []}).encode(),
    json.dumps({"pid": os.getpid(), "namespace": "x", "policy": "p", "decisions": 0, "util": [1],
                "updated": time.time(), "apps": [{"name": "a", "pid": 1, "epoch": 0, "epochs": 1, "iteration": 0,
                                                  "iterations_total": 1, "dr": [1], "quiet_for": 5.0,
                                                  "updated_ago": "long"}]}).encode(),
    json.dumps({"pid": os.getpid(), "namespace": "x", "policy": "p", "decisions": 0, "util": [1],
                "updated": time.time(), "apps": [], "memory": {"0": {"used": 1, "total": 2}}}).encode(),
])
def test_status_of_a_malformed_status_file_is_a_clear_error(ipc_env, capsys, content):
    ipc_env.private_runtime_dir()
    write_private(ipc_env.manager_status(), content)
    assert drbalance(["status"]) == 1
    err = capsys.readouterr().err
    assert "drbalance status: error:" in err and ("malformed" in err or "not JSON" in err), err
    assert drbalance(["status", "--watch", "--count", "1"]) == 0  # an error frame; the view watches on
    assert "(watching; Ctrl-C to stop)" in capsys.readouterr().out
    ipc_env.manager_status().unlink()
    ipc_env.manager_status().mkdir()
    assert drbalance(["status"]) == 1
    assert "cannot read the manager status" in capsys.readouterr().err


def emulated_objects(names) -> list[str]:
    return [e for e in leftovers(names) if ".emu" in e]


@pytest.mark.slow
def test_the_emulated_source_honours_namespace_and_cleans_up_unless_in_use(ipc_env, tmp_path):
    other = f"{ipc_env.namespace}o"
    names = discovery.IpcNames.current(other)
    holder = python_process("tests.helpers.emu_holder", "0", "0.2", "--hang", env={"DRBALANCE_NAMESPACE": other})
    try:
        assert holder.stdout.readline().strip() == "holding"
        manager = python_process("drbalance.manager.cli", "--source", "emulated:2", "--namespace", other,
                                 "--duration", "1.5", "--log", str(tmp_path / "m.jsonl"))
        _, err = manager.communicate(timeout=120)
        assert manager.returncode == 0, err
        assert emulated_objects(ipc_env) == []  # nothing in the environment's namespace
        kept = emulated_objects(names)
        assert kept and all(".emu.0" in e or ".emuw.0" in e for e in kept), kept  # GPU 0 in use: kept
        assert names.emulated_lock(0).exists() and not names.emulated_lock(1).exists()
    finally:
        holder.kill()
        holder.wait()
    manager = python_process("drbalance.manager.cli", "--source", "emulated:2", "--namespace", other,
                             "--duration", "1", "--log", str(tmp_path / "m2.jsonl"))
    _, err = manager.communicate(timeout=120)
    assert manager.returncode == 0, err
    assert emulated_objects(names) == [] and not names.emulated_lock(0).exists()


@pytest.mark.slow
def test_a_forged_notice_does_not_drop_a_live_job(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = toy_app("real", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
    try:
        first_line(app)
        wait_for(lambda: manager.events("decision"))
        inbox = posix_ipc.MessageQueue(ipc_env.inbox(discovery.read_manager(ipc_env).inbox))
        for kind in (NoticeKind.BOUNDARY, NoticeKind.REGISTER, NoticeKind.FINISH):
            inbox.send(Notice(kind, os.getpid(), 99, "real", time.time()).encode())
        inbox.close()
        wait_for(lambda: len([e for e in manager.events("invalid") if "ignored" in e["error"]]) >= 2)
        time.sleep(1.5)  # a status period later, the job is still in the table
        apps = json.loads(ipc_env.manager_status().read_text())["apps"]
        assert [a["name"] for a in apps] == ["real"]
        before = len(manager.events("decision"))
        wait_for(lambda: len(manager.events("decision")) > before)
    finally:
        app.kill()
        app.wait()
        code, err = manager.stop()
    assert code == 0, err
    assert not [e for e in manager.events("app_removed") if e["reason"] == "finished"]


def test_files_and_folders_are_private_under_umask_000(ipc_env, tmp_path):
    def open_umask() -> None:
        os.umask(0)

    log = tmp_path / "deep" / "er" / "manager.jsonl"
    manager = ManagerProcess(tmp_path, ipc_env, (50, 50), "--log", str(log), preexec_fn=open_umask)
    app = python_process("tests.helpers.toy_app", "--app", "modes", "--epochs", "1", "--iterations", "3",
                         preexec_fn=open_umask)
    out, err = app.communicate(timeout=120)
    try:
        assert app.returncode == 0, err
        runtime = ipc_env.runtime_dir()
        assert mode(runtime.parent) == mode(runtime) == 0o700
        for path in (ipc_env.manager_lock(), ipc_env.manager_info(), ipc_env.manager_status(), log):
            assert mode(path) == 0o600, path
        assert mode(log.parent) == mode(log.parent.parent) == 0o700
        assert mode(ipc_env.claims_dir()) == 0o700
        sd_log = tmp_path / "logs" / "modes.sd.jsonl"
        assert mode(sd_log) == 0o600 and mode(sd_log.parent) == 0o700
    finally:
        manager.stop()
    previous = os.umask(0)
    try:
        path = save_profile(Profile("p", 1.0, 0.1, 10, 9, 1, "cpu", ["x"], "host", "now"), tmp_path / "p" / "prof.json")
    finally:
        os.umask(previous)
    assert mode(path) == mode(path.with_suffix(".json.lock")) == 0o600 and mode(path.parent) == 0o700


def test_creating_objects_and_files_never_changes_the_process_umask(ipc_env, tmp_path, monkeypatch):
    def forbidden(mask: int) -> int:
        raise AssertionError("the umask belongs to the training script; drbalance must not change it")

    monkeypatch.setattr(os, "umask", forbidden)
    claim = discovery.AppClaim.take(ipc_env, "nomask")
    record = AppRecord.create(ipc_env, "nomask", claim.token)
    semaphore = objects.create_semaphore(ipc_env.app_signal("nomask", claim.token))
    queue = objects.create_queue(ipc_env.inbox(claim.token), 2, 64)
    writer = JsonLinesWriter(tmp_path / "x" / "log.jsonl")
    writer.write({"ok": True})
    writer.close()
    for entry in leftovers(ipc_env):
        assert mode(objects.SHM_DIR / entry) == 0o600
    assert stat.S_IMODE(os.fstat(queue.mqd).st_mode) == 0o600
    queue.close()
    queue.unlink()
    semaphore.unlink()
    semaphore.close()
    record.close()
    record.segment.unlink()
    claim.release()


def test_the_sigterm_handler_only_raises_and_the_session_cleans_up_in_normal_flow(ipc_env):
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        session = Session(BalancedDataParallel(nn.Linear(2, 2)), "termed", 1, 10, solo_time=1.0, sd_log=False)
        handler = signal.getsignal(signal.SIGTERM)
        assert ipc_env.listed_apps() == ["termed"]
        with pytest.raises(SessionTerminated) as raised:
            handler(signal.SIGTERM, None)
        assert raised.value.code == 128 + signal.SIGTERM
        assert ipc_env.listed_apps() == ["termed"]  # nothing cleaned up inside the handler
        session.close()  # the normal flow (a with block, finally, atexit) does it
        assert leftovers(ipc_env) == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        Termination.pending = False  # or pytest itself would die of SIGTERM at exit
        signal.signal(signal.SIGTERM, previous)


def test_profile_timeout_is_a_clear_error(ipc_env, tmp_path, capsys):
    assert drbalance(["profile", "slow", "--timeout", "1", "--", "sleep", "5"]) == 1
    err = capsys.readouterr().err
    assert "did not finish within --timeout 1 s" in err and "Traceback" not in err
    assert not (tmp_path / "profiles.json").exists()


def test_manager_log_lines_carry_time_and_level(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (50,))
    _, err = manager.stop()
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(TIMESTAMPED.match(line) for line in lines), lines


def test_the_log_rotates_by_size_and_keeps_n_files_in_order(tmp_path):
    path = tmp_path / "rot.jsonl"
    writer = JsonLinesWriter(path, max_bytes=4096, keep=2)
    for index in range(400):  # about 13 KiB of lines
        writer.write({"n": index, "pad": "x" * 16})
    writer.close()
    files = rotated_files(path)
    assert [f.name for f in files] == ["rot.jsonl.2", "rot.jsonl.1", "rot.jsonl"]
    assert all(f.stat().st_size <= 4096 for f in files) and not (tmp_path / "rot.jsonl.3").exists()
    numbers = [record["n"] for f in files for record in read_json_lines(f)]
    assert numbers == list(range(numbers[0], 400)) and numbers[0] > 0  # in order, oldest dropped, none torn


@pytest.mark.timeout(60)
def test_rotation_with_a_huge_keep_walks_only_the_files_that_exist(tmp_path):
    """A rotation shifts only the rotated files that exist: stepping through every index up to
    ``keep`` would make a manager with --log-keep 10**9 spin there and never see SIGTERM."""
    path = tmp_path / "rot.jsonl"
    writer = JsonLinesWriter(path, max_bytes=4096, keep=10**12)
    for index in range(400):
        writer.write({"n": index, "pad": "x" * 16})
    writer.close()
    files = rotated_files(path)
    assert [f.name for f in files] == ["rot.jsonl.3", "rot.jsonl.2", "rot.jsonl.1", "rot.jsonl"]
    assert [record["n"] for f in files for record in read_json_lines(f)] == list(range(400))


@pytest.mark.slow
def test_the_manager_log_rotates(ipc_env, tmp_path):
    def open_umask() -> None:
        os.umask(0)

    manager = ManagerProcess(tmp_path, ipc_env, (50,), "--log-max-bytes", "4096", "--log-keep", "2",
                             "--util-log-period", "0.05", preexec_fn=open_umask)  # private whatever the umask
    wait_for(lambda: Path(f"{manager.log_path}.2").exists())
    code, err = manager.stop()
    assert code == 0, err
    assert not Path(f"{manager.log_path}.3").exists() and manager.log_path.stat().st_size <= 4096
    rotated = rotated_files(manager.log_path)
    assert len(rotated) == 3 and all(mode(path) == 0o600 for path in rotated), [oct(mode(p)) for p in rotated]


@pytest.mark.timeout(30)
def test_a_log_path_with_dot_dot_after_a_symbolic_link_is_the_file_the_kernel_opens(tmp_path, monkeypatch):
    # making the path absolute as text (os.path.abspath) would drop 'link/..' whole; the kernel takes
    # '..' of the folder the link leads to, so the log would land elsewhere
    tmp_path = Path(os.path.realpath(tmp_path))
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "real" / "deep")
    monkeypatch.chdir(tmp_path)
    for given, meant in [(tmp_path / "a" / "link" / ".." / "x.jsonl", tmp_path / "real" / "x.jsonl"),
                         (Path("a/link/../new/y.jsonl"), tmp_path / "real" / "new" / "y.jsonl"),
                         (Path("a/link/../../a/z.jsonl"), tmp_path / "a" / "z.jsonl"),
                         (Path("real/deep/../w.jsonl"), tmp_path / "real" / "w.jsonl")]:
        writer = JsonLinesWriter(given)
        writer.write({"n": 1})
        writer.close()
        assert writer.path == meant, given
        assert [record["n"] for record in read_json_lines(meant)] == [1], given
        with open(given) as kernel:  # what the kernel opens at the path given is the file written
            assert os.fstat(kernel.fileno()).st_ino == meant.stat().st_ino, given
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["link", "z.jsonl"]  # no a/x.jsonl, no a/new
