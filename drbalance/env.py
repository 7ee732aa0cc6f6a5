"""Environment variables read by drbalance: one documented function per variable.

Nothing here is read at import time; each function reads its variable when called.
"""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

from drbalance import defaults

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
    return _state_home() / "drbalance" / "logs"


def _state_home() -> Path:
    """``$XDG_STATE_HOME``, else ``~/.local/state``."""
    return Path(os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state"))


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
    """``DRBALANCE_RUNTIME_DIR``: this user's private folder for the manager's lock, its discovery
    file, the apps' name claims and the status file (one sub-folder per namespace).

    Default: ``$XDG_RUNTIME_DIR/drbalance``, else ``/run/user/<uid>/drbalance``, else
    ``/tmp/drbalance-<uid>`` (``~/.local/state/drbalance/run-<host>`` when another user took that
    name first; ``_tmp_runtime_dir``). The
    first when ``XDG_RUNTIME_DIR`` is set (an absolute path); the second when that folder exists
    (what ``XDG_RUNTIME_DIR`` would be: jobs started without a login session, e.g. from cron, then
    still meet a manager started from one). Jobs and their manager must see the same folder, so a
    value must be an absolute path (ValueError otherwise: a relative one would name a different
    folder in each working directory). It is created with mode 0700 and checked before use
    (``drbalance.ipc.private``): never reached through another user's symbolic link, never another
    user's or writable by others.

    An ``XDG_RUNTIME_DIR`` that is not a folder of this user here (a value copied from another
    machine, as a batch job's environment is) is passed over, with a warning.
    """
    value = os.environ.get("DRBALANCE_RUNTIME_DIR")
    if value:
        if not os.path.isabs(value):
            raise ValueError(f"DRBALANCE_RUNTIME_DIR={value!r} is not an absolute path: jobs and their manager "
                             f"started in different folders would not meet; give e.g. {os.path.abspath(value)!r}")
        return Path(value)
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        if _owned_folder(Path(xdg), uid):
            return Path(xdg) / "drbalance"
        warnings.warn(f"XDG_RUNTIME_DIR={xdg!r} is not a folder of this user on this machine (a setting copied from "
                      f"another machine or login, as a batch job's environment is?): drbalance's runtime folder is "
                      f"its next default instead", RuntimeWarning, stacklevel=2)
    login_dir = Path(_LOGIN_DIR.format(uid=uid))
    if _owned_folder(login_dir, uid):
        return login_dir / "drbalance"
    return _tmp_runtime_dir(Path(_TMP_RUNTIME_DIR.format(uid=uid)), _squat_runtime_dir(), uid)


_LOGIN_DIR = "/run/user/{uid}"  # what XDG_RUNTIME_DIR would be, when it exists
_TMP_RUNTIME_DIR = "/tmp/drbalance-{uid}"  # the last default: a name any user can take first


def _squat_runtime_dir() -> Path:
    """Where the runtime directory goes when another user took ``/tmp/drbalance-<uid>``:
    ``$XDG_STATE_HOME/drbalance/run-<host>`` (``~/.local/state/drbalance/run-<host>``).

    The host's name keeps managers of one user on several machines that share a home folder
    (NFS) apart: each has its own lock, claims and pids.
    """
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", os.uname().nodename) or "host"
    return _state_home() / "drbalance" / f"run-{host}"


def _tmp_runtime_dir(tmp: Path, squat: Path, uid: int) -> Path:
    """The default runtime directory where no login folder exists: ``tmp`` (``/tmp/drbalance-<uid>``)
    unless another user could hold it, then ``squat`` (``_squat_runtime_dir``).

    Any user may create a name in /tmp first. ``tmp`` is used when it is a folder of ``uid`` (not a
    link), or when it does not exist and ``squat`` does not either (it is then created). When
    ``tmp`` is anything else (another user's folder, a link, a file) the folder is ``squat``, and
    ``squat`` stays chosen while it exists and ``tmp`` is not ``uid``'s: a neighbour who removes
    the planted name later does not split a manager and its jobs between two folders.
    """
    try:
        tmp.lstat()
    except FileNotFoundError:
        return squat if _owned_folder(squat, uid) else tmp
    except OSError:
        return squat
    return tmp if _owned_folder(tmp, uid) else squat


def _owned_folder(path: Path, uid: int) -> bool:
    """Whether ``path`` is a folder of ``uid`` itself, not a symbolic link to one."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return info.st_uid == uid and stat.S_ISDIR(info.st_mode)


def system_dir() -> Path:
    """``DRBALANCE_SYSTEM_DIR``: where a machine's system manager (``drbalance-manager --system``)
    keeps its socket and lock, one sub-folder per namespace (default ``/run/drbalance``).

    Every user's jobs look there first and attach to the system manager they find; without one,
    to their user's own manager. An absolute path (ValueError otherwise). Whether a job trusts what
    it finds there: ``drbalance.ipc.system``.
    """
    value = os.environ.get("DRBALANCE_SYSTEM_DIR")
    if not value:
        return Path(defaults.SYSTEM_DIR)
    if not os.path.isabs(value):
        raise ValueError(f"DRBALANCE_SYSTEM_DIR={value!r} is not an absolute path; give e.g. "
                         f"{os.path.abspath(value)!r}")
    return Path(value)


def slurm_node() -> str:
    """``SLURMD_NODENAME``: the Slurm node this process runs on, which Slurm sets in a job's tasks:
    a job spanning nodes names its part on each after it, and a node's manager sets that node's
    weight (``--slurm-weight``).

    Default: this machine's short host name.
    """
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def slurm_app_name() -> str | None:
    """``SLURM_JOB_ID``: with ``SLURM_JOB_NAME``, the app name of a Slurm job that gives none:
    ``<SLURM_JOB_NAME>-<SLURM_JOB_ID>`` (characters an app name may not hold made underscores, at most 48
    in all). None outside a Slurm job (or with an id that is not a number)."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+", job_id):
        return None
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("SLURM_JOB_NAME", "") or "job").lstrip(".-") or "job"
    return f"{name[:47 - len(job_id)]}-{job_id}"


def profile_output() -> Path | None:
    """``DRBALANCE_PROFILE_OUTPUT``: set by ``drbalance profile``; puts a session in solo-measurement mode.

    In solo-measurement mode a session trains alone on its first device, never contacts a manager, writes
    its measured iteration times to this file and ends the script after
    ``DRBALANCE_PROFILE_ITERATIONS`` iterations.
    """
    value = os.environ.get("DRBALANCE_PROFILE_OUTPUT")
    return Path(value) if value else None


def profile_iterations() -> int:
    """``DRBALANCE_PROFILE_ITERATIONS``: iterations to run in solo-measurement mode, warm-up included (default 200)."""
    return _positive_int("DRBALANCE_PROFILE_ITERATIONS", defaults.MEASURE_ITERATIONS)


def profile_warmup() -> int:
    """``DRBALANCE_PROFILE_WARMUP``: leading profile iterations left out of the mean (default 10)."""
    value = _positive_int("DRBALANCE_PROFILE_WARMUP", defaults.MEASURE_WARMUP, allow_zero=True)
    return value


_YES = {"1", "true", "yes", "on"}
_NO = {"", "0", "false", "no", "off"}


def no_manager() -> bool:
    """``DRBALANCE_NO_MANAGER``: ``1``, ``true``, ``yes`` or ``on``: sessions never contact a manager (own DR).

    Any case. Unset, empty, ``0``, ``false``, ``no`` or ``off``: they do. Anything else is a
    ValueError (a value that is neither must not silently leave the job managed).
    """
    raw = os.environ.get("DRBALANCE_NO_MANAGER", "")
    value = raw.strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    raise ValueError(f"DRBALANCE_NO_MANAGER={raw!r} is neither yes (1, true, yes, on) nor no "
                     f"(empty, 0, false, no, off)")


def emulated_gpus() -> str | None:
    """``DRBALANCE_EMULATED_GPUS``: ``N`` or ``N:MEMORY`` (e.g. ``4`` or ``4:16GiB``); unset = real devices.

    On a machine without CUDA it gives every ``BalancedDataParallel(model)`` of an unchanged
    script N emulated GPUs (default memory 24 GiB each; the model's cost is estimated from its
    first batch), and is the default of ``--source emulated`` and the examples' ``--devices auto``.
    Where CUDA is available, real GPUs are used and this is ignored by ``BalancedDataParallel``.
    """
    value = os.environ.get("DRBALANCE_EMULATED_GPUS")
    return value or None


def exit_grace() -> float:
    """``DRBALANCE_EXIT_GRACE``: seconds a job has after SIGTERM to unwind and exit (default 60).

    A session turns SIGTERM into ``SessionTerminated`` so that the script's ``with`` blocks and
    ``finally`` clauses run. A process still alive this long after the first SIGTERM (a thread
    that never ends, a blocked write, a hung cleanup) prints its threads' stacks to stderr and
    exits with status 143. A positive number of seconds.
    """
    raw = os.environ.get("DRBALANCE_EXIT_GRACE")
    if raw is None or raw == "":
        return defaults.EXIT_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DRBALANCE_EXIT_GRACE={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"DRBALANCE_EXIT_GRACE={raw!r} must be a positive, finite number of seconds")
    return value


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
