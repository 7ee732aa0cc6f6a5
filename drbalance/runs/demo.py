"""``drbalance demo``: the paper's scenario (a), scaled down, without and with balancing.

Six training jobs (2 x DenseNet121, 2 x ResNet50, 2 x AlexNet; real torchvision models on
FakeData) share 4 GPUs: first under the ``observe`` policy (each job keeps its one-GPU
round-robin placement), then under the paper's policy, then under ``fair`` (drbalance's own).
Prints the comparison table and writes the plots. An earlier demo's runs in the same folder are
moved aside first (``set_aside_earlier_runs``): a run's logs are appended to, never replaced.
Without 4 CUDA GPUs the GPUs are *emulated* (see docs/emulation.md): time-shared device slots on
this CPU with device times from published per-model measurements.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from drbalance import defaults, progress
from drbalance.argtypes import non_empty_path, non_negative_int, positive_float_up_to
from drbalance.ipc.private import write_private
from drbalance.policy import POLICIES
from drbalance.report.metrics import load_run, summarise
from drbalance.runs.launch import LaunchOptions, earlier_run, launch, resolve_devices
from drbalance.workload.scenarios import load_scenario

EMULATED_NOTICE = (
    "NOTE: no {gpus} CUDA GPUs here, so the {gpus} GPUs are EMULATED: time-shared device slots on "
    "this CPU. The models train for real on the CPU; their GPU time is modelled from published "
    "per-model measurements, stretched {scale:g}x (docs/emulation.md)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=non_empty_path, default=Path("drbalance-demo"),
                        help="directory for the runs (one per policy) and the report (default ./drbalance-demo)")
    parser.add_argument("--scenario", default="demo-a", help="scenario to run (default demo-a)")
    parser.add_argument("--devices", default="auto", choices=["auto", "emulated", "cuda"],
                        help="CUDA GPUs if the scenario's number exist (auto), or emulated ones")
    parser.add_argument("--time-scale", type=positive_float_up_to(defaults.MAX_TIME_SCALE), default=15.0,
                        help="emulated GPUs: how much slower than the modelled GPU (default 15, at most "
                        f"{defaults.MAX_TIME_SCALE:g})")
    parser.add_argument("--decide-every", type=non_negative_int, default=4,
                        help="iterations between decisions, for every policy (default 4: the demo's jobs run "
                        "only 12-40 iterations, and every 2 a move is judged on two iterations' noisy times; "
                        "docs/benchmarks.md. 0: the policy's own cadence)")
    parser.add_argument("--policies", type=parse_policies, default=DEMO_POLICIES,
                        help=f"comma-separated policies to run in turn (default {','.join(DEMO_POLICIES)})")
    progress.add_argument(parser)


DEMO_POLICIES = ("observe", "paper", "fair")
LABELS = {"observe": "without balancing (observe)", "paper": "the paper's policy", "fair": "drbalance (fair)"}


def parse_policies(text: str) -> tuple[str, ...]:
    """``observe,fair`` -> ("observe", "fair"); every name must be a registered policy."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--policies takes names from {', '.join(POLICIES)}; got {text!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # each policy's run has its own folder: a second run would be refused after the first
        raise argparse.ArgumentTypeError(f"--policies names {', '.join(repeated)} twice; each policy runs once")
    return names


def set_aside_earlier_runs(out: Path, policies: tuple[str, ...]) -> list[tuple[Path, Path]]:
    """Move an earlier demo's runs out of the way of this one, keeping them: every policy folder
    of ``out`` that holds a run's logs (``launch.earlier_run``), and then the report folder, is
    renamed to ``<name>.<n>`` with the first ``n`` >= 1 free for all of them. Returns the
    (old, new) paths, none if nothing was there. A run directory is never reused: ``launch``
    would refuse it, since the new logs would be appended to the old ones."""
    names = [name for name in policies if earlier_run(out / name) is not None]
    if not names:
        return []
    if os.path.lexists(out / "report"):
        names.append("report")
    suffix = 1
    while any(os.path.lexists(out / f"{name}.{suffix}") for name in names):
        suffix += 1
    moved = []
    for name in names:
        target = out / f"{name}.{suffix}"
        (out / name).rename(target)
        moved.append((out / name, target))
    return moved


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    devices = resolve_devices(args.devices, scenario.gpus)
    emulated = devices == "emulated"
    print(f"drbalance demo: {scenario.description}")
    if emulated:
        print(EMULATED_NOTICE.format(gpus=scenario.gpus, scale=args.time_scale))
    else:
        print(f"Using {scenario.gpus} real CUDA GPUs; solo-run times come from stored profiles named after "
              f"the models (drbalance profile MODEL -- python -m drbalance.runs.train --model MODEL ...).")
    moved = set_aside_earlier_runs(args.out, args.policies)
    if moved:
        print(f"An earlier demo's output was moved aside (nothing deleted): "
              f"{', '.join(f'{old} -> {new}' for old, new in moved)}")
    started = time.monotonic()
    runs = []
    show = progress.wanted(args.progress)
    bar = progress.bar(show, len(args.policies), "demo", "runs")  # per policy run; launch's bar: per iteration
    for policy in args.policies:
        label = LABELS.get(policy, policy)
        bar.set_postfix_str(policy)
        bar.write(f"\nrun {len(runs) + 1}/{len(args.policies)}: {label} ...")
        run_dir = args.out / policy
        options = LaunchOptions(scenario, policy, run_dir, devices, args.time_scale, decide_every=args.decide_every,
                                label=label, progress=show)
        launch(options)
        runs.append(run_dir)
        bar.update(1)
        bar.write(f"  done in {time.monotonic() - started:.0f} s; logs in {run_dir}")
    bar.close()
    from drbalance.report.command import format_table
    from drbalance.report.plots import plot_runs

    data = [load_run(path) for path in runs]
    table = format_table([summarise(run_data) for run_data in data])
    plots = plot_runs(data, args.out / "report")
    write_private(args.out / "report" / "report.md", ("```\n" + table + "\n```\n").encode("utf-8"))
    print("\n" + table)
    print(f"\nplots: {', '.join(str(p) for p in plots)}")
    print(f"total {time.monotonic() - started:.0f} s")
    if emulated:
        print("Reminder: the GPUs in this demo were emulated (CPU-only machine).")
    return 0
