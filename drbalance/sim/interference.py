"""Per-pair interference from Gavel's measured co-located throughputs (``--interference gavel``).

Gavel (OSDI'20) measured, on a V100, the throughput of each of two jobs sharing one GPU. Its
table (``gavel_pairs.json``, the ResNet-18 and ResNet-50 rows, copied unchanged) gives, for a
pair (X, Y), the share of its solo speed that X keeps: ``s_XY = pair[X][Y][0] / solo[X]``.
ResNet-50 pairs keep as little as 0.29-0.50 each: together less than one job alone.

Which entries are used:

- Excluded: placeholders (the pair value equals the solo value exactly, 80 of 676 single-GPU
  pairs on the V100) and pairs that were not runnable (``[0, 0]``). For an excluded (X, Y) the
  measured (Y, X) entry is used if there is one, else the nearest measured pair of the same two
  families (by batch size, on a log scale; a job paired with itself falls back to the nearest
  measured job paired with itself).
- Our models map to Gavel's jobs by weight (an assumption, documented in docs/simulator.md):
  the heavy ImageNet CNNs (ResNet-50, DenseNet-121, ResNeXt-50) to ``ResNet-50`` and the light
  ones (AlexNet, ShuffleNet V2, MnasNet) to ``ResNet-18``, at the nearest measured batch size.
  A model outside the table is heavy when its per-sample device time is at least half of
  ResNet-50's.

From shares to service rates. In the simulator an app alternates a host phase h (no GPU) and a
device phase of w seconds of work. While both apps of a pair are in their device phase, X's
chunk is served at rate ``x_XY`` (Y's at ``x_YX``), else at 1. If the other app's device phase
overlapped a fraction d_Y of X's at random (its duty cycle), X's device phase would last
``D_X = w_X / (1 - d_Y + d_Y x_XY)``, and its speed share would be ``(h_X + w_X) / (h_X + D_X)``;
given the measured shares this solves in closed form for both rates (``pair_rates``). The
simulated phases do not overlap at random (co-located apps fall into step), so the rates are
then refined by simulating the pair until it keeps the measured shares (``fit_pair``, within 2%).
The refined rates of our models' usual workloads are stored in ``gavel_rates.json``
(``python -m drbalance.sim.calibration --fit-gavel`` rewrites it); other pairs are refined on
first use. With three or
more chunks active (Gavel measured pairs only), the stretches add: X's chunk takes
``1 + sum over the others Y of (1 / x_XY - 1)`` times as long as alone, and the rates are scaled
down if their total would exceed the largest total rate of their pairs (``peak_capacity``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from drbalance.sim.model import Workload
from drbalance.workload.models import model_costs

log = logging.getLogger(__name__)

DATA = Path(__file__).with_name("gavel_pairs.json")
RATES = Path(__file__).with_name("gavel_rates.json")
HEAVY = frozenset({"resnet50", "densenet121", "resnext50_32x4d"})
LIGHT = frozenset({"alexnet", "shufflenet_v2_x1_0", "mnasnet1_0"})
MIN_RATE = 0.02  # a pair measured slower than total blocking would imply still makes progress


def family_of(model: str) -> str:
    """Gavel's job family standing in for one of our models."""
    if model in HEAVY:
        return "ResNet-50"
    if model in LIGHT:
        return "ResNet-18"
    reference = model_costs("resnet50").per_sample
    return "ResNet-50" if model_costs(model).per_sample >= 0.5 * reference else "ResNet-18"


def _job(family: str, batch: int) -> str:
    return f"{family} (batch size {batch})"


@dataclass(frozen=True)
class GavelTable:
    """Gavel's solo and pair throughputs (steps per second) for the jobs in ``gavel_pairs.json``."""

    solo: Mapping[str, float]
    pairs: Mapping[str, Mapping[str, Sequence[float]]]

    @classmethod
    def load(cls, path: Path = DATA) -> GavelTable:
        data = json.loads(path.read_text())
        return cls(data["solo"], data["pairs"])

    def batches(self, family: str) -> list[int]:
        prefix = family + " (batch size "
        return sorted(int(job[len(prefix):-1]) for job in self.solo if job.startswith(prefix))

    def job_for(self, workload: Workload) -> str:
        model, batch = workload
        family = family_of(model)
        nearest = min(self.batches(family), key=lambda b: (abs(math.log2(b / batch)), b))
        return _job(family, nearest)

    def measured(self, first: str, second: str) -> tuple[float, float] | None:
        """(share of solo speed kept by ``first``, by ``second``), or None if excluded."""
        pair = self.pairs.get(first, {}).get(second)
        if not pair or pair == [0.0, 0.0] or pair[0] == self.solo[first] or pair[1] == self.solo[second]:
            return None
        return pair[0] / self.solo[first], pair[1] / self.solo[second]

    def shares(self, first: str, second: str) -> tuple[float, float]:
        """The shares used for a pair: measured, else its mirror, else the nearest measured pair."""
        direct = self.measured(first, second)
        if direct is not None:
            return direct
        mirror = self.measured(second, first)
        if mirror is not None:
            return mirror[1], mirror[0]
        family_a, batch_a = _split(first)
        family_b, batch_b = _split(second)
        candidates = []
        for a in self.batches(family_a):
            for b in self.batches(family_b):
                if first == second and a != b:
                    continue  # a job paired with itself stands in for a job paired with itself
                found = self.measured(_job(family_a, a), _job(family_b, b))
                if found is not None:
                    distance = abs(math.log2(a / batch_a)) + abs(math.log2(b / batch_b))
                    candidates.append((distance, a, b, found))
        if not candidates:
            raise ValueError(f"no measured Gavel pair for {first!r} and {second!r}")
        return min(candidates)[3]


def _split(job: str) -> tuple[str, int]:
    family, _, rest = job.partition(" (batch size ")
    return family, int(rest.rstrip(")"))


def pair_rates(share_a: float, share_b: float, host_a: float, work_a: float, host_b: float,
               work_b: float) -> tuple[float, float]:
    """Service rates while both device phases overlap, from the measured speed shares (closed form).

    ``host_*`` and ``work_*`` are seconds per iteration on the host and of device work alone.
    """
    device_a = (host_a + work_a) / share_a - host_a
    device_b = (host_b + work_b) / share_b - host_b
    duty_a = device_a / (host_a + device_a)
    duty_b = device_b / (host_b + device_b)
    rate_a = (work_a / device_a - (1.0 - duty_b)) / duty_b
    rate_b = (work_b / device_b - (1.0 - duty_a)) / duty_a
    return min(1.0, max(MIN_RATE, rate_a)), min(1.0, max(MIN_RATE, rate_b))


def measured_shares(table: GavelTable, first: Workload, second: Workload) -> tuple[float, float]:
    """The speed shares Gavel measured for the jobs standing in for these two workloads."""
    return table.shares(table.job_for(first), table.job_for(second))


def fit_pair(table: GavelTable, first: Workload, second: Workload, rounds: int = 8,
             tolerance: float = 0.02) -> tuple[float, float]:
    """Service rates with which the simulated pair keeps Gavel's measured speed shares.

    Starts from the closed form and corrects each rate by the ratio of measured to simulated
    share (``simulated_shares``: the pair alone on one GPU, both running throughout), at most
    ``rounds`` times. A pair still further off than ``tolerance`` after that is logged as a
    warning (naming the pair and how far each share is off) and keeps the last rates.
    """
    wanted = measured_shares(table, first, second)
    costs_a, costs_b = model_costs(first[0]), model_costs(second[0])
    rates = pair_rates(wanted[0], wanted[1], costs_a.host_seconds(first[1]), costs_a.device_seconds(first[1]),
                       costs_b.host_seconds(second[1]), costs_b.device_seconds(second[1]))
    for _ in range(rounds):
        errors = _share_errors(wanted, simulated_shares(first, second, rates))
        if all(abs(error - 1.0) <= tolerance for error in errors):
            return rates[0], rates[1]
        rates = tuple(min(1.0, max(MIN_RATE, rate * error ** 1.5)) for rate, error in zip(rates, errors))
    errors = _share_errors(wanted, simulated_shares(first, second, rates))
    if any(abs(error - 1.0) > tolerance for error in errors):
        log.warning("the gavel pair %s + %s did not converge in %d rounds: the simulated shares are off "
                    "Gavel's by %+.1f%% and %+.1f%% (tolerance %.1f%%)", first, second, rounds,
                    100 * (1 / errors[0] - 1), 100 * (1 / errors[1] - 1), 100 * tolerance)
    return rates[0], rates[1]


def _share_errors(wanted: Sequence[float], got: Sequence[float]) -> list[float]:
    """Measured over simulated share, per job of a pair (1: exact)."""
    return [want / have for want, have in zip(wanted, got)]


def simulated_shares(first: Workload, second: Workload, rates: tuple[float, float],
                     iterations: int = 200) -> tuple[float, float]:
    """The share of its solo speed each of a pair keeps while both run on one GPU, simulated with
    these service rates: iterations finished per second of each job, up to its last iteration
    finished before either job's plan ends, times its solo iteration time (dimensionless).

    Gavel measured both jobs running throughout. Both plans are therefore long and the pair is
    simulated until each has finished ``iterations`` iterations; stopping when one job's plan
    ends instead (plans of equal length) would let the faster job finish first and the slower
    one run its last iterations alone, counting solo speed as shared speed.
    """
    from drbalance.sim.engine import SimConfig, Simulation
    from drbalance.workload.scenarios import AppSpec, Scenario  # the engine imports this module

    solo = (model_costs(first[0]).solo_iteration(first[1]), model_costs(second[0]).solo_iteration(second[1]))
    plan = 1000 * iterations  # never reached: the run stops long before
    apps = (AppSpec("x", first[0], first[1], 1, plan, (10,)), AppSpec("y", second[0], second[1], 1, plan, (10,)))
    simulation = Simulation(Scenario("pair", 1, apps), SimConfig(policy="observe", record=False,
                                                                 contention=_FixedPair(first, second, rates)))
    simulation.start()
    step = 10 * max(solo)  # seconds of simulated time per advance
    while min(app.tracker.done for app in simulation.apps) < iterations:
        simulation.advance(simulation.now + step)
    shares = []
    for app, seconds in zip(simulation.apps, solo):
        tracker = app.tracker
        shares.append(tracker.done * seconds / (tracker.last_mark - tracker.start))
    return shares[0], shares[1]


class _FixedPair:
    """An interference model for one pair with given rates (used while fitting)."""

    name = "fixed-pair"

    def __init__(self, first: Workload, second: Workload, rates: tuple[float, float]) -> None:
        self.rates_of = {first: rates[0], second: rates[1]}
        self.same = first == second

    def rates(self, workloads: Sequence[Workload]) -> tuple[float, ...]:
        if len(workloads) == 1:
            return (1.0,)
        if self.same:
            return (self.rates_of[workloads[0]],) * 2
        return tuple(self.rates_of[w] for w in workloads)

    def peak_capacity(self, workloads: Sequence[Workload]) -> float:
        return 2.0


class GavelInterference:
    """The ``gavel`` interference model (see the module docstring). Pair rates are cached per object."""

    name = "gavel"

    def __init__(self, table: GavelTable) -> None:
        self.table = table
        self._pairs: dict[tuple[Workload, Workload], tuple[float, float]] = {}

    @classmethod
    def load(cls, path: Path = DATA) -> GavelInterference:
        model = cls(GavelTable.load(path))
        model.preload()
        return model

    def pair(self, first: Workload, second: Workload) -> tuple[float, float]:
        """Service rates of (first, second) while both are active on one GPU."""
        key = (first, second)
        if key not in self._pairs:
            rates = fit_pair(self.table, first, second)
            self._pairs[(second, first)] = (rates[1], rates[0])
            self._pairs[key] = rates
        return self._pairs[key]

    def preload(self, path: Path = RATES) -> None:
        """Take the stored refined rates (see ``gavel_rates.json``) instead of fitting them again."""
        if not path.exists():
            return
        for entry in json.loads(path.read_text())["pairs"]:
            first, second = (entry["first"][0], entry["first"][1]), (entry["second"][0], entry["second"][1])
            rates = (entry["rates"][0], entry["rates"][1])
            self._pairs[(first, second)] = rates
            self._pairs[(second, first)] = (rates[1], rates[0])

    def rates(self, workloads: Sequence[Workload]) -> tuple[float, ...]:
        count = len(workloads)
        if count == 1:
            return (1.0,)
        stretch = [1.0] * count
        peak = 1.0
        for i in range(count):
            for j in range(i + 1, count):
                rate_i, rate_j = self.pair(workloads[i], workloads[j])
                stretch[i] += 1.0 / rate_i - 1.0
                stretch[j] += 1.0 / rate_j - 1.0
                peak = max(peak, rate_i + rate_j)
        rates = [1.0 / value for value in stretch]
        total = sum(rates)
        if count > 2 and total > peak:
            rates = [rate * peak / total for rate in rates]
        return tuple(rates)

    def peak_capacity(self, workloads: Sequence[Workload]) -> float:
        """The largest total service rate of any pair among ``workloads`` (at least 1)."""
        distinct = sorted(set(workloads))
        return max([1.0] + [sum(self.pair(a, b)) for a in distinct for b in distinct])
