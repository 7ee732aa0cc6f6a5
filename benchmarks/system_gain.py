"""One `fair` over every user's jobs against one `fair` per user, and doing nothing, in the simulator.

    python -m benchmarks.system_gain --workers 2       # every set below; writes benchmarks/results/system_gain.json
    python -m benchmarks.system_gain --sets paper      # the paper's scenarios only
    python -m benchmarks.system_gain --seeds 200:203 --wide-seeds 1100:1102 --out /tmp/gain.json   # a quick look

What a system manager gains over per-user managers on a server shared by several users. Arms,
each under both interference models:

- ``observe``: nothing moves, every app from round-robin: the reference of the never-worse rule
  (``drbalance.sim.mixes.not_worse``: a run is *worse* when its final max SD or mean SD exceeds
  observe's by more than ``NOT_WORSE_MARGIN``).
- ``system``: one ``fair`` over every app, as a system manager sees every user's jobs.
- ``per-user N``: the apps dealt to N users (``drbalance.sim.tenants.deal``: shuffled by a seed
  of the scenario's name and N, then dealt round-robin; each app once), one ``fair`` per user
  (``PerUserPolicy``): each sees only its user's apps and every GPU's utilisation, and decides
  only for its user's apps, as users' own managers do.

Every app counts once in max SD and mean SD, whoever owns it. Sets: ``paper``, scenarios (a),
(b), (c) from both placements of ``drbalance.sim.reproduce`` (round-robin and spread; observe
from round-robin); ``default``, the seeds of ``benchmarks.random_mixes`` (``--seeds``, held out
by default); ``wide``, its wide draw (``--wide-seeds``, held out by default); both random sets
start from round-robin, as ``random_mixes`` does. No torch is imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from benchmarks.random_mixes import DRAWS, seed_range
from drbalance.argtypes import names_from, positive_int
from drbalance.policy.fair import FairPolicy
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.mixes import NOT_WORSE_MARGIN, not_worse
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.sim.tenants import PerUserPolicy, deal
from drbalance.workload.scenarios import PLACEMENTS, SCENARIOS, Scenario

SETS = ("paper", "default", "wide")
PAPER_SCENARIOS = ("a", "b", "c")
DEFAULT_OUT = "benchmarks/results/system_gain.json"
DEALING = ("drbalance.sim.tenants.deal: the apps shuffled by random.Random(f'{scenario name}/{users}'), then dealt "
           "round-robin to user0, user1, ...; each app to one user")


@dataclass(frozen=True)
class Job:
    """One simulated run: a scenario of a set (a paper scenario's name or a seed), its start, the
    interference model and the arm (``observe``, ``system`` or ``per-user N``)."""

    set: str
    scenario: str
    placement: str
    interference: str
    arm: str


@dataclass(frozen=True)
class Outcome:
    """A run's final SDs (SD units) and its wall-clock time (seconds)."""

    spread: float
    max_sd: float
    mean_sd: float
    seconds: float


def scenario_of(set_name: str, key: str) -> Scenario:
    """The scenario a job names: a paper scenario by name, else the seed's draw of its set."""
    return SCENARIOS[key] if set_name == "paper" else DRAWS[set_name](int(key))


def simulate(job: Job) -> Outcome:
    """Run one job under fair (system or per user) or observe, as ``random_mixes`` runs a mix."""
    started = time.perf_counter()
    scenario = scenario_of(job.set, job.scenario)
    policy_name = "observe" if job.arm == "observe" else "fair"
    config = SimConfig(policy=policy_name, placement=job.placement, record=False,
                       contention=make_interference(job.interference))
    policy = None
    if job.arm.startswith("per-user "):
        policy = PerUserPolicy(deal(scenario, int(job.arm.split()[1])), FairPolicy)
    result = Simulation(scenario, config, policy=policy).run()
    return Outcome(result.sd_spread, result.max_sd, result.mean_sd, time.perf_counter() - started)


def arms(users: Sequence[int]) -> list[str]:
    return ["observe", "system", *(f"per-user {count}" for count in users)]


def jobs_for(sets: Sequence[str], seeds: Iterable[int], wide_seeds: Iterable[int], users: Sequence[int]) -> list[Job]:
    """Every run of the sweep: per set, scenario and interference model, observe from round-robin
    and every other arm from each placement of the set."""
    scenarios = {"paper": list(PAPER_SCENARIOS), "default": [str(seed) for seed in seeds],
                 "wide": [str(seed) for seed in wide_seeds]}
    jobs = []
    for set_name in sets:
        placements = PLACEMENTS if set_name == "paper" else ("round-robin",)
        for key in scenarios[set_name]:
            for interference in INTERFERENCE_MODELS:
                jobs.append(Job(set_name, key, "round-robin", interference, "observe"))
                jobs.extend(Job(set_name, key, placement, interference, arm)
                            for placement in placements for arm in arms(users)[1:])
    return jobs


def run_all(jobs: list[Job], workers: int) -> dict[Job, Outcome]:
    """Every job's outcome; progress to stderr every tenth of the jobs."""
    outcomes = {}
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for done, (job, outcome) in enumerate(zip(jobs, pool.map(simulate, jobs)), 1):
            outcomes[job] = outcome
            if done % max(1, len(jobs) // 10) == 0 or done == len(jobs):
                print(f"system_gain: {done} of {len(jobs)} runs", file=sys.stderr, flush=True)
    return outcomes


def reference(job: Job, outcomes: dict[Job, Outcome]) -> Outcome:
    """Observe from round-robin of the job's scenario and interference model."""
    return outcomes[Job(job.set, job.scenario, "round-robin", job.interference, "observe")]


def is_worse(job: Job, outcomes: dict[Job, Outcome]) -> bool:
    got, base = outcomes[job], reference(job, outcomes)
    return not not_worse(got.max_sd, got.mean_sd, base.max_sd, base.mean_sd)


def summary(outcomes: dict[Job, Outcome], users: Sequence[int]) -> list[dict]:
    """Per set (and all sets pooled), interference model and arm: runs, median and mean final max
    SD, runs worse than observe; for the per-user arms, the median of their max SD minus the
    system arm's on the same run, and the runs where that difference is above or below
    ``NOT_WORSE_MARGIN``."""
    rows = []
    sets = sorted({job.set for job in outcomes}, key=SETS.index)
    for set_name in [*sets, "all"]:
        for interference in INTERFERENCE_MODELS:
            for arm in arms(users):
                chosen = [job for job in outcomes if job.arm == arm and job.interference == interference
                          and set_name in (job.set, "all")]
                if not chosen:
                    continue
                maxima = [outcomes[job].max_sd for job in chosen]
                row = {"set": set_name, "interference": interference, "arm": arm, "runs": len(chosen),
                       "median_max_sd": statistics.median(maxima), "mean_max_sd": statistics.fmean(maxima),
                       "worse": None if arm == "observe" else sum(is_worse(job, outcomes) for job in chosen)}
                if arm.startswith("per-user"):
                    gaps = [outcomes[job].max_sd - outcomes[Job(job.set, job.scenario, job.placement, job.interference,
                                                                  "system")].max_sd for job in chosen]
                    row |= {"median_gap_to_system": statistics.median(gaps),
                            "above_system": sum(gap > NOT_WORSE_MARGIN for gap in gaps),
                            "below_system": sum(gap < -NOT_WORSE_MARGIN for gap in gaps)}
                rows.append(row)
    return rows


def tables(rows: list[dict]) -> str:
    """The summary as two markdown tables, one row per set and interference model: per arm the
    final max SD (median / mean over the runs) and the runs worse than observe; per per-user arm
    its max SD minus the system arm's on the same run (median) and the runs above / below it by
    more than the margin."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        cells.setdefault((row["set"], row["interference"]), {})[row["arm"]] = row
    arm_names = list(dict.fromkeys(row["arm"] for row in rows))
    per_user = [arm for arm in arm_names if arm.startswith("per-user")]
    outcome = ["| set | interference | runs | " + " | ".join(arm_names) + " |",
               "|---|---|---|" + "---|" * len(arm_names)]
    gap = ["| set | interference | " + " | ".join(f"{arm} - system" for arm in per_user) + " |",
           "|---|---|" + "---|" * len(per_user)]
    for (set_name, interference), by_arm in cells.items():
        runs = max(row["runs"] for row in by_arm.values())  # of each arm but observe (paper: from 2 placements)
        outcome.append(f"| {set_name} | {interference} | {runs} | " + " | ".join(
            f"{by_arm[arm]['median_max_sd']:.3f} / {by_arm[arm]['mean_max_sd']:.3f}"
            + ("" if by_arm[arm]["worse"] is None else f", {by_arm[arm]['worse']} worse") for arm in arm_names) + " |")
        gap.append(f"| {set_name} | {interference} | " + " | ".join(
            f"{by_arm[arm]['median_gap_to_system']:+.3f}; {by_arm[arm]['above_system']} above, "
            f"{by_arm[arm]['below_system']} below" for arm in per_user) + " |")
    return "\n".join(outcome) + "\n\n" + "\n".join(gap)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=names_from(SETS, "sets"), default=list(SETS),
                        help="comma-separated: paper, default, wide (default: all three)")
    parser.add_argument("--seeds", type=seed_range, default=range(200, 400),
                        help="seeds of the default draw: N or A:B (default 200:400, held out)")
    parser.add_argument("--wide-seeds", type=seed_range, default=range(1100, 1200),
                        help="seeds of the wide draw: N or A:B (default 1100:1200, held out)")
    parser.add_argument("--users", type=_user_counts, default=[2, 3], metavar="N,M",
                        help="user counts the apps are dealt to (default 2,3)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the JSON file to write (default {DEFAULT_OUT})")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    started = time.perf_counter()
    jobs = jobs_for(args.sets, args.seeds, args.wide_seeds, args.users)
    outcomes = run_all(jobs, args.workers)
    rows = summary(outcomes, args.users)
    wall = time.perf_counter() - started
    print(tables(rows))
    print(f"\n{len(jobs)} runs in {wall:.0f} s on {args.workers} workers; worse: final max or mean SD above "
          f"observe's (from round-robin) by more than {NOT_WORSE_MARGIN}")
    runs = [asdict(job) | asdict(outcome) | {"worse": None if job.arm == "observe" else is_worse(job, outcomes)}
            for job, outcome in outcomes.items()]
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump({"command": "python -m benchmarks.system_gain " + " ".join(argv),
                   "dealing": DEALING, "margin": NOT_WORSE_MARGIN, "wall_seconds": wall,
                   "workers": args.workers, "summary": rows, "runs": runs}, out, indent=1)
    return 0


def _user_counts(text: str) -> list[int]:
    """Comma-separated distinct integers >= 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"user counts are comma-separated integers; got {text!r}") from None
    if any(count < 1 for count in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"user counts must be distinct integers >= 1; got {text!r}")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
