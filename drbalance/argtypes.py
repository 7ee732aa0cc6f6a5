"""``argparse`` types for numbers that must be positive, and for paths that must not be empty: a bad
value is a one-line usage error (``argparse`` prints it and exits 2), never a traceback or a silent
change of meaning."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

from drbalance.defaults import MAX_JITTER


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, periods, steps)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number; got {text}")
    return value


def positive_float_up_to(largest: float) -> Callable[[str], float]:
    """A finite number > 0 and at most ``largest`` (a time scale, a pause: one too large overflows
    the clock the command sleeps on)."""

    def parse(text: str) -> float:
        value = positive_float(text)
        if value > largest:
            raise argparse.ArgumentTypeError(f"must be at most {largest:g}; got {text}")
        return value

    return parse


def _finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (thresholds such as the paper policy's SD_th)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text}")
    return value


def percent(text: str) -> float:
    """A number of percentage points within 0..100 (the paper policy's Util_th)."""
    value = _finite(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be within 0..100 percentage points; got {text}")
    return value


def relative_spread(text: str) -> float:
    """A relative spread within 0..``MAX_JITTER`` (the simulator's ``--jitter``: 0.1 = about 10% per phase)."""
    value = _finite(text)
    if not 0 <= value <= MAX_JITTER:
        raise argparse.ArgumentTypeError(
            f"must be a relative spread within 0..{MAX_JITTER:g} (0.1: about 10%); got {text}")
    return value


def _integer_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}; got {text}")
    return value


def integer_within(least: int, most: int) -> Callable[[str], int]:
    """An integer within ``least``..``most`` (a DR total: a record's shares are 16-bit)."""

    def parse(text: str) -> int:
        value = _integer_at_least(text, least)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be an integer within {least}..{most}; got {text}")
        return value

    return parse


def positive_int(text: str) -> int:
    """An integer >= 1 (counts of iterations, sizes)."""
    return _integer_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (where 0 means "none": e.g. no decisions besides the policy's own)."""
    return _integer_at_least(text, 0)


def non_empty_path(text: str) -> Path:
    """A file or folder path that is not empty: '' (an unset shell variable, ``--out "$DIR"``)
    would otherwise be the current folder, and a run's logs would land there without a word."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return Path(text)


AGO_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def point_in_time(text: str) -> float:
    """A moment as wall-clock seconds: an ISO 8601 date or date and time in local time
    (``2026-12-04``, ``2026-12-04T09:30``, ``2026-12-04 09:30:00``), or a time ago: a number and
    a unit, ``s``, ``m``, ``h`` or ``d`` (``90m``, ``2h``, ``3d``)."""
    unit = AGO_UNITS.get(text[-1:])
    if unit is not None and text[:-1]:
        try:
            ago = float(text[:-1])
        except ValueError:
            ago = math.nan
        if math.isfinite(ago) and ago >= 0:
            return time.time() - ago * unit
    try:
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        raise argparse.ArgumentTypeError(f"expected a date and time (2026-12-04, 2026-12-04T09:30) or a time ago "
                                         f"(90m, 2h, 3d); got {text!r}") from None


def names_from(known: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of names, each one of ``known`` (``what`` names them in
    the error: "policies", "mixes"); an empty list or an unknown name is a usage error."""
    choices = tuple(known)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            problem = f"unknown {what} {', '.join(map(repr, unknown))}" if unknown else f"no {what} given"
            raise argparse.ArgumentTypeError(f"{problem}; known: {', '.join(choices)}")
        return names

    return parse


def seconds_or_profile_name(text: str) -> float | str:
    """A solo-run time: a finite number > 0 is seconds (any float spelling: ``60``, ``2.5``,
    ``1e3``, ``.5e2``), anything else the name of a stored profile (``drbalance profile``),
    checked as one. A number that is not finite and positive (``-5``, ``0``, ``inf``, ``nan``) is
    refused rather than taken for a name."""
    from drbalance.profiling.store import check_profile_name  # no torch; only when used

    try:
        seconds = float(text)
    except ValueError:
        try:
            return check_profile_name(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{text} seconds: must be a finite number of seconds > 0, or the name "
                                         f"of a stored profile")
    return seconds


def check_stored_profile(parser: argparse.ArgumentParser, solo_time: float | str,
                         option: str = "--solo-time") -> None:
    """Exit with a usage error (status 2, one line after the usage) when ``solo_time`` (a
    ``seconds_or_profile_name`` value given as ``option``) names no stored profile, or the profiles
    file cannot be read; the message names the profiles file and the ``drbalance profile`` command
    that records one. Call it right after ``parse_args``, before the model is built: a ``Session``
    would raise ``ProfileNotFound`` only then. Seconds pass, and so does any name while this run
    is being measured by ``drbalance profile`` (its solo time is what is being measured)."""
    from drbalance import env  # no torch; only when used
    from drbalance.profiling.store import ProfileNotFound, resolve_solo_time

    if not isinstance(solo_time, str) or env.profile_output() is not None:
        return
    try:
        resolve_solo_time(solo_time, 1)
    except (ProfileNotFound, ValueError, OSError) as error:  # ValueError: an unreadable profiles file
        parser.error(f"argument {option}: {error}")


def app_name(text: str) -> str:
    """An app name the manager takes (``drbalance.ipc.names.check_app_name``: 1-48 letters, digits,
    ``_ . -``, not starting with ``.`` or ``-``)."""
    from drbalance.ipc.names import check_app_name  # no torch; only when used

    try:
        return check_app_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
