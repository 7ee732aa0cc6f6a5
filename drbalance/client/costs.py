"""Measure what a model's GPU cost depends on, on the CPU: FLOPs, saved activations, operators.

:func:`measure_features` runs one forward of the real model on a real (or example) batch and
counts, per sample: forward FLOPs (``torch.utils.flop_counter``), bytes of tensors autograd saves
for the backward (``torch.autograd.graph.saved_tensors_hooks``; the model's own parameters and
buffers are not counted), and the number of operator calls (kernel launches on a GPU, roughly).
``drbalance.workload.models.estimate_costs`` turns these into an emulated-GPU cost table (timing and memory).

    python -m drbalance.client.costs resnet50 densenet121 --image 224

prints the features of torchvision models (how the constants in ``drbalance.workload.models`` were
obtained).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from drbalance.client.scatter_gather import tensors_in
from drbalance.workload.models import ModelFeatures


class _OperatorCount(TorchDispatchMode):
    """Counts operator calls that reach the dispatcher (views and metadata-only ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def measure_features(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None, samples: int) -> tuple[
        ModelFeatures, Any]:
    """Run ``module(*args, **kwargs)`` once, counting; return (features per sample, the output).

    The forward is the caller's real forward (its output is returned for use), so measuring
    costs no extra computation beyond the counting itself. ``samples`` is the batch size of
    ``args``. Gradients must be enabled for saved activations to be counted. A tensor saved for
    the backward that has no storage of its own (a sparse tensor) is not counted.

    The counting runs the forward under a saved-tensor hook, ``FlopCounterMode`` and a dispatch
    mode, which some forwards do not support (``torch.func`` transforms, ``torch.autograd.grad``
    inside the forward): their errors come out of here as they are; see :func:`rough_features`.
    """
    if samples < 1:
        raise ValueError(f"need a batch of at least one sample to measure; got {samples}")
    own = {key[0] for key in map(_storage, list(module.parameters()) + list(module.buffers())) if key is not None}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key is not None and key[0] not in own:
            saved[key[0]] = key[1]
        return tensor

    counter = _OperatorCount()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with FlopCounterMode(display=False) as flops, counter:
            output = module(*args, **(kwargs or {}))
    features = ModelFeatures(
        flops_per_sample=flops.get_total_flops() / samples,
        saved_bytes_per_sample=sum(saved.values()) / samples,
        operators=counter.calls,
        parameter_bytes=_parameter_bytes(module),
        modules=sum(1 for _ in module.modules()),
    )
    return features, output


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the tensor's storage; None for one without storage (sparse)."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return storage.data_ptr(), storage.nbytes()


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def rough_features(module: nn.Module, args: Sequence[Any], output: Any, samples: int) -> ModelFeatures:
    """Features guessed without counting, for a forward :func:`measure_features` cannot run:
    two FLOPs per parameter and sample (a dense layer's multiply-add), the chunk's input and
    output bytes per sample as the activations kept for the backward (the least a first and a
    last layer keep), two operators per module. Rough: an emulated GPU's timing for such a
    model is an order of magnitude, not a calibration."""
    parameters = sum(p.numel() for p in module.parameters())
    tensors = [t for t in tensors_in((args, output)) if _storage(t) is not None]
    modules = sum(1 for _ in module.modules())
    return ModelFeatures(
        flops_per_sample=2.0 * parameters,
        saved_bytes_per_sample=sum(t.numel() * t.element_size() for t in tensors) / max(1, samples),
        operators=2 * modules,
        parameter_bytes=_parameter_bytes(module),
        modules=modules,
    )


def measure_torchvision(name: str, image: int = 224, batch: int = 2, classes: int = 1000) -> ModelFeatures:
    """Features of a torchvision model (no weights) on a random ``batch`` of ``image``-pixel images."""
    import torchvision

    builder = getattr(torchvision.models, name, None)
    if builder is None or not callable(builder):
        raise ValueError(f"torchvision has no model {name!r}")
    torch.manual_seed(0)
    model = builder(weights=None, num_classes=classes)
    model.train()
    features, _ = measure_features(model, (torch.randn(batch, 3, image, image),), None, batch)
    return features


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="torchvision model names")
    parser.add_argument("--image", type=int, default=224, help="image side in pixels (default 224)")
    parser.add_argument("--batch", type=int, default=2, help="batch size of the measured forward (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.models:
        print(json.dumps({"model": name, **measure_torchvision(name, args.image, args.batch).__dict__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
