"""How far `fair`'s learned GPU speeds stray from the GPUs' true speeds, in simulated random mixes.

    python -m benchmarks.speed_drift                                  # mixes 170-189, calibrated
    python -m benchmarks.speed_drift --seeds 0:200 --interference gavel
    python -m benchmarks.speed_drift --draw wide --seeds 1000:1100

The predictor learns each GPU's speed, relative to the GPU of the solo run, from the chunk times
of apps alone on it and of apps split over it (``Predictor._learn_gpus``, docs/policy.md). In the
simulator the true speeds are known: the scenario's ``gpu_speed`` (1 for every GPU where it gives
none). So after each of `fair`'s decisions this measures the drift, the largest
``|learned / true - 1|`` over the GPUs, and prints per run the largest drift and the share of
decisions at which some GPU was off by more than ``--tolerance`` (default 5%), then the median
share over the runs. A GPU that looks slower than the others when it is not makes moves between
GPUs of one speed look like gains.

Every run starts from round-robin, as ``benchmarks.random_mixes`` runs them (the same scenarios,
``--draw``). No torch is imported.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from benchmarks.random_mixes import DRAWS, seed_range
from drbalance.argtypes import positive_float_up_to, positive_int
from drbalance.policy.base import Decision, Snapshot
from drbalance.policy.fair import FairPolicy
from drbalance.sim import SimConfig, Simulation
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import Scenario


@dataclass(frozen=True)
class Drift:
    """One run's drift: the largest seen (a share: 0.1 is 10%) and at how many decisions some GPU
    was off by more than the tolerance, of how many. Before a GPU's speed is measured it is taken
    to be 1: a slower GPU is off by that much until then."""

    seed: int
    description: str
    largest: float
    off: int
    decisions: int

    @property
    def share_off(self) -> float:
        return self.off / self.decisions if self.decisions else 0.0


class DriftWatch(FairPolicy):
    """`fair`, noting after each decision how far its learned speeds are from ``true``."""

    def __init__(self, true: tuple[float, ...], tolerance: float) -> None:
        super().__init__()
        self.true, self.tolerance = true, tolerance
        self.largest, self.off, self.decisions = 0.0, 0, 0

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        decision = super().decide(app, trigger, snapshot)
        learned = self.predictor.speed if self.predictor is not None else [1.0] * len(self.true)
        drift = max(abs(speed / true - 1.0) for speed, true in zip(learned, self.true))
        self.largest = max(self.largest, drift)
        self.off += drift > self.tolerance
        self.decisions += 1
        return decision


def drift_of(scenario: Scenario, interference: str, tolerance: float, seed: int = -1) -> Drift:
    """Simulate ``scenario`` from round-robin under ``fair`` and measure the drift of its speeds."""
    true = tuple(scenario.speed(gpu) for gpu in range(scenario.gpus))
    policy = DriftWatch(true, tolerance)
    # no DR change cost (SimConfig.change_cost): a change's slower first iteration counts into the
    # host time fair learns, and so into its speeds (32 of 152 decisions off in the test's two-GPU
    # case with the default cost, 2 without); the drift measured here is the speed learning's own
    config = SimConfig(policy="fair", placement="round-robin", record=False,
                       contention=make_interference(interference), change_cost=0.0)
    Simulation(scenario, config, policy=policy).run()
    return Drift(seed, scenario.description, policy.largest, policy.off, policy.decisions)


def run(job: tuple[int, str, str, float]) -> Drift:
    """``drift_of`` the mix of one seed of ``draw``."""
    seed, draw, interference, tolerance = job
    return drift_of(DRAWS[draw](seed), interference, tolerance, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_range, default=range(170, 190), help="N (0..N-1) or A:B (A..B-1); "
                        "default 170:190")
    parser.add_argument("--draw", choices=sorted(DRAWS), default="default", help="as benchmarks.random_mixes")
    parser.add_argument("--interference", choices=sorted(INTERFERENCE_MODELS), default="calibrated")
    parser.add_argument("--tolerance", type=positive_float_up_to(1.0), default=0.05,
                        help="a GPU this share or more off its true speed counts as off (default 0.05)")
    parser.add_argument("--workers", type=positive_int, default=2, help="simulations in parallel (default 2)")
    args = parser.parse_args(argv)
    if not args.seeds:
        parser.error("no seeds: --seeds A:B needs B > A")
    jobs = [(seed, args.draw, args.interference, args.tolerance) for seed in args.seeds]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        drifts = list(pool.map(run, jobs))
    print(f"| seed | mix | largest drift | decisions with a GPU > {args.tolerance:.0%} off |")
    print("|---|---|---|---|")
    for drift in drifts:
        print(f"| {drift.seed} | {drift.description} | {drift.largest:.3f} | "
              f"{drift.share_off:.0%} of {drift.decisions} |")
    shares = [drift.share_off for drift in drifts]
    print()
    print(f"median share of decisions with a GPU off: {statistics.median(shares):.0%} over {len(drifts)} runs "
          f"({args.draw} draw, {args.interference})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
