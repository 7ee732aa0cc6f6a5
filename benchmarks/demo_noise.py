"""The demo's comparison under noise: how often `fair` ends with the lowest final spread and max SD.

    python -m benchmarks.demo_noise                                   # demo-a, 60 seeds, jitter 0-0.3, cadence 2 and 4
    python -m benchmarks.demo_noise --seeds 20 --jitter 0.2 --decide-every 2,3,4,6

`drbalance demo` runs six short jobs (a dense app runs 12 iterations) on emulated GPUs, where
iteration times vary from one to the next (the CPU is shared by six training processes), and
compares `observe`, `paper` and `fair` once each. One emulated run says little: this benchmark
asks the simulator instead, with every host phase and GPU chunk stretched by a random factor of
mean 1 (``SimConfig.jitter``, a relative spread), many seeds per setting. Per jitter and
decision cadence (``--decide-every``: iterations between decisions, as the demo's option), it
counts the seeds in which `fair` has a final spread (SD_max^diff) lower than both others', a
final max SD lower than both others', and both (the demo's target), with each policy's
median final spread / max SD / mean SD. No torch in the simulation; about a minute per setting
of 60 seeds on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

from benchmarks.random_mixes import Knobs, add_knob_option, fair_with, parsed_knobs
from benchmarks.timing import add_no_write, save
from drbalance.argtypes import non_negative_int, positive_int, relative_spread
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.workload.scenarios import load_scenario

POLICIES = ("observe", "paper", "fair")
Job = tuple[str, str, float, int, int]  # scenario, policy, jitter, decide_every, seed


def _list_of(kind):
    def parse(text: str) -> list:
        return [kind(part) for part in text.split(",") if part.strip()]
    return parse


def final(task: tuple[Job, Knobs]) -> tuple[Job, tuple[float, float, float]]:
    """One simulated run's final spread, max SD and mean SD (``fair`` with ``knobs`` replacing
    FairConfig's defaults)."""
    job, knobs = task
    scenario, policy, jitter, cadence, seed = job
    config = SimConfig(policy=policy, decide_every=cadence, jitter=jitter, seed=seed, record=False)
    result = Simulation(load_scenario(scenario), config, policy=fair_with(policy, knobs)).run()
    return job, (result.sd_spread, result.max_sd, result.mean_sd)


def tally(results: dict[Job, tuple[float, float, float]], scenario: str, jitter: float, cadence: int,
          seeds: int) -> dict:
    """Counts of seeds where `fair` is lowest (spread, max, both) and each policy's medians."""
    lowest_spread = lowest_max = both = 0
    for seed in range(seeds):
        ends = {policy: results[(scenario, policy, jitter, cadence, seed)] for policy in POLICIES}
        spread = ends["fair"][0] < min(ends["observe"][0], ends["paper"][0])
        highest = ends["fair"][1] < min(ends["observe"][1], ends["paper"][1])
        lowest_spread += spread
        lowest_max += highest
        both += spread and highest
    medians = {policy: [statistics.median(results[(scenario, policy, jitter, cadence, seed)][i]
                                          for seed in range(seeds)) for i in range(3)] for policy in POLICIES}
    return {"jitter": jitter, "decide_every": cadence, "seeds": seeds, "fair_lowest_spread": lowest_spread,
            "fair_lowest_max": lowest_max, "fair_lowest_both": both, "medians_spread_max_mean": medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="demo-a", help="scenario (default demo-a, the demo's)")
    parser.add_argument("--seeds", type=positive_int, default=60, help="seeds per setting (default 60)")
    parser.add_argument("--jitter", type=_list_of(relative_spread), default=[0.0, 0.05, 0.1, 0.2, 0.3],
                        help="comma-separated relative spreads (default 0,0.05,0.1,0.2,0.3)")
    parser.add_argument("--decide-every", type=_list_of(non_negative_int), default=[2, 4],
                        help="comma-separated cadences in iterations (default 2,4; 0: the policy's own)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    add_knob_option(parser)
    add_no_write(parser)
    args = parser.parse_args(argv)
    knobs = parsed_knobs(parser, args)
    jobs = [(args.scenario, policy, jitter, cadence, seed) for jitter in args.jitter for cadence in args.decide_every
            for seed in range(args.seeds if jitter > 0 else 1) for policy in POLICIES]
    with ProcessPoolExecutor(args.workers) as pool:
        results = dict(pool.map(final, [(job, knobs) for job in jobs], chunksize=8))
    rows = []
    print(f"{args.scenario}: `fair` lowest of observe / paper / fair, counted over seeds "
          f"(jitter 0 is one run: every seed is the same)")
    print("jitter  decide-every  seeds  lowest spread  lowest max  both  | medians spread / max / mean: "
          "observe; paper; fair")
    for jitter in args.jitter:
        for cadence in args.decide_every:
            row = tally(results, args.scenario, jitter, cadence, args.seeds if jitter > 0 else 1)
            rows.append(row)
            medians = "; ".join(" / ".join(f"{value:.3f}" for value in row["medians_spread_max_mean"][policy])
                                for policy in POLICIES)
            print(f"{jitter:6g}  {cadence:12d}  {row['seeds']:5d}  {row['fair_lowest_spread']:13d}  "
                  f"{row['fair_lowest_max']:10d}  {row['fair_lowest_both']:4d}  | {medians}")
    save("demo_noise", "benchmarks.demo_noise", argv, {"scenario": args.scenario, "knobs": dict(knobs), "rows": rows},
         args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
