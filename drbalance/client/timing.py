"""Per-replica timings of the last forward pass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaTiming:
    """How long one replica's forward took.

    ``slot`` is the index into the data ratio (and ``device_ids``); ``device`` names where it ran
    (``cuda:2``, ``cpu``, ``emu:2``); ``samples`` is the chunk size; ``seconds`` the forward time
    (CUDA events on a GPU, wall clock on the CPU; on emulated GPUs the wall time of the replica's
    device phase: the wait for the emulated GPU and the emulated device time, not the real CPU
    forward, which is host work there).
    """

    slot: int
    device: str
    samples: int
    seconds: float
