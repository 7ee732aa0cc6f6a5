"""Scatter a batch into chunks of given sizes and gather the replicas' outputs in sample order.

Mirrors ``torch.nn.parallel.scatter_gather`` with three differences: the chunk sizes are given
(by the data ratio) instead of equal; a 0-dim tensor argument is passed whole to every chunk
(as a non-tensor argument is) instead of failing to split; and a per-replica scalar output is,
by default, combined into the chunk-size-weighted mean rather than stacked into a vector.
Outputs must be tensors, ``None``, or tuples/lists/dicts/namedtuples of them: any other value
(an ``int``, a ``str``) raises ``TypeError`` naming it, as ``nn.DataParallel``'s gather fails on
it, and for every DR alike, so that a change of DR cannot turn a working script into a failing one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel._functions import Gather, Scatter

SCALAR_MODES = ("weighted_mean", "stack")


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, depth first through tuples, lists and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def map_tensors(function: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` rebuilt (tuples, namedtuples, lists, dicts) with ``function`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return function(obj)
    if is_namedtuple(obj):
        return type(obj)(*(map_tensors(function, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(function, item) for item in obj)
    if isinstance(obj, dict):
        return {key: map_tensors(function, item) for key, item in obj.items()}
    return obj


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor with at least one dimension in ``obj`` (depth first through tuples,
    lists and dict values); 0-dim tensors are not batches and are skipped."""
    return next((tensor for tensor in tensors_in(obj) if tensor.dim() > 0), None)


def batch_size_of(inputs: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int | None:
    """Samples in the batch: the size along ``dim`` of the first tensor argument with at least
    one dimension (None if there is none)."""
    tensor = first_tensor((inputs, kwargs))
    if tensor is None:
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
    broadcast_tensor: Callable[[torch.Tensor], Sequence[Any]] | None = None,
) -> list[Any]:
    """Split every tensor in ``obj`` into ``len(sizes)`` chunks; copy other objects by reference.

    ``split_tensor`` does the actual split of one tensor (``torch.split`` on the CPU, the
    autograd-aware ``Scatter`` on CUDA). Every tensor with a dimension must hold ``sum(sizes)``
    samples along ``dim``: a tensor of another length cannot be split by the same chunk sizes.
    A 0-dim tensor (a scalar such as a temperature or a step count) goes whole to every chunk,
    through ``broadcast_tensor`` (default: the same tensor for each; CUDA copies it to each GPU).
    """
    count = len(sizes)
    batch = sum(sizes)

    def scatter_map(item: Any, path: str) -> list[Any]:
        if isinstance(item, torch.Tensor):
            if item.dim() == 0:
                return list(broadcast_tensor(item)) if broadcast_tensor is not None else [item] * count
            if item.dim() <= dim:
                raise ValueError(
                    f"BalancedDataParallel: tensor {path} has shape {tuple(item.shape)}, which has no dim {dim} "
                    f"to split the batch along; every tensor argument with dimensions is split along dim {dim} "
                    f"(pass a 0-dim tensor to give it whole to every replica)"
                )
            if item.size(dim) != batch:
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
    """Split a tensor into chunks of ``sizes`` along ``dim`` that a replica can use as the bare
    module uses the whole tensor (autograd-aware).

    One chunk is the tensor itself. Several are views (no copy), except where a view would behave
    unlike the tensor a replica gets from ``nn.DataParallel``'s scatter (a copy on its GPU): a
    tensor that requires grad gives copies, since ``torch.split``'s views (outputs of one op that
    returns several views) refuse in-place ops (``nn.ReLU(inplace=True)`` on the input), and a
    contiguous tensor gives contiguous chunks, since a split along ``dim`` > 0 would not be
    (``x.view(...)`` in the module).
    """
    sizes = list(sizes)
    if len(sizes) == 1:
        return lambda tensor: (tensor,)

    def split(tensor: torch.Tensor) -> Sequence[torch.Tensor]:
        chunks = torch.split(tensor, sizes, dim)
        if tensor.requires_grad:
            return [chunk.clone() for chunk in chunks]  # dense copies: contiguous where the view was not
        if tensor.is_contiguous():
            return [chunk.contiguous() for chunk in chunks]  # the view itself when it is contiguous already
        return chunks

    return split


def cuda_broadcaster(devices: Sequence[int]) -> Callable[[torch.Tensor], Sequence[Any]]:
    """Copy a (0-dim) tensor to each of ``devices`` (autograd-aware ``Tensor.to``)."""
    targets = [torch.device("cuda", d) for d in devices]
    return lambda tensor: [tensor.to(target) for target in targets]


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

    Tensors are concatenated along ``dim`` by ``concat``. A floating-point 0-dim tensor (a
    per-replica scalar such as a mean loss) becomes the chunk-size-weighted mean in
    ``weighted_mean`` mode, so it equals the same reduction over the whole batch for any DR; in
    ``stack`` mode, and for integer or bool 0-dim tensors in either mode, it becomes a vector with
    one entry per replica, as ``nn.DataParallel`` returns. Lists and tuples must have the same
    length in every replica (``ValueError`` naming them: a per-sample list cannot be joined). Anything that is not a
    tensor, ``None`` or a container of them raises ``TypeError`` naming it.
    """
    batch = sum(sizes)
    weights = [size / batch for size in sizes] if batch else [1.0 / len(sizes)] * len(sizes)

    def gather_map(items: Sequence[Any], path: str) -> Any:
        first = items[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0 and scalar_mode == "weighted_mean" and _has_mean(first):
                return sum(move(item) * weight for item, weight in zip(items, weights))
            if first.dim() == 0:
                return concat([item.reshape(1) for item in items])
            return concat(items)
        if first is None:
            return None
        if isinstance(first, (list, tuple)) and not is_namedtuple(first) and any(len(i) != len(first) for i in items):
            raise ValueError(
                f"BalancedDataParallel: replicas returned {type(first).__name__}s of different lengths "
                f"{[len(item) for item in items]} as {path} (one entry per sample?); outputs are gathered entry by "
                f"entry, so a per-sample list cannot be joined: return a tensor with the batch along dim {dim}"
            )
        if isinstance(first, dict):
            if any(len(item) != len(first) for item in items):
                raise ValueError(f"BalancedDataParallel: replicas returned dicts with different keys in {path}")
            return type(first)((key, gather_map([item[key] for item in items], f"{path}[{key!r}]"))
                               for key in first)
        if is_namedtuple(first):
            return type(first)._make(gather_map(column, f"{path}.{name}")
                                     for name, column in zip(first._fields, zip(*items)))
        if isinstance(first, (list, tuple)):
            return type(first)(gather_map(column, f"{path}[{i}]") for i, column in enumerate(zip(*items)))
        raise _not_gatherable(first, path)

    return gather_map(outputs, "output")


def check_gatherable(output: Any, path: str = "output") -> None:
    """Raise the gather's ``TypeError`` for a non-tensor leaf even when there is nothing to gather.

    With a single replica no gather runs; checking anyway keeps the behaviour the same for every
    DR (a DR change must not make a working script fail).
    """
    if output is None or isinstance(output, torch.Tensor):
        return
    if isinstance(output, dict):
        for key, value in output.items():
            check_gatherable(value, f"{path}[{key!r}]")
    elif is_namedtuple(output):
        for name, value in zip(output._fields, output):
            check_gatherable(value, f"{path}.{name}")
    elif isinstance(output, (list, tuple)):
        for index, value in enumerate(output):
            check_gatherable(value, f"{path}[{index}]")
    else:
        raise _not_gatherable(output, path)


def _has_mean(scalar: torch.Tensor) -> bool:
    """Whether a 0-dim output can be gathered as a weighted mean: a floating-point or complex one.
    An integer or bool one (a count, a flag) is stacked instead, as ``nn.DataParallel`` does, so
    that it keeps its type (its mean would turn a count into a fraction)."""
    return scalar.is_floating_point() or scalar.is_complex()


def _not_gatherable(value: Any, path: str) -> TypeError:
    return TypeError(
        f"BalancedDataParallel: the module returned {type(value).__name__} {value!r:.60} as {path}; outputs are "
        f"gathered across replicas and must be tensors, None, or tuples/lists/dicts of them (return a "
        f"tensor, e.g. torch.tensor(value), or compute it outside the module)"
    )


def cuda_concat(target_device: int | str, dim: int) -> Callable[[Sequence[torch.Tensor]], Any]:
    """Concatenate tensors living on several GPUs onto ``target_device`` (autograd-aware)."""
    return lambda tensors: Gather.apply(target_device, dim, *tensors)
