"""The best *static* layout of a scenario: every app's DR fixed for the whole run (an upper-bound witness).

    python -m benchmarks.static_layouts a b c --interference gavel      # about 2 minutes a scenario
    python -m benchmarks.static_layouts b --scale 0.05 --starts 3 --markdown

A layout gives every app one DR for its whole run; nothing moves (policy ``observe`` from
explicit initial DRs), in the real simulator under the chosen interference model. What the best
layout reaches, some DR policy can reach (a policy that sets these DRs at registration and never
moves them), so it is an *upper* bound on the best max SD, beside ``drbalance.sim.bound``'s lower
bounds; a layout that beats ``fair`` shows headroom.

Search: every single-GPU layout (each app alone on one GPU or sharing, i.e. every way to cut the
apps into at most m groups; GPUs of equal speed and identical apps are interchangeable, so each
layout is simulated once), on runs and arrival times shortened by ``--scale`` (SDs change by about 1% at 0.05;
``gavel``, scenario (a), observe: 3.44 against 3.41). Then from the ``--starts`` best, a
hill-climb: change one app's DR to any single GPU, any even half over two GPUs, or even over all
GPUs, keep the best change, until none improves. The best layouts found are simulated at full
length (the numbers reported). Ranking: max SD, then the SD spread.

Not exhaustive over split layouts (there are 11^N of the candidate DRs alone), so the result is a
witness of what is reachable, not the optimum of static layouts.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from drbalance.argtypes import positive_int
from drbalance.ratio import DataRatio
from drbalance.report.metrics import summarise
from drbalance.sim.command import to_run
from drbalance.sim.engine import SimConfig, simulate
from drbalance.sim.model import INTERFERENCE_MODELS, Interference, make_interference
from drbalance.workload.scenarios import Scenario, load_scenario

Layout = tuple[tuple[int, ...], ...]  # one DR (shares) per app


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    max_sd: float
    spread: float
    mean_sd: float
    util: float | None = None

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.max_sd, 6), round(self.spread, 6))


def with_layout(scenario: Scenario, layout: Layout) -> Scenario:
    """The scenario with every app's initial DR set to the layout's."""
    if len(layout) != len(scenario.apps):
        raise ValueError(f"layout has {len(layout)} DRs for {len(scenario.apps)} apps")
    apps = tuple(replace(app, ratio=tuple(shares)) for app, shares in zip(scenario.apps, layout))
    return replace(scenario, apps=apps)


def evaluate(scenario: Scenario, layout: Layout, contention: Interference, full: bool = False) -> LayoutResult:
    """Simulate the layout with nothing moved; ``full``: also the time-averaged utilisation."""
    fixed = with_layout(scenario, layout)
    result = simulate(fixed, SimConfig(policy="observe", record=full, contention=contention))
    util = None
    if full:
        util = summarise(to_run(result, "static", fixed), step=max(1.0, result.makespan / 2000)).mean_util
    return LayoutResult(layout, result.max_sd, result.sd_spread, result.mean_sd, util)


def set_partitions(count: int, blocks: int) -> list[tuple[int, ...]]:
    """Every assignment of ``count`` items to at most ``blocks`` unlabelled groups (restricted growth strings)."""
    out: list[tuple[int, ...]] = []

    def grow(prefix: list[int], used: int) -> None:
        if len(prefix) == count:
            out.append(tuple(prefix))
            return
        for group in range(min(used + 1, blocks)):
            grow(prefix + [group], max(used, group + 1))

    grow([], 0)
    return out


def single_gpu_layouts(scenario: Scenario) -> list[Layout]:
    """Every single-GPU layout, once per class of layouts equal up to swapping GPUs of equal speed
    and identical apps (GPUs of different speeds: every labelled assignment)."""
    m, total = scenario.gpus, scenario.dr_total
    kinds = [(app.model, app.batch, app.iterations, app.arrival) for app in scenario.apps]
    uniform = len({scenario.speed(g) for g in range(m)}) == 1
    if uniform:
        assignments = set_partitions(len(kinds), m)
    else:
        import itertools
        assignments = list(itertools.product(range(m), repeat=len(kinds)))
    seen, layouts = set(), []
    for assignment in assignments:
        if uniform:
            key = tuple(sorted(tuple(sorted(kinds[i] for i, g in enumerate(assignment) if g == group))
                               for group in set(assignment)))
        else:
            key = tuple(sorted((kinds[i], g) for i, g in enumerate(assignment)))
        if key in seen:
            continue
        seen.add(key)
        layouts.append(tuple(DataRatio.single(m, g, total).shares for g in assignment))
    return layouts


def candidate_ratios(scenario: Scenario) -> list[tuple[int, ...]]:
    """The DRs the hill-climb tries for one app: each single GPU, each even half over two GPUs,
    even over all."""
    m, total = scenario.gpus, scenario.dr_total
    out = [DataRatio.single(m, g, total).shares for g in range(m)]
    if total % 2 == 0:
        for a in range(m):
            for b in range(a + 1, m):
                shares = [0] * m
                shares[a] = shares[b] = total // 2
                out.append(tuple(shares))
    even = DataRatio.even(m, total).shares
    if even not in out:
        out.append(even)
    return out


def hill_climb(scenario: Scenario, start: LayoutResult, contention: Interference) -> LayoutResult:
    best = start
    candidates = candidate_ratios(scenario)
    while True:
        improved = best
        for index in range(len(best.layout)):
            for shares in candidates:
                if shares == best.layout[index]:
                    continue
                layout = best.layout[:index] + (shares,) + best.layout[index + 1:]
                trial = evaluate(scenario, layout, contention)
                if trial.key < improved.key:
                    improved = trial
        if improved is best:
            return best
        best = improved


def shortened(scenario: Scenario, scale: float) -> Scenario:
    """The scenario with every run and every arrival time ``scale`` times as long (the order of
    arrivals and finishes is kept roughly as at full length)."""
    if scale == 1.0:
        return scenario
    shorter = scenario.scaled(scale)
    return replace(shorter, apps=tuple(replace(app, arrival=app.arrival * scale) for app in shorter.apps))


def search(scenario: Scenario, contention: Interference, scale: float = 0.05, starts: int = 3,
           log=None) -> tuple[LayoutResult, LayoutResult]:
    """(best single-GPU layout, best layout after the hill-climb), both re-simulated at full length."""
    short = shortened(scenario, scale)
    singles = sorted((evaluate(short, layout, contention) for layout in single_gpu_layouts(scenario)),
                     key=lambda r: r.key)
    if log:
        log(f"  {len(singles)} single-GPU layouts; best at scale {scale}: max SD {singles[0].max_sd:.3f}")
    climbed = [hill_climb(short, start, contention) for start in singles[:starts]]
    best_climbed = min(climbed, key=lambda r: r.key)
    if log:
        log(f"  hill-climb: max SD {best_climbed.max_sd:.3f} at scale {scale}")
    return (evaluate(scenario, singles[0].layout, contention, full=True),
            evaluate(scenario, best_climbed.layout, contention, full=True))


def describe(scenario: Scenario, layout: Layout) -> str:
    """E.g. ``GPU0: dense1 + alex1 | GPU1: res1 | dense2 on 0,1 (5/5)``."""
    groups: dict[int, list[str]] = {}
    splits = []
    for app, shares in zip(scenario.apps, layout):
        used = [g for g, share in enumerate(shares) if share]
        if len(used) == 1:
            groups.setdefault(used[0], []).append(app.name)
        else:
            splits.append(f"{app.name} on {','.join(map(str, used))} ({'/'.join(str(shares[g]) for g in used)})")
    parts = [f"GPU{g}: {' + '.join(names)}" for g, names in sorted(groups.items())]
    return " | ".join(parts + splits)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help="built-in scenario names or scenario files")
    parser.add_argument("--interference", default="gavel", choices=list(INTERFERENCE_MODELS))
    parser.add_argument("--scale", type=float, default=0.05, help="run-length factor for the search (default 0.05)")
    parser.add_argument("--starts", type=positive_int, default=3, help="single-GPU layouts the hill-climb starts from")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table row per scenario")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be within (0, 1]; got {args.scale}")
    if args.starts < 1:
        parser.error(f"--starts must be >= 1; got {args.starts}")
    contention = make_interference(args.interference)
    rows = []
    for name in args.scenarios:
        scenario = load_scenario(name)
        started = time.perf_counter()
        print(f"scenario {scenario.name} ({args.interference}):", file=sys.stderr)
        single, best = search(scenario, contention, args.scale, args.starts,
                              log=lambda line: print(line, file=sys.stderr))
        spent = time.perf_counter() - started
        for label, result in (("best single-GPU", single), ("best found", best)):
            line = (f"{scenario.name} {label}: max SD {result.max_sd:.3f}, spread {result.spread:.3f}, "
                    f"mean SD {result.mean_sd:.3f}, util {result.util:.0f}%: {describe(scenario, result.layout)}")
            print(line)
        print(f"  ({spent:.0f} s)")
        rows.append(f"| ({scenario.name}) | {single.spread:.3f} / {single.max_sd:.3f} / {single.mean_sd:.3f} / "
                    f"{single.util:.0f}% | {best.spread:.3f} / {best.max_sd:.3f} / {best.mean_sd:.3f} / "
                    f"{best.util:.0f}% | {describe(scenario, best.layout)} |")
    if args.markdown:
        print("| scenario | best single-GPU layout | best layout found | layout |")
        print("|---|---|---|---|")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
