"""``drbalance simulate SCENARIO``: simulate under a policy (or every baseline), print the report table.

    drbalance simulate a                                # one run of the default policy (fair)
    drbalance simulate a --compare                      # fair, f-sched, paper, observe, DataParallel, themis + bound
    drbalance simulate a --interference gavel           # Gavel's measured pair interference instead of one capacity
    drbalance simulate a --policy paper --out runs/sim  # also write logs that 'drbalance report' plots
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from drbalance import defaults, progress
from drbalance.argtypes import (
    integer_within,
    non_empty_path,
    non_negative_float,
    non_negative_int,
    percent,
    relative_spread,
)
from drbalance.ipc.private import make_dirs, write_private
from drbalance.jsonlog import JsonLinesWriter
from drbalance.policy import DEFAULT_POLICY, POLICIES
from drbalance.report.command import format_table
from drbalance.report.metrics import RunData, run_from_records, summarise
from drbalance.runs.launch import earlier_run
from drbalance.sim.bound import bounds
from drbalance.sim.engine import SimConfig, SimResult, check_horizon, simulate
from drbalance.sim.model import INTERFERENCE_MODELS, make_interference
from drbalance.workload.scenarios import MAX_DR_TOTAL, PLACEMENTS, Scenario, load_scenario


@dataclass(frozen=True)
class Variant:
    label: str
    config: SimConfig


def baselines(base: SimConfig) -> list[Variant]:
    """The comparison set: our policies and the paper's from the chosen placement, and what a user
    could pick instead."""
    return [
        Variant("fair", replace(base, policy="fair", scheduler=None)),
        Variant("f-sched", replace(base, policy="f-sched", scheduler=None)),
        Variant("paper", replace(base, policy="paper", scheduler=None)),
        Variant("observe (1 GPU/app, round-robin)", replace(base, policy="observe", placement="round-robin",
                                                            scheduler=None)),
        Variant("DataParallel (even over all GPUs)", replace(base, policy="observe", placement="spread",
                                                             scheduler=None)),
        Variant("themis (time-slicing, rho)", replace(base, scheduler="themis", placement=None)),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a, b, c, demo-a, e2e-a, e2e-skewed, or a scenario .json file")
    parser.add_argument("--policy", default=None, choices=list(POLICIES),
                        help=f"DR policy (default: {DEFAULT_POLICY}); not with --compare, which runs them all")
    parser.add_argument("--scheduler", choices=["themis"], default=None,
                        help="time-slice whole GPUs by finish-time fairness instead of a DR policy")
    parser.add_argument("--placement", choices=PLACEMENTS, default=None,
                        help="initial DRs: round-robin (1 GPU per app) or spread (plain DataParallel)")
    parser.add_argument("--compare", action="store_true",
                        help="run fair, f-sched and paper from the placement, and every baseline, plus the bound")
    parser.add_argument("--interference", choices=list(INTERFERENCE_MODELS), default="calibrated",
                        help="how co-located apps slow each other: one fitted capacity for every pair "
                        "(calibrated) or Gavel's measured pairs (gavel); see docs/simulator.md")
    parser.add_argument("--dr-total", type=integer_within(1, MAX_DR_TOTAL), default=None,
                        help="DR granularity (shares per mini-batch, 1..65535 as for the manager; default: the "
                        "scenario's, 10); a DDP app keeps one unit on each rank")
    parser.add_argument("--decide-every", type=non_negative_int, default=None,
                        help="iterations between decisions besides epoch ends (default, or 0: the policy's choice)")
    parser.add_argument("--jitter", type=relative_spread, default=0.0,
                        help="relative spread of every host phase and GPU chunk (log-normal, mean 1), as on a real "
                        "or emulated machine: 0.1 = about 10%%; default 0 (every iteration alike)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of --jitter's random numbers (the same seed, the same run; default 0)")
    parser.add_argument("--sd-threshold", type=non_negative_float, default=defaults.SD_THRESHOLD,
                        help="SD_th (paper policy): no move while max SD - min SD is below this")
    parser.add_argument("--util-threshold", type=percent, default=defaults.UTIL_THRESHOLD,
                        help="Util_th in percent points (paper policy)")
    parser.add_argument("--out", type=non_empty_path, default=None,
                        help="write each run's logs to OUT/<label>/ (readable by 'drbalance report')")
    parser.add_argument("--json", action="store_true",
                        help="print results as JSON (keys: docs/simulator.md; every value but a run's "
                             "wall-clock 'seconds' is the same on every run)")
    progress.add_argument(parser)


def to_run(result: SimResult, label: str, scenario: Scenario) -> RunData:
    info = {"label": label, "started": 0.0, "scenario": scenario.name, "simulated": True, "gpus": scenario.gpus}
    return run_from_records(label, result.app_records, result.manager_records, info)


def write_run_dir(result: SimResult, label: str, scenario: Scenario, out: Path) -> Path:
    """Logs in the launcher's run-directory layout, so 'drbalance report' reads them."""
    _refuse_links(out)
    make_dirs(out / "apps")
    for name, records in result.app_records.items():
        writer = JsonLinesWriter(out / "apps" / f"{name}.sd.jsonl", flush_every=4096)
        for record in records:
            writer.write(record)
        writer.close()
    writer = JsonLinesWriter(out / "manager.jsonl", flush_every=4096)
    for record in result.manager_records:
        writer.write(record)
    writer.close()
    info = {"label": label, "started": 0.0, "scenario": scenario.name, "simulated": True, "gpus": scenario.gpus,
            "final_sd": result.final_sd, "makespan": result.makespan, "events": result.events}
    write_private(out / "run.json", json.dumps(info, indent=2).encode("utf-8"))
    return out


def _refuse_links(run_dir: Path) -> None:
    """A run folder, or its ``apps``, that is a symbolic link (planted in a shared folder: the logs
    would go where it points) is refused: ``ValueError`` naming it."""
    for path in (run_dir, run_dir / "apps"):
        if path.is_symlink():
            raise ValueError(f"--out: {path} is a symbolic link; give a folder of your own")


def run_dir_name(variant: Variant) -> str:
    """The folder of ``--out`` a variant's logs go to: the first word of its label."""
    return variant.label.split(" ")[0]


def check_out_dirs(out: Path, names: list[str]) -> None:
    """Before anything is simulated: ``out`` must be a folder (or not exist yet) and none of its
    run folders may hold an earlier run's logs (they would be mixed into this run's, as
    ``launch`` refuses too). ValueError naming the path."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    for name in names:
        _refuse_links(out / name)
        found = earlier_run(out / name)
        if found is not None:
            raise ValueError(f"--out {out}: {out / name} already holds an earlier run ({found} exists); "
                             f"give another --out or move it away")


def check_arguments(args: argparse.Namespace) -> None:
    """Options that another one would silently override are refused (ValueError: a usage error,
    exit status 2): ``--compare`` runs every policy and the scheduler itself, and ``--scheduler``
    time-slices whole GPUs instead of running a DR policy."""
    if args.compare and (args.policy is not None or args.scheduler is not None):
        given = "--policy" if args.policy is not None else "--scheduler"
        raise ValueError(f"--compare runs fair, f-sched, paper, observe, DataParallel and themis itself; "
                         f"{given} cannot be combined with it (drop one of the two)")
    if args.scheduler is not None and args.policy is not None:
        raise ValueError(f"--scheduler {args.scheduler} time-slices whole GPUs instead of a DR policy; "
                         f"--policy cannot be combined with it (drop one of the two)")


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    if args.dr_total is not None:
        try:
            scenario = scenario.with_dr_total(args.dr_total)
        except ValueError as error:  # a DDP app of more ranks than --dr-total
            raise ValueError(f"{args.scenario}: --dr-total: {error}") from None
    policy = args.policy or DEFAULT_POLICY
    base = SimConfig(policy=policy, placement=args.placement, scheduler=args.scheduler,
                     decide_every=args.decide_every, sd_threshold=args.sd_threshold,
                     util_threshold=args.util_threshold, contention=make_interference(args.interference),
                     jitter=args.jitter, seed=args.seed)
    try:  # before anything is simulated or written, naming the scenario file
        check_horizon(scenario, base.max_time)
    except ValueError as error:
        raise ValueError(f"{args.scenario}: {error}") from None
    variants = baselines(base) if args.compare else [Variant(args.scheduler or policy, base)]
    if args.out:
        check_out_dirs(args.out, [run_dir_name(variant) for variant in variants])
    summaries, report = [], {}
    bar = progress.bar(progress.wanted(args.progress) and len(variants) > 1, len(variants),
                       f"simulate {scenario.name}", "runs")
    for variant in variants:
        bar.set_postfix_str(variant.label.split(" ")[0])
        started = time.perf_counter()
        result = simulate(scenario, variant.config)
        spent = time.perf_counter() - started
        run_data = to_run(result, variant.label, scenario)
        summaries.append(summarise(run_data, step=max(1.0, result.makespan / 2000)))
        summary = summaries[-1]
        report[variant.label] = {"final_sd": result.final_sd, "makespan": result.makespan, "seconds": spent,
                                 "events": result.events, "max_sd": result.max_sd, "mean_sd": result.mean_sd,
                                 "sd_spread": result.sd_spread, "mean_util": summary.mean_util,
                                 "mean_sd_time_avg": summary.mean_sd, "decisions": result.decisions}
        if args.out:
            write_run_dir(result, variant.label, scenario, args.out / run_dir_name(variant))
        bar.update(1)
    bar.close()
    found = bounds(scenario, base.contention)
    bound = found.value
    if args.json:
        print(json.dumps({"scenario": scenario.name, "interference": args.interference, "jitter": args.jitter,
                          "seed": args.seed, "bound_max_sd": bound,
                          "capacity_bound": found.capacity,
                          "sharing_bound": found.sharing.value if found.sharing is not None else None,
                          "runs": report}, indent=2))
        return 0
    print(f"scenario {scenario.name}: {scenario.description} (interference: {args.interference})")
    print(format_table(summaries))
    print("max SD: " + ", ".join(f"{s.label.split(' ')[0]} {max(v for v in s.final_sd.values()):.3f}"
                                  for s in summaries) + f"; lower bound for any DR policy {bound:.3f}")
    sharing = f"{found.sharing.value:.3f}" if found.sharing is not None else "n/a (apps arrive apart or > 7 apps)"
    print(f"  (capacity bound {found.capacity:.3f}, sharing bound {sharing}: docs/simulator.md#the-lower-bound)")
    print("simulated in " + ", ".join(f"{label.split(' ')[0]} {r['seconds']:.2f} s" for label, r in report.items()))
    if args.out:
        print(f"logs: {args.out}/<run>/ (plot with: drbalance report {args.out}/*)")
    return 0
