"""The fault campaign's section ``system``: the machine's system manager attacked and broken.

``python -m benchmarks.fault_campaign --only system`` (``--quick``: fewer repeats, shorter phases).
The system manager (``drbalance-manager --system``) runs as a real process as its systemd unit
runs it (``Nice=-10``), as root, and where its identity matters as a dedicated service user with
no capability (uid 4200). Its jobs are real processes of two real users (uids 4201 and 4202):
forked from this process, which drops to the user's uid (they run the real ``Session``,
``AutoLink`` and socket code), and torch training jobs started with ``setpriv``.

1. ``job_kill9``: jobs killed with SIGKILL at points of their life with the system manager
   (connected, attached, registered, in a stream of exchanges, a torch training job): time until
   the manager dropped them (its descriptors closed: the connection, the record, the pidfd) and
   leaks (descriptors, the per-user limits, the folder).
2. ``manager_kill9``: the system manager killed under training jobs of two users: the longest
   step of a job, how fast a restarted manager has every job attached again, its stale socket
   replaced.
3. ``manager_sigstop``: the system manager stopped (SIGSTOP) for a few seconds: the jobs train on
   (bounded waits), new jobs start meanwhile (one after another user filled the socket's
   backlog), and every job is answered again after SIGCONT.
4. ``corrupt``: malformed messages of every kind, random bytes, descriptors where none belong,
   huge messages, records that are not sealed memfds, a record corrupted at random while
   attached, notices and records naming another process or app: the manager stays up, logs
   ``invalid``, sends no invalid DR, removes no live job, writes no traceback.
5. ``flood``: a second user's floods (notices, connections, thousands of registrations, status
   requests, random bytes, records kept mid-write) while a first user's job exchanges: its
   answers (count, latency) in each phase; the limits' refusals logged once per user and reason.
6. ``hostile``: a second user plants files and links in the system folder, builds a look-alike
   system dir in /tmp, holds connections that send nothing, attaches a name she already holds.

Needs root (other uids); skipped with the reason otherwise. What the users' processes run:
``fault_system_users.py``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.fault_system_users import (
    FLOODS,
    corrupt_attacks,
    exchange_job,
    fill_backlog,
    hold_at,
    idle_connections,
    look_alike,
    memfd,
    name_held,
    plant,
    session_job,
)
from benchmarks.timing import summary
from drbalance.ipc import system
from drbalance.ipc.names import SHM_DIR
from drbalance.ipc.peer import peer_of

ROOT = Path(__file__).resolve().parent.parent
NICE = -10  # docs/operations.md: the system unit's Nice=
USER_A, USER_B, SERVICE_UID = 4201, 4202, 4200  # as tests/helpers/system.py


# --- waiting and reading --------------------------------------------------------------------------
def wait(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.005) -> float:
    """Seconds until ``predicate()`` is true; TimeoutError after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


class LogTail:
    """A JSON Lines log read as it grows (each call reads only what was appended)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict] = []
        self._offset = 0
        self._rest = b""

    def update(self) -> list[dict]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.events.append(record)
        return self.events

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.update() if e.get("event") == kind]


# --- the system manager as a process --------------------------------------------------------------
class SystemManager:
    """``drbalance-manager --system`` at ``Nice=-10``, as root (``uid`` None) or as ``uid``."""

    def __init__(self, lab: Lab, label: str, system_dir: Path, namespace: str, uid: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.label, self.uid, self.namespace = label, uid, namespace
        self.system_dir = system_dir
        self.folder = system_dir / namespace
        self.log_path = lab.log_dir(uid) / f"{label}.jsonl"
        self.err_path = lab.base / f"{label}.err"
        command = [sys.executable, "-m", "drbalance.manager.cli", "--system", "--namespace", namespace,
                   "--source", f"scripted:{lab.util}", "--sample-period", "0.1", "--log", str(self.log_path), *extra]
        if uid is not None:
            command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]
        env = dict(os.environ, DRBALANCE_SYSTEM_DIR=str(system_dir), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(self.err_path, "w") as err:
            self.process = subprocess.Popen(["nice", "-n", str(NICE), *command], cwd=ROOT, env=env,
                                            stdout=subprocess.DEVNULL, stderr=err)
        self.launched = time.time()
        self.log = LogTail(self.log_path)
        self.baseline_fds = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self, timeout: float = 120.0) -> float:
        """Wait until it listens (its ``start`` record); its descriptors counted then. Seconds waited."""
        waited = wait(lambda: self.log.of("start") or self.process.poll() is not None, timeout, 0.02)
        if self.process.poll() is not None:
            raise RuntimeError(f"system manager {self.label} exited: {self.stderr()[-2000:]}")
        time.sleep(0.3)
        self.baseline_fds = self.fds()
        return waited

    def fds(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return -1

    def alive(self) -> bool:
        return self.process.poll() is None

    def capabilities(self) -> str:
        """Its effective capabilities (``CapEff`` of /proc/<pid>/status)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return line.split()[1]
        return "?"

    def decided(self, app_key: str, after: float = 0.0) -> list[dict]:
        return [e for e in self.log.of("decision") if e["app"] == app_key and e["t"] >= after]

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def kill9(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)

    def outcome(self) -> dict:
        """What every run reports: decisions, bad DRs sent, faults, tracebacks."""
        events = self.log.update()
        decisions = [e for e in events if e.get("event") == "decision"]
        return {"decisions": len(decisions), "bad_dr_sent": len(bad_decisions(decisions)),
                "faults": [e["task"] + ": " + e["error"] for e in events if e.get("event") == "fault"],
                "tracebacks_on_stderr": self.stderr().count("Traceback")}


def bad_decisions(decisions: list[dict]) -> list[dict]:
    return [d for d in decisions if len(d["new_dr"]) != 4 or sum(d["new_dr"]) != d["dr_total"]]


# --- the lab: folders, users ----------------------------------------------------------------------
class Lab:
    """The section's folder in /tmp (root's, 0755), the users' homes, the managers' logs."""

    def __init__(self, base: Path) -> None:
        self.base = base
        os.chmod(base, 0o755)
        self.util = base / "util.json"
        self.util.write_text(json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}))
        os.chmod(self.util, 0o644)
        self.namespaces: set[str] = set()  # the users' jobs' (for leftovers)
        self.outputs = base / "out"
        self.outputs.mkdir()
        os.chmod(self.outputs, 0o1777)
        for uid in (None, SERVICE_UID):
            folder = self.log_dir(uid)
            folder.mkdir(mode=0o700)
            if uid is not None:
                os.chown(folder, uid, uid)
        for uid in (USER_A, USER_B):
            for folder in (self.home(uid), self.home(uid) / "run", self.home(uid) / "logs"):
                folder.mkdir()
                os.chown(folder, uid, uid)
                os.chmod(folder, 0o700)

    def log_dir(self, uid: int | None) -> Path:
        return self.base / ("logs" if uid is None else f"logs-{uid}")

    def home(self, uid: int) -> Path:
        return self.base / f"home-{uid}"

    def out(self, name: str) -> Path:
        return self.outputs / name

    def system_dir(self, label: str, owner: int | None = None) -> Path:
        """A system dir (root's, or given to ``owner`` by root, as systemd's RuntimeDirectory= does)."""
        folder = self.base / f"sys-{label}"
        folder.mkdir(mode=0o755)
        if owner is not None:
            os.chown(folder, owner, owner)
        return folder

    def user_env(self, uid: int, system_dir: Path, namespace: str) -> dict[str, str]:
        self.namespaces.add(namespace)
        home = self.home(uid)
        return {"HOME": str(home), "DRBALANCE_RUNTIME_DIR": str(home / "run"), "DRBALANCE_LOG_DIR": str(home / "logs"),
                "DRBALANCE_SYSTEM_DIR": str(system_dir), "DRBALANCE_NAMESPACE": namespace,
                "DRBALANCE_PROFILES": str(home / "profiles.json"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                "PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def sd_log(self, uid: int, app: str) -> list[dict]:
        path = self.home(uid) / "logs" / f"{app}.sd.jsonl"
        return LogTail(path).update() if path.exists() else []

    def leftovers(self) -> list[str]:
        """The users' objects of this section's namespaces in /dev/shm, their claims."""
        prefixes = tuple(f"{kind}drb.{uid}.{namespace}." for kind in ("", "sem.") for uid in (USER_A, USER_B)
                         for namespace in self.namespaces)
        found = [entry for entry in os.listdir(SHM_DIR) if entry.startswith(prefixes)]
        for uid in (USER_A, USER_B):
            for claims in (self.home(uid) / "run").glob("*/apps"):
                found += [f"{uid}:claim:{c.name}" for c in claims.iterdir()]
        return found


class UserProcess:
    """``function(*args)`` in a child forked from this process that drops to ``uid`` (its own
    group, no others) with ``env`` as its environment; its output and errors go to ``log``."""

    def __init__(self, uid: int, env: dict[str, str], log: Path, function: Callable[..., Any], *args: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the campaign
            code = 1
            try:
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.environ.clear()
                os.environ.update(env)
                random.seed()
                function(*args)
                code = 0
            except BaseException:  # the campaign reads the log
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(out)
        self.pid, self.log, self.returncode = pid, log, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 120.0) -> int:
        wait(lambda: self.poll() is not None, timeout, 0.02)
        return self.returncode

    def kill9(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)


# --- 1. jobs killed -------------------------------------------------------------------------------
KILL_POINTS = ("connected, before attaching", "attached, before its first notice", "registered, idle",
               "in a stream of exchanges", "a torch training job (Session)")


def job_kill9(lab: Lab, identity: str, repeats: int, torch_jobs: int) -> dict:
    """Jobs of both users killed at each point; seconds from the kill until the manager holds
    nothing of the job (its descriptors back to what it held before). ``identity``: the manager
    runs as ``root`` or as the ``service`` user."""
    uid = None if identity == "root" else SERVICE_UID
    namespace = f"k{identity}"
    manager = SystemManager(lab, f"kill-{identity}", lab.system_dir(f"kill-{identity}", uid), namespace, uid,
                            ("--max-jobs-per-user", "2", "--max-connections-per-user", "4"))
    manager.ready()
    times: dict[str, list[float]] = {point: [] for point in KILL_POINTS}
    reasons: list[str] = []
    try:
        for index in range(repeats):
            for point in KILL_POINTS[:4]:
                user = (USER_A, USER_B)[index % 2]
                app = f"k{index}{KILL_POINTS.index(point)}"
                process = start_to_kill(lab, manager, user, app, point)
                time.sleep(random.uniform(0.0, 0.3) if point != KILL_POINTS[3] else random.uniform(0.2, 1.0))
                times[point].append(kill_and_time(manager, process.kill9))
        for index in range(torch_jobs if identity == "root" else 0):
            app = f"torch{index}"
            job = torch_job(lab, USER_B, manager, app, "--epochs", "1000", "--iterations", "3", "--sleep", "0.02")
            job.stdout.readline()
            wait(lambda a=app: manager.decided(f"{USER_B}:{a}"), 120)
            time.sleep(random.uniform(0.1, 0.6))
            times[KILL_POINTS[4]].append(kill_and_time(manager, lambda j=job: (j.kill(), j.wait())))
        reasons = sorted({e["reason"] for e in manager.log.of("app_removed")})
        freed = limits_freed(lab, manager)
        alive = manager.alive()
        capabilities = manager.capabilities()
    finally:
        fds_after = manager.fds() - manager.baseline_fds
        code = manager.stop()
    return {"manager": identity, "capabilities": capabilities,
            "seconds_until_dropped": {p: summary(v) for p, v in times.items() if v},
            "app_removed_reasons": reasons, "manager_alive_throughout": alive,
            "descriptors_left_over": fds_after, "limits_freed (2 jobs of each user attach, limit 2)": freed,
            "exit_status": code, **manager.outcome()}


def start_to_kill(lab: Lab, manager: SystemManager, user: int, app: str, point: str) -> UserProcess:
    """A job of ``user`` that has reached ``point`` (waited for)."""
    env = lab.user_env(user, manager.system_dir, manager.namespace)
    ready = lab.out(f"{manager.label}-{app}.ready")
    if point == KILL_POINTS[3]:
        process = UserProcess(user, env, lab.out(f"{manager.label}-{app}.log"), exchange_job, app,
                              str(lab.out("never")), str(lab.out(f"{app}.json")), 0.02, str(ready))
    else:
        stage = {KILL_POINTS[0]: "connected", KILL_POINTS[1]: "attached", KILL_POINTS[2]: "registered"}[point]
        process = UserProcess(user, env, lab.out(f"{manager.label}-{app}.log"), hold_at, stage, app, str(ready))
    try:
        wait(lambda: ready.exists() or process.poll() is not None, 120)
    except TimeoutError:
        process.kill9()
        raise
    if process.poll() is not None:
        raise RuntimeError(f"job {app} failed: {process.log.read_text()[-2000:]}")
    if point == KILL_POINTS[0]:  # accepted: the manager holds the connection
        wait(lambda: manager.fds() > manager.baseline_fds, 30)
    return process


def kill_and_time(manager: SystemManager, kill: Callable[[], Any]) -> float:
    """Seconds from sending SIGKILL until the manager's descriptors are back to what it held before."""
    started = time.monotonic()
    kill()
    wait(lambda: manager.fds() <= manager.baseline_fds, 60)
    return time.monotonic() - started


def limits_freed(lab: Lab, manager: SystemManager) -> bool:
    """Whether two jobs of each user attach now (the manager's limit: 2 jobs, 4 connections a user)."""
    processes = []
    try:
        for user in (USER_A, USER_B):
            for index in range(2):
                ready = lab.out(f"{manager.label}-free{user}{index}.ready")
                processes.append((UserProcess(user, lab.user_env(user, manager.system_dir, manager.namespace),
                                              lab.out(f"{manager.label}-free{user}{index}.log"), hold_at, "attached",
                                              f"free{index}", str(ready)), ready))
        wait(lambda: all(r.exists() or p.poll() is not None for p, r in processes), 120)
        return all(r.exists() for _, r in processes)
    finally:
        for process, _ in processes:
            process.kill9()
        wait(lambda: manager.fds() <= manager.baseline_fds, 60)


def torch_job(lab: Lab, user: int, manager: SystemManager | None, app: str, *args: str,
              system_dir: Path | None = None, namespace: str | None = None) -> subprocess.Popen:
    """The toy torch training job (tests/helpers/toy_app.py) as ``user``, through ``setpriv``."""
    env = lab.user_env(user, system_dir or manager.system_dir, namespace or manager.namespace)
    command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", sys.executable, "-m",
               "tests.helpers.toy_app", "--app", app, *args]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# --- 2. the system manager killed -----------------------------------------------------------------
def training_jobs(lab: Lab, manager: SystemManager, per_user: int, label: str) -> list[tuple[int, str, UserProcess]]:
    """``per_user`` Session jobs of each user, until ``<label>.stop`` exists."""
    jobs = []
    for user in (USER_A, USER_B):
        for index in range(per_user):
            app = f"{label}{'ab'[user - USER_A]}{index}"
            jobs.append((user, app, UserProcess(user, lab.user_env(user, manager.system_dir, manager.namespace),
                                                lab.out(f"{app}.log"), session_job, app, str(lab.out(f"{label}.stop")),
                                                str(lab.out(f"{app}.json")))))
    return jobs


def finish_jobs(lab: Lab, label: str, jobs: list[tuple[int, str, UserProcess]]) -> list[dict]:
    lab.out(f"{label}.stop").touch()
    results = []
    for user, app, process in jobs:
        code = process.wait(120)
        if code != 0:
            raise RuntimeError(f"job {app} failed: {process.log.read_text()[-2000:]}")
        results.append({"user": user, "app": app, **json.loads(lab.out(f"{app}.json").read_text()),
                        "sd_log": lab.sd_log(user, app)})
    return results


def longest_step(steps: list[float], low: float = 0.0, high: float = math.inf) -> float:
    """The longest time between two steps that ended in [low, high]."""
    chosen = [t for t in steps if low <= t <= high]
    return max((b - a for a, b in zip(chosen, chosen[1:])), default=0.0)


def manager_kill9(lab: Lab, identity: str, per_user: int) -> dict:
    uid = None if identity == "root" else SERVICE_UID
    label = f"mk{identity}"
    system_dir = lab.system_dir(label, uid)
    first = SystemManager(lab, f"{label}-first", system_dir, label, uid)
    first.ready()
    jobs = training_jobs(lab, first, per_user, label)
    second = None
    try:
        keys = [f"{user}:{app}" for user, app, _ in jobs]
        wait(lambda: all(first.decided(key) for key in keys), 180, 0.1)
        time.sleep(2.0)
        killed = time.time()
        first.kill9()
        stale = (first.folder / system.SOCKET_NAME).exists()
        refused = connect_error(first.folder / system.SOCKET_NAME)
        time.sleep(2.0)  # the jobs train on alone
        second = SystemManager(lab, f"{label}-second", system_dir, label, uid)
        second.ready()
        restarted = second.log.of("start")[0]["t"]
        wait(lambda: all(second.decided(key) for key in keys), 120, 0.05)
        reattached = max(second.decided(key)[0]["t"] for key in keys)
        listener = listener_pid(second.folder / system.SOCKET_NAME)
        time.sleep(2.0)
        results = finish_jobs(lab, label, jobs)
        time.sleep(1.5)
        fds_after = second.fds() - first.baseline_fds  # its own count at start had the jobs attaching again
        capabilities = second.capabilities()
    finally:
        lab.out(f"{label}.stop").touch()
        for _, _, process in jobs:
            process.kill9()
        first.kill9()
        code = second.stop() if second is not None else None
    return {"manager": identity, "capabilities": capabilities, "jobs": len(jobs), "users": 2,
            "longest_step_seconds": max(longest_step(r["steps"]) for r in results),
            "longest_step_while_no_manager_seconds": max(longest_step(r["steps"], killed, restarted) for r in results),
            "every_job_trained_while_no_manager": all(
                any(killed < t < restarted for t in r["steps"]) for r in results),
            "socket_left_by_the_killed_manager": stale, "connect_while_dead": refused,
            "socket_listened_by_the_restarted_manager": listener == second.pid,
            "restarted_manager_listening_after_launch_seconds": restarted - second.launched,
            "every_job_attached_again_after_it_listened_seconds": reattached - restarted,
            "detached_events": sum(1 for r in results for e in r["sd_log"] if e["event"] == "detached"),
            "invalid_dr_applied": sum(r["invalid_dr"] for r in results), "descriptors_left_over": fds_after,
            "exit_status": code, **second.outcome()}


def listener_pid(path: Path) -> int:
    """The pid of the process listening on the socket at ``path`` (``SO_PEERCRED``), 0 if none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(path))
        return peer_of(sock).pid
    except OSError:
        return 0
    finally:
        sock.close()


def connect_error(path: Path) -> str:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(path))
        return "connected"
    except OSError as error:
        return type(error).__name__
    finally:
        sock.close()


# --- 3. the system manager stopped ----------------------------------------------------------------
def manager_sigstop(lab: Lab, per_user: int, stopped_seconds: float) -> dict:
    label = "stop"
    manager = SystemManager(lab, label, lab.system_dir(label), label)
    manager.ready()
    jobs = training_jobs(lab, manager, per_user, label)
    env = lab.user_env(USER_A, manager.system_dir, label)
    late: list[tuple[int, str, UserProcess]] = []
    filler = None
    try:
        keys = [f"{user}:{app}" for user, app, _ in jobs]
        wait(lambda: all(manager.decided(key) for key in keys), 180, 0.1)
        time.sleep(1.0)
        stopped = time.time()
        os.kill(manager.pid, signal.SIGSTOP)
        time.sleep(0.5)
        late.append((USER_A, "stoplate0", UserProcess(USER_A, env, lab.out("stoplate0.log"), session_job, "stoplate0",
                                                       str(lab.out(f"{label}.stop")), str(lab.out("stoplate0.json")),
                                                       str(lab.out("stoplate0.ready")))))
        wait(lambda: lab.out("stoplate0.ready").exists() or late[0][2].poll() is not None, 60)
        filler = UserProcess(USER_B, lab.user_env(USER_B, manager.system_dir, label), lab.out("filler.log"),
                             fill_backlog, str(lab.out("filler")))
        wait(lambda: lab.out("filler.count").exists() or filler.poll() is not None, 60)
        late.append((USER_A, "stoplate1", UserProcess(USER_A, env, lab.out("stoplate1.log"), session_job, "stoplate1",
                                                       str(lab.out(f"{label}.stop")), str(lab.out("stoplate1.json")),
                                                       str(lab.out("stoplate1.ready")))))
        wait(lambda: lab.out("stoplate1.ready").exists() or late[1][2].poll() is not None, 60)
        time.sleep(max(0.0, stopped + stopped_seconds - time.time()))
        continued = time.time()
        os.kill(manager.pid, signal.SIGCONT)
        lab.out("filler").touch()
        all_keys = keys + [f"{USER_A}:{app}" for _, app, _ in late]
        wait(lambda: all(manager.decided(key, continued) for key in all_keys), 120, 0.05)
        answered_again = {key: manager.decided(key, continued)[0]["t"] - continued for key in all_keys}
        time.sleep(2.0)
        results = finish_jobs(lab, label, jobs)
        late_results = finish_jobs(lab, label, late)
        time.sleep(1.5)
        fds_after = manager.fds() - manager.baseline_fds
        alive = manager.alive()
    finally:
        lab.out(f"{label}.stop").touch()
        lab.out("filler").touch()
        for _, _, process in jobs + late:
            process.kill9()
        if filler is not None:
            filler.kill9()
        code = manager.stop()
    during = [longest_step(r["steps"], stopped, continued) for r in results]
    return {"jobs": len(jobs), "users": 2, "stopped_seconds": continued - stopped,
            "longest_step_while_stopped_seconds": max(during),
            "steps_while_stopped_min": min(sum(stopped < t < continued for t in r["steps"]) for r in results),
            "no_answer_events": sum(1 for r in results for e in r["sd_log"] if e["event"] == "no_answer"),
            "slow_manager_events": sum(1 for r in results for e in r["sd_log"] if e["event"] == "slow_manager"),
            "detached_events": sum(1 for r in results for e in r["sd_log"] if e["event"] == "detached"),
            "every_job_answered_again_after_sigcont_seconds": max(answered_again[k] for k in keys),
            "job_started_while_stopped": late_report(late_results[0], answered_again[f"{USER_A}:stoplate0"],
                                                     stopped, continued),
            "backlog_filled_by_another_user": int(lab.out("filler.count").read_text()),
            "job_started_while_stopped_and_backlog_full": late_report(
                late_results[1], answered_again[f"{USER_A}:stoplate1"], stopped, continued),
            "manager_alive": alive, "descriptors_left_over": fds_after, "exit_status": code, **manager.outcome()}


def late_report(result: dict, answered_after: float, stopped: float, continued: float) -> dict:
    """A job started while the manager was stopped: its start, its training meanwhile, its first answer."""
    return {"startup_seconds": result["startup_seconds"], "attached_at_start": result["attached_at_start"],
            "steps_while_stopped": sum(stopped < t < continued for t in result["steps"]),
            "longest_step_while_stopped_seconds": longest_step(result["steps"], stopped, continued),
            "answered_after_sigcont_seconds": answered_after}


# --- 4. corrupt inputs ----------------------------------------------------------------------------
def corrupt(lab: Lab, randoms: int, rounds: int) -> dict:
    label = "corrupt"
    manager = SystemManager(lab, label, lab.system_dir(label), label)
    manager.ready()
    witness = UserProcess(USER_A, lab.user_env(USER_A, manager.system_dir, label), lab.out("witness.log"),
                          exchange_job, "a-witness", str(lab.out("corrupt.stop")), str(lab.out("witness.json")), 0.03)
    foreign = memfd()  # root's: passed by her as if it were her record
    attacker = None
    try:
        wait(lambda: manager.decided(f"{USER_A}:a-witness"), 120, 0.05)
        attacker = UserProcess(USER_B, lab.user_env(USER_B, manager.system_dir, label), lab.out("attacker.log"),
                               corrupt_attacks, str(lab.out("attacks.json")), witness.pid, "a-witness", foreign,
                               randoms, rounds, 10)
        os.close(foreign)
        foreign = -1
        if attacker.wait(600) != 0:
            raise RuntimeError(f"the attacks failed: {attacker.log.read_text()[-3000:]}")
        answered_before = len(manager.decided(f"{USER_A}:a-witness"))
        time.sleep(1.0)
        still_answering = len(manager.decided(f"{USER_A}:a-witness")) > answered_before
        alive = manager.alive()
        ended = time.time()
        lab.out("corrupt.stop").touch()
        witness.wait(60)
        time.sleep(1.5)
        fds_after = manager.fds() - manager.baseline_fds
    finally:
        if foreign >= 0:
            os.close(foreign)
        lab.out("corrupt.stop").touch()
        witness.kill9()
        if attacker is not None:
            attacker.kill9()
        code = manager.stop()
    attacks = json.loads(lab.out("attacks.json").read_text())
    exchanged = json.loads(lab.out("witness.json").read_text())
    answered = [x for _, x, _ in exchanged["exchanges"] if x is not None and x >= 0]
    invalid = manager.log.of("invalid")
    withheld = sum(e["count"] for e in manager.log.of("withheld"))
    removed = manager.log.of("app_removed")
    return {"answers": attacks, "manager_alive": alive, "still_answering_user_a": still_answering,
            "user_a_exchanges": len(exchanged["exchanges"]), "user_a_answered": len(answered),
            "user_a_invalid_dr": exchanged["invalid_dr"],
            "user_a_removed_while_alive": sum(1 for e in removed if e["app"] == f"{USER_A}:a-witness"
                                              and e["t"] < ended),
            "user_b_removals": dict(collections.Counter(e["reason"] for e in removed
                                                        if e["app"].startswith(f"{USER_B}:"))),
            "invalid_logged": len(invalid), "invalid_reasons_distinct": len({e["error"] for e in invalid}),
            "invalid_lines_withheld": withheld,
            "her_corrupted_record_kept_its_last_valid_status_logged": sum(
                1 for e in invalid if e.get("what") == "record" and e["app"] == f"{USER_B}:b-corrupt"),
            "invalid_logged_with_another_uid_than_hers": sum(1 for e in invalid if e.get("uid") not in (USER_B, None)),
            "descriptors_left_over": fds_after, "exit_status": code, **manager.outcome()}


# --- 5. floods ------------------------------------------------------------------------------------
def flood(lab: Lab, seconds: float, busy: int) -> dict:
    label = "flood"
    manager = SystemManager(lab, label, lab.system_dir(label), label)
    manager.ready()
    a_env = lab.user_env(USER_A, manager.system_dir, label)
    b_env = lab.user_env(USER_B, manager.system_dir, label)
    timed = UserProcess(USER_A, a_env, lab.out("a-timed.log"), exchange_job, "a-timed", str(lab.out("flood.stop")),
                        str(lab.out("a-timed.json")), 0.05)
    windows, by_b = {}, {}
    try:
        wait(lambda: manager.decided(f"{USER_A}:a-timed"), 120, 0.05)
        for number, (phase, make) in enumerate([*FLOODS.items(), ("quiet again", FLOODS["quiet"])]):
            stop, out = str(lab.out(f"phase{number}.stop")), str(lab.out(f"phase{number}-"))
            floods = [UserProcess(USER_B, b_env, lab.out(f"phase{number}-{i}.log"), function, *args)
                      for i, (function, args) in enumerate(make(stop, out, busy))]
            time.sleep(0.5 if floods else 0.0)  # under way
            started = time.time()
            time.sleep(seconds)
            windows[phase] = (started, time.time())
            Path(stop).touch()
            for process in floods:
                if process.wait(120) != 0:
                    raise RuntimeError(f"flood {phase} failed: {process.log.read_text()[-2000:]}")
            by_b[phase] = merge([json.loads(Path(f"{out}{i}").read_text()) for i in range(len(floods))])
            time.sleep(1.0)  # her connections closed, her jobs gone
        alive = manager.alive()
        lab.out("flood.stop").touch()
        timed.wait(60)
        time.sleep(1.5)
        fds_after = manager.fds() - manager.baseline_fds
    finally:
        lab.out("flood.stop").touch()
        timed.kill9()
        code = manager.stop()
    exchanges = json.loads(lab.out("a-timed.json").read_text())
    phases = {}
    for phase, (low, high) in windows.items():
        chosen = [(x, w) for t, x, w in exchanges["exchanges"] if low <= t <= high]
        answered = [x for x, _ in chosen if x is not None and x >= 0]
        written = [w for x, w in chosen if x is not None and x >= 0]
        phases[phase] = {"user_a_exchanges": len(chosen), "user_a_answered": len(answered),
                         "user_a_answer_seconds": summary(answered) if answered else None,
                         "user_a_answer_written_after_seconds": summary(written) if written else None,
                         "user_b": by_b[phase]}
    refused = [e for e in manager.log.of("refused") if e.get("uid") == USER_B]
    invalid = [e for e in manager.log.of("invalid") if e.get("uid") == USER_B]
    withheld = sum(e["count"] for e in manager.log.of("withheld") if e["uid"] == USER_B)
    per_reason = collections.Counter(e["error"] for e in refused)
    return {"seconds_per_phase": seconds, "phases": phases, "manager_alive": alive,
            "user_a_invalid_dr": exchanges["invalid_dr"],
            "refusals_logged_per_reason": dict(per_reason),
            "invalid_lines_logged_for_user_b": len(invalid), "problem_lines_withheld_for_user_b": withheld,
            "descriptors_left_over": fds_after, "exit_status": code, **manager.outcome()}


def merge(results: list[dict]) -> dict:
    merged: dict[str, Any] = {}
    for result in results:
        for key, value in result.items():
            if isinstance(value, dict):
                merged[key] = dict(collections.Counter(merged.get(key, {})) + collections.Counter(value))
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


# --- 6. a hostile second user ---------------------------------------------------------------------
def hostile(lab: Lab, idle: int, torch_jobs: bool) -> dict:
    results: dict[str, Any] = {}
    managers = {"root": SystemManager(lab, "hostile-root", lab.system_dir("hostile-root"), "hostile"),
                "service user": SystemManager(lab, "hostile-svc", lab.system_dir("hostile-svc", SERVICE_UID),
                                              "hostile", SERVICE_UID)}
    decoy = Path(tempfile.gettempdir()) / f"drbalance-lookalike-{os.getpid()}"
    decoy_link = Path(f"{decoy}-link")
    try:
        for manager in managers.values():
            manager.ready()
        own = lab.out("her-file")
        for who, manager in managers.items():
            UserProcess(USER_B, {}, lab.out(f"plant-{who}.log"), lambda: own.write_text("hers")).wait(60)
            UserProcess(USER_B, {}, lab.out(f"plant-{who}.log"), plant, str(manager.system_dir), "hostile", str(own),
                        str(lab.out(f"plant-{who}.json"))).wait(60)
            results[f"planting in the system folder ({who}'s)"] = json.loads(lab.out(f"plant-{who}.json").read_text())
            own.unlink(missing_ok=True)
        manager = managers["service user"]
        b_env = lab.user_env(USER_B, manager.system_dir, "hostile")
        a_env = lab.user_env(USER_A, manager.system_dir, "hostile")
        shared = UserProcess(USER_A, a_env, lab.out("a-shared.log"), exchange_job, "a-shared",
                             str(lab.out("hostile.stop")), str(lab.out("a-shared.json")), 0.05)
        wait(lambda: manager.decided(f"{USER_A}:a-shared"), 120, 0.05)
        watchers = [UserProcess(USER_B, b_env, lab.out(f"idle{s}.log"), idle_connections, idle, s,
                                str(lab.out(f"idle{s}.json"))) for s in (False, True)]
        UserProcess(USER_B, b_env, lab.out("names.log"), name_held, str(lab.out("names.json")), "a-shared").wait(60)
        results["names"] = json.loads(lab.out("names.json").read_text())
        for watcher in watchers:
            watcher.wait(120)
        for status_first in (False, True):
            idled = json.loads(lab.out(f"idle{status_first}.json").read_text())
            what = "connections that asked the status once, then nothing" if status_first else \
                "connections that sent nothing"
            closed = idled["closed_after_seconds"]
            results[what] = {"opened": idled["opened"], "closed": len(closed),
                             "closed_after_seconds": summary(closed) if closed else None}
        results["look-alike system dir in /tmp"] = look_alike_outcome(lab, decoy, decoy_link, torch_jobs)
        lab.out("hostile.stop").touch()
        shared.wait(60)
        exchanged = json.loads(lab.out("a-shared.json").read_text())
        results["user_a_job_of_the_shared_name"] = {
            "exchanges": len(exchanged["exchanges"]),
            "answered": sum(1 for _, x, _ in exchanged["exchanges"] if x is not None and x >= 0),
            "removed": [e["reason"] for e in manager.log.of("app_removed") if e["app"] == f"{USER_A}:a-shared"]}
        time.sleep(1.5)
        results["descriptors_left_over"] = {who: m.fds() - m.baseline_fds for who, m in managers.items()}
        results["managers_alive"] = all(m.alive() for m in managers.values())
    finally:
        lab.out("hostile.stop").touch()
        for manager in managers.values():
            results.setdefault("exit_status", {})[manager.label] = manager.stop()
        shutil.rmtree(decoy, ignore_errors=True)
        decoy_link.unlink(missing_ok=True)
    for who, manager in managers.items():
        results[f"manager ({who})"] = manager.outcome()
    return results


def look_alike_outcome(lab: Lab, decoy: Path, link: Path, torch_jobs: bool) -> dict:
    """Her look-alike system dir (and her link to it): user A's jobs told to look there must not trust it."""
    seconds = 60.0 if torch_jobs else 8.0
    listener = UserProcess(USER_B, {}, lab.out("decoy.log"), look_alike, str(decoy), "hostile", str(link), seconds,
                           str(lab.out("decoy.json")))
    wait(lambda: lab.out("decoy.json.ready").exists() or listener.poll() is not None, 60)
    outcome: dict[str, Any] = {}
    for what, folder in (("her folder", decoy), ("her link to it", link)):
        env = lab.user_env(USER_A, folder, "hostile")
        job = UserProcess(USER_A, env, lab.out(f"misled-{link == folder}.log"), exchange_job, "a-misled",
                          str(lab.out(f"misled-{link == folder}.stop")), str(lab.out(f"misled-{link == folder}.json")),
                          0.05)
        time.sleep(2.0)
        lab.out(f"misled-{link == folder}.stop").touch()
        job.wait(60)
        result = json.loads(lab.out(f"misled-{link == folder}.json").read_text())
        warning = [line for line in job.log.read_text().splitlines() if "system manager's folder" in line]
        outcome[what] = {"exchanges": len(result["exchanges"]),
                         "attached": sum(1 for _, x, _ in result["exchanges"] if x != -1),
                         "warning": warning[0].split("drbalance: ", 1)[-1][:300] if warning else None}
    if torch_jobs:
        job = torch_job(lab, USER_A, None, "a-misled-torch", "--epochs", "2", "--iterations", "3",
                        system_dir=decoy, namespace="hostile")
        out, err = job.communicate(timeout=300)
        outcome["a torch job told to use her folder"] = {
            "exit": job.returncode, "trained_to_the_end": '"done": true' in out,
            "warned": "anyone may make folders" in err}
    listener.wait(seconds + 60)
    outcome["connections her listener got"] = json.loads(lab.out("decoy.json").read_text())["accepted"]
    return outcome


# --- the section ----------------------------------------------------------------------------------
def campaign_system(scratch: Path, quick: bool) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root: the second users are uids a forked child takes"}
    import drbalance.client.session  # noqa: F401  (what the users' forked jobs run, imported once)
    import drbalance.ipc.system_link  # noqa: F401
    from tests.helpers.system import others_may_run_python

    base = Path(tempfile.mkdtemp(prefix="drbalance-fault-system-"))
    results: dict[str, Any] = {"load_before": os.getloadavg(), "users": [USER_A, USER_B],
                               "service_user": SERVICE_UID, "manager_nice": NICE}
    try:
        with others_may_run_python():
            lab = Lab(base)
            repeats = 2 if quick else 6
            results["job_kill9"] = [job_kill9(lab, "root", repeats, 1 if quick else 3)]
            results["job_kill9"].append(job_kill9(lab, "service", repeats, 0))
            results["manager_kill9"] = [manager_kill9(lab, identity, 1 if quick else 3)
                                        for identity in (("service",) if quick else ("root", "service"))]
            results["manager_sigstop"] = manager_sigstop(lab, 1 if quick else 2, 8.0 if quick else 10.0)
            results["corrupt"] = corrupt(lab, 60 if quick else 300, 40 if quick else 200)
            results["flood"] = flood(lab, 2.5 if quick else 6.0, 4 if quick else 8)
            results["hostile"] = hostile(lab, 3 if quick else 10, not quick)
            results["leftovers"] = lab.leftovers()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    return results
