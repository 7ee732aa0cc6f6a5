"""``drbalance profile NAME -- COMMAND...``: measure a solo-run time and store it by name."""

from __future__ import annotations

import argparse
from pathlib import Path

from drbalance import defaults, env
from drbalance.argtypes import non_negative_int, positive_float, positive_int
from drbalance.profiling.store import check_profile_name, run_profile


def _profile_name(text: str) -> str:
    """NAME as a usage error when it is not a valid profile name."""
    try:
        return check_profile_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _file_path(text: str) -> str:
    """--profiles: a non-empty path ('' would otherwise mean the default file, without a word)."""
    if not text:
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a training script alone for a few hundred iterations, extrapolate its solo-run time "
        "(iterations in its full plan x mean iteration time after warm-up) and store it under NAME. "
        "The script must use a drbalance Session; in solo-measurement mode the session trains on its first "
        "device only, never contacts a manager, and ends the script after --iterations iterations. "
        "Refer to the result with Session(..., solo_time=NAME)."
    )
    parser.usage = "drbalance profile NAME [options] -- TRAINING COMMAND..."
    parser.add_argument("name", metavar="NAME", type=_profile_name,
                        help="profile name (letters, digits, '_', '.', '-'); the training command "
                        "follows '--', e.g. -- python -m drbalance.runs.train --model resnet50")
    parser.add_argument("--iterations", type=positive_int, default=defaults.MEASURE_ITERATIONS,
                        help="iterations to run, warm-up included (default 200)")
    parser.add_argument("--warmup", type=non_negative_int, default=defaults.MEASURE_WARMUP,
                        help="leading iterations left out of the mean (default 10)")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="give up after this many seconds (default: wait for the command to end)")
    parser.add_argument("--profiles", type=_file_path, default=None,
                        help=f"profiles file (default DRBALANCE_PROFILES or {env.profiles_path()})")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, as a usage error (``drbalance`` turns the ValueError into one), a command line
    that cannot give a measurement: no training command, or no iteration left after the warm-up."""
    if not args.passthrough:
        raise ValueError("give the training command after '--', e.g. drbalance profile NAME -- python train.py")
    if args.warmup >= args.iterations:
        raise ValueError(f"--warmup ({args.warmup}) must be smaller than --iterations ({args.iterations}): "
                         f"the mean is taken over the iterations after the warm-up")


def run(args: argparse.Namespace) -> int:
    command = list(args.passthrough)
    path = Path(args.profiles) if args.profiles else None
    profile = run_profile(args.name, command, args.iterations, args.warmup, path=path, timeout=args.timeout)
    print(f"{profile.name}\t{profile.solo_time_s:.3f} s solo-run time\t"
          f"{profile.iteration_time_s * 1000:.2f} ms/iteration")
    return 0
