"""A ``BalancedDataParallel`` backend that runs on emulated GPUs (for machines without CUDA).

Each forward: (1) every chunk's real forward runs on the CPU, one after another, exactly as on
the CPU backend; (2) a *host phase* lasts the model's host time for this batch plus
DataParallel's overhead for this many replicas; the real CPU work done since the last device
phase (backward, optimizer step, data loading, this forward) counts towards it, so on a busy
2-core machine CPU contention is absorbed as long as the host time is long enough; (3) the
*device phase*: each chunk occupies its emulated GPU (``drbalance.emu``) for the model's device
time of that chunk (forward + backward), all chunks at once on their own GPUs, each waiting while
another job holds its GPU. Every time is multiplied by ``time_scale``; each real sample counts as
``sample_scale`` samples of the modelled workload (so small real batches can stand for ImageNet
batches). See docs/emulation.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import nn

from drbalance.client.backends import ChunkPlan, CpuBackend
from drbalance.emu.gpus import EmulatedGpu
from drbalance.ipc.names import IpcNames
from drbalance.models import ModelProfile


class EmulatedBackend(CpuBackend):
    """Chunks run on the CPU, then hold emulated GPUs for their modelled device time."""

    kind = "emulated"

    def __init__(
        self,
        gpu_count: int,
        profile: ModelProfile,
        time_scale: float = 1.0,
        sample_scale: float = 1.0,
        namespace: str | None = None,
    ) -> None:
        if gpu_count < 1:
            raise ValueError(f"need at least one emulated GPU; got {gpu_count}")
        if not time_scale > 0 or not sample_scale > 0:
            raise ValueError(f"time_scale and sample_scale must be > 0; got {time_scale}, {sample_scale}")
        names = IpcNames.current(namespace)
        self.gpus = [EmulatedGpu(names, index) for index in range(gpu_count)]
        self.profile = profile
        self.time_scale = float(time_scale)
        self.sample_scale = float(sample_scale)
        self._pool = ThreadPoolExecutor(max_workers=gpu_count, thread_name_prefix="drbalance-emu")
        self._last_device_end: float | None = None

    def resolve_device_ids(self, device_ids: Sequence[Any] | None, ratio_length: int | None) -> list[int]:
        ids = super().resolve_device_ids(device_ids if device_ids is not None else range(len(self.gpus)), None)
        bad = [d for d in ids if not 0 <= d < len(self.gpus)]
        if bad:
            raise ValueError(f"device_ids {bad} are not among the {len(self.gpus)} emulated GPUs")
        return ids

    def describe(self, device_ids: Sequence[int], slot: int) -> str:
        return f"emu:{device_ids[slot]}"

    def apply(self, module: nn.Module, device_ids: Sequence[int], plan: ChunkPlan,
              chunk_inputs: Sequence[Any], chunk_kwargs: Sequence[dict[str, Any]]):
        outputs, cpu_seconds = self.forward_chunks(module, device_ids, plan, chunk_inputs, chunk_kwargs)
        self._host_phase(plan, sum(cpu_seconds))
        device = [self.time_scale * self.profile.device_seconds(size * self.sample_scale) for size in plan.sizes]
        futures = [self._pool.submit(self.gpus[device_ids[slot]].occupy, seconds)
                   for slot, seconds in zip(plan.slots, device)]
        waits = [future.result() for future in futures]
        self._last_device_end = time.monotonic()
        spans = [cpu + wait + busy for cpu, wait, busy in zip(cpu_seconds, waits, device)]
        return outputs, self.timings(device_ids, plan, spans)

    def _host_phase(self, plan: ChunkPlan, forward_cpu: float) -> None:
        batch = sum(plan.sizes) * self.sample_scale
        target = self.time_scale * (self.profile.host_seconds(batch) + self.profile.overhead_seconds(len(plan.slots)))
        now = time.monotonic()
        spent = now - self._last_device_end if self._last_device_end is not None else forward_cpu
        if target > spent:
            time.sleep(target - spent)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for gpu in self.gpus:
            gpu.close()
