"""Another local user must not be able to stop, steer or fool our manager
and jobs, and the runtime directory never follows a planted link.

The attacks run as a real second user (``tests.helpers.neighbour``: a child process that drops to
uid "nobody"); those tests need root and are skipped, with the reason, otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

import posix_ipc
import pytest
from torch import nn

from drbalance import env
from drbalance.cli import main as drbalance
from drbalance.client import BalancedDataParallel, Session
from drbalance.emu.gpus import EmulatedGpu, release_emulated_gpus
from drbalance.ipc import discovery, objects
from drbalance.ipc.endpoint import AppChannel
from drbalance.ipc.link import PosixManagerLink
from drbalance.ipc.names import IpcNames, new_token
from drbalance.ipc.private import UnsafePath, private_dir, write_private
from drbalance.ipc.records import AppRecord
from drbalance.jsonlog import JsonLinesWriter
from drbalance.manager.daemon import MAX_FOREIGN_LISTED, Manager, ManagerSettings
from drbalance.manager.utilization import ScriptedSource
from tests.conftest import ROOT, python_process, wait_for
from tests.helpers.neighbour import THIRD_UID, as_neighbour, needs_second_user, second_user, swapped_folder
from tests.helpers.processes import ManagerProcess, decisions_for, first_line, long_app, stop_all, toy_app
from tests.helpers.steered import SteeredModel


def predictable_names(names: IpcNames, app: str) -> list[str]:
    """Every name an attacker could guess without the token (the fixed names), plus token-shaped guesses."""
    guess = new_token()
    return [names.prefix + "inbox", names.prefix + "manager", names.prefix + f"app.{app}",
            names.prefix + f"sig.{app}", names.prefix + f"app.{app}.{guess}", names.prefix + f"manager.{guess}"]


@pytest.mark.slow
@needs_second_user
def test_a_neighbours_squatted_names_stop_nothing_and_are_reported_by_owner(ipc_env, tmp_path, capsys):
    uid, _, who = second_user()
    planted = predictable_names(ipc_env, "victim")
    results = as_neighbour([["shm", name, 0o666] for name in planted] +
                           [["sem", name, 0o666] for name in planted[:4]] +
                           [["mq", ipc_env.prefix + "inbox", 0o666]])
    assert set(results) == {"ok"}, results
    manager = ManagerProcess(tmp_path, ipc_env)  # starts, though its fixed inbox/heartbeat names are taken
    try:
        app = toy_app("victim", "--epochs", "2", "--iterations", "3", "--exchange-timeout", "10")
        assert first_line(app) == {"iteration": 0, "ratio": [0, 0, 10, 0], "attached": True}  # answered
        out, err = app.communicate(timeout=120)
        assert app.returncode == 0, err
        foreign = wait_for(lambda: len(manager.events("foreign")) >= len(planted) and manager.events("foreign"))
        assert {e["object"] for e in foreign} >= {name.lstrip("/") for name in planted}
        assert all(e["owner_uid"] == uid and who.split()[0] in e["owner"] for e in foreign)
        status = wait_for(lambda: json.loads(ipc_env.manager_status().read_text())["foreign"])
        assert any(item["owner_uid"] == uid for item in status)
        assert drbalance(["status"]) == 0
        table = capsys.readouterr().out
        assert f"WARNING: /dev/shm/{planted[2].lstrip('/')} belongs to" in table
        assert manager.alive()
    finally:
        code, err = manager.stop()
        objects.unlink_queue(ipc_env.prefix + "inbox")
    assert code == 0, err
    assert "belongs to" in err and "Traceback" not in err
    decisions = manager.events("decision")
    assert [d["trigger"] for d in decisions] == ["register", "boundary"]


@pytest.mark.slow
@needs_second_user
def test_objects_planted_while_the_manager_runs_do_not_stop_it(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = toy_app("steady", "--epochs", "30", "--iterations", "3", "--sleep", "0.05")
    try:
        first_line(app)
        info = discovery.read_manager(ipc_env)
        token = info.token
        # a foreign app.x must not make the manager exit, nor a foreign ...manager crash jobs; a
        # world-writable segment with the manager's own token cannot even be created
        results = as_neighbour([["shm", ipc_env.prefix + "app.x", 0o666],
                                ["shm", ipc_env.prefix + f"app.x.{new_token()}", 0o666],
                                ["shm", ipc_env.prefix + "manager", 0o666],
                                ["shm", ipc_env.manager_record(token), 0o666],
                                ["open_shm", ipc_env.manager_record(token)],
                                ["open_mq", ipc_env.inbox(info.inbox)],
                                ["send_mq", ipc_env.inbox(info.inbox)]])
        assert results[:3] == ["ok", "ok", "ok"]
        assert results[3].startswith("ExistentialError")  # ours exists: nobody can take its name
        assert all(r.startswith("PermissionsError") for r in results[4:]), results  # 0600: no reading, no notices
        wait_for(lambda: len(manager.events("foreign")) >= 3)
        out, err = app.communicate(timeout=120)
        assert app.returncode == 0, err
        assert json.loads(out.splitlines()[-2])["attached"]  # the job stayed attached all along
        assert manager.alive()
    finally:
        app.kill()
        code, err = manager.stop()
    assert code == 0, err
    assert [e["reason"] for e in manager.events("app_removed")] == ["finished"]


@pytest.mark.slow
@needs_second_user
def test_a_job_never_trusts_a_foreign_heartbeat_or_inbox_and_trains_on_detached(ipc_env, tmp_path):
    """Suppose a neighbour's world-writable heartbeat and inbox sat where ``manager.json`` points
    (it cannot write that file, so we write it for the test): the job must refuse them, name them
    and their owner, send nothing there, and train on with its own DR."""
    token = new_token()
    uid, _, _ = second_user()
    results = as_neighbour([["shm", ipc_env.manager_record(token), 0o666], ["mq", ipc_env.inbox(token), 0o666]])
    assert results == ["ok", "ok"]
    ipc_env.private_runtime_dir()
    fake = discovery.ManagerInfo(os.getpid(), objects.process_start_ticks(os.getpid()), token, time.time())
    discovery.publish_manager(ipc_env, fake)  # "a live manager", pid = this test
    try:
        app = toy_app("careful", "--epochs", "2", "--iterations", "3")
        out, err = app.communicate(timeout=120)
        assert app.returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        assert all(not line.get("attached", False) for line in lines) and lines[-1]["done"]
        assert ipc_env.manager_record(token) in err and f"uid {uid}" in err and "not trusted" in err
        inbox = posix_ipc.MessageQueue(ipc_env.inbox(token))
        assert inbox.current_messages == 0  # not one notice reached the neighbour
        inbox.close()
    finally:
        objects.unlink_queue(ipc_env.inbox(token))
        objects.unlink_shared_memory(ipc_env.manager_record(token))


@pytest.mark.slow
@needs_second_user
def test_a_foreign_record_where_a_claim_points_is_reported_not_adopted(ipc_env, tmp_path):
    token = new_token()
    uid, _, _ = second_user()
    assert as_neighbour([["shm", ipc_env.app_record("forged", token), 0o666],
                         ["sem", ipc_env.app_signal("forged", token), 0o666]]) == ["ok", "ok"]
    sleeper = toy_app("holder", "--hang-after", "0")  # a live process to name in the claim
    first_line(sleeper)
    try:
        ipc_env.private_runtime_dir()
        info = discovery.ClaimInfo("forged", sleeper.pid, objects.process_start_ticks(sleeper.pid), token, time.time())
        (ipc_env.claims_dir() / "forged.claim").write_bytes(info.encode())
        manager = ManagerProcess(tmp_path, ipc_env)
        try:
            wait_for(lambda: any(e["object"] == ipc_env.app_record("forged", token).lstrip("/")
                                 for e in manager.events("foreign")))
            status = json.loads(ipc_env.manager_status().read_text())
            assert "forged" not in [a["name"] for a in status["apps"]] and manager.alive()
        finally:
            code, err = manager.stop()
        assert code == 0 and "Traceback" not in err, err
        foreign = [e for e in manager.events("foreign") if "forged" in e["object"]]
        assert foreign and all(e["owner_uid"] == uid for e in foreign)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
@needs_second_user
@pytest.mark.timeout(120)
def test_a_foreign_record_a_claim_points_at_is_named_once_even_past_the_first_thousand_foreign_names(
        ipc_env, tmp_path):
    """The manager remembers the first 1,000 of other users' names by name; one it met through a
    claim, beyond those, was forgotten at every listing and named again at every rescan."""
    token = new_token()
    stem = str(objects.SHM_DIR / (ipc_env.prefix.lstrip("/") + "app.a"))  # sorts before app.forged
    planted = 1_100
    assert as_neighbour([["empty_files", stem, planted], ["shm", ipc_env.app_record("forged", token), 0o666]],
                        timeout=60) == ["ok", "ok"]
    sleeper = toy_app("holder", "--hang-after", "0")  # a live process to name in the claim
    first_line(sleeper)
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    try:
        ipc_env.private_runtime_dir()
        info = discovery.ClaimInfo("forged", sleeper.pid, objects.process_start_ticks(sleeper.pid), token, time.time())
        (ipc_env.claims_dir() / "forged.claim").write_bytes(info.encode())
        manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl",
                                          rescan_period=0.1), ScriptedSource(script))
        manager.start()
        try:
            manager.run(duration=3.0)  # about 30 rescans, each adopting from the claim in vain
        finally:
            manager.stop()
        events = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        forged = [e for e in events if e["event"] == "foreign" and "forged" in e["object"]]
        assert len(forged) == 1, len(forged)
        assert [e["count"] for e in events if e["event"] == "foreign_count"] == [planted + 1]
    finally:
        sleeper.kill()
        sleeper.wait()
        for index in range(planted):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{stem}{index}")


# --- the runtime directory -----------------------------------------------------------------------
@pytest.mark.slow
@needs_second_user
def test_a_runtime_dir_link_planted_by_a_neighbour_is_refused_and_its_target_untouched(ipc_env, tmp_path):
    target = tmp_path / "root-owned"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    link = Path(f"/tmp/drbalance-h10-test-{secrets.token_hex(4)}")
    assert as_neighbour([["symlink", str(target), str(link)]]) == ["ok"]
    try:
        manager = ManagerProcess(tmp_path, ipc_env, wait=False, env={"DRBALANCE_RUNTIME_DIR": str(link)})
        code, err = manager.stop(signal_it=False)
        assert code == 1 and "symbolic link owned by" in err and "Traceback" not in err, err
        assert stat.S_IMODE(target.stat().st_mode) == 0o755 and list(target.iterdir()) == []
        app = toy_app("linked", "--epochs", "1", "--iterations", "2", env={"DRBALANCE_RUNTIME_DIR": str(link)})
        out, err = app.communicate(timeout=120)
        assert app.returncode == 0, err  # the job trains on, detached
        assert "symbolic link" in err and list(target.iterdir()) == []
    finally:
        link.unlink()


@needs_second_user
def test_a_neighbours_link_behind_one_of_ours_on_the_way_to_the_runtime_dir_is_refused(tmp_path):
    """Our own link on the way may point at a name in /tmp that a neighbour took (a link left
    dangling after a reboot). The links it leads through are checked one by one: resolving them at
    once (realpath) would follow hers unchecked and make the runtime directory in a folder of her
    choice."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    taken = Path(f"/tmp/drbalance-h10-test-{secrets.token_hex(4)}")
    ours = tmp_path / "ours"
    ours.symlink_to(taken)  # made when /tmp/<name> was our folder
    assert as_neighbour([["symlink", str(target), str(taken)]]) == ["ok"]
    try:
        with pytest.raises(UnsafePath, match="symbolic link owned by"):
            private_dir(ours / "run")
        with pytest.raises(UnsafePath, match="symbolic link owned by"):
            JsonLinesWriter(ours / "logs" / "job.sd.jsonl")
        assert list(target.iterdir()) == []
    finally:
        taken.unlink()

@needs_second_user
def test_a_runtime_dir_owned_by_a_neighbour_is_refused(tmp_path):
    planted = Path(f"/tmp/drbalance-h10-test-{secrets.token_hex(4)}")
    assert as_neighbour([["mkdir", str(planted), 0o777]]) == ["ok"]
    try:
        with pytest.raises(UnsafePath, match="belongs to"):
            private_dir(planted)
        with pytest.raises(UnsafePath, match="belongs to"):
            private_dir(planted / "inside")  # a folder on the way that another user could swap
    finally:
        os.rmdir(planted)


def test_a_runtime_dir_that_is_a_link_or_writable_by_others_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafePath, match="symbolic link"):
        private_dir(tmp_path / "link")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafePath, match="writable by group or others"):
        private_dir(open_dir)
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o777  # refused, not "repaired"
    shared = tmp_path / "shared"  # a folder on the way that others may write (and not sticky)
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePath, match="writable by others"):
        private_dir(shared / "run")
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    assert private_dir(readable) == readable and stat.S_IMODE(readable.stat().st_mode) == 0o700
    file_instead = tmp_path / "file"
    file_instead.write_text("x")
    with pytest.raises(UnsafePath, match="not a folder"):
        private_dir(file_instead)


@needs_second_user
def test_a_tmp_runtime_dir_taken_by_a_neighbour_moves_to_the_state_folder_and_stays_there(tmp_path):
    uid = os.getuid()
    planted = Path(f"/tmp/drbalance-h10-test-{secrets.token_hex(4)}")
    squat = tmp_path / "state" / "drbalance" / "run-host"
    assert env._tmp_runtime_dir(planted, squat, uid) == planted  # neither exists: /tmp, made on first use
    assert as_neighbour([["mkdir", str(planted), 0o700]]) == ["ok"]  # taken before our manager started
    try:
        assert env._tmp_runtime_dir(planted, squat, uid) == squat  # not refused, which would leave no manager at all
        assert private_dir(squat) == squat and squat.stat().st_uid == uid
        os.rmdir(planted)  # the neighbour lets go of the name later: our manager and jobs stay together
        assert env._tmp_runtime_dir(planted, squat, uid) == squat
        assert as_neighbour([["symlink", str(tmp_path), str(planted)]]) == ["ok"]
        assert env._tmp_runtime_dir(planted, squat, uid) == squat  # a neighbour's link is never followed
    finally:
        if planted.is_symlink() or planted.exists():
            os.unlink(planted) if planted.is_symlink() else os.rmdir(planted)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert env._tmp_runtime_dir(mine, squat, uid) == mine  # our own folder in /tmp wins


def test_a_tmp_runtime_dir_name_that_is_not_a_folder_moves_to_the_state_folder(tmp_path):
    taken = tmp_path / "drbalance-file"
    taken.write_text("not a folder")
    squat = tmp_path / "state" / "run-host"
    assert env._tmp_runtime_dir(taken, squat, os.getuid()) == squat
    assert env._tmp_runtime_dir(tmp_path / "free", squat, os.getuid()) == tmp_path / "free"
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    assert env._squat_runtime_dir().parent == state / "drbalance"


@needs_second_user
def test_a_manager_and_its_jobs_meet_when_a_neighbour_took_the_tmp_runtime_dir(ipc_env, tmp_path, monkeypatch):
    """The default path with no login folder, at a /tmp name of this test's own (the real
    /tmp/drbalance-<uid> may be in use), in one process: a manager and a job over real IPC."""
    from drbalance.ipc.layout import Notice, NoticeKind

    planted = Path(f"/tmp/drbalance-h10-test-{secrets.token_hex(4)}")
    monkeypatch.setattr(env, "_TMP_RUNTIME_DIR", str(planted))
    monkeypatch.setattr(env, "_LOGIN_DIR", str(tmp_path / "no-login-folder"))
    monkeypatch.delenv("DRBALANCE_RUNTIME_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert as_neighbour([["mkdir", str(planted), 0o755]]) == ["ok"]
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    session = None
    try:
        manager.start()  # does not raise "/tmp/drbalance-...: belongs to nobody"
        assert env.runtime_dir() == env._squat_runtime_dir() and ipc_env.manager_info().exists()
        model = BalancedDataParallel(nn.Linear(4, 1), device_ids=[0, 1, 2, 3])
        session = Session(model, app="beside", epochs=1, iterations_per_epoch=10, solo_time=1.0, sd_log=False,
                          exchange_timeout=0.0)
        manager.handle(Notice(NoticeKind.REGISTER, os.getpid(), session.notice_seq, "beside", 0.0))
        assert manager.table.get("beside") is not None  # the manager found the job's claim and record
        assert session.link.manager() is not None  # and the job its manager
        assert list(planted.iterdir()) == []  # nothing of ours in the neighbour's folder
    finally:
        if session is not None:
            session.close()
        manager.stop()
        os.rmdir(planted)
    starts = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"event":"start"' in line]
    assert [e["runtime_dir"] for e in starts] == [str(env._squat_runtime_dir() / ipc_env.namespace)]


def test_the_runtime_dir_prefers_xdg_runtime_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DRBALANCE_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert env.runtime_dir() == tmp_path / "drbalance"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/path")  # not absolute: ignored, as the spec says
    assert env.runtime_dir() != Path("relative/path") / "drbalance"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    login = Path(f"/run/user/{os.getuid()}")
    expected = login / "drbalance" if login.is_dir() and login.stat().st_uid == os.getuid() else \
        env._tmp_runtime_dir(Path(f"/tmp/drbalance-{os.getuid()}"), env._squat_runtime_dir(), os.getuid())
    assert env.runtime_dir() == expected
    monkeypatch.setenv("DRBALANCE_RUNTIME_DIR", str(tmp_path / "mine"))
    assert env.runtime_dir() == tmp_path / "mine"  # an explicit choice wins


def test_a_relative_drbalance_runtime_dir_is_refused_not_resolved_per_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("DRBALANCE_RUNTIME_DIR", "relative/run")
    with pytest.raises(ValueError, match="DRBALANCE_RUNTIME_DIR='relative/run' is not an absolute path"):
        env.runtime_dir()
    process = python_process("drbalance.manager.cli", "--source", "emulated:2", "--duration", "1",
                             env={"DRBALANCE_RUNTIME_DIR": "relative/run"}, cwd=tmp_path)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "is not an absolute path" in err, err
    assert not (tmp_path / "relative").exists()  # nothing made in the working directory


def test_a_manager_blames_an_unsafe_runtime_dir_not_its_utilisation_source(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    process = python_process("drbalance.manager.cli", "--source", "emulated:2", "--duration", "1",
                             env={"DRBALANCE_RUNTIME_DIR": str(open_dir)})
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1 and "unsafe path, nothing started" in err and "writable by group or others" in err
    assert "utilisation source" not in err, err
    assert os.listdir(open_dir) == []


@needs_second_user
@pytest.mark.timeout(180)
def test_thousands_of_planted_objects_do_not_break_drbalance_status(ipc_env, tmp_path, capsys, caplog):
    """Foreign objects are not all listed in status.json: 4000 long-named empty objects would make
    it larger than the 1 MiB that ``drbalance status`` reads, which would then fail ("not JSON")
    for the manager's user, however long the neighbour kept them."""
    planted = [ipc_env.prefix + "z" * 200 + str(index) for index in range(4000)]
    results = as_neighbour([["shm", name, 0o600] for name in planted], timeout=120)
    assert set(results) == {"ok"}
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    try:
        manager.start()  # its first rescan finds them
        assert manager.foreign_counts == {second_user()[0]: len(planted)}  # all counted
        assert len(manager.foreign) == MAX_FOREIGN_LISTED  # the first named (more at each listing)
        manager._write_status(time.monotonic())
        assert drbalance(["status"]) == 0, capsys.readouterr().err
        table = capsys.readouterr().out
        status = json.loads(ipc_env.manager_status().read_text())
        listed = len(status["foreign"])
        assert status["foreign_total"] == len(planted) and 0 < listed <= 100
        assert table.count("belongs to") == listed  # a screenful, then how many more
        assert f"and {len(planted) - listed} more objects of other users" in table
        named = [r for r in caplog.records if "belongs to" in r.getMessage()]
        assert 0 < len(named) <= 100 and "only the manager log" in caplog.text  # not 4000 lines on stderr
        events = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert len([e for e in events if e["event"] == "foreign"]) == MAX_FOREIGN_LISTED  # not 4000 lines
        assert [(e["owner_uid"], e["count"]) for e in events if e["event"] == "foreign_count"] == [
            (second_user()[0], len(planted))]
    finally:
        manager.stop()


@pytest.mark.slow
@needs_second_user
@pytest.mark.timeout(300)
def test_a_flood_of_planted_names_leaves_the_manager_answering_every_notice_in_time(ipc_env, tmp_path):
    """Empty files cost a neighbour nothing, and /dev/shm takes millions. With 200,000 under our
    prefix each rescan's listing takes about a second (a ``stat`` and a parse each, every 2 s; 7 s
    for 300,000 on a loaded machine) and the first one several more (a log line each); on the
    manager's only thread, a job's 0.5 s waits for answers would run out and it could lose the
    manager. The listing runs in a thread; the manager answers as before, names a few of the
    objects and counts the rest."""
    stem = str(objects.SHM_DIR / (ipc_env.prefix.lstrip("/") + "app.x"))
    planted = 200_000
    try:
        assert as_neighbour([["empty_files", stem, planted]], timeout=200) == ["ok"]
        manager = ManagerProcess(tmp_path, ipc_env)
        # 30 boundaries, each waiting at most 0.5 s for its answer (the default)
        app = toy_app("steady", "--epochs", "30", "--iterations", "3", "--sleep", "0.1", "--exchange-timeout", "0.5")
        out, err = app.communicate(timeout=240)
        assert app.returncode == 0, err
        counted = [e for e in manager.events("foreign_count") if e["count"] == planted]
        named = manager.events("foreign")
        code, manager_err = manager.stop()
    finally:
        for index in range(planted):
            try:
                os.unlink(f"{stem}{index}")
            except FileNotFoundError:
                pass
    assert code == 0 and "Traceback" not in manager_err, manager_err
    sd_log = [json.loads(line) for line in (Path(os.environ["DRBALANCE_LOG_DIR"]) / "steady.sd.jsonl")
              .read_text().splitlines()]
    late = [e for e in sd_log if e["event"] in ("no_answer", "detached")]
    assert not late, late  # every answer within its wait, the manager never lost
    assert all(json.loads(line)["attached"] for line in out.splitlines()[1:] if "attached" in line)
    assert counted and counted[0]["owner_uid"] == second_user()[0]
    assert 0 < len(named) <= MAX_FOREIGN_LISTED * 40  # at most 20 newly named per listing, not 200,000


# --- emulated GPUs: their names carry a token too ---------------------------------------------------
@needs_second_user
def test_emulated_gpu_names_a_neighbour_took_first_stop_neither_a_job_nor_the_manager(ipc_env, tmp_path):
    """``/drb.<uid>.<namespace>.emu.<index>`` is not the whole name: were it, a neighbour who created
    it first would make every job on that emulated GPU fail ("Caught ForeignObject in replica 0 on
    device emu:0 ... belongs to mallory") and ``drbalance-manager --source emulated`` refuse to start."""
    uid, _, _ = second_user()
    planted = [ipc_env.prefix + "emu.0", ipc_env.prefix + "emu.1"]
    assert as_neighbour([["shm", planted[0], 0o666], ["shm", planted[1], 0o600]]) == ["ok", "ok"]
    gpus = [EmulatedGpu(ipc_env, 0), EmulatedGpu(ipc_env, 1)]
    try:
        for gpu in gpus:
            assert gpu.occupy(0.01) >= 0.0
            name = ipc_env.emulated_gpu(gpu.index)
            assert name not in planted and objects.listed_owner(name) == os.geteuid()
        process = python_process("drbalance.manager.cli", "--source", "emulated:2", "--duration", "1",
                                 "--log", str(tmp_path / "m.jsonl"))
        _, err = process.communicate(timeout=60)
        assert process.returncode == 0 and "Traceback" not in err, err
    finally:
        release_emulated_gpus(gpus)
    assert [objects.listed_owner(name) for name in planted] == [uid, uid]  # the neighbour's are left alone


@needs_second_user
def test_an_emulated_gpu_name_a_neighbour_takes_once_it_is_gone_is_not_used_again(ipc_env):
    """The name of an emulated GPU shows in /dev/shm. Removed while its lock file stays (systemd-logind's
    RemoveIPC), it could be taken by a neighbour who read it there; the next job must use another."""
    uid, _, _ = second_user()
    first = EmulatedGpu(ipc_env, 0)
    seen = ipc_env.emulated_gpu(0)
    objects.unlink_shared_memory(seen)  # as RemoveIPC does; the lock file in the runtime folder stays
    first.close()
    assert as_neighbour([["shm", seen, 0o666]]) == ["ok"]
    again = EmulatedGpu(ipc_env, 0)
    try:
        name = ipc_env.emulated_gpu(0)
        assert name != seen and objects.listed_owner(name) == os.geteuid()
        assert again.occupy(0.01) >= 0.0
    finally:
        release_emulated_gpus([again])
    assert objects.listed_owner(seen) == uid


# --- a job's objects made again after RemoveIPC, whose names a neighbour could see ------------------
@pytest.mark.slow
@needs_second_user
def test_a_job_whose_removed_record_name_a_neighbour_took_moves_to_a_new_token_and_stays_managed(ipc_env, tmp_path):
    """RemoveIPC unlinks a running job's record and semaphore; their names (with the token) were
    visible in /dev/shm, so a neighbour can create them first. The job leaves them alone (it must
    not remove the neighbour's objects, though root may), makes its objects under a new token,
    names that in its claim, and the manager follows the claim, so a manager started later still
    reaches it."""
    uid, _, _ = second_user()
    manager = ManagerProcess(tmp_path, ipc_env)
    app = None
    try:
        app = long_app("moved")
        assert first_line(app)["attached"]
        wait_for(lambda: decisions_for(manager, "moved") >= 2)
        claim = discovery.read_claim(ipc_env, "moved")
        old = claim.token
        taken = [ipc_env.app_record("moved", old), ipc_env.app_signal("moved", claim.signal)]
        # the job is stopped meanwhile, so the neighbour is first to the names (a running job that
        # notices the removal first makes its record again under the same name: another case)
        os.kill(app.pid, signal.SIGSTOP)
        try:
            assert discovery.remove_app_objects(ipc_env, "moved", old, claim.signal)  # as RemoveIPC does
            assert as_neighbour([["shm", taken[0], 0o666], ["sem", taken[1], 0o666]]) == ["ok", "ok"]
        finally:
            os.kill(app.pid, signal.SIGCONT)
        # the claim is rewritten in place: a read between its truncation and its write finds it empty (None)
        new = wait_for(lambda: (claim := discovery.read_claim(ipc_env, "moved")) is not None
                       and claim.token != old and claim.token)
        assert objects.listed_owner(ipc_env.app_record("moved", new)) == os.geteuid()
        wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "record of moved"])
        served = decisions_for(manager, "moved")
        wait_for(lambda: decisions_for(manager, "moved") >= served + 2)  # the manager serves it at the new token
        assert objects.listed_owner(taken[0]) == uid and objects.listed_owner(taken[1], "semaphore") == uid
        assert manager.alive() and app.poll() is None
    finally:
        code, err = stop_all(manager, app)
    assert code == 0 and "Traceback" not in err, err


@needs_second_user
def test_a_jobs_removed_record_name_taken_by_a_neighbour_does_not_cut_an_unprivileged_job_off(ipc_env):
    """The same as an unprivileged job ("nobody"; the neighbour is another uid), which cannot remove
    the neighbour's objects: it must not warn once and stay where no manager can find it."""
    uid, gid, _ = second_user()
    runtime = tempfile.mkdtemp(prefix="drbalance-moved-")  # in /tmp: the job's user can reach it
    os.chown(runtime, uid, gid)
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the job, as "nobody": never returns into the test
        code = 1
        try:
            os.close(to_parent)
            os.close(from_parent)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.environ["DRBALANCE_RUNTIME_DIR"] = runtime
            names = IpcNames.current(ipc_env.namespace)
            session = Session(SteeredModel(), "victim", 1, 10, solo_time=10.0, sd_log=False, handle_sigterm=False)
            claim = discovery.read_claim(names, "victim")
            old = claim.token
            discovery.remove_app_objects(names, "victim", old, claim.signal)  # as RemoveIPC does
            taken = [names.app_record("victim", old), names.app_signal("victim", claim.signal)]
            os.write(from_child, json.dumps(taken).encode())
            os.read(to_child, 1)  # the neighbour took both names
            for _ in range(5):  # reports its status on the way (10 iterations an epoch)
                session.step()
            claim = discovery.read_claim(names, "victim")
            new = claim.token
            result = [old, new, objects.listed_owner(names.app_record("victim", new)),
                      objects.listed_owner(names.app_signal("victim", claim.signal), "semaphore")]
            session.close()
            os.write(from_child, json.dumps(result).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(from_child)
    os.close(to_child)
    try:
        taken = json.loads(os.read(to_parent, 4096))
        assert as_neighbour([["shm", taken[0], 0o666], ["sem", taken[1], 0o666]],
                            user=(THIRD_UID, THIRD_UID)) == ["ok", "ok"]
        os.write(from_parent, b"x")
        old, new, record_owner, signal_owner = json.loads(os.read(to_parent, 4096))
        assert new != old and record_owner == uid and signal_owner == uid
        assert objects.listed_owner(taken[0]) == THIRD_UID  # left to its owner
    finally:
        os.close(from_parent)  # a child still waiting for the neighbour goes on, and ends
        _, status = os.waitpid(pid, 0)
        os.close(to_parent)
        for listed in IpcNames(ipc_env.namespace, uid).listed():
            if listed.entry.startswith("sem."):
                objects.unlink_semaphore("/" + listed.entry[4:])
            else:
                objects.unlink_shared_memory("/" + listed.entry)
        shutil.rmtree(runtime, ignore_errors=True)
    assert status == 0


# --- the system-wide count of message queues, which every user's queues fill ------------------------
QUEUES_SCRIPT = r"""
set -e
mount --make-rprivate /
mount -t mqueue none "$OUT/mqueue"
echo 4 > /proc/sys/fs/mqueue/queues_max
cd "$ROOT"
"$PY" -c "$JOB" > "$OUT/job.out" 2>&1
echo '{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}' > "$OUT/util.json"
DRBALANCE_RUNTIME_DIR="$OUT/run" DRBALANCE_NAMESPACE=rootq \
  setpriv --inh-caps -sys_resource --bounding-set -sys_resource \
  "$PY" -m drbalance.manager.cli --source scripted:"$OUT/util.json" --duration 1 > "$OUT/manager.out" 2>&1 \
  && echo "manager rc 0" >> "$OUT/manager.out" || echo "manager rc $?" >> "$OUT/manager.out"
"""

QUEUES_JOB = textwrap.dedent("""
    import os, sys
    import posix_ipc
    from drbalance.ipc import objects
    from tests.helpers.neighbour import THIRD_UID, as_neighbour, second_user
    made = as_neighbour([["mq", f"/filler-{i}", 0o600] for i in range(8)])  # root is exempt from the count
    print("neighbour", made.count("ok"), flush=True)
    pid = os.fork()
    if pid == 0:  # the manager's user: not root
        os.setgroups([])
        os.setgid(THIRD_UID)
        os.setuid(THIRD_UID)
        try:
            objects.create_queue("/drb.%d.x.inbox.0123456789abcdef" % THIRD_UID, 10, 128)
            print("created", flush=True)
        except objects.QueueLimitError as error:
            print("refused:", error, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
""")


@needs_second_user
def test_a_neighbour_who_fills_the_systems_queue_count_is_named_not_this_users_budget():
    """Any user can create fs.mqueue.queues_max (256) tiny queues, about 25 KiB of their budget; then
    no other unprivileged user can create one, and a manager cannot start. The error blamed the
    manager's own RLIMIT_MSGQUEUE ("this user's message-queue budget is probably used up"), and
    raising it changes nothing. Root is not exempt either, only CAP_SYS_RESOURCE is (many
    containers drop it): a root manager without it exits 1 saying so. In a private IPC namespace
    whose count is 4."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-i", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("a private IPC namespace needs CAP_SYS_ADMIN (unshare -i -m)")
    out_dir = Path(tempfile.mkdtemp(prefix="drbalance-queues-"))  # in /tmp: the manager's user can list it
    try:
        os.chmod(out_dir, 0o755)
        (out_dir / "mqueue").mkdir()
        env = dict(os.environ, ROOT=str(ROOT), PY=sys.executable, JOB=QUEUES_JOB, OUT=str(out_dir),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([unshare, "-i", "-m", "sh", "-c", QUEUES_SCRIPT], env=env, timeout=100, check=True)
        out = (out_dir / "job.out").read_text()
        manager = (out_dir / "manager.out").read_text()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    _, _, who = second_user()
    assert "neighbour 4" in out and "refused:" in out, out
    assert "budget is probably used up" not in out, out
    assert "fs.mqueue.queues_max" in out and "4 queues" in out and "system-wide" in out, out
    assert f"4 of {who}" in out, out  # who holds them, read from the mounted mqueue file system
    assert "manager rc 1" in manager and "Traceback" not in manager, manager
    assert "system-wide count of message queues is reached" in manager and f"4 of {who}" in manager, manager
    assert "only processes with CAP_SYS_RESOURCE are exempt (root without it is not" in manager, manager


# --- log folders: the user's choice, but never reached through a neighbour's link -------------------
@needs_second_user
def test_a_log_folder_reached_through_a_neighbours_link_is_refused_and_its_target_untouched(ipc_env, tmp_path):
    """Log folders may be shared (group-writable, another user's), but are never reached through a
    neighbour's symbolic link: her ``/tmp/<name>`` pointing at a folder of her choice would make the
    manager (root here) and the jobs write their logs there (where fs.protected_symlinks is 0, as in
    many containers; where it is 1 the kernel refuses with a bare "Permission denied")."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    link = Path(f"/tmp/drbalance-logs-test-{secrets.token_hex(4)}")
    assert as_neighbour([["symlink", str(target), str(link)]]) == ["ok"]
    try:
        with pytest.raises(UnsafePath, match="symbolic link owned by"):
            JsonLinesWriter(link / "job.sd.jsonl", open_later=True)
        with pytest.raises(UnsafePath, match="symbolic link owned by"):
            JsonLinesWriter(link / "new" / "job.sd.jsonl", open_later=True)  # folders to be made below it
        manager = ManagerProcess(tmp_path, ipc_env, (50,), "--log", str(link / "manager.jsonl"), wait=False)
        code, err = manager.stop(signal_it=False)
        assert code == 1 and "symbolic link owned by" in err and "Traceback" not in err, err
        assert list(target.iterdir()) == []
    finally:
        link.unlink()


@needs_second_user
@pytest.mark.timeout(120)
def test_a_folder_a_neighbour_swaps_with_her_link_never_takes_a_log_or_file_of_ours_elsewhere(tmp_path):
    """A log folder may be shared (docs allow it: hers, group-writable, setgid). She exchanges a
    folder on the way with her symbolic link in a loop (renameat2 RENAME_EXCHANGE) and removes the
    log now and then, so that it is opened again. Every folder is opened relative to the one before
    it, without following her link: a log path checked, then opened again by its name, would let a
    root manager create its log in a root-only folder of her choice."""
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    written, attempts, errors = 0, 0, []
    with swapped_folder(target, "m.jsonl") as (logs, neighbour):
        while attempts < 4000 and not any(target.iterdir()):
            attempts += 1
            try:
                if attempts % 2:
                    writer = JsonLinesWriter(logs / "m.jsonl")  # what the manager and jobs open their logs by
                    writer.write({"attempt": attempts})
                    assert writer.close() == 0
                else:
                    write_private(logs / "status.json", b"{}")  # status, run.json, reports
                written += 1
            except OSError as error:
                errors.append(error)
    assert neighbour and neighbour[0].startswith("ok ") and int(neighbour[0].split()[1]) > 0, neighbour
    assert sorted(os.listdir(target)) == []  # nothing of ours in the folder of her choice
    assert written and errors  # both faces of the swap were met: a real folder, and her link
    assert all(isinstance(e, UnsafePath) and "symbolic link owned by" in str(e) for e in errors), errors[:5]


def test_a_log_folder_every_user_may_write_is_refused_a_sticky_or_group_one_is_not(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafePath, match="writable by others"):
        JsonLinesWriter(open_dir / "job.sd.jsonl")  # anyone could replace the log, or plant a folder link
    with pytest.raises(UnsafePath, match="writable by others"):
        JsonLinesWriter(open_dir / "deeper" / "job.sd.jsonl")
    assert os.listdir(open_dir) == []
    for mode in (0o1777, 0o2775, 0o755):
        folder = tmp_path / f"folder-{mode:o}"
        folder.mkdir()
        os.chmod(folder, mode)
        writer = JsonLinesWriter(folder / "logs" / "job.sd.jsonl")
        writer.write({"ok": True})
        assert writer.close() == 0 and (folder / "logs" / "job.sd.jsonl").exists()


# --- a job's second object: its name must not follow from the first one's ---------------------------
@needs_second_user
def test_a_neighbour_who_sees_a_jobs_record_appear_cannot_take_its_semaphore_name_first(ipc_env, monkeypatch):
    """A job's record and semaphore were named with one token, and the record is made first: a
    neighbour watching /dev/shm (inotify) who creates ``sig.<app>.<token>`` as soon as
    ``app.<app>.<token>`` appears won that race 13 times out of 20 with a Python loop against a root
    job, which then trained unmanaged ("POSIX IPC unavailable"). Here she always wins it: the test
    plants the name the record's name gives right after the record is made."""
    uid, _, _ = second_user()
    planted = []
    make_record = AppRecord.create

    def make_then_neighbour_plants(names, app, token):
        record = make_record(names, app, token)
        planted.append(names.app_signal(app, token))  # all that the record's public name tells her
        assert as_neighbour([["sem", planted[-1], 0o666]]) == ["ok"]
        return record

    monkeypatch.setattr(AppRecord, "create", make_then_neighbour_plants)
    link = PosixManagerLink(ipc_env, "raced")
    try:
        claim = discovery.read_claim(ipc_env, "raced")
        channel = AppChannel(ipc_env, "raced")  # the manager's side finds the pair through the claim
        channel.close()
        assert objects.listed_owner(ipc_env.app_record("raced", claim.token)) == os.geteuid()
        assert [objects.listed_owner(name, "semaphore") for name in planted] == [uid]  # left to her
    finally:
        link.close()


def test_a_dead_apps_signal_that_no_claim_names_is_removed_a_live_apps_is_kept(ipc_env, tmp_path, monkeypatch):
    """The semaphore's token is not the record's, so a semaphore whose claim went (removed with the
    runtime directory) can only be found in the listing: the manager removes it when no claim,
    record or table entry of its app is left, and only then."""
    from drbalance.manager import daemon
    monkeypatch.setattr(daemon, "GRACE_SECONDS", 0.0)
    ghost = ipc_env.app_signal("ghost", new_token())
    objects.create_semaphore(ghost).close()
    live = PosixManagerLink(ipc_env, "alive")
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    try:
        manager.start()  # its first rescan
        assert not objects.semaphore_listed(ghost)
        assert objects.semaphore_listed(ipc_env.app_signal("alive", live.signal_token))
        removed = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()
                   if '"event":"app_removed"' in line]
        assert [e["app"] for e in removed] == ["ghost"]
    finally:
        manager.stop()
        live.close()


@needs_second_user
def test_a_neighbour_who_sees_a_managers_inbox_appear_cannot_take_its_heartbeat_name_first(ipc_env, monkeypatch):
    """The same race for the manager: its inbox (made first) shows in /dev/mqueue wherever that is
    mounted (systemd mounts it), and the heartbeat had the inbox's token. A neighbour watching
    /dev/mqueue who created ``manager.<token>`` as soon as ``inbox.<token>`` appeared stopped 5
    manager starts of 10 ("Shared memory with the specified name already exists")."""
    from drbalance.ipc.endpoint import ManagerEndpoint
    uid, _, _ = second_user()
    planted = []
    make_queue = objects.create_queue

    def make_then_neighbour_plants(name, max_messages, max_message_size):
        queue = make_queue(name, max_messages, max_message_size)
        planted.append(ipc_env.manager_record(name.rpartition(".")[2]))  # what the inbox's name tells her
        assert as_neighbour([["shm", planted[-1], 0o666]]) == ["ok"]
        return queue

    monkeypatch.setattr(objects, "create_queue", make_then_neighbour_plants)
    endpoint = ManagerEndpoint(ipc_env)
    try:
        info = discovery.read_manager(ipc_env)
        assert objects.listed_owner(ipc_env.manager_record(info.token)) == os.geteuid()
        assert [objects.listed_owner(name) for name in planted] == [uid]  # left to her
    finally:
        endpoint.close()


def test_a_stale_xdg_runtime_dir_is_passed_over_with_a_warning(monkeypatch, tmp_path):
    """A batch job's environment copied from the submitting machine names a login folder that does
    not exist here (or is another user's): the next default, and a warning that says so."""
    monkeypatch.delenv("DRBALANCE_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run-user-4301"))  # absent here
    with pytest.warns(RuntimeWarning, match="not a folder of this user on this machine"):
        chosen = env.runtime_dir()
    assert chosen != tmp_path / "run-user-4301" / "drbalance"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert chosen == env.runtime_dir()
