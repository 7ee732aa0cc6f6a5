"""`fair` against doing nothing on scenarios drawn at random: how often a policy ends worse.

    python -m benchmarks.random_mixes                          # seeds 0-199, fair vs observe, both models
    python -m benchmarks.random_mixes --seeds 0:20 --policies fair,f-sched
    python -m benchmarks.random_mixes --json benchmarks/results/random_mixes.json
    python -m benchmarks.random_mixes --set swap_partners=1   # fair with a knob of FairConfig changed
    python -m benchmarks.random_mixes --max-gpus 3 --jitter 0.05 --noise-seeds 0,1   # small servers, under noise
    python -m benchmarks.random_mixes --draw wide --seeds 1000:1100   # the wide draw (wide_mix)
    python -m benchmarks.random_mixes --seeds 200:400                 # held out: never used to tune fair

The mixes of ``drbalance.sim.mixes`` and the paper's scenarios were the ones `fair` was tuned
on. Here each seed draws its own scenario (``random_mix``): 2, 3, 4, 6 or 8 GPUs (4 twice as
likely); between one more app than GPUs and 2.5 apps per GPU, each of the six models at random
with run lengths of 5 to 40 minutes alone; half the seeds start every app at t = 0, the others
spread arrivals over the first 15 minutes; a quarter give the GPUs speeds of 1, 0.75 or 0.5.
Every run starts from round-robin placement; ``observe`` from round-robin (nothing moved) is
the reference, and a run is *worse* when its final max SD or mean SD exceeds observe's by more
than ``drbalance.sim.mixes.NOT_WORSE_MARGIN`` (the never-worse rule). No torch is imported; about 8
minutes for the 200 seeds on 2 cores.

A single run is chaotic (a 1% longer decision window can leave another layout), so a change that
turns one run from worse to not worse may only have drawn another outcome. ``--jitter X`` gives
every host phase and chunk a random spread X (the simulator's ``SimConfig.jitter``) and
``--noise-seeds`` repeats every run under each seed of that noise, ``observe`` under the same
seed as the policy it is compared with; the summary then names the scenarios that were worse
under every noise seed. ``--max-gpus N`` keeps only the seeds whose mix has at most N GPUs
(74 of the 200 seeds have 2 or 3 GPUs).

Seeds 0-199 (and 1000-1099 of the wide draw) are the ones `fair`'s settings were chosen on;
seeds 200-399 (and 1100-1299 of the wide draw) are held out: choose a change on the first, report
it on both (docs/reproduction.md, "Random mixes").

``--draw wide`` turns each seed into a scenario of another draw (``wide_mix``): what the default
draw never tries (fewer apps than GPUs, batches other than 32, epochs other than 10, runs of 2
minutes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from drbalance.argtypes import names_from, positive_int, relative_spread
from drbalance.policy import POLICIES
from drbalance.policy.fair import FairConfig, FairPolicy
from drbalance.sim.engine import SimConfig, SimResult, Simulation
from drbalance.sim.mixes import MODELS, batch_of, not_worse
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import Scenario, sized_app

GPU_COUNTS = (2, 3, 4, 4, 6, 8)
SOLO_SECONDS = (300.0, 2400.0)  # each app's run length alone on one GPU, drawn uniformly
ARRIVAL_SPREAD = 900.0  # seconds over which arrivals are spread, for the seeds that spread them
GPU_SPEEDS = (1.0, 0.75, 0.5)


def random_mix(seed: int) -> Scenario:
    """The scenario of ``seed`` (the same for everyone: ``random.Random(seed)``), of the default draw."""
    rng = random.Random(seed)
    gpus = rng.choice(GPU_COUNTS)
    apps = max(gpus + 1, round(gpus * rng.uniform(1.0, 2.5)))
    together = rng.random() < 0.5
    specs = []
    for index in range(apps):
        model = rng.choice(MODELS)
        specs.append(sized_app(f"r{index}", model, batch_of(model), rng.uniform(*SOLO_SECONDS), 10,
                               arrival=0.0 if together else rng.uniform(0.0, ARRIVAL_SPREAD)))
    speeds = tuple(rng.choice(GPU_SPEEDS) for _ in range(gpus)) if rng.random() < 0.25 else None
    return Scenario(f"random-{seed}", gpus, tuple(specs), f"{apps} apps on {gpus} GPUs, drawn from seed {seed}",
                    gpu_speed=speeds)


WIDE_BATCHES = (16, 32, 64, 128)
WIDE_ALEXNET_BATCHES = (64, 128, 256)
WIDE_EPOCHS = (2, 5, 10, 20)
WIDE_SOLO_SECONDS = (120.0, 3600.0)
WIDE_ARRIVAL_SPREAD = 1200.0


def wide_mix(seed: int) -> Scenario:
    """The scenario of ``seed`` in the wide draw: what a user might try beside the default draw
    (which ``fair`` was tuned on). Fewer apps than GPUs are possible (0.75
    to 2.5 apps per GPU, at least 2 apps), batches of 16 to 128 samples (AlexNet 64 to 256),
    2, 5, 10 or 20 epochs, 2 to 60 minutes alone, arrivals over 20 minutes for half the seeds;
    GPUs of one speed."""
    rng = random.Random(seed)
    gpus = rng.choice(GPU_COUNTS)
    apps = max(2, round(gpus * rng.uniform(0.75, 2.5)))
    together = rng.random() < 0.5
    specs = []
    for index in range(apps):
        model = rng.choice(MODELS)
        batch = rng.choice(WIDE_ALEXNET_BATCHES if model == "alexnet" else WIDE_BATCHES)
        specs.append(sized_app(f"r{index}", model, batch, rng.uniform(*WIDE_SOLO_SECONDS), rng.choice(WIDE_EPOCHS),
                               arrival=0.0 if together else rng.uniform(0.0, WIDE_ARRIVAL_SPREAD)))
    return Scenario(f"wide-{seed}", gpus, tuple(specs), f"{apps} apps on {gpus} GPUs, wide draw, seed {seed}")


DRAWS: Mapping[str, Callable[[int], Scenario]] = MappingProxyType({"default": random_mix, "wide": wide_mix})
"""How a seed becomes a scenario (``--draw``)."""


@dataclass(frozen=True)
class Run:
    """One simulated run's final SDs (spread, max, mean: SD units)."""

    seed: int
    interference: str
    policy: str
    spread: float
    max_sd: float
    mean_sd: float
    noise: int = 0  # the seed of the jitter's noise (0 without jitter)
    churn: tuple[float, ...] = ()  # per app, its DR changes per hour of its run (simulated seconds)


def churn(result: SimResult) -> tuple[float, ...]:
    """Per app of a run, its DR changes per hour of its run."""
    return tuple(3600.0 * result.changes[name] / seconds for name, seconds in result.run_seconds.items()
                 if seconds > 0)


Knobs = tuple[tuple[str, object], ...]  # FairConfig fields and the values that replace their defaults


def simulate_mix(scenario: Scenario, interference: str, policy: str, knobs: Knobs = (), jitter: float = 0.0,
                 noise: int = 0) -> SimResult:
    """Simulate a scenario under one policy and interference model, from round-robin, as the
    sweep does; ``fair`` with ``knobs`` replacing FairConfig's defaults; with ``jitter`` (a relative
    spread, ``SimConfig.jitter``) drawn from the noise seed ``noise``."""
    config = SimConfig(policy=policy, placement="round-robin", record=False,
                       contention=make_interference(interference), jitter=jitter, seed=noise)
    return Simulation(scenario, config, policy=fair_with(policy, knobs)).run()


def fair_with(policy: str, knobs: Knobs) -> FairPolicy | None:
    """``fair`` with ``knobs`` replacing FairConfig's defaults if ``policy`` is fair and there are
    knobs; else None (the simulation makes the registry's policy)."""
    return FairPolicy(replace(FairConfig(), **dict(knobs))) if policy == "fair" and knobs else None


def add_knob_option(parser: argparse.ArgumentParser) -> None:
    """``--set NAME=VALUE`` (repeatable): a FairConfig knob changed; read with ``parsed_knobs``."""
    parser.add_argument("--set", type=knob, action="append", default=[], metavar="NAME=VALUE",
                        help="run fair with this FairConfig knob changed (repeatable), e.g. swap_partners=1")


def parsed_knobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Knobs:
    """The ``--set`` knobs, checked by FairConfig (a value it refuses is a usage error)."""
    try:
        replace(FairConfig(), **dict(args.set))
    except ValueError as error:
        parser.error(str(error))
    return tuple(args.set)


def run(job: tuple[int, str, str], knobs: Knobs = (), jitter: float = 0.0, noise: int = 0,
        draw: str = "default") -> Run:
    """Simulate the seed's scenario of ``draw`` (``DRAWS``) under one policy and interference
    model (``simulate_mix``)."""
    seed, interference, policy = job
    result = simulate_mix(DRAWS[draw](seed), interference, policy, knobs, jitter, noise)
    return Run(seed, interference, policy, result.sd_spread, result.max_sd, result.mean_sd, noise, churn(result))


def _run_with(task: tuple[tuple[int, str, str], Knobs, float, int, str]) -> Run:
    return run(*task)


def sweep(seeds: Sequence[int], policies: list[str], workers: int = 2, knobs: Knobs = (), jitter: float = 0.0,
          noise: int = 0, draw: str = "default") -> dict[tuple[int, str, str], Run]:
    """Every seed under both interference models, ``observe`` and each policy (under one noise seed)."""
    jobs = [(seed, interference, policy) for seed in seeds for interference in INTERFERENCE_MODELS
            for policy in ["observe", *policies]]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        return dict(zip(jobs, pool.map(_run_with, [(job, knobs, jitter, noise, draw) for job in jobs])))


def small_servers(seeds: Sequence[int], max_gpus: int | None, draw: str = "default") -> list[int]:
    """The seeds whose mix has at most ``max_gpus`` GPUs (all of them for None)."""
    return [seed for seed in seeds if max_gpus is None or DRAWS[draw](seed).gpus <= max_gpus]


def knob(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` for a number field of FairConfig, VALUE read as that field's type."""
    name, _, value = text.partition("=")
    defaults = FairConfig()
    numbers = {field.name: type(getattr(defaults, field.name)) for field in fields(FairConfig)
               if type(getattr(defaults, field.name)) in (int, float)}
    if name not in numbers or not value:
        raise argparse.ArgumentTypeError(f"--set takes NAME=VALUE with NAME one of {', '.join(sorted(numbers))}; "
                                         f"got {text!r}")
    try:
        return name, numbers[name](value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} takes a {numbers[name].__name__}; got {value!r}") from None


def worse(got: Run, base: Run) -> bool:
    """Whether ``got`` ends worse than doing nothing (``base``, observe) by the never-worse rule."""
    return not not_worse(got.max_sd, got.mean_sd, base.max_sd, base.mean_sd)


def report(results: dict[tuple[int, str, str], Run], seeds: Sequence[int], policies: list[str],
           draw: str = "default") -> str:
    """One line per seed and model (observe's max / mean SD, each policy's spread / max / mean and
    whether it is worse), then per policy and model the count of worse runs."""
    lines = []
    counts = {(policy, interference): 0 for policy in policies for interference in INTERFERENCE_MODELS}
    for seed in seeds:
        scenario = DRAWS[draw](seed)
        shape = f"{scenario.gpus}x{len(scenario.apps)}{' speeds' if scenario.gpu_speed else ''}"
        for interference in INTERFERENCE_MODELS:
            base = results[(seed, interference, "observe")]
            cells = [f"seed {seed:3d} {shape:10s} {interference:10s} observe {base.max_sd:.3f} / {base.mean_sd:.3f}"]
            for policy in policies:
                got = results[(seed, interference, policy)]
                bad = worse(got, base)
                counts[(policy, interference)] += bad
                cells.append(f"{policy} {got.spread:.3f} / {got.max_sd:.3f} / {got.mean_sd:.3f}"
                             f"{' WORSE' if bad else ''}")
            lines.append(" | ".join(cells))
    lines.append("")
    for (policy, interference), count in counts.items():
        lines.append(f"{policy}, {interference}: worse than doing nothing in {count} of {len(seeds)} runs")
    return "\n".join(lines)


def always_worse(by_noise: Mapping[int, Mapping[tuple[int, str, str], Run]], seeds: Sequence[int],
                 policies: list[str]) -> str:
    """Over several noise seeds: per policy, the worse runs in all, and the scenarios (seed, model)
    worse under every noise seed (those are not chance)."""
    lines = []
    for policy in policies:
        worse_in: dict[tuple[int, str], int] = {}
        for results in by_noise.values():
            for seed in seeds:
                for interference in INTERFERENCE_MODELS:
                    if worse(results[(seed, interference, policy)], results[(seed, interference, "observe")]):
                        worse_in[(seed, interference)] = worse_in.get((seed, interference), 0) + 1
        runs = len(by_noise) * len(seeds) * len(INTERFERENCE_MODELS)
        every = sorted(key for key, count in worse_in.items() if count == len(by_noise))
        lines.append(f"{policy}: worse than doing nothing in {sum(worse_in.values())} of {runs} runs; "
                     f"{len(worse_in)} scenarios worse at least once, {len(every)} under every noise seed"
                     + (f": {', '.join(f'{seed} {interference}' for seed, interference in every)}" if every else ""))
    return "\n".join(lines)


def seed_range(text: str) -> range:
    """``A:B`` (seeds A to B-1) or ``N`` (seeds 0 to N-1)."""
    try:
        first, _, last = text.partition(":")
        seeds = range(int(first), int(last)) if last else range(int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be N or A:B (integers); got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def _noise_seeds(text: str) -> list[int]:
    """Comma-separated distinct integers >= 0."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"noise seeds are comma-separated integers; got {text!r}") from None
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"noise seeds must be distinct integers >= 0; got {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_range, default=range(200), help="N (0..N-1) or A:B (A..B-1); default 200")
    parser.add_argument("--max-gpus", type=positive_int, metavar="N",
                        help="only the seeds whose mix has at most N GPUs (default: every seed)")
    parser.add_argument("--policies", type=names_from(POLICIES, "policies"), default=["fair"],
                        help="comma-separated policies besides observe")
    parser.add_argument("--draw", choices=sorted(DRAWS), default="default",
                        help="how a seed becomes a scenario: the default draw, or the wide one (wide_mix: fewer "
                        "apps than GPUs, other batches, epochs and run lengths)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel")
    parser.add_argument("--jitter", type=relative_spread, default=0.0, metavar="X",
                        help="relative spread of every host phase and chunk (SimConfig.jitter; default 0: none)")
    parser.add_argument("--noise-seeds", type=_noise_seeds, default=[0], metavar="A,B,...",
                        help="with --jitter: run everything once per seed of the noise (default 0)")
    add_knob_option(parser)
    parser.add_argument("--json", metavar="PATH", help="also write every run's final SDs here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.jitter == 0.0 and args.noise_seeds != [0]:
        parser.error("--noise-seeds needs --jitter: without noise every seed gives the same runs")
    policies, knobs = args.policies, parsed_knobs(parser, args)
    seeds = small_servers(args.seeds, args.max_gpus, args.draw)
    if not seeds:
        parser.error(f"no seed of {args.seeds.start}..{args.seeds.stop - 1} has a mix of at most {args.max_gpus} GPUs")
    by_noise = {noise: sweep(seeds, policies, args.workers, knobs, args.jitter, noise, args.draw)
                for noise in args.noise_seeds}
    for number, (noise, results) in enumerate(by_noise.items()):
        if args.jitter:
            print(("\n" if number else "") + f"noise seed {noise} (jitter {args.jitter:g}):")
        print(report(results, seeds, policies, args.draw))
    if args.jitter:
        print()
        print(always_worse(by_noise, seeds, policies))
    if args.json:
        runs = [result for results in by_noise.values() for result in results.values()]
        rows = [vars(result) | {"worse": worse(result, by_noise[result.noise][(result.seed, result.interference,
                                                                               "observe")])}
                for result in runs if result.policy != "observe"]
        bases = [vars(result) for result in runs if result.policy == "observe"]
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"command": "python -m benchmarks.random_mixes " + " ".join(argv), "draw": args.draw,
                       "jitter": args.jitter,
                       "observe": bases, "runs": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
