"""Scatter a batch into chunks of given sizes and gather the replicas' outputs in sample order.

Mirrors ``torch.nn.parallel.scatter_gather`` with two differences: the chunk sizes are given (by
the data ratio) instead of equal, and a per-replica scalar output is, by default, combined into
the chunk-size-weighted mean rather than stacked into a vector.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel._functions import Gather, Scatter

SCALAR_MODES = ("weighted_mean", "stack")


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor found in ``obj`` (depth first through tuples, lists and dict values)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def batch_size_of(inputs: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int | None:
    """Samples in the batch: the size along ``dim`` of the first tensor argument (None if none)."""
    tensor = first_tensor((inputs, kwargs))
    if tensor is None or tensor.dim() == 0:
        return None
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"BalancedDataParallel splits along dim={dim}, but the first input tensor has shape "
            f"{tuple(tensor.shape)}"
        )
    return int(tensor.size(dim))


def scatter_by_sizes(
    obj: Any,
    sizes: Sequence[int],
    dim: int,
    split_tensor: Callable[[torch.Tensor], Sequence[Any]],
    where: str = "inputs",
) -> list[Any]:
    """Split every tensor in ``obj`` into ``len(sizes)`` chunks; copy other objects by reference.

    ``split_tensor`` does the actual split of one tensor (``torch.split`` on the CPU, the
    autograd-aware ``Scatter`` on CUDA). Every tensor must hold ``sum(sizes)`` samples along
    ``dim``: a tensor of another length cannot be split by the same chunk sizes.
    """
    count = len(sizes)
    batch = sum(sizes)

    def scatter_map(item: Any, path: str) -> list[Any]:
        if isinstance(item, torch.Tensor):
            if item.dim() == 0 or item.size(dim) != batch:
                shape = tuple(item.shape)
                raise ValueError(
                    f"BalancedDataParallel: tensor {path} has shape {shape}, but the batch has "
                    f"{batch} samples along dim {dim}; every tensor argument is split by the same "
                    f"chunk sizes {list(sizes)}"
                )
            return list(split_tensor(item))
        if is_namedtuple(item):
            parts = [scatter_map(v, f"{path}.{name}") for name, v in zip(item._fields, item)]
            return [type(item)(*args) for args in zip(*parts)]
        if isinstance(item, tuple) and item:
            parts = [scatter_map(v, f"{path}[{i}]") for i, v in enumerate(item)]
            return [tuple(args) for args in zip(*parts)]
        if isinstance(item, list) and item:
            parts = [scatter_map(v, f"{path}[{i}]") for i, v in enumerate(item)]
            return [list(args) for args in zip(*parts)]
        if isinstance(item, dict) and item:
            keys = list(item)
            parts = [scatter_map(item[k], f"{path}[{k!r}]") for k in keys]
            return [type(item)(zip(keys, args)) for args in zip(*parts)]
        return [item] * count

    return scatter_map(obj, where)


def cpu_splitter(sizes: Sequence[int], dim: int) -> Callable[[torch.Tensor], Sequence[Any]]:
    """Split a tensor into views of ``sizes`` along ``dim`` (autograd-aware, no copy)."""
    sizes = list(sizes)
    return lambda tensor: torch.split(tensor, sizes, dim)


def cuda_splitter(
    devices: Sequence[int], sizes: Sequence[int], dim: int
) -> Callable[[torch.Tensor], Sequence[Any]]:
    """Copy chunks of ``sizes`` to ``devices`` with torch's autograd-aware ``Scatter``."""
    devices, sizes = list(devices), tuple(sizes)
    return lambda tensor: Scatter.apply(devices, sizes, dim, tensor)


def gather_outputs(
    outputs: Sequence[Any],
    sizes: Sequence[int],
    dim: int,
    scalar_mode: str,
    concat: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    move: Callable[[torch.Tensor], torch.Tensor],
) -> Any:
    """Combine per-replica outputs (in replica order = sample order) into one output.

    Tensors are concatenated along ``dim`` by ``concat``. A 0-dim tensor (a per-replica scalar
    such as a mean loss) becomes the chunk-size-weighted mean in ``weighted_mean`` mode, so it
    equals the same reduction over the whole batch for any DR; in ``stack`` mode it becomes a
    vector with one entry per replica, as ``nn.DataParallel`` returns.
    """
    batch = sum(sizes)
    weights = [size / batch for size in sizes] if batch else [1.0 / len(sizes)] * len(sizes)

    def gather_map(items: Sequence[Any]) -> Any:
        first = items[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0 and scalar_mode == "weighted_mean":
                return sum(move(item) * weight for item, weight in zip(items, weights))
            if first.dim() == 0:
                return concat([item.reshape(1) for item in items])
            return concat(items)
        if first is None:
            return None
        if isinstance(first, dict):
            if any(len(item) != len(first) for item in items):
                raise ValueError("BalancedDataParallel: replicas returned dicts with different keys")
            return type(first)((key, gather_map([item[key] for item in items])) for key in first)
        if is_namedtuple(first):
            return type(first)._make(map(gather_map, zip(*items)))
        if isinstance(first, (list, tuple)):
            return type(first)(map(gather_map, zip(*items)))
        return first

    return gather_map(outputs)


def cuda_concat(target_device: int | str, dim: int) -> Callable[[Sequence[torch.Tensor]], Any]:
    """Concatenate tensors living on several GPUs onto ``target_device`` (autograd-aware)."""
    return lambda tensors: Gather.apply(target_device, dim, *tensors)
