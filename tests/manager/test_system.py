"""The system manager as a real process with real jobs (of this user) over its socket: attaching,
balancing, refusing what a job claims falsely, limits, status, and living beside users' own managers.
Other users' jobs: test_system_users.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time

import pytest

from drbalance.ipc import system, wire
from drbalance.ipc.objects import process_start_ticks
from drbalance.ipc.system_link import LOOK_AGAIN_SECONDS, SystemManagerLink, SystemStatusError, read_system_status
from drbalance.manager.status import read_status
from tests.conftest import wait_for
from tests.helpers.clock import ManualClock
from tests.helpers.processes import ManagerProcess, first_line, stop_app, toy_app
from tests.helpers.system import RawClient, SystemManagerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def machine(ipc_env, tmp_path):
    """A system manager of the test's namespace (its system dir: the test's own)."""
    manager = SystemManagerProcess(tmp_path, tmp_path / "system", ipc_env.namespace)
    yield manager
    code, err = manager.stop()
    assert code == 0, err


def test_a_job_attaches_to_the_system_manager_and_is_balanced(machine, tmp_path):
    app = toy_app("solo", "--epochs", "2", "--iterations", "3", "--exchange-timeout", "10")
    assert first_line(app)["ratio"] == [0, 0, 10, 0]  # the paper's exclusive mode: GPU 2 is the least used
    out, err = app.communicate(timeout=120)
    assert app.returncode == 0, err
    attached = machine.events("attached")
    assert [(e["app"], e["pid"], e["uid"]) for e in attached] == [(f"{os.geteuid()}:solo", app.pid, os.geteuid())]
    decisions = machine.events("decision")
    assert decisions[0]["branch"] == "exclusive" and decisions[0]["new_dr"] == [0, 0, 10, 0]
    assert [e["reason"] for e in machine.events("app_removed")] == ["finished"]


def test_status_shows_the_system_managers_jobs(machine, ipc_env):
    app = toy_app("seen", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
    try:
        first_line(app)
        status = wait_for(lambda: s if (s := read_status(ipc_env))["apps"] else None, timeout=60)
        assert status["system"] is True and status["pid"] == machine.process.pid
        assert [a["name"] for a in status["apps"]] == ["seen"] and status["apps"][0]["pid"] == app.pid
    finally:
        stop_app(app)


def test_a_users_own_manager_does_not_start_beside_a_system_manager(machine, ipc_env, tmp_path):
    own = ManagerProcess(tmp_path, ipc_env, wait=False)
    code, err = own.stop(signal_it=False)
    assert code == 1 and "system manager" in err and "balances every user's jobs" in err


def test_a_users_own_manager_stops_when_a_system_manager_starts_and_its_jobs_move_to_it(ipc_env, tmp_path):
    own = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50))
    app = toy_app("mover", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--exchange-timeout", "5")
    machine = None
    try:
        assert first_line(app)["ratio"] == [0, 0, 10, 0]
        wait_for(lambda: own.events("decision"), timeout=60)
        machine = SystemManagerProcess(tmp_path, tmp_path / "system", ipc_env.namespace, (10, 90, 90, 90))
        code, err = own.stop(signal_it=False)  # it stops by itself
        assert code == 0, err
        assert own.events("stop")[0]["reason"] == "a system manager took over the namespace"
        wait_for(lambda: any(e["app"].endswith(":mover") for e in machine.events("decision")), timeout=60)
    finally:
        stop_app(app)
        if machine is not None:
            code, err = machine.stop()
            assert code == 0, err


def test_a_job_falls_back_to_its_users_manager_and_back(ipc_env, tmp_path):
    machine = SystemManagerProcess(tmp_path, tmp_path / "system", ipc_env.namespace)
    app = toy_app("wanderer", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--exchange-timeout", "5")
    own = None
    try:
        first_line(app)
        wait_for(lambda: machine.events("decision"), timeout=60)
        assert machine.stop()[0] == 0
        own = ManagerProcess(tmp_path, ipc_env)
        wait_for(lambda: any(e["app"] == "wanderer" for e in own.events("decision")), timeout=60)
    finally:
        stop_app(app)
        if own is not None:
            own.stop()


def test_a_notice_or_record_naming_another_process_is_refused_and_reported(machine, ipc_env):
    client = RawClient(ipc_env.namespace)
    try:
        assert client.attach("liar").kind == wire.Kind.WELCOME
        client.publish("liar")
        client.notice("liar", pid=1)  # claims to be init
        answer = client.answer()
        assert answer.kind == wire.Kind.REFUSED and wire.refusal(answer.payload)[0] == wire.Refusal.INVALID
        time.sleep(1.1)  # the manager tells a connection at most one refusal a second
        client.notice("other", seq=2)  # another app's name on this connection
        answer = client.answer()
        assert answer.kind == wire.Kind.REFUSED and "'other'" in wire.refusal(answer.payload)[1]
        client.publish("liar", pid=1)  # the record names another process
        time.sleep(1.1)
        client.notice("liar", seq=3)
        answer = client.answer()
        assert answer.kind == wire.Kind.REFUSED and "names pid 1" in wire.refusal(answer.payload)[1]
    finally:
        client.close()
    invalid = wait_for(lambda: [e for e in machine.events() if e["event"] == "invalid"], timeout=30)
    assert any("pid 1" in e["error"] for e in invalid)
    assert not machine.events("decision")  # nothing was decided on a lie


def test_a_record_naming_another_start_time_is_refused_saying_so(machine, ipc_env):
    """The pid is right, the process start time is not (a record of an earlier process of that
    pid): the refusal names the start times, not only the pids (which agree)."""
    client = RawClient(ipc_env.namespace)
    try:
        assert client.attach("reborn").kind == wire.Kind.WELCOME
        client.publish("reborn")
        status = client.record.read_status()
        ticks = process_start_ticks(os.getpid())
        client.record.write_status(dataclasses.replace(status, start_ticks=ticks + 7))
        client.notice("reborn")
        answer = client.answer()
        assert answer.kind == wire.Kind.REFUSED
        assert f"started at {ticks + 7}" in wire.refusal(answer.payload)[1], wire.refusal(answer.payload)[1]
        assert f"started at {ticks}" in wire.refusal(answer.payload)[1]
    finally:
        client.close()


def test_a_record_that_is_not_a_sealed_memfd_is_refused(machine, ipc_env, tmp_path):
    plain = tmp_path / "record"
    plain.write_bytes(bytes(8192))
    fd = os.open(plain, os.O_RDWR)
    client = RawClient(ipc_env.namespace)
    try:
        answer = client.attach("fake", fd=fd)
        assert answer.kind == wire.Kind.REFUSED and "memfd" in wire.refusal(answer.payload)[1]
    finally:
        os.close(fd)
        client.close()


def test_a_second_job_of_the_same_name_and_user_is_refused(machine, ipc_env):
    first = RawClient(ipc_env.namespace)
    second = RawClient(ipc_env.namespace)
    try:
        assert first.attach("twin").kind == wire.Kind.WELCOME
        answer = second.attach("twin")
        assert answer.kind == wire.Kind.REFUSED and wire.refusal(answer.payload)[0] == wire.Refusal.NAME_IN_USE
        first.close()  # gone: the name is free again
        third = RawClient(ipc_env.namespace)
        assert wait_for(lambda: third.attach("twin").kind == wire.Kind.WELCOME or None, timeout=30)
        third.close()
    finally:
        first.close()
        second.close()


def test_per_user_limits_refuse_jobs_connections_and_notices(ipc_env, tmp_path):
    machine = SystemManagerProcess(tmp_path, tmp_path / "system", ipc_env.namespace, (90, 80, 20, 50),
                                   "--max-jobs-per-user", "1", "--max-connections-per-user", "3",
                                   "--notices-per-user", "5")
    clients = [RawClient(ipc_env.namespace) for _ in range(3)]
    try:
        assert clients[0].attach("one").kind == wire.Kind.WELCOME
        answer = clients[1].attach("two")
        assert answer.kind == wire.Kind.REFUSED and wire.refusal(answer.payload)[0] == wire.Refusal.LIMIT
        extra = RawClient(ipc_env.namespace)  # the fourth connection
        answer = extra.answer()
        assert answer.kind == wire.Kind.REFUSED and "3 connections" in wire.refusal(answer.payload)[1]
        extra.close()
        clients[0].publish("one")
        for seq in range(1, 41):
            clients[0].notice("one", seq=seq)
        kinds = []
        while (message := clients[0].answer(timeout=3)) is not None:
            kinds.append((message.kind, wire.refusal(message.payload)[0] if message.kind == wire.Kind.REFUSED else 0))
        assert (wire.Kind.REFUSED, wire.Refusal.LIMIT) in kinds
        decisions = machine.events("decision")
        assert 1 <= len(decisions) <= 10  # 5 a second with a burst of 5; the rest refused or replaced
    finally:
        for client in clients:
            client.close()
        code, err = machine.stop()
        assert code == 0, err
    assert json.dumps(machine.events("refused"))  # logged


def test_a_removed_socket_is_made_again_and_jobs_attach_there(machine, ipc_env):
    (machine.folder / "manager.sock").unlink()
    wait_for(lambda: machine.events("repaired"), timeout=30)
    client = RawClient(ipc_env.namespace)
    try:
        assert client.attach("after").kind == wire.Kind.WELCOME
    finally:
        client.close()


def test_a_job_and_the_status_do_not_wait_on_a_stopped_system_manager_whose_queue_is_full(machine, ipc_env):
    """A stopped (or hung) system manager accepts no connection: once its listen queue is full, a
    job that connects must not wait for it (its start and every later look would hang)."""
    place = system.find(ipc_env.namespace)
    os.kill(machine.process.pid, signal.SIGSTOP)
    held, outcome = [], {}
    try:
        while True:  # the queue filled, as another user's connections can fill it
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            try:
                sock.connect(str(place.socket))
            except BlockingIOError:
                sock.close()
                break
            held.append(sock)

        def start_a_job_and_ask_the_status() -> None:
            link = SystemManagerLink(place, "late", attach_timeout=1.0)
            outcome["attached"], outcome["problem"] = link.sock is not None, link.problem
            link.close()
            try:
                read_system_status(ipc_env.namespace, timeout=1.0)
            except SystemStatusError as error:
                outcome["status"] = str(error)

        job = threading.Thread(target=start_a_job_and_ask_the_status, daemon=True)
        job.start()
        job.join(timeout=30)
        returned = not job.is_alive()
    finally:
        os.kill(machine.process.pid, signal.SIGCONT)
        for sock in held:
            sock.close()
    job.join(timeout=60)
    assert returned, "the job waited for a stopped system manager to accept its connection"
    assert outcome["attached"] is False and "accepts no connection" in outcome["problem"], outcome
    assert "accepts no connection" in outcome["status"], outcome


def test_a_job_that_waited_in_vain_for_a_stopped_system_manager_looks_again_only_later(machine, ipc_env):
    """A look at a stopped system manager costs the attach wait; a job does not pay it again at its
    next looks (a session's start looks three times in a row), only after ``LOOK_AGAIN_SECONDS``."""
    place = system.find(ipc_env.namespace)
    clock = ManualClock()
    os.kill(machine.process.pid, signal.SIGSTOP)
    link = None
    try:
        link = SystemManagerLink(place, "late", clock=clock, attach_timeout=0.2)  # no welcome: not attached
        tries = []
        connect = link._connect
        link._connect = lambda: tries.append(clock.monotonic()) or connect()
        assert link.manager() is None and link.manager() is None
        assert tries == []
        clock.advance(LOOK_AGAIN_SECONDS)
        assert link.manager() is None and tries == [LOOK_AGAIN_SECONDS]
    finally:
        os.kill(machine.process.pid, signal.SIGCONT)
        if link is not None:
            link.close()
