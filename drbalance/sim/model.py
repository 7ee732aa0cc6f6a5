"""The simulator's model of iteration time and GPU contention (docs/simulator.md).

One iteration of an app with batch B and DR split into chunks b_g (k of them non-empty):

1. Host phase (no GPU): ``host_ratio * device(B) + dp_overhead * (k - 1)`` seconds.
2. Device phase: chunk g needs ``fixed + per_sample * b_g`` seconds of GPU g alone; all chunks
   start together; the iteration ends when the last chunk ends.
3. Contention: each GPU is processor-shared by the chunks on it. With n chunks active, the GPU
   serves ``capacity(n)`` seconds of work per second in total, split equally: capacity(1) = 1,
   capacity(n >= 2) = ``co_location_capacity`` (>= 1 when co-located kernels overlap; 1 = pure
   time slicing).
4. Utilisation (as NVML reports it): the fraction of a sample period during which at least one
   chunk was active on the GPU.

Per-model parameters come from ``drbalance.models`` (calibrated there); the co-location
capacity is fitted by ``drbalance.sim.calibration`` to Gavel's measured pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from drbalance.models import CO_LOCATION_CAPACITY


@dataclass(frozen=True)
class ContentionModel:
    co_location_capacity: float = CO_LOCATION_CAPACITY

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
