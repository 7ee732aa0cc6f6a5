"""What the users' processes run in the fault campaign's section ``system`` (``fault_system.py``).

Each function runs in a child forked from the campaign that took a user's uid (``UserProcess``):
jobs of user A or B (the real ``Session``, ``AutoLink`` and socket code, or a job stopped at a
point of its life), and user B's attacks on the system manager: malformed messages and records,
floods, planted files, a look-alike system dir. They reach the manager of the namespace in
``DRBALANCE_NAMESPACE`` through the system dir in ``DRBALANCE_SYSTEM_DIR`` and write what they saw
as JSON for the campaign.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import json
import math
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from drbalance import DataRatio
from drbalance.ipc import system, wire
from drbalance.ipc.layout import (
    AREA_HEADER,
    COMMAND_OFFSET,
    LAYOUT_VERSION,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_SIZE,
    STATUS_OFFSET,
    AppState,
    AppStatus,
    Notice,
    NoticeKind,
    SegmentKind,
)
from drbalance.ipc.link import DEFAULT_EXCHANGE_TIMEOUT
from drbalance.ipc.names import IpcNames
from drbalance.ipc.objects import process_start_ticks
from drbalance.ipc.records import AppRecord

ANSWERS = frozenset({wire.Kind.WELCOME, wire.Kind.REFUSED, wire.Kind.COMMAND, wire.Kind.STATUS_REPLY})


# --- the jobs -------------------------------------------------------------------------------------
class RatioHolder:
    """Stands in for BalancedDataParallel in a forked job (the session reads and sets the DR);
    counts DRs it could not have been sent: not 4 GPUs, or at neither the job's total nor the manager's."""

    def __init__(self) -> None:
        self.ratio = DataRatio([1, 1, 1, 1], 4)
        self.invalid = 0

    def set_ratio(self, ratio: DataRatio) -> None:
        if len(ratio) != 4 or ratio.total not in (4, 10):
            self.invalid += 1
        self.ratio = ratio


def status_of(app: str, seq: int, pid: int | None = None, ticks: int = 0) -> AppStatus:
    now = time.time()
    return AppStatus(pid or os.getpid(), app, AppState.RUNNING, DataRatio([1, 1, 1, 1], 4), 0, 10, 1, 100, 10, seq,
                     1.5, 0.1, 10.0, now, now, time.monotonic(), start_ticks=ticks)


def session_job(app: str, stop: str, out: str, ready: str = "", iteration: float = 0.03, per_epoch: int = 4) -> None:
    """A job training with the real ``Session`` (its DR on a ``RatioHolder``) until ``stop`` exists:
    an iteration of ``iteration`` seconds, a boundary every ``per_epoch``; the wall time of every
    step. ``ready`` is made once the session started."""
    from drbalance.client.session import Session

    model = RatioHolder()
    started = time.monotonic()
    session = Session(model, app, 1_000_000, per_epoch, solo_time=100.0, handle_sigterm=False)
    startup = time.monotonic() - started
    attached_at_start = session.attached
    if ready:
        Path(ready).touch()
    steps = []
    while not os.path.exists(stop):
        time.sleep(iteration)
        session.step()
        steps.append(time.time())
    session.close()
    Path(out).write_text(json.dumps({"startup_seconds": startup, "attached_at_start": attached_at_start,
                                     "steps": steps, "invalid_dr": model.invalid}))


def exchange_job(app: str, stop: str, out: str, pause: float, ready: str = "") -> None:
    """BOUNDARY notices through the real link (``AutoLink``: the system manager, else the user's
    own), ``pause`` seconds apart, until ``stop`` exists: per exchange its wall time, the seconds
    to the answer (None: none within the exchange timeout; -1: no manager) and from sending the
    notice to the manager's writing the answer (its wall clock: what the manager's turn added)."""
    from drbalance.ipc.system_link import AutoLink

    link = AutoLink(IpcNames.current(), app)
    pid, ticks = os.getpid(), process_start_ticks(os.getpid()) or 0
    exchanges, invalid, seq, longest, last = [], 0, 0, 0.0, time.monotonic()
    while not os.path.exists(stop):
        seq += 1
        link.publish(status_of(app, seq, pid, ticks))
        sent_wall, started = time.time(), time.perf_counter()
        beat = link.manager()
        notice = Notice(NoticeKind.BOUNDARY, pid, seq, app, time.time())
        if beat is not None and link.notify(notice, 0.25):
            command = link.await_command(seq, DEFAULT_EXCHANGE_TIMEOUT)
            exchanges.append((sent_wall, None, None) if command is None else
                             (sent_wall, time.perf_counter() - started, command.written_wall - notice.sent_wall))
            if command is not None and (len(command.ratio) != 4 or command.ratio.total not in (4, beat.dr_total)):
                invalid += 1  # a new DR comes at the manager's total, a kept one as the job has it
            if command is not None and ready and not os.path.exists(ready):
                Path(ready).touch()
        else:
            exchanges.append((sent_wall, -1, None))
            time.sleep(0.01)
        time.sleep(pause)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    problem = getattr(link, "problem", "")
    link.close()
    Path(out).write_text(json.dumps({"exchanges": exchanges, "invalid_dr": invalid, "longest_gap": longest,
                                     "problem": problem}))


def raw_connection() -> socket.socket:
    """A connection to the system manager of this process's namespace (the folder checked as a job does)."""
    place = system.find(os.environ["DRBALANCE_NAMESPACE"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.connect(str(place.socket))
    return sock


def answer_of(sock: socket.socket, timeout: float = 3.0) -> str:
    """The manager's next message, in words: its kind (and a refusal's text), ``closed`` or ``no answer``."""
    try:
        if not wire.wait_readable(sock, timeout):
            return "no answer"
        message = wire.receive(sock, ANSWERS, size=wire.MAX_REPLY)
    except (EOFError, ConnectionResetError):
        return "closed"
    if message is None:
        return "no answer"
    if message.kind == wire.Kind.REFUSED:
        code, text = wire.refusal(message.payload)
        return f"REFUSED ({code.name}): {text[:160]}"
    return message.kind.name


def attach(sock: socket.socket, app: str, record: AppRecord) -> str:
    """Pass ``record`` for ``app``; the manager's answer in words."""
    try:
        wire.send(sock, wire.Kind.ATTACH, wire.attach_payload(app), fds=(record.segment.memory.fd,), timeout=5)
    except OSError:  # a connection over her limit is closed at once
        return answer_of(sock, 0) if wire.wait_readable(sock, 0) else "closed"
    return answer_of(sock)


def hold_at(stage: str, app: str, ready: str) -> None:
    """Reach ``stage`` (``connected``, ``attached``, ``registered``), say so, then wait to be killed."""
    sock = raw_connection()
    record = AppRecord.create_sealed(app)
    if stage != "connected":
        answer = attach(sock, app, record)
        if answer != "WELCOME":
            raise RuntimeError(f"{app}: {answer}")
    if stage == "registered":
        record.write_status(status_of(app, 1))
        wire.send(sock, wire.Kind.NOTICE, Notice(NoticeKind.REGISTER, os.getpid(), 1, app, time.time()).encode(),
                  timeout=5)
        if answer_of(sock, 30) != "COMMAND":
            raise RuntimeError(f"{app}: no answer to its notice")
    Path(ready).touch()
    time.sleep(3600)


def fill_backlog(hold: str) -> None:
    """Connections without accepting (a stopped manager does not) until the backlog is full; held
    until ``hold`` exists; their count written to ``hold``'s ``.count`` file."""
    held = []
    for _ in range(10_000):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            sock.connect(str(system.find(os.environ["DRBALANCE_NAMESPACE"]).socket))
        except BlockingIOError:
            sock.close()
            break
        held.append(sock)
    Path(hold + ".count").write_text(str(len(held)))
    while not os.path.exists(hold):
        time.sleep(0.05)


# --- corrupt inputs -------------------------------------------------------------------------------
def memfd(size: int = SEGMENT_SIZE, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
          header: bytes | None = None) -> int:
    """A memfd of ``size`` bytes starting with ``header`` (default: a valid record's), with ``seals``."""
    fd = os.memfd_create("drbalance-record.forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if header is None:
        header = SEGMENT_HEADER.pack(SEGMENT_MAGIC, LAYOUT_VERSION, SegmentKind.APP, STATUS_OFFSET, COMMAND_OFFSET)
    os.pwrite(fd, header, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def record_descriptors(folder: str, foreign_fd: int) -> list[tuple[str, Callable[[], int]]]:
    """Descriptors passed as a record with ``ATTACH``, none of which a manager may map."""
    all_seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

    def regular_file() -> int:
        fd = os.open(os.path.join(folder, f"record-file-{os.getpid()}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, LAYOUT_VERSION, SegmentKind.APP, STATUS_OFFSET,
                                          COMMAND_OFFSET).ljust(SEGMENT_SIZE, b"\0"), 0)
        return fd

    def shm_object() -> int:
        path = f"/dev/shm/drbalance-campaign-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, SEGMENT_SIZE)
        os.unlink(path)
        return fd

    version = SEGMENT_HEADER.pack(SEGMENT_MAGIC, LAYOUT_VERSION + 1, SegmentKind.APP, STATUS_OFFSET, COMMAND_OFFSET)
    manager_kind = SEGMENT_HEADER.pack(SEGMENT_MAGIC, LAYOUT_VERSION, SegmentKind.MANAGER, STATUS_OFFSET,
                                       COMMAND_OFFSET)
    return [
        ("a regular file with a record's header", regular_file),
        ("a POSIX shared memory object of hers", shm_object),
        ("a pipe", lambda: os.pipe()[0]),
        ("a socket", lambda: socket.socketpair()[0].detach()),
        ("a folder", lambda: os.open(folder, os.O_RDONLY | os.O_DIRECTORY)),
        ("/dev/null", lambda: os.open("/dev/null", os.O_RDWR)),
        ("an eventfd", lambda: os.eventfd(0)),
        ("an unsealed memfd", lambda: memfd(seals=0)),
        ("a memfd sealed against shrinking only", lambda: memfd(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)),
        ("a sealed memfd of 4096 bytes", lambda: memfd(4096)),
        ("a sealed memfd of 16384 bytes", lambda: memfd(16384)),
        ("a memfd sealed against writing too", lambda: memfd(seals=all_seals | fcntl.F_SEAL_WRITE)),
        ("a sealed memfd never written (no header)", lambda: memfd(header=b"")),
        ("a sealed memfd of another layout version", lambda: memfd(header=version)),
        ("a sealed memfd with a manager's header", lambda: memfd(header=manager_kind)),
        ("another user's sealed memfd (root's)", lambda: os.dup(foreign_fd)),
    ]


def malformed_messages(pid: int) -> list[tuple[str, bytes, int]]:
    """(what, bytes, descriptors to pass) of messages the protocol does not allow."""
    header = wire.HEADER.pack
    notice = Notice(NoticeKind.BOUNDARY, pid, 1, "b-none", time.time()).encode()
    name = wire.attach_payload("b-malformed")

    def notice_with(**fields: Any) -> bytes:
        values = dict(magic=Notice.MAGIC, version=LAYOUT_VERSION, kind=2, pid=pid, name=b"b-none", sent=time.time())
        values.update(fields)
        return wire.encode(wire.Kind.NOTICE, Notice.STRUCT.pack(values["magic"], values["version"], values["kind"], 0,
                                                                values["pid"], 1, values["name"], values["sent"]))

    return [
        ("an empty message", b"", 0),
        ("3 bytes, shorter than the header", b"DRB", 0),
        ("bad magic", header(b"XXXX", LAYOUT_VERSION, 1, 0) + name, 1),
        ("another layout version", header(wire.MAGIC, LAYOUT_VERSION + 1, 2, 0) + notice, 0),
        ("unknown kind 77", header(wire.MAGIC, LAYOUT_VERSION, 77, 0), 0),
        ("a WELCOME sent to the manager", wire.encode(wire.Kind.WELCOME, wire.Welcome(pid, 4, 10, 1.0).encode()), 0),
        ("a REFUSED sent to the manager", wire.encode(wire.Kind.REFUSED, wire.refusal_payload(wire.Refusal.LIMIT, "x")),
         0),
        ("a COMMAND sent to the manager", wire.encode(wire.Kind.COMMAND, wire.COMMAND.pack(1)), 0),
        ("a STATUS_REPLY sent to the manager", wire.encode(wire.Kind.STATUS_REPLY, b"{}"), 0),
        ("ATTACH with a 47-byte name", wire.encode(wire.Kind.ATTACH, b"x" * 47), 1),
        ("ATTACH with a non-ASCII name", wire.encode(wire.Kind.ATTACH, "bé".encode().ljust(48, b"\0")), 1),
        ("ATTACH with an empty name", wire.encode(wire.Kind.ATTACH, b"\0" * 48), 1),
        ("ATTACH with control characters in the name", wire.encode(wire.Kind.ATTACH, b"a\x1b[2J".ljust(48, b"\0")), 1),
        ("ATTACH with a path as name", wire.encode(wire.Kind.ATTACH, b"../../etc/passwd".ljust(48, b"\0")), 1),
        ("ATTACH with no record", wire.encode(wire.Kind.ATTACH, name), 0),
        ("ATTACH with two records (more descriptors than allowed)", wire.encode(wire.Kind.ATTACH, name), 2),
        ("ATTACH with eight descriptors", wire.encode(wire.Kind.ATTACH, name), 8),
        ("NOTICE of 75 bytes", wire.encode(wire.Kind.NOTICE, notice[:75]), 0),
        ("NOTICE of 77 bytes", wire.encode(wire.Kind.NOTICE, notice + b"\0"), 0),
        ("NOTICE with bad magic", notice_with(magic=b"XXXX"), 0),
        ("NOTICE of another version", notice_with(version=LAYOUT_VERSION + 1), 0),
        ("NOTICE of kind 9", notice_with(kind=9), 0),
        ("NOTICE of pid 0", notice_with(pid=0), 0),
        ("NOTICE of pid -5", notice_with(pid=-5), 0),
        ("NOTICE sent at NaN", notice_with(sent=math.nan), 0),
        ("NOTICE sent at infinity", notice_with(sent=math.inf), 0),
        ("NOTICE of a non-ASCII app", notice_with(name="bé".encode()), 0),
        ("NOTICE before ATTACH", wire.encode(wire.Kind.NOTICE, notice), 0),
        ("NOTICE carrying a descriptor", wire.encode(wire.Kind.NOTICE, notice), 1),
        ("STATUS carrying a descriptor", wire.encode(wire.Kind.STATUS), 1),
        ("513 bytes (past MAX_REQUEST)", wire.encode(wire.Kind.STATUS, b"x" * (513 - wire.HEADER.size)), 0),
        ("64 KiB", wire.encode(wire.Kind.NOTICE, b"x" * 65536), 0),
        ("200 KB", wire.encode(wire.Kind.ATTACH, b"x" * 200_000), 1),
    ]


def send_raw(sock: socket.socket, data: bytes, fds: list[int]) -> str:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sock.sendmsg([data], ancillary)
    except OSError as error:
        return f"not sent ({type(error).__name__}: {error})"
    return ""


def corrupt_attacks(out: str, witness_pid: int, witness_app: str, foreign_fd: int, randoms: int,
                    rounds: int, seed: int) -> None:
    """User B's attacks over the socket; what the manager answered to each, as JSON in ``out``."""
    rng = random.Random(seed)
    folder = os.path.dirname(out)
    answers: dict[str, Any] = {}
    for what, data, count in malformed_messages(os.getpid()):
        fds = [memfd() for _ in range(count)]
        with contextlib.closing(raw_connection()) as sock:
            answers[what] = send_raw(sock, data, fds) or answer_of(sock)
        for fd in fds:
            os.close(fd)
    for what, make in record_descriptors(folder, foreign_fd):
        fd = make()
        with contextlib.closing(raw_connection()) as sock:
            answers[f"record: {what}"] = send_raw(sock, wire.encode(wire.Kind.ATTACH, wire.attach_payload("b-rec")),
                                                  [fd]) or answer_of(sock)
        os.close(fd)
    answers.update(forged(witness_pid, witness_app))
    answers["random bytes"] = random_messages(rng, randoms)
    answers["mutated notices of an attached job"] = mutated_notices(rng, randoms)
    answers["her own record corrupted while attached"] = corrupted_record(rng, rounds)
    Path(out).write_text(json.dumps(answers))


def forged(witness_pid: int, witness_app: str) -> dict[str, str]:
    """An attached job of hers sends notices, or writes a record, naming another process or app."""
    me = os.getpid()
    ticks = process_start_ticks(me) or 0
    cases = {
        "notice naming user A's job's pid": dict(notice_pid=witness_pid),
        "notice naming pid 1": dict(notice_pid=1),
        "notice naming user A's app": dict(notice_app=witness_app),
        "notice naming an app nobody runs": dict(notice_app="nobody-runs-this"),
        "record naming user A's job's pid": dict(record_pid=witness_pid),
        "record naming her pid with another start time": dict(record_ticks=ticks + 7),
        "record naming user A's app": dict(record_app=witness_app),
    }
    answers = {}
    for index, (what, case) in enumerate(cases.items()):
        app = f"b-forge{index}"
        record = AppRecord.create_sealed(app)
        with contextlib.closing(raw_connection()) as sock:
            if attach(sock, app, record) != "WELCOME":
                answers[what] = "her attach was refused"
                continue
            status = status_of(case.get("record_app", app), 1, case.get("record_pid", me), case.get("record_ticks", 0))
            record.status_area.write(status.encode())
            notice = Notice(NoticeKind.REGISTER, case.get("notice_pid", me), 1, case.get("notice_app", app),
                            time.time())
            wire.send(sock, wire.Kind.NOTICE, notice.encode(), timeout=5)
            answers[what] = answer_of(sock)
        record.close()
    return answers


def random_messages(rng: random.Random, count: int) -> dict:
    """``count`` messages of random bytes on one connection (kept open by the manager)."""
    answers: collections.Counter = collections.Counter()
    sent = 0
    sock = raw_connection()
    for index in range(count):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600)))
        if index % 3 == 0:  # a valid header now and then, so the payload's checks are reached
            data = wire.HEADER.pack(wire.MAGIC, LAYOUT_VERSION, rng.choice((1, 2, 3)), 0) + data
        if not send_raw(sock, data, []):
            sent += 1
        while wire.wait_readable(sock, 0):
            answers[answer_of(sock, 0).split(":")[0]] += 1
    time.sleep(0.5)
    while wire.wait_readable(sock, 0.2):
        answers[answer_of(sock, 0).split(":")[0]] += 1
    sock.close()
    return {"sent": sent, "answers": dict(answers)}


def mutated_notices(rng: random.Random, count: int) -> dict:
    """An attached job of hers sends valid notices with 1-5 random bytes changed."""
    app = "b-mutant"
    record = AppRecord.create_sealed(app)
    sock = raw_connection()
    answers: collections.Counter = collections.Counter()
    if attach(sock, app, record) != "WELCOME":
        return {"attached": False}
    record.write_status(status_of(app, 1))
    for seq in range(1, count + 1):
        data = bytearray(Notice(NoticeKind.BOUNDARY, os.getpid(), seq, app, time.time()).encode())
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        wire.send(sock, wire.Kind.NOTICE, bytes(data), timeout=1)
        time.sleep(0.025)  # within the notices allowed per second
        while wire.wait_readable(sock, 0):
            answers[answer_of(sock, 0).split(":")[0]] += 1
    sock.close()
    record.close()
    return {"sent": count, "answers": dict(answers)}


def corrupt_bytes(rng: random.Random, record: AppRecord) -> str:
    """Random bytes somewhere in her own record: the header, the status area (counter, CRC,
    payload) or the command area."""
    offset = rng.choice([rng.randrange(0, SEGMENT_HEADER.size), STATUS_OFFSET + rng.randrange(0, AREA_HEADER.size),
                         STATUS_OFFSET + AREA_HEADER.size + rng.randrange(0, 900),
                         COMMAND_OFFSET + rng.randrange(0, 100)])
    data = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 64])))
    record.segment.mapping[offset:offset + len(data)] = data
    return f"{len(data)} bytes at {offset}"


def corrupted_record(rng: random.Random, rounds: int) -> dict:
    """Her attached job corrupts its own record at random, then sends a notice: every command the
    manager signals must read back as a valid DR (the manager keeps her last valid status)."""
    app = "b-corrupt"
    record = AppRecord.create_sealed(app)
    sock = raw_connection()
    if attach(sock, app, record) != "WELCOME":
        return {"attached": False}
    record.write_status(status_of(app, 1))
    commands = invalid = 0
    answers: collections.Counter = collections.Counter()
    for seq in range(1, rounds + 1):
        corrupt_bytes(rng, record)
        if rng.random() < 0.5:
            record.write_status(status_of(app, seq))  # a valid status again, now and then
        wire.send(sock, wire.Kind.NOTICE, Notice(NoticeKind.BOUNDARY, os.getpid(), seq, app, time.time()).encode(),
                  timeout=1)
        answer = answer_of(sock, 2.0)
        answers[answer.split(":")[0]] += 1
        if answer == "COMMAND":
            commands += 1
            try:
                command = record.read_command()
                if command is None or len(command.ratio) != 4 or command.ratio.total not in (4, 10):
                    invalid += 1
            except Exception:  # a command the manager wrote must read back
                invalid += 1
        time.sleep(0.03)
    sock.close()
    record.close()
    return {"rounds": rounds, "commands_signalled": commands, "invalid_commands_read": invalid,
            "answers": dict(answers)}


# --- floods ---------------------------------------------------------------------------------------
def until(stop: str) -> Iterator[int]:
    count = 0
    while not os.path.exists(stop):
        yield count
        count += 1


def drain(sock: socket.socket, answers: collections.Counter | None = None) -> bool:
    """Read what the manager sent (never waits); False once it closed the connection."""
    while wire.wait_readable(sock, 0):
        answer = answer_of(sock, 0)
        if answer == "closed":
            return False
        if answers is not None:
            answers[answer.split(":")[0]] += 1
    return True


def flood_notices(app: str, stop: str, out: str) -> None:
    """An attached job of hers sending notices as fast as the socket takes them."""
    record = AppRecord.create_sealed(app)
    sock = raw_connection()
    attach(sock, app, record)
    record.write_status(status_of(app, 1))
    sent, answers = 0, collections.Counter()
    for seq in until(stop):
        try:
            if wire.send(sock, wire.Kind.NOTICE, Notice(NoticeKind.BOUNDARY, os.getpid(), seq + 1, app,
                                                        time.time()).encode(), timeout=0.01):
                sent += 1
        except OSError:
            break
        drain(sock, answers)
    Path(out).write_text(json.dumps({"sent": sent, "answers": dict(answers)}))


def flood_connections(stop: str, out: str) -> None:
    """Connections opened until refused, closed, opened again."""
    opened = 0
    for _ in until(stop):
        held = []
        for _ in range(200):
            try:
                held.append(raw_connection())
            except OSError:
                break
        opened += len(held)
        for sock in held:
            sock.close()
    Path(out).write_text(json.dumps({"opened": opened}))


def flood_registrations(stop: str, out: str, prefix: str, keep: int = 70) -> None:
    """ATTACH after ATTACH, each a new job name on a new connection with a new record; the last
    ``keep`` connections held open."""
    held: collections.deque = collections.deque()
    answers: collections.Counter = collections.Counter()
    for index in until(stop):
        try:
            sock = raw_connection()
        except OSError:
            answers["connect failed"] += 1
            continue
        record = AppRecord.create_sealed(f"{prefix}{index}")
        answers[attach(sock, f"{prefix}{index}", record).split(":")[0]] += 1
        held.append((sock, record))
        if len(held) > keep:
            old, old_record = held.popleft()
            old.close()
            old_record.close()
    for sock, record in held:
        sock.close()
        record.close()
    Path(out).write_text(json.dumps({"registrations": sum(answers.values()), "answers": dict(answers)}))


def flood_status(stop: str, out: str) -> None:
    """Status requests back to back (a connection closed after 5 s unattached is opened again)."""
    replies = 0
    sock = raw_connection()
    for _ in until(stop):
        try:
            wire.send(sock, wire.Kind.STATUS, timeout=0.5)
            answer = answer_of(sock, 1.0)
        except OSError:
            answer = "closed"
        if answer == "STATUS_REPLY":
            replies += 1
        elif answer == "closed":
            sock.close()
            sock = raw_connection()
    sock.close()
    Path(out).write_text(json.dumps({"status_replies": replies}))


def flood_garbage(stop: str, out: str, seed: int) -> None:
    """Random bytes as messages back to back."""
    rng = random.Random(seed)
    sent = 0
    sock = raw_connection()
    for index in until(stop):
        data = rng.randbytes(rng.randrange(1, 600))
        if index % 2:
            data = wire.HEADER.pack(wire.MAGIC, LAYOUT_VERSION, rng.choice((1, 2, 3)), 0) + data
        if not send_raw(sock, data, []):
            sent += 1
        if not drain(sock):
            sock.close()
            sock = raw_connection()
    sock.close()
    Path(out).write_text(json.dumps({"sent": sent}))


def busy_records(stop: str, out: str, count: int) -> None:
    """``count`` attached jobs of hers whose records are kept mid-write: each status seqlock counter
    odd, and changing, so a reader never sees it settle."""
    jobs = []
    for index in range(count):
        app = f"b-busy{index}"
        record = AppRecord.create_sealed(app)
        sock = raw_connection()
        attach(sock, app, record)
        record.write_status(status_of(app, 1))
        wire.send(sock, wire.Kind.NOTICE, Notice(NoticeKind.REGISTER, os.getpid(), 1, app, time.time()).encode(),
                  timeout=5)
        answer_of(sock, 10)
        jobs.append((sock, record))
    passes = 0
    area = [(record.status_area.words, record.status_area.counter_index) for _, record in jobs]
    while not os.path.exists(stop):
        passes += 1
        for words, index in area:
            words[index] = (2 * passes + 1) & 0xFFFFFFFF
        time.sleep(0.0002)
    for sock, record in jobs:
        sock.close()
        record.close()
    Path(out).write_text(json.dumps({"jobs": count, "counter_changes": passes}))


FLOODS: dict[str, Callable[[str, str, int], list[tuple[Callable[..., None], tuple]]]] = {
    "quiet": lambda stop, out, size: [],
    "notices": lambda stop, out, size: [(flood_notices, (f"b-flood{i}", stop, f"{out}{i}")) for i in range(4)],
    "connections": lambda stop, out, size: [(flood_connections, (stop, f"{out}{i}")) for i in range(2)],
    "registrations": lambda stop, out, size: [(flood_registrations, (stop, f"{out}{i}", f"reg{i}-")) for i in range(2)],
    "status requests": lambda stop, out, size: [(flood_status, (stop, f"{out}{i}")) for i in range(4)],
    "random bytes": lambda stop, out, size: [(flood_garbage, (stop, f"{out}{i}", i)) for i in range(2)],
    "records kept mid-write": lambda stop, out, size: [(busy_records, (stop, f"{out}0", size))],
}


# --- a hostile second user ------------------------------------------------------------------------
def plant(system_dir: str, namespace: str, own_file: str, out: str) -> None:
    """Everything she tries in the system folder; each result (``done`` or the error's class)."""
    folder = os.path.join(system_dir, namespace)
    sock_path = os.path.join(folder, system.SOCKET_NAME)

    def bind() -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(os.path.join(folder, "x.sock"))
        finally:
            listener.close()

    actions = {
        "write a file in the namespace folder": lambda: Path(folder, "manager.sock.x").write_text("x"),
        "make a symbolic link there": lambda: os.symlink("/tmp", os.path.join(folder, "link")),
        "make a hard link to her file there": lambda: os.link(own_file, os.path.join(folder, "hard")),
        "make a folder there": lambda: os.mkdir(os.path.join(folder, "d")),
        "make a FIFO there": lambda: os.mkfifo(os.path.join(folder, "fifo")),
        "bind a socket there": bind,
        "replace manager.sock with her file": lambda: os.rename(own_file, sock_path),
        "remove manager.sock": lambda: os.unlink(sock_path),
        "remove manager.lock": lambda: os.unlink(os.path.join(folder, system.LOCK_NAME)),
        "open manager.lock for writing": lambda: os.close(os.open(os.path.join(folder, system.LOCK_NAME),
                                                                  os.O_WRONLY)),
        "change manager.sock's times": lambda: os.utime(sock_path),
        "change the folder's mode": lambda: os.chmod(folder, 0o777),
        "make another namespace's folder in the system dir": lambda: os.mkdir(os.path.join(system_dir, "default")),
        "rename the namespace folder": lambda: os.rename(folder, folder + ".old"),
    }
    results = {}
    for what, action in actions.items():
        try:
            action()
            results[what] = "done"
        except OSError as error:
            results[what] = type(error).__name__
    Path(out).write_text(json.dumps(results))


def look_alike(folder: str, namespace: str, link: str, seconds: float, out: str) -> None:
    """Her own system dir in /tmp (``folder``, with a listener that welcomes anyone) and her link to
    it (``link``); how many connections her listener got in ``seconds``."""
    os.makedirs(os.path.join(folder, namespace))
    os.chmod(folder, 0o755)
    os.chmod(os.path.join(folder, namespace), 0o755)
    os.symlink(folder, link)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(os.path.join(folder, namespace, system.SOCKET_NAME))
    os.chmod(os.path.join(folder, namespace, system.SOCKET_NAME), 0o666)
    listener.listen(16)
    listener.settimeout(0.1)
    accepted, end = 0, time.monotonic() + seconds
    Path(out + ".ready").touch()
    while time.monotonic() < end:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        accepted += 1
        with contextlib.suppress(OSError):
            wire.send(sock, wire.Kind.WELCOME, wire.Welcome(os.getpid(), 4, 10, time.time()).encode())
        sock.close()
    Path(out).write_text(json.dumps({"accepted": accepted}))


def idle_connections(count: int, status_first: bool, out: str) -> None:
    """``count`` connections that send nothing (or one status request, then nothing): seconds
    until the manager closed each."""
    opened = []
    for _ in range(count):
        sock = raw_connection()
        if status_first:
            wire.send(sock, wire.Kind.STATUS, timeout=5)
            answer_of(sock, 5)
        opened.append((sock, time.monotonic()))
    closed = []
    for sock, started in opened:
        deadline = started + 60
        while time.monotonic() < deadline:
            if wire.wait_readable(sock, max(0.0, deadline - time.monotonic())) and answer_of(sock, 0) == "closed":
                closed.append(time.monotonic() - started)
                break
        sock.close()
    Path(out).write_text(json.dumps({"opened": count, "closed_after_seconds": closed}))


def name_held(out: str, shared_app: str) -> None:
    """An ATTACH for a name another of her connections holds; and one for a name a job of user A holds."""
    record = AppRecord.create_sealed("b-dup")
    first = raw_connection()
    results = {"first ATTACH of b-dup": attach(first, "b-dup", record)}
    second, other = raw_connection(), AppRecord.create_sealed("b-dup")
    results["second ATTACH of b-dup on another connection"] = attach(second, "b-dup", other)
    record.write_status(status_of("b-dup", 1))
    wire.send(first, wire.Kind.NOTICE, Notice(NoticeKind.REGISTER, os.getpid(), 1, "b-dup", time.time()).encode(),
              timeout=5)
    results["the first connection's notice afterwards"] = answer_of(first, 10)
    third, shared = raw_connection(), AppRecord.create_sealed(shared_app)
    results[f"ATTACH of {shared_app}, the name of user A's job"] = attach(third, shared_app, shared)
    for sock in (first, second, third):
        sock.close()
    Path(out).write_text(json.dumps(results))
