"""What a DR-management policy sees and returns: plain, framework-free data.

A policy is a pure function of a snapshot: ``decide(app, trigger, snapshot) -> Decision``. The
daemon builds snapshots from shared-memory records and NVML; the simulator builds them from its
model; unit tests write them by hand. Policies never know which of the three called them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from drbalance import defaults
from drbalance.ratio import DEFAULT_TOTAL, DataRatio
from drbalance.solo_estimate import ALONE, MANAGER, SHARED


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and shape of the server.

    ``sd_threshold``: SD_th, the SD_max^diff below which nothing moves (a ratio, default 0.1).
    ``util_threshold``: Util_th in percentage points (default 20): above it the utilisation
    branch runs, below it the SD branch. ``dr_total``: the granularity of new DRs (default 10).
    """

    gpu_count: int
    dr_total: int = DEFAULT_TOTAL
    sd_threshold: float = defaults.SD_THRESHOLD
    util_threshold: float = defaults.UTIL_THRESHOLD

    def __post_init__(self) -> None:
        if isinstance(self.gpu_count, bool) or not isinstance(self.gpu_count, int) or self.gpu_count < 1:
            raise ValueError(f"gpu_count must be a positive integer; got {self.gpu_count!r}")
        if isinstance(self.dr_total, bool) or not isinstance(self.dr_total, int) or self.dr_total < 1:
            raise ValueError(f"dr_total must be a positive integer; got {self.dr_total!r}")
        if not (math.isfinite(self.sd_threshold) and self.sd_threshold >= 0):
            raise ValueError(f"sd_threshold must be a finite number >= 0; got {self.sd_threshold!r}")
        if not (math.isfinite(self.util_threshold) and 0 <= self.util_threshold <= 100):
            raise ValueError(f"util_threshold must be within 0..100 percentage points; got {self.util_threshold!r}")


SOLO_BASES = (None, ALONE, SHARED, MANAGER)
"""``AppView.solo_basis`` values."""


@dataclass(frozen=True)
class AppView:
    """One live app as a policy sees it. Times in seconds; ``slowdown`` None = not known yet.

    Everything per GPU is in the server's GPU order (the manager maps each app's devices to it).
    Constraints on any DR the app may be given: ``allowed`` (the GPUs the app can use; None = all),
    ``min_share`` (every allowed GPU keeps at least this share, in units of the configured DR
    total; 0 = a GPU may be emptied), ``max_share`` (per GPU, the largest share that fits its
    memory; None = no cap). Measurements: ``chunk_seconds`` (per GPU, mean seconds of the app's
    replica per iteration, None where not measured), ``chunk_samples`` (mean samples of those
    chunks), ``batch`` (samples per global mini-batch; None = unknown). ``solo_basis``: where
    ``solo_time`` comes from: None given or profiled; the job's own online estimate from GPUs it
    had ``alone``, or from ``shared`` ones only (an upper bound); the ``manager``'s estimate.
    """

    name: str
    ratio: DataRatio
    slowdown: float | None
    pid: int = 0
    epoch: int = 0
    iteration: int = 0
    iterations_total: int = 1
    iteration_time: float | None = None
    solo_time: float = 1.0
    allowed: tuple[int, ...] | None = None
    min_share: int = 0
    max_share: tuple[int | None, ...] | None = None
    chunk_seconds: tuple[float | None, ...] | None = None
    chunk_samples: tuple[float, ...] | None = None
    batch: int | None = None
    solo_basis: str | None = None

    def __post_init__(self) -> None:
        if self.solo_basis not in SOLO_BASES:
            raise ValueError(f"app {self.name!r}: solo_basis must be one of {SOLO_BASES}; got {self.solo_basis!r}")
        if self.slowdown is not None and not (math.isfinite(self.slowdown) and self.slowdown >= 0):
            raise ValueError(f"app {self.name!r}: slowdown must be finite and >= 0 or None; got {self.slowdown!r}")
        for what in ("max_share", "chunk_seconds", "chunk_samples"):
            value = getattr(self, what)
            if value is not None and len(value) != len(self.ratio):
                raise ValueError(f"app {self.name!r}: {what} has {len(value)} entries for {len(self.ratio)} GPUs")
        if self.allowed is not None and (not self.allowed or any(not 0 <= g < len(self.ratio) for g in self.allowed)):
            raise ValueError(f"app {self.name!r}: allowed GPUs {self.allowed} are not within 0..{len(self.ratio) - 1}")
        if self.min_share < 0:
            raise ValueError(f"app {self.name!r}: min_share must be >= 0; got {self.min_share}")

    @property
    def solo_measured(self) -> bool:
        """Whether ``solo_time`` is the job's own (given, profiled, or estimated from GPUs it had
        alone): not an upper bound, nor the manager's estimate."""
        return self.solo_basis is None or self.solo_basis == ALONE

    def usable(self, gpu: int) -> bool:
        """Whether the app may hold a share on ``gpu``."""
        return self.allowed is None or gpu in self.allowed

    def cap(self, gpu: int, total: int) -> int:
        """The largest share the app may hold on ``gpu`` (in units of ``total``)."""
        if not self.usable(gpu):
            return 0
        limit = None if self.max_share is None else self.max_share[gpu]
        return total if limit is None else max(0, min(total, limit))


@dataclass(frozen=True)
class Snapshot:
    """Everything a decision may depend on.

    ``utilization``: per GPU, percent busy (0-100) averaged over the smoothing window, or None
    where the driver gave no reading. ``apps``: every live app, the deciding one included.
    """

    apps: tuple[AppView, ...]
    utilization: tuple[float | None, ...]
    config: PolicyConfig

    def __post_init__(self) -> None:
        if len(self.utilization) != self.config.gpu_count:
            raise ValueError(
                f"{len(self.utilization)} utilisation readings for {self.config.gpu_count} GPUs"
            )
        for gpu, value in enumerate(self.utilization):
            if value is not None and not (math.isfinite(value) and 0 <= value <= 100):
                raise ValueError(f"utilisation of GPU {gpu} is {value!r}; expected 0..100 or None")
        names = [app.name for app in self.apps]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate app names in snapshot: {names}")

    def app(self, name: str) -> AppView:
        for view in self.apps:
            if view.name == name:
                return view
        raise KeyError(f"app {name!r} is not in the snapshot (apps: {[a.name for a in self.apps]})")


@dataclass(frozen=True)
class Decision:
    """The new DR for ``app``, the branch of the algorithm that produced it, and why.

    ``next_boundary``: seconds after which the app should ask for a decision again (a boundary
    notice), besides its epoch ends; None leaves the app's own cadence. ``others``: new DRs for
    other apps, decided jointly with this one; the manager pushes them to those apps at once
    (each applies it after its current iteration), after checking each against that app's constraints.
    """

    app: str
    ratio: DataRatio
    branch: str
    details: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    next_boundary: float | None = None
    others: Mapping[str, DataRatio] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, app: str, ratio: DataRatio, branch: str, **details: Any) -> Decision:
        """A decision with its details given as keyword arguments (stored read-only)."""
        return cls(app, ratio, branch, MappingProxyType(details))

    def __post_init__(self) -> None:
        if self.next_boundary is not None and not (math.isfinite(self.next_boundary) and self.next_boundary > 0):
            raise ValueError(f"next_boundary must be a positive number of seconds or None; got {self.next_boundary!r}")


class Policy(Protocol):
    """A DR-management policy: a pure function of (app, trigger, snapshot)."""

    name: str

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        """Decide ``app``'s DR. ``trigger`` is ``register`` (new app) or ``boundary``."""
        ...


@runtime_checkable
class SoloEstimating(Protocol):
    """A policy that also estimates each app's solo iteration time from what it learned (``fair``,
    ``f-sched``); the manager sends it with every answer (``AppCommand.solo_iteration``)."""

    def solo_estimate(self, app: str) -> float | None:
        """Seconds of one iteration of ``app`` alone on one GPU, or None."""
        ...


def violations(view: AppView, ratio: DataRatio, config: PolicyConfig) -> list[str]:
    """Why ``ratio`` may not be given to the app (empty: it respects every constraint).

    Checked by the daemon on every decision, and by the policies before they propose a DR.
    """
    problems = []
    if len(ratio) != config.gpu_count:
        return [f"{len(ratio)} shares for a server of {config.gpu_count} GPUs"]
    if view.allowed is None and view.max_share is None and view.min_share == 0:
        return problems  # no constraints: every share of a valid DR fits (policies check many candidates)
    for gpu, share in enumerate(ratio.shares):
        if share and not view.usable(gpu):
            problems.append(f"share {share} on GPU {gpu}, which the app cannot use (it can use {list(view.allowed)})")
        elif share > view.cap(gpu, ratio.total):
            problems.append(f"share {share} on GPU {gpu} exceeds its memory cap {view.cap(gpu, ratio.total)}")
        elif view.usable(gpu) and share < view.min_share:
            problems.append(f"share {share} on GPU {gpu} is below the app's minimum {view.min_share}")
    return problems


def current_ratio(view: AppView, config: PolicyConfig) -> DataRatio | None:
    """The app's DR in the configured total, or None if it does not fit this server."""
    if len(view.ratio) != config.gpu_count:
        return None
    return view.ratio.rescale(config.dr_total)


class ObservePolicy:
    """The baseline: never change a DR (apps keep the placement they started with)."""

    name = "observe"

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        return Decision(app, snapshot.app(app).ratio, "observe")
