"""Mixes beyond the paper's scenarios, and `fair` against doing nothing on each.

    python -m drbalance.sim.mixes                    # every mix, fair vs observe, both interference models
    python -m drbalance.sim.mixes --only 64x16 --policies fair,paper
    python -m drbalance.sim.mixes --only 64x16,128x32 --placement spread   # the policies start spread

``observe`` (doing nothing) always runs from round-robin: the baseline. ``--placement``
picks where the other policies start (``spread``: every app as evenly over the GPUs as its DR
allows, plain DataParallel's layout), so ``ok`` means "not worse than doing nothing from
round-robin" from either start.

Every mix is built from a fixed seed, so anyone gets the same apps:

- ``8x12``: 12 apps (the six models, twice) on 8 GPUs, all at t = 0, equal run lengths.
- ``staggered``: 10 apps on 4 GPUs arriving one every 3 minutes.
- ``mixed-lengths``: 12 apps on 6 GPUs at t = 0, solo run lengths from 5 to 60 minutes.
- ``64x16`` and ``128x32``: the six models mixed, run lengths 10-30 minutes, arrivals spread over
  the first 10 minutes (the simulator benchmark's scenario).
- ``hetero``: scenario (a) on GPUs of speeds 1, 1, 0.5, 0.5.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from types import MappingProxyType

from drbalance.argtypes import names_from, positive_int
from drbalance.policy import POLICIES
from drbalance.sim.engine import SimConfig, simulate
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import PLACEMENTS, SCENARIOS, Scenario, load_scenario, sized_app

MODELS = ("densenet121", "resnet50", "alexnet", "resnext50_32x4d", "shufflenet_v2_x1_0", "mnasnet1_0")


def batch_of(model: str) -> int:
    return 128 if model == "alexnet" else 32


def arrivals_mix(apps: int = 64, gpus: int = 16, seed: int = 11) -> Scenario:
    """The six models mixed, run lengths 10-30 min alone, arrivals over the first 10 minutes."""
    rng = random.Random(seed)
    specs = []
    for index in range(apps):
        model = MODELS[index % len(MODELS)]
        specs.append(sized_app(f"app{index}", model, batch_of(model), rng.uniform(600, 1800), 10,
                               arrival=rng.uniform(0, 600)))
    return Scenario(f"{apps}x{gpus}", gpus, tuple(specs), f"{apps} apps on {gpus} GPUs, arriving over 10 min")


def eight_by_twelve() -> Scenario:
    specs = tuple(sized_app(f"{model.split('_')[0]}-{copy}", model, batch_of(model), 1800, 10)
                  for copy in (1, 2) for model in MODELS)
    return Scenario("8x12", 8, specs, "12 apps (the six models twice) on 8 GPUs")


def staggered() -> Scenario:
    specs = tuple(sized_app(f"s{index}", MODELS[index % 6], batch_of(MODELS[index % 6]), 1200, 10,
                            arrival=180.0 * index) for index in range(10))
    return Scenario("staggered", 4, specs, "10 apps on 4 GPUs, one arriving every 3 minutes")


def mixed_lengths(seed: int = 5) -> Scenario:
    rng = random.Random(seed)
    specs = tuple(sized_app(f"m{index}", MODELS[index % 6], batch_of(MODELS[index % 6]), rng.uniform(300, 3600), 10)
                  for index in range(12))
    return Scenario("mixed-lengths", 6, specs, "12 apps on 6 GPUs, 5 to 60 minutes alone")


def heterogeneous() -> Scenario:
    return replace(SCENARIOS["a"], name="hetero", gpu_speed=(1.0, 1.0, 0.5, 0.5),
                   description="scenario (a) on GPUs of speeds 1, 1, 0.5, 0.5")


MIXES: Mapping[str, Callable[[], Scenario]] = MappingProxyType({
    "8x12": eight_by_twelve,
    "staggered": staggered,
    "mixed-lengths": mixed_lengths,
    "hetero": heterogeneous,
    "64x16": arrivals_mix,
    "128x32": lambda: arrivals_mix(128, 32, seed=13),
})


def scenario_named(name: str) -> Scenario:
    """A mix of ``MIXES`` by name, else ``load_scenario``'s (a built-in name or a .json file;
    ValueError naming the known ones otherwise)."""
    if name in MIXES:
        return MIXES[name]()
    try:
        return load_scenario(name)
    except ValueError as error:
        raise ValueError(f"{error}; or a mix: {', '.join(MIXES)}") from None


NOT_WORSE_MARGIN = 0.01  # SD units: how far above doing nothing a policy's max and mean SD may end


def not_worse(max_sd: float, mean_sd: float, baseline_max_sd: float, baseline_mean_sd: float) -> bool:
    """The rule "never worse than doing nothing" holds when a run's final max SD and mean SD are each at
    most the baseline's (``observe``) + ``NOT_WORSE_MARGIN``."""
    return max_sd <= baseline_max_sd + NOT_WORSE_MARGIN and mean_sd <= baseline_mean_sd + NOT_WORSE_MARGIN


def final(job: tuple[str, str, str, str]) -> tuple[float, float, float]:
    """(spread, max SD, mean SD) at the end of one run of (mix, policy, interference, placement)."""
    mix, policy, interference, placement = job
    result = simulate(MIXES[mix](), SimConfig(policy=policy, placement=placement, record=False,
                                              contention=make_interference(interference)))
    return result.sd_spread, result.max_sd, result.mean_sd


def table(mixes: list[str], policies: list[str], workers: int = 2, placement: str = "round-robin") -> str:
    """The markdown table: per interference model and mix, ``observe`` from round-robin and each
    policy from ``placement`` (final spread / max SD / mean SD, and ok or WORSE)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}")
    jobs = [(mix, policy, interference, "round-robin" if policy == "observe" else placement)
            for interference in INTERFERENCE_MODELS for mix in mixes for policy in ["observe", *policies]]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        results = {job[:3]: found for job, found in zip(jobs, pool.map(final, jobs))}
    start = "" if placement == "round-robin" else f" (from {placement})"
    lines = ["| interference | mix | observe | " + " | ".join(policy + start for policy in policies) + " |",
             "|---|---|---|" + "---|" * len(policies)]
    for interference in INTERFERENCE_MODELS:
        for mix in mixes:
            base = results[(mix, "observe", interference)]
            cells = []
            for policy in policies:
                got = results[(mix, policy, interference)]
                ok = not_worse(got[1], got[2], base[1], base[2])
                cells.append(f"{got[0]:.3f} / {got[1]:.3f} / {got[2]:.3f} {'ok' if ok else 'WORSE'}")
            lines.append(f"| {interference} | {mix} | {base[0]:.3f} / {base[1]:.3f} / {base[2]:.3f} | "
                         + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: final SD spread / max SD / mean SD; ok = max and mean SD at most observe's "
                 f"+ {NOT_WORSE_MARGIN}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=names_from(MIXES, "mixes"), default=list(MIXES), help="comma-separated mixes")
    parser.add_argument("--policies", type=names_from(POLICIES, "policies"), default=["fair"],
                        help="comma-separated policies besides observe")
    parser.add_argument("--placement", choices=PLACEMENTS, default="round-robin",
                        help="where the policies start (observe always starts round-robin)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel")
    args = parser.parse_args(argv)
    print(table(args.only, args.policies, args.workers, args.placement))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
