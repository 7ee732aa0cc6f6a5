"""``drbalance status``: the running manager's live apps and GPU utilisation.

Three forms: a table (``drbalance status``), the status file as JSON (``--json``, for scripts),
and a refreshing view (``--watch``: per-GPU utilisation bars, per-app SD, DR and state, in the
spirit of nvitop and gpustat). Rendering is a pure function of the status data
(:func:`format_table`, :func:`format_watch`); only :func:`watch` touches the terminal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from drbalance import defaults
from drbalance.argtypes import positive_float_up_to, positive_int
from drbalance.ipc.names import IpcNames
from drbalance.ipc.objects import pid_alive
from drbalance.ipc.private import read_private
from drbalance.ipc.system_link import SystemStatusError, read_system_status
from drbalance.jsonlog import finite_number

STALE_SECONDS = 10.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen (ANSI)
MIN_BAR = 10  # utilisation bars are at least this many characters wide
MAX_PID = 2 ** 31  # a pid is a C int: a larger one would make pid_alive's os.kill raise OverflowError


class StatusError(RuntimeError):
    """No usable status: no manager, a dead or stuck one, or a malformed status file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace (default: DRBALANCE_NAMESPACE or 'default')")
    parser.add_argument("--json", action="store_true", help="print the manager's status as JSON")
    parser.add_argument("--watch", action="store_true",
                        help="refresh a live view (GPU utilisation bars; each app's SD, DR and state) until Ctrl-C")
    parser.add_argument("--interval", type=positive_float_up_to(defaults.MAX_WATCH_INTERVAL), default=None, metavar="S",
                        help=f"seconds between refreshes with --watch (default: 2, at most "
                        f"{defaults.MAX_WATCH_INTERVAL:g})")
    parser.add_argument("--count", type=positive_int, default=None, metavar="N",
                        help="with --watch: stop after N frames (default: until Ctrl-C)")


def read_status(names: IpcNames) -> dict[str, Any]:
    """The status of the namespace's manager, checked: the machine's system manager's when one runs
    (asked over its socket: it shows this user's jobs by name, others' as anonymous load), else
    this user's own manager's status file. ``StatusError`` (a RuntimeError) when there is none."""
    try:
        status = read_system_status(names.namespace)
    except SystemStatusError as error:
        raise StatusError(str(error)) from None
    if status is not None:
        problem = _malformed(status)
        if problem:
            raise StatusError(f"the system manager's status is malformed: {problem}")
        return status
    return read_user_status(names)


def read_user_status(names: IpcNames) -> dict[str, Any]:
    """This user's own manager's status file, checked; ``StatusError`` if no live manager wrote it."""
    path = names.manager_status()
    try:
        raw = read_private(path, private=True)
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


def _malformed(status: Any) -> str | None:
    """What is wrong with a decoded status file (None if it has every field the table shows)."""
    if not isinstance(status, dict):
        return f"expected an object, got {type(status).__name__}"
    for key, kind in (("pid", int), ("namespace", str), ("policy", str), ("decisions", int), ("util", list),
                      ("apps", list)):
        if not isinstance(status.get(key), kind) or isinstance(status.get(key), bool):
            return f"field {key!r} is missing or not a {kind.__name__}"
    if not 0 < status["pid"] < MAX_PID:
        return f"field 'pid' is not a process id (1..{MAX_PID - 1})"
    if not finite_number(status.get("updated")):
        return "field 'updated' is missing or not a number"
    memory = status.get("memory", [])
    if not isinstance(memory, list) or any(m is not None and not isinstance(m, dict) for m in memory):
        return "field 'memory' is not a list of objects and nulls"
    if any(u is not None and not finite_number(u) for u in status["util"]):
        return "field 'util' holds something other than numbers and nulls"
    for index, app in enumerate(status["apps"]):
        if not isinstance(app, dict):
            return f"apps[{index}] is not an object"
        for key, kind in (("name", str), ("pid", int), ("epoch", int), ("epochs", int), ("iteration", int),
                          ("iterations_total", int), ("dr", list)):
            if not isinstance(app.get(key), kind) or isinstance(app.get(key), bool):
                return f"apps[{index}].{key} is missing or not a {kind.__name__}"
        if app.get("sd") is not None and not finite_number(app["sd"]):
            return f"apps[{index}].sd is not a number"
        for key in ("quiet_for", "updated_ago"):
            if app.get(key) is not None and not finite_number(app[key]):
                return f"apps[{index}].{key} is not a number"
    foreign = status.get("foreign", [])
    if not isinstance(foreign, list) or any(not isinstance(f, dict) for f in foreign):
        return "field 'foreign' is not a list of objects"
    total = status.get("foreign_total", len(foreign))
    if not isinstance(total, int) or isinstance(total, bool) or total < len(foreign):
        return "field 'foreign_total' is not a count of at least the objects in 'foreign'"
    if not isinstance(status.get("faults", {}), dict):
        return "field 'faults' is not an object"
    return None


def sd_text(app: dict[str, Any]) -> str:
    """An app's SD for the tables: ``1.23``, ``~1.23`` when it divides by the job's own estimate of its
    solo-run time (the job was given none), ``*1.23`` by the manager's, ``>=0.41`` while the job's
    own estimate can only be too high (the SD is at least that), ``-`` while unknown."""
    if app.get("sd") is None:
        return "-"
    if app.get("sd_bound") is True:
        return f">={app['sd']:.2f}"
    mark = "*" if _from_manager(app) else "~" if app.get("sd_estimated") is True else ""
    return f"{mark}{app['sd']:.2f}"


def _from_manager(app: dict[str, Any]) -> bool:
    return app.get("sd_estimated") is True and app.get("solo_basis") == "manager"


ESTIMATED_NOTE = "~ SD from the job's own estimate of its solo-run time (no solo_time given; docs/profiles.md)"
MANAGER_NOTE = "* SD from the manager's estimate of its solo-run time (no solo_time given, no GPU alone)"
BOUND_NOTE = (">= the SD is at least this: the job's estimate of its solo-run time can still only be too high "
              "(docs/profiles.md)")


def sd_notes(apps: list[dict[str, Any]]) -> list[str]:
    """The notes that explain the marks ``sd_text`` put in a table of ``apps``."""
    notes = []
    if any(app.get("sd_estimated") is True and app.get("sd_bound") is not True and not _from_manager(app)
           for app in apps):
        notes.append(ESTIMATED_NOTE)
    if any(_from_manager(app) and app.get("sd_bound") is not True for app in apps):
        notes.append(MANAGER_NOTE)
    if any(app.get("sd_bound") is True and app.get("sd") is not None for app in apps):
        notes.append(BOUND_NOTE)
    return notes


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def printable(text: object) -> str:
    """``text`` safe for a terminal: control characters (escape sequences) and undecodable bytes
    (surrogates, which a strict UTF-8 stdout refuses) written as Python escapes, e.g. ``\\x1b``."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


def format_table(status: dict[str, Any]) -> str:
    util = ", ".join("n/a" if u is None else f"{u:.0f}%" for u in status["util"])
    kind = "system manager" if status.get("system") is True else "manager"
    lines = [
        f"{kind} pid {status['pid']}  namespace {status['namespace']}  policy {status['policy']}  "
        f"decisions {status['decisions']}",
        f"GPU utilisation (smoothed): {util}",
        "",
        f"{'APP':<24} {'PID':>7} {'EPOCH':>9} {'ITERATION':>15} {'SD':>6}  {'STATE':<10} DR",
    ]
    for app in sorted(status["apps"], key=lambda a: a["name"]):
        sd = sd_text(app)
        state = str(app.get("state", "?")).lower()
        if app.get("quiet_for") is not None:
            state = f"quiet {_duration(app.get('updated_ago') or app['quiet_for'])}"
        if app.get("anonymous") is True:  # another user's job, shown by a system manager as load only
            lines.append(f"{app['name']:<24} {'-':>7} {'-':>9} {'-':>15} {sd:>6}  {state:<10} {app['dr']}")
            continue
        lines.append(
            f"{app['name']:<24} {app['pid']:>7} {app['epoch']:>4}/{app['epochs']:<4} "
            f"{app['iteration']:>7}/{app['iterations_total']:<7} {sd:>6}  {state:<10} {app['dr']}"
        )
    if not status["apps"]:
        lines.append("(no apps)")
    lines += sd_notes(status["apps"])
    for item in status.get("foreign", []):
        lines.append(f"WARNING: /dev/shm/{printable(item.get('object'))} belongs to {printable(item.get('owner'))}: "
                     f"another user's object under this namespace's names (ignored, never trusted)")
    unlisted = status.get("foreign_total", 0) - len(status.get("foreign", []))
    if unlisted > 0:
        lines.append(f"WARNING: and {unlisted} more objects of other users under this namespace's names "
                     f"(the manager log names each)")
    lines += fault_lines(status)
    return "\n".join(lines)


def fault_lines(status: dict[str, Any]) -> list[str]:
    """One warning per failing task of the manager, with how many times in a row it failed."""
    counts = status.get("fault_counts")
    counts = counts if isinstance(counts, dict) else {}
    lines = []
    for task, error in sorted(status.get("faults", {}).items()):
        count = counts.get(task)
        times = f" ({count} times in a row)" if isinstance(count, int) and not isinstance(count, bool) and count > 1 \
            else ""
        lines.append(f"WARNING: the manager's {printable(task)} is failing{times}: {printable(error)}")
    return lines


def app_state(app: dict[str, Any]) -> str:
    """``quiet`` (no record update for the quiet period; its process runs), ``detached`` (its GPUs
    are not this manager's: it trains on with its own DR), else the app's own state, lower case
    (``starting``, ``running``, ``finished``)."""
    if app.get("quiet_for") is not None:
        return "quiet"
    if app.get("steered") is False:
        return "detached"
    return str(app.get("state", "?")).lower()


def utilization_bar(percent: float | None, width: int) -> str:
    """``[#####-----]  50%``: ``width`` characters between the brackets; ``n/a`` when unknown."""
    if percent is None:
        return f"[{' ' * width}]  n/a"
    filled = round(max(0.0, min(100.0, percent)) / 100 * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {percent:3.0f}%"


def _memory(entry: Any) -> str:
    if not isinstance(entry, dict) or not finite_number(entry.get("used")) or not finite_number(entry.get("total")):
        return ""
    gib = 1024 ** 3
    return f"  mem {entry['used'] / gib:5.1f}/{entry['total'] / gib:.1f} GiB"


def format_watch(status: dict[str, Any], width: int = 80, now: float | None = None) -> str:
    """One frame of ``drbalance status --watch`` for a checked status (see :func:`read_status`).

    ``width``: the terminal's columns (the bars grow with it); ``now``: wall time for the
    header's clock and the manager's uptime (default: the status's ``updated``).
    """
    now = status["updated"] if now is None else now
    started = status.get("started")
    uptime = f"  up {_duration(max(0.0, now - started))}" if finite_number(started) else ""
    lines = [
        f"drbalance  namespace {status['namespace']}  policy {status['policy']}  manager pid {status['pid']}"
        f"{uptime}  decisions {status['decisions']}  {time.strftime('%H:%M:%S', time.localtime(now))}",
        "",
    ]
    memory = status.get("memory") or []
    bar = max(MIN_BAR, width - 40)
    for gpu, percent in enumerate(status["util"]):
        reading = memory[gpu] if gpu < len(memory) else None
        lines.append(f"GPU {gpu:<2} {utilization_bar(percent, bar)}{_memory(reading)}")
    lines += ["", f"{'APP':<20} {'STATE':<9} {'SD':>6} {'EPOCH':>11}  DR"]
    for app in sorted(status["apps"], key=lambda a: a["name"]):
        dr = " ".join(str(share) for share in app["dr"])
        epoch = "-" if app.get("anonymous") is True else f"{app['epoch']:>5}/{app['epochs']:<5}"
        lines.append(f"{app['name'][:20]:<20} {app_state(app):<9} {sd_text(app):>6} {epoch:>11}  {dr}")
    if not status["apps"]:
        lines.append("(no apps)")
    lines += sd_notes(status["apps"])
    lines += fault_lines(status)
    return "\n".join(lines)


def watch(read: Callable[[], dict[str, Any]], interval: float, count: int | None, out: TextIO,
          clear: bool, width: Callable[[], int] = lambda: shutil.get_terminal_size().columns,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Show a frame every ``interval`` seconds (``count`` frames, or until Ctrl-C); 0.

    ``clear``: redraw in place (a terminal); otherwise frames follow each other, separated by a
    blank line (a pipe or a file). A manager that is gone or stuck is shown as an error frame and
    the view keeps watching (it comes back when a manager starts).
    """
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                sleep(interval)
            try:
                frame = format_watch(read(), width(), time.time())
            except StatusError as error:
                frame = f"drbalance status: {error} (watching; Ctrl-C to stop)"
            out.write((CLEAR_SCREEN if clear else ("\n" if shown else "")) + frame + "\n")
            out.flush()
            shown += 1
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
    return 0


def _stop_on_ctrl_c() -> None:
    """Make Ctrl-C (SIGINT) end the live view even when this process inherited SIGINT ignored,
    as commands started in the background by a non-interactive shell do (Python then leaves it
    ignored and no KeyboardInterrupt would ever come)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def check_arguments(args: argparse.Namespace) -> None:
    """Options that would be ignored or cannot be combined, and a namespace that is not a valid
    name: ValueError, a usage error (exit status 2) before anything is read."""
    if not args.watch and (args.interval is not None or args.count is not None):
        raise ValueError("--interval and --count go with --watch")
    if args.watch and args.json:
        raise ValueError("--watch shows a live view; --json prints the status once: choose one")
    IpcNames.current(args.namespace)


def run(args: argparse.Namespace) -> int:
    names = IpcNames.current(args.namespace)
    if args.watch:
        _stop_on_ctrl_c()
        interval = 2.0 if args.interval is None else args.interval
        return watch(lambda: read_status(names), interval, args.count, sys.stdout, clear=sys.stdout.isatty())
    status = read_status(names)
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0
