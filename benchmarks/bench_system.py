"""A system manager under a flood from one user: how long another user's notices wait for their answer.

One system manager (``drbalance-manager --system``, the paper's policy on a scripted utilisation,
as in ``bench_protocol``) serves two users. User A (uid 4201) runs one job and times its
boundary exchanges: from the notice to the new DR set on the model. User B (uid 4202) floods in
the ``flood`` rounds: several jobs each sending notices as fast as its socket takes them, and a
process opening connections until refused, again and again. Rounds alternate, quiet and flood,
so drift on a busy machine hits both alike. Target: A's p99 under the flood at most 10 ms.

Needs root (the two users are uids set in forked children). Writes
``benchmarks/results/system_flood.json``.

    python -m benchmarks.bench_system [--exchanges 200] [--rounds 5] [--flood-jobs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import add_no_write, save, summary
from drbalance import DataRatio
from drbalance.argtypes import positive_int
from drbalance.jsonlog import read_json_lines

USER_A, USER_B = 4201, 4202
NAMESPACE = "bench-system"
NICE = -10  # docs/operations.md: the system unit's Nice=, so a user's busy processes do not delay its turns


class RatioHolder:
    """Stands in for BalancedDataParallel: the session only reads and sets the DR."""

    def __init__(self) -> None:
        self.ratio = DataRatio([1, 1, 1, 1], 4)

    def set_ratio(self, ratio: DataRatio) -> None:
        self.ratio = ratio


def fork_as(uid: int, function, *args) -> int:
    """A forked child running ``function(*args)`` as ``uid``; its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            function(*args)
            code = 0
        except BaseException:  # the parent sees the status; the reason goes to stderr
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return pid


def measure(exchanges: int, out: str, ready: str, pause: float) -> None:
    """User A: one job's boundary exchanges, ``pause`` seconds apart; per exchange the seconds from
    its notice to the new DR set on the model (``exchange``) and from the notice's sending to the
    manager's writing the answer (``answer``: what the manager's queue and turn add), as JSON in ``out``."""
    from drbalance.client.session import Session
    from drbalance.ipc.layout import NoticeKind

    session = Session(RatioHolder(), "a-timed", 1, exchanges * 4, solo_time=100.0, sd_log=False, handle_sigterm=False)
    if not session.attached:
        raise RuntimeError("user A's job did not attach to the system manager")
    Path(ready).touch()
    exchange, answer, late = [], [], 0
    for _ in range(exchanges):
        session.tracker.iteration_finished(session.clock.monotonic())
        started = time.perf_counter()
        session._exchange(NoticeKind.BOUNDARY, session.clock.monotonic())
        exchange.append(time.perf_counter() - started)
        command = session.link.poll_command(session.notice_seq)
        if session.applied_generation != session.notice_seq or command is None:
            late += 1
        else:
            answer.append(command.written_wall - session._awaiting_sent)
        time.sleep(pause)
    session.close()
    Path(out).write_text(json.dumps({"exchange": exchange, "answer": answer, "late": late}))


def flood_notices(index: int, stop: str, out: str) -> None:
    """User B: one job's notices as fast as the socket takes them, until ``stop`` exists."""
    import socket

    from drbalance.ipc import system, wire
    from drbalance.ipc.layout import AppState, AppStatus, Notice, NoticeKind
    from drbalance.ipc.records import AppRecord

    app = f"b-flood{index}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(system.find(NAMESPACE).socket))
    record = AppRecord.create_sealed(app)
    wire.send(sock, wire.Kind.ATTACH, wire.attach_payload(app), fds=(record.segment.memory.fd,), timeout=5)
    now = time.time()
    record.write_status(AppStatus(os.getpid(), app, AppState.RUNNING, DataRatio([1, 1, 1, 1], 4), 0, 1, 1, 1000,
                                  1000, 1, 2.0, 0.1, 1.0, now, now, time.monotonic()))
    sent = 0
    while not os.path.exists(stop):
        sent += 1
        notice = Notice(NoticeKind.BOUNDARY, os.getpid(), sent, app, time.time())
        try:
            wire.send(sock, wire.Kind.NOTICE, notice.encode(), timeout=0.01)
        except OSError:
            break
        _drain(sock)
    sock.close()
    record.close()
    Path(out).write_text(json.dumps({"sent": sent}))


def flood_connections(stop: str, out: str) -> None:
    """User B: connections opened until refused, closed, opened again, until ``stop`` exists."""
    import socket

    from drbalance.ipc import system

    place = system.find(NAMESPACE)
    opened = 0
    while not os.path.exists(stop):
        held = []
        for _ in range(200):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(str(place.socket))
            except OSError:
                sock.close()
                break
            held.append(sock)
            opened += 1
        for sock in held:
            sock.close()
    Path(out).write_text(json.dumps({"opened": opened}))


def _drain(sock) -> None:
    """Read what the manager sent (its answers and refusals), never waiting."""
    from drbalance.ipc import wire

    while wire.wait_readable(sock, 0):
        try:
            if wire.receive(sock, frozenset(wire.Kind)) is None:
                return
        except (EOFError, wire.WireError, OSError):
            return


def run_round(scratch: Path, exchanges: int, flood_jobs: int, flooding: bool, number: int, pause: float) -> dict:
    out, ready, stop = scratch / f"a{number}.json", scratch / f"ready{number}", scratch / f"stop{number}"
    floods = []
    if flooding:
        for index in range(flood_jobs):
            floods.append((fork_as(USER_B, flood_notices, index, str(stop), str(scratch / f"b{number}-{index}.json")),
                           scratch / f"b{number}-{index}.json"))
        floods.append((fork_as(USER_B, flood_connections, str(stop), str(scratch / f"c{number}.json")),
                       scratch / f"c{number}.json"))
        time.sleep(1.0)  # the flood under way before A starts
    started = time.time()
    timed = fork_as(USER_A, measure, exchanges, str(out), str(ready), pause)
    _, status = os.waitpid(timed, 0)
    stop.touch()
    flooded = {}
    for pid, path in floods:
        os.waitpid(pid, 0)
        if path.exists():
            for key, value in json.loads(path.read_text()).items():
                flooded[key] = flooded.get(key, 0) + value
    if status != 0 or not out.exists():
        raise RuntimeError(f"user A's timing process failed (wait status {status})")
    return {"flood": flooding, **json.loads(out.read_text()), "flooded": flooded, "window": (started, time.time())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exchanges", type=positive_int, default=200, help="user A's timed exchanges per round")
    parser.add_argument("--rounds", type=positive_int, default=5, help="quiet and flood rounds each (interleaved)")
    parser.add_argument("--flood-jobs", type=positive_int, default=4, help="user B's jobs sending notices")
    parser.add_argument("--pause", type=float, default=0.05,
                        help="seconds between user A's exchanges (20 a second: within the per-user limit of 50)")
    parser.add_argument("--nice", type=int, default=NICE,
                        help="the system manager's nice value, as its systemd unit sets it (Nice=)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root: the two users are uids taken by forked children")
    # everything the children import, imported here: a child of another uid cannot read /root (mode
    # 0700), where this Python's standard library lives
    import socket  # noqa: F401
    import traceback  # noqa: F401

    import drbalance.client.session  # noqa: F401
    import drbalance.ipc.records  # noqa: F401
    root = Path(__file__).resolve().parent.parent
    base = Path(tempfile.mkdtemp(prefix="drbalance-bench-system-"))
    os.chmod(base, 0o755)
    util = base / "util.json"
    util.write_text(json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [40, 50, 60, 70]}]}))
    os.environ.update({"DRBALANCE_SYSTEM_DIR": str(base / "system"), "DRBALANCE_NAMESPACE": NAMESPACE,
                       "DRBALANCE_NO_MANAGER": ""})
    scratch = base / "scratch"
    scratch.mkdir(mode=0o1777)
    os.chmod(scratch, 0o1777)
    manager = subprocess.Popen(
        ["nice", "-n", str(args.nice), sys.executable, "-m", "drbalance.manager.cli", "--system", "--namespace",
         NAMESPACE, "--source", f"scripted:{util}", "--policy", "paper", "--log", str(base / "manager.jsonl")],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rounds = []
    try:
        deadline = time.monotonic() + 30
        while not (base / "system" / NAMESPACE / "manager.sock").exists():
            if manager.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the system manager did not start: {manager.stderr.read()}")
            time.sleep(0.05)
        for number in range(args.rounds * 2):
            rounds.append(run_round(scratch, args.exchanges, args.flood_jobs, number % 2 == 1, number, args.pause))
            print(f"round {number + 1}/{args.rounds * 2} ({'flood' if number % 2 else 'quiet'}) done", flush=True)
    finally:
        manager.send_signal(signal.SIGTERM)
        manager.wait(timeout=60)
        decisions = [e for e in read_json_lines(base / "manager.jsonl")
                     if e.get("event") == "decision" and e.get("app") == f"{USER_A}:a-timed"]
        shutil.rmtree(base, ignore_errors=True)
    for chosen in rounds:
        low, high = chosen["window"]
        chosen["queued"] = [e["queued_us"] * 1e-6 for e in decisions if low <= e["t"] <= high and "queued_us" in e]
    payload = {"args": vars(args), "user_b_per_round": [r["flooded"] for r in rounds if r["flood"]]}
    for label, flooding in (("quiet", False), ("flood", True)):
        chosen = [r for r in rounds if r["flood"] == flooding]
        payload[label] = {"exchange_seconds": summary([v for r in chosen for v in r["exchange"]]),
                          "answer_seconds": summary([v for r in chosen for v in r["answer"]]),
                          "queued_seconds": summary([v for r in chosen for v in r["queued"]]),
                          "late": sum(r["late"] for r in chosen)}
    for what in ("exchange_seconds", "answer_seconds", "queued_seconds"):
        payload[f"{what}_p99_ratio_flood_to_quiet"] = payload["flood"][what]["p99"] / payload["quiet"][what]["p99"]
    for label in ("quiet", "flood"):
        e, a, q = (payload[label][key] for key in ("exchange_seconds", "answer_seconds", "queued_seconds"))
        print(f"user A, {label}: exchange median {e['median'] * 1e3:.3f} ms p99 {e['p99'] * 1e3:.3f} ms; "
              f"answer written median {a['median'] * 1e3:.3f} ms p99 {a['p99'] * 1e3:.3f} ms; "
              f"in the manager's queue median {q['median'] * 1e3:.3f} ms p99 {q['p99'] * 1e3:.3f} ms; "
              f"late {payload[label]['late']}")
    print(f"target: user A's p99 under the flood at most 10 ms; user B per flood round: {payload['user_b_per_round']}")
    save("system_flood", "benchmarks.bench_system", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
