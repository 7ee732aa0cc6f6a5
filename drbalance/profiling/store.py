"""Solo-run profiles: measure an app alone on one device, store its solo-run time by name.

``drbalance profile NAME -- python train.py ...`` runs the script with ``DRBALANCE_PROFILE_*``
set. The script's session then trains alone on its first device, records each iteration's
duration, writes them to a file and ends the script after N iterations. The mean iteration time
after warm-up and the start-up cost (what the warm-up iterations took beyond that mean) are stored
under NAME in the profiles file (``DRBALANCE_PROFILES``, see ``docs/profiles.md``); a job that
names the profile gets ``start-up + its own plan's iterations x the mean`` as its solo-run time.
"""

from __future__ import annotations

import fcntl
import json
import math
import numbers
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from drbalance import env
from drbalance.ipc.private import open_folder
from drbalance.jsonlog import finite_number

PROFILES_VERSION = 1
PROFILE_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass(frozen=True)
class Profile:
    """A stored solo-run measurement. Times in seconds.

    What a job uses is per iteration: ``iteration_time_s`` (the mean after warm-up) and
    ``startup_s`` (how much longer the warm-up iterations took than that mean; 0 in files that do not
    record it). ``solo_time_s`` is the solo-run time of the profiled command's own plan
    of ``iterations_total`` iterations; a job of another plan gets :meth:`solo_time` of its own.
    """

    name: str
    solo_time_s: float
    iteration_time_s: float
    iterations_total: int
    measured_iterations: int
    warmup_iterations: int
    device: str
    command: list[str]
    host: str
    created: str
    startup_s: float = 0.0

    def solo_time(self, iterations: int) -> float:
        """Solo-run seconds of a plan of ``iterations`` iterations: start-up + iterations x mean."""
        return self.startup_s + iterations * self.iteration_time_s


@dataclass(frozen=True)
class SoloTime:
    """A job's solo-run time (seconds, for its whole plan) and where it came from, as its SD log says:
    ``source`` is ``"seconds"`` (given as a number) or ``"profile"`` (``profile`` names it, scaled
    to the job's plan of ``iterations`` iterations)."""

    seconds: float
    source: str
    profile: Profile | None = None
    iterations: int = 0

    def describe(self) -> dict[str, Any]:
        """The fields of the SD log's ``start`` record that say where the solo time came from."""
        if self.profile is None:
            return {"solo_time_source": self.source}
        return {"solo_time_source": self.source, "profile": self.profile.name,
                "profile_iteration_time": self.profile.iteration_time_s, "profile_startup": self.profile.startup_s,
                "profile_iterations": self.profile.iterations_total, "scaled_to_iterations": self.iterations}


class ProfileNotFound(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def check_profile_name(name: str) -> str:
    if not name or len(name) > 64 or not set(name) <= PROFILE_NAME_CHARS:
        raise ValueError(f"profile name {name!r} is not valid: use 1-64 letters, digits, '_', '.' or '-'")
    return name


def _read_store(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"version": PROFILES_VERSION, "profiles": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"profiles file {path} is not readable JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise ValueError(f"profiles file {path} has no 'profiles' object")
    return data


def load_profile(name: str, path: Path | None = None, hint: str = "") -> Profile:
    """The stored profile ``name``; ``ProfileNotFound`` lists the names that exist. ``hint`` (a
    clause ending in "; ") goes into its message before the command that creates the profile,
    which ends the message."""
    path = path or env.profiles_path()
    profiles = _read_store(path)["profiles"]
    if name not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        create = "or create the profile with" if hint else "create it with"
        raise ProfileNotFound(
            f"no solo-run profile named {name!r} in {path} (profiles there: {known}); "
            f"{hint}{create}: drbalance profile {name} -- python your_train.py ..."
        )
    try:
        profile = Profile(**profiles[name])
    except TypeError as error:
        raise ValueError(f"profile {name!r} in {path} is malformed: {error}") from None
    if not (finite_number(profile.solo_time_s) and profile.solo_time_s > 0):  # not true, nor 400 digits
        raise ValueError(f"profile {name!r} in {path} has an invalid solo time {profile.solo_time_s!r}")
    if not (finite_number(profile.iteration_time_s) and profile.iteration_time_s > 0):
        raise ValueError(f"profile {name!r} in {path} has an invalid iteration time {profile.iteration_time_s!r}")
    if not (finite_number(profile.startup_s) and profile.startup_s >= 0):
        raise ValueError(f"profile {name!r} in {path} has an invalid start-up time {profile.startup_s!r}")
    return profile


def save_profile(profile: Profile, path: Path | None = None) -> Path:
    """Add or replace ``profile`` in the store (locked, atomically replaced)."""
    path = path or env.profiles_path()
    with open_folder(path.parent, create=True) as folder:  # missing folders get mode 0700, whatever the umask
        lock, _ = folder.open(_lock_path(path).name, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_store(path)
            data["profiles"][profile.name] = asdict(profile)
            data["version"] = PROFILES_VERSION
            folder.write(path.name, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        finally:
            os.close(lock)  # releases the flock
    return path


def check_store(path: Path | None = None) -> Path:
    """The profiles file (``path`` or the default), checked before anything is measured: its folder
    and lock file must be there or be created (``OSError`` otherwise: a file in the way, no write
    permission) and an existing file must be a readable profiles file (``ValueError`` otherwise),
    so that a measurement is never taken only to be lost."""
    path = path or env.profiles_path()
    with open_folder(path.parent, create=True) as folder:
        os.close(folder.open(_lock_path(path).name, os.O_RDWR | os.O_CREAT)[0])
    _read_store(path)
    return path


def _lock_path(path: Path) -> Path:
    """The lock file that writers of the profiles file ``path`` take."""
    return path.with_suffix(path.suffix + ".lock")


def resolve_solo_time(solo_time: float | str, iterations: int) -> SoloTime:
    """The solo-run time of a plan of ``iterations`` iterations: a number as it is (seconds for the
    whole plan), a profile name as the profile's start-up + ``iterations`` x its mean iteration
    time (whatever plan it was measured with). ``ProfileNotFound`` for a name with no profile
    (saying so when the name reads as a solo time in seconds: ``"12.5"`` instead of ``12.5``);
    ValueError for an invalid profile name and for anything that is neither."""
    if isinstance(solo_time, str):
        check_profile_name(solo_time)  # before "create it with: drbalance profile NAME", which would refuse it
        hint = ""
        if _reads_as_seconds(solo_time):
            hint = f"for {solo_time} seconds, give the number ({solo_time}), not a string; "
        profile = load_profile(solo_time, None, hint)
        return SoloTime(profile.solo_time(iterations), "profile", profile, iterations)
    if isinstance(solo_time, bool) or not isinstance(solo_time, numbers.Real):
        raise ValueError(f"solo_time must be the solo-run time in seconds (a number) or the name of a stored "
                         f"profile; got {solo_time!r}")
    return SoloTime(float(solo_time), "seconds")


def _reads_as_seconds(text: str) -> bool:
    """Whether ``text`` is a finite number > 0, as a solo time in seconds must be."""
    try:
        seconds = float(text)
    except ValueError:
        return False
    return math.isfinite(seconds) and seconds > 0


@dataclass(frozen=True)
class Measurement:
    """What a session in solo-measurement mode writes: its iteration times and its full plan."""

    iteration_times: list[float]
    warmup: int
    iterations_total: int
    device: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> Measurement:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"profile measurement {path} is missing or malformed: {error}") from None


def extrapolate(measurement: Measurement) -> tuple[float, float, float]:
    """(solo-run seconds of the measured plan, mean iteration seconds after warm-up, start-up
    seconds: how much longer the warm-up iterations took than that mean, at least 0)."""
    steady = measurement.iteration_times[measurement.warmup:]
    if not steady:
        raise ValueError(
            f"the profile run finished only {len(measurement.iteration_times)} iterations, none after "
            f"the {measurement.warmup} warm-up ones; run more iterations or a shorter warm-up"
        )
    mean = statistics.fmean(steady)
    startup = max(0.0, sum(measurement.iteration_times[:measurement.warmup]) - measurement.warmup * mean)
    return startup + mean * measurement.iterations_total, mean, startup


STOP_GRACE = 10.0  # seconds the profiled command's processes get after SIGTERM before SIGKILL


def run_command_group(command: list[str], env: dict[str, str], timeout: float | None) -> int:
    """Run ``command`` in a process group of its own and return its exit status. When it runs
    past ``timeout`` seconds (``subprocess.TimeoutExpired``) or this process is interrupted
    (Ctrl-C, SIGTERM), the whole group is stopped first (``stop_group``): a shell script's or
    torchrun's children too, not only the process started here."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except BaseException:
        stop_group(process)
        raise


def stop_group(process: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """SIGTERM to ``process``'s process group; SIGKILL to what is left of it after ``grace`` seconds."""
    group = process.pid  # the leader of its own session and group
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        process.poll()  # reap the leader: a zombie still counts as a member of its group
        if not _group_alive(group):
            return
        time.sleep(0.05)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def run_profile(
    name: str, command: Sequence[str], iterations: int, warmup: int, path: Path | None = None,
    timeout: float | None = None,
) -> Profile:
    """Run ``command`` in solo-measurement mode and store the result as ``name``."""
    check_profile_name(name)
    if not command:
        raise ValueError("give the training command after '--', e.g. drbalance profile NAME -- python train.py")
    if iterations <= warmup:
        raise ValueError(f"--iterations ({iterations}) must be larger than --warmup ({warmup})")
    path = check_store(path)  # before the measurement: a store that cannot take it would lose it
    with tempfile.TemporaryDirectory(prefix="drbalance-profile-") as scratch:
        output = Path(scratch) / "measurement.json"
        child_env = dict(os.environ)
        child_env.update({
            "DRBALANCE_PROFILE_OUTPUT": str(output),
            "DRBALANCE_PROFILE_ITERATIONS": str(iterations),
            "DRBALANCE_PROFILE_WARMUP": str(warmup),
        })
        started = time.monotonic()
        try:
            returncode = run_command_group(list(command), child_env, timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the profiled command did not finish within --timeout {timeout:g} s and was "
                               f"stopped: {list(command)}; nothing was stored") from None
        except OSError as error:
            raise RuntimeError(f"cannot run the profiled command {list(command)}: {error}") from None
        if returncode != 0:
            raise RuntimeError(f"the profiled command exited with status {returncode}: {list(command)}")
        if not output.exists():
            raise RuntimeError(
                "the profiled command finished without writing a measurement: does it create a "
                "drbalance Session and call session.step() every iteration?"
            )
        measurement = Measurement.read(output)
    solo, mean, startup = extrapolate(measurement)
    profile = Profile(
        name=name, solo_time_s=solo, iteration_time_s=mean, iterations_total=measurement.iterations_total,
        measured_iterations=len(measurement.iteration_times) - measurement.warmup,
        warmup_iterations=measurement.warmup, device=measurement.device, command=list(command),
        host=socket.gethostname(), created=time.strftime("%Y-%m-%dT%H:%M:%S"), startup_s=startup,
    )
    try:
        save_profile(profile, path)
    except (OSError, ValueError) as error:  # the store changed since check_store: say what was measured
        raise RuntimeError(f"profile {name!r} (solo-run time {solo:.3f} s, {mean:.6f} s/iteration) could not be "
                           f"stored: {error}") from None
    print(f"profile {name!r}: {mean * 1000:.1f} ms/iteration x {measurement.iterations_total} iterations + "
          f"{startup:.1f} s start-up = solo-run time {solo:.1f} s (measured in {time.monotonic() - started:.0f} s "
          f"on {measurement.device}); a job naming it gets start-up + its own iterations x the mean",
          file=sys.stderr)
    return profile
