"""Is a fairer end reachable without a higher mean? Every static layout of a small random mix, against doing nothing.

    python -m benchmarks.frontier 165:calibrated 28:calibrated 174:gavel     # seed:interference
    python -m benchmarks.frontier 165:calibrated --scale 1 --json benchmarks/results/frontier.json

Issue 9 counts a run as worse than doing nothing (``observe`` from round-robin) if its final max
SD *or* its mean SD ends more than 0.01 above doing nothing's. Where ``fair`` always misses
(docs/reproduction.md, "Random mixes"), it mostly lowers the max SD and raises the mean. This
benchmark asks whether that is a trade the scenario forces: over every *static* layout (each
app's DR fixed for its whole run, ``benchmarks.static_layouts.evaluate``) of the random mix of
``seed`` (``benchmarks.random_mixes.random_mix``), is there one whose max SD is lower than doing
nothing's by at least ``--fairer`` (0.05) while its mean SD stays within +0.01 of doing nothing's?

Layouts: every combination of per-app DRs from the richest grid of ``app_ratio_grids`` that
gives at most ``--limit`` layouts (on 2 GPUs with 3 apps every DR; else each app alone on a GPU
or split over two GPUs, coarser as the apps grow). Every layout is simulated on runs shortened
by ``--scale`` (default 0.2; arrival times too); the fairer ones with the lowest mean SDs and the fairest ones are
simulated again at full length, and those are the numbers reported. Static layouts are a subset
of what a policy can do (a policy may move apps over time), so "none found" is evidence, not
proof, that the rule forbids every fairer end: a policy that moves apps may do better than any
fixed layout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from benchmarks.random_mixes import random_mix, simulate_mix
from benchmarks.static_layouts import Layout, describe, evaluate, shortened
from drbalance.argtypes import positive_int
from drbalance.ratio import DataRatio
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import Scenario

TOLERANCE = 0.01  # issue 9's "+0.01"


@dataclass(frozen=True)
class Point:
    """One layout's final SDs (SD units)."""

    layout: Layout
    max_sd: float
    mean_sd: float


def case(text: str) -> tuple[int, str]:
    """``SEED:INTERFERENCE``, e.g. ``165:calibrated``."""
    seed, _, interference = text.partition(":")
    if not seed.isdigit() or interference not in INTERFERENCE_MODELS:
        raise argparse.ArgumentTypeError(f"expected SEED:INTERFERENCE with INTERFERENCE one of "
                                         f"{', '.join(INTERFERENCE_MODELS)}; got {text!r}")
    return int(seed), interference


def app_ratio_grids(scenario: Scenario) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The DRs that may be tried for each app, richest first: every DR of the scenario's
    granularity (2 GPUs only), each GPU alone or split 2:8, 5:5 or 8:2 over two GPUs, split 5:5
    only, each GPU alone only."""
    m, total = scenario.gpus, scenario.dr_total
    singles = [DataRatio.single(m, g, total).shares for g in range(m)]

    def with_splits(parts: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        out = list(singles)
        for a, b in itertools.combinations(range(m), 2):
            for first, second in parts:
                shares = [0] * m
                shares[a], shares[b] = first, second
                out.append(tuple(shares))
        return out

    fifth, half = total // 5, total // 2
    grids = []
    if m == 2:
        grids.append(("every DR", [(share, total - share) for share in range(total, -1, -1)]))
    grids.append(("alone or split 2:8, 5:5, 8:2", with_splits([(fifth, total - fifth), (half, total - half),
                                                                (total - fifth, fifth)])))
    grids.append(("alone or split 5:5", with_splits([(half, total - half)])))
    grids.append(("alone", singles))
    return grids


def app_ratios(scenario: Scenario, limit: int) -> tuple[str, list[tuple[int, ...]]]:
    """The richest grid of ``app_ratio_grids`` with at most ``limit`` layouts (else the poorest)."""
    grids = app_ratio_grids(scenario)
    for name, options in grids:
        if len(options) ** len(scenario.apps) <= limit:
            return name, options
    return grids[-1]


def _evaluate(task: tuple[int, str, float, Layout]) -> Point:
    seed, interference, scale, layout = task
    result = evaluate(shortened(random_mix(seed), scale), layout, make_interference(interference))
    return Point(layout, result.max_sd, result.mean_sd)


def doing_nothing(seed: int, interference: str, scale: float) -> Point:
    """``observe`` from round-robin, as random_mixes runs it (its layout left empty)."""
    result = simulate_mix(shortened(random_mix(seed), scale), interference, "observe")
    return Point((), result.max_sd, result.mean_sd)


def explore(seed: int, interference: str, fairer_by: float, scale: float, workers: int,
            limit: int) -> dict[str, object]:
    """The question of the module docstring for one case, answered at full length."""
    scenario = random_mix(seed)
    grid, options = app_ratios(scenario, limit)
    count = len(options) ** len(scenario.apps)
    layouts = list(itertools.product(options, repeat=len(scenario.apps)))
    with ProcessPoolExecutor(max(1, workers)) as pool:
        short = list(pool.map(_evaluate, [(seed, interference, scale, layout) for layout in layouts], chunksize=16))
        base_short = doing_nothing(seed, interference, scale)
        # at the short length: the fairer layouts (by a little less than asked: lengths differ),
        # the lowest mean among them first, and the fairest layout of all
        fairer = sorted((p for p in short if p.max_sd <= base_short.max_sd - 0.5 * fairer_by),
                        key=lambda p: p.mean_sd)
        picks = fairer[:8] + sorted(short, key=lambda p: (p.max_sd, p.mean_sd))[:2]
        full = list(pool.map(_evaluate, [(seed, interference, 1.0, p.layout) for p in picks]))
    base = doing_nothing(seed, interference, 1.0)
    answering = [p for p in full if p.max_sd <= base.max_sd - fairer_by and p.mean_sd <= base.mean_sd + TOLERANCE]
    fairest = min(full, key=lambda p: (p.max_sd, p.mean_sd))
    lowest_mean = min((p for p in full if p.max_sd <= base.max_sd - fairer_by), key=lambda p: p.mean_sd, default=None)

    def show(point: Point | None) -> dict[str, object] | None:
        if point is None:
            return None
        return {"layout": describe(scenario, point.layout), "max_sd": round(point.max_sd, 4),
                "mean_sd": round(point.mean_sd, 4)}

    return {
        "case": f"{seed}:{interference}",
        "scenario": f"{len(scenario.apps)} apps on {scenario.gpus} GPUs"
                    + (f", speeds {list(scenario.gpu_speed)}" if scenario.gpu_speed else ""),
        "grid": grid,
        "layouts": count,
        "doing_nothing": {"max_sd": round(base.max_sd, 4), "mean_sd": round(base.mean_sd, 4)},
        "fairer_without_higher_mean": show(min(answering, key=lambda p: (p.mean_sd, p.max_sd), default=None)),
        "fairer_lowest_mean": show(lowest_mean),
        "fairest": show(fairest),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", type=case, help="SEED:INTERFERENCE of random_mixes")
    parser.add_argument("--fairer", type=float, default=0.05, help="max SD fall that counts as fairer (default 0.05)")
    parser.add_argument("--scale", type=float, default=0.2, help="run-length factor for the search (default 0.2)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--limit", type=positive_int, default=1500,
                        help="most layouts per case: the richest grid within it is used (default 1500)")
    parser.add_argument("--json", metavar="PATH", help="also write the answers here")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be within (0, 1]; got {args.scale}")
    if not args.fairer > 0:
        parser.error(f"--fairer must be > 0; got {args.fairer}")
    if args.limit < 1:
        parser.error(f"--limit must be >= 1; got {args.limit}")
    answers = []
    for seed, interference in args.cases:
        found = explore(seed, interference, args.fairer, args.scale, args.workers, args.limit)
        answers.append(found)
        base = found["doing_nothing"]
        print(f"{found['case']:16} {found['scenario']}, {found['layouts']} layouts ({found['grid']}); doing nothing "
              f"{base['max_sd']:.3f} / {base['mean_sd']:.3f} (max / mean SD)")
        for key in ("fairer_without_higher_mean", "fairer_lowest_mean", "fairest"):
            point = found[key]
            text = "none" if point is None else f"{point['max_sd']:.3f} / {point['mean_sd']:.3f}  {point['layout']}"
            print(f"    {key.replace('_', ' '):28} {text}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"command": "python -m benchmarks.frontier " + " ".join(sys.argv[1:] if argv is None else argv),
                       "fairer": args.fairer, "scale": args.scale, "answers": answers}, out, indent=1)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
