"""Two real users (uids 4201 and 4202) on one system manager: both balanced, and every attack of
the second on the first refused with the first user's jobs untouched. Root only (CI runs as root):
the jobs run as the users through ``setpriv``, the attacks in forked children that take a user's uid."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from drbalance.ipc import system, wire
from drbalance.ipc.private import UnsafePath
from tests.conftest import wait_for
from tests.helpers.neighbour import needs_second_user
from tests.helpers.processes import first_line, stop_app
from tests.helpers.system import (
    SERVICE_UID,
    USER_A,
    USER_B,
    RawClient,
    SystemManagerProcess,
    as_user,
    others_may_run_python,
    shared_tmp,
    user_env,
    user_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.second_user, needs_second_user]
NAMESPACE = "users"
LONG = ("--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--exchange-timeout", "5")


@pytest.fixture
def server(tmp_path):
    """A shared /tmp folder, a system manager (as root) in it, and /root traversable for the users' jobs."""
    with shared_tmp() as base, others_may_run_python():
        os.chmod(tmp_path, 0o755)
        manager = SystemManagerProcess(tmp_path, base / "system", NAMESPACE, (90, 80, 20, 50), "--metrics-port", "0")
        try:
            yield base, manager
        finally:
            code, err = manager.stop()
            assert code == 0, err


@contextlib.contextmanager
def jobs(base: Path, system_dir: Path, *specs: tuple[int, str]):
    """Long-running toy jobs (uid, name), each attached and reporting, stopped at the end."""
    started = []
    try:
        for uid, name in specs:
            app = user_job(uid, user_env(base, uid, system_dir, NAMESPACE), name, *LONG)
            started.append(app)
            first_line(app)
        yield started
    finally:
        for app in started:
            stop_app(app)


def decided(manager: SystemManagerProcess, uid: int, app: str) -> list[dict]:
    return [e for e in manager.events("decision") if e["app"] == f"{uid}:{app}"]


def test_two_users_jobs_on_one_system_manager_are_both_balanced(server):
    base, manager = server
    with jobs(base, manager.system_dir, (USER_A, "a1"), (USER_A, "a2"), (USER_B, "b1"), (USER_B, "b2")) as apps:
        for uid, name in ((USER_A, "a1"), (USER_A, "a2"), (USER_B, "b1"), (USER_B, "b2")):
            wait_for(lambda uid=uid, name=name: decided(manager, uid, name), timeout=60)
        attached = {e["app"]: (e["uid"], e["pid"]) for e in manager.events("attached")}
        assert attached == {f"{USER_A}:a1": (USER_A, apps[0].pid), f"{USER_A}:a2": (USER_A, apps[1].pid),
                            f"{USER_B}:b1": (USER_B, apps[2].pid), f"{USER_B}:b2": (USER_B, apps[3].pid)}
    # one policy saw all four: the paper's exclusive mode gave each its own GPU, none shared "GPU 0"
    placed = [decided(manager, uid, name)[0]["new_dr"] for uid, name in
              ((USER_A, "a1"), (USER_A, "a2"), (USER_B, "b1"), (USER_B, "b2"))]
    assert sorted(dr.index(10) for dr in placed) == [0, 1, 2, 3]


def test_a_system_manager_needs_no_privilege(tmp_path):
    """Run as a dedicated service user to whom root gave the system dir, it balances two users' jobs."""
    with shared_tmp() as base, others_may_run_python():
        os.chmod(tmp_path, 0o755)
        system_dir = base / "system"
        system_dir.mkdir(mode=0o755)
        os.chown(system_dir, SERVICE_UID, SERVICE_UID)
        manager = SystemManagerProcess(base, system_dir, NAMESPACE, uid=SERVICE_UID)  # its script where it can read
        try:
            with jobs(base, system_dir, (USER_A, "a"), (USER_B, "b")):
                wait_for(lambda: decided(manager, USER_A, "a") and decided(manager, USER_B, "b"), timeout=60)
        finally:
            code, err = manager.stop()
        assert code == 0, err
        assert os.stat(manager.log_path).st_uid == SERVICE_UID and os.stat(manager.log_path).st_mode & 0o077 == 0


# --- the second user's attacks ---------------------------------------------------------------------
def forged_notice(namespace: str, system_dir: str, app: str, pid: int) -> list[str]:
    """As user B: attach an app of her own, then send notices naming A's app and A's pid; and a
    record naming A's pid. What the manager answered each time."""
    os.environ["DRBALANCE_SYSTEM_DIR"] = system_dir
    client = RawClient(namespace)
    answers = [client.attach("b-liar").kind.name]
    client.publish("b-liar")
    for fake_app, fake_pid in ((app, pid), ("b-liar", pid)):
        client.notice(fake_app, pid=fake_pid)
        answer = client.answer()
        answers.append(wire.refusal(answer.payload)[1] if answer is not None else "none")
        time.sleep(1.1)  # one refusal a second
    client.publish("b-liar", pid=pid)  # her record names A's process
    client.notice("b-liar")
    answer = client.answer()
    answers.append(wire.refusal(answer.payload)[1] if answer is not None else "none")
    client.close()
    return answers


def test_notices_and_records_naming_another_users_job_are_refused(server):
    base, manager = server
    with jobs(base, manager.system_dir, (USER_A, "a1")) as (victim,):
        wait_for(lambda: decided(manager, USER_A, "a1"), timeout=60)
        before = len(decided(manager, USER_A, "a1"))
        answers = as_user(USER_B, forged_notice, NAMESPACE, str(manager.system_dir), "a1", victim.pid)
        assert answers[0] == "WELCOME"
        assert all("refused" in text for text in answers[1:3]), answers
        assert f"names pid {victim.pid}" in answers[3]
        triggers = {e["trigger"] for e in decided(manager, USER_A, "a1")[before:]}
        assert "register" not in triggers  # B's notices never made a decision for A's job
    invalid = [e for e in manager.events("invalid") if e.get("uid") == USER_B]
    assert len(invalid) >= 2 and all(e["pid"] != victim.pid for e in invalid)  # her pid, from the kernel


def peek(pid: int, log: str) -> list[str]:
    """As user B: try to reach A's record (through /proc: any descriptor of A's process) and A's SD log."""
    results = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        results.append(f"listed {len(fds)}")
    except OSError as error:
        results.append(type(error).__name__)
    for fd in range(3, 64):
        try:
            os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR))
            results.append(f"opened {fd}")
        except OSError:
            continue
    try:
        Path(log).read_text()
        results.append("read the log")
    except OSError as error:
        results.append(type(error).__name__)
    return results


def test_another_user_cannot_reach_a_jobs_record_or_logs(server):
    base, manager = server
    with jobs(base, manager.system_dir, (USER_A, "a1")) as (victim,):
        log = base / f"home-{USER_A}" / "logs" / "a1.sd.jsonl"
        wait_for(log.exists, timeout=60)
        assert as_user(USER_B, peek, victim.pid, str(log)) == ["PermissionError", "PermissionError"]


def flood(namespace: str, system_dir: str, seconds: float) -> dict:
    """As user B: one job's notices as fast as the socket takes them, and connections until refused."""
    os.environ["DRBALANCE_SYSTEM_DIR"] = system_dir
    client = RawClient(namespace)
    client.attach("flood")
    client.publish("flood")
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        client.notice("flood", seq=sent + 1)
        sent += 1
        while client.sock is not None and wire.wait_readable(client.sock, 0):
            if wire.receive(client.sock, frozenset(wire.Kind)) is None:
                break
    extra, refused = [], 0
    for _ in range(300):  # thousands of registrations would do no more: the limit is per user
        try:
            other = RawClient(namespace)
        except OSError:
            refused += 1
            continue
        extra.append(other)
    time.sleep(1.0)  # well within the 5 s an accepted connection may stay without attaching
    for other in extra:
        if wire.wait_readable(other.sock, 0):  # refused: closed at once (told why at most once a second)
            refused += 1
        other.close()
    client.close()
    return {"sent": sent, "refused_connections": refused}


def test_a_flood_of_notices_and_connections_from_one_user_does_not_stop_anothers(server):
    base, manager = server
    with jobs(base, manager.system_dir, (USER_A, "a1")):
        wait_for(lambda: decided(manager, USER_A, "a1"), timeout=60)
        started = time.time()
        result = as_user(USER_B, flood, NAMESPACE, str(manager.system_dir), 5.0)
        assert result["sent"] > 100 and result["refused_connections"] >= 300 - 127
        during = [e for e in decided(manager, USER_A, "a1") if e["t"] >= started]
        assert during, "user A's job got no answer while user B flooded"
        with jobs(base, manager.system_dir, (USER_A, "a2")):  # A can still attach a new job
            wait_for(lambda: decided(manager, USER_A, "a2"), timeout=60)
    refused = [e for e in manager.events("refused") if e.get("uid") == USER_B]
    assert any("notices per second" in e["error"] for e in refused)
    assert any("connections" in e["error"] for e in refused)


def plant(system_dir: str, namespace: str, decoy: str) -> list[str]:
    """As user B: try to put things in the system folder; build a look-alike system dir of her own."""
    folder = Path(system_dir) / namespace
    results = []
    for action in (lambda: (folder / "manager.sock.x").write_text("x"),
                   lambda: os.symlink("/tmp", folder / "link"),
                   lambda: os.unlink(folder / "manager.sock")):
        try:
            action()
            results.append("done")
        except OSError as error:
            results.append(type(error).__name__)
    fake = Path(decoy) / namespace
    fake.mkdir(parents=True)
    os.chmod(decoy, 0o755)
    os.chmod(fake, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(fake / "manager.sock"))
    listener.close()
    return results


def test_another_user_can_plant_nothing_in_the_system_folder_and_her_look_alike_is_not_trusted(server, monkeypatch):
    base, manager = server
    decoy = base / "decoy"
    decoy.mkdir()
    os.chmod(decoy, 0o1777)  # a /tmp-like folder: anyone may make things in it
    results = as_user(USER_B, plant, str(manager.system_dir), NAMESPACE, str(decoy / "sys"))
    assert results == ["PermissionError", "PermissionError", "PermissionError"]
    monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(decoy / "sys"))
    with pytest.raises(UnsafePath, match="anyone may make folders"):
        system.find(NAMESPACE)
    # a job told to look there (a stale environment, say) trains on with its user's own manager instead
    env = user_env(base, USER_A, decoy / "sys", NAMESPACE)
    app = user_job(USER_A, env, "misled", "--epochs", "1", "--iterations", "3")
    out, err = app.communicate(timeout=120)
    assert app.returncode == 0, err
    assert "not using the system manager's folder" in err and "anyone may make folders" in err


def status_of(namespace: str, system_dir: str) -> dict:
    os.environ["DRBALANCE_SYSTEM_DIR"] = system_dir
    from drbalance.ipc.system_link import read_system_status

    return read_system_status(namespace)


def test_a_users_status_and_the_metrics_name_no_other_users_jobs(server):
    base, manager = server
    with jobs(base, manager.system_dir, (USER_A, "secret-alpha"), (USER_B, "b-own")):
        wait_for(lambda: decided(manager, USER_A, "secret-alpha") and decided(manager, USER_B, "b-own"), timeout=60)
        seen = as_user(USER_B, status_of, NAMESPACE, str(manager.system_dir))
        names = sorted(app["name"] for app in seen["apps"])
        assert names == ["(another user's job)", "b-own"]
        assert "secret-alpha" not in json.dumps(seen) and str(USER_A) not in json.dumps(seen)
        other = next(app for app in seen["apps"] if app.get("anonymous"))
        assert other["dr"] and "sd" in other  # load: the GPUs it uses, its SD
        admin = status_of(NAMESPACE, str(manager.system_dir))  # root: the administrator
        assert sorted(app["name"] for app in admin["apps"]) == [f"{USER_A}/secret-alpha", f"{USER_B}/b-own"]
        url = wait_for(lambda: next((e["url"] for e in manager.events("metrics")), None), timeout=30)
        text = wait_for(lambda: t if "drbalance_app_slowdown{" in (t := urllib.request.urlopen(url).read().decode())
                        else None, timeout=30)
        assert "secret-alpha" not in text and "b-own" not in text and 'app="job' in text
