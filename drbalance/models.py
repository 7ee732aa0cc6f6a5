"""Per-model timing profiles of the paper's six models, shared by the emulated GPUs and the simulator.

Times are seconds on the paper's GPU class (Quadro RTX 6000; the public stand-in is the TITAN
RTX, the same TU102 chip), FP32, forward + backward of one iteration. Derivation (every source is
in ../shared/data/README.md; the full table and its caveats are in docs/calibration.md):

- ``t12``: one GPU, 12 images, TITAN RTX (ryujaehun/pytorch-gpu-benchmark). AlexNet is missing
  there; it is taken as 0.1406 x ResNet-50, the AlexNet / ResNet-50 ratio of jcjohnson/cnn-benchmarks.
- Device time of a chunk of b samples: ``fixed + per_sample * b``. The split of ``t12`` into a
  fixed and a per-sample part uses the one linear fit in the data: Pollux's ImageNet ResNet-50,
  0.061 s + 4.3 ms/sample, whose fixed part is 54% of its 12-sample time. The same 54% is assumed
  for every model (an assumption; only ResNet-50 has two batch sizes in the data).
- DataParallel overhead per extra replica: ``(t(4 GPUs) - t(1 GPU)) / 3`` from the same table,
  where each GPU holds 12 images either way, so the growth is DataParallel's own cost (scatter,
  replicate, gather). AlexNet: assumed 20 ms (no data).
- Host time per iteration (data loading, optimizer, Python), during which the GPU idles:
  ``host_ratio * device(batch)``. Gavel's v100 pairs keep a median 0.68 of solo speed when two
  jobs share a GPU; if a job keeps its GPU busy a fraction f of the time and sharing interleaved
  the busy parts perfectly, 2f = 1 / 0.68, f = 0.735, so host / device = (1 - f) / f = 0.36.
  Processor sharing does not interleave perfectly, so a co-location capacity above 1 is fitted
  as well (``CO_LOCATION_CAPACITY``) to reproduce the 0.68.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

FIXED_FRACTION_AT_12 = 0.061 / (0.061 + 12 * 0.0043)  # Pollux ResNet-50 linear fit: 0.54
CO_LOCATION_CAPACITY = 1.216
"""Seconds of device work a GPU serves per second while two or more jobs share it. Pure time
slicing (1.0) makes each of two co-located jobs keep only 0.576 of its solo speed under this
model; 1.216 reproduces Gavel's measured median of 0.679 (fitted by
``python -m drbalance.sim.calibration --fit``): co-located kernels partly overlap."""
CO_LOCATED_SPEED = 0.68  # Gavel v100 median throughput of each of two jobs sharing a GPU
BUSY_FRACTION = 1.0 / (2 * CO_LOCATED_SPEED)  # 0.735
HOST_RATIO = (1.0 - BUSY_FRACTION) / BUSY_FRACTION  # 0.36


@dataclass(frozen=True)
class ModelProfile:
    """Timing of one model's training iteration on one reference GPU (seconds)."""

    name: str
    fixed: float  # device seconds per chunk, independent of its size
    per_sample: float  # device seconds per sample
    dp_overhead: float  # host seconds per replica beyond the first (DataParallel's own cost)
    host_ratio: float = HOST_RATIO  # host seconds per iteration / device seconds of the whole batch

    def __post_init__(self) -> None:
        for field in ("fixed", "per_sample", "dp_overhead", "host_ratio"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must be >= 0")

    def device_seconds(self, samples: float) -> float:
        """Device time of one chunk of ``samples`` samples (0 for an empty chunk: no replica)."""
        return self.fixed + self.per_sample * samples if samples > 0 else 0.0

    def host_seconds(self, batch: float) -> float:
        """Host time of one iteration with a mini-batch of ``batch`` samples."""
        return self.host_ratio * self.device_seconds(batch)

    def overhead_seconds(self, replicas: int) -> float:
        """DataParallel's extra host time for ``replicas`` replicas."""
        return self.dp_overhead * max(0, replicas - 1)

    def solo_iteration(self, batch: float) -> float:
        """One iteration alone on one GPU: host + device."""
        return self.host_seconds(batch) + self.device_seconds(batch)


def _from_table(name: str, t12_ms: float, t4gpu_ms: float | None, dp_overhead_ms: float | None = None) -> ModelProfile:
    fixed = FIXED_FRACTION_AT_12 * t12_ms / 1000.0
    per_sample = (1.0 - FIXED_FRACTION_AT_12) * t12_ms / 1000.0 / 12.0
    overhead = dp_overhead_ms / 1000.0 if dp_overhead_ms is not None else (t4gpu_ms - t12_ms) / 3.0 / 1000.0
    return ModelProfile(name, fixed, per_sample, overhead)


RESNET50_T12_MS = 64.9
ALEXNET_OVER_RESNET50 = 14.56 / 103.58  # jcjohnson/cnn-benchmarks, Pascal Titan X, batch 16

MODEL_PROFILES: Mapping[str, ModelProfile] = MappingProxyType({
    "densenet121": _from_table("densenet121", 103.4, 276.6),
    "resnet50": _from_table("resnet50", RESNET50_T12_MS, 138.6),
    "alexnet": _from_table("alexnet", RESNET50_T12_MS * ALEXNET_OVER_RESNET50, None, dp_overhead_ms=20.0),
    "resnext50_32x4d": _from_table("resnext50_32x4d", 94.0, 154.8),
    "shufflenet_v2_x1_0": _from_table("shufflenet_v2_x1_0", 39.6, 126.4),
    "mnasnet1_0": _from_table("mnasnet1_0", 38.5, 114.2),
})

SHORT_NAMES: Mapping[str, str] = MappingProxyType({
    "dense": "densenet121", "res": "resnet50", "alex": "alexnet", "resnext": "resnext50_32x4d",
    "shuffle": "shufflenet_v2_x1_0", "mnas": "mnasnet1_0",
})


def model_profile(name: str) -> ModelProfile:
    """The profile of a model by torchvision name (or the paper's short name, e.g. ``dense``)."""
    full = SHORT_NAMES.get(name, name)
    try:
        return MODEL_PROFILES[full]
    except KeyError:
        raise ValueError(f"no timing profile for model {name!r}; known: {', '.join(MODEL_PROFILES)}") from None
