"""The performance model of ``plan``: every app's iteration time under any DRs,
learned online from the apps' records (no torch, nothing from the simulator).

For app i with n_ig samples of its batch B_i on GPU g (k_i GPUs with samples), in seconds::

    T_i  = h_i + o_i (k_i - 1) + max_g c_ig                                iteration time
    c_ig = (f_i + w_i n_ig) / s_g * (1 + sum_{j != i, on g} kappa_ij d_jg)    chunk time on GPU g (n_ig > 0)
    d_jg = c_jg / T_j                                                     duty: share of time j keeps g busy
    u_i  = h_i + f_i + w_i B_i                                            solo iteration: alone on a speed-1 GPU

Per app: ``h`` host seconds per iteration (loading, optimiser, Python: all but the chunks),
``o`` seconds per extra replica (scatter, replicate, gather, and the wait for the slowest chunk),
``f`` GPU seconds of a chunk whatever its size (kernel launches), ``w`` GPU seconds per sample,
which follows from the solo iteration ``u`` (solo-run time / planned iterations). Per GPU: ``s``
its speed (1 = the solo run's GPU).
Per pair of apps sharing a GPU: ``kappa``, how much i's chunk stretches per unit of j's duty
(prior ``kappa_prior``, 1: time slicing; a pair never measured together takes i's mean kappa over
the pairs measured with it, times j's mean kappa over the pairs measured with it, over the mean of
all, each mean ``kappa_prior`` where nothing is measured). The duties make T a fixed point, found by damped
iteration. SD at finish follows from T by Eq. 2.

Each is fitted by least squares over the last ``history`` windows of the app's records, its
prior counting as ``prior_weight`` windows:

- ``h``: T - max_g c_g over windows on one GPU (prior ``host_prior`` x u); ``o``: over windows
  on k > 1 GPUs, (T - max_g c_g - h) / (k - 1) (prior 0);
- ``f``: c_g s_g / sigma_g - (u - h) n_g / B = f (1 - n_g / B) over chunks smaller than the
  batch (prior ``fixed_prior`` x (u - h));
- ``s_g``: (u - h) / c_g over windows of an app alone on g with its whole batch (prior 1), as a
  mean of logarithms;
- ``kappa_i.``: c_g s_g / (f + w n_g) - 1 = sum_j kappa_ij d_jg over windows of i shared with
  others, ridge regression towards the prior.

A window is what an app's record shows at a plan: its mean iteration time and chunk times since
its last boundary (the apps notice every plan period, so each plan reads about one new window).

``error`` is the model's own measured prediction error: the median relative miss of the
iteration times it predicted at a plan (``expect``) for the layout each app was then measured in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from drbalance.policy.base import AppView

FIXED_POINT_STEPS = 12
"""Damped iterations of the duties' fixed point (each halves the distance; 12 leave < 0.1%)."""


@dataclass(frozen=True)
class ModelConfig:
    """Priors (shares of an app's solo iteration) and how much history the fits keep."""

    host_prior: float = 0.25  # share of the solo iteration spent off the GPU (docs/calibration.md: 0.26)
    fixed_prior: float = 0.3  # share of a whole batch's GPU time that does not shrink with the chunk (Pollux)
    kappa_prior: float = 1.0  # kappa of a pair never measured together: time slicing
    history: int = 8  # windows per app kept for the fits (older ones describe an older layout)
    prior_weight: float = 0.1  # windows' worth of each prior: one measurement outweighs it, it holds without any

    def __post_init__(self) -> None:
        for name in ("host_prior", "fixed_prior"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be a share within 0..1; got {getattr(self, name)!r}")
        if not 0.0 <= self.kappa_prior < math.inf:
            raise ValueError(f"kappa_prior must be a finite number >= 0; got {self.kappa_prior!r}")
        if not 0.0 < self.prior_weight < math.inf:
            raise ValueError(f"prior_weight must be a positive number of windows; got {self.prior_weight!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"history must be a positive number of windows; got {self.history!r}")


class Window(NamedTuple):
    """One measured window of an app: iteration time and per used GPU (gpu, samples, chunk seconds,
    ((other app, its duty on the GPU), ...) or None where the company is not known)."""

    seconds: float
    chunks: tuple[tuple[int, float, float, tuple[tuple[str, float], ...]], ...]


@dataclass
class AppFit:
    """What is learned about one app (seconds)."""

    solo: float
    batch: float
    host: float
    fixed: float
    replica: float = 0.0
    windows: deque = field(default_factory=deque)
    iteration: int = -1  # the record's iteration count last learned from

    @property
    def device(self) -> float:
        """GPU seconds of the whole batch alone on a speed-1 GPU (at least a twentieth of the solo iteration)."""
        return max(0.05 * self.solo, self.solo - self.host)

    @property
    def per_sample(self) -> float:
        return max(0.0, self.device - self.fixed) / self.batch

    def alone(self, samples: float) -> float:
        """GPU seconds of a chunk of ``samples`` on a speed-1 GPU with nobody else (0: no chunk)."""
        return self.fixed + self.per_sample * samples if samples > 0 else 0.0


class Model:
    """Learns from snapshots (``learn``) and predicts iteration times (``times``)."""

    def __init__(self, gpu_count: int, config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        self.gpu_count = gpu_count
        self.apps: dict[str, AppFit] = {}
        self.speed = np.ones(gpu_count)
        self.kappa: dict[tuple[str, str], float] = {}
        self.misses: deque = deque(maxlen=64)  # relative misses of predicted iteration times
        self.expected: dict[str, tuple[tuple[int, ...], float]] = {}  # per app: GPUs, predicted seconds
        self._speed_logs: dict[str, dict[int, list[float]]] = {}  # per app: its alone windows' logs per GPU

    @property
    def error(self) -> float:
        """Median relative miss of the iteration times predicted before measuring them (inf: none yet)."""
        return float(np.median(self.misses)) if self.misses else math.inf

    # --- learning -------------------------------------------------------------------------------
    def learn(self, views: Sequence[AppView]) -> None:
        """Forget apps that are gone; learn from every app whose record shows a new measured window."""
        names = {view.name for view in views}
        for gone in [name for name in self.apps if name not in names]:
            del self.apps[gone]
            self._speed_logs.pop(gone, None)
        self.kappa = {pair: k for pair, k in self.kappa.items() if pair[0] in names and pair[1] in names}
        duties = {view.name: _duties(view) for view in views}
        users: dict[int, set[str]] = {}
        for view in views:
            for gpu in view.ratio.used:
                users.setdefault(gpu, set()).add(view.name)
        for view in views:
            fit = self._fit_of(view)
            window = _window(view, duties, users)
            if window is None or view.iteration == fit.iteration:
                continue
            fit.iteration = view.iteration
            self._measure_miss(view.name, window)
            fit.windows.append(window)
            while len(fit.windows) > self.config.history:
                fit.windows.popleft()
            self._fit_host(view.name, fit)
            self._fit_speeds(view.name)
            self._fit_kappa(view.name, fit)

    def expect(self, names: Sequence[str], samples: np.ndarray, seconds: np.ndarray) -> None:
        """Note the iteration times predicted for the apps in the layout ``samples`` (N x GPUs):
        each app's next window in that layout measures the model's error (``error``)."""
        for name, row, value in zip(names, samples, seconds):
            self.expected[name] = (tuple(int(gpu) for gpu in np.flatnonzero(row > 0)), float(value))

    def _measure_miss(self, name: str, window: Window) -> None:
        expected = self.expected.pop(name, None)
        if expected is not None and expected[0] == tuple(chunk[0] for chunk in window.chunks):
            self.misses.append(abs(window.seconds / expected[1] - 1.0))

    def _fit_of(self, view: AppView) -> AppFit:
        solo = max(1e-9, view.solo_time / max(1, view.iterations_total))
        batch = float(view.batch or (sum(view.chunk_samples) if view.chunk_samples else 0) or 1)
        fit = self.apps.get(view.name)
        if fit is None or fit.solo != solo or fit.batch != batch:
            host = self.config.host_prior * solo
            fit = self.apps[view.name] = AppFit(solo, batch, host, self.config.fixed_prior * (solo - host))
            self._speed_logs.pop(view.name, None)  # its windows of before are gone with its old fit
        return fit

    def _fit_host(self, name: str, fit: AppFit) -> None:
        """h from windows on one GPU, o from split windows, f from chunks smaller than the batch;
        each prior counts as one window."""
        config, solo = self.config, fit.solo
        prior = config.prior_weight
        alone = [w.seconds - max(c[2] for c in w.chunks) for w in fit.windows if len(w.chunks) == 1]
        fit.host = min(0.95 * solo, max(0.0, (prior * config.host_prior * solo + sum(alone)) / (prior + len(alone))))
        split = [(w.seconds - max(c[2] for c in w.chunks) - fit.host) / (len(w.chunks) - 1)
                 for w in fit.windows if len(w.chunks) > 1]
        fit.replica = max(0.0, sum(split) / (prior + len(split)))
        weight, total = prior, prior * config.fixed_prior * fit.device
        for window in fit.windows:
            for gpu, samples, seconds, others in window.chunks:
                if others is not None:
                    share = 1.0 - samples / fit.batch
                    stretch = 1.0 + sum(self.pair(name, other) * duty for other, duty in others)
                    measured = seconds * self.speed[gpu] / stretch - fit.device * samples / fit.batch
                    weight, total = weight + share * share, total + share * measured
        fit.fixed = min(fit.device, max(0.0, total / weight))

    def _fit_speeds(self, name: str) -> None:
        """Every GPU some app used alone with its whole batch: the mean log of (u - h) / c over all such
        windows (each app's logs kept from its last fit: only ``name``'s have changed)."""
        fit = self.apps[name]
        mine: dict[int, list[float]] = {}
        for window in fit.windows:
            for gpu, samples, seconds, others in window.chunks:
                if others == () and seconds > 0 and samples >= fit.batch:  # the whole batch, alone
                    mine.setdefault(gpu, []).append(math.log(fit.alone(samples) / seconds))
        self._speed_logs[name] = mine
        logs: dict[int, list[float]] = {}
        for app in self.apps:
            for gpu, values in self._speed_logs.get(app, {}).items():
                logs.setdefault(gpu, []).extend(values)
        for gpu, values in logs.items():
            self.speed[gpu] = math.exp(sum(values) / (self.config.prior_weight + len(values)))  # the prior: log 1

    def _fit_kappa(self, name: str, fit: AppFit) -> None:
        """Ridge regression of i's chunk stretch on its co-runners' duties, towards ``kappa_prior``."""
        partners = sorted({other for w in fit.windows for c in w.chunks for other, _ in c[3] or ()})
        if not partners:
            return
        index = {other: column for column, other in enumerate(partners)}
        rows, targets = [], []
        for window in fit.windows:
            for gpu, samples, seconds, others in window.chunks:
                if others:  # shared, with known company
                    row = np.zeros(len(partners))
                    for other, duty in others:
                        row[index[other]] = duty
                    rows.append(row)
                    targets.append(seconds * self.speed[gpu] / fit.alone(samples) - 1.0)
        if not rows:
            return
        a, y = np.array(rows), np.array(targets)
        prior = np.full(len(partners), self.config.kappa_prior)
        weight = self.config.prior_weight
        kappa = np.linalg.solve(a.T @ a + weight * np.eye(len(partners)), a.T @ y + weight * prior)
        for other, value in zip(partners, np.clip(kappa, 0.0, 10.0)):
            self.kappa[name, other] = float(value)

    # --- prediction ------------------------------------------------------------------------------
    def pair(self, name: str, other: str) -> float:
        """kappa of ``name``'s chunks beside ``other``'s (the prior if never measured together)."""
        found = self.kappa.get((name, other))
        return found if found is not None else self.prior(name, other)

    def prior(self, name: str, other: str, means: tuple | None = None) -> float:
        """The prior of a pair: how much ``name`` suffers beside the others it was measured with, times
        how much ``other`` makes its company suffer, relative to all pairs (``kappa_prior`` without any).
        ``means``: ``_means()``, if the caller has it."""
        overall, suffers, causes = means or self._means()
        sensitivity = suffers.get(name, overall)
        aggressiveness = causes.get(other, overall)
        return sensitivity * aggressiveness / overall if overall > 0 else 0.0

    def _means(self) -> tuple[float, dict[str, float], dict[str, float]]:
        """The mean kappa of all measured pairs, and per app over the pairs it suffers in and causes."""
        if not self.kappa:
            return self.config.kappa_prior, {}, {}
        suffers: dict[str, list[float]] = {}
        causes: dict[str, list[float]] = {}
        for (a, b), k in self.kappa.items():
            suffers.setdefault(a, []).append(k)
            causes.setdefault(b, []).append(k)
        values = list(self.kappa.values())
        return (sum(values) / len(values), {a: sum(ks) / len(ks) for a, ks in suffers.items()},
                {b: sum(ks) / len(ks) for b, ks in causes.items()})

    def arrays(self, names: Sequence[str]) -> tuple[np.ndarray, ...]:
        """(h, o, f, w, kappa with a zero diagonal) for ``names`` in that order."""
        fits = [self.apps[name] for name in names]
        means = self._means()
        learned = self.kappa
        kappa = np.array([[0.0 if a == b else learned[a, b] if (a, b) in learned else self.prior(a, b, means)
                           for b in names] for a in names])
        kappa = kappa.reshape(len(names), len(names))
        return (np.array([f.host for f in fits]), np.array([f.replica for f in fits]),
                np.array([f.fixed for f in fits]), np.array([f.per_sample for f in fits]), kappa)

    def times(self, names: Sequence[str], samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Iteration times (N) and duties (N x GPUs) of the apps ``names`` with ``samples`` (N x GPUs):
        the fixed point of T and d, by damped iteration from the duties without company."""
        host, replica, fixed, per_sample, kappa = self.arrays(names)
        used = samples > 0
        alone = (fixed[:, None] + per_sample[:, None] * samples) * used / self.speed[None, :]
        base = host + replica * np.maximum(0, used.sum(axis=1) - 1)
        seconds = base + alone.max(axis=1, initial=0.0)
        duty = alone / seconds[:, None]
        for _ in range(FIXED_POINT_STEPS):
            chunks = alone * (1.0 + kappa @ duty)
            seconds = base + chunks.max(axis=1, initial=0.0)
            duty = 0.5 * duty + 0.5 * chunks / seconds[:, None]
        return seconds, duty


def _duties(view: AppView) -> dict[int, float]:
    """Per GPU the share of time the app's last window kept it busy (chunk time / iteration time)."""
    if not view.iteration_time or view.chunk_seconds is None:
        return {}
    return {gpu: min(1.0, seconds / view.iteration_time) for gpu, seconds in enumerate(view.chunk_seconds)
            if seconds is not None and seconds > 0}


def _window(view: AppView, duties: dict[str, dict[int, float]], users: dict[int, set[str]]) -> Window | None:
    """The app's last measured window as the model learns from it, or None if it measured nothing.

    A chunk on a GPU that an app uses without a measured duty there (it arrived or moved there since
    its last window) has unknown company: its co-runners are given as None, and the speed and kappa
    fits leave it out."""
    if view.slowdown is None or not view.iteration_time or view.chunk_seconds is None or view.chunk_samples is None:
        return None
    chunks = []
    for gpu, (seconds, samples) in enumerate(zip(view.chunk_seconds, view.chunk_samples)):
        if seconds is not None and seconds > 0 and samples > 0:
            others = tuple((name, found[gpu]) for name, found in duties.items() if name != view.name and gpu in found)
            unknown = any(gpu not in duties.get(name, {}) for name in users.get(gpu, ()) if name != view.name)
            chunks.append((gpu, float(samples), float(seconds), None if unknown else others))
    return Window(float(view.iteration_time), tuple(chunks)) if chunks else None
