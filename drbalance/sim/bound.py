"""A lower bound on the largest SD that any DR policy can reach under the simulator's model.

Derivation (docs/simulator.md). Let app i arrive at a_i, have solo-run time S_i, plan n_i
iterations of batch B_i. Under any DR policy:

1. *Own speed.* An iteration split over k GPUs, without any contention, takes at least
   ``host(B) + overhead(k) + fixed + per_sample * B / k`` (the largest of k chunks is at least
   B / k samples). So app i needs at least n_i * t_i where t_i is the minimum over k = 1..m, and
   SD_i >= n_i t_i / S_i.
2. *Capacity.* Each iteration needs at least ``fixed + per_sample * B`` seconds of device work
   (one chunk; more chunks only add ``fixed`` each), so app i needs G_i >= n_i (fixed + per_sample B).
   A GPU serves at most ``capacity`` seconds of work per second (1 + co-location gain). If every
   SD is at most s, app i ends by d_i = a_i + s S_i, so for every window [A, D] the apps with
   a_i >= A and d_i <= D need sum G_i <= m * capacity * (D - A). The smallest s for which this
   holds for every A in {a_i} and D in {d_i} (binary search: the condition only relaxes as s
   grows) is a bound.

The bound is max(1., 2.): no run of any DR policy can have max SD below it. It ignores
host-phase overlap limits and chunk granularity, so it can be loose.
"""

from __future__ import annotations

from collections.abc import Sequence

from drbalance.models import model_profile
from drbalance.scenarios import AppSpec, Scenario
from drbalance.sim.model import ContentionModel


def fastest_iteration(app: AppSpec, gpus: int) -> float:
    """The shortest iteration time of ``app`` on ``gpus`` GPUs with no contention (seconds)."""
    profile = model_profile(app.model)
    best = float("inf")
    for k in range(1, gpus + 1):
        largest_chunk = app.batch / k
        best = min(best, profile.host_seconds(app.batch) + profile.overhead_seconds(k)
                   + profile.device_seconds(largest_chunk))
    return best


def device_work(app: AppSpec) -> float:
    return app.iterations * model_profile(app.model).device_seconds(app.batch)


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


def lower_bound(scenario: Scenario, contention: ContentionModel | None = None) -> float:
    """No DR policy can finish the scenario with every SD below this value (under the model)."""
    contention = contention or ContentionModel()
    apps = scenario.apps
    solo = [app.solo_time() for app in apps]
    own = max(app.iterations * fastest_iteration(app, scenario.gpus) / s for app, s in zip(apps, solo))
    work = [device_work(app) for app in apps]
    capacity = scenario.gpus * contention.capacity(2 if len(apps) > 1 else 1)
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
