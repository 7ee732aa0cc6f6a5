"""Speed of the ``plan`` policy at scale: a notice's answer (a lookup) and a plan (the solve), timed.

64 apps (the six models, arriving over 10 minutes: ``benchmarks.bench_simulator.big_scenario``) on
16 GPUs, and 128 apps on 32 GPUs, simulated under ``plan`` for ``--seconds`` of simulated time
(the arrivals and the plans that follow them). Every ``decide()`` the simulator asks for (a
notice) and every ``plan()`` (a period, an arrival, a departure) is timed around the call: wall
time, and the CPU time of the calling thread (on a loaded machine the wall time's tail is mostly
waiting for a core). Targets: a notice answered within 1 ms p99 at 64 x 16; a plan within 200 ms
p99 at 64 x 16 and within 1 s at 128 x 32.

    python -m benchmarks.bench_plan                      # both sizes, 1,800 simulated seconds each
    python -m benchmarks.bench_plan --sizes 64x16 --seconds 600 --no-write
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from benchmarks.bench_simulator import big_scenario
from benchmarks.timing import add_no_write, save, summary
from drbalance.argtypes import positive_float
from drbalance.policy.base import Decision, Plan, Snapshot
from drbalance.policy.plan import PlanPolicy
from drbalance.sim.engine import SimConfig, Simulation


class TimedPlanner:
    """``plan`` with every decide() and plan() call timed (seconds: wall and the thread's CPU)."""

    name = "plan"

    def __init__(self, policy: PlanPolicy) -> None:
        self.policy = policy
        self.plan_period = policy.plan_period
        self.times: dict[str, tuple[list[float], list[float]]] = {"notice": ([], []), "plan": ([], [])}

    def _timed(self, kind: str, call: Callable[[], Any]) -> Any:
        cpu, started = time.thread_time(), time.perf_counter()
        found = call()
        wall, threads = self.times[kind]
        wall.append(time.perf_counter() - started)
        threads.append(time.thread_time() - cpu)
        return found

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        return self._timed("notice", lambda: self.policy.decide(app, trigger, snapshot))

    def plan(self, trigger: str, snapshot: Snapshot) -> Plan:
        return self._timed("plan", lambda: self.policy.plan(trigger, snapshot))


def run(apps: int, gpus: int, seconds: float) -> dict:
    """Simulate ``apps`` x ``gpus`` under a timed ``plan`` for ``seconds`` of simulated time."""
    timed = TimedPlanner(PlanPolicy())
    simulation = Simulation(big_scenario(apps, gpus), SimConfig(policy="plan", record=False), policy=timed)
    started = time.perf_counter()
    simulation.start()
    simulation.advance(seconds)
    result = {"simulated_s": seconds, "wall_s": time.perf_counter() - started}
    for kind, (wall, cpu) in timed.times.items():
        result[kind] = {"calls": len(wall), "wall_seconds": summary(wall), "cpu_seconds": summary(cpu),
                        "max_wall_s": max(wall)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64x16,128x32", help="comma-separated APPSxGPUS (default 64x16,128x32)")
    parser.add_argument("--seconds", type=positive_float, default=1800.0,
                        help="simulated seconds per size (default 1800: the arrivals and what follows)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    payload: dict = {"args": vars(args), "runs": {}}
    for size in args.sizes.split(","):
        try:
            apps, gpus = (int(part) for part in size.split("x"))
        except ValueError:
            parser.error(f"--sizes takes APPSxGPUS, e.g. 64x16; got {size!r}")
        case = payload["runs"][size] = run(apps, gpus, args.seconds)
        for kind in ("notice", "plan"):
            found = case[kind]
            wall, cpu = found["wall_seconds"], found["cpu_seconds"]
            print(f"{size:7} {kind:6} {found['calls']:6} calls: wall median {wall['median'] * 1e3:8.3f} ms, "
                  f"p99 {wall['p99'] * 1e3:8.3f} ms, max {found['max_wall_s'] * 1e3:8.3f} ms; CPU median "
                  f"{cpu['median'] * 1e3:8.3f} ms, p99 {cpu['p99'] * 1e3:8.3f} ms", flush=True)
    save("plan_speed", "benchmarks.bench_plan", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
