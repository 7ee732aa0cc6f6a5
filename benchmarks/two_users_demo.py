"""Scenario demo-a as two users' jobs: one system manager for both, beside a manager per user.

The demo's six jobs (2 x DenseNet121, 2 x ResNet-50, 2 x AlexNet, real training on emulated GPUs)
are dealt in turn to two users (uids 4201 and 4202: dense1, alex1 and res2 to the first, the others
to the second) and run twice from the same placement on the same 4 emulated GPUs, which are the
machine's in both runs (every user's jobs share them, as real GPUs):

- ``system``: one system manager (``drbalance-manager --system``, ``fair``) balances all six;
- ``per-user``: each user runs their own manager (``fair``), which sees only its user's three jobs
  (and the GPUs' utilisation, everyone's load, as NVML would).

Then ``drbalance report`` compares the two runs (the runs and ``report/`` in ``--out``; its table
in ``benchmarks/results/two_users_demo.txt``). Needs root (the users are uids its children take).
About 4 minutes per run on 2 cores.

    python -m benchmarks.two_users_demo [--out /tmp/drbalance-two-users-demo] [--time-scale 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from drbalance import defaults
from drbalance.argtypes import positive_float
from drbalance.ipc import system
from drbalance.runs.launch import LaunchOptions, app_command, stop_all
from drbalance.workload.scenarios import load_scenario

ROOT = Path(__file__).resolve().parent.parent
USERS = (4201, 4202)
NAMESPACE = "two-users"
GPUS = 4
SETUP_SECONDS = 900.0


def prepare_home(base: Path, uid: int) -> Path:
    home = base / f"home-{uid}"
    for folder in (home, home / "run", home / "logs", home / "gates"):
        folder.mkdir(exist_ok=True)
        os.chown(folder, uid, uid)
        os.chmod(folder, 0o700)
    return home


def user_env(home: Path, system_dir: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "DRBALANCE_RUNTIME_DIR": str(home / "run"),
            "DRBALANCE_LOG_DIR": str(home / "logs"), "DRBALANCE_SYSTEM_DIR": str(system_dir),
            "DRBALANCE_NAMESPACE": NAMESPACE, "DRBALANCE_EMULATED_GPUS": str(GPUS), "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1"}


def as_uid(uid: int, command: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f} s")
        time.sleep(0.05)


def run(kind: str, options: LaunchOptions, base: Path, run_dir: Path) -> None:
    """One run of the scenario (``kind``: ``system`` or ``per-user``) into ``run_dir``."""
    from drbalance.emu.gpus import EmulatedSource

    scenario = options.scenario
    system_dir = base / f"system-{kind}"
    system_dir.mkdir()
    os.chmod(system_dir, 0o755)
    os.environ["DRBALANCE_SYSTEM_DIR"] = str(system_dir)
    homes = {uid: prepare_home(base / kind, uid) for uid in USERS}
    (run_dir / "apps").mkdir(parents=True)
    managers: list[subprocess.Popen] = []
    apps: dict[str, subprocess.Popen] = {}
    holder = None
    info = {"scenario": scenario.name, "label": kind, "policy": "fair", "devices": "emulated", "gpus": GPUS,
            "time_scale": options.time_scale, "namespace": NAMESPACE, "apps": {},
            "scenario_json": json.loads(scenario.to_json())}
    try:
        if kind == "system":
            log = run_dir / "manager.jsonl"
            managers.append(subprocess.Popen(
                [sys.executable, "-m", "drbalance.manager.cli", "--system", "--namespace", NAMESPACE, "--policy",
                 "fair", "--source", f"emulated:{GPUS}", "--log", str(log), "--util-log-period", "0.5",
                 "--sample-period", "0.5"], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                stdout=open(run_dir / "manager.out", "w"), stderr=subprocess.STDOUT))
            wait(lambda: (system_dir / NAMESPACE / "manager.sock").exists(), 60, "the system manager did not start")
        else:  # the machine's emulated GPUs, made by no manager: each user's manager reads them
            holder = EmulatedSource.for_machine(system.create(NAMESPACE), str(GPUS), None)
            for uid in USERS:
                log = run_dir / ("manager.jsonl" if uid == USERS[0] else f"manager-{uid}.jsonl")
                log.touch()
                os.chown(log, uid, uid)
                os.chmod(log, 0o600)
                managers.append(subprocess.Popen(
                    as_uid(uid, [sys.executable, "-m", "drbalance.manager.cli", "--namespace", NAMESPACE, "--policy",
                                 "fair", "--source", f"emulated:{GPUS}", "--log", str(log), "--util-log-period", "0.5",
                                 "--sample-period", "0.5"]), env=user_env(homes[uid], system_dir), cwd=ROOT,
                    stdout=open(run_dir / f"manager-{uid}.out", "w"), stderr=subprocess.STDOUT))
            for uid in USERS:
                wait(lambda uid=uid: (homes[uid] / "run" / NAMESPACE / "status.json").exists(), 60,
                     f"the manager of uid {uid} did not start")
        gates = {}
        for index, app in enumerate(scenario.apps):
            uid = USERS[index % 2]
            gate = homes[uid] / "gates" / app.name
            command = app_command(options, index, f"emulated:{GPUS}") + ["--start-gate", str(gate)]
            apps[app.name] = subprocess.Popen(as_uid(uid, command), env=user_env(homes[uid], system_dir), cwd=ROOT,
                                              stdout=open(run_dir / "apps" / f"{app.name}.out", "w"),
                                              stderr=subprocess.STDOUT)
            info["apps"][app.name] = {"model": app.model, "uid": uid, "command": command,
                                      "initial_dr": scenario.initial_ratio(index).to_list()}
            gates[app.name] = gate
        for name, gate in gates.items():
            wait(lambda gate=gate, name=name: os.path.exists(f"{gate}.ready") or apps[name].poll() is not None,
                 SETUP_SECONDS, f"{name} was not set up")
            if apps[name].poll() is not None:
                raise RuntimeError(f"{name} exited while setting up: see {run_dir / 'apps' / (name + '.out')}")
        info["started"] = time.time()
        for app in sorted(scenario.apps, key=lambda a: a.arrival):
            delay = info["started"] + app.arrival * options.time_scale - time.time()
            if delay > 0:
                time.sleep(delay)
            gates[app.name].write_text("start\n")
        for name, process in apps.items():
            process.wait()
            info["apps"][name]["returncode"] = process.returncode
    finally:
        stop_all(apps.values())
        stop_all(managers)
        if holder is not None:
            holder.close()
        info["ended"] = time.time()
        (run_dir / "run.json").write_text(json.dumps(info, indent=1))
        for home in homes.values():  # the users' SD logs, where a report finds a run's
            for log in (home / "logs").glob("*.sd.jsonl"):
                shutil.copyfile(log, run_dir / "apps" / log.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "drbalance-two-users-demo",
                        help="folder for the two runs and the report (refused if it exists)")
    parser.add_argument("--time-scale", type=positive_float, default=15.0,
                        help="emulated GPUs: stretch modelled times (the demo's 15)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root: the two users' jobs run as uids 4201 and 4202")
    if args.out.exists():
        parser.error(f"{args.out} exists: move it away first")
    from tests.helpers.system import others_may_run_python

    scenario = load_scenario("demo-a")
    base = Path(tempfile.mkdtemp(prefix="drbalance-two-users-"))
    os.chmod(base, 0o755)
    try:
        with others_may_run_python():
            for kind in ("system", "per-user"):
                (base / kind).mkdir()
                os.chmod(base / kind, 0o755)
                options = LaunchOptions(scenario=scenario, policy="fair", run_dir=args.out / kind,
                                        time_scale=args.time_scale, real_batch=defaults.EMULATED_REAL_BATCH)
                started = time.monotonic()
                run(kind, options, base, args.out / kind)
                print(f"{kind}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = subprocess.run([sys.executable, "-m", "drbalance", "report", str(args.out / "system"),
                             str(args.out / "per-user"), "--out", str(args.out / "report")],
                            cwd=ROOT, capture_output=True, text=True)
    print(report.stdout + report.stderr)
    if report.returncode == 0:
        result = ROOT / "benchmarks" / "results" / "two_users_demo.txt"
        result.write_text(f"# python -m benchmarks.two_users_demo --time-scale {args.time_scale:g}\n{report.stdout}")
        print(f"wrote {result}")
    return report.returncode


if __name__ == "__main__":
    raise SystemExit(main())
