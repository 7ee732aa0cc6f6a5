"""Read one simulated run's decision log: where utilisation is lost, and which moves were judged
on a window that mixed two DRs.

    python -m benchmarks.decision_log a --placement spread            # fair, calibrated
    python -m benchmarks.decision_log staggered --interference gavel --moves

It prints the final SDs and finish times, the mean GPU utilisation (busy time over the makespan,
per GPU) in periods of ``--period`` seconds, and counts the reverts of *pushed* moves that were
decided on a mixed window: the other half of a swap is pushed to an app and applied after its
current iteration (at its next report until the client looked for pushes every iteration), in
the middle of that app's decision window; the window it is then judged on (and the predictor
learns from) holds chunks of both DRs: now one iteration's, before up to ``report_every``.
``--moves`` lists every change (move, swap, plan, revert) with its time and gain, such reverts
marked ``MIXED``.

What it showed for ``fair`` at 4c66d28 (calibrated model): while the apps run, utilisation sits
at about 84% in (a) and (c) from either placement (six apps on four GPUs: two GPUs shared, at
about 95%, two with one app, at 74%); the time average falls under 83% from spread only through
the tail, where apps with low SDs finish up to 160 s before the last, so the shortfall is the
final SD spread. In (a) from spread the spread comes from a pushed move reverted 4.6 s after the
push (3 of 3 reverts there were judged on mixed windows; 16 of 28 in the staggered mix, 26 of 36
in (c) from round-robin).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

from drbalance.sim import SimConfig, Simulation
from drbalance.sim.engine import SimResult
from drbalance.sim.mixes import scenario_named
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import Scenario

CHANGES = ("move", "swap", "plan", "revert")


def scenario_of(name: str) -> Scenario:
    try:
        return scenario_named(name)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def utilisation_by_period(result: SimResult, period: float) -> list[tuple[float, list[float]]]:
    """Per period (start second, per-GPU mean of the sampled utilisation in percent), up to the makespan."""
    buckets: dict[int, list[list[float]]] = defaultdict(list)
    for record in result.manager_records:
        if record["event"] == "util" and record["t"] <= result.makespan:
            buckets[int(record["t"] // period)].append(record["util"])
    rows = []
    for index in sorted(buckets):
        readings = buckets[index]
        rows.append((index * period, [sum(r[g] for r in readings) / len(readings) for g in range(len(readings[0]))]))
    return rows


def mixed_reverts(result: SimResult) -> list[dict[str, Any]]:
    """Reverts decided at a boundary whose window began before a pushed DR was applied."""
    pushes: dict[str, list[float]] = defaultdict(list)
    for name, records in result.app_records.items():
        pushes[name] = [r["t"] for r in records if r["event"] == "update" and r.get("branch") == "push"]
    last_decision: dict[str, float] = {}
    found = []
    for record in result.manager_records:
        if record["event"] != "decision":
            continue
        name, now = record["app"], record["t"]
        start = last_decision.get(name)
        last_decision[name] = now
        if record["branch"] == "revert" and start is not None and any(start < t <= now for t in pushes[name]):
            found.append(record)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario",
                        help="a built-in scenario (a, b, c, demo-a, ...), a .json file or a mix of drbalance.sim.mixes")
    parser.add_argument("--policy", default="fair")
    parser.add_argument("--placement", default=None, help="round-robin or spread (default: the scenario's)")
    parser.add_argument("--interference", default="calibrated", choices=INTERFERENCE_MODELS)
    parser.add_argument("--period", type=float, default=120.0, help="seconds per utilisation period (default 120)")
    parser.add_argument("--moves", action="store_true", help="list every change the policy made")
    args = parser.parse_args(argv)
    if args.period <= 0:
        parser.error("--period must be > 0")
    config = SimConfig(policy=args.policy, placement=args.placement, contention=make_interference(args.interference))
    result = Simulation(scenario_of(args.scenario), config).run()
    print(f"final SDs: {', '.join(f'{n} {sd:.3f}' for n, sd in result.final_sd.items())}")
    print(f"spread {result.sd_spread:.3f}, max {result.max_sd:.3f}, mean {result.mean_sd:.4f}")
    print(f"finish (s): {', '.join(f'{n} {t:.0f}' for n, t in result.finish.items())}; makespan {result.makespan:.0f}")
    busy = [b / result.makespan for b in result.gpu_busy]
    print(f"busy share per GPU over the makespan: {[round(100 * b, 1) for b in busy]}, "
          f"mean {100 * sum(busy) / len(busy):.2f}%")
    print(f"utilisation per {args.period:.0f} s (per GPU %, mean):")
    for start, per_gpu in utilisation_by_period(result, args.period):
        print(f"  {start:6.0f} s  {[round(u) for u in per_gpu]}  {sum(per_gpu) / len(per_gpu):.1f}")
    mixed = mixed_reverts(result)
    decisions = [r for r in result.manager_records if r["event"] == "decision"]
    counts = defaultdict(int)
    for record in decisions:
        counts[record["branch"]] += 1
    print(f"decisions by branch: {dict(sorted(counts.items()))}")
    print(f"reverts judged on a window that mixed two DRs (a push applied within it): {len(mixed)} "
          f"of {counts['revert']}")
    if args.moves:
        marked = {id(r) for r in mixed}
        for r in decisions:
            if r["branch"] in CHANGES:
                flag = " MIXED" if id(r) in marked else ""
                gain = r["details"].get("gain")
                print(f"  {r['t']:8.1f} {r['app']:10} {r['branch']:6} {r['old_dr']} -> {r['new_dr']}"
                      f"{'' if gain is None else f' gain {gain:.3f}'}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
