"""Environment variables read by drbalance: one documented function per variable.

Nothing here is read at import time; each function reads its variable when called.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def namespace() -> str:
    """``DRBALANCE_NAMESPACE``: which manager a job talks to (default ``default``).

    Jobs and a manager meet only within one namespace of one user; two managers on one host need
    two namespaces. Letters, digits, ``_`` and ``-``, at most 32 characters.
    """
    value = os.environ.get("DRBALANCE_NAMESPACE", "default")
    if not NAMESPACE_PATTERN.match(value):
        raise ValueError(
            f"DRBALANCE_NAMESPACE={value!r} is not a valid namespace: use 1-32 letters, digits, '_' or '-'"
        )
    return value


def log_dir() -> Path:
    """``DRBALANCE_LOG_DIR``: where per-app SD logs go when no path is given.

    Default: ``$XDG_STATE_HOME/drbalance/logs`` (``~/.local/state/drbalance/logs``).
    """
    value = os.environ.get("DRBALANCE_LOG_DIR")
    if value:
        return Path(value)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "drbalance" / "logs"


def profiles_path() -> Path:
    """``DRBALANCE_PROFILES``: the JSON file of stored solo-run profiles.

    Default: ``$XDG_CONFIG_HOME/drbalance/profiles.json`` (``~/.config/drbalance/profiles.json``).
    """
    value = os.environ.get("DRBALANCE_PROFILES")
    if value:
        return Path(value)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "drbalance" / "profiles.json"


def runtime_dir() -> Path:
    """``DRBALANCE_RUNTIME_DIR``: where the manager keeps its lock and status files.

    Default: ``/tmp/drbalance-<uid>`` (created with mode 0700).
    """
    value = os.environ.get("DRBALANCE_RUNTIME_DIR")
    return Path(value) if value else Path(f"/tmp/drbalance-{os.getuid()}")


def profile_output() -> Path | None:
    """``DRBALANCE_PROFILE_OUTPUT``: set by ``drbalance profile``; puts a session in profile mode.

    In profile mode a session trains alone on its first device, never contacts a manager, writes
    its measured iteration times to this file and ends the script after
    ``DRBALANCE_PROFILE_ITERATIONS`` iterations.
    """
    value = os.environ.get("DRBALANCE_PROFILE_OUTPUT")
    return Path(value) if value else None


def profile_iterations() -> int:
    """``DRBALANCE_PROFILE_ITERATIONS``: iterations to run in profile mode, warm-up included (default 200)."""
    return _positive_int("DRBALANCE_PROFILE_ITERATIONS", 200)


def profile_warmup() -> int:
    """``DRBALANCE_PROFILE_WARMUP``: leading profile iterations left out of the mean (default 10)."""
    value = _positive_int("DRBALANCE_PROFILE_WARMUP", 10, allow_zero=True)
    return value


def no_manager() -> bool:
    """``DRBALANCE_NO_MANAGER``: when ``1``, sessions never contact a manager (train with their own DR)."""
    return os.environ.get("DRBALANCE_NO_MANAGER", "") in {"1", "true", "yes"}


def emulated_gpus() -> str | None:
    """``DRBALANCE_EMULATED_GPUS``: ``N`` or ``N:MEMORY`` (e.g. ``4`` or ``4:16GiB``); unset = real devices.

    On a machine without CUDA it gives every ``BalancedDataParallel(model)`` of an unchanged
    script N emulated GPUs (default memory 24 GiB each; the model's cost is estimated from its
    first batch), and is the default of ``--source emulated`` and the examples' ``--devices auto``.
    Where CUDA is available, real GPUs are used and this is ignored by ``BalancedDataParallel``.
    """
    value = os.environ.get("DRBALANCE_EMULATED_GPUS")
    return value or None


def _positive_int(name: str, default: int, allow_zero: bool = False) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={raw!r} must be {'>= 0' if allow_zero else '> 0'}")
    return value
