"""Per-model cost tables of the paper's six models, shared by the emulated GPUs and the simulator.

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
- Memory (emulated GPUs only): a replica keeps ``memory_fixed`` bytes whatever its chunk
  (weights, gradients and one optimizer state: 3 x the parameters' bytes), plus
  ``memory_per_sample`` bytes per sample at the peak of the backward: the activations autograd
  saves for the backward, measured on the CPU (``drbalance.client.costs``) at 224 x 224, times
  ``BACKWARD_PEAK_FACTOR`` = 1.5 for gradient buffers and allocator slack (an assumption, not
  measured on a GPU). The forward's peak is the saved activations alone.

Any other model (:func:`estimate_costs`): its features are measured on the CPU from one real
forward (FLOPs, saved activation bytes, operator calls, modules, parameter bytes) and turned into
times by a least-squares fit over the six models above (relative error, non-negative
coefficients): device time of a chunk of b samples = 0.0952 ms per forward operator call (the
fixed part: kernel launches of forward and backward) + b x (0.294 ms per forward GFLOP + 0.0172 ms
per MB of saved activations). On the six models this reproduces the 12-image time within 15%
(0.85x to 1.13x; the test suite checks it). DataParallel overhead per extra replica = 3.05 ms +
0.126 ms per module (fit over the five models with 4-GPU data, within 10%).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
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
BACKWARD_PEAK_FACTOR = 1.5  # peak activation memory of the backward / saved activations (assumed)
MEMORY_FIXED_FACTOR = 3  # weights + gradients + one optimizer state, in parameter bytes

# The fit of estimate_costs (see the module docstring), milliseconds.
MS_PER_OPERATOR = 0.0952
MS_PER_GFLOP = 0.294
MS_PER_SAVED_MB = 0.0172
DP_OVERHEAD_MS = 3.05
DP_OVERHEAD_MS_PER_MODULE = 0.126


@dataclass(frozen=True)
class ModelCosts:
    """Timing of one model's training iteration on one reference GPU (seconds)."""

    name: str
    fixed: float  # device seconds per chunk, independent of its size
    per_sample: float  # device seconds per sample
    dp_overhead: float  # host seconds per replica beyond the first (DataParallel's own cost)
    host_ratio: float = HOST_RATIO  # host seconds per iteration / device seconds of the whole batch
    memory_fixed: float = 0.0  # device bytes a replica keeps whatever its chunk (0 = not modelled)
    memory_per_sample: float = 0.0  # device bytes per sample at the backward's peak (0 = not modelled)

    def __post_init__(self) -> None:
        for field in ("fixed", "per_sample", "dp_overhead", "host_ratio", "memory_fixed", "memory_per_sample"):
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

    def memory_peak(self, samples: float, backward: bool) -> float:
        """Peak device bytes of a replica with a chunk of ``samples`` samples, in the forward or
        in the backward (0 for an empty chunk: no replica)."""
        if samples <= 0:
            return 0.0
        activations = self.memory_per_sample * samples
        return self.memory_fixed + (activations if backward else activations / BACKWARD_PEAK_FACTOR)


@dataclass(frozen=True)
class ModelFeatures:
    """What a model's GPU cost depends on, measured on the CPU from one real forward
    (``drbalance.client.costs.measure_features``). Per sample unless said otherwise."""

    flops_per_sample: float  # forward floating-point operations
    saved_bytes_per_sample: float  # bytes of activations autograd keeps for the backward
    operators: int  # operator calls in one forward (about the kernel launches of one chunk)
    parameter_bytes: int  # bytes of the model's parameters (whole model)
    modules: int  # nn.Module objects in the model (what DataParallel's replicate walks)


def estimate_costs(name: str, features: ModelFeatures) -> ModelCosts:
    """A cost table for any model from its measured features (the fit in the module docstring)."""
    per_sample_ms = (MS_PER_GFLOP * features.flops_per_sample / 1e9
                     + MS_PER_SAVED_MB * features.saved_bytes_per_sample / 1e6)
    return ModelCosts(
        name,
        fixed=MS_PER_OPERATOR * features.operators / 1000.0,
        per_sample=per_sample_ms / 1000.0,
        dp_overhead=(DP_OVERHEAD_MS + DP_OVERHEAD_MS_PER_MODULE * features.modules) / 1000.0,
        **memory_model(features),
    )


def memory_model(features: ModelFeatures) -> dict[str, float]:
    """``memory_fixed`` and ``memory_per_sample`` (bytes) of a model from its features."""
    return {"memory_fixed": float(MEMORY_FIXED_FACTOR * features.parameter_bytes),
            "memory_per_sample": BACKWARD_PEAK_FACTOR * features.saved_bytes_per_sample}


def _from_table(name: str, t12_ms: float, t4gpu_ms: float | None, dp_overhead_ms: float | None = None) -> ModelCosts:
    fixed = FIXED_FRACTION_AT_12 * t12_ms / 1000.0
    per_sample = (1.0 - FIXED_FRACTION_AT_12) * t12_ms / 1000.0 / 12.0
    overhead = dp_overhead_ms / 1000.0 if dp_overhead_ms is not None else (t4gpu_ms - t12_ms) / 3.0 / 1000.0
    return ModelCosts(name, fixed, per_sample, overhead, **memory_model(TABLE_FEATURES[name]))


TABLE_FEATURES: Mapping[str, ModelFeatures] = MappingProxyType({
    # python -m drbalance.client.costs <model> --image 224 --batch 2 (torch 2.15, CPU, training mode)
    "densenet121": ModelFeatures(5.668e9, 130.53e6, 674, 31_915_424, 433),
    "resnet50": ModelFeatures(8.178e9, 86.02e6, 282, 102_228_128, 151),
    "alexnet": ModelFeatures(1.428e9, 3.741e6, 31, 244_403_360, 24),
    "resnext50_32x4d": ModelFeatures(8.461e9, 112.34e6, 282, 100_115_616, 151),
    "shufflenet_v2_x1_0": ModelFeatures(0.2898e9, 20.42e6, 358, 9_114_416, 205),
    "mnasnet1_0": ModelFeatures(0.6288e9, 44.34e6, 260, 17_533_248, 182),
})


RESNET50_T12_MS = 64.9
ALEXNET_OVER_RESNET50 = 14.56 / 103.58  # jcjohnson/cnn-benchmarks, Pascal Titan X, batch 16

MODEL_COSTS: Mapping[str, ModelCosts] = MappingProxyType({
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


MIN_IMAGE_SIZE: Mapping[str, tuple[int, int]] = MappingProxyType({
    "densenet121": (29, 61), "resnet50": (1, 33), "alexnet": (63, 63), "resnext50_32x4d": (1, 33),
    "shufflenet_v2_x1_0": (1, 33), "mnasnet1_0": (1, 33),
})
"""The models the training scripts (``drbalance.runs.train``, ``train_ddp``, so ``drbalance launch``)
train, by torchvision name, each with the smallest image side, pixels, at which it trains (forward
and backward in training mode): (on chunks of two samples or more, on a chunk of one sample).
Under it a pooling layer's output is empty, or a batch norm sees one value per channel. Measured
on the CPU with torchvision 0.29; the test suite measures it again."""

def model_costs(name: str) -> ModelCosts:
    """The cost table of a model by torchvision name (or the paper's short name, e.g. ``dense``).

    The paper's six models come from the published timings; any other torchvision model is
    estimated (:func:`estimate_costs`) from features measured on the CPU at 224 x 224 (this
    needs torch and torchvision and takes a few seconds, once per model and process). For a
    model of your own, use ``drbalance.client.costs.measure_features`` and ``estimate_costs``
    (``BalancedDataParallel`` on emulated GPUs does this by itself on its first forward).
    """
    full = SHORT_NAMES.get(name, name)
    known = MODEL_COSTS.get(full)
    return known if known is not None else _measured_costs(full)


@lru_cache(maxsize=32)
def _measured_costs(name: str) -> ModelCosts:
    try:
        from drbalance.client.costs import measure_torchvision
    except ImportError as error:
        raise ValueError(f"no cost table for model {name!r} (known: {', '.join(MODEL_COSTS)}), and it "
                         f"cannot be measured without torch and torchvision ({error})") from None
    try:
        features = measure_torchvision(name)
    except (ImportError, ValueError) as error:
        raise ValueError(f"no cost table for model {name!r} (known: {', '.join(MODEL_COSTS)}), and it "
                         f"cannot be measured: {error}") from None
    return replace(estimate_costs(name, features), name=name)
