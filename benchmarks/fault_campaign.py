"""Fault campaign: real processes and real IPC, attacked and broken on purpose.

Sections (each a dict in the result):
1. ``kill9``: jobs killed with SIGKILL at several points of their life (right after creating its
   name claim, before writing it; idle after a report; during the first status write; in the
   middle of notice exchanges; a real torch training job) while a manager runs; and jobs killed
   while no manager runs, collected by the next one. Times from the kill until the job's objects
   and claim are gone; leaks afterwards.
2. ``manager_kill9``: the manager killed under exchanging jobs: how long a job waits at most,
   and how fast a restarted manager adopts every job.
3. ``flood``: N jobs sending notices back to back for S seconds: sent, answered, latency.
4. ``corrupt``: random corruption of live jobs' records, well-formed records naming another pid
   or process start time, and random inbox messages while a job exchanges: the manager's
   survival, what it logged, that every DR it sent was valid, and that no live job's objects went.
5. ``neighbour``: a real second user (needs root) squatting and opening our names, planting
   objects, swapping the log folder for a link, holding --metrics-port connections open.
6. ``filesystem``: runtime directory removed, status file replaced by a folder, a full disk (a
   512 KiB tmpfs when mounting is allowed; else a file-size limit), segments truncated.
7. ``system``: the machine's system manager (``drbalance-manager --system``) with real jobs of two
   real users: jobs and the manager killed or stopped, corrupt inputs over its socket, a second
   user's floods and tricks (``benchmarks/fault_system.py``; needs root).

Usage: python -m benchmarks.fault_campaign [--quick] [--only SECTIONS] [--no-write | --out PATH]
Writes benchmarks/results/fault_campaign.json; docs/reliability.md summarises it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.fault_system import campaign_system
from benchmarks.timing import add_no_write, save, scratch_namespace, summary
from drbalance import DataRatio
from drbalance.ipc import discovery, objects
from drbalance.ipc.layout import (
    AREA_HEADER,
    COMMAND_OFFSET,
    SEGMENT_SIZE,
    STATUS_OFFSET,
    AppState,
    AppStatus,
    Notice,
    NoticeKind,
)
from drbalance.ipc.link import DEFAULT_EXCHANGE_TIMEOUT, PosixManagerLink
from drbalance.ipc.names import SHM_DIR, IpcNames, new_token
from drbalance.ipc.private import UnsafePath
from drbalance.ipc.records import AppRecord
from drbalance.jsonlog import JsonLinesWriter, read_json_lines
from tests.helpers.connections import HeldConnections
from tests.helpers.disk import fill_up, mount_small_tmpfs

ROOT = Path(__file__).resolve().parent.parent


# --- processes --------------------------------------------------------------------------------
def python(module: str, *args: str, out: Path | None = None, **popen: Any) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(popen.pop("env", {}))
    stdout = open(out, "w") if out else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=stdout,
                            stderr=subprocess.STDOUT if out else subprocess.DEVNULL, text=True, **popen)


class Manager:
    def __init__(self, scratch: Path, label: str, *extra: str, env: dict | None = None) -> None:
        util = scratch / "util.json"
        util.write_text(json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}))
        self.log = scratch / f"{label}.jsonl"
        self.out = scratch / f"{label}.out"
        args = ["--source", f"scripted:{util}", "--sample-period", "0.1", *extra]
        if "--log" not in extra:
            args += ["--log", str(self.log)]
        self.process = python("drbalance.manager.cli", *args, out=self.out, env=env or {})
        self.names = IpcNames.current()

    def ready(self, timeout: float = 60.0) -> None:
        wait(lambda: self.names.manager_status().exists() or self.process.poll() is not None, timeout)
        if self.process.poll() is not None:
            raise RuntimeError(f"manager exited: {self.out.read_text()}")

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.log.exists():
            return []
        return [e for e in read_json_lines(self.log) if kind is None or e["event"] == kind]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def wait(predicate, timeout: float = 60.0, interval: float = 0.005) -> float:
    """Seconds until ``predicate()`` is true; TimeoutError after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def idle_job(name: str, *flags: str) -> tuple[subprocess.Popen, str]:
    process = python("tests.helpers.idle_app", name, *flags)
    ready, token = process.stdout.readline().split()
    return process, token


def kill9(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()


def gone(names: IpcNames, app: str) -> bool:
    return app not in names.listed_apps() and app not in names.listed_signals() and not names.app_claim(app).exists()


def leaks(names: IpcNames) -> list[str]:
    """Everything of this user in this namespace still in /dev/shm or the claims folder."""
    me = os.geteuid()
    found = [o.entry for o in names.listed() if o.owner == me]
    claims = names.claims_dir()
    return found + ([f"claim:{c}" for c in os.listdir(claims)] if claims.exists() else [])


# --- the exchanging job (run as a child: --role exchanger NAME SECONDS OUT) --------------------------
def exchanger(name: str, seconds: float, out: str, pause: float = 0.0) -> None:
    """Sends BOUNDARY notices through the real link (back to back, or ``pause`` s apart); writes its
    figures as JSON."""
    names = IpcNames.current()
    link = PosixManagerLink(names, name)
    pid, ticks = os.getpid(), objects.process_start_ticks(os.getpid()) or 0
    ratio = DataRatio([1, 1, 1, 1], 4)
    latencies, invalid, sent, answered, seq = [], 0, 0, 0, 0
    longest, last = 0.0, time.monotonic()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seq += 1
        now = time.monotonic()
        link.publish(AppStatus(pid, name, AppState.RUNNING, ratio, 0, 10, 1, 100, 10, seq, 1.5, 0.1, 10.0,
                               time.time(), time.time(), now, start_ticks=ticks))
        started = time.perf_counter()
        if link.manager() is not None and link.notify(Notice(NoticeKind.BOUNDARY, pid, seq, name, time.time()), 0.25):
            sent += 1
            command = link.await_command(seq, DEFAULT_EXCHANGE_TIMEOUT)  # what a Session waits
            if command is not None:
                answered += 1
                latencies.append(time.perf_counter() - started)
                if len(command.ratio) != 4 or command.ratio.total not in (4, 10):
                    invalid += 1
        else:
            time.sleep(0.01)
        time.sleep(pause)
        longest = max(longest, time.monotonic() - last)
        last = time.monotonic()
    link.close()
    Path(out).write_text(json.dumps({"sent": sent, "answered": answered, "invalid_dr": invalid,
                                     "latencies": latencies, "longest_gap": longest}))


# --- 1. kill -9 points ----------------------------------------------------------------------------
def campaign_kill9(scratch: Path, repeats: int) -> dict:
    names = IpcNames.current()
    manager = Manager(scratch, "kill9")
    manager.ready()
    times: dict[str, list[float]] = {"right after creating its claim": [], "idle after a report": [],
                                      "during its first status write": [], "mid-exchange": [],
                                      "torch training job (Session)": []}
    points = (("right after creating its claim", ("--empty-claim",)), ("idle after a report", ()),
              ("during its first status write", ("--half",)))
    try:
        for index in range(repeats):
            for point, (label, flags) in enumerate(points):
                name = f"k{index}p{point}"
                process, _ = idle_job(name, *flags)
                time.sleep(random.uniform(0.0, 0.5))
                kill9(process)
                times[label].append(wait(lambda n=name: gone(names, n)))
            name = f"k{index}x"
            process = python("benchmarks.fault_campaign", "--role", "exchanger", name, "600", str(scratch / "x.json"))
            wait(lambda n=name: n in names.listed_apps())
            time.sleep(random.uniform(0.2, 1.0))  # somewhere inside its stream of exchanges
            kill9(process)
            times["mid-exchange"].append(wait(lambda n=name: gone(names, n)))
        for index in range(max(1, repeats // 4)):
            name = f"torch{index}"
            job = python("tests.helpers.toy_app", "--app", name, "--epochs", "100", "--iterations", "3",
                         "--sleep", "0.02")
            job.stdout.readline()
            time.sleep(random.uniform(0.1, 0.6))
            kill9(job)
            times["torch training job (Session)"].append(wait(lambda n=name: gone(names, n)))
        alive = manager.alive()
    finally:
        manager.stop()
    # killed while no manager runs: the next manager's first rescan collects them
    for index in range(repeats):
        process, _ = idle_job(f"orphan{index}", *(("--half",) if index % 2 else ()))
        kill9(process)
    restarted = Manager(scratch, "kill9-restart")
    started = time.monotonic()
    restarted.ready()
    orphans = wait(lambda: not [a for a in names.listed_apps() if a.startswith("orphan")])
    total = time.monotonic() - started
    restarted.stop()
    return {
        "collection_seconds": {label: summary(values) for label, values in times.items() if values},
        "manager_alive_throughout": alive,
        "killed_without_a_manager": {"jobs": repeats, "collected_after_manager_start_seconds": total,
                                     "after_ready_seconds": orphans},
        "leaks_after": leaks(names),
    }


# --- 2. the manager killed ----------------------------------------------------------------------
def campaign_manager_kill9(scratch: Path, jobs: int) -> dict:
    names = IpcNames.current()
    first = Manager(scratch, "mk-first")
    first.ready()
    outputs = [scratch / f"mk{i}.json" for i in range(jobs)]
    processes = [python("benchmarks.fault_campaign", "--role", "exchanger", f"mk{i}", "14", str(out))
                 for i, out in enumerate(outputs)]
    try:
        wait(lambda: len(first.events("app_added")) >= jobs)
        time.sleep(2.0)
        kill9(first.process)
        time.sleep(2.0)  # jobs train on without a manager
        started = time.monotonic()
        second = Manager(scratch, "mk-second")
        second.ready()
        wait(lambda: len({e["app"] for e in second.events("app_added")}) >= jobs)
        adopted = time.monotonic() - started
        for process in processes:
            process.wait(timeout=120)
        second.stop()
    finally:
        for process in processes:
            kill9(process)
    results = [json.loads(out.read_text()) for out in outputs]
    return {"jobs": jobs, "longest_gap_between_exchanges_seconds": max(r["longest_gap"] for r in results),
            "restarted_manager_adopted_all_seconds": adopted,
            "answered_after_restart": all(r["answered"] > 0 for r in results), "leaks_after": leaks(names)}


# --- 3. flood ----------------------------------------------------------------------------------
def campaign_flood(scratch: Path, jobs: int, seconds: float) -> dict:
    names = IpcNames.current()
    manager = Manager(scratch, "flood", "--policy", "observe")
    manager.ready()
    outputs = [scratch / f"flood{i}.json" for i in range(jobs)]
    processes = [python("benchmarks.fault_campaign", "--role", "exchanger", f"f{i}", str(seconds), str(out))
                 for i, out in enumerate(outputs)]
    try:
        for process in processes:
            process.wait(timeout=seconds + 120)
        alive = manager.alive()
    finally:
        for process in processes:
            kill9(process)
        manager.stop()
    results = [json.loads(out.read_text()) for out in outputs]
    latencies = [value for r in results for value in r["latencies"]]
    return {"jobs": jobs, "seconds": seconds, "sent": sum(r["sent"] for r in results),
            "answered": sum(r["answered"] for r in results), "invalid_dr": sum(r["invalid_dr"] for r in results),
            "answer_latency_seconds": summary(latencies) if latencies else None, "manager_alive": alive,
            "leaks_after": leaks(names)}


# --- 4. corrupt inputs ------------------------------------------------------------------------------
def corrupt_segment(path: Path, rng: random.Random) -> str:
    """One random corruption of a record file; returns what was done."""
    choice = rng.randrange(5)
    try:
        with open(path, "r+b") as segment:
            if choice == 0:
                size = rng.choice([0, 8, 100, STATUS_OFFSET + 10, COMMAND_OFFSET, SEGMENT_SIZE - 1])
                segment.truncate(size)
                return f"truncated to {size}"
            offset = rng.choice([rng.randrange(0, 16), STATUS_OFFSET + rng.randrange(0, AREA_HEADER.size),
                                 STATUS_OFFSET + AREA_HEADER.size + rng.randrange(0, 900),
                                 COMMAND_OFFSET + rng.randrange(0, 100)])
            segment.seek(offset)
            data = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 64])))
            segment.write(data)
            return f"{len(data)} random bytes at {offset}"
    except OSError as error:
        return f"skipped ({error})"


def forge_status(names: IpcNames, app: str, token: str, dead_pid: bool) -> str:
    """Write a well-formed status (seqlock and CRC right) that names another process into a live
    job's record: a dead pid, or the job's pid with another start time; returns which."""
    record = AppRecord.open(names, app, token)
    try:
        status = record.read_status()
        if dead_pid:
            gone = subprocess.Popen(["true"])
            gone.wait()
            record.write_status(dataclasses.replace(status, pid=gone.pid))
            return "a dead pid"
        record.write_status(dataclasses.replace(status, start_ticks=status.start_ticks + 7))
        return "another start time"
    finally:
        record.close()


def random_message(rng: random.Random) -> bytes:
    valid = Notice(NoticeKind.BOUNDARY, os.getpid(), rng.randrange(1 << 40), "ghost", time.time()).encode()
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 128)))
    if kind == 1:
        mutated = bytearray(valid)
        for _ in range(rng.randrange(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        return bytes(mutated)
    if kind == 2:
        return valid[: rng.randrange(len(valid))]
    return valid  # a well-formed notice for an app that does not exist


def campaign_corrupt(scratch: Path, records: int, messages: int, seed: int = 10) -> dict:
    rng = random.Random(seed)
    names = IpcNames.current()
    manager = Manager(scratch, "corrupt")
    manager.ready()
    witness = python("benchmarks.fault_campaign", "--role", "exchanger", "witness", "600",
                     str(scratch / "witness.json"))
    victims, done = [], []
    try:
        wait(lambda: "witness" in names.listed_apps())
        inbox = objects.open_queue(names.inbox(discovery.read_manager(names).inbox))
        for index in range(records):
            if index % 5 == 0:
                victims.append(idle_job(f"v{index}"))
            process, token = victims[-1]
            app = f"v{index - index % 5}"
            path = SHM_DIR / names.app_record(app, token).lstrip("/")
            done.append(corrupt_segment(path, rng))
            time.sleep(0.02)
        forged = []
        for index in range(max(2, records // 10)):  # live jobs whose records then name another process
            victims.append(idle_job(f"w{index}"))
            forged.append(forge_status(names, f"w{index}", victims[-1][1], index % 2 == 0))
        sent = 0
        for _ in range(messages):
            try:
                inbox.send(random_message(rng), timeout=1.0)
                sent += 1
            except Exception:
                pass
        inbox.close()
        time.sleep(3.0)  # a rescan or two over the corrupted records
        alive = manager.alive()
        answered_before = len([e for e in manager.events("decision") if e["app"] == "witness"])
        time.sleep(1.0)
        still_answering = len([e for e in manager.events("decision") if e["app"] == "witness"]) > answered_before
    finally:
        killed_wall = time.time()  # every app_removed of a victim before this removed a live job's objects
        kill9(witness)
        for process, _ in victims:
            kill9(process)
        try:  # the manager collects every killed job, corrupted record or not
            collected = wait(lambda: not names.listed_apps() and not discovery.claimed_apps(names), 60)
        except TimeoutError:
            collected = None
        manager.stop()
    decisions = manager.events("decision")
    bad = [d for d in decisions if len(d["new_dr"]) != 4 or sum(d["new_dr"]) != d["dr_total"]]
    removed_alive = [e for e in manager.events("app_removed") if e["app"][0] in "vw" and e["t"] < killed_wall]
    return {"records_corrupted": len(done), "well_formed_records_naming_another_process": forged,
            "messages_sent": sent, "manager_alive": alive,
            "still_answering_a_good_job": still_answering, "decisions": len(decisions), "bad_dr_sent": len(bad),
            "invalid_logged": len(manager.events("invalid")), "live_records_removed": len(removed_alive),
            "examples": done[:8], "all_killed_jobs_collected_after_seconds": collected, "leaks_after": leaks(names)}


# --- 5. neighbours ---------------------------------------------------------------------------------
def campaign_neighbour(scratch: Path) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root to act as a second user"}
    from tests.helpers.neighbour import as_neighbour, second_user

    names = IpcNames.current()
    uid, _, who = second_user()
    outcomes: dict[str, Any] = {"second_user": who}
    guess = new_token()
    planted = [names.prefix + "inbox", names.prefix + "manager", names.prefix + "app.victim",
               names.prefix + "sig.victim", names.prefix + f"app.victim.{guess}", names.prefix + f"manager.{guess}"]
    as_neighbour([["shm", n, 0o666] for n in planted] + [["mq", names.prefix + "inbox", 0o666]])
    manager = Manager(scratch, "neighbour")
    try:
        manager.ready()
        outcomes["manager starts despite squatted inbox/heartbeat/record names"] = manager.alive()
        job = python("tests.helpers.toy_app", "--app", "victim", "--epochs", "40", "--iterations", "3",
                     "--sleep", "0.02")
        first = json.loads(job.stdout.readline())
        outcomes["job with a squatted record name attaches"] = first["attached"]
        info = discovery.read_manager(names)
        token = info.token
        late = as_neighbour([["shm", names.prefix + "app.x", 0o666], ["shm", names.manager_record(token), 0o666],
                             ["open_shm", names.manager_record(token)], ["send_mq", names.inbox(info.inbox)],
                             ["open_sem", names.app_signal("victim", discovery.read_claim(names, "victim").signal)]])
        time.sleep(2.5)
        outcomes["manager alive after app.x planted while running"] = manager.alive()
        outcomes["neighbour creates a name we hold"] = late[1]
        outcomes["neighbour opens our heartbeat"] = late[2]
        outcomes["neighbour sends a notice to our inbox"] = late[3]
        outcomes["neighbour opens a job's semaphore"] = late[4]
        out, _ = job.communicate(timeout=300)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        outcomes["job attached to the end"] = all(line.get("attached", True) for line in lines)
        foreign = manager.events("foreign")
        outcomes["foreign objects reported (name, owner)"] = sorted({(e["object"], e["owner"]) for e in foreign})
    finally:
        manager.stop()
        objects.unlink_queue(names.prefix + "inbox")
    target = scratch / "target"
    target.mkdir(mode=0o755)
    link = Path(f"/tmp/drbalance-campaign-{secrets.token_hex(4)}")
    as_neighbour([["symlink", str(target), str(link)]])
    try:
        refused = Manager(scratch, "symlinked", env={"DRBALANCE_RUNTIME_DIR": str(link)})
        code = refused.process.wait(timeout=60)
        outcomes["runtime dir = a neighbour's symlink"] = {
            "exit": code, "message": refused.out.read_text().strip().splitlines()[-1],
            "target_mode": oct(target.stat().st_mode & 0o7777), "files_written_in_target": len(list(target.iterdir()))}
    finally:
        link.unlink()
    outcomes["log folder swapped with her link in a loop"] = swapped_log_folder(scratch)
    outcomes["connections held open to --metrics-port"] = held_metrics_connections(scratch)
    outcomes["leaks_after"] = leaks(names)
    for listed in names.listed():  # the neighbour's objects (root may remove them)
        if listed.entry.startswith("sem."):
            objects.unlink_semaphore("/" + listed.entry[4:])
        else:
            objects.unlink_shared_memory("/" + listed.entry)
    return outcomes


def swapped_log_folder(scratch: Path, seconds: float = 10.0) -> dict:
    """A log folder in the neighbour's group-writable (setgid) folder, which she exchanges with her
    symbolic link to a root-only folder in a loop (renameat2 RENAME_EXCHANGE), removing the
    manager's log every 0.5 s, for ``seconds``: a manager runs with its log there meanwhile, and
    SD logs are opened there one after the other. Files that reached the root-only folder, opens
    done and refused."""
    from tests.helpers.neighbour import swapped_folder

    target = scratch / "root-only"
    target.mkdir(mode=0o700)
    opened = refused = 0
    with swapped_folder(target, "manager.jsonl") as (logs, swaps):
        manager, refused_starts = start_through_swaps(scratch, logs / "manager.jsonl")
        try:
            started, attempt = time.monotonic(), 0
            while time.monotonic() - started < seconds:
                attempt += 1
                try:
                    writer = JsonLinesWriter(logs / "job.sd.jsonl")
                    writer.write({"attempt": attempt})
                    writer.close()
                    opened += 1
                except UnsafePath:
                    refused += 1
            manager_alive = manager.alive()
        finally:
            manager.stop()
    return {"neighbour": swaps[0] if swaps else "did not run", "manager_starts_refused": refused_starts,
            "opened": opened, "refused": refused, "manager_alive": manager_alive,
            "manager_log_reopened": manager.out.read_text().count("was removed or replaced"),
            "files_in_root_only_folder": sorted(os.listdir(target))}


def start_through_swaps(scratch: Path, log: Path, tries: int = 50) -> tuple[Manager, int]:
    """A manager logging to ``log`` while a folder on its way is swapped with a link: a start that
    meets the link is refused (exit 1, "symbolic link owned by"), so start again; the manager that
    started and how many starts were refused."""
    for refused in range(tries):
        manager = Manager(scratch, f"swapped{refused}", "--log", str(log))
        try:
            manager.ready()
            return manager, refused
        except RuntimeError as error:
            if "symbolic link owned by" not in str(error):
                raise
    raise RuntimeError(f"no manager started in {tries} tries")


def held_metrics_connections(scratch: Path, held: int = 50, scrapes: int = 20) -> dict:
    """``held`` connections to a manager's --metrics-port, each opened again as soon as it is
    closed, while ``scrapes`` scrapes are made one after the other: how many were answered."""
    manager = Manager(scratch, "metrics", "--metrics-port", "0")
    manager.ready()
    url = json.loads(manager.names.manager_status().read_text())["metrics"]
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    answered, seconds = 0, []
    try:
        with HeldConnections(host, int(port), held) as holder:
            for _ in range(scrapes):  # over about 10 s: past REQUEST_SECONDS, the held ones are closed, opened again
                time.sleep(0.5)
                started = time.monotonic()
                try:
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        answered += reply.status == 200 and b"drbalance_apps" in reply.read()
                except OSError:
                    pass
                seconds.append(time.monotonic() - started)
    finally:
        manager.stop()
    return {"held": held, "scrapes": scrapes, "answered": answered, "reopened_by_the_holder": holder.reopened,
            "scrape_seconds": summary(seconds)}


# --- 6. file-system faults --------------------------------------------------------------------------
def campaign_filesystem(scratch: Path) -> dict:
    names = IpcNames.current()
    results: dict[str, Any] = {}
    manager = Manager(scratch, "fs")
    manager.ready()
    job = python("benchmarks.fault_campaign", "--role", "exchanger", "fsjob", "600", str(scratch / "fs.json"))
    try:
        wait(lambda: "fsjob" in names.listed_apps())
        remove_tree(names.runtime_dir().parent)
        results["runtime dir removed: manager.json and lock restored after (s)"] = wait(
            lambda: names.manager_info().exists(), 30)
        results["runtime dir removed: job's claim restored after (s)"] = wait(
            lambda: names.app_claim("fsjob").exists(), 30)
        status = names.manager_status()
        wait(lambda: status.exists(), 30)
        status.unlink()
        status.mkdir()
        wait(lambda: [e for e in manager.events("fault") if e["task"] == "status"], 30)
        status.rmdir()
        results["status file replaced by a folder: recovered after the folder went (s)"] = wait(
            lambda: status.is_file(), 30)
        token = discovery.read_manager(names).token
        os.truncate(SHM_DIR / names.manager_record(token).lstrip("/"), 0)
        results["heartbeat truncated to 0 bytes: repaired after (s)"] = wait(
            lambda: (SHM_DIR / names.manager_record(token).lstrip("/")).stat().st_size > 0, 30)
        record = SHM_DIR / names.app_record("fsjob", discovery.read_claim(names, "fsjob").token).lstrip("/")
        os.truncate(record, 0)
        results["job record truncated to 0 bytes: repaired by the job after (s)"] = wait(
            lambda: record.stat().st_size > 0, 30)
        soft, hard = resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE, (manager.log.stat().st_size, hard))
        time.sleep(3.0)
        resource.prlimit(manager.process.pid, resource.RLIMIT_FSIZE, (soft, hard))
        wait(lambda: "the manager log works again" in manager.out.read_text(), 30)
        results["file-size limit on the log for 3 s (EFBIG): manager alive"] = manager.alive()
        results["manager alive after all faults"] = manager.alive()
    finally:
        kill9(job)
        try:
            wait(lambda: gone(names, "fsjob"), 30)
        except TimeoutError:
            pass
        manager.stop()
    events = manager.events()
    results["decisions in log == decisions counted at stop (nothing lost)"] = (
        len([e for e in events if e["event"] == "decision"]) == events[-1].get("decisions"))
    results["tracebacks on stderr"] = manager.out.read_text().count("Traceback")
    results["full disk (tmpfs)"] = full_disk(scratch)
    results["leaks_after"] = leaks(names)
    return results


def remove_tree(path: Path, tries: int = 50) -> None:
    """``rm -rf path``, again while a process that writes there (the manager's status file) makes a
    new file in it meanwhile ("Directory not empty")."""
    for _ in range(tries - 1):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            continue
    shutil.rmtree(path)


def full_disk(scratch: Path) -> dict:
    small = scratch / "small"
    if not mount_small_tmpfs(small):
        return {"skipped": "mounting a tmpfs is not permitted here"}
    env = {"DRBALANCE_RUNTIME_DIR": str(small / "run")}
    os.environ.update(env)
    try:
        manager = Manager(scratch, "disk", "--log", str(small / "manager.jsonl"), env=env)
        manager.log = small / "manager.jsonl"
        manager.ready()
        job = python("benchmarks.fault_campaign", "--role", "paced", "diskjob", "12", str(scratch / "disk.json"))
        wait(lambda: "diskjob" in IpcNames.current().listed_apps())
        fill_up(small / "filler")
        time.sleep(4.0)
        alive = manager.alive()
        (small / "filler").unlink()
        job.wait(timeout=120)
        manager.stop()
        events = manager.events()
        answered = json.loads((scratch / "disk.json").read_text())
        return {"manager_alive_while_full": alive, "job_sent": answered["sent"], "job_answered": answered["answered"],
                "decisions_logged": len([e for e in events if e["event"] == "decision"]),
                "decisions_counted": events[-1].get("decisions"), "log_gap_records": len(
                    [e for e in events if e["event"] == "log_gap"])}
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
        os.environ["DRBALANCE_RUNTIME_DIR"] = str(scratch / "run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter floods")
    parser.add_argument("--role", nargs=4, metavar=("ROLE", "NAME", "SECONDS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--only", default=None, help="comma-separated sections to run")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the whole result to this file instead of benchmarks/results/")
    add_no_write(parser)
    args = parser.parse_args(argv)
    if args.role:
        exchanger(args.role[1], float(args.role[2]), args.role[3], pause=0.05 if args.role[0] == "paced" else 0.0)
        return 0
    repeats, flood_jobs, flood_seconds = (4, 8, 5.0) if args.quick else (12, 32, 20.0)
    sections = {
        "kill9": lambda s: campaign_kill9(s, repeats),
        "manager_kill9": lambda s: campaign_manager_kill9(s, 8),
        "flood": lambda s: campaign_flood(s, flood_jobs, flood_seconds),
        "corrupt": lambda s: campaign_corrupt(s, 60 if args.quick else 200, 60 if args.quick else 200),
        "neighbour": campaign_neighbour,
        "filesystem": campaign_filesystem,
        "system": lambda s: campaign_system(s, args.quick),
    }
    chosen = args.only.split(",") if args.only else list(sections)
    result: dict[str, Any] = {"cores": os.cpu_count(), "load_before": os.getloadavg()}
    for name in chosen:
        with scratch_namespace(f"fc{name[:4]}") as scratch:
            started = time.monotonic()
            print(f"{name} ...", flush=True)
            result[name] = sections[name](scratch)
            result[name]["section_seconds"] = round(time.monotonic() - started, 1)
            print(json.dumps(result[name], indent=1, default=str)[:3000], flush=True)
    result["load_after"] = os.getloadavg()
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    save("fault_campaign", "benchmarks.fault_campaign", argv, result, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
