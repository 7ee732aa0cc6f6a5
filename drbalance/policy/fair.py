"""``fair``: predict every app's slow-down under candidate DRs and pick the change that lowers the
largest predicted SD at finish (then the mean), with rules against thrashing (docs/policy.md).

The policy keeps state between decisions (what it learned, when it last moved each app, moves it
still owes other apps); it sees only snapshots, as every policy does. At app i's registration it
moves i whole onto an idle GPU if i's DR shares a GPU with another app and every other app has
run for a while (branch ``place``; ``_place_newcomer``); else i keeps its DR until it has
measured a window. At app i's decision:

1. Learn from the snapshot (``Predictor.observe``).
2. If i's last move has now been measured for a whole decision window and for at least
   ``judge_iterations`` of i's iterations (else branch ``measuring``: i stays put, and the move
   is judged later on the mean of the windows since it), check it: a move that
   changed i's replica count corrects the predictor's replica penalty by how far the measured
   iteration time missed the predicted one (``Predictor.learn_move``); the corrected predictor
   compares i's current DR with the one before the move; a move that made things worse by at
   least ``min_gain`` is undone (branch ``revert``) and that DR is not tried again for
   ``ban_windows`` windows; a move of i alone between GPUs nobody else uses is undone on its own
   measurements once they show a loss of ``idle_tolerance``.
3. Otherwise, unless i is protected (moved less than ``protect_windows`` windows ago) or has
   used its ``max_moves_per_epoch``: if i's solo time is still an upper bound and i is split,
   i goes whole onto one of its GPUs that nobody else uses, once, to measure it (branch
   ``measure-solo``; ``_measure_solo``). Else candidates are scored: i consolidated onto one GPU, a share
   (half or all of it) moved between two GPUs (which also takes a replica away), i's DR swapped
   with another app's (the other app's half is pushed to it at once), i and an app split over
   the same two GPUs as i each put on one of them (``untangle_pairs``). The best candidate by
   (predicted max SD, predicted mean SD) is taken if it lowers the max by ``min_gain``, or keeps
   the max and lowers the SDs' sum by ``min_gain`` (branch ``move`` / ``swap``); else ``keep``. In
   i's last ``closing_windows`` decision windows only moves of i alone are made: a fall of the
   SDs' sum counts first, and a more even result only if the mean does not rise (``judge``).

Every candidate respects the app's constraints (allowed GPUs, minimum and maximum shares).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType
from typing import Any, NamedTuple

from drbalance.policy.base import AppView, Decision, PolicyConfig, Snapshot, current_ratio, violations
from drbalance.policy.predictor import Neighbourhood, Predictor, PredictorConfig
from drbalance.ratio import DataRatio
from drbalance.solo_estimate import SHARED


@dataclass(frozen=True)
class FairConfig:
    """Anti-thrash rules and search breadth. Gains are in SD units (predicted SD at finish)."""

    min_gain: float = 0.02
    noise: float = 0.03  # predicted SD differences below this count as ties when they go against a change
    error_prior: float = 0.05  # relative error of predicted iteration times before any move is measured
    error_smoothing: float = 0.2  # weight of each measured move in that error
    error_floor: float = 0.2  # a measured relative error up to this needs no extra gain (a precise predictor)
    mean_slack: float = 0.0  # a fairer configuration may raise the mean SD by this share of its gain
    idle_tolerance: float = 0.005  # predicted SD rise any app may take for a move onto an idle GPU; also the
    # measured loss of SD at finish that undoes a move of an app alone (``_measured_loss``)
    protect_windows: int = 1
    judge_iterations: int = 4  # a move is judged once measured for at least this many of the app's iterations
    max_moves_per_epoch: int = 4
    ban_windows: int = 4
    destinations: int = 4  # least-loaded GPUs tried as destinations
    spread_gpus: int = 3  # an app over more GPUs moves shares from its this many most loaded ones to its
    # this many least loaded ones (and the destinations) only, or goes whole onto one of the least loaded;
    # 0: shares from and to every GPU it uses
    swap_partners: int = 6  # apps tried as swap partners
    untangle_pairs: int = 1  # two apps split over the same two GPUs (nobody else there) may take one GPU each; 0: off
    window_fraction: float = 0.01  # decision window: this share of the app's solo-run time...
    window_iterations: int = 20  # ...but at least this many of its iterations
    closing_windows: float = 2.0  # an app with fewer of its decision windows left puts efficiency first (judge)
    newcomer_idle_utilization: float = 10.0  # percent: an idle GPU reads below this (a newcomer's placement)
    newcomer_settled_seconds: float = 60.0  # ...made only if every other app has run this long
    novel_floor: float = 0.05  # changes that put an app beside a stranger take their margin from the
    # error of such moves less this (when larger than the usual); 1 or more: off (uncertainty)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)

    def __post_init__(self) -> None:
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0; got {self.min_gain}")
        if not 0 <= self.newcomer_idle_utilization <= 100:  # also refuses NaN
            raise ValueError(f"newcomer_idle_utilization must be within 0..100 percent; got "
                             f"{self.newcomer_idle_utilization!r}")
        if not 0 <= self.newcomer_settled_seconds < math.inf:  # also refuses NaN
            raise ValueError(f"newcomer_settled_seconds must be a finite number of seconds >= 0; got "
                             f"{self.newcomer_settled_seconds!r}")
        if not 0 <= self.novel_floor < math.inf:  # also refuses NaN
            raise ValueError(f"novel_floor must be a finite number >= 0 (1 or more: off); got {self.novel_floor!r}")
        if not self.closing_windows >= 0:  # also refuses NaN
            raise ValueError(f"closing_windows must be a number >= 0; got {self.closing_windows!r}")
        for name in ("protect_windows", "judge_iterations", "max_moves_per_epoch", "ban_windows", "destinations",
                     "swap_partners", "spread_gpus", "untangle_pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")


class Verdict(NamedTuple):
    """A policy's judgement of a change that pays: its gain (for the log) and a key to rank it
    against other such changes (larger is better)."""

    gain: float
    key: tuple[float, ...]


@dataclass
class _Move:
    """A change the policy made to one app, kept until it has been measured."""

    before: DataRatio
    after: DataRatio
    iteration: int
    predicted: float  # iteration time predicted for ``after`` (seconds)
    quiet: int = 0  # the app's next decisions during which it stays put
    checked: bool = False  # measured for a whole window and judged
    novel: bool = False  # its change put an app (the mover or a partner) beside a stranger (puts_strangers_together)
    measured_seconds: float = 0.0  # seconds of the app's iterations measured since the move (its windows' means)
    measured_iterations: int = 0  # ...over this many iterations
    seen: int = -1  # the app's iteration at the last decision that added to them (-1: ``iteration``)
    epoch: int | None = None  # the app's epoch it was counted in (``_Track.record``)
    pushed: bool = False  # made by another app's decision (a swap, a plan, a GPU yielded to a newcomer)
    alone_before: float | None = None  # seconds per iteration measured under ``before`` on GPUs no other
    # app used (the move's own, of the app alone there; ``_alone_measurement``): judged by measurements

    def measure(self, view: AppView) -> float | None:
        """Add the window the app's record describes (its mean iteration time over the iterations
        since the last decision that looked) and return the mean seconds per iteration since the
        move, or None if nothing was measured."""
        start = self.iteration if self.seen < 0 else self.seen
        self.seen = max(start, view.iteration)
        if view.iteration_time is not None and view.iteration > start:
            first = not self.measured_iterations
            self.measured_seconds += view.iteration_time * (view.iteration - start)
            self.measured_iterations += view.iteration - start
            if first:  # one window: its mean as the record gives it
                return view.iteration_time
        return self.measured_seconds / self.measured_iterations if self.measured_iterations else None


@dataclass
class _Track:
    """Per app: where the policy first saw it, decision windows, recent moves, DRs not to retry."""

    first_iteration: int = 0  # the app's iteration at its first decision this policy made (or push)
    last_decision: int | None = None
    window_start: int | None = None  # the app's iteration at the decision before its last (its record's window)
    window: int = 0  # iterations between the app's decisions
    last_move: _Move | None = None
    moves: dict[int, int] = field(default_factory=dict)  # epoch -> moves made in it
    banned: dict[tuple[int, ...], int] = field(default_factory=dict)  # shares -> banned until this iteration
    solo_measured: bool = False  # sent whole onto a GPU of its own to measure its solo time (``_measure_solo``)

    def record(self, move: _Move, epoch: int) -> None:
        """A move made to the app in its ``epoch`` (its own, a revert or a push): judged and protected
        as its last move, and counted towards its moves that epoch."""
        self.last_move = move
        move.epoch = epoch
        self.moves[epoch] = self.moves.get(epoch, 0) + 1

    def drop_unmade_move(self) -> None:
        """The last move never ran (the job kept its DR of before): nothing to judge or protect.
        One pushed to the app by another app's decision is not counted towards the moves of its
        epoch either; the app's own moves and reverts still count, so the move cap still bounds
        how often a DR the job keeps refusing is tried again."""
        move, self.last_move = self.last_move, None
        if move is not None and move.pushed and self.moves.get(move.epoch, 0) > 0:
            self.moves[move.epoch] -= 1


class FairPolicy:
    """See the module docstring."""

    name = "fair"

    def __init__(self, config: FairConfig | None = None) -> None:
        self.config = config or FairConfig()
        self.predictor: Predictor | None = None
        self.tracks: dict[str, _Track] = {}
        self.error = self.config.error_prior  # relative error of the iteration times it predicted
        self.novel_error = self.config.error_prior  # the same, of the moves that put an app beside a stranger
        self._runs: dict[str, tuple[int, int]] = {}  # per app: the pid and iteration its last record showed

    # --- the decision ----------------------------------------------------------------------------
    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        """The app's new DR, and when it should ask again (its decision window, in seconds)."""
        decision = self._choose(app, trigger, snapshot)
        window = self.window_seconds(snapshot.app(app))
        # a record's times can be any finite float >= 0: a window that is no positive number of seconds
        # (0 or an overflow) leaves the app's own cadence, where it would make the Decision refuse it
        return replace(decision, next_boundary=window if 0.0 < window < math.inf else None)

    def solo_estimate(self, app: str) -> float | None:
        """The predictor's estimate of the app's solo iteration in seconds (``Predictor.solo_estimate``),
        None if it has none."""
        return None if self.predictor is None else self.predictor.solo_estimate(app)

    def window_seconds(self, view: AppView) -> float:
        """How long the app's decision (and measurement) window lasts."""
        per_iteration = view.iteration_time or view.solo_time / max(1, view.iterations_total)
        return max(self.config.window_fraction * view.solo_time, self.config.window_iterations * per_iteration)

    def _choose(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        config = snapshot.config
        me = snapshot.app(app)
        ratio = current_ratio(me, config)
        if ratio is None:
            return Decision.of(app, me.ratio, "bad-dr", gpus=len(me.ratio), server_gpus=config.gpu_count)
        live = {view.name for view in snapshot.apps}
        predictor = self._predictor(snapshot, app, live)
        track = self._track(me)
        self._note_window(track, me)
        if trigger == "register":
            placed = self._place_newcomer(me, ratio, snapshot)
            if placed is not None:
                return placed
        if trigger == "register" or me.slowdown is None or me.iteration_time is None or me.chunk_seconds is None:
            return Decision.of(app, me.ratio, "no-measurement")
        search = self._new_search(snapshot, predictor, me, self._locked_gpus(app, live))
        checked = self._check_last_move(me, ratio, track, search)
        if checked is not None:
            return checked
        move = track.last_move
        if move is not None and move.quiet > 0:
            move.quiet -= 1
            return Decision.of(app, me.ratio, "protected", decisions_left=move.quiet)
        if self.capped(me):
            return Decision.of(app, me.ratio, "move-cap", epoch=me.epoch)
        measuring = self._measure_solo(me, ratio, search, track)
        if measuring is not None:
            return measuring
        best = search.best(ratio)
        if best is None:
            return Decision.of(app, me.ratio, "keep", locked=sorted(search.locked))
        changes, gain = best
        others = {other: their for other, their in changes.items() if other != app}
        for other, their in others.items():  # pushed to them now: each is a move of theirs too
            view = snapshot.app(other)
            before = current_ratio(view, snapshot.config) or view.ratio  # as the app's check will read it
            self._track(view).record(_Move(before, their, view.iteration, search.predicted_time(other, changes),
                                           quiet=self.config.protect_windows, pushed=True), view.epoch)
        branch = "move" if not others else "swap" if len(others) == 1 else "plan"
        decision = self._move(me, ratio, changes, branch, search, track, gain, partners=sorted(others))
        return replace(decision, others=MappingProxyType(others))

    def _place_newcomer(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision | None:
        """A registering app that shares a GPU with another app goes whole onto an idle GPU, if there
        is one: no app's DR uses it and its utilisation reads below ``newcomer_idle_utilization``
        (or gives no reading). The least busy such GPU, then the lowest index. Else None: it keeps
        its DR until measured, like any newcomer. Only if every other app has run for at least
        ``newcomer_settled_seconds`` since the policy first saw it (``run_seconds``): jobs
        launched together register one by one, and a GPU the ones registered so far leave free
        may be where the next one starts.

        With no idle GPU, a GPU that only one split app uses is given up to the newcomer
        (``_yield_split``): before the newcomer arrived that app may have spread onto a GPU that
        nobody used, which doing nothing would now give the newcomer."""
        config = snapshot.config
        settled = self.config.newcomer_settled_seconds
        taken: set[int] = set()
        for view in snapshot.apps:
            if view.name == me.name:
                continue
            if view.iteration_time is None or self.run_seconds(view) < settled:
                return None  # it may have started with the newcomer: where the others go is not known
            taken.update(view.ratio.used)
        if taken.isdisjoint(ratio.used):
            return None
        idle = []
        for gpu in range(config.gpu_count):
            reading = snapshot.utilization[gpu]
            busy = 0.0 if reading is None else reading
            if gpu in taken or busy >= self.config.newcomer_idle_utilization:
                continue
            candidate = DataRatio.single(config.gpu_count, gpu, config.dr_total)
            if not violations(me, candidate, config):
                idle.append((busy, gpu, candidate))
        if not idle:
            return self._yield_split(me, ratio, snapshot)
        busy, gpu, candidate = min(idle, key=lambda found: found[:2])
        return Decision.of(me.name, candidate, "place", gpu=gpu, utilization=busy)

    def _yield_split(self, me: AppView, ratio: DataRatio, snapshot: Snapshot) -> Decision | None:
        """The newcomer ``me`` (on a taken GPU, none idle) gets a GPU that one other app uses alone
        as part of a split over several GPUs: that app is consolidated onto its other GPUs (its
        shares there rescaled to the DR total, pushed to it) and the newcomer goes whole onto the
        GPU it leaves. The newcomer's own GPU first if it is such a GPU, else the lowest index.
        Not an app in its protected period, nor to a DR banned for it (undone lately), nor with
        more load onto a GPU locked by another app's unmeasured move (``_locked_gpus``). None if
        there is none, or no such change respects both apps' constraints."""
        config = snapshot.config
        users: list[list[tuple[AppView, DataRatio | None]]] = [[] for _ in range(config.gpu_count)]
        for view in snapshot.apps:
            if view.name != me.name:
                theirs = current_ratio(view, config)  # None: a DR that does not fit this server
                for gpu in view.ratio.used:
                    if gpu < config.gpu_count:
                        users[gpu].append((view, theirs))
        mine = set(ratio.used)
        locked = self._locked_gpus(me.name, {view.name for view in snapshot.apps})
        for gpu in sorted(range(config.gpu_count), key=lambda index: (index not in mine, index)):
            if len(users[gpu]) != 1:
                continue
            split, theirs = users[gpu][0]
            if theirs is None or len(theirs.used) < 2 or self.protected(split.name):
                continue
            rest = [share if index != gpu else 0 for index, share in enumerate(theirs.shares)]
            consolidated = DataRatio.from_weights(rest, config.dr_total)
            candidate = DataRatio.single(config.gpu_count, gpu, config.dr_total)
            if violations(split, consolidated, config) or violations(me, candidate, config):
                continue
            if self.banned(split, consolidated) or locked.intersection(_gained(theirs, consolidated)):
                continue  # a DR it undid lately, or more load where another app's move is being measured
            self._track(split).record(_Move(theirs, consolidated, split.iteration, 0.0,
                                            quiet=self.config.protect_windows, checked=True, pushed=True), split.epoch)
            decision = Decision.of(me.name, candidate, "place", gpu=gpu, utilization=snapshot.utilization[gpu],
                                   yielded_by=split.name)
            return replace(decision, others=MappingProxyType({split.name: consolidated}))
        return None

    def _measure_solo(self, me: AppView, ratio: DataRatio, search: _Search, track: _Track) -> Decision | None:
        """An app whose solo time is still an upper bound (``solo_basis`` ``shared``: the job's own
        estimate from chunks smaller than its batch or from shared GPUs) and that is split over
        several GPUs goes whole onto one of them that no other app uses, once (branch
        ``measure-solo``): that window measures its solo iteration (a whole batch alone on one GPU,
        the host time of one replica), which no split shows. Until then both its SD and what the
        predictor derives from its solo time (its work, host time and overhead) rest on a bound
        that can be several times too high: a small model split evenly over four emulated GPUs
        runs 3.4x slower than on one, and its own bound is 5.5x its solo iteration.

        The GPU: the app's largest share among its GPUs that no other app uses (then the lowest
        index); none if there is no such GPU, the move breaks the app's constraints or was undone
        lately, or the app has less than one decision window left. Unlike the search's moves, it is
        made in the app's closing windows too: a short job would otherwise end on its bound. The
        move is judged as any move of an app alone: undone if its window measured slower than
        before, or if going back wins by the objective with the measured solo time. It teaches the
        replica penalty nothing (its prediction rested on the bound)."""
        if me.solo_basis != SHARED or track.solo_measured or len(ratio.used) < 2 or self.windows_left(me) < 1:
            return None  # less than the window it measures left: it could not be judged and undone
        config = search.config
        free = [gpu for gpu in ratio.used if not search.others_on({gpu}) and gpu not in search.locked]
        if not free:
            return None
        gpu = max(free, key=lambda index: (ratio[index], -index))
        candidate = DataRatio.single(config.gpu_count, gpu, config.dr_total)
        if violations(me, candidate, config) or self.banned(me, candidate):
            return None
        track.solo_measured = True
        alone = self._alone_measurement(me, ratio, {me.name: candidate}, search, track)
        track.record(_Move(ratio, candidate, me.iteration, 0.0, quiet=self.config.protect_windows,
                           alone_before=alone), me.epoch)
        return Decision.of(me.name, candidate, "measure-solo", gpu=gpu)

    def _locked_gpus(self, app: str, live: set[str]) -> set[int]:
        """GPUs that another app's recent move added load to, and whose effect is not measured yet.
        No more load goes there meanwhile. ``live``: the names of the apps in the snapshot."""
        locked: set[int] = set()
        for name, track in self.tracks.items():
            move = track.last_move
            if move is not None and not move.checked and name != app and name in live:
                locked.update(_gained(move.before, move.after))
        return locked

    def judge(self, search: _Search, before: Mapping[str, float], after: Mapping[str, float],
              movers: int = 1, novel: bool = False) -> Verdict | None:
        """How much a change pays, from the predicted times of the apps it affects; None if not enough.

        Leximax over their predicted SDs at finish (the other apps do not change): the largest are
        compared first; at the first that is lower by at least min_gain the change wins and the
        difference is the gain, unless an earlier one is higher by ``noise`` or more (differences
        below that are within the predictor's error, and count as ties). If none differs, a fall
        of the SDs' sum by at least min_gain wins, and that fall per app is the gain. A gain is
        refused if the SDs of all apps would rise, in sum, by more than ``mean_slack`` times it per
        app plus ``noise``. Ranked by gain, then by the fall of the mean.

        Closing windows: while the deciding app has fewer than ``closing_windows`` of its decision
        windows left, only a change of the deciding app alone (``movers`` 1: no swap, no plan) is
        made: first one that lowers the sum of the SDs by min_gain (the gain: that fall per app)
        without raising the largest by ``noise``; after it, one that wins the leximax comparison
        with no rise of the mean at all. A change could not be measured and undone before the app
        ends, and a swap's partner would carry a move it never judged.

        ``novel``: the change puts an app beside a stranger; its margin then comes from the error
        of such moves where that is larger (``uncertainty``).
        """
        old_sds, new_sds = search.sds(before), search.sds(after)
        config = self.config
        margin = self.uncertainty(search, after, novel)
        needed, noise = max(config.min_gain, margin), max(config.noise, margin)
        mean_rise = (sum(new_sds.values()) - sum(old_sds.values())) / search.app_count
        closing = search.closing
        if closing:
            if movers != 1:
                return None  # in its closing windows an app makes only moves of its own
            fall = -mean_rise * search.app_count  # of the SDs' sum
            if fall >= needed and max(new_sds.values(), default=0.0) - max(old_sds.values(), default=0.0) < noise:
                return Verdict(-mean_rise, (1.0, -mean_rise, -mean_rise))
        for old, now in zip(sorted(old_sds.values(), reverse=True), sorted(new_sds.values(), reverse=True)):
            if old - now >= needed:
                if closing:
                    return Verdict(old - now, (0.0, old - now, -mean_rise)) if mean_rise <= 0.0 else None
                allowed = config.mean_slack * (old - now) + noise / search.app_count
                return Verdict(old - now, (old - now, -mean_rise)) if mean_rise <= allowed else None
            if now - old >= noise:
                return None
        if closing:
            return None
        return self._sum_win(mean_rise, search.app_count, needed)

    @staticmethod
    def _sum_win(mean_rise: float, app_count: int, needed: float) -> Verdict | None:
        """No SD differs by the needed gain: a fall of the SDs' sum by it wins (gain: the fall per app)."""
        return Verdict(-mean_rise, (-mean_rise, -mean_rise)) if -mean_rise * app_count >= needed else None

    def windows_left(self, view: AppView) -> float:
        """How many of its decision windows the app has left to run: its iterations left at its
        measured pace (the solo pace before it is measured), over its window."""
        per_iteration = view.iteration_time or view.solo_time / max(1, view.iterations_total)
        left = max(0, view.iterations_total - view.iteration) * per_iteration
        return left / max(1e-9, self.window_seconds(view))

    def uncertainty(self, search: _Search, times: Mapping[str, float], novel: bool = False) -> float:
        """How far predicted SDs at finish can be off: the policy's measured relative error of
        iteration-time predictions times the part of the SD still to come (iterations left x
        predicted iteration time / solo-run time), averaged over the apps a change affects.
        Errors up to ``error_floor`` count as none: a predictor that good gains more from acting on
        its predictions than from doubting them (in the simulator, a margin from a 5% error leaves
        (c) from round-robin at a spread of 0.15, against 0.05 without one). Noisy windows (emulated GPUs
        on a starved CPU: misses of 50% and more) and long remaining runs call for larger gains.

        A ``novel`` change (it puts an app beside a stranger: an app whose kappa with it was never
        learned, so the predictor used an estimate) uses instead, where larger, the error measured
        on such moves alone less ``novel_floor``: under Gavel's measured pairs those miss by more
        than 25% three times as often as a move onto a GPU of the app's own (docs/reproduction.md)."""
        excess = self.margin_excess(novel)
        if not excess:
            return 0.0  # what the sum below comes to, without it
        parts = []
        for name, seconds in times.items():
            view = search.views[name]
            if view.slowdown is not None:
                parts.append(max(0, view.iterations_total - view.iteration) * seconds / view.solo_time)
        return excess * (sum(parts) / len(parts)) if parts else 0.0

    # --- bookkeeping -----------------------------------------------------------------------------
    def _new_search(self, snapshot: Snapshot, predictor: Predictor, me: AppView, locked: set[int]) -> _Search:
        """The search of one decision of ``me`` (the candidates and their scores)."""
        return _Search(self, snapshot, predictor, me, locked)

    def _new_predictor(self, gpu_count: int) -> Predictor:
        """A predictor for a server of ``gpu_count`` GPUs."""
        return Predictor(gpu_count, self.config.predictor)

    def _predictor(self, snapshot: Snapshot, app: str, live: set[str] | None = None) -> Predictor:
        """The predictor, having forgotten the apps that are gone and learned from the snapshot
        (``live``: the names of the snapshot's apps, if the caller has them)."""
        if self.predictor is None or self.predictor.gpu_count != snapshot.config.gpu_count:
            if self.predictor is not None:  # another server: the moves, locks and bans were of the last one's GPUs
                self.tracks.clear()
            self.predictor = self._new_predictor(snapshot.config.gpu_count)
        if live is None:
            live = {view.name for view in snapshot.apps}
        restarted = self._restarted(snapshot.apps, live)
        if restarted:  # a new run of the app: nothing learned about, or done to, the last one holds for it
            live = live - restarted
        self.predictor.forget(live)
        if not live.issuperset(self.tracks):  # some app is gone (a loop in Python only then)
            for name in [name for name in self.tracks if name not in live]:
                del self.tracks[name]
        self.predictor.observe(snapshot.apps, learn_from=(app,))
        return self.predictor

    def _restarted(self, views: tuple[AppView, ...], live: set[str]) -> set[str]:
        """Apps whose record shows a new run under the same name since the policy last saw them:
        another pid, or an iteration count that went back (a job restarted, maybe with another
        model, before the policy saw it gone). The last run's move would otherwise stay unjudged
        until the new run passed its iteration, keeping the GPUs it went to locked for every other
        app, and its bans, move counts, run time and what the predictor learned about it would
        stand for the new run."""
        runs = self._runs
        restarted = set()
        for view in views:
            run = (view.pid, view.iteration)
            known = runs.get(view.name)
            if known is not None and known != run and (known[0] != run[0] or run[1] < known[1]):
                restarted.add(view.name)
            runs[view.name] = run
        if len(runs) > len(live):
            for name in [name for name in runs if name not in live]:
                del runs[name]
        return restarted

    def _track(self, view: AppView) -> _Track:
        """The app's track, begun at its current iteration if the policy has none."""
        track = self.tracks.get(view.name)
        if track is None:
            track = self.tracks[view.name] = _Track(first_iteration=view.iteration)
        return track

    def run_seconds(self, view: AppView) -> float:
        """How long the policy has seen the app run (seconds): its iterations since the policy's
        first decision for it, at its measured iteration time; 0 if not measured or never seen.
        Not its iterations since it started: a job resumed from a checkpoint (``start_epoch``)
        registers with the iterations of its earlier run already counted."""
        track = self.tracks.get(view.name)
        if track is None or view.iteration_time is None:
            return 0.0
        return max(0, view.iteration - track.first_iteration) * view.iteration_time

    @staticmethod
    def _note_window(track: _Track, me: AppView) -> None:
        if track.last_decision is not None and me.iteration > track.last_decision:
            track.window = me.iteration - track.last_decision
        track.window_start, track.last_decision = track.last_decision, me.iteration

    def capped(self, view: AppView) -> bool:
        """Whether the app has made ``max_moves_per_epoch`` moves in its current epoch (its own,
        reverts, and those pushed to it as a swap partner or in a plan): it makes no move of its
        own until the next."""
        track = self.tracks.get(view.name)
        return track is not None and track.moves.get(view.epoch, 0) >= self.config.max_moves_per_epoch

    def banned(self, view: AppView, ratio: DataRatio) -> bool:
        """Whether ``ratio`` was undone for the app (a revert) less than ``ban_windows`` of its
        windows ago: it is not tried again meanwhile, as its own move or pushed to it."""
        track = self.tracks.get(view.name)
        until = None if track is None else track.banned.get(ratio.shares)
        return until is not None and view.iteration < until

    def protected(self, name: str) -> bool:
        """Whether the app is in the protected period after a move (``protect_windows`` of its
        decisions, the first of which judges the move)."""
        track = self.tracks.get(name)
        move = None if track is None else track.last_move
        return move is not None and (move.quiet > 0 or not move.checked)

    def _move(self, me: AppView, ratio: DataRatio, changes: Mapping[str, DataRatio], branch: str, search: _Search,
              track: _Track, gain: float, **details: Any) -> Decision:
        """Make the deciding app's part of ``changes`` (its move, or its half of a swap or plan),
        remembering the iteration time predicted for it with every change applied: a swap's
        mover is predicted with its partner gone from the GPU it joins."""
        new = changes[me.name]
        predicted = search.predicted_time(me.name, changes)
        alone = self._alone_measurement(me, ratio, changes, search, track)
        track.record(_Move(ratio, new, me.iteration, predicted, quiet=self.config.protect_windows,
                           novel=search.puts_strangers_together(changes), alone_before=alone),
                     me.epoch)
        return Decision.of(me.name, new, branch, gain=gain, predicted_iteration=predicted, **details)

    @staticmethod
    def _alone_measurement(me: AppView, ratio: DataRatio, changes: Mapping[str, DataRatio], search: _Search,
                           track: _Track) -> float | None:
        """The app's measured seconds per iteration under ``ratio``, if ``changes`` moves it alone and
        only between GPUs no other app uses (``before`` or ``after``), and its record's window ran
        under ``ratio`` throughout (no move of it since the window began); else None.

        Such a move changes nobody's time but the app's own, so it is judged by measurements alone
        (``_measured_loss``): the predictor that chose it may share its error (a split over an idle
        GPU predicted faster that ran slower also taught the predictor that one GPU is slower)."""
        last = track.last_move
        if len(changes) != 1 or me.iteration_time is None or track.window_start is None:
            return None
        if last is not None and last.iteration > track.window_start:
            return None  # the window mixed two DRs
        if search.others_on(set(ratio.used) | set(changes[me.name].used)):
            return None
        return me.iteration_time

    def _measured_loss(self, me: AppView, move: _Move, measured: float | None, search: _Search) -> Verdict | None:
        """A move of the app alone on GPUs nobody else uses (``_alone_measurement``) that measured
        slower than before it by at least ``idle_tolerance`` of SD at finish (the iterations left at
        the difference, over the solo-run time), whatever gain it was predicted to make: the gain of
        undoing it; None if not such a move, if another app uses those GPUs now, or if it did not
        cost that much."""
        terms = _eq2_terms(me)
        if move.alone_before is None or not measured or terms is None:
            return None
        if search.others_on(set(move.before.used) | set(move.after.used)):
            return None
        _, left, solo = terms
        loss = left * (measured - move.alone_before) / solo
        threshold = self.config.idle_tolerance
        return Verdict(loss, (loss,)) if loss >= threshold else None

    def _undo_verdict(self, me: AppView, move: _Move, measured: float | None, search: _Search) -> Verdict | None:
        """The gain of undoing the app's judged move: its measured loss (a move of the app alone),
        going back winning the objective, or lowering the affected SDs' sum by ``min_gain``; None
        if the move stays."""
        found = self._measured_loss(me, move, measured, search)
        if found is None:
            found = search.gain({me.name: move.before})
        if found is None:
            found = search.mean_gain({me.name: move.before})
        return found

    def _learn_from_move(self, me: AppView, move: _Move, measured: float, predictor: Predictor) -> None:
        """What a move measured for a whole window teaches (``measured`` and ``move.predicted``:
        seconds per iteration, both > 0): the replica penalty, if it changed the app's replica
        count (the GPUs that get samples of its batch, ``Predictor.replicas``), and the policy's
        relative error of its predictions."""
        name = me.name
        predictor.learn_move(predictor.replicas(name, move.before), predictor.replicas(name, move.after), measured,
                             move.predicted)
        miss = min(1.0, abs(measured / move.predicted - 1.0))
        self.error += self.config.error_smoothing * (miss - self.error)
        if move.novel:
            self.novel_error += self.config.error_smoothing * (miss - self.novel_error)

    def margin_excess(self, novel: bool = False) -> float:
        """The relative error that sets a change's margin (``uncertainty``): the measured error
        above ``error_floor``, or for a ``novel`` change the error of moves beside strangers above
        ``novel_floor`` where that is larger; 0 for none."""
        excess = max(0.0, self.error - self.config.error_floor)
        return max(excess, self.novel_error - self.config.novel_floor) if novel else excess

    def novel_margin_matters(self) -> bool:
        """Whether the error of moves beside strangers would raise a change's margin now."""
        return self.margin_excess(novel=True) > self.margin_excess()

    @staticmethod
    def _measuring(me: AppView, move: _Move) -> Decision:
        """The app's last move has run fewer than ``judge_iterations`` iterations: it stays put
        (its protected decisions count down meanwhile) and the move is judged later."""
        move.quiet = max(0, move.quiet - 1)
        return Decision.of(me.name, me.ratio, "measuring", iterations=me.iteration - move.iteration)

    def _check_last_move(self, me: AppView, ratio: DataRatio, track: _Track, search: _Search) -> Decision | None:
        """Undo the app's last move if, measured for a whole window, it made things worse: going
        back pays by the policy's judgement, or lowers the SDs of the apps it affects by
        ``min_gain`` in sum (a move meant to be fair that turned out to cost everyone)."""
        move = track.last_move
        if move is None or me.iteration <= move.iteration:
            return None
        if ratio != move.after:
            if ratio == move.before:  # the job never ran it (an out-of-memory revert, a refused or lost command):
                track.drop_unmade_move()  # nothing to judge, no GPU to hold or period to protect, no move counted
            return None
        if move.checked:  # judged, or a revert or a GPU yielded to a newcomer: not judged again
            return None
        measured = move.measure(me)
        if me.iteration - move.iteration < self.config.judge_iterations:
            return self._measuring(me, move)
        move.checked = True
        details = {"measured_iteration": measured, "predicted_iteration": move.predicted}
        if move.predicted > 0 and measured:
            self._learn_from_move(me, move, measured, search.predictor)
        if violations(me, move.before, search.config):
            return None
        found = self._undo_verdict(me, move, measured, search)
        if found is None:
            return None
        track.banned[move.after.shares] = me.iteration + self.config.ban_windows * max(1, track.window)
        track.record(_Move(move.after, move.before, me.iteration, 0.0, quiet=self.config.protect_windows,
                           checked=True), me.epoch)
        return Decision.of(me.name, move.before, "revert", gain=found.gain, **details)


class _Search:
    """Scores changes to the configuration by the predicted SDs at finish of the apps they affect.

    The configuration is the snapshot's (with DRs pushed to apps but not yet applied). Candidates
    never add load to a locked GPU.
    """

    def __init__(self, policy: FairPolicy, snapshot: Snapshot, predictor: Predictor, me: AppView,
                 locked: set[int]) -> None:
        self.policy = policy
        self.config: PolicyConfig = snapshot.config
        self.predictor = predictor
        self.me = me
        self.locked = locked
        gpus = self.config.gpu_count
        views: dict[str, AppView] = {}
        ratios: dict[str, DataRatio] = {}  # the apps whose DR has a share per GPU of the server
        measured = 0  # apps with an SD so far
        for view in snapshot.apps:  # one pass over the apps
            name, ratio = view.name, view.ratio
            views[name] = view
            if len(ratio.shares) == gpus:
                ratios[name] = ratio
            if view.slowdown is not None:
                measured += 1
        self.views, self.ratios, self.app_count = views, ratios, max(1, measured)
        # the deciding app is in its last ``closing_windows`` (``FairPolicy.judge``): once per search
        self.closing = policy.windows_left(me) < policy.config.closing_windows
        self._all_sds: dict[str, float] | None = None
        self._neighbourhood: Neighbourhood | None = None
        self._occupants: list[list[str]] | None = None
        self._load: list[float] | None = None  # ``_others_load``
        self._compared: dict[tuple, tuple[Mapping[str, float], dict[str, float]]] = {}
        self._sds_of: dict[int, tuple[Mapping[str, float], dict[str, float]]] = {}  # id(times) -> (times, SDs)
        self._eq2: dict[str, tuple[float, int, float] | None] = {}

    @property
    def neighbourhood(self) -> Neighbourhood:
        """The predictor's what-ifs around the current configuration (built at first use: a
        decision that scores nothing does not pay for it)."""
        if self._neighbourhood is None:
            self._neighbourhood = self.predictor.neighbourhood(self.ratios, self.views)
        return self._neighbourhood

    def predicted_time(self, name: str, changes: Mapping[str, DataRatio]) -> float:
        """The app's predicted (corrected) seconds per iteration with ``changes`` applied (0.0 if the
        change does not affect it): read from ``compare``, which judged the change already."""
        return self.compare(changes)[1].get(name, 0.0)

    def _sds(self, times: Mapping[str, float]) -> dict[str, float]:
        sds = {}
        terms = self._eq2
        for name, seconds in times.items():
            if name not in terms:
                terms[name] = _eq2_terms(self.views[name])
            found = terms[name]
            if found is not None:  # Eq. 2 at finish, every iteration left taking `seconds`
                elapsed, left, solo = found
                sds[name] = (elapsed + left * seconds) / solo
        return sds

    def compare(self, changes: Mapping[str, DataRatio]) -> tuple[Mapping[str, float], Mapping[str, float]]:
        """``Neighbourhood.compare``, kept for the search (a change may be judged twice, and many
        changes share the times without them). The maps are the search's own: read, never change."""
        key = tuple((name, ratio.shares, ratio.total) for name, ratio in changes.items())
        found = self._compared.get(key)
        if found is None:
            found = self._compared[key] = self.neighbourhood.compare(changes)
        return found

    def sds(self, times: Mapping[str, float]) -> dict[str, float]:
        """Predicted SDs at finish for these predicted iteration times (apps with an SD so far);
        kept for the times ``compare`` gave (the same map object: the same SDs)."""
        kept = self._sds_of.get(id(times))
        if kept is not None and kept[0] is times:
            return kept[1]
        found = self._sds(times)
        self._sds_of[id(times)] = (times, found)
        return found

    def all_sds(self) -> dict[str, float]:
        """Predicted SDs at finish of every app in the current configuration (solved once)."""
        if self._all_sds is None:
            self._all_sds = self._sds(self.neighbourhood.solve(list(self.neighbourhood.ratios), {}))
        return self._all_sds

    def mean_gain(self, changes: Mapping[str, DataRatio]) -> Verdict | None:
        """A change that lowers the predicted SDs at finish by ``min_gain`` in sum, or None."""
        before, after = (self.sds(times) for times in self.compare(changes))
        fall = sum(before.values()) - sum(after.values())
        if fall < self.policy.config.min_gain:
            return None
        return Verdict(fall / self.app_count, (fall,))

    def gain(self, changes: Mapping[str, DataRatio]) -> Verdict | None:
        """The policy's judgement of a change, or None if it does not pay."""
        before, after = self.compare(changes)
        novel = self.policy.novel_margin_matters() and self.puts_strangers_together(changes)
        return self.policy.judge(self, before, after, movers=len(changes), novel=novel)

    def puts_strangers_together(self, changes: Mapping[str, DataRatio]) -> bool:
        """Whether the change puts a moved app on a GPU beside an app whose kappa with it (how much
        that app slows it down) the predictor never learned, alone together or in a crowd."""
        occupants = self._gpu_occupants()
        known = self.predictor.measured_together
        for name, new in changes.items():
            for gpu in new.used:
                for other in occupants[gpu]:  # apps the change leaves where they are
                    if other != name and other not in changes and not known(name, other):
                        return True
                for other, theirs in changes.items():  # apps the change moves there too
                    if other != name and theirs[gpu] > 0 and other in self.ratios and not known(name, other):
                        return True
        return False

    def others_on(self, gpus: set[int]) -> bool:
        """Whether an app but the deciding one has a share of one of ``gpus`` (DRs pushed included)."""
        occupants = self._gpu_occupants()
        return any(name != self.me.name for gpu in gpus for name in occupants[gpu])

    def _gpu_occupants(self) -> list[list[str]]:
        """Per GPU, the apps whose current DR gives it a share (built once per search)."""
        if self._occupants is None:
            self._occupants = [[] for _ in range(self.config.gpu_count)]
            for name, ratio in self.ratios.items():
                for gpu in ratio.used:
                    self._occupants[gpu].append(name)
        return self._occupants

    def best(self, ratio: DataRatio) -> tuple[dict[str, DataRatio], float] | None:
        best: tuple[Verdict, dict[str, DataRatio]] | None = None
        candidates = list(self._candidates(ratio))
        candidates.extend(plan for plan in self._consolidation_plans() if self.me.name in plan
                          and not any(self.policy.banned(self.views[name], their) for name, their in plan.items()))
        idle_users = []
        for changes in candidates:
            found = self.gain(changes)
            if found is not None and (best is None or found.key > best[0].key):
                best = (found, changes)
            elif found is None and self._fills_idle_gpu(changes):
                idle_users.append(changes)
        if best is None:
            return self._use_idle_gpu(idle_users)
        return best[1], best[0].gain

    def _fills_idle_gpu(self, changes: Mapping[str, DataRatio]) -> bool:
        """Whether the change puts work on a GPU nobody uses and leaves more GPUs in use."""
        occupants = self._gpu_occupants()
        if all(occupants):
            return False  # no GPU is idle: none can be taken
        change: dict[int, int] = {}
        for name, ratio in changes.items():
            current = self.ratios.get(name)
            if current is not None:
                for gpu in current.used:
                    change[gpu] = change.get(gpu, 0) - 1
            for gpu in ratio.used:
                change[gpu] = change.get(gpu, 0) + 1
        taken = sum(1 for gpu, delta in change.items() if not occupants[gpu] and delta > 0)
        emptied = sum(1 for gpu, delta in change.items() if occupants[gpu] and len(occupants[gpu]) + delta == 0)
        return taken > emptied

    def _use_idle_gpu(self, candidates: list[dict[str, DataRatio]]) -> tuple[dict[str, DataRatio], float] | None:
        """A GPU nobody uses is worth taking even without a predicted gain, as long as no app's
        predicted SD rises by more than ``idle_tolerance``: it keeps the server busy and its
        measurements teach the predictor (utilisation is the paper's second goal)."""
        best: tuple[float, dict[str, DataRatio]] | None = None
        tolerance = self.policy.config.idle_tolerance
        for changes in candidates:
            before, after = (self.sds(times) for times in self.compare(changes))
            if any(after.get(name, 0.0) - sd > tolerance for name, sd in before.items()):
                continue
            fall = sum(before.values()) - sum(after.values())
            if fall >= 0 and (best is None or fall > best[0]):
                best = (fall, changes)
        return None if best is None else (best[1], best[0] / self.app_count)

    def _touches_lock(self, before: DataRatio, after: DataRatio) -> bool:
        """Whether ``after`` adds load to a locked GPU (one of ``_gained(before, after)``)."""
        old, new, old_total, new_total = before.shares, after.shares, before.total, after.total
        for gpu in self.locked:
            if new[gpu] * old_total > old[gpu] * new_total:
                return True
        return False

    def _candidates(self, ratio: DataRatio) -> Iterator[dict[str, DataRatio]]:
        me, config = self.me, self.config
        seen = {ratio.shares}
        for candidate in self._own_candidates(ratio):
            if candidate.shares in seen or self.policy.banned(me, candidate):
                continue
            seen.add(candidate.shares)
            if not self._touches_lock(ratio, candidate) and not violations(me, candidate, config):
                yield {me.name: candidate}
        for partner in self._partners():
            mine = self.ratios[partner].rescale(config.dr_total)
            theirs = ratio
            if mine.shares == ratio.shares or not self._exchange_allowed(ratio, mine, partner, theirs):
                continue
            yield {me.name: mine, partner: theirs}
        if self.policy.config.untangle_pairs:
            yield from self._untangled(ratio)

    def _untangled(self, ratio: DataRatio) -> Iterator[dict[str, DataRatio]]:
        """If the deciding app and one other are both split over the same two GPUs and nobody else
        uses them: each on one of them, both ways (two replicas each and a shared GPU each become
        one GPU each, with no replica overhead)."""
        used = ratio.used
        if len(used) != 2:
            return
        occupants = self._gpu_occupants()
        there = set(occupants[used[0]]) | set(occupants[used[1]])
        others = there - {self.me.name}
        if len(others) != 1:
            return
        (partner,) = others
        view = self.views[partner]
        if view.slowdown is None or self.policy.protected(partner) or self.ratios[partner].used != used:
            return
        gpus, total = self.config.gpu_count, self.config.dr_total
        for mine_gpu, their_gpu in ((used[0], used[1]), (used[1], used[0])):
            mine, theirs = DataRatio.single(gpus, mine_gpu, total), DataRatio.single(gpus, their_gpu, total)
            if self._exchange_allowed(ratio, mine, partner, theirs):
                yield {self.me.name: mine, partner: theirs}

    def _exchange_allowed(self, ratio: DataRatio, mine: DataRatio, partner: str, theirs: DataRatio) -> bool:
        """Whether the deciding app may go from ``ratio`` to ``mine`` while ``partner`` takes
        ``theirs``: neither DR banned for its app, no locked GPU given load, both within their
        apps' limits (``violations``)."""
        me, other, config = self.me, self.views[partner], self.config
        if self.policy.banned(me, mine) or self.policy.banned(other, theirs):
            return False
        if self._touches_lock(ratio, mine) or self._touches_lock(self.ratios[partner], theirs):
            return False
        return not violations(me, mine, config) and not violations(other, theirs, config)

    def _consolidation_plans(self) -> list[dict[str, DataRatio]]:
        """Every app that may move put on one GPU, greedily, in three orders: the most slowed first,
        the most work first (longest-processing-time first), and registration order. The judge
        picks among them (each greedy order reaches a different local optimum: in scenario (a)
        from spread, most-slowed-first pairs the two ResNets with the two AlexNets, registration
        order pairs them as round-robin placement does, which balances far better).

        Proposed only at a crowded start (a quarter of the apps or more spread over at least half
        the GPUs, as plain DataParallel does), where no single move improves: moving one app out
        of a crowd of spread apps still leaves it in the crowd on its new GPU.
        """
        wide = max(2, (self.config.gpu_count + 1) // 2)
        spread = sum(1 for ratio in self.ratios.values() if len(ratio.used) >= wide)
        if spread * 4 < len(self.ratios) or self.config.gpu_count < 2:
            return []
        movable = self._movable()
        if self.me.name not in movable:
            return []
        settings = self.predictor.config
        orders = (
            sorted(movable, key=lambda name: -(self.views[name].slowdown or 0.0)),
            sorted(movable, key=lambda name: -self.predictor.apps[name].work(settings)),
            list(movable),
        )
        plans: list[dict[str, DataRatio]] = []
        for order in orders:
            plan = self._plan(order)
            if plan and plan not in plans:
                plans.append(plan)
        return plans

    def _movable(self) -> list[str]:
        """Apps a consolidation plan may move, in registration order: measured, not protected
        (unless it is the deciding app), and free to leave a GPU."""
        movable = []
        for name in self.ratios:
            view = self.views[name]
            busy = name != self.me.name and self.policy.protected(name)
            if view.slowdown is not None and not busy and view.min_share == 0:
                movable.append(name)
        return movable

    def _plan(self, order: list[str]) -> dict[str, DataRatio]:
        """Put the apps of ``order`` on one GPU each, in that order, each where its predicted
        iteration time is least given the apps placed before it and those staying put."""
        config = self.config
        predictor = self.predictor
        settings = predictor.config
        moving = set(order)
        # per GPU, the apps staying put and their duty alone (device share of their solo iteration)
        load: list[list[tuple[str, float]]] = [[] for _ in range(config.gpu_count)]
        for name, ratio in self.ratios.items():
            if name not in moving:
                model = predictor.apps[name]
                duty = model.work(settings) / model.solo_iteration
                for gpu in ratio.used:
                    load[gpu].append((name, duty))
        plan: dict[str, DataRatio] = {}
        for name in order:
            view = self.views[name]
            model = predictor.apps[name]
            work, host = model.work(settings), model.host_time(settings)
            best: tuple[float, int] | None = None
            for gpu in range(config.gpu_count):
                candidate = DataRatio.single(config.gpu_count, gpu, config.dr_total)
                if gpu in self.locked and self.ratios[name][gpu] == 0 or violations(view, candidate, config):
                    continue
                crowd = len(load[gpu]) > 1
                stretch = 1.0 + sum(predictor.pair_kappa(name, other, crowd) * duty for other, duty in load[gpu])
                seconds = host + work / predictor.speed[gpu] * stretch
                if best is None or seconds < best[0]:
                    best = (seconds, gpu)
            if best is None:
                continue
            chosen = DataRatio.single(config.gpu_count, best[1], config.dr_total)
            load[best[1]].append((name, work / model.solo_iteration))
            if chosen != self.ratios[name]:
                plan[name] = chosen
        return plan

    def _own_candidates(self, ratio: DataRatio) -> Iterator[DataRatio]:
        total, gpus = self.config.dr_total, self.config.gpu_count
        destinations = self._quiet_gpus()
        for gpu in destinations:
            yield DataRatio.single(gpus, gpu, total)
        sources = targets = used = ratio.used
        limit = self.policy.config.spread_gpus
        if 0 < limit < len(used):  # spread wide: from the most loaded GPUs to the least loaded ones
            load = self._others_load()
            by_load = sorted(used, key=lambda g: (load[g], g))
            sources, targets = sorted(by_load[-limit:]), by_load[:limit]
            for gpu in targets:  # the whole batch onto one of them: a wide app can leave a crowd in one move
                yield DataRatio.single(gpus, gpu, total)  # (one that is also a destination: judged once, _candidates)
        for source in sources:
            for gpu in sorted(set(destinations) | set(targets)):
                if gpu == source:
                    continue
                for amount in sorted({ratio[source] // 2, ratio[source]}):  # half, all
                    if amount > 0:
                        shares = list(ratio.shares)
                        shares[source] -= amount
                        shares[gpu] += amount
                        yield DataRatio(shares, total)

    def _quiet_gpus(self) -> list[int]:
        """Unlocked GPUs that carry less than the average load of the other apps by at least half
        an app (their shares summed), quietest first: moving there balances load, where moving
        to an averagely loaded GPU would only shuffle it."""
        gpus = self.config.gpu_count
        load = self._others_load()
        average = sum(load) / gpus
        quiet = [g for g in range(gpus) if g not in self.locked and (load[g] == 0 or load[g] <= average - 0.5)]
        mine = self.ratios.get(self.me.name)
        if not quiet and mine is not None and self._sharing_pays():
            heaviest = max(load[g] + mine[g] / mine.total for g in mine.used)
            quiet = [g for g in range(gpus) if g not in self.locked and load[g] <= heaviest - 1.0]
        return sorted(quiet, key=lambda g: (load[g], g))[: self.policy.config.destinations]

    def _others_load(self) -> list[float]:
        """Per GPU, the other apps' shares on it summed (in apps: 1.0 is one app's whole share);
        computed once per search."""
        if self._load is None:
            load = self._load = [0.0] * self.config.gpu_count
            me = self.me.name
            for name, ratio in self.ratios.items():
                if name != me:
                    shares, total = ratio.shares, ratio.total
                    for gpu in ratio.used:
                        load[gpu] += shares[gpu] / total
        return self._load

    def _sharing_pays(self) -> bool:
        """Whether every pair measured alone together kept a kappa under 1: overlapping chunks
        then take less than twice as long, so two apps on one GPU do more than one at a time."""
        learned = self.predictor.kappa[False]
        return bool(learned) and max(learned.values()) < 1.0

    def _partners(self) -> list[str]:
        """Apps worth trying to swap with: measured (a swap with an app that has no SD yet is
        judged on the mover's SD alone), not moving already (a pushed move counts towards the
        partner's move cap but is not refused by it: docs/policy.md), the least slowed first."""
        candidates = []
        me, views, protected = self.me.name, self.views, self.policy.protected
        for name in self.ratios:
            slowdown = views[name].slowdown
            if name != me and slowdown is not None and not protected(name):
                candidates.append((slowdown, name))
        return [name for _, name in sorted(candidates)[: self.policy.config.swap_partners]]


def _eq2_terms(view: AppView) -> tuple[float, int, float] | None:
    """The terms of Eq. 2 at finish that the app's record alone gives: the time elapsed at finish
    but for the iterations left, those iterations, the solo-run time. With every iteration left
    taking t seconds the predicted SD is (elapsed + left * t) / solo."""
    if view.slowdown is None or view.iteration_time is None:
        return None
    left = max(0, view.iterations_total - view.iteration)
    return view.slowdown * view.solo_time - left * view.iteration_time, left, view.solo_time


def _gained(before: DataRatio, after: DataRatio) -> tuple[int, ...]:
    """GPUs whose share grows from ``before`` to ``after`` (compared as fractions of the batch)."""
    return _gained_shares(before.shares, before.total, after.shares, after.total)


@lru_cache(maxsize=4096)
def _gained_shares(before: tuple[int, ...], before_total: int, after: tuple[int, ...],
                   after_total: int) -> tuple[int, ...]:
    return tuple(g for g, (a, b) in enumerate(zip(before, after)) if b * before_total > a * after_total)


