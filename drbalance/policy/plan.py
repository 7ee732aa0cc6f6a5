"""``plan``: all apps' DRs chosen together, to minimise the largest predicted SD at finish, then the mean.

Every ``plan_period`` seconds and at every arrival or departure (``plan``), the policy learns from
the apps' records (``drbalance.policy.model``), predicts every app's SD at finish in the layout
now (SD0_i), and solves one integer programme with SciPy's HiGHS. Each app j picks one DR from
its options r (``options``: its DR now, whole on each GPU it may use, half or all of one GPU's
share moved to another, another app's DR), or two apps exchange DRs (a swap: one column for the
pair, ``Programme``); ``x_jr`` is 1 for the pick. ``G_i,jr`` is the change of app i's
predicted SD at finish if j alone took option r: for j itself, its iteration time with the
others' duties as they are, over its remaining run plus the cost of the change
(``change_cost`` iterations, for a new DR); for an app i sharing a GPU with j, the stretch of its
chunk there by j's change of duty (kappa_ij x delta d_jg)::

    minimise    t + MEAN_WEIGHT * sum_i sum_jr G_i,jr x_jr / N
    subject to  t >= SD0_i + sum_jr G_i,jr x_jr           for every app i
                sum_i sum_jr G_i,jr x_jr <= 0            the mean SD does not rise
                sum_r x_jr = 1                           one DR per app
                sum_{j, r adding load to g} x_jr <= 1     per GPU g
                x_jr in {0, 1}

The changes' effects add up, which holds while no two of them meet on a GPU: hence the last
constraint, at most one app adding load to each GPU per plan. If HiGHS has no integer answer
within ``solve_nodes`` branch-and-bound nodes (a tenth of the plan period at most), the
programme's LP relaxation is solved and each app takes its largest
``x_jr``. The plan is then predicted in full (``Model.times``: the duties' fixed point) against the
layout now, and applied only if it lowers the largest predicted SD or the mean by more than the
model's own measured error (``Model.error``) on the part of the SDs still to come, without raising
the other by more than that. A move an app cannot win back before it finishes raises its own SD
in ``G`` and is not made. A notice is answered from the plan (``decide``: a lookup, no solve).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix, hstack, vstack

from drbalance import defaults
from drbalance.policy.base import AppView, Decision, Plan, PolicyConfig, Snapshot, current_ratio, violations
from drbalance.policy.model import Model, ModelConfig
from drbalance.ratio import DataRatio

MEAN_WEIGHT = 0.1
"""The mean SD's weight against the largest in the objective: the largest first, then the mean."""
SOLVE_SHARE = 0.1
"""The most of a plan period a solve may take (seconds = this x ``plan_period``): a guard for large
servers; the node limit, not the clock, ends the solves of small ones, so a run is the same on any
machine."""


@dataclass(frozen=True)
class PlanConfig:
    """When to plan, what a change costs, how long a solve may take."""

    plan_period: float = 10.0  # seconds between plans (besides arrivals and departures)
    change_cost: float = defaults.CHANGE_COST_ITERATIONS  # iterations' worth an app loses per DR change
    solve_nodes: int = 200  # HiGHS's branch-and-bound nodes for the integer programme (then its LP relaxation)
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if not 0 < self.plan_period < math.inf:
            raise ValueError(f"plan_period must be a positive number of seconds; got {self.plan_period!r}")
        if isinstance(self.solve_nodes, bool) or not isinstance(self.solve_nodes, int) or self.solve_nodes < 1:
            raise ValueError(f"solve_nodes must be a positive number of nodes; got {self.solve_nodes!r}")
        if not 0 <= self.change_cost < math.inf:
            raise ValueError(f"change_cost must be a number of iterations >= 0; got {self.change_cost!r}")


def options(view: AppView, ratio: DataRatio, config: PolicyConfig, taken: list[DataRatio]) -> list[DataRatio]:
    """The DRs an app may be given in one plan, its own first: whole on any GPU, half or all of one
    GPU's share moved to another, and another app's DR (``taken``: for swaps); each within the
    app's constraints (``violations``)."""
    gpus, total = config.gpu_count, config.dr_total
    found = [ratio] + [DataRatio.single(gpus, gpu, total) for gpu in range(gpus)] + taken
    for source in ratio.used:
        for amount in {ratio[source] // 2, ratio[source]} - {0}:
            for target in range(gpus):
                if target != source:
                    shares = list(ratio.shares)
                    shares[source] -= amount
                    shares[target] += amount
                    found.append(DataRatio(shares, total))
    unique = list(dict.fromkeys(found))
    return [unique[0]] + [option for option in unique[1:] if not violations(view, option, config)]


class Layout:
    """The apps of a snapshot in the layout now, as the model predicts it (numpy arrays, N apps x GPUs)."""

    def __init__(self, snapshot: Snapshot, model: Model, change_cost: float) -> None:
        config = snapshot.config
        self.views = [view for view in snapshot.apps if current_ratio(view, config) is not None]
        self.names = [view.name for view in self.views]
        self.ratios = [current_ratio(view, config) for view in self.views]
        self.batches = [round(model.apps[name].batch) for name in self.names]
        self.host, self.replica, self.fixed, self.per_sample, self.kappa = model.arrays(self.names)
        self.speed, self.change_cost = model.speed, change_cost
        self.samples = self.split(range(len(self.names)), self.ratios)
        self.seconds, self.duty = model.times(self.names, self.samples)
        self.elapsed, self.left, self.solo = (np.array(column, dtype=float) for column in zip(*map(_eq2, self.views)))
        self.sd = self.slowdowns(self.seconds, np.zeros(len(self.names)))
        self.stretch = 1.0 + self.kappa @ self.duty  # of each app's chunks per GPU, by the others now
        self.unshared = self.alone(range(len(self.names)), self.samples)  # chunks now, without company
        self.chunks = self.unshared * self.stretch
        self.base = self.seconds - self.chunks.max(axis=1, initial=0.0)  # host and replica seconds

    def split(self, apps: Sequence[int], ratios: Sequence[DataRatio]) -> np.ndarray:
        """Samples per GPU of each app's batch under its ratio (rows)."""
        return np.array([_split(ratio.shares, ratio.total, self.batches[i]) for i, ratio in zip(apps, ratios)],
                        dtype=float).reshape(len(ratios), len(self.speed))

    def alone(self, apps: Sequence[int], samples: np.ndarray) -> np.ndarray:
        """Chunk seconds of ``apps`` with ``samples`` (rows) per GPU, without company."""
        apps = np.asarray(apps, dtype=int)
        return (self.fixed[apps, None] + self.per_sample[apps, None] * samples) * (samples > 0) / self.speed

    def slowdowns(self, seconds: np.ndarray, changed: np.ndarray) -> np.ndarray:
        """SDs at finish (Eq. 2) for iteration times ``seconds``, a change paid where ``changed``."""
        return (self.elapsed + (self.left + self.change_cost * changed) * seconds) / self.solo

    def own(self, apps: np.ndarray, ratios: Sequence[DataRatio], stretch: np.ndarray,
            samples: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per change (app ``apps[o]`` to ``ratios[o]``, its chunks stretched by ``stretch[o]``): the
        app's iteration seconds, change of its SD at finish, and duties per GPU (o x GPUs)."""
        samples = self.split(apps, ratios) if samples is None else samples
        chunks = self.alone(apps, samples) * stretch
        seconds = self.host[apps] + self.replica[apps] * np.maximum(0, (samples > 0).sum(axis=1) - 1) + chunks.max(
            axis=1, initial=0.0)
        changed = np.array([ratio != self.ratios[i] for i, ratio in zip(apps, ratios)])
        sd = (self.elapsed[apps] + (self.left[apps] + self.change_cost * changed) * seconds) / self.solo[apps]
        return seconds, sd - self.sd[apps], chunks / seconds[:, None]

    def effects(self, apps: np.ndarray, ratios: Sequence[DataRatio], samples: np.ndarray) -> csr_matrix:
        """``G`` (changes x apps): per change, the change of every app's predicted SD at finish: the
        mover's own, and that of each app sharing a GPU with it, whose chunk there stretches by
        kappa x the mover's change of duty."""
        _, own, duty = self.own(apps, ratios, self.stretch[apps], samples)
        kept = np.array([ratio == self.ratios[j] for j, ratio in zip(apps, ratios)], dtype=bool)
        own[kept] = 0.0  # keeping a DR changes nothing (the one-step estimate is not the fixed point exactly)
        delta = np.where(kept[:, None], 0.0, duty - self.duty[apps])
        reach = (np.abs(delta) > 1e-12).astype(float) @ (self.unshared > 0).T.astype(float)  # changes x apps
        reach[np.arange(len(apps)), apps] = 0.0
        change, app = np.nonzero(reach)
        chunks = self.chunks[app] + self.unshared[app] * self.kappa[app, apps[change]][:, None] * delta[change]
        seconds = self.base[app] + chunks.max(axis=1, initial=0.0)
        others = self.left[app] * (seconds - self.seconds[app]) / self.solo[app]
        rows = np.concatenate([np.arange(len(apps)), change])
        return csr_matrix((np.concatenate([own, others]), (rows, np.concatenate([apps, app]))),
                          shape=(len(apps), len(self.names)))


@dataclass
class Programme:
    """The integer programme of the module docstring: one column per change (an app to one of its
    options, or two apps exchanging DRs) and its effects ``G`` on every app's SD (columns x apps)."""

    effects: csr_matrix
    movers: list[tuple[int, ...]]  # per column, the apps it changes
    taken: list[tuple[DataRatio, ...]]  # ...and the DR each of them takes
    who: np.ndarray  # apps x columns: 1 where the column changes the app
    adds: np.ndarray  # GPUs x columns: how many of its apps the column adds load to the GPU for
    sd: np.ndarray  # every app's predicted SD at finish in the layout now

    @classmethod
    def build(cls, layout: Layout, choices: list[list[DataRatio]]) -> Programme:
        count = len(layout.names)
        apps = np.array([j for j, choices_j in enumerate(choices) for _ in choices_j], dtype=int)
        ratios = [ratio for choices_j in choices for ratio in choices_j]
        index = {(j, ratio): o for o, (j, ratio) in enumerate(zip(apps, ratios))}
        samples = layout.split(apps, ratios)
        effects = layout.effects(apps, ratios, samples)
        pairs = _swaps(layout.ratios, index)
        adds = (samples > layout.samples[apps]).T.astype(float)
        who = np.zeros((count, len(apps)))
        who[apps, np.arange(len(apps))] = 1.0
        if pairs:  # each of the two without the other beside it; the others as for the two moves
            first, second = np.array(pairs, dtype=int).T
            j_moves = [index[j, layout.ratios[k]] for j, k in pairs]
            k_moves = [index[k, layout.ratios[j]] for j, k in pairs]
            swaps = (effects[j_moves] + effects[k_moves]).tolil()
            for mover, partner, moves in ((first, second, j_moves), (second, first, k_moves)):
                stretch = layout.stretch[mover] - layout.kappa[mover, partner][:, None] * layout.duty[partner]
                _, own, _ = layout.own(mover, [ratios[o] for o in moves], stretch, samples[moves])
                swaps[np.arange(len(pairs)), mover] = own
            effects = vstack([effects, swaps.tocsr()]).tocsr()
            adds = np.hstack([adds, adds[:, j_moves] + adds[:, k_moves]])
            pair_who = np.zeros((count, len(pairs)))
            pair_who[first, np.arange(len(pairs))] = pair_who[second, np.arange(len(pairs))] = 1.0
            who = np.hstack([who, pair_who])
        movers = [(int(j),) for j in apps] + pairs
        taken = [(ratio,) for ratio in ratios] + [(layout.ratios[k], layout.ratios[j]) for j, k in pairs]
        return cls(effects, movers, taken, who, adds, layout.sd)

    def value(self, columns: Sequence[int]) -> float | None:
        """The objective of taking ``columns`` (x = 1 there, 0 elsewhere); None if that breaks a constraint."""
        x = np.zeros(len(self.movers))
        x[list(columns)] = 1.0
        change = self.effects.T @ x
        if not np.allclose(self.who @ x, 1.0) or (self.adds @ x > 1.0).any() or change.sum() > 1e-12:
            return None
        return float((self.sd + change).max() + MEAN_WEIGHT * change.sum() / len(self.sd))

    def solve(self, nodes: int, seconds: float) -> list[int]:
        """The columns HiGHS takes within ``seconds`` (an integer answer), else those of its LP
        relaxation (each app's largest, whole)."""
        count, gpus, top = len(self.sd), len(self.adds), len(self.movers)
        mean = np.asarray(self.effects.sum(axis=1)).ravel()  # each column's effect on the sum of the SDs
        matrix = vstack([hstack([-self.effects.T, np.ones((count, 1))]),  # t >= SD0 + G x
                         csr_matrix(np.hstack([self.who, np.zeros((count, 1))])),  # one change per app
                         csr_matrix(np.hstack([self.adds, np.zeros((gpus, 1))])),  # one app adds load per GPU
                         csr_matrix(np.append(mean, 0.0))]).tocsr()  # the mean does not rise
        lower = np.concatenate([self.sd, np.ones(count), np.zeros(gpus), [-np.inf]])
        upper = np.concatenate([np.full(count, np.inf), np.ones(count), np.ones(gpus), [0.0]])
        constraint = LinearConstraint(matrix, lower, upper)
        cost = np.append(MEAN_WEIGHT * mean / count, 1.0)
        bounds = Bounds(np.append(np.zeros(top), -np.inf), np.append(np.ones(top), np.inf))
        result = milp(cost, constraints=constraint, integrality=np.append(np.ones(top), 0), bounds=bounds,
                      options={"node_limit": nodes, "time_limit": seconds})
        if result.x is None:
            result = milp(cost, constraints=constraint, bounds=bounds)
        if result.x is None:
            return []
        taken, covered = [], set()
        for column in np.argsort(-result.x[:top], kind="stable"):
            if result.x[column] > 1e-6 and covered.isdisjoint(self.movers[column]):
                taken.append(int(column))
                covered.update(self.movers[column])
        return taken

    def ratios(self, columns: Sequence[int], current: list[DataRatio]) -> list[DataRatio]:
        """Every app's DR once ``columns`` are taken."""
        chosen = list(current)
        for column in columns:
            for mover, ratio in zip(self.movers[column], self.taken[column]):
                chosen[mover] = ratio
        return chosen


class PlanPolicy:
    """See the module docstring."""

    name = "plan"

    def __init__(self, config: PlanConfig | None = None) -> None:
        self.config = config or PlanConfig()
        self.model: Model | None = None
        self.planned: dict[str, DataRatio] = {}
        self.plan_period = self.config.plan_period  # seconds; the manager's --plan-period sets it

    def decide(self, app: str, trigger: str, snapshot: Snapshot) -> Decision:
        """The app's DR in the current plan (a lookup; its own DR if the plan has none for it). The app
        is asked to notice every ``plan_period``, so that each plan reads a fresh window of it."""
        view = snapshot.app(app)
        planned = self.planned.get(app)
        usable = planned is not None and len(planned) == len(view.ratio) and not violations(
            view, planned, snapshot.config)
        ratio = planned if usable else view.ratio
        return Decision(app, ratio, "plan" if ratio != view.ratio else "keep", next_boundary=self.plan_period)

    def plan(self, trigger: str, snapshot: Snapshot) -> Plan:
        """Learn from the snapshot, solve, and keep the new plan if it pays (see the module docstring)."""
        if self.model is None or self.model.gpu_count != snapshot.config.gpu_count:
            self.model = Model(snapshot.config.gpu_count, self.config.model)
        self.model.learn(snapshot.apps)
        live = {view.name for view in snapshot.apps}
        self.planned = {name: ratio for name, ratio in self.planned.items() if name in live}
        if not any(current_ratio(view, snapshot.config) is not None for view in snapshot.apps):
            return Plan({}, "empty")
        layout = Layout(snapshot, self.model, self.config.change_cost)
        self.model.expect(layout.names, layout.samples, layout.seconds)
        choices = [options(view, ratio, snapshot.config, layout.ratios) for view, ratio in
                   zip(layout.views, layout.ratios)]
        return self._judge(layout, self.solve(layout, choices), trigger)

    def solve(self, layout: Layout, choices: list[list[DataRatio]]) -> list[DataRatio]:
        """Each app's DR in the plan the programme of the module docstring picks."""
        programme = Programme.build(layout, choices)
        columns = programme.solve(self.config.solve_nodes, SOLVE_SHARE * self.plan_period)
        return programme.ratios(columns, layout.ratios)

    def _judge(self, layout: Layout, chosen: list[DataRatio], trigger: str) -> Plan:
        """The plan in full against the layout now: kept if it pays beyond the model's error."""
        changed = np.array([ratio != now for ratio, now in zip(chosen, layout.ratios)])
        if not changed.any():
            return Plan({}, "keep", MappingProxyType({"trigger": trigger}))
        seconds, _ = self.model.times(layout.names, layout.split(range(len(chosen)), chosen))
        before, after = layout.sd, layout.slowdowns(seconds, changed)
        margin = self.model.error * float(np.max(layout.left * seconds / layout.solo, where=changed, initial=0.0))
        gain_max, gain_mean = float(before.max() - after.max()), float(before.mean() - after.mean())
        details = {"trigger": trigger, "max_sd": [_rounded(before.max()), _rounded(after.max())],
                   "mean_sd": [_rounded(before.mean()), _rounded(after.mean())], "margin": _rounded(margin),
                   "error": _rounded(self.model.error), "changes": int(changed.sum())}
        if not ((gain_max > margin and gain_mean >= -margin) or (gain_max >= -margin and gain_mean > margin)):
            return Plan({}, "keep", MappingProxyType(details))
        changes = {layout.names[i]: chosen[i] for i in np.flatnonzero(changed)}
        self.planned.update(changes)
        return Plan(MappingProxyType(changes), "plan", MappingProxyType(details))


@lru_cache(maxsize=65536)
def _split(shares: tuple[int, ...], total: int, batch: int) -> tuple[int, ...]:
    return DataRatio(shares, total).split(batch)


def _swaps(ratios: list[DataRatio], index: dict[tuple[int, DataRatio], int]) -> list[tuple[int, int]]:
    """Pairs of apps with different DRs that may take each other's (both among their options)."""
    return [(j, k) for j in range(len(ratios)) for k in range(j + 1, len(ratios))
            if ratios[j] != ratios[k] and (j, ratios[k]) in index and (k, ratios[j]) in index]


def _eq2(view: AppView) -> tuple[float, float, float]:
    """Elapsed seconds, iterations left and solo-run time of Eq. 2 (elapsed from the record's SD)."""
    left = max(0, view.iterations_total - view.iteration)
    if view.slowdown is None or view.iteration_time is None:
        return 0.0, float(left), view.solo_time
    return max(0.0, view.slowdown * view.solo_time - left * view.iteration_time), float(left), view.solo_time


def _rounded(value: float) -> float | None:
    return round(float(value), 4) if math.isfinite(value) else None
