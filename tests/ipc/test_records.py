"""Shared-memory records and notices: layout, validation, torn reads, stale leftovers, modes."""

import dataclasses
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time

import posix_ipc
import pytest

from drbalance import DataRatio
from drbalance.ipc import objects
from drbalance.ipc.discovery import AppClaim
from drbalance.ipc.layout import (
    LAYOUT_VERSION,
    AppCommand,
    AppState,
    AppStatus,
    ManagerBeat,
    Notice,
    NoticeKind,
    RecordError,
    SegmentKind,
    SlotStatus,
)
from drbalance.ipc.names import SHM_DIR, IpcNames, new_token
from drbalance.ipc.records import AppNameInUse, AppRecord, RecordBusy, RecordEmpty
from tests.conftest import ROOT, leftovers, python_process
from tests.helpers.record_writer import consistent, status_for


def sample_status(**changes) -> AppStatus:
    base = AppStatus(
        pid=os.getpid(), app="rec", state=AppState.RUNNING, ratio=DataRatio([1, 2, 7, 0]), epoch=1, epochs=3,
        iteration=12, iterations_total=30, iterations_per_epoch=10, notice_seq=4, slowdown=1.37,
        iteration_time=0.25, solo_time=7.5, start_wall=1.7e9, updated_wall=1.7e9 + 3, updated_mono=123.0,
        start_ticks=987654, batch=32, min_share=0,
        slots=(SlotStatus("GPU-6f1c2a4e-0000-4000-8000-000000000001", 0.012, 3.0, 2.5e6, None),
               SlotStatus("GPU-6f1c2a4e-0000-4000-8000-000000000002", 0.021, 6.4, 2.5e6, 7),
               SlotStatus("", 0.08, 22.4),
               SlotStatus()),
    )
    return dataclasses.replace(base, **changes)


def test_status_command_notice_and_heartbeat_round_trip(ipc_env):
    record = AppRecord.create(ipc_env, "rec")
    try:
        with pytest.raises(RecordEmpty):
            record.read_status()
        assert record.read_command() is None
        status = sample_status(slowdown=None, iteration_time=None, state=AppState.STARTING)
        record.write_status(status)
        assert record.read_status() == status
        status = sample_status()
        record.write_status(status)
        assert record.read_status() == status
        command = AppCommand(4242, 7, DataRatio([0, 0, 3, 7]), "util", 1.7e9)
        record.write_command(command)
        assert record.read_command() == command
    finally:
        record.close()
        record.segment.unlink()
    notice = Notice(NoticeKind.BOUNDARY, 99, 5, "rec", 1.7e9)
    assert Notice.decode(notice.encode()) == notice
    beat = ManagerBeat(99, 4, 10, 1.7e9, 55.0)
    assert ManagerBeat.decode(beat.encode(), "hb") == beat


def corrupt(status_bytes: bytes, fmt: str, offset: int, value) -> bytes:
    data = bytearray(status_bytes)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


# Offsets inside the AppStatus payload (see AppStatus.HEAD).
PID, NAME, STATE, FLAGS, COUNT, TOTAL, SHARES = 0, 4, 52, 53, 54, 56, 60
TAIL = 8 + 4 + 2 + 2  # start ticks, batch, min share, slot count
FLOATS = AppStatus.HEAD.size - TAIL - 6 * 8  # sd, iter_time, solo, start, updated, mono
MIN_SHARE = AppStatus.HEAD.size - 4
SLOT0 = AppStatus.HEAD.size  # uuid (64 bytes), chunk seconds, chunk samples, bytes per sample, max samples


@pytest.mark.parametrize(
    ("fmt", "offset", "value", "message"),
    [
        ("<i", PID, 0, "pid 0 is not a process id"),
        ("<B", STATE, 9, "unknown app state 9"),
        ("<B", COUNT, 0, "GPU count 0 outside"),
        ("<B", COUNT, 40, "GPU count 40 outside"),
        ("<H", TOTAL, 11, "sum to 10, but the DR total is 11"),
        ("<H", SHARES + 2 * 5, 3, "shares beyond GPU 3 are not zero"),
        ("<d", FLOATS, float("nan"), "SD is nan"),
        ("<d", FLOATS, float("inf"), "SD is inf"),
        ("<d", FLOATS, -1.0, "SD is -1.0"),
        ("<d", FLOATS + 8, float("nan"), "iteration time is nan"),
        ("<d", FLOATS + 16, 0.0, "solo-run time 0.0"),
        ("<d", FLOATS + 40, float("inf"), "monotonic time is inf"),
        ("<4s", NAME, b"../x", "app name '../x' is not valid"),
        ("<2s", NAME, b"\xff\xfe", "not ASCII"),
        ("<H", MIN_SHARE, 11, "minimum share 11 exceeds the DR total 10"),
        ("<H", MIN_SHARE + 2, 3, "3 slot entries for a DR of 4 GPUs"),
        ("<d", SLOT0 + 64, float("nan"), "slot 0: chunk seconds is nan"),
        ("<d", SLOT0 + 72, -2.0, "slot 0: chunk samples is -2.0"),
        ("<d", SLOT0 + 80, float("inf"), "slot 0: memory per sample is inf"),
        ("<3s", SLOT0, b"\xffab", "slot 0: GPU UUID is not ASCII"),
    ],
)
def test_malformed_status_bytes_are_rejected_with_a_clear_error(fmt, offset, value, message):
    payload = corrupt(sample_status().encode(), fmt, offset, value)
    with pytest.raises(RecordError, match=message.replace("(", r"\(").replace(".", r"\.")):
        AppStatus.decode(payload, "test record")


def test_malformed_notices_are_rejected_with_a_clear_error():
    good = Notice(NoticeKind.REGISTER, 7, 1, "app", 1.0).encode()
    cases = {
        good[:-1]: "75 bytes, expected 76",
        b"XXXX" + good[4:]: "bad magic",
        good[:4] + struct.pack("<H", LAYOUT_VERSION + 1) + good[6:]: f"version {LAYOUT_VERSION + 1}",
        good[:6] + b"\x09" + good[7:]: "unknown kind 9",
        good[:8] + struct.pack("<i", -5) + good[12:]: "pid -5",
        good[:-8] + struct.pack("<d", float("nan")): "send time is nan",
        b"": "0 bytes",
    }
    for message, expected in cases.items():
        with pytest.raises(RecordError, match=expected):
            Notice.decode(message)


def test_checksum_catches_bytes_changed_behind_the_seqlock(ipc_env):
    record = AppRecord.create(ipc_env, "rec")
    try:
        record.write_status(sample_status())
        area = record.status_area
        record.segment.mapping[area.start + 60] ^= 0xFF  # flip a byte without touching the counter
        with pytest.raises(RecordError, match="checksum mismatch"):
            record.read_status()
        struct.pack_into("<I", record.segment.mapping, area.offset, 7)  # a writer died mid-write
        with pytest.raises(RecordBusy, match="still being written after 30 attempts"):
            area.read(attempts=30)
        with pytest.raises(RecordBusy, match="counter 7 unchanged since the last read waited"):
            area.read(attempts=30)  # at once: the same dead write is not waited for twice
        record.write_status(sample_status())  # the next writer recovers the area
        assert record.read_status() == sample_status()
    finally:
        record.close()
        record.segment.unlink()


def test_a_record_naming_another_app_is_refused(ipc_env):
    record = AppRecord.create(ipc_env, "owner")
    try:
        record.write_status(sample_status(app="intruder"))
        with pytest.raises(RecordError, match="names app 'intruder', not 'owner'"):
            record.read_status()
    finally:
        record.close()
        record.segment.unlink()


def test_reader_never_sees_a_torn_record_while_another_process_rewrites_it(ipc_env):
    """Read while another process rewrites, until many different writes were seen (however long a
    busy machine takes to produce them), and check every read for consistency."""
    writer = python_process("tests.helpers.record_writer", "torn", "200")
    try:
        ready, token = writer.stdout.readline().split()
        assert ready == "ready"
        record = AppRecord.open(ipc_env, "torn", token)
        seen, busy, distinct = 0, 0, set()
        deadline = time.monotonic() + 120.0
        while (len(distinct) < 300 or seen < 3000) and time.monotonic() < deadline:
            try:
                status = record.read_status()
            except RecordBusy:
                busy += 1
                continue
            assert consistent(status), f"torn read: {status}"
            seen += 1
            distinct.add(status.iteration)
        record.close()
    finally:
        writer.kill()
        writer.wait()
    assert seen >= 3000 and len(distinct) >= 300, (seen, busy, len(distinct))
    assert status_for(5, "x") != status_for(6, "x")  # the consistency check can tell k apart


@pytest.mark.slow
def test_leftovers_of_a_killed_app_do_not_break_the_next_run_with_the_same_name(ipc_env):
    app = python_process("tests.helpers.toy_app", "--app", "phoenix", "--hang-after", "1",
                         env={"DRBALANCE_NO_MANAGER": ""})
    try:
        for _ in range(2):
            app.stdout.readline()  # iteration 0 and 1: the record and semaphore exist
        assert ipc_env.listed_apps() == ["phoenix"]
        with pytest.raises(AppNameInUse, match="already running as pid"):
            AppClaim.take(ipc_env, "phoenix")  # the name is taken while the app lives
        os.kill(app.pid, signal.SIGKILL)
        app.wait()
    finally:
        app.kill()
    assert ipc_env.listed_apps() == ["phoenix"] and ipc_env.listed_signals() == ["phoenix"]
    again = python_process("tests.helpers.toy_app", "--app", "phoenix", "--epochs", "1", "--iterations", "3")
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert out.strip().splitlines()[-2].startswith('{"iteration": 3')
    assert leftovers(ipc_env) == []  # the new run replaced the leftovers and removed its own at exit


def test_a_dead_apps_unreadable_claim_and_junk_record_do_not_block_its_name(ipc_env):
    """A claim file with garbage in it (a writer killed mid-write) and a junk segment under the
    token of a dead holder: nobody holds the claim's lock, so the next app takes the name and the
    junk goes."""
    ipc_env.private_runtime_dir()
    claims = ipc_env.claims_dir()
    claims.mkdir(mode=0o700)
    (claims / "junk.claim").write_bytes(b"{garbage")
    first = AppClaim.take(ipc_env, "junk")  # garbage, unlocked: a dead writer's
    dead_token = first.token
    junk = posix_ipc.SharedMemory(ipc_env.app_record("junk", dead_token), posix_ipc.O_CREX, mode=0o600, size=100)
    os.write(junk.fd, b"garbage")
    junk.close_fd()
    os.close(first.fd)  # dies without releasing: the claim names dead_token, the lock is free
    first.fd = None
    second = AppClaim.take(ipc_env, "junk")
    try:
        assert second.previous is not None and second.previous.token == dead_token
        assert second.token != dead_token
        assert ipc_env.listed_apps() == []  # the dead holder's junk segment was removed
        record = AppRecord.create(ipc_env, "junk", second.token)
        record.write_status(sample_status(app="junk"))
        assert record.read_status().app == "junk"
        record.close()
        record.segment.unlink()
    finally:
        second.release()
    assert not (claims / "junk.claim").exists()


CLAIM_ON_A_FULL_DISK = """
import json, os, resource, signal, sys
from drbalance.ipc.discovery import AppClaim, read_claim
from drbalance.ipc.names import IpcNames
names = IpcNames.current()
claim = AppClaim.take(names, "renewed")
os.unlink(claim.path)  # e.g. a cleanup of the runtime folder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is then an EFBIG error
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4, hard))  # no file may grow past 4 bytes: a full disk
refused = claim.renew()
left = os.path.exists(claim.path)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
renewed = claim.renew()
found = read_claim(names, "renewed")
print(json.dumps({"refused": refused, "left": left, "renewed": renewed, "pid": found.pid if found else None,
                  "me": os.getpid()}))
claim.release()
"""


def test_a_claim_that_cannot_be_written_back_is_tried_again_and_leaves_no_empty_claim(ipc_env):
    """Putting a removed claim back on a full disk does not raise out of the job's step, and is
    tried again; a file left empty would make the claim look held for good and no manager would
    find the job."""
    done = subprocess.run([sys.executable, "-c", CLAIM_ON_A_FULL_DISK], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["refused"] is False and result["left"] is False  # not put back, and no empty file left
    assert result["renewed"] is True and result["pid"] == result["me"]  # put back once the disk has room
    assert leftovers(ipc_env) == []

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_objects_are_private_whatever_the_umask(ipc_env, umask):
    previous = os.umask(umask)
    try:
        record = AppRecord.create(ipc_env, "private")
        semaphore = objects.create_semaphore(ipc_env.app_signal("private", record.token))
    finally:
        os.umask(previous)
    try:
        for entry in leftovers(ipc_env):
            mode = stat.S_IMODE((SHM_DIR / entry).stat().st_mode)
            assert mode == 0o600, (entry, oct(mode))
        assert len(leftovers(ipc_env)) == 2
    finally:
        record.close()
        semaphore.unlink()
        semaphore.close()
        record.segment.unlink()


def test_names_are_namespaced_per_user_tokenised_and_validated():
    names = IpcNames("lab", 1000)
    token = "0123456789abcdef"
    assert names.app_record("a.b-c_1", token) == "/drb.1000.lab.app.a.b-c_1.0123456789abcdef"
    assert names.inbox(token) == "/drb.1000.lab.inbox.0123456789abcdef"
    assert IpcNames("other", 1000).inbox(token) != names.inbox(token) != IpcNames("lab", 1001).inbox(token)
    for bad in ("", "../etc", "a/b", "x" * 49, "-lead", "sp ace"):
        with pytest.raises(ValueError, match="not valid"):
            names.app_record(bad, token)
    for bad_token in ("", "0123", "0123456789ABCDEF", "../../etc/passw", "0123456789abcdef0"):
        with pytest.raises(ValueError, match="token"):
            names.inbox(bad_token)
    with pytest.raises(ValueError, match="namespace"):
        IpcNames.current("bad/ns")
    assert len({new_token() for _ in range(100)}) == 100


def test_a_second_session_of_one_name_in_the_same_process_is_refused_clearly(ipc_env):
    first = AppClaim.take(ipc_env, "twice")
    try:
        with pytest.raises(AppNameInUse, match="this process already runs an app named 'twice'"):
            AppClaim.take(ipc_env, "twice")
    finally:
        first.release()
    AppClaim.take(ipc_env, "twice").release()  # free again once released


def test_a_record_or_heartbeat_whose_header_was_overwritten_is_restored_by_its_writer(ipc_env):
    from drbalance.ipc.endpoint import ManagerEndpoint
    from drbalance.ipc.link import PosixManagerLink
    from drbalance.ipc.records import Segment

    def zero_magic(name: str) -> None:
        fd = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDWR)
        try:
            os.pwrite(fd, b"\0\0\0\0", 0)
        finally:
            os.close(fd)

    link = PosixManagerLink(ipc_env, "damaged")
    endpoint = ManagerEndpoint(ipc_env)
    try:
        zero_magic(link.record.name)
        with pytest.raises(RecordEmpty, match="bad magic"):  # what a manager met: no answer, ever
            AppRecord.open(ipc_env, "damaged", link.token)
        link.publish(status_for(3, "damaged"))  # the app's next report puts the header back
        assert AppRecord.open(ipc_env, "damaged", link.token).read_status().iteration == 3
        zero_magic(endpoint.heartbeat.segment.name)
        assert endpoint.beat(ManagerBeat(os.getpid(), 2, 10, time.time(), time.monotonic())) is True
        Segment.open(endpoint.heartbeat.segment.name, SegmentKind.MANAGER).close()  # jobs can read it again
    finally:
        link.close()
        endpoint.close()
    assert leftovers(ipc_env) == []
