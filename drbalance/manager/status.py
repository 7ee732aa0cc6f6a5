"""``drbalance status``: the running manager's live apps and GPU utilisation, as a table."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from drbalance.ipc.names import IpcNames
from drbalance.ipc.objects import pid_alive

STALE_SECONDS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace (default: DRBALANCE_NAMESPACE or 'default')")
    parser.add_argument("--json", action="store_true", help="print the manager's status as JSON")


def read_status(names: IpcNames) -> dict[str, Any]:
    """The manager's status file; RuntimeError if no live manager wrote it."""
    path = names.manager_status()
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeError(f"no drbalance-manager is running in namespace {names.namespace!r}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise RuntimeError(f"cannot read the manager status {path}: {error}") from None
    if not pid_alive(int(status.get("pid", 0))):
        raise RuntimeError(f"the manager of namespace {names.namespace!r} (pid {status.get('pid')}) is not "
                           f"running; its status file {path} is left over")
    if time.time() - float(status.get("updated", 0)) > STALE_SECONDS:
        raise RuntimeError(f"the manager (pid {status['pid']}) has not updated its status for over "
                           f"{STALE_SECONDS:.0f} s: it may be stuck")
    return status


def format_table(status: dict[str, Any]) -> str:
    util = ", ".join("n/a" if u is None else f"{u:.0f}%" for u in status["util"])
    lines = [
        f"manager pid {status['pid']}  namespace {status['namespace']}  policy {status['policy']}  "
        f"decisions {status['decisions']}",
        f"GPU utilisation (smoothed): {util}",
        "",
        f"{'APP':<24} {'PID':>7} {'EPOCH':>9} {'ITERATION':>15} {'SD':>6}  DR",
    ]
    for app in sorted(status["apps"], key=lambda a: a["name"]):
        sd = "-" if app["sd"] is None else f"{app['sd']:.2f}"
        lines.append(
            f"{app['name']:<24} {app['pid']:>7} {app['epoch']:>4}/{app['epochs']:<4} "
            f"{app['iteration']:>7}/{app['iterations_total']:<7} {sd:>6}  {app['dr']}"
        )
    if not status["apps"]:
        lines.append("(no apps)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    status = read_status(IpcNames.current(args.namespace))
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0
