"""Decision latency of the policies at scale: every ``decide()`` call of a whole simulated run, timed.

64 apps (the six models, mixed run lengths, arriving over 10 minutes) on 16 GPUs, and 128 apps on
32 GPUs, simulated under each policy; each decision the simulator asks for is timed around the
call itself (``time.perf_counter``), so it includes everything the daemon's policy step does
(learning from the snapshot, the search). Policies run one after another in one process; the
table gives medians and tails per policy. Target for ``fair``: a decision within 1 ms at 64 x 16.

Usage: python -m benchmarks.bench_policy [--policies fair,paper,f-sched] [--no-write]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench_simulator import big_scenario
from benchmarks.timing import add_no_write, save, summary
from drbalance.policy import POLICIES, Decision, Policy, Snapshot
from drbalance.sim import SimConfig, Simulation


class Timed:
    """Wraps a policy and records the wall time of every decision (seconds)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.seconds: list[float] = []

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        started = time.perf_counter()
        decision = self.policy.decide(app, trigger, snapshot)
        self.seconds.append(time.perf_counter() - started)
        return decision


def run(policy: str, apps: int, gpus: int) -> dict:
    timed = Timed(POLICIES[policy]())
    started = time.perf_counter()
    result = Simulation(big_scenario(apps, gpus), SimConfig(policy=policy, record=False), policy=timed).run()
    return {"decision_seconds": summary(timed.seconds), "decision_max_s": max(timed.seconds),
            "simulation_s": time.perf_counter() - started, "decisions": len(timed.seconds),
            "max_sd": result.max_sd, "mean_sd": result.mean_sd}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="fair,paper,f-sched", help="comma-separated policies")
    parser.add_argument("--sizes", default="64x16,128x32", help="comma-separated APPSxGPUS")
    add_no_write(parser)
    args = parser.parse_args(argv)
    payload: dict = {"args": vars(args), "runs": {}}
    for size in args.sizes.split(","):
        apps, gpus = (int(part) for part in size.split("x"))
        for policy in args.policies.split(","):
            case = run(policy, apps, gpus)
            payload["runs"][f"{policy}@{size}"] = case
            seconds = case["decision_seconds"]
            print(f"{policy:8} {size:7} decisions {case['decisions']:6}: median {seconds['median'] * 1e3:.3f} ms, "
                  f"p90 {seconds['p90'] * 1e3:.3f} ms, p99 {seconds['p99'] * 1e3:.3f} ms, "
                  f"max {case['decision_max_s'] * 1e3:.1f} ms; whole simulation {case['simulation_s']:.1f} s; "
                  f"final max/mean SD {case['max_sd']:.3f}/{case['mean_sd']:.3f}", flush=True)
    save("policy", "benchmarks.bench_policy", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
