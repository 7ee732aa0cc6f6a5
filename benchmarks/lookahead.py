"""A look-ahead oracle: how low could a DR policy take the max SD, if it could see the future?

Not a policy anyone can deploy: at each decision it copies the whole running simulation, gives
the deciding app each candidate DR in a copy, runs every copy ``--horizon`` seconds ahead (the
other apps keep their DRs), and keeps the DR whose copy ends with the lowest predicted SDs at
finish (max SD first, then the mean). It reads the simulator's model through the copies, which
no real manager can. Issue 9 quoted such an oracle (candidate DRs 90 s ahead) reaching max SDs
of 1.22-1.30 in (a), (b), (c) under the calibrated model; this script measures the same kind of
oracle under both interference models, to tell how far issue 9's targets are within reach of
*any* DR policy of this kind, beside ``drbalance.sim.bound``'s lower bounds and
``benchmarks/static_layouts.py``'s fixed layouts.

    python -m benchmarks.lookahead a b c --interference gavel          # about 4 minutes a run
    python -m benchmarks.lookahead a --placement spread --horizon 60 --every 45
    python -m benchmarks.lookahead staggered --placement round-robin --interference calibrated

Candidates for the deciding app: its current DR, every single GPU, an even split over every pair
of GPUs, and an even split over all GPUs (``static_layouts``' set). Each app decides every
``--every`` seconds (default: the horizon), at the end of an iteration, one app at a time, so
the oracle is greedy: it never plans several apps' moves together. Predicted SD at finish in a
copy: Eq. 2 with the app's mean iteration time over the horizon (an app that finished in the
horizon: its final SD). A move must improve that key by ``MIN_GAIN`` (0.002) to be made.

Usage: python -m benchmarks.lookahead SCENARIO [...] [--placement round-robin|spread|both]
       [--interference calibrated|gavel|both] [--horizon S] [--every S] [--scale F] [--workers N]
       [--name NAME] [--no-write]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from itertools import combinations
from types import MappingProxyType
from typing import Any

from benchmarks.timing import add_no_write, save
from drbalance.argtypes import positive_int
from drbalance.policy import Decision, ObservePolicy, Snapshot
from drbalance.ratio import DataRatio
from drbalance.report.metrics import summarise
from drbalance.sim.command import to_run
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.sim.mixes import scenario_named
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import PLACEMENTS

HORIZON = 90.0  # seconds simulated ahead per candidate (issue 9's oracle)
MIN_GAIN = 0.002  # SD units a move must win by on (max SD, mean SD)


def candidate_ratios(gpus: int, total: int, current: DataRatio) -> list[DataRatio]:
    """The DRs the oracle tries for one app: the current one first, then every single GPU, an
    even split over every pair, and an even split over all GPUs (duplicates dropped)."""
    found = [current]
    found.extend(DataRatio.single(gpus, gpu, total) for gpu in range(gpus))
    for first, second in combinations(range(gpus), 2):
        shares = [0] * gpus
        shares[first] = total // 2
        shares[second] = total - total // 2
        found.append(DataRatio(shares, total))
    if gpus > 2:
        found.append(DataRatio.even(gpus, total))
    unique: list[DataRatio] = []
    for ratio in found:
        if ratio not in unique:
            unique.append(ratio)
    return unique


def predicted_sds(simulation: Simulation, marks: dict[str, tuple[int, float]]) -> list[float]:
    """Every started app's SD at finish as the copy predicts it: final if it finished, else Eq. 2
    with its mean iteration time since ``marks`` (iterations done, time of the last one)."""
    sds = []
    for app in simulation.apps:
        tracker = app.tracker
        if not app.arrived:
            continue
        if tracker.finished:
            sds.append(tracker.slowdown(tracker.last_mark))
            continue
        done, mark = marks.get(app.name, (tracker.first, tracker.start))
        if tracker.done > done:
            per_iteration = (tracker.last_mark - mark) / (tracker.done - done)
        else:
            per_iteration = tracker.mean_iteration_time
        if per_iteration is None:
            continue
        elapsed = tracker.last_mark - tracker.start
        sds.append((elapsed + tracker.iterations_left * per_iteration) / tracker.run_solo_time)
    return sds


class LookAhead:
    """The oracle, as a policy object the simulation calls (``attach`` it to the simulation first)."""

    name = "lookahead"

    def __init__(self, horizon: float = HORIZON, every: float | None = None, min_gain: float = MIN_GAIN) -> None:
        if horizon <= 0:
            raise ValueError(f"the horizon must be a positive number of seconds; got {horizon}")
        self.horizon = horizon
        self.every = horizon if every is None else every
        self.min_gain = min_gain
        self.simulation: Simulation | None = None
        self.copies = 0
        self.moves = 0

    def attach(self, simulation: Simulation) -> None:
        self.simulation = simulation

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        view = snapshot.app(app)
        if trigger != "boundary" or view.slowdown is None or self.simulation is None:
            return Decision(app, view.ratio, "wait", next_boundary=self.every)
        config = snapshot.config
        keys = {}
        for ratio in candidate_ratios(config.gpu_count, config.dr_total, view.ratio):
            sds = self._look(app, ratio)
            keys[ratio] = (max(sds), sum(sds) / len(sds)) if sds else (float("inf"), float("inf"))
        best = min(keys, key=lambda ratio: keys[ratio])
        stay = keys[view.ratio]
        better = (stay[0] - keys[best][0] >= self.min_gain
                  or (stay[0] - keys[best][0] > -self.min_gain and stay[1] - keys[best][1] >= self.min_gain))
        if best == view.ratio or not better:
            return Decision(app, view.ratio, "keep", next_boundary=self.every)
        self.moves += 1
        details = MappingProxyType({"max_sd": keys[best][0], "mean_sd": keys[best][1]})
        return Decision(app, best, "move", details, next_boundary=self.every)

    def _look(self, name: str, ratio: DataRatio) -> list[float]:
        """Copy the simulation as it stands at ``name``'s boundary, give the app ``ratio``, finish
        the boundary as the simulation does after a decision, and run the copy ahead."""
        simulation = self.simulation
        if simulation is None:
            raise RuntimeError("LookAhead.attach(simulation) must be called before the run")
        # shared, not copied: the settings, the scenario; the copy's own records start empty and
        # its apps keep their DRs (``observe``)
        memo: dict[int, Any] = {id(self): ObservePolicy(), id(simulation.config): simulation.config,
                                id(simulation.scenario): simulation.scenario,
                                id(simulation.manager_records): []}
        for app in simulation.apps:
            memo[id(app.records)] = []
        ahead: Simulation = copy.deepcopy(simulation, memo)
        self.copies += 1
        app = next(a for a in ahead.apps if a.name == name)
        app.ratio, app.pushed = ratio, None
        app.cadence = app.boundary_due = None
        app.tracker.new_window()
        app.slot_window.new_window()
        ahead._start_iteration(app)
        marks = {a.name: (a.tracker.done, a.tracker.last_mark) for a in ahead.apps if a.arrived}
        ahead.advance(ahead.now + self.horizon)
        return predicted_sds(ahead, marks)


def run_oracle(scenario_name: str, placement: str, interference: str, horizon: float,
               every: float | None, scale: float = 1.0) -> dict[str, Any]:
    """One whole run under the oracle (runs ``scale`` times as long as the scenario's): final SDs,
    their spread, max and mean, the time-averaged utilisation (%), moves made, copies run."""
    scenario = scenario_named(scenario_name)
    if scale != 1.0:
        scenario = scenario.scaled(scale)
    config = SimConfig(policy="observe", placement=placement, contention=make_interference(interference))
    oracle = LookAhead(horizon, every)
    simulation = Simulation(scenario, config, policy=oracle)
    oracle.attach(simulation)
    started = time.perf_counter()
    result = simulation.run()
    summary = summarise(to_run(result, "lookahead", simulation.scenario), step=max(1.0, result.makespan / 2000))
    return {
        "scenario": scenario_name, "placement": placement, "interference": interference, "horizon": horizon,
        "every": oracle.every, "final_sd": result.final_sd, "max_sd": result.max_sd, "mean_sd": result.mean_sd,
        "spread": result.sd_spread, "utilisation": summary.mean_util, "moves": oracle.moves,
        "copies": oracle.copies, "seconds": time.perf_counter() - started,
    }


def _run(args: tuple[str, str, str, float, float | None, float]) -> dict[str, Any]:
    return run_oracle(*args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help="scenario names, mixes or JSON files (a, b, c, staggered, ...)")
    parser.add_argument("--placement", choices=(*PLACEMENTS, "both"), default="both")
    parser.add_argument("--interference", choices=(*INTERFERENCE_MODELS, "both"), default="both")
    parser.add_argument("--horizon", type=float, default=HORIZON, help="seconds simulated ahead (default 90)")
    parser.add_argument("--every", type=float, default=None, help="seconds between an app's decisions "
                                                                  "(default: the horizon)")
    parser.add_argument("--scale", type=float, default=1.0, help="run-length factor (default 1: full runs)")
    parser.add_argument("--workers", type=positive_int, default=2, help="runs in parallel (default 2)")
    parser.add_argument("--name", default="lookahead", help="write benchmarks/results/NAME.json (default lookahead)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    if args.horizon <= 0 or (args.every is not None and args.every <= 0):
        parser.error("--horizon and --every must be positive numbers of seconds")
    if not 0 < args.scale <= 1:
        parser.error("--scale must be in (0, 1]")
    if not args.name.replace("_", "").replace("-", "").isalnum():
        parser.error("--name: letters, digits, '-' and '_' only")
    placements = PLACEMENTS if args.placement == "both" else (args.placement,)
    models = tuple(INTERFERENCE_MODELS) if args.interference == "both" else (args.interference,)
    jobs = [(name, placement, model, args.horizon, args.every, args.scale)
            for model in models for name in args.scenarios for placement in placements]
    results = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for found in pool.map(_run, jobs):
            results.append(found)
            print(f"{found['interference']} {found['scenario']} {found['placement']}: max SD {found['max_sd']:.3f}, "
                  f"{found['seconds']:.0f} s", file=sys.stderr, flush=True)
    print("| interference | scenario | placement | spread | max SD | mean SD | utilisation % | moves | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for found in results:
        util = found["utilisation"]
        print(f"| {found['interference']} | ({found['scenario']}) | {found['placement']} | {found['spread']:.3f} | "
              f"{found['max_sd']:.3f} | {found['mean_sd']:.3f} | {'-' if util is None else f'{util:.1f}'} | "
              f"{found['moves']} | {found['seconds']:.0f} |")
    save(args.name, "benchmarks.lookahead", list(argv) if argv is not None else None, {"runs": results},
         args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
