"""The sharing bound: a lower bound on the largest SD of any DR policy that counts forced co-location.

``drbalance.sim.bound``'s capacity bound lets the GPUs serve their peak total rate all the time.
Under ``gavel`` two heavy jobs active together on one GPU are served *less* in total than one
alone (0.30 + 0.30 of a second of work per second for two ResNet-50s), so the best a capacity
argument can assume is that co-located jobs never overlap; then the bound is about 1.0. But a DR
policy cannot pause a job: every live app is, at every instant, either in its host phase or
has a chunk active on some GPU, and its host phases add up to a fixed amount. With more apps
than GPUs, apps *must* overlap. This module turns that into a linear programme.

Facts about the simulator's model (docs/simulator.md) that hold for every DR policy:

1. An iteration of app i split into k chunks has a host phase of exactly ``h_i + (k - 1) o_i``
   seconds (``o_i``: DataParallel overhead per extra replica) and device work ``w_i + (k - 1) f_i``
   (``w_i = fixed + per_sample x B``, ``f_i = fixed``), with ``1 <= k <= m``. The next iteration
   starts the instant the last chunk ends.
2. So at every instant of its life [a_i, F_i] an app is in its host phase or has at least one
   chunk active on a GPU (no idle gap; a DR policy never suspends it).
3. A GPU of speed v whose set of active chunks is S serves app i's chunk at ``v x r_i(S)``
   seconds of work per second, where ``r(S)`` is the interference model's ``rates`` (exactly
   what the engine uses; an app has at most one chunk per GPU at a time).
4. SD_i = (F_i - a_i) / S_i with S_i = n_i (h_i + w_i) the solo time.

Suppose every SD is at most s and the apps (all arriving at the same time a) finish in the order
pi. Cut the run at the finish times into phases k = 1..N of lengths tau_k; in phase k the live
apps are L_k = {pi_k, ..., pi_N}. Variables, per phase: ``y[k, c, S]``, the GPU-seconds that GPUs of
speed class c spend with exactly the apps S (a non-empty subset of L_k) active; per app and phase:
``it[i, k]``, the iterations app i starts in phase k, and ``ex[i, k]``, their extra chunks
(sum of k - 1). Necessary conditions:

- capacity: ``sum_S y[k, c, S] <= m_c tau_k`` (m_c GPUs of speed v_c, one state each at a time);
- work: the work served to i in phase k, ``sum_{c, S containing i} v_c r_i(S) y[k, c, S]``, is at
  least that of the iterations it starts in the phase, less the one still running at the
  phase's end: ``>= w_i it + f_i ex - (w_i + (m - 1) f_i)``;
- presence (fact 2): ``tau_k <= host time in phase k + sum_{c, S containing i} y[k, c, S]`` (an
  app active on two GPUs is counted twice: the sum only over-counts), and the host time in
  phase k is at most that of the iterations started in it plus the one running into it:
  ``<= h_i it + o_i ex + (h_i + (m - 1) o_i)``;
- own speed: every iteration started in phase k but the last ends in it, and none is shorter
  than ``t_i``, the fastest iteration with no contention (``drbalance.sim.bound``'s 1.):
  ``tau_k >= t_i (it[i, k] - 1)``;
- ``ex[i, k] <= (m - 1) it[i, k]``, ``sum_k it[i, k] = n_i``;
- deadlines: ``tau_1 + ... + tau_{p(i)} <= s S_i`` where p(i) is i's place in pi.

Iterations and chunk counts are relaxed to real numbers and the timing within a phase is
forgotten (the programme may interleave host phases perfectly, which the simulator's apps,
falling into step, do not), so the minimum s of the programme for order pi is a lower bound on
the max SD of every run that finishes in that order; the minimum over all orders bounds every
run. The programme has ``s`` as a variable (the deadlines are linear in it), so each order is one
LP (``drbalance.sim.lp``: SciPy's HiGHS solver); orders that differ only by swapping identical apps are solved once.

Limits: apps must all arrive at the same time (the paper's scenarios do), and N is kept small
(at most ``MAX_APPS``; the states grow as 2^N), and by default at most ``MAX_ORDERS`` distinct
finish orders are solved (scenario (b): 30 and (a): 90, under a second; (c): 720 needs
``max_orders=None``, about 4 s): otherwise ``sharing_bound`` returns None and only the capacity bound applies.

How loose it is. The programme lets an app be "present" wherever it is cheapest: it can satisfy
presence in a crowded state on one GPU (rates near 0: a parked app) while the other GPUs serve
apps alone, and it places host phases freely within a phase. A real DR policy could only come
near that by moving DRs every iteration with exact knowledge of every phase; the policies here
decide every 1% of a solo run. So the bound is valid for every DR policy but far from what
policies that move slowly can reach.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from drbalance.sim.lp import solve_lp
from drbalance.sim.model import ContentionModel, Interference
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario

MAX_APPS = 7
MAX_ORDERS = 120  # by default; each order is one LP (a few milliseconds with HiGHS)


@dataclass(frozen=True)
class AppTerms:
    """One app's constants for the programme (seconds): host ``h``, device work ``w`` of one
    whole-batch chunk, ``fixed`` work and ``overhead`` host time per extra chunk, solo time, and
    ``fastest``, the shortest possible iteration (no contention, best split)."""

    iterations: int
    host: float
    work: float
    fixed: float
    overhead: float
    solo: float
    fastest: float

    @classmethod
    def of(cls, app: AppSpec, speeds: Sequence[float]) -> AppTerms:
        from drbalance.sim.bound import fastest_iteration  # bound.py imports this module

        costs = model_costs(app.model)
        return cls(app.iterations, costs.host_seconds(app.batch), costs.device_seconds(app.batch), costs.fixed,
                   costs.dp_overhead, app.solo_time(), fastest_iteration(app, speeds))


@dataclass(frozen=True)
class SharingBound:
    """The bound (max SD), the finish order that attains it, and how many orders were solved."""

    value: float
    order: tuple[str, ...]
    orders_solved: int


def order_bound(terms: Sequence[AppTerms], rates: dict[tuple[int, ...], tuple[float, ...]],
                classes: Sequence[tuple[float, int]], order: Sequence[int]) -> float:
    """The programme's minimum s for one finish order (indices into ``terms``).

    ``rates[S]``: per-chunk service rates (speed 1) of the apps in the sorted tuple S, active
    together; ``classes``: (speed, count) of the GPUs.
    """
    n_apps = len(terms)
    gpus = sum(count for _, count in classes)
    unit = max(t.solo for t in terms)  # times in units of the longest solo run, iterations as fractions
    place = {app: k for k, app in enumerate(order)}
    # variable layout
    index: dict[tuple, int] = {}

    def var(key: tuple) -> int:
        if key not in index:
            index[key] = len(index)
        return index[key]

    var(("s",))
    for k in range(n_apps):
        var(("tau", k))
    states = []
    for k in range(n_apps):
        live = sorted(order[k:])
        for size in range(1, len(live) + 1):
            for subset in itertools.combinations(live, size):
                for c in range(len(classes)):
                    states.append((k, c, subset))
                    var(("y", k, c, subset))
    for i in range(n_apps):
        for k in range(place[i] + 1):
            var(("it", i, k))
            var(("ex", i, k))
    width = len(index)
    ub_rows: list[np.ndarray] = []
    ub_values: list[float] = []
    eq_rows: list[np.ndarray] = []
    eq_values: list[float] = []

    def row(entries: dict[int, float]) -> np.ndarray:
        vector = np.zeros(width)
        for column, value in entries.items():
            vector[column] += value
        return vector

    for i, t in enumerate(terms):  # deadlines
        entries = {index[("tau", k)]: 1.0 for k in range(place[i] + 1)}
        entries[index[("s",)]] = -t.solo / unit
        ub_rows.append(row(entries))
        ub_values.append(0.0)
    for k in range(n_apps):  # capacity
        for c, (_, count) in enumerate(classes):
            entries = {index[("y", kk, cc, subset)]: 1.0 for kk, cc, subset in states if kk == k and cc == c}
            entries[index[("tau", k)]] = -float(count)
            ub_rows.append(row(entries))
            ub_values.append(0.0)
    by_app_phase: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for k, c, subset in states:
        speed = classes[c][0]
        for position, app in enumerate(subset):
            by_app_phase.setdefault((app, k), []).append((index[("y", k, c, subset)], speed * rates[subset][position]))
    for i, t in enumerate(terms):
        for k in range(place[i] + 1):
            it, ex = index[("it", i, k)], index[("ex", i, k)]
            served = by_app_phase[(i, k)]
            n = t.iterations / unit
            work = row({it: t.work * n, ex: t.fixed * n})  # work of the iterations started <= served + one
            for column, rate in served:
                work[column] -= rate
            ub_rows.append(work)
            ub_values.append((t.work + (gpus - 1) * t.fixed) / unit)
            presence = row({index[("tau", k)]: 1.0, it: -t.host * n, ex: -t.overhead * n})
            for column, _ in served:
                presence[column] -= 1.0
            ub_rows.append(presence)
            ub_values.append((t.host + (gpus - 1) * t.overhead) / unit)
            ub_rows.append(row({ex: 1.0, it: -(gpus - 1.0)}))
            ub_values.append(0.0)
            ub_rows.append(row({it: t.fastest * n, index[("tau", k)]: -1.0}))
            ub_values.append(t.fastest / unit)
        eq_rows.append(row({index[("it", i, k)]: 1.0 for k in range(place[i] + 1)}))
        eq_values.append(1.0)
    objective = np.zeros(width)
    objective[index[("s",)]] = 1.0
    result = solve_lp(objective, np.array(ub_rows), np.array(ub_values), np.array(eq_rows), np.array(eq_values))
    if result.status != "optimal" or result.objective is None:
        raise RuntimeError(f"sharing bound: the programme for order {list(order)} is {result.status}")
    return result.objective


def distinct_orders(apps: Sequence[AppSpec]) -> list[tuple[int, ...]]:
    """Finish orders of the apps, one per sequence of kinds (identical apps are interchangeable)."""
    kinds = [(app.model, app.batch, app.iterations) for app in apps]
    seen: set[tuple] = set()
    orders = []
    for order in itertools.permutations(range(len(apps))):
        key = tuple(kinds[i] for i in order)
        if key not in seen:
            seen.add(key)
            orders.append(order)
    return orders


def state_rates(apps: Sequence[AppSpec], contention: Interference) -> dict[tuple[int, ...], tuple[float, ...]]:
    """The interference model's per-chunk rates for every non-empty set of the apps active together."""
    workloads = [(app.model, app.batch) for app in apps]
    rates = {}
    for size in range(1, len(apps) + 1):
        for subset in itertools.combinations(range(len(apps)), size):
            rates[subset] = tuple(contention.rates([workloads[i] for i in subset]))
    return rates


def sharing_bound(scenario: Scenario, contention: Interference | None = None,
                  max_orders: int | None = MAX_ORDERS) -> SharingBound | None:
    """The sharing bound of the scenario (module docstring), or None where it is not computed:
    apps arriving at different times, more than ``MAX_APPS`` apps, or more distinct finish orders
    than ``max_orders`` (None: no limit; scenario (c)'s 720 orders take about 4 s)."""
    contention = contention or ContentionModel()
    apps = scenario.apps
    if len(apps) > MAX_APPS or len({app.arrival for app in apps}) != 1:
        return None
    speeds = [scenario.speed(g) for g in range(scenario.gpus)]
    classes = [(speed, speeds.count(speed)) for speed in sorted(set(speeds), reverse=True)]
    terms = [AppTerms.of(app, speeds) for app in apps]
    rates = state_rates(apps, contention)
    best, best_order = float("inf"), ()
    orders = distinct_orders(apps)
    if max_orders is not None and len(orders) > max_orders:
        return None
    for order in orders:
        value = order_bound(terms, rates, classes, order)
        if value < best:
            best, best_order = value, order
    return SharingBound(best, tuple(apps[i].name for i in best_order), len(orders))
