"""Manager costs on this machine.

1. Decision time at 64 apps x 16 GPUs: the paper policy alone on snapshots that reach its
   heaviest branches (util and SD), and the daemon's whole notice path (read all 64 records,
   decide, write the command, post the semaphore, log) over real shared memory. Target: <= 1 ms.
2. CPU of an idle ``drbalance-manager`` process (no apps), from /proc over a quiet interval.
   Target: < 1% of one core.

Usage: python -m benchmarks.bench_manager [--decisions 3000] [--idle-seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.timing import add_no_write, save, scratch_namespace, summary
from drbalance import DataRatio
from drbalance.argtypes import positive_int
from drbalance.ipc.layout import AppState, AppStatus, Notice, NoticeKind
from drbalance.ipc.link import PosixManagerLink
from drbalance.ipc.names import IpcNames
from drbalance.manager.daemon import Manager, ManagerSettings
from drbalance.manager.utilization import ScriptedSource
from drbalance.policy import AppView, PolicyConfig, Snapshot
from drbalance.policy.paper import PaperPolicy

APPS, GPUS = 64, 16


def random_ratio(rng: random.Random) -> DataRatio:
    weights = [rng.choice([0, 0, 0, 1, 2, 5]) for _ in range(GPUS)]
    if not any(weights):
        weights[rng.randrange(GPUS)] = 1
    return DataRatio.from_weights(weights)


def bench_policy(count: int) -> dict:
    rng = random.Random(7)
    policy, config = PaperPolicy(), PolicyConfig(GPUS)
    samples: dict[str, list[float]] = {}
    for _ in range(count):
        apps = tuple(AppView(f"a{i}", random_ratio(rng), rng.uniform(1.0, 3.0)) for i in range(APPS))
        slowest = max(apps, key=lambda a: a.slowdown).name
        spread = rng.random() < 0.5
        util = tuple(rng.uniform(0, 100) if spread else rng.uniform(50, 60) for _ in range(GPUS))
        snapshot = Snapshot(apps, util, config)
        started = time.perf_counter()
        decision = policy.decide(slowest, "boundary", snapshot)
        samples.setdefault(decision.branch, []).append(time.perf_counter() - started)
    every = [value for values in samples.values() for value in values]
    return {"all": summary(every), **{branch: summary(values) for branch, values in samples.items()}}


def bench_daemon_notice(count: int, scratch: Path) -> dict:
    """The daemon's notice path; records rewritten before each notice (all, or the notifier's only)."""
    util = scratch / "util16.json"
    util.write_text(json.dumps({"gpus": GPUS, "steps": [{"at": 0, "util": [float(10 + 5 * g) for g in range(GPUS)]}]}))
    manager = Manager(ManagerSettings(log_path=scratch / "bench-manager.jsonl"), ScriptedSource(util))
    manager.start()
    rng = random.Random(3)
    names = IpcNames.current()
    links, statuses = [], []
    results = {}
    try:
        for index in range(APPS):
            links.append(PosixManagerLink(names, f"app{index}"))
            statuses.append(AppStatus(os.getpid(), f"app{index}", AppState.RUNNING, random_ratio(rng), 1, 10, 20,
                                      100, 10, 0, rng.uniform(1, 3), 0.1, 10.0, time.time(), time.time(),
                                      time.monotonic()))
            links[-1].publish(statuses[-1])
        for mode in ("all_records_changed", "notifier_changed"):
            samples = []
            for seq in range(1, count + 1):
                target = rng.randrange(APPS)
                for index in range(APPS) if mode == "all_records_changed" else (target,):
                    statuses[index] = replace(statuses[index], slowdown=rng.uniform(1, 3), notice_seq=seq,
                                              updated_mono=time.monotonic())
                    links[index].publish(statuses[index])
                notice = Notice(NoticeKind.BOUNDARY, os.getpid(), seq, f"app{target}", time.time())
                started = time.perf_counter()
                manager.handle(notice)
                samples.append(time.perf_counter() - started)
            results[mode] = summary(samples)
    finally:
        for link in links:
            link.close()
        manager.stop()
    return results


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_idle_cpu(seconds: float, scratch: Path) -> dict:
    util = scratch / "util4.json"
    util.write_text(json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [10, 20, 30, 40]}]}))
    process = subprocess.Popen([sys.executable, "-m", "drbalance.manager.cli", "--source", f"scripted:{util}",
                                "--log", str(scratch / "idle.jsonl")], stderr=subprocess.DEVNULL)
    try:
        time.sleep(3.0)  # start-up (imports) is not idling
        before, started = cpu_seconds(process.pid), time.monotonic()
        time.sleep(seconds)
        used, elapsed = cpu_seconds(process.pid) - before, time.monotonic() - started
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    return {"cpu_seconds": used, "wall_seconds": elapsed, "percent_of_a_core": 100 * used / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=positive_int, default=3000, help="timed decisions (default 3000)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle interval measured (default 20)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    with scratch_namespace("benchm") as scratch:
        payload = {
            "args": vars(args),
            "policy_decision": bench_policy(args.decisions),
            "daemon_notice": bench_daemon_notice(args.decisions, scratch),
            "idle": bench_idle_cpu(args.idle_seconds, scratch),
        }
    policy, notice, idle = payload["policy_decision"]["all"], payload["daemon_notice"], payload["idle"]
    print(f"policy decision, {APPS} apps x {GPUS} GPUs: median {policy['median'] * 1e3:.3f} ms, "
          f"p99 {policy['p99'] * 1e3:.3f} ms (target <= 1 ms)")
    for mode, stats in notice.items():
        print(f"daemon notice path (read {APPS} records + decide + answer + log), {mode.replace('_', ' ')}: "
              f"median {stats['median'] * 1e3:.3f} ms, p99 {stats['p99'] * 1e3:.3f} ms")
    print(f"idle manager: {idle['percent_of_a_core']:.3f}% of a core over {idle['wall_seconds']:.0f} s "
          f"(target < 1%)")
    save("manager", "benchmarks.bench_manager", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
