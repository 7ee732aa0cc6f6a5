"""Simulator speed: wall time to simulate whole scenarios to completion.

1. The paper's scenario (a) (6 apps, 4 GPUs, ~30 min of each app's solo time) under the paper
   policy, fair and observe, with logs recorded as 'drbalance simulate' records them. Target < 2 s
   for paper and observe (fair decides every 1% of each app's solo time: more decisions).
2. 64 apps (the six models, mixed) on 16 GPUs, arriving over 10 minutes: fair (its own decision
   windows) and paper (decisions every 50 iterations). Target < 30 s.

Usage: python -m benchmarks.bench_simulator [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.timing import add_no_write, save, summary
from drbalance.argtypes import positive_int
from drbalance.sim import SimConfig, simulate
from drbalance.sim.mixes import arrivals_mix
from drbalance.workload.scenarios import SCENARIOS, Scenario


def big_scenario(apps: int = 64, gpus: int = 16, seed: int = 11) -> Scenario:
    """The six models mixed, arriving over 10 minutes (``drbalance.sim.mixes.arrivals_mix``)."""
    return arrivals_mix(apps, gpus, seed)


def timed(scenario: Scenario, config: SimConfig, repeats: int) -> dict:
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = simulate(scenario, config)
        seconds.append(time.perf_counter() - started)
    return {"seconds": summary(seconds), "events": result.events, "max_sd": result.max_sd,
            "makespan_simulated_s": result.makespan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per case (default 5)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    payload = {
        "args": vars(args),
        "scenario_a_paper": timed(SCENARIOS["a"], SimConfig(policy="paper"), args.repeats),
        "scenario_a_fair": timed(SCENARIOS["a"], SimConfig(policy="fair"), args.repeats),
        "scenario_a_observe": timed(SCENARIOS["a"], SimConfig(policy="observe"), args.repeats),
        "apps64_gpus16_fair": timed(big_scenario(), SimConfig(policy="fair", record=False),
                                    max(1, args.repeats // 2)),
        "apps64_gpus16_paper": timed(big_scenario(), SimConfig(policy="paper", decide_every=50, record=False),
                                     max(1, args.repeats // 2)),
    }
    for key, target in (("scenario_a_paper", 2.0), ("scenario_a_fair", 4.0), ("scenario_a_observe", 2.0),
                        ("apps64_gpus16_fair", 30.0), ("apps64_gpus16_paper", 30.0)):
        case = payload[key]
        print(f"{key}: median {case['seconds']['median']:.2f} s (max {case['seconds']['p99']:.2f} s), "
              f"{case['events']} events, target < {target:.0f} s")
    save("simulator", "benchmarks.bench_simulator", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
