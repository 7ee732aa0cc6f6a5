"""Decision latency of the policies at scale: every ``decide()`` call of a whole simulated run, timed.

64 apps (the six models, mixed run lengths, arriving over 10 minutes) on 16 GPUs, and 128 apps on
32 GPUs, simulated under each policy; each decision the simulator asks for is timed around the
call itself (``time.perf_counter``), so it includes everything the daemon's policy step does
(learning from the snapshot, the search). Policies run one after another in one process; the
table gives medians and tails per policy. Target for ``fair``: a decision within 1 ms at 64 x 16.

``--against REV`` also loads ``fair`` / ``f-sched`` as they were at git revision REV (their
modules ``predictor.py``, ``fair.py`` and ``fsched.py``; everything else is the working tree's) and runs both
in lockstep on the same snapshots, alternating which decides first: the two distributions are
measured side by side under the same load, and every decision of the two is compared (branch,
DR, pushed DRs, next boundary, details bit for bit). A performance change must report 0
differences.

``--count`` adds, for ``fair``, an untimed run of the same simulation that counts per decision
the changes it judged (distinct ones: ``Neighbourhood.compare`` calls), the apps each affects,
and the consolidation plans proposed: what a decision's time is made of.

``--set NAME=VALUE`` runs ``fair`` with a FairConfig knob changed (as ``random_mixes`` does;
also for ``--count`` and ``--crowd``; not for the old revision of ``--against``), e.g. ``--set
spread_gpus=0`` for the search over every GPU of a wide app; its results go to a file named after the knobs.

``--placement spread`` starts every app as evenly over the GPUs as its DR allows (plain DataParallel's
layout; at 64 x 16 with a DR total of 10: one unit on each of GPUs 0-9): the crowded start, where a
candidate change affects every app on the GPUs it uses and a decision costs far more.

``--crowd APPSxGPUS`` times instead ``fair``'s first decisions on a hand-built crowd: every app
spread over every GPU and measured (the worst start: one snapshot in which every change affects
every app), with its numpy solve of crowds (``Neighbourhood.DENSE_PARTNERS``) and with every set
solved in Python, alternately in one process, each on a fresh policy; every decision of the two
is compared (results in policy_crowd.json).

Usage: python -m benchmarks.bench_policy [--policies fair,paper,f-sched] [--placement spread] [--against REV]
       [--count] [--crowd APPSxGPUS [--repeats N]] [--set NAME=VALUE] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Mapping
from pathlib import Path

from benchmarks.bench_simulator import big_scenario
from benchmarks.random_mixes import Knobs, add_knob_option, fair_with, parsed_knobs
from benchmarks.timing import add_no_write, save, summary
from drbalance.argtypes import positive_int
from drbalance.policy import POLICIES, AppView, Decision, Policy, PolicyConfig, Snapshot
from drbalance.policy.predictor import Neighbourhood
from drbalance.ratio import DataRatio
from drbalance.sim import SimConfig, Simulation

ROOT = Path(__file__).resolve().parent.parent
REVISABLE = ("predictor", "fair", "fsched")  # drbalance/policy modules loaded at --against's revision


class Timed:
    """Wraps a policy and records the wall time of every decision (seconds), and the CPU time
    its thread spent in it (on a loaded machine the wall time's tail is mostly waiting for a
    core; the CPU time is the decision's own cost)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        cpu = time.thread_time()
        started = time.perf_counter()
        decision = self.policy.decide(app, trigger, snapshot)
        self.seconds.append(time.perf_counter() - started)
        self.cpu_seconds.append(time.thread_time() - cpu)
        return decision


class Lockstep:
    """Two implementations of one policy deciding on the same snapshots, timed alternately (the
    first of them drives the simulation); counts the decisions on which they differ."""

    def __init__(self, current: Policy, baseline: Policy) -> None:
        self.current, self.baseline = Timed(current), Timed(baseline)
        self.name = current.name
        self.differences = 0
        self.first_difference: str | None = None

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        if len(self.current.seconds) % 2:
            theirs = self.baseline.decide(app, trigger, snapshot)
            ours = self.current.decide(app, trigger, snapshot)
        else:
            ours = self.current.decide(app, trigger, snapshot)
            theirs = self.baseline.decide(app, trigger, snapshot)
        if _key(ours) != _key(theirs):
            self.differences += 1
            if self.first_difference is None:
                self.first_difference = f"decision {len(self.current.seconds)}: {_key(ours)} != {_key(theirs)}"
        return ours


def _key(decision: Decision) -> tuple:
    return (decision.app, decision.branch, decision.ratio, tuple(sorted(decision.others.items())),
            repr(decision.next_boundary), repr(sorted(decision.details.items())))


def policy_at(revision: str, name: str) -> Policy:
    """A new ``name`` policy built from the policy modules as they were at git ``revision``."""
    modules = modules_at(revision)
    classes = {"fair": modules["fair"].FairPolicy, "f-sched": modules["fsched"].FSchedPolicy}
    if name not in classes:
        raise ValueError(f"--against compares {', '.join(classes)} only; got {name!r}")
    return classes[name]()


def modules_at(revision: str) -> dict[str, types.ModuleType]:
    """The modules of ``REVISABLE`` as they were at git ``revision`` (under private names; each
    imports the others at that revision, and everything else as it is now)."""
    modules: dict[str, types.ModuleType] = {}
    tag = f"_bench_{abs(hash(revision))}"
    for stem in REVISABLE:
        qualified = f"{tag}_{stem}"
        if qualified in sys.modules:
            modules[stem] = sys.modules[qualified]
            continue
        source = subprocess.run(["git", "show", f"{revision}:drbalance/policy/{stem}.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        for earlier in modules:
            source = source.replace(f"from drbalance.policy.{earlier} import", f"from {tag}_{earlier} import")
        module = types.ModuleType(qualified)
        module.__file__ = f"{revision}:drbalance/policy/{stem}.py"
        sys.modules[qualified] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        modules[stem] = module
    return modules


def _policy(name: str, knobs: Knobs) -> Policy:
    """A fresh policy of the registry, or ``fair`` with ``--set``'s knobs."""
    return fair_with(name, knobs) or POLICIES[name]()


def _results_name(base: str, knobs: Knobs) -> str:
    """The results file's name: a variant's (``--set``) never replaces the defaults' results."""
    return base + "".join(f"_set_{knob}-{value}" for knob, value in knobs)


def run(policy: str, apps: int, gpus: int, against: str | None = None, placement: str = "round-robin",
        knobs: Knobs = ()) -> dict:
    deciding = _policy(policy, knobs)
    if against is None:
        timed = driver = Timed(deciding)
    else:
        driver = Lockstep(deciding, policy_at(against, policy))
        timed = driver.current
    started = time.perf_counter()
    config = SimConfig(policy=policy, placement=placement, record=False)
    result = Simulation(big_scenario(apps, gpus), config, policy=driver).run()
    case = {"decision_seconds": summary(timed.seconds), "decision_max_s": max(timed.seconds),
            "decision_cpu_seconds": summary(timed.cpu_seconds),
            "simulation_s": time.perf_counter() - started, "decisions": len(timed.seconds),
            "max_sd": result.max_sd, "mean_sd": result.mean_sd}
    if isinstance(driver, Lockstep):
        case["against"] = {"revision": against, "decision_seconds": summary(driver.baseline.seconds),
                           "decision_cpu_seconds": summary(driver.baseline.cpu_seconds),
                           "decision_max_s": max(driver.baseline.seconds), "differences": driver.differences,
                           "first_difference": driver.first_difference}
    return case


def count_fair(apps: int, gpus: int, placement: str = "round-robin", knobs: Knobs = ()) -> dict:
    """Per decision of ``fair`` (the working tree's code) in the ``apps`` x ``gpus`` run: the distinct
    changes it judged, and over all of them the apps each affected; the consolidation plans
    proposed. Counted in an untimed run (the counting wraps two methods)."""
    from drbalance.policy.fair import _Search
    from drbalance.policy.predictor import Neighbourhood

    judged: list[int] = []
    affected: list[int] = []
    plans = [0]
    compare, consolidation = Neighbourhood.compare, _Search._consolidation_plans

    def counted_compare(self: Neighbourhood,
                        changes: Mapping[str, DataRatio]) -> tuple[dict[str, float], dict[str, float]]:
        found = compare(self, changes)
        judged[-1] += 1
        affected.append(len(found[0]))
        return found

    def counted_plans(self: _Search) -> list[dict[str, DataRatio]]:
        found = consolidation(self)
        plans[0] += len(found)
        return found

    policy = _policy("fair", knobs)

    class Counting:
        name = policy.name

        def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
            judged.append(0)
            return policy.decide(app, trigger, snapshot)

    Neighbourhood.compare, _Search._consolidation_plans = counted_compare, counted_plans
    try:
        Simulation(big_scenario(apps, gpus), SimConfig(policy="fair", placement=placement, record=False),
                   policy=Counting()).run()
    finally:
        Neighbourhood.compare, _Search._consolidation_plans = compare, consolidation
    ordered = sorted(judged)
    return {"decisions": len(judged), "judged_median": ordered[len(ordered) // 2],
            "judged_p90": ordered[int(0.9 * len(ordered))], "judged_p99": ordered[int(0.99 * len(ordered))],
            "judged_max": ordered[-1], "affected_mean": sum(affected) / max(1, len(affected)),
            "consolidation_plans": plans[0]}


CROWD_ITERATIONS = 1000


def crowd_snapshot(apps: int, gpus: int, step: int, seed: int = 0) -> Snapshot:
    """``apps`` apps of 1000 iterations, each over all ``gpus`` GPUs (equal shares of a batch of
    64), measured: chunks of 0.05-0.4 s per full batch (less for a smaller chunk, +-10% noise),
    iteration times as if the crowd stretched them; ``step`` windows later, 5% slower each."""
    rng = random.Random(seed * 1000 + step)
    ratio = DataRatio.from_weights([1] * gpus)
    batch = 64
    sizes = ratio.split(batch)
    views = []
    for index in range(apps):
        full = rng.uniform(0.05, 0.4)
        iteration_time = 0.05 + full * gpus * 0.4 * (1 + 0.1 * step)
        chunks = tuple(full * (0.3 + 0.7 * n / batch) * (1 + 0.05 * step) * rng.uniform(0.9, 1.1) if n else None
                       for n in sizes)
        solo = 0.02 + full
        views.append(AppView(f"app{index}", ratio, iteration_time / solo, iteration=100 + 20 * step,
                             iterations_total=CROWD_ITERATIONS, iteration_time=iteration_time,
                             solo_time=CROWD_ITERATIONS * solo, batch=batch, chunk_seconds=chunks,
                             chunk_samples=tuple(float(n) for n in sizes)))
    return Snapshot(tuple(views), (90.0,) * gpus, PolicyConfig(gpus))


def crowd(apps: int, gpus: int, repeats: int, steps: int = 3, knobs: Knobs = ()) -> dict:
    """``fair``'s decisions on ``crowd_snapshot`` windows 0..steps-1 (app0 deciding), on a fresh
    policy per repeat, with the dense solve and with Python only (``DENSE_PARTNERS`` out of reach),
    alternating which goes first; seconds per decision, per window; decisions compared."""
    snapshots = [crowd_snapshot(apps, gpus, step) for step in range(steps)]
    kept = Neighbourhood.DENSE_PARTNERS
    modes = {"dense": kept, "python": 10**12}
    seconds: dict[str, list[list[float]]] = {mode: [[] for _ in snapshots] for mode in modes}
    decisions: dict[str, list] = {}
    differences = 0
    try:
        for repeat in range(repeats):
            order = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
            for mode in order:
                Neighbourhood.DENSE_PARTNERS = modes[mode]
                policy = _policy("fair", knobs)
                made = []
                for step, snapshot in enumerate(snapshots):
                    started = time.perf_counter()
                    made.append(_key(policy.decide("app0", "boundary", snapshot)))
                    seconds[mode][step].append(time.perf_counter() - started)
                if mode in decisions:
                    differences += made != decisions[mode]
                decisions[mode] = made
            differences += decisions["dense"] != decisions["python"]
    finally:
        Neighbourhood.DENSE_PARTNERS = kept
    return {"seconds": {mode: [statistics.median(values) for values in per_step] for mode, per_step in seconds.items()},
            "repeats": repeats, "differences": differences,
            "branches": [decision[1] for decision in decisions["dense"]]}


def _line(label: str, seconds: dict, largest: float) -> str:
    return (f"{label}: median {seconds['median'] * 1e3:.3f} ms, p90 {seconds['p90'] * 1e3:.3f} ms, "
            f"p99 {seconds['p99'] * 1e3:.3f} ms, max {largest * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="fair,paper,f-sched", help="comma-separated policies")
    parser.add_argument("--sizes", default="64x16,128x32", help="comma-separated APPSxGPUS")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="also run fair / f-sched as at this git revision, in lockstep (see above)")
    parser.add_argument("--count", action="store_true",
                        help="for fair, also count judged changes per decision in an untimed run (see above)")
    parser.add_argument("--placement", choices=("round-robin", "spread"), default="round-robin",
                        help="where each app starts: alone on one GPU (default) or as evenly over the GPUs as its DR "
                             "allows, as plain DataParallel (the crowded start: a change then affects every app on "
                             "the GPUs it uses); "
                             "results go to policy_spread.json")
    parser.add_argument("--crowd", default=None, metavar="APPSxGPUS",
                        help="time fair's first decisions on a hand-built crowd instead (see above)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per solve path with --crowd (default 5)")
    add_knob_option(parser)
    add_no_write(parser)
    args = parser.parse_args(argv)
    knobs = parsed_knobs(parser, args)
    if args.crowd is not None:
        return _crowd_main(args, argv, knobs)
    payload: dict = {"args": vars(args), "runs": {}}
    for size in args.sizes.split(","):
        apps, gpus = (int(part) for part in size.split("x"))
        for policy in args.policies.split(","):
            against = args.against if args.against and policy in ("fair", "f-sched") else None
            case = run(policy, apps, gpus, against, args.placement, knobs)
            payload["runs"][f"{policy}@{size}"] = case
            print(f"{policy:8} {size:7} decisions {case['decisions']:6}: "
                  + _line("", case["decision_seconds"], case["decision_max_s"])[2:]
                  + f"; whole simulation {case['simulation_s']:.1f} s; "
                  f"final max/mean SD {case['max_sd']:.3f}/{case['mean_sd']:.3f}", flush=True)
            cpu = case["decision_cpu_seconds"]
            print(f"{'':17} CPU time: median {cpu['median'] * 1e3:.3f} ms, p90 {cpu['p90'] * 1e3:.3f} ms, "
                  f"p99 {cpu['p99'] * 1e3:.3f} ms", flush=True)
            if against is not None:
                other = case["against"]
                base, ours = other["decision_seconds"], case["decision_seconds"]
                base_cpu = other["decision_cpu_seconds"]
                print(f"{'':8} {'':7} " + _line(f"at {against}", base, other["decision_max_s"])
                      + f"; CPU time median {base_cpu['median'] * 1e3:.3f} ms, p99 {base_cpu['p99'] * 1e3:.3f} ms",
                      flush=True)
                print(f"{'':17} current / {against}: wall median {ours['median'] / base['median']:.2f}, "
                      f"p99 {ours['p99'] / base['p99']:.2f}; CPU median {cpu['median'] / base_cpu['median']:.2f}, "
                      f"p99 {cpu['p99'] / base_cpu['p99']:.2f}; decisions that differ: {other['differences']}",
                      flush=True)
                if case["against"]["first_difference"]:
                    print(f"{'':17} first: {case['against']['first_difference']}", flush=True)
            if args.count and policy == "fair":
                counts = case["counts"] = count_fair(apps, gpus, args.placement, knobs)
                print(f"{'':17} judged changes per decision: median {counts['judged_median']}, "
                      f"p90 {counts['judged_p90']}, p99 {counts['judged_p99']}, max {counts['judged_max']}; "
                      f"apps affected per change {counts['affected_mean']:.1f} on average; "
                      f"consolidation plans proposed {counts['consolidation_plans']}", flush=True)
    name = "policy" if args.placement == "round-robin" else "policy_spread"
    save(_results_name(name, knobs), "benchmarks.bench_policy", argv, payload, args.no_write)
    return 0


def _crowd_main(args: argparse.Namespace, argv: list[str] | None, knobs: Knobs = ()) -> int:
    apps, gpus = (int(part) for part in args.crowd.split("x"))
    case = crowd(apps, gpus, args.repeats, knobs=knobs)
    for step, (dense, python) in enumerate(zip(case["seconds"]["dense"], case["seconds"]["python"])):
        print(f"window {step} ({case['branches'][step]}): dense {dense * 1e3:.1f} ms, python {python * 1e3:.1f} ms, "
              f"ratio {dense / python:.2f} (medians of {args.repeats})", flush=True)
    print(f"decisions that differ: {case['differences']}", flush=True)
    save(_results_name("policy_crowd", knobs), "benchmarks.bench_policy", argv, {"args": vars(args), "crowd": case},
         args.no_write)
    return 1 if case["differences"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
