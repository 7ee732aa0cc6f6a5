"""The system manager's parts without processes: admission, the notice queue, what each user sees,
the wire format, the checks of a passed record, and which system folder a job trusts."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from drbalance.ipc import system, wire
from drbalance.ipc.layout import LAYOUT_VERSION, SEGMENT_SIZE, AppState, AppStatus, Notice, NoticeKind
from drbalance.ipc.peer import Peer, PeerRefused, check_record_descriptor
from drbalance.ipc.private import UnsafePath
from drbalance.ipc.records import AppRecord, RecordBusy
from drbalance.jsonlog import read_json_lines
from drbalance.manager.admission import Admission, NoticeQueue, TokenBucket, UserLimits
from drbalance.manager.balancer import ManagerSettings
from drbalance.manager.system import PROBLEM_LINES_PER_SECOND, Connection, SocketChannel, SystemManager
from drbalance.manager.utilization import ScriptedSource
from drbalance.manager.visibility import ANONYMOUS, status_for
from drbalance.ratio import DataRatio
from tests.helpers.clock import ManualClock
from tests.helpers.neighbour import needs_second_user


def test_a_flooding_user_waits_behind_themselves_in_the_notice_queue():
    queue: NoticeQueue[str] = NoticeQueue()
    for index in range(1000):  # user 2 floods: one pending notice per job, the latest kept
        queue.put(2, f"b{index % 10}", f"b{index % 10}#{index}")
    assert len(queue) == 10
    queue.put(1, "a", "a#1")
    served = [queue.pop()[0] for _ in range(3)]
    assert "a" in served[:2]  # at most one of the flooder's notices before it
    rest = [queue.pop() for _ in range(len(queue))]
    assert all(key.startswith("b") for key, _ in rest)
    assert queue.pop() is None


def test_only_the_latest_of_a_flood_of_one_jobs_notices_is_kept():
    queue: NoticeQueue[int] = NoticeQueue()
    for index in range(500):
        queue.put(2, "b", index)
    assert len(queue) == 1 and queue.pop() == ("b", 499)


def test_the_latest_notice_of_a_job_replaces_the_pending_one_and_leaving_drops_it():
    queue: NoticeQueue[int] = NoticeQueue()
    queue.put(1, "a", 1)
    queue.put(1, "a", 2)
    queue.put(1, "b", 3)
    queue.drop(1, "b")
    assert queue.pop() == ("a", 2)
    assert queue.pop() is None
    queue.put(1, "c", 4)  # the user comes back after all its notices went
    assert queue.pop() == ("c", 4)


def test_users_take_turns_in_the_order_their_notices_came():
    queue: NoticeQueue[str] = NoticeQueue()
    for uid, key in ((1, "a1"), (1, "a2"), (2, "b1"), (3, "c1"), (2, "b2")):
        queue.put(uid, key, key)
    assert [queue.pop()[0] for _ in range(5)] == ["a1", "b1", "c1", "a2", "b2"]


def test_limits_are_per_user():
    admission = Admission(UserLimits(jobs=2, connections=3, notices_per_second=5))
    assert [admission.connection_refusal(7) for _ in range(3)] == [None, None, None]
    assert "3 connections" in admission.connection_refusal(7)
    assert admission.connection_refusal(8) is None  # another user is not affected
    admission.connection_closed(7)
    assert admission.connection_refusal(7) is None
    assert [admission.job_refusal(7) for _ in range(2)] == [None, None]
    assert "2 jobs" in admission.job_refusal(7)
    admission.job_left(7)
    assert admission.job_refusal(7) is None
    assert [admission.notice_refusal(7, 100.0) for _ in range(5)] == [None] * 5
    assert "5 notices" in admission.notice_refusal(7, 100.0)
    assert admission.notice_refusal(8, 100.0) is None
    assert admission.notice_refusal(7, 100.3) is None  # 0.3 s later: 1.5 more allowed
    assert admission.refused_notices == {7: 1}


def test_a_token_bucket_refills_at_its_rate_up_to_one_second_of_burst():
    bucket = TokenBucket(10.0, now=0.0)
    assert sum(bucket.take(0.0) for _ in range(20)) == 10
    assert sum(bucket.take(100.0) for _ in range(20)) == 10  # a long pause gives no more than the burst
    assert sum(bucket.take(100.5) for _ in range(20)) == 5


@pytest.mark.parametrize("field, value", [("jobs", 0), ("connections", True), ("notices_per_second", float("inf")),
                                          ("attach_seconds", -1)])
def test_limits_refuse_values_without_meaning(field, value):
    with pytest.raises(ValueError, match=field):
        UserLimits(**{field: value})


STATUS = {"pid": 10, "namespace": "default", "policy": "fair", "decisions": 3, "util": [50.0], "updated": 1.0,
          "faults": {"sample": "OSError: /home/alice/x"}, "fault_counts": {"sample": 1}, "log": "/run/drbalance/x",
          "apps": [{"name": "secret-a", "uid": 4201, "user_login": "alice", "pid": 111, "epoch": 2, "epochs": 9,
                    "iteration": 20, "iterations_total": 90, "sd": 1.5, "dr": [10], "state": "RUNNING"},
                   {"name": "mine", "uid": 4202, "user_login": "bob", "pid": 222, "epoch": 1, "epochs": 5,
                    "iteration": 5, "iterations_total": 25, "sd": 1.2, "dr": [10], "state": "RUNNING"}]}


def test_a_user_sees_their_own_jobs_by_name_and_others_as_anonymous_load():
    seen = status_for(STATUS, viewer=4202, manager_uid=0, show_names=False)
    text = repr(seen)
    assert "secret-a" not in text and "alice" not in text and "111" not in text and "4201" not in text
    other, mine = seen["apps"]
    assert other["name"] == ANONYMOUS and other["sd"] == 1.5 and other["dr"] == [10] and other["pid"] == 0
    assert mine["name"] == "mine" and mine["pid"] == 222
    assert "faults" not in seen and "log" not in seen  # may name paths or other jobs


def test_the_administrator_and_show_names_see_every_job_by_user_and_name():
    for viewer, manager_uid, show in ((0, 4200, False), (4200, 4200, False), (4202, 0, True)):
        seen = status_for(STATUS, viewer=viewer, manager_uid=manager_uid, show_names=show)
        assert seen["apps"][0]["name"] == "alice/secret-a"
    assert "faults" in status_for(STATUS, viewer=0, manager_uid=4200, show_names=False)


def test_messages_the_protocol_does_not_allow_are_refused_and_their_descriptors_closed():
    fd = os.open("/dev/null", os.O_RDONLY)
    with pytest.raises(wire.WireError, match="carries descriptors"):
        wire.decode(wire.encode(wire.Kind.NOTICE, b"x"), [fd], 0, frozenset({wire.Kind.NOTICE}))
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    version = wire.LAYOUT_VERSION
    for data, error in ((wire.HEADER.pack(b"XXXX", version, 2, 0), "magic"),
                        (wire.encode(wire.Kind.WELCOME), "not expected"),
                        (wire.HEADER.pack(wire.MAGIC, version, 255, 0), "unknown message kind"),
                        (wire.HEADER.pack(wire.MAGIC, version - 1, 2, 0), "layout version"), (b"DR", "shorter")):
        with pytest.raises(wire.WireError, match=error):
            wire.decode(data, [], 0, frozenset({wire.Kind.NOTICE}))
    with pytest.raises(wire.WireError, match="longer"):
        wire.decode(wire.encode(wire.Kind.NOTICE), [], socket.MSG_TRUNC, frozenset({wire.Kind.NOTICE}))


def test_messages_cross_a_socket_with_the_record_descriptor():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    record = AppRecord.create_sealed("job")
    try:
        assert wire.send(left, wire.Kind.ATTACH, wire.attach_payload("job"), fds=(record.segment.memory.fd,))
        message = wire.receive(right, frozenset({wire.Kind.ATTACH}))
        assert message.kind == wire.Kind.ATTACH and wire.attached_app(message.payload) == "job"
        assert len(message.fds) == 1
        check_record_descriptor(message.fds[0], Peer(os.getpid(), os.geteuid(), os.getegid()), SEGMENT_SIZE)
        message.close_fds()
        assert wire.receive(right, frozenset({wire.Kind.ATTACH})) is None  # nothing more: never waits
        left.close()
        with pytest.raises(EOFError):
            wire.receive(right, frozenset({wire.Kind.ATTACH}))
    finally:
        record.close()
        right.close()


def test_a_passed_record_must_be_a_sealed_memfd_of_the_peer_of_the_records_size(tmp_path):
    me = Peer(os.getpid(), os.geteuid(), os.getegid())
    plain = tmp_path / "file"
    plain.write_bytes(bytes(SEGMENT_SIZE))
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, SEGMENT_SIZE)
    wrong_size = os.memfd_create("y", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(wrong_size, 4096)
    fcntl.fcntl(wrong_size, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    pipe_read, pipe_write = os.pipe()
    file_fd = os.open(plain, os.O_RDWR)
    try:
        for fd, reason in ((file_fd, "instead of a memfd"), (unsealed, "not sealed"), (wrong_size, "4096 bytes"),
                           (pipe_read, "not a memory file")):
            with pytest.raises(PeerRefused, match=reason):
                check_record_descriptor(fd, me, SEGMENT_SIZE)
        record = AppRecord.create_sealed("z")
        with pytest.raises(PeerRefused, match="not its own"):
            check_record_descriptor(record.segment.memory.fd, Peer(me.pid, me.uid + 1, me.gid), SEGMENT_SIZE)
        with pytest.raises(OSError):
            os.ftruncate(record.segment.memory.fd, 0)  # the seal holds against its own creator too
        record.close()
    finally:
        for fd in (unsealed, wrong_size, pipe_read, pipe_write, file_fd):
            os.close(fd)


def test_a_passed_record_sealed_against_writing_is_refused_saying_so():
    """The manager writes its commands into the record: one sealed against writing cannot be
    mapped for that, and is refused with the reason (not an unexplained "Operation not permitted")."""
    me = Peer(os.getpid(), os.geteuid(), os.getegid())
    resizing = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    for write_seal in (fcntl.F_SEAL_WRITE, 0x10):  # F_SEAL_WRITE, F_SEAL_FUTURE_WRITE (Linux 5.1)
        fd = os.memfd_create("w", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SEGMENT_SIZE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, resizing | write_seal | fcntl.F_SEAL_SEAL)
            with pytest.raises(PeerRefused, match="sealed against writing"):
                check_record_descriptor(fd, me, SEGMENT_SIZE)
        finally:
            os.close(fd)


def test_the_system_manager_never_waits_on_a_record_its_owner_keeps_mid_write(monkeypatch):
    """A job (another user's) can keep its record's seqlock counter odd, a new value each time:
    reading it must cost the system manager no wait (it keeps the job's last valid status), or
    every decision, for every user's jobs, would wait about 20 ms per such record."""
    job_side = AppRecord.create_sealed("busy")
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection = Connection(right, Peer(os.getpid(), os.geteuid(), os.getegid()), 0.0)
    connection.record = AppRecord.adopt(os.dup(job_side.segment.memory.fd), "busy", "record of 'busy'")
    try:
        now = time.time()
        job_side.write_status(AppStatus(os.getpid(), "busy", AppState.RUNNING, DataRatio([1, 1], 2), 0, 2, 1, 10, 5,
                                        1, 1.0, 0.1, 1.0, now, now, time.monotonic()))
        channel = SocketChannel(connection)
        assert channel.read_status().app == "busy"
        sleeps = []
        monkeypatch.setattr(time, "sleep", sleeps.append)
        words, index = job_side.status_area.words, job_side.status_area.counter_index
        for odd in (1001, 1003, 1005):  # a write "under way", another one at every read
            words[index] = odd
            with pytest.raises(RecordBusy):
                channel.read_status()
        assert sleeps == []
    finally:
        connection.close()
        job_side.close()
        left.close()


def test_a_notice_keeps_its_format_inside_a_message():
    notice = Notice(NoticeKind.BOUNDARY, 42, 7, "job", 1.5)
    message = wire.decode(wire.encode(wire.Kind.NOTICE, notice.encode()), [], 0, frozenset({wire.Kind.NOTICE}))
    assert Notice.decode(message.payload) == notice


# --- which system folder a job trusts ------------------------------------------------------------
@pytest.fixture
def root_tmp(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="drbalance-trust-"))
    os.chmod(base, 0o755)
    monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(base / "sys"))
    yield base
    os.chmod(base, 0o755)
    for path in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            path.rmdir()
    base.rmdir()


def test_no_system_folder_means_no_system_manager(root_tmp):
    assert system.find("ns") is None


def test_the_system_folder_is_made_0755_and_found(root_tmp):
    made = system.create("ns")
    assert stat.S_IMODE(os.stat(made.folder).st_mode) == 0o755
    assert system.find("ns") == made and made.owner == os.geteuid()


@needs_second_user
def test_a_system_dir_of_another_user_is_trusted_only_where_root_gave_it(root_tmp):
    root = root_tmp / "sys"
    (root / "ns").mkdir(parents=True)
    for folder in (root, root / "ns"):
        os.chown(folder, 4200, 4200)
        os.chmod(folder, 0o755)
    assert system.find("ns").owner == 4200  # its parent is root's and only root may write it
    os.chmod(root_tmp, 0o1777)  # now anyone could have made it there
    with pytest.raises(UnsafePath, match="anyone may make folders"):
        system.find("ns")
    os.chmod(root_tmp, 0o755)
    os.chown(root / "ns", 4201, 4201)  # the namespace folder is not the system dir owner's
    with pytest.raises(UnsafePath, match="not to the system dir's owner"):
        system.find("ns")


@needs_second_user
def test_a_link_or_a_writable_folder_on_the_way_is_refused(root_tmp):
    made = system.create("ns")
    os.chmod(made.folder, 0o777)
    with pytest.raises(UnsafePath, match="writable by group or others"):
        system.find("ns")
    os.chmod(made.folder, 0o755)
    elsewhere = root_tmp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "ns").mkdir(mode=0o755)
    link = root_tmp / "link"
    link.symlink_to(elsewhere)
    os.chown(link, 4201, 4201, follow_symlinks=False)  # a user's link on the way is never followed
    os.environ["DRBALANCE_SYSTEM_DIR"] = str(link)
    with pytest.raises(UnsafePath, match="symbolic link owned by"):
        system.find("ns")
    os.chown(link, 0, 0, follow_symlinks=False)  # root's link is followed
    assert system.find("ns").root == link


@pytest.mark.skipif(os.geteuid() != 0, reason="a system dir is trusted only where root made it; CI runs as root")
def test_one_users_junk_messages_write_few_lines_to_the_manager_log_the_rest_are_counted(root_tmp, tmp_path):
    """Every malformed message is refused; but junk with a reason of its own each must not write a
    line apiece to the administrator's log (one user could rotate it away, and slow the manager
    down for everyone): past ``PROBLEM_LINES_PER_SECOND`` a user's lines are counted (``withheld``)."""
    script = tmp_path / "util.json"
    script.write_text(json.dumps({"gpus": 2, "steps": [{"at": 0, "util": [10, 20]}]}))
    clock = ManualClock(start=1000.0)  # still while the junk is read: no new allowance
    manager = SystemManager(ManagerSettings(namespace="junk", log_path=tmp_path / "m.jsonl"),
                            ScriptedSource(script, clock), clock=clock)
    manager.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    junk = 100
    try:
        sock.connect(str(manager.place.socket))
        for pid in range(1, junk + 1):  # "pid -N is not a process id": a reason of its own each
            payload = Notice.STRUCT.pack(Notice.MAGIC, LAYOUT_VERSION, 2, 0, -pid, 1, b"junk", 1.0)
            assert wire.send(sock, wire.Kind.NOTICE, payload, timeout=5)
        assert wire.send(sock, wire.Kind.STATUS, timeout=5)  # answered once all the junk before it was read
        answers = []
        while wire.Kind.STATUS_REPLY not in answers:
            manager.turn()
            while wire.wait_readable(sock, 0):
                answers.append(wire.receive(sock, frozenset(wire.Kind), size=wire.MAX_REPLY).kind)
        clock.advance(manager.settings.gc_period)
        manager.turn()
    finally:
        sock.close()
        manager.stop()
    events = list(read_json_lines(tmp_path / "m.jsonl"))
    lines = [e for e in events if e["event"] == "invalid"]
    withheld = [e for e in events if e["event"] == "withheld"]
    assert len(lines) == PROBLEM_LINES_PER_SECOND, len(lines)
    assert sum(e["count"] for e in withheld) == junk - len(lines) and withheld[0]["uid"] == os.geteuid()
