"""``drbalance status``: the running manager's live apps and GPU utilisation, as a table."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from drbalance.ipc.names import IpcNames
from drbalance.ipc.objects import pid_alive
from drbalance.ipc.private import read_private

STALE_SECONDS = 10.0


class StatusError(RuntimeError):
    """No usable status: no manager, a dead or stuck one, or a malformed status file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace (default: DRBALANCE_NAMESPACE or 'default')")
    parser.add_argument("--json", action="store_true", help="print the manager's status as JSON")


def read_status(names: IpcNames) -> dict[str, Any]:
    """The manager's status file, checked; ``StatusError`` (a RuntimeError) if no live manager wrote it."""
    path = names.manager_status()
    try:
        raw = read_private(path)
    except (FileNotFoundError, NotADirectoryError):
        raise StatusError(f"no drbalance-manager is running in namespace {names.namespace!r} "
                          f"(no status file {path})") from None
    except OSError as error:
        raise StatusError(f"cannot read the manager status {path}: {error}") from None
    try:
        status = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StatusError(f"the manager status {path} is not JSON: {error}") from None
    problem = _malformed(status)
    if problem:
        raise StatusError(f"the manager status {path} is malformed: {problem}")
    if not pid_alive(status["pid"]):
        raise StatusError(f"the manager of namespace {names.namespace!r} (pid {status['pid']}) is not "
                          f"running; its status file {path} is left over")
    if time.time() - status["updated"] > STALE_SECONDS:
        raise StatusError(f"the manager (pid {status['pid']}) has not updated its status for over "
                          f"{STALE_SECONDS:.0f} s: it may be stuck")
    return status


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _malformed(status: Any) -> str | None:
    """What is wrong with a decoded status file (None if it has every field the table shows)."""
    if not isinstance(status, dict):
        return f"expected an object, got {type(status).__name__}"
    for key, kind in (("pid", int), ("namespace", str), ("policy", str), ("decisions", int), ("util", list),
                      ("apps", list)):
        if not isinstance(status.get(key), kind) or isinstance(status.get(key), bool):
            return f"field {key!r} is missing or not a {kind.__name__}"
    if not _number(status.get("updated")):
        return "field 'updated' is missing or not a number"
    if any(u is not None and not _number(u) for u in status["util"]):
        return "field 'util' holds something other than numbers and nulls"
    for index, app in enumerate(status["apps"]):
        if not isinstance(app, dict):
            return f"apps[{index}] is not an object"
        for key, kind in (("name", str), ("pid", int), ("epoch", int), ("epochs", int), ("iteration", int),
                          ("iterations_total", int), ("dr", list)):
            if not isinstance(app.get(key), kind) or isinstance(app.get(key), bool):
                return f"apps[{index}].{key} is missing or not a {kind.__name__}"
        if app.get("sd") is not None and not _number(app["sd"]):
            return f"apps[{index}].sd is not a number"
        if app.get("quiet_for") is not None and not _number(app["quiet_for"]):
            return f"apps[{index}].quiet_for is not a number"
    foreign = status.get("foreign", [])
    if not isinstance(foreign, list) or any(not isinstance(f, dict) for f in foreign):
        return "field 'foreign' is not a list of objects"
    if not isinstance(status.get("faults", {}), dict):
        return "field 'faults' is not an object"
    return None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def format_table(status: dict[str, Any]) -> str:
    util = ", ".join("n/a" if u is None else f"{u:.0f}%" for u in status["util"])
    lines = [
        f"manager pid {status['pid']}  namespace {status['namespace']}  policy {status['policy']}  "
        f"decisions {status['decisions']}",
        f"GPU utilisation (smoothed): {util}",
        "",
        f"{'APP':<24} {'PID':>7} {'EPOCH':>9} {'ITERATION':>15} {'SD':>6}  {'STATE':<10} DR",
    ]
    for app in sorted(status["apps"], key=lambda a: a["name"]):
        sd = "-" if app.get("sd") is None else f"{app['sd']:.2f}"
        state = str(app.get("state", "?")).lower()
        if app.get("quiet_for") is not None:
            state = f"quiet {_duration(app.get('updated_ago') or app['quiet_for'])}"
        lines.append(
            f"{app['name']:<24} {app['pid']:>7} {app['epoch']:>4}/{app['epochs']:<4} "
            f"{app['iteration']:>7}/{app['iterations_total']:<7} {sd:>6}  {state:<10} {app['dr']}"
        )
    if not status["apps"]:
        lines.append("(no apps)")
    for item in status.get("foreign", []):
        lines.append(f"WARNING: /dev/shm/{item.get('object')} belongs to {item.get('owner')}: another user's "
                     f"object under this namespace's names (ignored, never trusted)")
    for task, error in sorted(status.get("faults", {}).items()):
        lines.append(f"WARNING: the manager's {task} is failing: {error}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    status = read_status(IpcNames.current(args.namespace))
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0
