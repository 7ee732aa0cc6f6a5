"""The ``drbalance`` command: one subcommand per module, imported only when used.

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``, and may provide
``check_arguments(args)``: checks across options that one option's type cannot make; its
ValueError is a usage error (exit status 2), before anything runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from types import FrameType

from drbalance import __version__, stdout
from drbalance.helptext import HelpFormatter, environment_epilog

SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "drbalance.runs.demo", "run the paper's scenario (a), scaled down, with and without balancing"),
    ("launch", "drbalance.runs.launch", "start a manager and a scenario's apps as real processes"),
    ("report", "drbalance.report.command", "summarise and plot your jobs' logs, or runs side by side"),
    ("simulate", "drbalance.sim.command", "simulate a scenario under a policy (no GPUs needed)"),
    ("status", "drbalance.manager.status", "show the running manager's apps and GPU utilisation"),
    ("profile", "drbalance.profiling.command", "measure and store an app's solo-run time"),
)


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None, str | None]:
    parser = argparse.ArgumentParser(
        prog="drbalance",
        description="Fair sharing of a multi-GPU server by adaptive mini-batch redistribution. "
        "The daemon itself is 'drbalance-manager'.",
        formatter_class=HelpFormatter,
        epilog=environment_epilog(),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = chosen_command(argv)
    for name, module, help_text in SUBCOMMANDS:
        sub = commands.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter,
                                  epilog=environment_epilog())
        # also after the subcommand ('drbalance simulate a -v'); SUPPRESS keeps a -v given before it
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")
        if name == chosen:
            importlib.import_module(module).add_arguments(sub)
            return parser, sub, module
    return parser, None, None


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line: its first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def split_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """``profile``'s own arguments and the program's command line after its ``--``. For every other
    subcommand ``--`` keeps argparse's meaning (the options end there), so what follows it is
    parsed, or refused as an unrecognised argument, never dropped without a word (dropped,
    ``launch s.json -- --policy observe`` would run the default policy and exit 0)."""
    if chosen_command(argv) == "profile" and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Run one ``drbalance`` command; its exit status (1 as well when what it printed could not be
    written to standard output: a full disk, ``/dev/full``)."""
    with stdout.watched() as watch:
        try:
            status = _main(argv, watch)
        except SystemExit:  # argparse: after --help or --version (0), or a usage error (2)
            if watch is not None and watch.report("drbalance"):
                raise SystemExit(1) from None
            raise
        return 1 if watch is not None and watch.report("drbalance") else status


def _main(argv: list[str] | None, watch: stdout.Watched | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stdout is None:  # started with its standard output closed ('>&-'): print() would drop every line
        if sys.stderr is not None:
            print("drbalance: error: standard output is closed; what the command prints would be lost",
                  file=sys.stderr)
        return 2
    argv, passthrough = split_command_line(argv)
    parser, sub, module = build_parser(argv)
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    if module is None:
        parser.print_help()
        return 2
    check_arguments = getattr(importlib.import_module(module), "check_arguments", None)
    if check_arguments is not None:
        try:
            check_arguments(args)
        except ValueError as error:
            sub.error(str(error))  # usage and the message, exit status 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    previous = _stop_on_sigterm()
    try:
        status = int(importlib.import_module(module).run(args) or 0)
        raise_if_terminated()  # a SIGTERM whose exception was swallowed: still a termination
        return status
    except KeyboardInterrupt:  # a command's own cleanup ran as it unwound (launch stops its manager and jobs)
        print(f"drbalance {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. 'drbalance report ... --json | head': the reader has what it wanted
        stdout.point_at_devnull(sys.stdout)  # no second error at exit
        return 141
    except Terminated:
        return 128 + signal.SIGTERM
    except (ValueError, OSError, KeyError, RuntimeError) as error:  # OSError: a missing file, a full disk, ...
        if watch is not None and watch.caused(error):
            watch.report(f"drbalance {args.command}")
        else:
            print(f"drbalance {args.command}: error: {error}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM arrived (``kill``, ``timeout``, systemd): raised like Ctrl-C's KeyboardInterrupt, so
    that a command's cleanup runs (``launch`` and ``demo`` stop their manager and jobs and remove
    their emulated GPUs) instead of the process dying and leaving them behind."""


class _Sigterm:
    """Whether SIGTERM arrived since ``_stop_on_sigterm``: its ``Terminated`` can be raised where
    Python only prints it and goes on (an at-fork handler while ``subprocess`` starts a child, a
    ``__del__``), so the waits of long commands also look here (:func:`raise_if_terminated`)."""

    received = False


def raise_if_terminated() -> None:
    """Raise ``Terminated`` if SIGTERM arrived (for polling loops: its first raise may have been
    swallowed, and the command would run on and exit 0)."""
    if _Sigterm.received:
        raise Terminated()


def _stop_on_sigterm() -> signal.Handlers | None:
    """Make SIGTERM raise ``Terminated`` once (a second one kills as usual); the handler it
    replaced, or None outside the main thread (where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    _Sigterm.received = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _Sigterm.received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not _inside_logging(frame):
            raise Terminated()

    return signal.signal(signal.SIGTERM, on_sigterm)


def _inside_logging(frame: FrameType | None) -> bool:
    """Whether the signal interrupted the ``logging`` module itself: ``Terminated`` is then left to
    the next :func:`raise_if_terminated`. Raised there, it comes out of logging's lock release run
    as an at-fork hook while ``subprocess`` starts a child, where Python drops it (it prints
    "Exception ignored in: <function _releaseLock>" and a traceback), and a release cut short
    leaves the lock held: every later log line would wait for it."""
    return frame is not None and frame.f_globals.get("__name__") == "logging"


if __name__ == "__main__":
    raise SystemExit(main())
