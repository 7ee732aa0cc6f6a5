"""Per-replica timings of the last forward pass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaTiming:
    """How long one replica's chunk kept its device busy.

    ``slot`` is the index into the data ratio (and ``device_ids``); ``device`` names where it ran
    (``cuda:2``, ``cpu``, ``emu:2``); ``samples`` is the chunk size; ``seconds`` the device time:
    on a GPU the forward and the backward by CUDA events (the forward alone until the backward
    has run, or without one; ``drbalance.client.cuda_timing``); on emulated GPUs the wall time of
    the replica's device phase, forward and backward: the wait for the emulated GPU and the
    emulated device time, not the real CPU forward, which is host work there; on the CPU the
    forward's wall clock.
    """

    slot: int
    device: str
    samples: int
    seconds: float
