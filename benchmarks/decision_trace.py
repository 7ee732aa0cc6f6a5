"""Record every decision of whole simulated runs, to prove that a change to a policy's code does
not change what it decides (performance work).

Each case is a scenario (a, b, c from both placements, the mixes of ``drbalance.sim.mixes``, the
64 x 16 benchmark scenario) under an interference model and a policy. For every ``decide()`` the
trace holds the app, trigger, branch, new DR, DRs pushed to others, the next boundary and the
details (floats written with ``repr``: bit for bit), and per run the final SDs.

    python -m benchmarks.decision_trace --write /tmp/before.json          # record
    python -m benchmarks.decision_trace --compare /tmp/before.json        # same again, or the first difference

``--quick`` leaves out the slow cases (64 x 16 and the mixes).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from drbalance.argtypes import positive_int
from drbalance.policy import POLICIES, Decision, Policy, Snapshot
from drbalance.sim import SimConfig, Simulation
from drbalance.sim.mixes import MIXES
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import SCENARIOS, Scenario


def _exact(value: Any) -> Any:
    """A JSON-able form that keeps floats bit for bit."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(key): _exact(item) for key, item in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_exact(item) for item in value]
    if hasattr(value, "shares"):
        return list(value.shares)
    return value


class Recorder:
    """Wraps a policy and records each decision."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.trace: list[list[Any]] = []

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        decision = self.policy.decide(app, trigger, snapshot)
        self.trace.append([app, trigger, decision.branch, list(decision.ratio.shares), _exact(dict(decision.others)),
                           _exact(decision.next_boundary), _exact(dict(decision.details))])
        return decision


def cases(quick: bool) -> list[tuple[str, str, str, str | None]]:
    """(scenario, interference, policy, placement) of every case."""
    found = []
    for interference in INTERFERENCE_MODELS:
        for name in ("a", "b", "c"):
            for placement in ("round-robin", "spread"):
                found.append((name, interference, "fair", placement))
        found.append(("a", interference, "f-sched", "spread"))
        found.append(("c", interference, "f-sched", "round-robin"))
        if not quick:
            for mix in ("8x12", "staggered", "mixed-lengths", "hetero", "64x16"):
                found.append((mix, interference, "fair", None))
    return found


def scenario_of(name: str) -> Scenario:
    return SCENARIOS[name] if name in SCENARIOS else MIXES[name]()


def run_case(case: tuple[str, str, str, str | None]) -> dict[str, Any]:
    name, interference, policy, placement = case
    recorder = Recorder(POLICIES[policy]())
    config = SimConfig(policy=policy, placement=placement, record=False, contention=make_interference(interference))
    result = Simulation(scenario_of(name), config, policy=recorder).run()
    return {"case": list(case), "decisions": recorder.trace, "final_sd": _exact(dict(result.final_sd))}


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """Human-readable differences (empty: identical)."""
    problems = []
    old = {json.dumps(run["case"]): run for run in before}
    for run in after:
        key = json.dumps(run["case"])
        base = old.get(key)
        if base is None:
            problems.append(f"{key}: not in the recorded trace")
            continue
        for index, (was, now) in enumerate(zip(base["decisions"], run["decisions"])):
            if was != now:
                problems.append(f"{key}: decision {index} differs:\n  before {was}\n  after  {now}")
                break
        else:
            if len(base["decisions"]) != len(run["decisions"]):
                problems.append(f"{key}: {len(base['decisions'])} decisions before, {len(run['decisions'])} after")
        if base["final_sd"] != run["final_sd"]:
            problems.append(f"{key}: final SDs differ")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="record the traces into this JSON file")
    parser.add_argument("--compare", type=Path, help="compare with the traces recorded in this JSON file")
    parser.add_argument("--quick", action="store_true", help="leave out 64 x 16 and the mixes")
    parser.add_argument("--jobs", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument("--only", default=None, help="run only cases whose scenario is in this comma-separated list")
    args = parser.parse_args(argv)
    if args.write is None and args.compare is None:
        parser.error("give --write or --compare")
    todo = cases(args.quick)
    if args.only:
        todo = [case for case in todo if case[0] in args.only.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_case, todo))
    total = sum(len(run["decisions"]) for run in runs)
    if args.write is not None:
        args.write.write_text(json.dumps(runs))
        print(f"recorded {len(runs)} runs, {total} decisions into {args.write}")
    if args.compare is not None:
        problems = compare(json.loads(args.compare.read_text()), runs)
        for problem in problems:
            print(problem)
        print(f"compared {len(runs)} runs, {total} decisions: {'identical' if not problems else 'DIFFERENT'}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
