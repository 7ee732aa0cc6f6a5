"""How far `fair`'s predictions of its own moves miss, by kind of move, in simulated runs.

    python -m benchmarks.move_misses a b c staggered mixed-lengths          # fair as it is
    python -m benchmarks.move_misses a b c staggered mixed-lengths --step 0  # without the replica penalty

At an app's first decision after a move (a whole window measured under the new DR) `fair`
compares the measured iteration time with the one it predicted when it moved. This prints, per
scenario (from round-robin) and interference model, the median and mean of measured / predicted
for four kinds of move: *split* (the move added replicas), *join* (it took replicas away),
*one GPU* (from one GPU to another) and *several* (the same number of replicas, more than one).
Above 1 the predictor was optimistic. ``--step`` sets ``PredictorConfig.replica_penalty_step``
(0: the replica penalty is never learned, the predictor as it was before it). ``--by-branch``
splits each kind by the branch that made the move: ``move``, ``swap`` or ``plan`` for the
deciding app, ``pushed`` for the other apps of a swap or plan (docs/policy.md: until
2026-11-23 a swap's mover was predicted as if its partner stayed, and ran at a median 0.58-0.81
of its predicted time; since, 0.97-1.05).

What it showed before the replica penalty (``--step 0``): splits ran slower than predicted in 9
of 10 runs of (a), (b), (c), the staggered and mixed-lengths mixes (median 1.04-1.30; (a) under
`gavel`, two splits, 0.94), moves onto one GPU faster (0.60-0.95); see docs/policy.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from drbalance.argtypes import positive_int
from drbalance.policy.base import AppView, Decision
from drbalance.policy.fair import FairConfig, FairPolicy, _Move, _Search, _Track
from drbalance.policy.predictor import Predictor
from drbalance.ratio import DataRatio
from drbalance.sim import SimConfig, Simulation
from drbalance.sim.mixes import scenario_named
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference

KINDS = ("split", "join", "one GPU", "several")


def kind_of(replicas_before: int, replicas_after: int) -> str:
    """The kind of a move by the replica counts before and after it."""
    if replicas_after > replicas_before:
        return "split"
    if replicas_after < replicas_before:
        return "join"
    return "one GPU" if replicas_after == 1 else "several"


class MissLog(FairPolicy):
    """`fair`, noting measured / predicted iteration time of every move it checks."""

    def __init__(self, config: FairConfig | None = None) -> None:
        super().__init__(config)
        self.by_branch: dict[str, list[float]] = defaultdict(list)  # "kind/branch" -> measured / predicted
        self._branches: dict[tuple[str, int], str] = {}  # (app, iteration of its move) -> branch

    def _move(self, me: AppView, ratio: DataRatio, changes: Mapping[str, DataRatio], branch: str, search: _Search,
              track: _Track, gain: float, **details: Any) -> Decision:
        self._branches[(me.name, me.iteration)] = branch
        return super()._move(me, ratio, changes, branch, search, track, gain, **details)

    def _learn_from_move(self, me: AppView, move: _Move, measured: float, predictor: Predictor) -> None:
        kind = kind_of(predictor.replicas(me.name, move.before), predictor.replicas(me.name, move.after))
        branch = self._branches.get((me.name, move.iteration), "pushed")
        self.by_branch[f"{kind}/{branch}"].append(measured / move.predicted)
        super()._learn_from_move(me, move, measured, predictor)


def run(job: tuple[str, str, float | None], by_branch: bool = False) -> dict[str, list[float]]:
    """The misses by kind (or by kind and branch) of one run of a scenario from round-robin."""
    name, interference, step = job
    config = FairConfig()
    if step is not None:
        config = replace(config, predictor=replace(config.predictor, replica_penalty_step=step))
    policy = MissLog(config)
    # no DR change cost (SimConfig.change_cost): what is measured is the predictor's own miss, which
    # a change's slower first iteration would add to
    sim = SimConfig(policy="fair", placement="round-robin", record=False, contention=make_interference(interference),
                    change_cost=0.0)
    Simulation(scenario_named(name), sim, policy=policy).run()
    if by_branch:
        return dict(policy.by_branch)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for key, values in policy.by_branch.items():
        by_kind[key.split("/")[0]].extend(values)
    return dict(by_kind)


def run_by_branch(job: tuple[str, str, float | None]) -> dict[str, list[float]]:
    return run(job, by_branch=True)


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{len(values)}: {statistics.median(values):.3f} / {statistics.fmean(values):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help="built-in scenarios, .json files or mixes of drbalance.sim.mixes")
    parser.add_argument("--step", type=float, default=None,
                        help="replica_penalty_step for the predictor (default: PredictorConfig's)")
    parser.add_argument("--by-branch", action="store_true",
                        help="split each kind by the branch that made the move (move, swap, plan, pushed)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.step is not None and not 0.0 <= args.step <= 1.0:
        parser.error(f"--step must be within 0..1; got {args.step}")
    for name in args.scenarios:
        try:
            scenario_named(name)
        except ValueError as error:
            parser.error(str(error))
    jobs = [(name, interference, args.step) for name in args.scenarios for interference in sorted(INTERFERENCE_MODELS)]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(run_by_branch if args.by_branch else run, jobs))
    if args.by_branch:
        print("| scenario | interference | kind/branch: moves: median / mean |")
        print("|---|---|---|")
        for (name, interference, _), misses in zip(jobs, results):
            print(f"| {name} | {interference} | "
                  + "; ".join(f"{key} {cell(values)}" for key, values in sorted(misses.items())) + " |")
        return 0
    print("| scenario | interference | " + " | ".join(KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for (name, interference, _), misses in zip(jobs, results):
        print(f"| {name} | {interference} | " + " | ".join(cell(misses.get(kind, [])) for kind in KINDS) + " |")
    print()
    print("Cells: moves checked: median / mean of measured / predicted iteration time "
          "(above 1: slower than predicted).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
