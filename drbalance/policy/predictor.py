"""Predict each app's iteration time under any DRs, from what the apps' records show (no torch).

Used by the ``fair`` and ``f-sched`` policies. Everything it knows comes from snapshots, that is
from the apps' records and NVML: each app's solo iteration time (solo-run time / planned
iterations), its measured iteration time, and per GPU its replica's measured chunk time and
chunk size (``AppView.chunk_seconds`` / ``chunk_samples``). Nothing comes from the simulator.

The model of one iteration of app i whose DR puts n_g samples on GPU g (k GPUs used):

    T_i = (host_i + overhead_i * (k - 1) + max_g  work_i * (phi + (1 - phi) * n_g / B_i) / speed_g * dilation_ig)
          * (1 + rho * (k - 1))
    dilation_ig = 1 + sum over the other apps j on g of  kappa_ij * duty_jg

- ``host_i`` (host seconds per iteration: data loading, optimizer, Python) is measured as the
  iteration time minus the longest chunk while the app runs on one GPU; ``overhead_i`` (seconds
  per extra replica: scatter, replicate, gather) likewise while it runs on several.
- ``work_i`` is the full batch's device time on a speed-1 GPU: the solo iteration time minus the
  host time (the solo run is, by definition, alone on one reference GPU). ``phi`` is the part of
  a chunk's time that does not shrink with its size (prior 0.3; from the linear fits in
  docs/calibration.md).
- ``speed_g`` is learned from apps alone on GPU g with their whole batch (default 1), and for a GPU
  never measured so, from an app split over it and a measured GPU, alone on both
  (``_learn_relative_speeds``).
- ``duty_jg`` is the fraction of time app j keeps GPU g busy (its chunk time there over its
  iteration time), and ``kappa_ij`` how much app i's chunk stretches per unit of that: learned
  per pair of apps, by a normalised least-mean-squares step, from every measured chunk time of
  an app that shares its GPU. A pair never seen together gets the app's mean sensitivity times
  the other's mean aggressiveness over the pairs learned so far, relative to the overall mean
  (``interference_prior`` while nothing is learned).
- ``rho`` (the replica penalty, one for all apps, 0 until learned) is what a split costs beyond
  that: learned from the policy's own moves that changed an app's replica count
  (``learn_move``). The mean-field stretch above is the expected stretch of each chunk, but an
  iteration waits for its slowest chunk, and with chunks on several shared GPUs that one is
  usually stretched more than on average, so a split runs slower than the stretch predicts;
  rho takes up that difference.
- A per-app correction factor (measured / predicted iteration time for the configuration the
  app was measured in) absorbs what the model misses.

Times in seconds. Predicted SD at finish follows Eq. 2 with the predicted iteration time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import add
from typing import NamedTuple

import numpy as np

from drbalance.policy.base import AppView
from drbalance.ratio import DataRatio


@dataclass(frozen=True)
class PredictorConfig:
    """Priors and learning rates. Shares are of the app's solo iteration time."""

    fixed_fraction: float = 0.3  # phi: part of a full-batch chunk's time that does not depend on its size
    host_prior: float = 0.25  # host share of the solo iteration until measured
    overhead_prior: float = 0.25  # cost of each extra replica until measured
    overhead_floor: float = 0.02  # seconds: the least an extra replica is assumed to cost until measured
    duty_prior: float = 0.7  # share of time an app without measurements keeps its GPUs busy
    interference_prior: float = 1.0  # kappa of a pair never seen together: time slicing
    smoothing: float = 0.5  # weight of a new observation in the running estimates
    interference_step: float = 0.5  # NLMS step for kappa
    correction_bounds: tuple[float, float] = (0.67, 1.5)
    replica_penalty_step: float = 0.2  # rho += this x (measured / predicted - 1) / replicas added, per measured move
    replica_penalty_max: float = 1.0  # rho's ceiling (share of the iteration time per extra replica)

    def __post_init__(self) -> None:
        for name in ("fixed_fraction", "host_prior", "smoothing", "interference_step", "replica_penalty_step"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within 0..1; got {value!r}")
        if self.overhead_prior < 0 or self.interference_prior < 0:
            raise ValueError("overhead_prior and interference_prior must be >= 0")
        if not self.replica_penalty_max >= 0:  # also refuses NaN
            raise ValueError(f"replica_penalty_max must be a number >= 0; got {self.replica_penalty_max!r}")


@dataclass
class AppModel:
    """What the predictor has learned about one app (seconds)."""

    solo_iteration: float
    batch: int
    host: float | None = None
    overhead: float | None = None
    correction: float = 1.0
    measured_iteration: int = -1  # the app's iteration count at the last observation used

    def host_time(self, config: PredictorConfig) -> float:
        return self.host if self.host is not None else config.host_prior * self.solo_iteration

    def overhead_time(self, config: PredictorConfig) -> float:
        if self.overhead is not None:
            return self.overhead
        return max(config.overhead_floor, config.overhead_prior * self.solo_iteration)

    def work(self, config: PredictorConfig) -> float:
        """Full-batch device seconds on a speed-1 GPU (at least a tenth of the solo iteration)."""
        return max(0.1 * self.solo_iteration, self.solo_iteration - self.host_time(config))

    def host_bound(self) -> bool:
        """Whether the measured host time is as long as the whole solo iteration, which did that host
        work and the device work: the app's CPU is starved (emulated GPUs on a loaded machine: host
        times of 1.3-2.3 s against a solo iteration of 1.0 s). Its work estimate (the solo iteration
        less that host time) is then at its floor, and its chunk times, normalised by a work that
        small, would make its GPU look many times slower than it is."""
        return self.host is not None and self.host >= self.solo_iteration


MIN_SOLO_ITERATION = 1e-9
"""Seconds: the least solo iteration time a model takes (a record's solo-run time over its planned
iterations can be any positive float, or round to 0); every time the model derives from it stays > 0."""

SPEED_BOUNDS = (1e-3, 1e3)
"""The range of a speed learned from one window (relative to the solo run's GPU). A chunk time that
is tiny or huge against the app's work (a legal record: any finite time >= 0) would make a GPU's
speed, which every app's predictions divide by, infinite or zero: a ZeroDivisionError in every
later decision, or kappas driven to their cap."""


SAME_CHUNK_SAMPLES = 1
"""Samples by which two chunks of one iteration may differ for their times to compare the GPUs'
speeds (``Predictor._learn_relative_speeds``): with chunks of equal size the size factor cancels
out, and a chunk one sample larger changes it by about (1 - phi) / B (2% at a batch of 32)."""

SPEED_TOLERANCE = 0.1
"""Two GPUs whose speeds one split app's chunks show within this share of each other count as alike:
one sample of difference between the chunks makes 2%, and real windows are noisier than the
simulator's (emulated GPUs on a loaded CPU); GPUs of different models differ by more."""


def samples(ratio: DataRatio, batch: int) -> tuple[int, ...]:
    """Samples per GPU of a batch split by the DR."""
    return _split(ratio.shares, ratio.total, batch)


@lru_cache(maxsize=65536)
def _split(shares: tuple[int, ...], total: int, batch: int) -> tuple[int, ...]:
    return DataRatio(shares, total).split(batch)


class Predictor:
    """Learns from snapshots (``observe``) and predicts iteration times (``iteration_times``)."""

    def __init__(self, gpu_count: int, config: PredictorConfig | None = None) -> None:
        self.gpu_count = gpu_count
        self.config = config or PredictorConfig()
        self.apps: dict[str, AppModel] = {}
        self.speed = [1.0] * gpu_count
        self._speed_measured = [False] * gpu_count  # learned from an app alone on the GPU with its whole batch
        self._speed_compared = [False] * gpu_count  # learned only against another GPU (``_learn_relative_speeds``)
        # who uses which GPU, as the snapshots showed it: per GPU how often an app arrived on it or left it;
        # per app the GPUs its DR used, how many of those changes it made itself, and what the others had
        # made when it was last learned from (``_quiet_gpus``)
        self._occupancy = [0] * gpu_count
        self._occupants: dict[str, tuple[int, ...]] = {}
        self._own_changes: dict[str, list[int]] = {}
        self._others_at_window: dict[str, tuple[int, ...]] = {}
        # kappa per pair, learned apart in two contexts: False = the two alone on the GPU, True = in
        # a crowd (a third app there too); with running sums for pairs never seen together
        self.kappa: dict[bool, dict[tuple[str, str], float]] = {False: {}, True: {}}
        self._sums = {False: _KappaSums(), True: _KappaSums()}
        self.replica_penalty = 0.0  # rho: iteration time grows by this share per extra replica (``learn_move``)
        self.generation = 0  # moves on whenever anything a prediction reads is learned or forgotten
        self._modelled: dict[str, AppView] = {}  # per app, the view its model was last updated from
        self._placed: dict[str, tuple[DataRatio, int, tuple[int, ...]]] = {}  # per app: DR, batch, GPUs with samples
        # per app and DR (shares, total): its chunks (``chunks``), kept until its model, a GPU's speed
        # or the replica penalty is learned (``_drop_chunks``); what else a prediction reads (kappas,
        # corrections) is not in them
        self._chunks: dict[str, dict[tuple[tuple[int, ...], int], Chunks]] = {}
        # per app, its kappas as ``pair_kappa`` found them, per context ([False] pair, [True] crowd):
        # other app -> kappa. One learned for the pair is kept until the pair's kappa is learned
        # again; one from an estimate or the prior (listed in ``_estimated``) until any kappa is
        # learned (the running sums move): ``_set_kappa``
        self._kappa_rows: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        self._estimated: list[tuple[dict[str, float], str]] = []

    # --- learning ---------------------------------------------------------------------------------
    def forget(self, live: Iterable[str]) -> None:
        """Drop what was learned about apps that are gone."""
        keep = set(live)
        gone: list[str] = [] if keep.issuperset(self.apps) else [name for name in self.apps if name not in keep]
        for name in gone:
            del self.apps[name]
            self._note_occupants(name, ())
            self._own_changes.pop(name, None)
            self._others_at_window.pop(name, None)
            self.generation += 1
            self._drop_chunks(name)
            self._kappa_rows.pop(name, None)
            self._modelled.pop(name, None)
            self._placed.pop(name, None)
        for crowd, learned in self.kappa.items():
            # a context's running sums name every app in a pair it learned: its pairs are walked
            # only when one of those apps is gone
            sums = self._sums[crowd]
            if keep.issuperset(sums.suffered) and keep.issuperset(sums.caused):
                continue
            for pair in [pair for pair in learned if pair[0] not in keep or pair[1] not in keep]:
                self._set_kappa(pair, crowd, None)

    def model(self, view: AppView) -> AppModel:
        model = self.apps.get(view.name)
        batch = _full_batch(view, model)
        solo = max(MIN_SOLO_ITERATION, view.solo_time / max(1, view.iterations_total))
        if model is None:
            model = self.apps[view.name] = AppModel(solo, batch)
            self.generation += 1
            self._drop_chunks(view.name)
        elif model.solo_iteration != solo or model.batch != batch:
            self.generation += 1
            self._drop_chunks(view.name)
        model.solo_iteration, model.batch = solo, batch
        return model

    def observe(self, views: Sequence[AppView], learn_from: Iterable[str] | None = None) -> None:
        """Learn from the apps in ``learn_from`` (default: all) whose record shows a new window,
        and from every app never learned from yet.

        The daemon calls a policy at an app's decision boundary, right after the app published a
        whole window's measurements: learning from that app alone uses every window once.
        """
        seen, apps = self._modelled, self.apps
        wanted = None if learn_from is None else set(learn_from)
        learning = []  # the views to learn from, picked in the same pass (app names are unique)
        for view in views:
            name = view.name
            if seen.get(name) is not view or name not in apps:  # a record read before changes nothing
                self.model(view)
                seen[name] = view
                self._note_occupants(name, view.ratio.used)
            if wanted is None or name in wanted or apps[name].measured_iteration < 0:
                learning.append(view)  # deciding now, or never learned from
        for view in learning:
            model = apps[view.name]
            placement = _measured_samples(view)
            if placement is None or view.iteration == model.measured_iteration:
                continue
            model.measured_iteration = view.iteration
            self.generation += 1  # host, overhead, speeds, kappas, correction
            self._drop_chunks(view.name)  # its host or overhead (a GPU's speed drops every app's)
            others = self._co_runners(view, placement, views)
            quiet = self._quiet_gpus(view.name)
            self._learn_host(view, model, placement)
            if view.solo_measured:  # else its work is a guess: its chunks would teach wrong speeds and kappas
                self._learn_gpus(view, model, placement, others, quiet)
            self._learn_correction(view, model, self._measured_configuration_time(view, model, placement, others))

    def _note_occupants(self, name: str, used: tuple[int, ...]) -> None:
        """The GPUs the app's DR uses now (none: it is gone); each GPU it arrived on or left counts a
        change of that GPU's occupants, made by the app."""
        before = self._occupants.get(name, ())
        if before == used:
            return
        own = self._own_changes.get(name)
        if own is None:
            own = self._own_changes[name] = [0] * self.gpu_count
        for gpu in set(before).symmetric_difference(used):
            if gpu >= self.gpu_count:  # a DR that does not fit this server (the policy refuses it)
                continue
            self._occupancy[gpu] += 1
            own[gpu] += 1
        if used:
            self._occupants[name] = used
        else:
            self._occupants.pop(name, None)

    def _quiet_gpus(self, name: str) -> frozenset[int]:
        """The GPUs on which no other app arrived or left since the app was last learned from (as far
        as the snapshots in between showed): its window there was not shared with an app that came
        or went. Empty at its first window. Notes where the others stand now, for its next window."""
        own = self._own_changes.get(name) or [0] * self.gpu_count
        others = tuple(total - mine for total, mine in zip(self._occupancy, own))
        before = self._others_at_window.get(name)
        self._others_at_window[name] = others
        if before is None:
            return frozenset()
        return frozenset(gpu for gpu, (then, now) in enumerate(zip(before, others)) if then == now)

    def _co_runners(self, view: AppView, placement: Sequence[int],
                    views: Sequence[AppView]) -> dict[int, dict[str, float]]:
        """For each GPU the app used: the other apps there and their duty (measured, else a prior)."""
        used = [g for g, n in enumerate(placement) if n > 0]
        found: dict[int, dict[str, float]] = {g: {} for g in used}
        places = [(gpu, found[gpu]) for gpu in used]
        prior, me = self.config.duty_prior, view.name
        for other in views:
            name = other.name
            if name == me:
                continue
            chunk_seconds, iteration_time = other.chunk_seconds, other.iteration_time
            if chunk_seconds is not None and iteration_time:  # measured
                shares = other.ratio.shares
                for gpu, there in places:
                    seconds = chunk_seconds[gpu]
                    if seconds is not None:
                        there[name] = min(1.0, seconds / iteration_time)
                    elif gpu < len(shares) and shares[gpu] > 0 and gpu in self.gpus_of(name, other.ratio):
                        # moved here since its window: counted as unmeasured (a GPU without a share
                        # never gets samples, so ``gpus_of`` is asked only about one with a share)
                        there[name] = prior
            else:
                shares = other.ratio.shares
                for gpu, there in places:
                    if gpu < len(shares) and shares[gpu] > 0:
                        there[name] = prior
        return found

    def _measured_configuration_time(self, view: AppView, model: AppModel, placement: Sequence[int],
                                     others: Mapping[int, Mapping[str, float]]) -> float:
        """The model's iteration time for the configuration the app was measured in."""
        config = self.config
        work = model.work(config)
        longest = 0.0
        for gpu, duties in others.items():
            stretch = self._stretch(view.name, duties)
            longest = max(longest, work * self.size_factor(placement[gpu], model.batch) / self.speed[gpu] * stretch)
        alone = model.host_time(config) + model.overhead_time(config) * (len(others) - 1) + longest
        return alone * self.replica_factor(len(others))

    def _stretch(self, app: str, duties: Mapping[str, float]) -> float:
        """How much the app's chunk on a GPU stretches beside the other apps there (by name: their
        duty): 1 + the sum of ``pair_kappa`` x duty, in a crowd's context when there are two or more."""
        crowd = len(duties) > 1
        return 1.0 + sum(self.pair_kappa(app, other, crowd) * duty for other, duty in duties.items())

    def _learn_host(self, view: AppView, model: AppModel, placement: Sequence[int]) -> None:
        config = self.config
        longest = max(s for s in view.chunk_seconds if s is not None)
        host = max(0.0, view.iteration_time - longest)
        used = sum(1 for n in placement if n > 0)
        if used == 1:
            model.host = _blend(model.host, host, config.smoothing)
        else:
            per_replica = max(0.0, (host - model.host_time(config)) / (used - 1))
            model.overhead = _blend(model.overhead, per_replica, config.smoothing)

    def _learn_gpus(self, view: AppView, model: AppModel, placement: Sequence[int],
                    co_runners: Mapping[int, Mapping[str, float]], quiet: frozenset[int] = frozenset()) -> None:
        """GPU speeds and kappas from the window's chunk times, normalised by the app's work. No
        speed from a host-bound app: on emulated GPUs on a starved CPU its chunks put every GPU's
        speed at 0.07-0.13, and every prediction with them."""
        config = self.config
        work = model.work(config)
        used = list(co_runners)
        if len(used) > 1 and not model.host_bound():
            self._learn_relative_speeds(view, model.batch, placement, co_runners, quiet)
        for gpu in used:
            seconds = view.chunk_seconds[gpu]
            if not seconds:
                continue
            others = co_runners[gpu]
            unstretched = work * self.size_factor(placement[gpu], model.batch)
            if not others:
                if len(used) == 1 and not model.host_bound():  # alone with the whole batch: this GPU's speed
                    known = self.speed[gpu] if self._speed_measured[gpu] else None
                    measured = min(SPEED_BOUNDS[1], max(SPEED_BOUNDS[0], unstretched / seconds))
                    self._set_speed(gpu, _blend(known, measured, config.smoothing))
                    self._speed_measured[gpu] = True
                continue
            stretch = seconds * self.speed[gpu] / unstretched - 1.0
            crowd = len(others) > 1
            predicted = sum(self.pair_kappa(view.name, name, crowd) * duty for name, duty in others.items())
            norm = sum(duty * duty for duty in others.values()) + 1e-3
            step = config.interference_step * (stretch - predicted) / norm
            for name, duty in others.items():
                value = self.pair_kappa(view.name, name, crowd) + step * duty
                self._set_kappa((view.name, name), crowd, min(10.0, max(0.0, value)))

    def _learn_relative_speeds(self, view: AppView, batch: int, placement: Sequence[int],
                               co_runners: Mapping[int, Mapping[str, float]], quiet: frozenset[int]) -> None:
        """Speeds of GPUs never measured alone, from an app split over several GPUs that it has to
        itself, against one of them whose speed was measured alone: chunks of one iteration with the
        same number of samples (within ``SAME_CHUNK_SAMPLES``) take times inversely proportional to
        their GPUs' speeds, whatever the app's work and the size factor's ``phi``. Only GPUs on which
        no other app arrived or left during the window (``quiet``: a chunk stretched by an app that
        has since left can make a GPU of a uniform server look 14% slower) and that no other app's DR
        uses now, and the first time only where the chunks show the two GPUs' speeds apart by more
        than ``SPEED_TOLERANCE`` (a speed measured alone carries the error of the app's host-time
        estimate, up to 13% in a uniform server: GPUs shown to be alike keep what they had rather
        than take on the reference's error). Once compared, every such window counts (blended), so
        a speed learned from one bad window moves back.

        Without this, a GPU that no app has alone is never learned: a job split 5:5 over a
        full-speed and a half-speed GPU runs 31% slower than predicted, the per-app correction
        takes the miss for the whole app, the single GPU it could consolidate onto is predicted
        25% slower than it is, and the split stays to the end."""
        alone = [gpu for gpu, others in co_runners.items()  # no other app measured there
                 if not others and gpu in quiet and view.chunk_seconds[gpu] and placement[gpu] > 0]
        if len(alone) < 2:  # most split windows in a crowd; before the claims, a pass over every app
            return
        claimed = {gpu for name, gpus in self._occupants.items() if name != view.name for gpu in gpus}
        alone = [gpu for gpu in alone if gpu not in claimed]  # nor another app sent there since
        references = [gpu for gpu in alone if self._speed_measured[gpu]]
        if not references or len(alone) < 2:
            return
        reference = max(references, key=lambda gpu: (placement[gpu], -gpu))  # the largest chunk, then the lowest index
        size, seconds = placement[reference], view.chunk_seconds[reference]
        for gpu in alone:
            if self._speed_measured[gpu] or abs(placement[gpu] - size) > SAME_CHUNK_SAMPLES:
                continue
            relative = (seconds / view.chunk_seconds[gpu]) * (
                self.size_factor(placement[gpu], batch) / self.size_factor(size, batch))
            if abs(relative - 1.0) <= SPEED_TOLERANCE and not self._speed_compared[gpu]:
                continue  # as fast as the reference, within the noise of one window: nothing new
            measured = min(SPEED_BOUNDS[1], max(SPEED_BOUNDS[0], self.speed[reference] * relative))
            known = self.speed[gpu] if self._speed_compared[gpu] else None
            self._set_speed(gpu, _blend(known, measured, self.config.smoothing))
            self._speed_compared[gpu] = True

    def _set_speed(self, gpu: int, speed: float) -> None:
        """A GPU's learned speed (every app's chunks there change)."""
        self.speed[gpu] = speed
        self._drop_chunks()

    def _set_kappa(self, pair: tuple[str, str], crowd: bool, value: float | None) -> None:
        """Set (or with None forget) one pair's kappa in one context, keeping the running sums in step."""
        self.generation += 1
        old = self.kappa[crowd].pop(pair, None)
        if old is not None:
            self._sums[crowd].remove(pair, old)
        if value is not None:
            self.kappa[crowd][pair] = value
            self._sums[crowd].add(pair, value)
        # the kept kappas this can move: the pair's own (both contexts), every estimate and prior
        rows = self._kappa_rows.get(pair[0])
        if rows is not None:
            for row in rows:
                row.pop(pair[1], None)
        for row, other in self._estimated:
            row.pop(other, None)
        self._estimated.clear()

    def _learn_correction(self, view: AppView, model: AppModel, predicted: float) -> None:
        if predicted > 0:
            low, high = self.config.correction_bounds
            ratio = min(high, max(low, view.iteration_time / predicted))
            model.correction = _blend(model.correction, ratio, self.config.smoothing)

    def replica_factor(self, replicas: int) -> float:
        """The iteration time's factor for an app with this many replicas: 1 + rho per extra one."""
        return 1.0 + self.replica_penalty * max(0, replicas - 1)

    def gpus_of(self, name: str, ratio: DataRatio) -> tuple[int, ...]:
        """The GPUs that get samples of the app's batch under ``ratio`` (a small share of a small
        batch can round to none, so these can be fewer than the DR's nonzero shares)."""
        return _used(ratio.shares, ratio.total, self.apps[name].batch)

    def replicas(self, name: str, ratio: DataRatio) -> int:
        """How many replicas the app runs under ``ratio``: ``len(gpus_of(...))``."""
        return len(self.gpus_of(name, ratio))

    def learn_move(self, replicas_before: int, replicas_after: int, measured: float, predicted: float) -> None:
        """Correct the replica penalty rho from a move measured for a whole window (seconds per
        iteration, measured and as predicted before the move): a move that added replicas and was
        slower than predicted, or took replicas away and was faster, raises it; the reverse lowers
        it: rho += ``replica_penalty_step`` x (measured / predicted - 1) / (replicas after -
        replicas before), kept within 0..``replica_penalty_max``. A move that kept the replica
        count, or with no measurement, teaches nothing here."""
        changed = replicas_after - replicas_before
        if not changed or not predicted > 0 or not measured > 0:
            return
        step = self.config.replica_penalty_step * (measured / predicted - 1.0) / changed
        learned = min(self.config.replica_penalty_max, max(0.0, self.replica_penalty + step))
        if learned != self.replica_penalty:
            self.replica_penalty = learned
            self.generation += 1
            self._drop_chunks()

    def measured_together(self, app: str, other: str) -> bool:
        """Whether ``app``'s kappa with ``other`` was learned from measurements, alone together or
        in a crowd; if not, ``pair_kappa`` is an estimate or the prior."""
        pair = (app, other)
        return pair in self.kappa[False] or pair in self.kappa[True]

    def pair_kappa(self, app: str, other: str, crowd: bool = False) -> float:
        """How much ``app``'s chunk stretches per unit of ``other``'s duty on the same GPU, the two
        alone there (``crowd`` False) or with a third app (True).

        The additive model is not exact, so kappas are learned apart in the two contexts: in
        scenario (a) from spread, kappas learned with all six apps on every GPU are about 0.9
        where the same pairs alone together measure 0.6, and pairs predicted from the crowd's
        values put every swap out of reach. What a pair showed alone together is the best
        knowledge of it in either context; a kappa learned in a crowd comes next for a crowd, and
        for a pair only after an estimate from the kappas learned in pairs. An estimate for a
        pair never seen together is the app's mean sensitivity times the other's mean
        aggressiveness over the mean; with nothing learned, ``interference_prior``.

        Kept per app in ``kappa_rows`` until what it depends on is learned (``_set_kappa``).
        """
        row = self.kappa_rows(app)[1 if crowd else 0]
        found = row.get(other)
        if found is None:
            found = row[other] = self._look_up_kappa(app, other, crowd)
        return found

    def kappa_rows(self, app: str) -> tuple[dict[str, float], dict[str, float]]:
        """The app's kappas found so far, per context ([False]: alone together with the other app,
        [True]: in a crowd): other app -> ``pair_kappa``. Read them, never change them; a pair not
        there yet is found by ``pair_kappa``."""
        rows = self._kappa_rows.get(app)
        if rows is None:
            rows = self._kappa_rows[app] = ({}, {})
        return rows

    def _look_up_kappa(self, app: str, other: str, crowd: bool) -> float:
        """``pair_kappa`` from what is learned; one from an estimate or the prior is listed in
        ``_estimated`` (the caller keeps it in ``kappa_rows``)."""
        pair = (app, other)
        learned, sums = self.kappa, self._sums
        found = learned[False].get(pair)
        if found is None and crowd:
            found = learned[True].get(pair)
        if found is not None:
            return found  # learned for the pair: moves only when the pair is learned
        if crowd:
            found = sums[False].estimate(app, other)
        else:
            found = sums[False].estimate(app, other)
            if found is None:  # (and only then) the pair's kappa learned in a crowd
                found = learned[True].get(pair)
        if found is None:
            found = sums[True].estimate(app, other)
        self._estimated.append((self.kappa_rows(app)[1 if crowd else 0], other))
        return self.config.interference_prior if found is None else found

    def solo_estimate(self, name: str) -> float | None:
        """The app's solo iteration (seconds of one iteration alone on one GPU of speed 1) from its
        last window: its host time (the iteration less its longest chunk and its measured replica
        overhead) plus its chunks' device time with what slowed them taken out: the other apps'
        duties there times ``pair_kappa`` (for an app whose solo time is not measured,
        ``AppView.solo_measured``, that comes from other apps' pairs: it learns no kappa of its
        own), the GPU's speed and the chunk's size; the median over its GPUs. None before a window."""
        view, model = self._modelled.get(name), self.apps.get(name)
        placement = None if view is None else _measured_samples(view)
        if placement is None or model is None:
            return None
        others = self._co_runners(view, placement, tuple(self._modelled.values()))
        works = []
        for gpu, duties in others.items():
            seconds = view.chunk_seconds[gpu]
            if seconds:
                stretch = self._stretch(name, duties)
                works.append(seconds * self.speed[gpu] / (self.size_factor(placement[gpu], model.batch) * stretch))
        if not works:
            return None
        longest = max(seconds for seconds in view.chunk_seconds if seconds is not None)
        host = view.iteration_time - longest - (len(others) - 1) * (model.overhead or 0.0)
        return max(0.0, host) + statistics.median(works)

    # --- prediction -------------------------------------------------------------------------------
    def chunks(self, name: str, ratio: DataRatio) -> Chunks:
        """The app's chunks under ``ratio`` alone, and its seconds per iteration outside them; kept
        until the app's model, a GPU's speed or the replica penalty is learned."""
        kept = self._chunks.get(name)
        if kept is None:
            kept = self._chunks[name] = {}
        key = (ratio.shares, ratio.total)
        found = kept.get(key)
        if found is None:
            found = kept[key] = self._chunks_of(self.apps[name], ratio)
        return found

    def _chunks_of(self, model: AppModel, ratio: DataRatio) -> Chunks:
        """``chunks``, computed."""
        config, speed, batch = self.config, self.speed, model.batch
        work, host, overhead = model.work(config), model.host_time(config), model.overhead_time(config)
        gpus, factors = _size_factors(ratio.shares, ratio.total, batch, config.fixed_fraction)
        placed = []
        longest = None
        for g, factor in zip(gpus, factors):
            seconds = work * factor / speed[g]  # work * size_factor(n, batch) / speed[g]
            placed.append((g, seconds))
            if longest is None or seconds > longest:  # as max() keeps the first largest
                longest = seconds
        fixed = host + overhead * (len(placed) - 1)
        if len(placed) > 1 and self.replica_penalty:  # every part grows by the replica factor
            factor = self.replica_factor(len(placed))
            placed = [(g, seconds * factor) for g, seconds in placed]
            fixed *= factor
            longest *= factor
        return Chunks(tuple(placed), fixed, fixed + (0.0 if longest is None else longest), gpus)

    def _drop_chunks(self, name: str | None = None) -> None:
        """Forget the kept chunks of an app whose model changed (of every app: None)."""
        if name is None:
            self._chunks.clear()
        else:
            self._chunks.pop(name, None)

    def size_factor(self, size: float, batch: int) -> float:
        """Device time of a chunk of ``size`` samples as a share of the full batch's."""
        phi = self.config.fixed_fraction
        return phi + (1.0 - phi) * size / max(1, batch) if size > 0 else 0.0

    def neighbourhood(self, ratios: Mapping[str, DataRatio], views: Mapping[str, AppView]) -> Neighbourhood:
        """What-if evaluations around the configuration ``ratios`` (see ``Neighbourhood``)."""
        return Neighbourhood(self, ratios, views)

    def iteration_times(self, ratios: Mapping[str, DataRatio], views: Mapping[str, AppView]) -> dict[str, float]:
        """Predicted seconds per iteration of every app if each used the DR given for it."""
        return self.neighbourhood(ratios, views).solve(list(ratios), {})


class _KappaSums:
    """Running sums of a set of learned kappas, for estimating pairs never seen together."""

    def __init__(self) -> None:
        self.suffered: dict[str, list[float]] = {}  # per app: kappa it suffered (sum, count)
        self.caused: dict[str, list[float]] = {}  # per app: kappa it caused (sum, count)
        self.total = 0.0
        self.count = 0

    def add(self, pair: tuple[str, str], value: float) -> None:
        self._change(pair, value, 1)

    def remove(self, pair: tuple[str, str], value: float) -> None:
        self._change(pair, -value, -1)

    def _change(self, pair: tuple[str, str], value: float, count: int) -> None:
        for table, name in ((self.suffered, pair[0]), (self.caused, pair[1])):
            entry = table.setdefault(name, [0.0, 0])
            entry[0] += value
            entry[1] += count
            if entry[1] == 0:
                del table[name]
        self.total += value
        self.count += count

    def estimate(self, app: str, other: str) -> float | None:
        """Sensitivity of ``app`` times aggressiveness of ``other`` over the mean (None: nothing learned)."""
        if self.count == 0:
            return None
        overall = self.total / self.count
        if overall <= 0:
            return 0.0
        suffered, caused = self.suffered.get(app), self.caused.get(other)
        sensitivity = suffered[0] / suffered[1] if suffered else overall
        aggressiveness = caused[0] / caused[1] if caused else overall
        return sensitivity * aggressiveness / overall


class Chunks(NamedTuple):
    """An app's iteration under one DR before any sharing: ``placed`` its chunks as (GPU, seconds
    alone on it), ``fixed`` its seconds outside them (host time and the replicas' overhead),
    ``alone`` the iteration's seconds (fixed + its longest chunk), ``gpus`` the GPUs it uses.
    The predictor keeps them and hands the same ones out again: read them, never change them."""

    placed: tuple[tuple[int, float], ...]
    fixed: float
    alone: float
    gpus: tuple[int, ...]


class Neighbourhood:
    """Predicted iteration times for changes around one configuration, solved locally.

    A change of some apps' DRs affects those apps and the apps sharing a GPU with them (before or
    after); only those are solved (a fixed point: duties depend on the times they stretch). An
    app outside that set counts on the GPUs it shares with the set by its measured duty (chunk
    time over iteration time; a prior before it is measured). Comparing the affected apps before
    and after a change is then cheap, whatever the number of apps.

    What does not depend on the change (measured duties, outside terms, the solution without a
    change for a set of apps) is computed once and kept until the predictor learns something
    (its ``generation`` moves on): then all but the configuration (``ratios``, ``on_gpu``,
    measured duties, as at construction) is computed afresh. Each app's chunks under a DR and
    the pair kappas in both contexts are kept by the predictor itself, from one decision to the
    next, until what each depends on is learned (``Predictor.chunks``, ``Predictor.pair_kappa``).
    """

    ROUNDS = 3
    DENSE_PARTNERS = 2500
    """Pairs (chunk, chunk of another app of the set on its GPU) from which ``solve`` goes through
    ``_solve_dense``: a crowd, where the rounds in Python cost O(apps^2 x GPUs) per candidate."""

    def __init__(self, predictor: Predictor, ratios: Mapping[str, DataRatio], views: Mapping[str, AppView]) -> None:
        self.predictor = predictor
        self.views = views
        self.ratios: dict[str, DataRatio] = {}
        self.on_gpu: list[list[str]] = [[] for _ in range(predictor.gpu_count)]
        mine, on_gpu, apps, placed = self.ratios, self.on_gpu, predictor.apps, predictor._placed
        for name, ratio in ratios.items():
            model = apps.get(name)
            if model is not None:
                mine[name] = ratio
                known = placed.get(name)  # the same DR object as at the last decision: the same GPUs
                if known is not None and known[0] is ratio and known[1] == model.batch:
                    gpus = known[2]
                else:
                    gpus = _used(ratio.shares, ratio.total, model.batch)  # as Predictor.gpus_of
                    placed[name] = (ratio, model.batch, gpus)
                for gpu in gpus:
                    on_gpu[gpu].append(name)
        self._duty: dict[tuple[str, int], float] = {}
        # what depends on what the predictor learned, kept while it learns nothing (``_renew``)
        self._generation = predictor.generation
        self._terms: dict[tuple[str, int, bool], list[tuple[str, float]]] = {}
        self._alone: dict[tuple[str, int], float] = {}  # a chunk's stretch with the app alone in the set
        self._current: dict[str, Chunks] = {}  # chunks under the current DRs
        self._unchanged: dict[tuple[str, ...], dict[str, float]] = {}
        self._kappas: dict[tuple[tuple[str, ...], bool], np.ndarray] = {}  # ``_kappa_matrix``

    def measured_duty(self, name: str, gpu: int) -> float:
        """The share of time the app keeps ``gpu`` busy in its current configuration: its measured
        chunk time there over its iteration time (``duty_prior`` before it is measured)."""
        key = (name, gpu)
        value = self._duty.get(key)
        if value is None:
            view = self.views.get(name)
            seconds = view.chunk_seconds if view is not None else None
            measured = seconds[gpu] if seconds is not None and view.iteration_time else None
            value = min(1.0, measured / view.iteration_time) if measured else self.predictor.config.duty_prior
            self._duty[key] = value
        return value

    def kappa(self, app: str, other: str, crowd: bool = False) -> float:
        """``Predictor.pair_kappa`` in either context (which the predictor keeps)."""
        return self.predictor.pair_kappa(app, other, crowd)

    def _outside_terms(self, name: str, gpu: int, crowd: bool) -> list[tuple[str, float]]:
        """Per app of the current configuration on ``gpu`` (but ``name``): how much it stretches
        ``name``'s chunk there while it counts by its measured duty (kappa x duty), the kappas of
        a crowd or of a pair as ``crowd`` says."""
        key = (name, gpu, crowd)
        terms = self._terms.get(key)
        if terms is None:
            terms = self._terms[key] = [(other, self.kappa(name, other, crowd) * self.measured_duty(other, gpu))
                                        for other in self.on_gpu[gpu] if other != name]
        return terms

    def _outside_alone(self, name: str, gpu: int) -> float:
        """The stretch of ``name``'s chunk on ``gpu`` when it is the only app of the set solved:
        1 plus every other current occupant's term (in a crowd if there are two or more)."""
        crowd = sum(1 for other in self.on_gpu[gpu] if other != name) >= 2
        outside = 1.0
        for _, term in self._outside_terms(name, gpu, crowd):
            outside += term
        self._alone[(name, gpu)] = outside
        return outside

    def _renew(self) -> None:
        """Forget every value that depends on what the predictor learned (it learned since)."""
        self._generation = self.predictor.generation
        for cache in (self._terms, self._alone, self._current, self._unchanged, self._kappas):
            cache.clear()

    def affected(self, changes: Mapping[str, DataRatio]) -> list[str]:
        """The changed apps and every app on a GPU they use before or after the change."""
        if self._generation != self.predictor.generation:
            self._renew()
        gpus: set[int] = set()
        for name, ratio in changes.items():
            gpus.update(self.chunks(name, ratio).gpus)  # the GPUs that get samples
            if name in self.ratios:
                gpus.update(self._current_chunks(name).gpus)
        names = set(changes)
        for gpu in gpus:
            names.update(self.on_gpu[gpu])
        return sorted(names)

    def compare(self, changes: Mapping[str, DataRatio]) -> tuple[Mapping[str, float], dict[str, float]]:
        """Predicted (corrected) times of the affected apps without and with the change. The times
        without it are the neighbourhood's own map, the same object for the same affected apps
        (so a search can key on it): read it, never change it."""
        names = self.affected(changes)
        self.solve(names, {})  # solved or found, and kept in ``_unchanged``
        return self._unchanged[tuple(names)], self.solve(names, changes)

    def chunks(self, name: str, ratio: DataRatio) -> Chunks:
        """The app's chunks under ``ratio`` alone, and its seconds per iteration outside them
        (``Predictor.chunks``)."""
        return self.predictor.chunks(name, ratio)

    def _current_chunks(self, name: str) -> Chunks:
        found = self._current.get(name)
        if found is None:
            found = self._current[name] = self.chunks(name, self.ratios[name])
        return found

    def solve(self, names: Sequence[str], changes: Mapping[str, DataRatio]) -> dict[str, float]:
        """Predicted (corrected) seconds per iteration of ``names`` with ``changes`` applied."""
        if self._generation != self.predictor.generation:
            self._renew()
        unchanged = None
        if not changes:
            unchanged = tuple(names)
            found = self._unchanged.get(unchanged)
            if found is not None:
                return dict(found)
        apps = self.predictor.apps
        current = self._current
        if len(names) == 1 and self.ROUNDS >= 1:
            return self._solve_one(names[0], changes)
        index: dict[str, int] = {}
        chunks: list[tuple[tuple[int, float], ...]] = []
        fixed: list[float] = []
        times: list[float] = []  # before the first round: every chunk alone
        inside_on: dict[int, list[tuple[str, int, int]]] = {}  # per GPU: (app, its index, chunk number)
        slots = 0
        for position, name in enumerate(names):
            index[name] = position
            ratio = changes.get(name) if changes else None
            if ratio is None:
                found = current.get(name) or self._current_chunks(name)
            else:
                found = self.chunks(name, ratio)
            chunks.append(found.placed)
            fixed.append(found.fixed)
            times.append(found.alone)
            for gpu in found.gpus:  # the GPUs of ``found.placed``, in its order
                entry = inside_on.get(gpu)
                if entry is None:
                    entry = inside_on[gpu] = []
                entry.append((name, position, slots))
                slots += 1
        if sum(len(here) * (len(here) - 1) for here in inside_on.values()) >= self.DENSE_PARTNERS:
            result = self._solve_dense(names, index, chunks, fixed, times, inside_on)
            if unchanged is not None:
                self._unchanged[unchanged] = dict(result)
            return result
        # per GPU the set uses: the apps there now that are not in the set (they count by their
        # measured duty), and whether an app there is in a crowd (it and two others or more, of the
        # set or staying put), which picks the kappas (``Predictor.pair_kappa``)
        on_gpu = self.on_gpu
        shared: dict[int, tuple[list[tuple[str, int, int]], bool, int]] = {}  # per GPU: the set there, crowd, strangers
        for gpu, here in inside_on.items():
            outside_set = 0
            for other in on_gpu[gpu]:
                if other not in index:
                    outside_set += 1
            shared[gpu] = (here, len(here) + outside_set > 2, outside_set)
        # per chunk: the stretch from apps outside the set (fixed) and (kappa, chunk, app) of those
        # inside; chunks in the order of ``names`` then GPUs, refined in place (Gauss-Seidel). A
        # chunk with no app of the set beside it keeps its first value: it is left out of the rounds
        coupled_plans = []
        stretched: list[float] = []
        base = [0.0] * len(times)  # per app: its longest chunk that no other app of the set shares
        all_terms, kappa_rows, pair_kappa = self._terms, self.predictor.kappa_rows, self.predictor.pair_kappa
        number = -1
        for position, name in enumerate(names):
            rows = kappa_rows(name)
            for gpu, chunk in chunks[position]:
                number += 1
                here, crowd, strangers = shared[gpu]
                outside = 1.0
                if strangers:
                    terms = all_terms.get((name, gpu, crowd))
                    if terms is None:
                        terms = self._outside_terms(name, gpu, crowd)
                    for other, term in terms:
                        if other not in index:
                            outside += term
                stretched.append(chunk)
                if len(here) == 1:
                    value = chunk * outside
                    if value > base[position]:
                        base[position] = value
                    continue
                partners = []
                row = rows[crowd]
                for other, where, slot in here:
                    if other != name:
                        factor = row.get(other)
                        if factor is None:  # not found yet: found and kept in the row
                            factor = pair_kappa(name, other, crowd)
                        partners.append((factor, slot, where))
                coupled_plans.append((number, position, chunk, outside, partners))
        if not coupled_plans and self.ROUNDS:  # no two apps of the set share a GPU: one round is all
            times = list(map(add, fixed, base))
        for _ in range(self.ROUNDS if coupled_plans else 0):
            longest = base[:]
            for number, position, chunk, outside, partners in coupled_plans:
                stretch = outside
                for factor, key, other in partners:
                    share = stretched[key] / times[other]
                    stretch += factor * (share if share < 1.0 else 1.0)
                value = chunk * stretch
                stretched[number] = value
                if value > longest[position]:
                    longest[position] = value
            times = list(map(add, fixed, longest))
        result = {name: seconds * apps[name].correction for name, seconds in zip(names, times)}
        if unchanged is not None:
            self._unchanged[unchanged] = dict(result)
        return result

    def _outside_stretch(self, name: str, gpu: int, crowd: bool, index: Mapping[str, int]) -> float:
        """1 plus the terms of the apps on ``gpu`` outside the set ``index`` (in ``on_gpu`` order)."""
        terms = self._terms.get((name, gpu, crowd))
        if terms is None:
            terms = self._outside_terms(name, gpu, crowd)
        outside = 1.0
        for other, term in terms:
            if other not in index:
                outside += term
        return outside

    def _kappa_matrix(self, names: Sequence[str], crowd: bool) -> np.ndarray:
        """``pair_kappa`` of every ordered pair of ``names`` in one context, as a matrix [app, other]
        (the diagonal is never read); kept per set until the predictor learns something."""
        key = (tuple(names), crowd)
        found = self._kappas.get(key)
        if found is None:
            kappa_rows, pair_kappa = self.predictor.kappa_rows, self.predictor.pair_kappa
            rows = []
            for name in names:
                row = kappa_rows(name)[crowd]
                rows.append([row[other] if other in row else pair_kappa(name, other, crowd) for other in names])
            found = self._kappas[key] = np.array(rows, dtype=float)
        return found

    def _solve_dense(self, names: Sequence[str], index: Mapping[str, int],
                     chunks: Sequence[tuple[tuple[int, float], ...]], fixed: Sequence[float],
                     alone: Sequence[float], inside_on: Mapping[int, list[tuple[str, int, int]]]) -> dict[str, float]:
        """``solve``'s rounds with numpy, for a crowd: the same operations on the same values in the
        same order, so the same floats to the last bit (what a decision compares must not depend
        on which path solved it).

        The chunks are a matrix [app, GPU]. A chunk's partners are the apps of the set on its GPU,
        which a round of ``solve`` visits in the order of ``names`` (Gauss-Seidel: an app earlier
        in the set counts by its stretched chunk of this round, a later one by the last round's),
        so the rounds go app by app, each over all GPUs at once. Its stretch is summed as ``solve``
        sums it: its outside term, then each partner's term in the order of the set, an app not
        on the GPU adding an exact 0 (``np.add.accumulate`` adds row after row; ``np.add.reduce``
        may add in pairs).
        """
        count, gpus = len(names), self.predictor.gpu_count
        chunk = np.zeros((count, gpus))
        present = np.zeros((count, gpus), dtype=bool)
        for position, placed in enumerate(chunks):
            for gpu, seconds in placed:
                chunk[position, gpu] = seconds
                present[position, gpu] = True
        members = present.sum(axis=0)
        outside = np.ones((count, gpus))
        crowd = np.zeros(gpus, dtype=bool)
        for gpu, here in inside_on.items():
            strangers = sum(1 for other in self.on_gpu[gpu] if other not in index)
            crowd[gpu] = len(here) + strangers > 2
            if strangers:
                for name, position, _ in here:
                    outside[position, gpu] = self._outside_stretch(name, gpu, bool(crowd[gpu]), index)
        coupled = present & (members >= 2)
        base = np.fmax.reduce(np.where(present & ~coupled, chunk * outside, 0.0), axis=1, initial=0.0)
        fixed_seconds = np.array(fixed, dtype=float)
        times = np.array(alone, dtype=float)
        rows = [position for position in range(count) if coupled[position].any()]
        if not rows and self.ROUNDS:  # as ``solve``: one round is all
            times = fixed_seconds + base
        else:
            weights = self._partner_weights(names, present, coupled, crowd)
            times = self._dense_rounds(rows, chunk, coupled, outside, weights, base, fixed_seconds, times)
        apps = self.predictor.apps
        return {name: float(seconds) * apps[name].correction for name, seconds in zip(names, times)}

    def _partner_weights(self, names: Sequence[str], present: np.ndarray, coupled: np.ndarray,
                         crowd: np.ndarray) -> np.ndarray:
        """[app, partner, GPU]: the kappa by which the partner's share of ``app``'s chunk on the GPU
        counts, in that GPU's context; exactly 0 where either is not there, and for the app itself."""
        used = coupled.any(axis=0)
        contexts = {bool(value) for value in crowd[used]}
        if len(contexts) == 1:
            kappas = self._kappa_matrix(names, contexts.pop())[:, :, None]
        else:
            kappas = np.where(crowd[None, None, :], self._kappa_matrix(names, True)[:, :, None],
                              self._kappa_matrix(names, False)[:, :, None])
        together = coupled[:, None, :] & present[None, :, :]
        together[np.arange(len(names)), np.arange(len(names)), :] = False
        return np.where(together, kappas, 0.0)

    def _dense_rounds(self, rows: Sequence[int], chunk: np.ndarray, coupled: np.ndarray, outside: np.ndarray,
                      weights: np.ndarray, base: np.ndarray, fixed: np.ndarray, times: np.ndarray) -> np.ndarray:
        """``solve``'s rounds over the apps ``rows`` (those with a chunk beside another of the set);
        seconds per iteration of every app after the last round.

        A partner's share is its stretched chunk over its iteration time, at most 1: ``np.fmin``
        gives 1 for a NaN as ``solve``'s ``share if share < 1.0 else 1.0`` does, so every share is
        finite and a weight of exactly 0 (no chunk there, or the app itself) adds exactly 0."""
        stretched = chunk.copy()
        count, gpus = chunk.shape
        terms = np.empty((count + 1, gpus))
        sums = np.empty((count + 1, gpus))
        columns = {position: np.flatnonzero(coupled[position]) for position in rows}
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for _ in range(self.ROUNDS):
                longest = base.copy()
                share = np.fmin(stretched / times[:, None], 1.0)
                for position in rows:
                    mine = columns[position]
                    terms[0] = outside[position]
                    np.multiply(weights[position], share, out=terms[1:])
                    np.add.accumulate(terms, axis=0, out=sums)
                    value = chunk[position, mine] * sums[-1, mine]
                    stretched[position, mine] = value
                    np.fmin(stretched[position] / times[position], 1.0, out=share[position])
                    largest = np.fmax.reduce(value)
                    if largest > longest[position]:
                        longest[position] = largest
                times = fixed + longest
        return times

    def _solve_one(self, name: str, changes: Mapping[str, DataRatio]) -> dict[str, float]:
        """``solve`` of a single app, written out: it shares no GPU with another app of the set,
        so one round is the fixed point (the same operations in the same order)."""
        ratio = changes.get(name) if changes else None
        found = self._current.get(name) or self._current_chunks(name) if ratio is None else self.chunks(name, ratio)
        longest = 0.0
        alone = self._alone
        for gpu, chunk in found.placed:
            outside = alone.get((name, gpu))
            if outside is None:
                outside = self._outside_alone(name, gpu)
            value = chunk * outside
            if value > longest:
                longest = value
        result = {name: (found.fixed + longest) * self.predictor.apps[name].correction}
        if not changes:
            self._unchanged[(name,)] = dict(result)
        return result


@lru_cache(maxsize=65536)
def _size_factors(shares: tuple[int, ...], total: int, batch: int,
                  phi: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The GPUs that get samples of a batch split by these shares, and each chunk's device time
    as a share of the full batch's (``Predictor.size_factor`` with this ``phi``)."""
    gpus, factors = [], []
    for gpu, size in enumerate(_split(shares, total, batch)):
        if size:
            gpus.append(gpu)
            factors.append(phi + (1.0 - phi) * size / max(1, batch) if size > 0 else 0.0)
    return tuple(gpus), tuple(factors)


@lru_cache(maxsize=65536)
def _used(shares: tuple[int, ...], total: int, batch: int) -> tuple[int, ...]:
    """The GPUs that get at least one sample of a batch split by these shares."""
    return tuple(gpu for gpu, size in enumerate(_split(shares, total, batch)) if size)


def _full_batch(view: AppView, model: AppModel | None) -> int:
    """The app's mini-batch (samples), as its window's chunks ran it.

    The record's ``batch`` is the samples of the app's last forward: at an epoch's end without
    ``drop_last`` that is the epoch's partial last batch, while its chunk means are over a window of
    full batches. Taken as the batch, it would make each chunk look several times the batch (a
    31.2-sample chunk of a batch of 8) and the GPU as many times faster, for every app. So a batch smaller than
    the one known for the app, with a window of more samples, is a partial one (the known batch
    stands), and no batch is smaller than a chunk of the window (a chunk is never larger than its
    batch). A window's chunks within the record's batch leave it as it is.
    """
    batch = view.batch or 1
    measured = view.chunk_samples
    if not measured:
        return batch
    if model is not None and batch < model.batch and sum(measured) > batch:
        batch = model.batch
    largest = max(measured)
    if largest > batch and math.isfinite(largest):
        batch = math.ceil(largest)
    return batch


def _measured_samples(view: AppView) -> tuple[int, ...] | None:
    """Samples per GPU in the app's measured window, or None without a usable measurement."""
    if view.chunk_seconds is None or view.chunk_samples is None or not view.iteration_time:
        return None
    sizes = tuple(int(round(n)) if s is not None else 0 for s, n in zip(view.chunk_seconds, view.chunk_samples))
    return sizes if any(sizes) else None


def _blend(old: float | None, new: float, weight: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1.0 - weight) * old + weight * new
