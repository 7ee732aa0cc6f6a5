"""A lower bound on the largest SD that any DR policy can reach under the simulator's model.

Derivation (docs/simulator.md). Let app i arrive at a_i, have solo-run time S_i, plan n_i
iterations of batch B_i. Under any DR policy:

1. *Own speed.* An iteration split over k GPUs, without any contention, takes at least
   ``host(B) + overhead(k) + fixed / v_max + per_sample * B / V_k``, where v_max is the fastest
   GPU's speed and V_k the summed speed of the k fastest (the chunks cannot all finish sooner
   than the whole batch served by those k GPUs at once). So app i needs at least n_i * t_i where
   t_i is the minimum over k = 1..m, and SD_i >= n_i t_i / S_i.
2. *Capacity.* Each iteration needs at least ``fixed + per_sample * B`` seconds of device work
   (one chunk; more chunks only add ``fixed`` each), so app i needs G_i >= n_i (fixed + per_sample B).
   GPU g serves at most ``speed_g * peak`` seconds of work per second, where ``peak`` is the
   interference model's largest total service rate for the scenario's workloads (the
   calibrated model: the co-location capacity). If every SD is at most s, app i ends by
   d_i = a_i + s S_i, so for every window [A, D] the apps with a_i >= A and d_i <= D need
   sum G_i <= sum_g speed_g * peak * (D - A). The smallest s for which this holds for every A in
   {a_i} and D in {d_i} (binary search: the condition only relaxes as s grows) is a bound.

The capacity bound is max(1., 2.). It ignores that apps cannot pause, so under ``gavel`` (where
two heavy jobs overlapping on a GPU are served less than one alone) it stays near 1.0.

3. *Sharing* (``drbalance.sim.sharing_bound``, apps arriving together, at most 7 apps and 120
   distinct finish orders unless asked for more): a linear
   programme per finish order that counts the co-location forced on apps that can never pause
   (every live app is in its host phase or has a chunk active), with the interference model's
   rates for every set of apps active together.

``lower_bound`` is the largest of the three: no run of any DR policy can have max SD below it.
``bounds`` gives each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drbalance.sim.model import ContentionModel, Interference
from drbalance.sim.sharing_bound import SharingBound, sharing_bound
from drbalance.workload.models import model_costs
from drbalance.workload.scenarios import AppSpec, Scenario


def fastest_iteration(app: AppSpec, speeds: Sequence[float]) -> float:
    """The shortest iteration time of ``app`` on GPUs of these speeds with no contention (seconds)."""
    costs = model_costs(app.model)
    fastest = sorted(speeds, reverse=True)
    best = float("inf")
    for k in range(1, len(fastest) + 1):
        device = costs.fixed / fastest[0] + costs.per_sample * app.batch / sum(fastest[:k])
        best = min(best, costs.host_seconds(app.batch) + costs.overhead_seconds(k) + device)
    return best


def device_work(app: AppSpec) -> float:
    return app.iterations * model_costs(app.model).device_seconds(app.batch)


def _feasible(apps: Sequence[AppSpec], solo: Sequence[float], work: Sequence[float], bound: float,
              capacity: float) -> bool:
    deadlines = [app.arrival + bound * s for app, s in zip(apps, solo)]
    for start in sorted({app.arrival for app in apps}):
        for end in sorted(set(deadlines)):
            if end <= start:
                continue
            needed = sum(w for app, w, d in zip(apps, work, deadlines) if app.arrival >= start and d <= end)
            if needed > capacity * (end - start) * (1 + 1e-12):
                return False
    return True


@dataclass(frozen=True)
class Bounds:
    """The lower bounds on the max SD of any DR policy: ``capacity`` (own speed and capacity) and
    ``sharing`` (None where it does not apply); ``value`` is the largest."""

    capacity: float
    sharing: SharingBound | None

    @property
    def value(self) -> float:
        return max(self.capacity, self.sharing.value if self.sharing is not None else 0.0)


def bounds(scenario: Scenario, contention: Interference | None = None) -> Bounds:
    """Both lower bounds of the scenario under the interference model (default: calibrated)."""
    contention = contention or ContentionModel()
    return Bounds(capacity_bound(scenario, contention), sharing_bound(scenario, contention))


def lower_bound(scenario: Scenario, contention: Interference | None = None) -> float:
    """No DR policy can finish the scenario with every SD below this value (under the model)."""
    return bounds(scenario, contention).value


def capacity_bound(scenario: Scenario, contention: Interference | None = None) -> float:
    """The own-speed and capacity bound (1. and 2. of the module docstring)."""
    contention = contention or ContentionModel()
    apps = scenario.apps
    speeds = [scenario.speed(g) for g in range(scenario.gpus)]
    solo = [app.solo_time() for app in apps]
    own = max(app.iterations * fastest_iteration(app, speeds) / s for app, s in zip(apps, solo))
    work = [device_work(app) for app in apps]
    capacity = sum(speeds) * contention.peak_capacity([(app.model, app.batch) for app in apps])
    low, high = 0.0, max(own, 1.0)
    while not _feasible(apps, solo, work, high, capacity):
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        if _feasible(apps, solo, work, middle, capacity):
            high = middle
        else:
            low = middle
    return max(own, high)
