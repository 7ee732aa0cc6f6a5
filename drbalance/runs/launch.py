"""``drbalance launch``: a manager and a scenario's apps as real processes, logs in one run directory.

The run directory holds ``run.json`` (what ran, when, exit codes), ``manager.jsonl`` (the
manager's log), ``apps/<app>.sd.jsonl`` (each app's SD log) and ``apps/<app>.out`` (its output).
Each run gets its own namespace, so runs never meet each other or a user's manager.

On emulated GPUs every modelled time is stretched by ``--time-scale`` (so that the real CPU
work of six jobs on a small machine hides inside the modelled host time), each app's real
mini-batch is ``--real-batch`` images of ``--image-size`` pixels standing for the scenario's
batch, and solo-run times come from the timing model. On CUDA GPUs solo-run times come from
stored profiles named after the models (``drbalance profile resnet50 -- python -m drbalance.runs.train ...``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from drbalance import defaults, progress
from drbalance.argtypes import (
    non_empty_path,
    non_negative_float,
    non_negative_int,
    percent,
    positive_float,
    positive_float_up_to,
    positive_int,
)
from drbalance.cli import raise_if_terminated
from drbalance.emu.gpus import remove_emulated_gpus
from drbalance.ipc.names import IpcNames
from drbalance.ipc.private import make_dirs, open_private, write_private
from drbalance.policy import DEFAULT_POLICY, POLICIES
from drbalance.workload.models import MIN_IMAGE_SIZE, SHORT_NAMES
from drbalance.workload.scenarios import Scenario, load_scenario

logger = logging.getLogger(__name__)


@dataclass
class LaunchOptions:
    scenario: Scenario
    policy: str
    run_dir: Path
    devices: str = "emulated"  # "emulated" or "cuda"
    time_scale: float = defaults.EMULATED_TIME_SCALE
    real_batch: int = defaults.EMULATED_REAL_BATCH
    image_size: int = defaults.IMAGE_SIZE
    decide_every: int | None = None
    report_every: int = 2
    sd_threshold: float | None = None
    util_threshold: float | None = None
    timeout: float | None = None
    label: str | None = None
    extra_manager_args: list[str] = field(default_factory=list)
    progress: bool = False  # a bar of the apps' iterations (all apps together) with the time left, on stderr
    estimate_solo: bool = False  # apps get no solo-run time: each estimates its own (drbalance.solo_estimate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a, b, c, demo-a, e2e-a, e2e-skewed, or a scenario .json file")
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES),
                        help="the manager's policy ('observe' = no balancing)")
    parser.add_argument("--run-dir", type=non_empty_path, required=True,
                        help="directory for this run's logs (created; refused if it holds an earlier run's logs)")
    parser.add_argument("--devices", default="auto", choices=["auto", "emulated", "cuda"],
                        help="real CUDA GPUs or emulated ones (auto: CUDA if the scenario's GPUs exist)")
    parser.add_argument("--time-scale", type=positive_float_up_to(defaults.MAX_TIME_SCALE),
                        default=defaults.EMULATED_TIME_SCALE,
                        help=f"emulated GPUs: stretch modelled times (at most {defaults.MAX_TIME_SCALE:g})")
    parser.add_argument("--real-batch", type=positive_int, default=defaults.EMULATED_REAL_BATCH,
                        help="emulated GPUs: real images per iteration")
    parser.add_argument("--image-size", type=positive_int, default=defaults.IMAGE_SIZE, help="image side in pixels")
    parser.add_argument("--decide-every", type=non_negative_int, default=None,
                        help="iterations between decisions (default: the policy's own cadence)")
    parser.add_argument("--sd-threshold", type=non_negative_float, default=None,
                        help=f"manager's SD_th (paper policy; default {defaults.SD_THRESHOLD})")
    parser.add_argument("--util-threshold", type=percent, default=None,
                        help=f"manager's Util_th, percent points (paper policy; default {defaults.UTIL_THRESHOLD:g})")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="stop every app after this many seconds (default: run to the end)")
    parser.add_argument("--label", default=None, help="name of this run in reports (default: the policy)")
    parser.add_argument("--estimate-solo", action="store_true",
                        help="give the apps no solo-run time: each estimates its own from its measurements, as a "
                        "job without a profile does (docs/profiles.md; benchmarks/solo_estimate.py measures it)")
    progress.add_argument(parser)


def cuda_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def resolve_devices(requested: str, gpus: int) -> str:
    """``--devices`` for a scenario of ``gpus`` GPUs: "auto" picks CUDA when this machine has that
    many CUDA devices, else emulated ones; "cuda" is refused here, before any process starts, when it
    has fewer."""
    if requested == "emulated":
        return requested
    found = cuda_gpu_count()
    if requested == "auto":
        return "cuda" if found >= gpus else "emulated"
    if found < gpus:
        raise ValueError(f"--devices cuda: the scenario needs {gpus} GPUs and torch sees {found} CUDA device(s) "
                         "here; use --devices emulated (or auto)")
    return requested


def check_launchable(scenario: Scenario, devices: str, image_size: int, real_batch: int) -> None:
    """ValueError, before anything starts, for an app whose training script would refuse it at
    once: a model the scripts do not train (``MIN_IMAGE_SIZE`` lists those; the simulator also
    takes short names and other torchvision models), or an ``image_size`` (pixels a side) under
    its model's smallest (``MIN_IMAGE_SIZE``): the one for chunks of one sample for a DDP app (a
    rank may hold one sample of a global batch) and for a DataParallel app of one sample per
    iteration (``real_batch`` on emulated GPUs, the app's batch on CUDA ``devices``)."""
    for app in scenario.apps:
        if app.model not in MIN_IMAGE_SIZE:
            full = SHORT_NAMES.get(app.model)
            hint = f"; write {full!r} for {app.model!r}" if full else ""
            raise ValueError(f"app {app.name!r}: model {app.model!r} is not one the training scripts train "
                             f"({', '.join(MIN_IMAGE_SIZE)}){hint}")
        shared, alone = MIN_IMAGE_SIZE[app.model]
        batch = real_batch if devices == "emulated" else app.batch
        if image_size < shared:
            raise ValueError(f"argument --image-size: app {app.name!r} trains {app.model}, on images of at least "
                             f"{shared} pixels a side; got {image_size}")
        if (app.ddp or batch == 1) and image_size < alone:
            how = ("as a DDP job, whose ranks may hold one sample each" if app.ddp
                   else "one sample per iteration")
            raise ValueError(f"argument --image-size: app {app.name!r} trains {app.model} {how}, on images of "
                             f"at least {alone} pixels a side; got {image_size}")


def check_arguments(args: argparse.Namespace) -> None:
    """Usage errors found before anything starts: the scenario's models and ``--image-size``
    (``check_launchable``). A scenario that cannot be loaded is left to ``run``, which says so."""
    try:
        scenario = load_scenario(args.scenario)
    except (ValueError, OSError):
        return
    devices = args.devices if args.devices != "auto" else resolve_devices("auto", scenario.gpus)
    check_launchable(scenario, devices, args.image_size, args.real_batch)


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    devices = resolve_devices(args.devices, scenario.gpus)
    options = LaunchOptions(
        scenario, args.policy, args.run_dir, devices, args.time_scale, args.real_batch, args.image_size,
        args.decide_every, sd_threshold=args.sd_threshold, util_threshold=args.util_threshold,
        timeout=args.timeout, label=args.label, progress=progress.wanted(args.progress),
        estimate_solo=args.estimate_solo,
    )
    launch(options)
    from drbalance.report.command import summarise_runs

    print(summarise_runs([args.run_dir]))
    return 0


def _wait_for(predicate, timeout: float, what: str, process: subprocess.Popen | None = None,
              output: Path | None = None) -> None:
    """Poll ``predicate``; RuntimeError if ``process`` exits first (with the last line of its
    ``output`` file, which says why) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process is not None and process.poll() is not None:
            why = _last_line(output) if output is not None else ""
            raise RuntimeError(f"{what}: the process exited with status {process.returncode}"
                               + (f": {why} (see {output})" if why else ""))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")
        raise_if_terminated()
        time.sleep(0.05)


def _last_line(path: Path) -> str:
    """The last non-empty line of a text file ('' if none or unreadable)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


SETUP_TIMEOUT = 600.0  # seconds the apps may take to set up (import torch, build the model) before the start


def _wait_for_setup(apps: dict[str, subprocess.Popen], gates: dict[str, Path], timeout: float) -> None:
    """Wait until every gated app has written ``<gate>.ready``; an error names an app that exited
    first, or those not ready after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    waiting = dict(gates)
    while waiting:
        for name, gate in list(waiting.items()):
            if os.path.exists(f"{gate}.ready"):
                del waiting[name]
            elif apps[name].poll() is not None:
                raise RuntimeError(f"app {name!r} exited with status {apps[name].returncode} while setting up; "
                                   f"see its .out file in the run's apps/ folder")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"apps {sorted(waiting)} not set up after {timeout:.0f} s")
        if waiting:
            raise_if_terminated()
            time.sleep(0.05)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stopped_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` after which the kernel sends the child SIGTERM when the launcher dies, even
    by SIGKILL or the out-of-memory killer (Linux ``prctl(PR_SET_PDEATHSIG)``): the manager, which
    never ends by itself, and the jobs would run on without it. None where libc has no ``prctl``.

    The signal follows the thread that started the child: the launcher starts every child from
    its main thread, which lives as long as the launcher.
    """
    prctl = _libc_prctl()
    if prctl is None:
        return None
    launcher = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec: no imports, no locks
        _sigterm_when_parent_dies(prctl, launcher)

    return arm


def follow_parent() -> bool:
    """Ask the kernel to send this process SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), as
    ``stopped_with_launcher`` does for the launcher's children; for processes started by another
    program, such as the ranks torchrun starts, which run in sessions of their own: when their
    agent is killed (by SIGKILL, or by the launcher after its stop grace) they would otherwise wait
    in a collective until the process group's timeout. False where libc has no ``prctl``, or
    where the parent died while asking (this process then stops itself)."""
    prctl = _libc_prctl()
    # the parent may be 1 legitimately: torchrun as a container's first process
    return prctl is not None and _sigterm_when_parent_dies(prctl, os.getppid())


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _sigterm_when_parent_dies(prctl: Callable[..., int], parent: int) -> bool:
    """Ask for SIGTERM at the death of ``parent`` (this process's parent when it was read); if the
    parent died before the request was made, stop now. False then."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
        return False
    return True


STOP_GRACE = 10.0  # seconds the processes of a run have to exit after SIGTERM before SIGKILL


def stop_all(processes: Iterable[subprocess.Popen], grace: float = STOP_GRACE) -> None:
    """SIGTERM to every process still running, all at once; SIGKILL to those still running
    ``grace`` seconds later. Returns when all have exited (reaped), so a run of N apps that
    ignore SIGTERM takes ``grace`` to stop, not N times it."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def torchrun_log_dir(run_dir: Path, app: str) -> Path:
    """Where torchrun keeps a DDP app's per-rank directories: in the run directory. Without
    ``--log-dir`` torchrun makes a ``torchelastic_*`` directory in the system's temporary
    directory for every job and never removes it, on a server that other users share."""
    return run_dir.resolve() / "apps" / f"{app}.torchrun"


def app_command(options: LaunchOptions, index: int, devices_arg: str) -> list[str]:
    scenario, app = options.scenario, options.scenario.apps[index]
    ratio = scenario.initial_ratio(index)
    gpus = list(range(scenario.gpus))
    if app.ddp:  # one rank per GPU of its initial DR, under torchrun; the DR is over those ranks
        gpus = list(ratio.used)
        shares = [ratio.shares[g] for g in gpus]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(len(gpus)),
                   "--log-dir", str(torchrun_log_dir(options.run_dir, app.name)),
                   "-m", "drbalance.runs.train_ddp", "--gpus", ",".join(map(str, gpus))]
    else:
        shares = list(ratio.shares)
        command = [sys.executable, "-m", "drbalance.runs.train"]
    command += [
        "--model", app.model, "--app", app.name,
        "--epochs", str(app.epochs), "--iterations", str(app.iterations_per_epoch),
        "--image-size", str(options.image_size), "--ratio", ",".join(map(str, shares)),
        "--report-every", str(options.report_every), "--no-progress", "--devices", devices_arg,
    ]
    if options.devices == "emulated":
        command += ["--batch-size", str(options.real_batch), "--sample-scale", str(app.batch / options.real_batch),
                    "--time-scale", str(options.time_scale)]
        solo = str(app.solo_time() * options.time_scale)
    else:
        command += ["--batch-size", str(app.batch)]
        solo = app.model
        if not app.ddp:
            command += ["--gpus", ",".join(map(str, gpus))]
    if not options.estimate_solo:
        command += ["--solo-time", solo]
    if options.decide_every:
        command += ["--decide-every", str(options.decide_every)]
    return command


class RunDirectoryInUse(ValueError):
    """The run directory already holds an earlier run's logs: the new run's would be appended to
    them, and a report would mix the two runs."""


def earlier_run(run_dir: Path) -> Path | None:
    """A log file of an earlier run in ``run_dir`` (its ``run.json``, manager log, or an app's SD
    log), or None if it holds none (or does not exist)."""
    for name in ("run.json", "manager.jsonl", "manager.jsonl.1"):
        if os.path.lexists(run_dir / name):
            return run_dir / name
    apps = run_dir / "apps"
    if apps.is_dir():
        return next(iter(sorted(apps.glob("*.sd.jsonl"))), None)
    return None


def launch(options: LaunchOptions) -> Path:
    """Run the scenario to completion (or ``timeout``); return the run directory.

    Raises ``RunDirectoryInUse`` before anything starts if the run directory already holds an
    earlier run's logs (they are left as they are), and ValueError if an app's training script
    would refuse its model or ``image_size`` (``check_launchable``)."""
    scenario, run_dir = options.scenario, options.run_dir
    check_launchable(scenario, options.devices, options.image_size, options.real_batch)
    if os.path.lexists(run_dir) and not run_dir.is_dir():  # else "[Errno 20] Not a directory: 'R/apps'"
        raise ValueError(f"run directory {run_dir} exists and is not a folder; give a folder (made if missing)")
    found = earlier_run(run_dir)
    if found is not None:
        raise RunDirectoryInUse(f"run directory {run_dir} already holds an earlier run ({found} exists); this run's "
                                f"logs would be mixed with it. Choose another --run-dir, or move that one away. "
                                f"Nothing was started.")
    make_dirs(run_dir / "apps")
    namespace = f"run-{uuid.uuid4().hex[:12]}"
    child_env = dict(os.environ)
    child_env.update({
        "DRBALANCE_NAMESPACE": namespace,
        "DRBALANCE_RUNTIME_DIR": str(run_dir.resolve() / ".runtime"),
        "DRBALANCE_LOG_DIR": str(run_dir.resolve() / "apps"),
        "PYTHONUNBUFFERED": "1",
    })
    child_env.pop("DRBALANCE_NO_MANAGER", None)
    source = f"emulated:{scenario.gpus}" if options.devices == "emulated" else "nvml"
    devices_arg = f"emulated:{scenario.gpus}" if options.devices == "emulated" else "cuda"
    manager_command = [sys.executable, "-m", "drbalance.manager.cli", "--namespace", namespace,
                       "--policy", options.policy, "--source", source, "--log", str(run_dir / "manager.jsonl"),
                       "--util-log-period", "0.5", "--sample-period", "0.5"]
    if options.devices == "cuda":
        manager_command += ["--gpus", ",".join(map(str, range(scenario.gpus)))]
    if options.sd_threshold is not None:
        manager_command += ["--sd-threshold", str(options.sd_threshold)]
    if options.util_threshold is not None:
        manager_command += ["--util-threshold", str(options.util_threshold)]
    manager_command += options.extra_manager_args
    info = {
        "scenario": scenario.name, "description": scenario.description, "policy": options.policy,
        "label": options.label or options.policy, "devices": options.devices, "gpus": scenario.gpus,
        "time_scale": options.time_scale if options.devices == "emulated" else 1.0,
        "namespace": namespace, "apps": {}, "scenario_json": json.loads(scenario.to_json()),
    }
    manager_out = private_output(run_dir / "manager.out")
    with_launcher = stopped_with_launcher()
    manager = subprocess.Popen(manager_command, env=child_env, stdout=manager_out, stderr=subprocess.STDOUT,
                               preexec_fn=with_launcher)
    names = IpcNames(namespace, os.getuid())
    apps: dict[str, subprocess.Popen] = {}
    outputs = []

    def start(index: int, gate: Path | None) -> None:
        app = scenario.apps[index]
        out = private_output(run_dir / "apps" / f"{app.name}.out")
        outputs.append(out)
        command = app_command(options, index, devices_arg)
        if gate is not None:
            command += ["--start-gate", str(gate)]
        apps[app.name] = subprocess.Popen(command, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=with_launcher)
        info["apps"][app.name] = {"model": app.model, "command": command, "pid": apps[app.name].pid,
                                  "initial_dr": scenario.initial_ratio(index).to_list()}

    try:
        status_file = run_dir.resolve() / ".runtime" / namespace / "status.json"
        _wait_for(status_file.exists, 60, "drbalance-manager", manager, run_dir / "manager.out")
        # Every app (but DDP ones, which torchrun starts) is started now and sets up (imports, model,
        # data) up to its start gate; the scenario's arrivals are counted from when all are set up.
        # Started at their arrival times instead, the first apps would train alone for as long as
        # the later ones take to import: seconds, and on a loaded machine tens of seconds (see
        # docs/emulation.md), a placement the scenario does not have.
        gates = make_dirs(run_dir / ".gates")
        order = sorted(range(len(scenario.apps)), key=lambda i: scenario.apps[i].arrival)
        gated = {index: gates / scenario.apps[index].name for index in order if not scenario.apps[index].ddp}
        for index, gate in gated.items():
            start(index, gate)
        _wait_for_setup(apps, {scenario.apps[i].name: gate for i, gate in gated.items()}, SETUP_TIMEOUT)
        info["started"] = time.time()
        _write(run_dir, info)
        for index in order:
            app = scenario.apps[index]
            delay = info["started"] + app.arrival * info["time_scale"] - time.time()
            raise_if_terminated()
            if delay > 0:
                time.sleep(delay)
            if index in gated:
                write_private(gated[index], b"start\n")
            else:
                start(index, None)
        deadline = None if options.timeout is None else info["started"] + options.timeout
        _wait_for_apps(apps, info, deadline, scenario, status_file, options.progress)
    finally:
        stop_all(apps.values())
        stop_all([manager])
        manager_out.close()
        for out in outputs:
            out.close()
        info["ended"] = time.time()
        for name, process in apps.items():
            info["apps"][name]["returncode"] = process.returncode
        info["manager_returncode"] = manager.returncode
        try:
            _record_run(run_dir, info)
        finally:  # a record that cannot be written (a full disk) still leaves no emulated GPUs behind
            if options.devices == "emulated":
                remove_emulated_gpus(names, scenario.gpus)
    failed = {n: a["returncode"] for n, a in info["apps"].items() if a["returncode"] not in (0, None)
              and a.get("stopped") != "timeout"}
    if failed:
        raise RuntimeError(f"apps failed: {failed}; see {run_dir / 'apps'}/*.out")
    return run_dir


def _record_run(run_dir: Path, info: dict) -> None:
    """Write the final ``run.json``; for a run that failed while starting, set what it wrote aside
    first (``set_aside_failed_start``), out of the way of a retry."""
    if "started" in info:
        _write(run_dir, info)
        return
    try:
        aside = set_aside_failed_start(run_dir, info)
        logger.warning("drbalance launch: the run did not start; what it wrote is in %s, and %s can be "
                       "used again", aside, run_dir)
    except OSError as error:  # e.g. a full disk: the record stays where it is (the retry is refused)
        logger.warning("drbalance launch: the run did not start, and what it wrote could not be set "
                       "aside (%s)", error)
        _write(run_dir, info)


FAILED_START_FILES = ("manager.jsonl", "manager.out", "apps", ".gates")


def set_aside_failed_start(run_dir: Path, info: dict) -> Path:
    """Move what a launch that failed while starting wrote (the manager's log and output, the apps'
    outputs, the start gates, whose ``.ready`` files would fool a retry) into
    ``run_dir/failed-start.<n>/`` (the first ``n`` >= 1 free), with its ``run.json`` there, so
    that nothing is lost and ``run_dir`` holds no earlier run: a retry into it is not refused.
    Returns that folder."""
    suffix = 1
    while os.path.lexists(run_dir / f"failed-start.{suffix}"):
        suffix += 1
    aside = make_dirs(run_dir / f"failed-start.{suffix}")
    names = [*FAILED_START_FILES, *sorted(p.name for p in run_dir.glob("manager.jsonl.*"))]
    for name in names:
        if os.path.lexists(run_dir / name):
            (run_dir / name).rename(aside / name)
    _write(aside, {**info, "failed_at_start": True})
    return aside


def private_output(path: Path):
    """A process's output file, mode 0600 (it may show what the user's jobs do)."""
    fd, _ = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def iterations_done(status: dict | None, totals: dict[str, int], finished: set[str]) -> int:
    """Iterations the scenario's apps have done: a finished app counts in full, a running one as far
    as the manager's ``status`` (its status file) shows it (0 when the manager does not show it)."""
    shown = {}
    if isinstance(status, dict) and isinstance(status.get("apps"), list):
        for app in status["apps"]:
            if isinstance(app, dict) and isinstance(app.get("iteration"), int):
                shown[app.get("name")] = app["iteration"]
    return sum(total if name in finished else min(total, max(0, shown.get(name, 0)))
               for name, total in totals.items())


def _wait_for_apps(apps: dict[str, subprocess.Popen], info: dict, deadline: float | None, scenario: Scenario,
                   status_file: Path, show: bool) -> None:
    """Wait until every app has exited (or ``deadline``: the rest are stopped); a bar of iterations if ``show``."""
    totals = {app.name: app.epochs * app.iterations_per_epoch for app in scenario.apps}
    bar = progress.bar(show, sum(totals.values()), scenario.name, "iterations")
    pending = dict(apps)
    try:
        while pending:
            for name, process in list(pending.items()):
                if process.poll() is not None:
                    del pending[name]
            if show:
                bar.update(iterations_done(_read_json(status_file), totals, set(apps) - set(pending)) - bar.n)
                bar.set_postfix_str(f"{len(apps) - len(pending)}/{len(apps)} apps done")
            if pending and deadline is not None and time.time() >= deadline:
                for name in pending:
                    info["apps"][name]["stopped"] = "timeout"
                stop_all(pending.values())
                return
            if pending:
                raise_if_terminated()
                time.sleep(0.5)
    finally:
        bar.close()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(run_dir: Path, info: dict) -> None:
    """Replace ``run_dir/run.json`` with ``info`` atomically (``write_private``): a full disk or a
    crash while writing leaves the earlier ``run.json`` whole (its ``started`` is what a report
    measures time from), and a symbolic link planted there is replaced, never followed."""
    write_private(run_dir / "run.json", json.dumps(info, indent=2).encode("utf-8"))
