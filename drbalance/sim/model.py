"""The simulator's model of iteration time and GPU contention (docs/simulator.md).

One iteration of an app with batch B and DR split into chunks b_g (k of them non-empty):

1. Host phase (no GPU): ``host_ratio * device(B) + dp_overhead * (k - 1)`` seconds.
2. Device phase: chunk g needs ``fixed + per_sample * b_g`` seconds of work on a GPU of speed 1;
   all chunks start together; the iteration ends when the last chunk ends.
3. Contention: the chunks active on one GPU share it. An *interference model* says how much
   work per second each active chunk gets, given which workloads are active together; a GPU of
   speed s serves s times that. Two models:

   - ``calibrated`` (``ContentionModel``): with n >= 2 chunks active the GPU serves
     ``co_location_capacity`` seconds of work per second, split equally (1 when alone). One number
     for every pair of models, fitted to Gavel's median pair speed.
   - ``gavel`` (``drbalance.sim.interference.GavelInterference``): per pair of workloads, from
     Gavel's measured co-located throughputs (some pairs keep far less than half their speed).
4. Utilisation (as NVML reports it): the fraction of a sample period during which at least one
   chunk was active on the GPU.

Per-model parameters come from ``drbalance.workload.models`` (calibrated there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from drbalance.workload.models import CO_LOCATION_CAPACITY

Workload = tuple[str, int]
"""What runs on a GPU, for the interference model: (model name, batch of the app)."""


class Interference(Protocol):
    """How co-located chunks share one GPU of speed 1."""

    name: str

    def rates(self, workloads: Sequence[Workload]) -> tuple[float, ...]:
        """Seconds of device work served per second to each active chunk (same order)."""
        ...

    def peak_capacity(self, workloads: Sequence[Workload]) -> float:
        """The most device work per second one GPU of speed 1 can serve in total to any of these
        workloads together (for the lower bound)."""
        ...


@dataclass(frozen=True)
class ContentionModel:
    """The ``calibrated`` model: one co-location capacity for every pair of workloads."""

    co_location_capacity: float = CO_LOCATION_CAPACITY
    name = "calibrated"

    def __post_init__(self) -> None:
        if not 1.0 <= self.co_location_capacity <= 4.0:
            raise ValueError(f"co_location_capacity must be within 1..4; got {self.co_location_capacity}")

    def capacity(self, active: int) -> float:
        """Seconds of device work served per second on a GPU with ``active`` chunks."""
        if active <= 0:
            return 0.0
        return 1.0 if active == 1 else self.co_location_capacity

    def rate(self, active: int) -> float:
        """Per-chunk service rate with ``active`` chunks."""
        return self.capacity(active) / active if active > 0 else 0.0

    def rates(self, workloads: Sequence[Workload]) -> tuple[float, ...]:
        return (self.rate(len(workloads)),) * len(workloads)

    def peak_capacity(self, workloads: Sequence[Workload]) -> float:
        return self.co_location_capacity if len(set(workloads)) > 1 or len(workloads) > 1 else 1.0


def _gavel() -> Interference:
    from drbalance.sim.interference import GavelInterference

    return GavelInterference.load()


INTERFERENCE_MODELS: Mapping[str, Callable[[], Interference]] = MappingProxyType({
    "calibrated": ContentionModel,
    "gavel": _gavel,
})


def make_interference(name: str) -> Interference:
    """An interference model by name (``calibrated`` or ``gavel``)."""
    try:
        return INTERFERENCE_MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown interference model {name!r}; known: {', '.join(INTERFERENCE_MODELS)}") from None
