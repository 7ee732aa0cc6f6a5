"""Reproduce the paper's Fig. 5-7 numbers in the simulator: ``python -m drbalance.sim.reproduce``.

For each scenario (a), (b), (c) and each starting placement (one GPU per app round-robin, and
plain DataParallel over all GPUs) it simulates the run without the algorithm (observe) and with
it (paper), and prints a markdown table beside the paper's reported values.
"""

from __future__ import annotations

import argparse

from drbalance.report.metrics import summarise
from drbalance.scenarios import SCENARIOS
from drbalance.sim.bound import lower_bound
from drbalance.sim.command import to_run
from drbalance.sim.engine import SimConfig, simulate


def measure(scenario_name: str, placement: str, policy: str, decide_every: int | None) -> dict:
    scenario = SCENARIOS[scenario_name]
    result = simulate(scenario, SimConfig(policy=policy, placement=placement, decide_every=decide_every))
    summary = summarise(to_run(result, policy, scenario), step=max(1.0, result.makespan / 2000))
    return {"start": summary.start_sd_diff, "final": summary.final_sd_diff, "mean_sd": summary.mean_sd,
            "final_mean_sd": summary.final_mean_sd, "util": summary.mean_util, "max_sd": result.max_sd}


def table(decide_every: int | None = None) -> str:
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
            without = measure(name, placement, "observe", decide_every)
            with_ = measure(name, placement, "paper", decide_every)
            sd_change = (with_["mean_sd"] - without["mean_sd"]) / without["mean_sd"]
            util_change = (with_["util"] - without["util"]) / without["util"]
            lines.append(
                f"| ({name}) | {placement} | {paper['sd_diff_start']:.2f} / {without['start']:.2f}, "
                f"{with_['start']:.2f} | {paper['sd_diff_end']:.2f} / {without['final']:.2f}, {with_['final']:.2f} "
                f"| {100 * paper['mean_sd_change']:+.0f}% / {100 * sd_change:+.0f}% | "
                f"{100 * paper['util_change']:+.0f}% / {100 * util_change:+.0f}% "
                f"({without['util']:.0f}% -> {with_['util']:.0f}%) | {with_['max_sd']:.2f} / {bound:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decide-every", type=int, default=None, help="iterations between decisions")
    args = parser.parse_args(argv)
    print(table(args.decide_every))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
