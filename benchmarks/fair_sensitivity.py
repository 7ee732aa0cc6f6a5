"""How much `fair`'s results on (a), (b), (c) move when its knobs move a little.

    python -m benchmarks.fair_sensitivity                       # calibrated, both placements, 8 variants
    python -m benchmarks.fair_sensitivity --interference gavel --workers 2
    python -m benchmarks.fair_sensitivity --short               # the demo's short runs against observe
    python -m benchmarks.fair_sensitivity --short staggered mixed-lengths --cadences own   # mixes too

One simulated run is deterministic, but the outcome of a run is sensitive to small changes: a
decision window 1% longer shifts every decision point, which changes which moves are judged on
which windows, and a different early move can leave a different layout for the rest of the run.
A single run per scenario (docs/reproduction.md's tables) can therefore pass or miss a target by
luck. This benchmark runs `fair` on each scenario and placement for a few nearby variants:

- the decision window (``FairConfig.window_fraction``) at 98%, 99%, 101% and 102% of its default,
- the report period (``SimConfig.report_every``, iterations between an app's records) at 3, 4, 6,
- and the defaults,

and prints, per row, the mean and the range of the final SD spread, max SD, mean SD and the
time-averaged utilisation, and how many variants meet issue 9's targets (spread <= 0.10,
max SD <= 1.25 for (a) and (c) and <= 1.31 for (b), utilisation >= 83%). No torch is imported.

``--short`` runs the scaled-down scenarios of the demo and the end-to-end tests (demo-a, e2e-a,
e2e-skewed: about ten iterations per app) under both interference models, for the same variants
with the policy's own decision cadence and with a decision every 2 iterations (the demo's
``--decide-every``), and counts the runs in which `fair` is not worse than doing nothing
(`observe` from the scenario's placement): final max SD and mean SD at most its + 0.01. Names
after ``--short`` (scenarios, or mixes of ``drbalance.sim.mixes``) replace the three;
``--cadences own`` leaves out the decision every 2 iterations (slow and beside the point for
runs of thousands of iterations).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from statistics import mean

from drbalance.argtypes import positive_int
from drbalance.policy.fair import FairConfig, FairPolicy
from drbalance.sim import mixes
from drbalance.sim.engine import SimConfig
from drbalance.sim.model import INTERFERENCE_MODELS
from drbalance.sim.reproduce import Outcome, measure

MAX_SD_TARGET = {"a": 1.25, "b": 1.31, "c": 1.25}
SPREAD_TARGET = 0.10
UTIL_TARGET = 83.0
WINDOW_FACTORS = (0.98, 0.99, 1.01, 1.02)
REPORT_PERIODS = (3, 4, 6)
SHORT_SCENARIOS = ("demo-a", "e2e-a", "e2e-skewed")
SHORT_DECIDE_EVERY = (None, 2)  # the policy's own cadence, and the demo's


def cadence_label(decide_every: int | None) -> str:
    """How ``--cadences`` names a decision cadence: 'own' (the policy's) or an iteration count."""
    return "own" if decide_every is None else str(decide_every)


@dataclass(frozen=True)
class Variant:
    """One perturbation: a factor on the default decision window, and the report period (iterations)."""

    window_factor: float = 1.0
    report_every: int = SimConfig.report_every
    decide_every: int | None = None  # iterations between decisions besides the policy's own

    @property
    def label(self) -> str:
        if self.window_factor != 1.0:
            label = f"window x{self.window_factor:g}"
        elif self.report_every != SimConfig.report_every:
            label = f"report every {self.report_every}"
        else:
            label = "defaults"
        return label if self.decide_every is None else f"{label}, decide every {self.decide_every}"


def meets_targets(outcome: Outcome, scenario: str) -> bool:
    """Whether one run meets issue 9's spread, max-SD and utilisation targets for the scenario."""
    return (outcome.spread <= SPREAD_TARGET and outcome.max_sd <= MAX_SD_TARGET[scenario]
            and outcome.util >= UTIL_TARGET)


def variants(decide_every: int | None = None) -> list[Variant]:
    """The defaults, then the window factors, then the report periods."""
    return ([Variant(decide_every=decide_every)]
            + [Variant(window_factor=f, decide_every=decide_every) for f in WINDOW_FACTORS]
            + [Variant(report_every=r, decide_every=decide_every) for r in REPORT_PERIODS])


def run_one(job: tuple[str, str, str, Variant]) -> Outcome:
    """Simulate `fair` on one scenario and placement under one interference model and variant."""
    name, placement, interference, variant = job
    defaults = FairConfig()
    policy = FairPolicy(replace(defaults, window_fraction=defaults.window_fraction * variant.window_factor))
    return measure(name, placement, "fair", interference, variant.decide_every, report_every=variant.report_every,
                   policy_object=policy)


def _cell(values: list[float], digits: int) -> str:
    return f"{mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(interference: str, workers: int) -> str:
    """A markdown table: per scenario and placement, mean (min-max) over the variants, and targets met."""
    rows = [(name, placement) for name in ("a", "b", "c") for placement in ("round-robin", "spread")]
    chosen = variants()
    jobs = [(name, placement, interference, variant) for name, placement in rows for variant in chosen]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run_one, jobs))
    lines = [
        f"| scenario | placement | spread | max SD | mean SD | utilisation % | variants meeting every target "
        f"(of {len(chosen)}) | defaults |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, (name, placement) in enumerate(rows):
        mine = results[index * len(chosen):(index + 1) * len(chosen)]
        met = sum(meets_targets(r, name) for r in mine)
        missed = [v.label for v, r in zip(chosen, mine) if not meets_targets(r, name)]
        base = mine[0]
        lines.append(
            f"| ({name}) | {placement} | {_cell([r.spread for r in mine], 3)} | {_cell([r.max_sd for r in mine], 3)} "
            f"| {_cell([r.mean_sd for r in mine], 3)} | {_cell([r.util for r in mine], 1)} | {met}"
            + (f" (missed: {', '.join(missed)})" if missed else "")
            + f" | {base.spread:.3f} / {base.max_sd:.3f} / {base.mean_sd:.3f} / {base.util:.1f}% |")
    return "\n".join(lines)


def not_worse(outcome: Outcome, baseline: Outcome) -> bool:
    """``drbalance.sim.mixes.not_worse`` for two outcomes."""
    return mixes.not_worse(outcome.max_sd, outcome.mean_sd, baseline.max_sd, baseline.mean_sd)


def short_table(workers: int, names: tuple[str, ...] = SHORT_SCENARIOS,
                cadences: tuple[int | None, ...] = SHORT_DECIDE_EVERY) -> str:
    """A markdown table: per scenario and interference model, `fair` over the variants (each
    decision cadence: None is the policy's own) against `observe`, and how many runs are not worse."""
    rows = [(name, interference) for name in names for interference in sorted(INTERFERENCE_MODELS)]
    chosen = [v for every in cadences for v in variants(every)]
    jobs = [(name, "round-robin", interference, variant) for name, interference in rows for variant in chosen]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        baselines = list(pool.map(measure, [name for name, _ in rows], ["round-robin"] * len(rows),
                                  ["observe"] * len(rows), [interference for _, interference in rows]))
        results = list(pool.map(run_one, jobs))
    lines = [
        f"| scenario | interference | `observe`: max / mean SD | `fair`: max SD | `fair`: mean SD "
        f"| runs not worse (of {len(chosen)}) | not worse, per cadence: "
        + " / ".join("own" if every is None else f"every {every}" for every in cadences) + " |",
        "|---|---|---|---|---|---|---|",
    ]
    per = len(chosen) // len(cadences)
    for index, ((name, interference), base) in enumerate(zip(rows, baselines)):
        mine = results[index * len(chosen):(index + 1) * len(chosen)]
        ok = [not_worse(r, base) for r in mine]
        lines.append(
            f"| {name} | {interference} | {base.max_sd:.3f} / {base.mean_sd:.3f} "
            f"| {_cell([r.max_sd for r in mine], 3)} | {_cell([r.mean_sd for r in mine], 3)} "
            f"| {sum(ok)} | {' / '.join(str(sum(ok[i:i + per])) for i in range(0, len(ok), per))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interference", choices=sorted(INTERFERENCE_MODELS), default="calibrated",
                        help="contention model of the simulator (default: calibrated)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--short", nargs="*", metavar="SCENARIO",
                        help="fair against observe, both interference models, on these scenarios or mixes "
                             f"(default: {', '.join(SHORT_SCENARIOS)})")
    default_cadences = ",".join(cadence_label(every) for every in SHORT_DECIDE_EVERY)
    parser.add_argument("--cadences", default=default_cadences,
                        help=f"with --short: decision cadences, 'own' (the policy's) or iterations "
                             f"(default {default_cadences})")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.short is not None:
        try:
            cadences = tuple(None if part == "own" else int(part) for part in args.cadences.split(","))
        except ValueError:
            parser.error(f"--cadences: 'own' or iteration counts, comma-separated; got {args.cadences!r}")
        if not cadences or any(every is not None and every < 1 for every in cadences):
            parser.error(f"--cadences: 'own' or iteration counts >= 1; got {args.cadences!r}")
        print(short_table(args.workers, tuple(args.short) or SHORT_SCENARIOS, cadences))
    else:
        print(table(args.interference, args.workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
