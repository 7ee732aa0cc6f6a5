"""The error of a job's solo-time estimate, its own (``drbalance.solo_estimate``) or the manager's, against the truth.

    python -m benchmarks.solo_estimate                     # the simulator: scenarios a, b, c x two placements
    python -m benchmarks.solo_estimate --emulated RUN_DIR...  # the SD logs of launches on emulated GPUs

**Simulator.** Each scenario runs under the manager's policy (``fair``), from round-robin (one GPU
per app) and from ``spread`` (every app over every GPU), every app given no solo time, as a job
started with ``solo_time=None`` is. At each of an app's reports and boundaries the client's own
estimator gets what the client would give it: the window's mean iteration time and per-GPU mean
chunk times and sizes (the simulator's ``SlotWindow``, fed as the client feeds it), the batch,
and per GPU whether the app had it alone (no other live app with a share there, as NVML's
process list or the emulated GPUs' memory table tell a real job). After each of its decisions the
policy's estimate of the app's solo iteration (``FairPolicy.solo_estimate``) is what the
manager's answer carries. The app's SD then uses the solo time ``chosen_solo`` picks, as the
session does, and its record says which (``AppView.solo_basis``): the policy sees what it would
see on a real server. Each estimate (seconds per iteration) is compared with the cost model's
solo iteration (``ModelCosts.solo_iteration(batch)``) at the end of each app's first epoch and at
its finish: the one its SD used, and the job's own. An app whose own estimate at the end of its
first epoch is ``shared`` had no GPU alone in any window of it: those are the apps the manager's
estimate is for. The simulator publishes no hook for this: the benchmark subclasses
``Simulation`` and wraps ``_publish`` and ``_decide``.

**Emulated GPUs.** A run directory of ``drbalance launch SCENARIO --estimate-solo`` on emulated
GPUs: each app's SD log carries the solo time its SD uses (``solo_time``) and its basis at every
report; the true solo time is the cost model's at the launch's time scale (``AppSpec.solo_time()
x time_scale``, what ``--solo-time auto`` gives), from the scenario and time scale ``run.json``
records.

Writes ``benchmarks/results/solo_estimate.json`` (``--out``) and prints one row per app and
median / largest absolute errors by basis.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from drbalance.jsonlog import read_json_lines
from drbalance.sim.engine import SimConfig, Simulation
from drbalance.solo_estimate import AloneWindow, SlotSample, SoloEstimate, SoloEstimator, chosen_solo
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import SCENARIOS, Scenario, scenario_from_json

RESULTS = Path(__file__).resolve().parent / "results" / "solo_estimate.json"

PLACEHOLDER_SOLO = 1.0
"""Seconds a record shows as the solo time before the first estimate (the session's
``UNKNOWN_SOLO_SECONDS``); the SD is unknown meanwhile."""


@dataclass(frozen=True)
class AppError:
    """One app's estimates against its true solo iteration time: relative errors (estimate / true -
    1) at the end of its first epoch and at its finish, of the solo time its SD used (with its
    basis: ``alone``, ``manager``, ``shared``) and of the job's own estimate (with its basis)."""

    run: str
    app: str
    model: str
    first_epoch_error: float | None
    first_epoch_basis: str | None
    final_error: float | None
    final_basis: str | None
    first_epoch_own_error: float | None = None
    first_epoch_own_basis: str | None = None


class EstimatingSimulation(Simulation):
    """A simulation of jobs given no solo time (see the module docstring)."""

    def __init__(self, scenario: Scenario, config: SimConfig) -> None:
        super().__init__(scenario, config)
        self.estimators = {app.name: SoloEstimator() for app in self.apps}
        self.alone_windows = {app.name: AloneWindow() for app in self.apps}
        self.from_manager: dict[str, float | None] = {app.name: None for app in self.apps}
        self.used: dict[str, tuple[float, str] | None] = {app.name: None for app in self.apps}
        for app in self.apps:  # a boundary's new window of means is a new window of alone flags too
            app.slot_window.new_window = _also(app.slot_window.new_window, self.alone_windows[app.name].new_window)
            app.tracker.solo_time = None  # given none: estimated online
        self.at_first_epoch: dict[str, tuple[tuple[float, str] | None, SoloEstimate | None]] = {}

    def _publish(self, app: Any) -> None:
        tracker = app.tracker
        if tracker.done > tracker.first:  # a window measured: the client refines its estimate
            self._estimate(app)
        if tracker.solo_time is None:  # no estimate yet: no SD, a placeholder solo time
            tracker.solo_time = PLACEHOLDER_SOLO
            super()._publish(app)
            tracker.solo_time = None
            app.reported_sd = None
            app.published = replace(app.published, slowdown=None, solo_basis="shared")
            return
        super()._publish(app)
        used = self.used[app.name]
        app.published = replace(app.published, solo_basis=None if used is None else used[1])
        if tracker.done >= tracker.plan.iterations_per_epoch and app.name not in self.at_first_epoch:
            self.at_first_epoch[app.name] = (used, self.estimators[app.name].estimate)

    def _estimate(self, app: Any) -> None:
        tracker = app.tracker
        others = [other for other in self.apps if other is not app and other.alive]
        alone = self.alone_windows[app.name].update([not any((other.pushed or other.ratio)[gpu] for other in others)
                                                     for gpu in range(len(self.gpus))])
        slots = [None if mean is None else SlotSample(mean[0], mean[1], alone[gpu])
                 for gpu, mean in enumerate(app.slot_window.means())]
        own = self.estimators[app.name].observe(tracker.mean_iteration_time, app.spec.batch, slots)
        used = self.used[app.name] = chosen_solo(own, self.from_manager[app.name])
        if used is not None:
            tracker.set_solo_time(used[0] * tracker.plan.total)

    def _decide(self, app: Any, trigger: str) -> None:
        super()._decide(app, trigger)
        self.from_manager[app.name] = self.policy.solo_estimate(app.name)  # what the answer carries


def _also(first: Any, then: Any) -> Any:
    """A function that calls ``first()``, then ``then()``."""
    def both() -> None:
        first()
        then()
    return both


def _error(seconds: float | None, true_seconds: float) -> float | None:
    return None if seconds is None else seconds / true_seconds - 1.0


def simulated(scenarios: list[str], placements: list[str]) -> list[AppError]:
    rows = []
    for name in scenarios:
        for placement in placements:
            simulation = EstimatingSimulation(SCENARIOS[name], SimConfig(placement=placement, record=False))
            simulation.run()
            for app in simulation.apps:
                true_seconds = model_costs(app.spec.model).solo_iteration(app.spec.batch)
                used, own = simulation.at_first_epoch.get(app.name, (None, None))
                final = simulation.used[app.name]
                rows.append(AppError(
                    f"{name}/{placement}", app.name, app.spec.model,
                    _error(None if used is None else used[0], true_seconds), None if used is None else used[1],
                    _error(None if final is None else final[0], true_seconds), None if final is None else final[1],
                    _error(None if own is None else own.iteration_seconds, true_seconds),
                    None if own is None else own.basis))
    return rows


def emulated(run_dir: Path) -> list[AppError]:
    """Errors of the apps of a launch on emulated GPUs from their SD logs (see the module docstring)."""
    info = json.loads((run_dir / "run.json").read_text())
    scenario = scenario_from_json(json.dumps(info["scenario_json"]), str(run_dir / "run.json"))
    rows = []
    for spec in scenario.apps:
        true_total = spec.solo_time() * info["time_scale"]  # what --solo-time auto gives
        records = [r for r in read_json_lines(run_dir / "apps" / f"{spec.name}.sd.jsonl")
                   if r.get("solo_estimated") and isinstance(r.get("solo_time"), (int, float))]
        if not records:
            continue
        first = next((r for r in records if r.get("iteration", 0) >= spec.iterations_per_epoch), None)  # epoch 1 end
        final = records[-1]
        rows.append(AppError(run_dir.name, spec.name, spec.model,
                             None if first is None else first["solo_time"] / true_total - 1.0,
                             None if first is None else first.get("solo_basis"),
                             final["solo_time"] / true_total - 1.0, final.get("solo_basis")))
    return rows


def summary(rows: list[AppError]) -> dict[str, Any]:
    """Median and largest absolute error at the first epoch's end and at the finish, overall and by
    the basis of the solo time the SD used; and for the apps that shared every GPU of their first
    epoch (their own estimate ``shared`` then), of the solo time their SD used and of their own."""
    result: dict[str, Any] = {}
    for when in ("first_epoch", "final"):
        for basis in (None, "alone", "manager", "shared"):
            key = f"{when}{'' if basis is None else '_' + basis}"
            result[key] = _errors([getattr(row, f"{when}_error") for row in rows
                                   if basis is None or getattr(row, f"{when}_basis") == basis])
    shared = [row for row in rows if row.first_epoch_own_basis == "shared"]
    result["first_epoch_shared_every_gpu"] = _errors([row.first_epoch_error for row in shared])
    result["first_epoch_shared_every_gpu_own"] = _errors([row.first_epoch_own_error for row in shared])
    return result


def _errors(errors: list[float | None]) -> dict[str, Any]:
    found = [abs(error) for error in errors if error is not None]
    return {"apps": len(found), "median_abs_error": statistics.median(found) if found else None,
            "max_abs_error": max(found) if found else None,
            "within_10_percent": sum(1 for error in found if error <= 0.10)}


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulated", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                        help="read launches' SD logs (drbalance launch ... --estimate-solo) instead of simulating")
    parser.add_argument("--scenarios", default="a,b,c", help="simulated scenarios (default a,b,c)")
    parser.add_argument("--placements", default="round-robin,spread", help="starting placements")
    parser.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    if args.emulated is not None:
        rows = [row for run_dir in args.emulated for row in emulated(run_dir)]
        out = args.out or RESULTS.with_name("solo_estimate_emulated.json")
    else:
        rows = simulated(args.scenarios.split(","), args.placements.split(","))
        out = args.out or RESULTS
    print(f"{'run':<16} {'app':<8} {'first epoch':>12} {'basis':>7} {'final':>8} {'basis':>7}")
    for row in rows:
        print(f"{row.run:<16} {row.app:<8} {_percent(row.first_epoch_error):>12} {row.first_epoch_basis or '-':>7} "
              f"{_percent(row.final_error):>8} {row.final_basis or '-':>7}")
    totals = summary(rows)
    for key, value in totals.items():
        if value["apps"]:
            print(f"{key:<34} {value['apps']:>3} apps  median |error| {_percent(value['median_abs_error'])}  "
                  f"largest {_percent(value['max_abs_error'])}  within 10%: {value['within_10_percent']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m benchmarks.solo_estimate " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
                               "rows": [asdict(row) for row in rows], "summary": totals}, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
