"""Reproduce the paper's experiments in the simulator and compare every policy and baseline.

    python -m drbalance.sim.reproduce                 # the paper's table (observe vs paper), calibrated model
    python -m drbalance.sim.reproduce --policies      # fair / f-sched / paper / observe / themis, both models

For each scenario (a), (b), (c) and each starting placement (one GPU per app round-robin, and
plain DataParallel over all GPUs) the first table simulates the run without the algorithm
(observe) and with the paper's, beside the paper's reported values. The second gives, under both
interference models (``calibrated``: one fitted co-location capacity; ``gavel``: Gavel's measured
pairs), each policy's final SD spread / max / mean, time-averaged GPU utilisation, and the
reference: ``observe`` from round-robin (each job alone on its GPU, nothing moved).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from drbalance.policy.base import Policy
from drbalance.report.metrics import summarise
from drbalance.sim.bound import lower_bound
from drbalance.sim.command import to_run
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.mixes import scenario_named
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import SCENARIOS

POLICY_ROWS = ("fair", "f-sched", "paper", "observe", "themis")


@dataclass(frozen=True)
class Outcome:
    """Final SDs and time averages of one simulated run."""

    spread: float
    max_sd: float
    mean_sd: float
    util: float
    mean_sd_time: float
    start: float


def measure(scenario_name: str, placement: str, policy: str, interference: str = "calibrated",
            decide_every: int | None = None, *, report_every: int = SimConfig.report_every,
            policy_object: Policy | None = None) -> Outcome:
    """Simulate one run of a scenario (a built-in name or .json file, or a mix of ``sim.mixes``);
    ``policy`` "themis" is the time-slicing scheduler.

    ``report_every``: iterations between an app's records; ``policy_object``: a policy built with
    other knobs than the registry's (``policy`` then only labels the run).
    """
    scenario = scenario_named(scenario_name)
    scheduler = "themis" if policy == "themis" else None
    config = SimConfig(policy="observe" if scheduler else policy, scheduler=scheduler, placement=placement,
                       decide_every=decide_every, report_every=report_every,
                       contention=make_interference(interference))
    result = Simulation(scenario, config, policy=policy_object).run()
    summary = summarise(to_run(result, policy, scenario), step=max(1.0, result.makespan / 2000))
    return Outcome(result.sd_spread, result.max_sd, result.mean_sd, summary.mean_util, summary.mean_sd,
                   summary.start_sd_diff)


def _measure(args: tuple) -> Outcome:
    return measure(*args)


def paper_table(decide_every: int | None = None) -> str:
    """observe vs paper from both placements, beside the paper's reported changes (calibrated model)."""
    lines = [
        "| scenario | start placement | SD_max^diff start: paper / ours (w/o, with) | SD_max^diff end: paper / ours "
        "(w/o, with) | mean SD change: paper / ours | mean util change: paper / ours | max SD with / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("a", "b", "c"):
        scenario = SCENARIOS[name]
        paper = scenario.paper
        bound = lower_bound(scenario)
        for placement in ("round-robin", "spread"):
            without = measure(name, placement, "observe", decide_every=decide_every)
            with_ = measure(name, placement, "paper", decide_every=decide_every)
            sd_change = (with_.mean_sd_time - without.mean_sd_time) / without.mean_sd_time
            util_change = (with_.util - without.util) / without.util
            lines.append(
                f"| ({name}) | {placement} | {paper['sd_diff_start']:.2f} / {without.start:.2f}, "
                f"{with_.start:.2f} | {paper['sd_diff_end']:.2f} / {without.spread:.2f}, {with_.spread:.2f} "
                f"| {100 * paper['mean_sd_change']:+.0f}% / {100 * sd_change:+.0f}% | "
                f"{100 * paper['util_change']:+.0f}% / {100 * util_change:+.0f}% "
                f"({without.util:.0f}% -> {with_.util:.0f}%) | {with_.max_sd:.2f} / {bound:.2f} |"
            )
    return "\n".join(lines)


def policy_table(policies: Iterable[str] = POLICY_ROWS, workers: int = 2) -> str:
    """Every policy from both placements under both interference models (final values)."""
    policies = list(policies)
    jobs = [(name, placement, policy, interference)
            for interference in INTERFERENCE_MODELS for name in ("a", "b", "c")
            for placement in ("round-robin", "spread") for policy in policies]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        outcomes = dict(zip(jobs, pool.map(_measure, jobs)))
    lines = ["| interference | scenario | placement | " + " | ".join(policies) + " |",
             "|---|---|---|" + "---|" * len(policies)]
    for interference in INTERFERENCE_MODELS:
        for name in ("a", "b", "c"):
            for placement in ("round-robin", "spread"):
                cells = []
                for policy in policies:
                    o = outcomes[(name, placement, policy, interference)]
                    cells.append(f"{o.spread:.3f} / {o.max_sd:.3f} / {o.mean_sd:.3f} / {o.util:.0f}%")
                lines.append(f"| {interference} | ({name}) | {placement} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: final SD spread / max SD / mean SD / time-averaged GPU utilisation.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decide-every", type=int, default=None, help="iterations between decisions (paper table)")
    parser.add_argument("--policies", action="store_true",
                        help="print the policy comparison under both interference models instead")
    parser.add_argument("--workers", type=int, default=2, help="simulations in parallel (default 2)")
    args = parser.parse_args(argv)
    print(policy_table(workers=args.workers) if args.policies else paper_table(args.decide_every))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
