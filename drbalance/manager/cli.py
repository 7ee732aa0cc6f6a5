"""``drbalance-manager``: the daemon's command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from drbalance import __version__, env, stdout
from drbalance.argtypes import (
    non_empty_path,
    non_negative_float,
    non_negative_int,
    percent,
    positive_float,
    positive_int,
)
from drbalance.helptext import HelpFormatter, environment_epilog
from drbalance.ipc import system
from drbalance.ipc.private import UnsafePath
from drbalance.manager.admission import UserLimits
from drbalance.manager.daemon import Manager, ManagerAlreadyRunning, ManagerSettings, ManagerStartError
from drbalance.manager.metrics import ManagerMetrics, MetricsServerError
from drbalance.manager.slurm import SlurmWeight
from drbalance.manager.system import SystemManager
from drbalance.manager.utilization import MAX_WINDOW, UtilizationSource, UtilizationUnavailable, open_source
from drbalance.policy import POLICIES

logger = logging.getLogger("drbalance.manager")

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(message)s"  # local time, e.g. 2026-11-21T21:30:00.123


def parse_gpus(text: str | None) -> list[int] | None:
    """``0,1,3`` -> [0, 1, 3]; None/empty -> all GPUs of the source."""
    if not text:
        return None
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"--gpus takes comma-separated GPU indices, e.g. 0,1,2,3; got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"--gpus needs distinct non-negative indices; got {text!r}")
    return gpus


def parse_port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port, reported in the log and in ``drbalance status --json``)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number 0..65535; got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number 0..65535; got {port}")
    return port


MIN_SAMPLE_PERIOD = 0.01  # seconds; shorter only burns a core (NVML refreshes utilisation every 1/6 to 1 s)


def sample_period(text: str) -> float:
    """``--sample-period``: a number of seconds >= ``MIN_SAMPLE_PERIOD``."""
    value = positive_float(text)
    if value < MIN_SAMPLE_PERIOD:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_SAMPLE_PERIOD:g} s (a shorter period only keeps a "
                                         f"core busy); got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    defaults = ManagerSettings()
    parser = argparse.ArgumentParser(
        prog="drbalance-manager",
        description="The drbalance manager: reads every training job's slow-down (SD) and the GPUs' "
        "utilisation, and re-splits the mini-batch of the job that suffers most (the data ratio, DR) "
        "so that all jobs' slow-downs converge. Jobs find it through their namespace; without it "
        "they train on with their own DR. Stop it with Ctrl-C or SIGTERM.",
        formatter_class=HelpFormatter,
        epilog=environment_epilog(),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--namespace", default=None,
                        help="namespace shared with the jobs (default: DRBALANCE_NAMESPACE or 'default')")
    parser.add_argument("--policy", default=defaults.policy, choices=list(POLICIES),
                        help="DR-management policy: 'fair' = predict every job's SD from its measurements and "
                        "move to lower the largest (docs/policy.md); 'f-sched' = the F-scheduling thesis's "
                        "throughput-under-a-variance-bound rule; 'paper' = the paper's Alg. 1+2; 'observe' = "
                        "never change a DR (baseline)")
    parser.add_argument("--sd-threshold", type=non_negative_float, default=defaults.sd_threshold,
                        help="SD_th (paper policy): no move while max SD - min SD is below this")
    parser.add_argument("--util-threshold", type=percent, default=defaults.util_threshold,
                        help="Util_th (paper policy), percentage points: above it the utilisation branch runs, "
                        "else the SD branch")
    parser.add_argument("--dr-total", type=positive_int, default=defaults.dr_total,
                        help="granularity of DRs: shares are 1/DR_TOTAL of a mini-batch; 1..65535 (a record's "
                        "shares are 16-bit)")
    parser.add_argument("--source", default=None,
                        help="utilisation source: 'nvml' (real GPUs), 'emulated[:N[:MEMORY]]' (emulated GPUs; "
                        "docs/emulation.md), or 'scripted:FILE' (a JSON script, for tests) (default: 'nvml'; "
                        "where NVML finds no GPU and DRBALANCE_EMULATED_GPUS is set, 'emulated', as for the jobs)")
    parser.add_argument("--gpus", type=parse_gpus, default=None,
                        help="which GPUs the DRs index, e.g. 0,1,2,3 (default: all of the source's)")
    parser.add_argument("--sample-period", type=sample_period, default=defaults.sample_period,
                        help=f"seconds between utilisation samples, at least {MIN_SAMPLE_PERIOD:g} (NVML itself "
                        "updates its reading only every 1/6 to 1 s)")
    parser.add_argument("--window", type=positive_int, default=defaults.window,
                        help=f"utilisation smoothing window, in samples (1..{MAX_WINDOW})")
    parser.add_argument("--util-log-period", type=positive_float, default=defaults.util_log_period,
                        help="seconds between utilisation records in the manager log")
    parser.add_argument("--quiet-after", "--stale-after", dest="quiet_after", type=positive_float,
                        default=defaults.quiet_after,
                        help="seconds without a record update after which a job is shown as quiet in "
                        "'drbalance status' (a job is removed only when its process is gone, never for being quiet)")
    parser.add_argument("--log", type=non_empty_path, default=None,
                        help="manager log, JSON Lines (default: <runtime dir>/<namespace>/manager.jsonl)")
    parser.add_argument("--log-max-bytes", type=non_negative_int, default=defaults.log_max_bytes,
                        help="rotate the manager log when it would grow beyond this many bytes, at least 4096 "
                        "(0 = never)")
    parser.add_argument("--log-keep", type=non_negative_int, default=defaults.log_keep,
                        help="rotated manager logs to keep, 0-1000 (manager.jsonl.1 is the newest)")
    parser.add_argument("--metrics-port", type=parse_port, default=None, metavar="PORT",
                        help="serve Prometheus metrics at http://ADDRESS:PORT/metrics (0: any free port, "
                        "logged); off when not given (docs/operations.md lists the series)")
    parser.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                        help="address the metrics endpoint listens on: loopback only by default; e.g. 0.0.0.0 "
                        "or :: to let a Prometheus on another host scrape it (anyone who can reach the port "
                        "sees app names)")
    system = parser.add_argument_group(
        "system manager", "one manager for every user of the machine, started by the administrator "
        "(docs/operations.md): jobs find it with no setting and attach to it before their user's own manager")
    limits = UserLimits()
    system.add_argument("--system", action="store_true",
                        help="run as the machine's system manager, in DRBALANCE_SYSTEM_DIR/<namespace> (default "
                        "/run/drbalance/<namespace>), as root or as the service user that owns that folder")
    system.add_argument("--max-jobs-per-user", type=positive_int, default=limits.jobs, metavar="N",
                        help="jobs one user may have attached at once; more are refused (with --system)")
    system.add_argument("--max-connections-per-user", type=positive_int, default=limits.connections, metavar="N",
                        help="connections one user may hold open at once (jobs, status views; with --system)")
    system.add_argument("--notices-per-user", type=positive_float, default=limits.notices_per_second,
                        metavar="PER_SECOND", help="notices taken from one user per second, with a burst of one "
                        "second's worth; more are refused (with --system)")
    system.add_argument("--show-names", action="store_true",
                        help="show every job's user and name to every user in 'drbalance status' and in the "
                        "metrics (default: a user sees other users' jobs only as anonymous load; with --system)")
    slurm = parser.add_argument_group("Slurm", "a manager on a Slurm node (docs/slurm.md)")
    slurm.add_argument("--slurm-weight", action="store_true",
                       help="set this node's Weight in Slurm to 100 x the slow-down a new job would have here, so "
                       "Slurm starts new jobs where they are slowed least (runs 'scontrol update NodeName=NODE "
                       "Weight=W' when it changes; needs Slurm operator rights)")
    slurm.add_argument("--slurm-node", default=None, metavar="NODE",
                       help="this node's NodeName in slurm.conf (default: SLURMD_NODENAME, else the short host name)")
    slurm.add_argument("--slurm-weight-period", type=positive_float, default=defaults.slurm_weight_period,
                       metavar="SECONDS", help="seconds between weight updates")
    parser.add_argument("--duration", type=positive_float, default=None,
                        help="exit after this many seconds (default: run until stopped)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return parser


NO_GPU_HINT = ("; without NVIDIA GPUs (or their driver), run on emulated GPUs: drbalance-manager --source "
               "emulated:4, with DRBALANCE_EMULATED_GPUS=4 for the jobs (or set it for both: the manager then "
               "starts on them) (docs/emulation.md)")
"""What a manager that finds no NVML adds to the error: the way on a machine without GPUs."""


def open_default_source(gpus: list[int] | None, namespace: str,
                        machine: system.SystemPlace | None = None) -> UtilizationSource:
    """The source without ``--source``: NVML; where it finds no GPU and ``DRBALANCE_EMULATED_GPUS``
    is set, that many emulated GPUs, as a job's ``BalancedDataParallel`` of this environment
    chooses (CUDA where there is one, else the variable's emulated GPUs). ``machine``: a system
    manager's folder (``open_source``)."""
    try:
        return open_source("nvml", gpus, namespace=namespace, machine=machine)
    except UtilizationUnavailable as error:
        if not env.emulated_gpus():
            raise
        logger.info("drbalance-manager: no NVIDIA GPU (%s); on DRBALANCE_EMULATED_GPUS=%s emulated GPUs",
                    error, env.emulated_gpus())
        return open_source("emulated", gpus, namespace=namespace, machine=machine)


def main(argv: list[str] | None = None) -> int:
    """Run ``drbalance-manager``; the exit status (0, 1: a fault, 2: a usage error).

    The signal handlers it installs (stop on SIGINT, SIGTERM, SIGHUP; SIGXFSZ ignored) are
    restored to the ones it found on every return, so a caller in the same process (a test, a
    program embedding the manager) gets its own handlers back.
    """
    with stdout.watched() as watch:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help or --version (0), a usage error (2)
            if watch is not None and watch.report("drbalance-manager"):
                raise SystemExit(1) from None  # what --help printed was lost: a full disk, /dev/full
            raise
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        datefmt="%Y-%m-%dT%H:%M:%S")
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    if hasattr(signal, "SIGXFSZ"):
        handled.append(signal.SIGXFSZ)
    previous = {signum: signal.getsignal(signum) for signum in handled}
    try:
        return _serve(args)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(signum, handler)


def _serve(args: argparse.Namespace) -> int:
    """Install the stop handlers, then start the manager and serve until it stops; the exit status."""
    # The stop handlers come before anything is made (emulated GPUs are shared objects): a signal
    # that arrives before the manager exists is kept and honoured once it does; a second one then
    # ends the process at once (a start-up that hangs, e.g. in a driver call, needs no SIGKILL).
    early_stop: list[str] = []
    manager: Manager | SystemManager | None = None

    def on_stop(number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if manager is not None:
            manager.request_stop(name)
        elif not early_stop:
            early_stop.append(name)
        else:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

    if hasattr(signal, "SIGXFSZ"):  # a file-size limit makes writes fail (logged, retried) instead of killing us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    stop_on = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # a closed terminal; 'nohup' ignores it, and so do we
        stop_on.append(signal.SIGHUP)
    for signum in stop_on:
        signal.signal(signum, on_stop)
    try:
        namespace = args.namespace if args.namespace is not None else env.namespace()
        settings = ManagerSettings(
            namespace=namespace,
            policy=args.policy, sd_threshold=args.sd_threshold, util_threshold=args.util_threshold,
            dr_total=args.dr_total, sample_period=args.sample_period, window=args.window,
            util_log_period=args.util_log_period, quiet_after=args.quiet_after, log_path=args.log,
            log_max_bytes=args.log_max_bytes or None, log_keep=args.log_keep,
            slurm_weight_period=args.slurm_weight_period,
        )
        machine = _system_place(namespace) if args.system else None
        source = open_default_source(args.gpus, namespace, machine) if args.source is None else \
            open_source(args.source, args.gpus, namespace=namespace, machine=machine)
    except ManagerStartError as error:
        logger.error("drbalance-manager: %s", error)
        return 1
    except UtilizationUnavailable as error:
        logger.error("drbalance-manager: %s%s", error, NO_GPU_HINT if args.source in (None, "nvml") else "")
        return 2
    except ValueError as error:
        logger.error("drbalance-manager: %s", error)
        return 2
    except UnsafePath as error:  # e.g. emulated GPUs in a runtime directory others can write: the path is to blame
        logger.error("drbalance-manager: unsafe path, nothing started: %s", error)
        return 1
    except OSError as error:
        logger.error("drbalance-manager: cannot open the utilisation source %r: %s", args.source, error)
        return 1
    metrics = ManagerMetrics(namespace, settings.policy) if args.metrics_port is not None else None
    try:
        manager = _manager(args, settings, source, metrics)
    except ValueError as error:  # e.g. --dr-total 0, --sd-threshold -1
        source.close()
        logger.error("drbalance-manager: %s", error)
        return 2
    if early_stop:
        manager.request_stop(early_stop[0])
    if manager.stopping is not None:  # stopped before it started: only the source to close
        source.close()
        logger.info("drbalance-manager: stopped by %s before it started; nothing left behind", manager.stopping)
        return 0
    try:
        manager.start()
    except (ManagerAlreadyRunning, ManagerStartError, OSError, ValueError) as error:
        source.close()
        logger.error("drbalance-manager: %s", error)
        return 1
    try:
        if metrics is not None:
            try:
                metrics.serve(args.metrics_address, args.metrics_port)
            except MetricsServerError as error:
                manager.request_stop("metrics endpoint unavailable")
                logger.error("drbalance-manager: %s (%s)", error, error.hint)
                return 1
            manager.log("metrics", url=metrics.url())
            logger.info("drbalance-manager: metrics at %s", metrics.url())
        manager.run(args.duration)
    finally:
        manager.stop()
        if metrics is not None:
            metrics.close()
    return 0


def _system_place(namespace: str) -> system.SystemPlace:
    """The system manager's folder, made where missing (``ManagerStartError`` naming what to do)."""
    try:
        return system.create(namespace)
    except OSError as error:  # UnsafePath, PermissionError
        raise ManagerStartError(
            f"cannot use the system folder {system.system_root() / namespace}: {error}. Run the system manager as "
            f"root, or as a service user to whom root gave {system.system_root()} (systemd: "
            f"RuntimeDirectory=drbalance; docs/operations.md)") from None


def _manager(args: argparse.Namespace, settings: ManagerSettings, source, metrics) -> Manager | SystemManager:
    """The manager the options ask for: the machine's system manager (``--system``), else the user's own."""
    if not args.system:
        manager = Manager(settings, source, metrics=metrics)
    else:
        limits = UserLimits(args.max_jobs_per_user, args.max_connections_per_user, args.notices_per_user)
        manager = SystemManager(settings, source, metrics=metrics, limits=limits, show_names=args.show_names)
    if args.slurm_weight:
        manager.slurm = SlurmWeight(args.slurm_node or env.slurm_node())
    return manager


if __name__ == "__main__":
    raise SystemExit(main())
