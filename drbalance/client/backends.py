"""Where the replicas of a ``BalancedDataParallel`` run: CUDA GPUs or the CPU.

A backend turns one forward's *chunk plan* (which DR slots get how many samples) into the
module's output: scatter the inputs by the chunk sizes, run one replica per non-empty chunk,
gather the outputs in sample order. ``CudaBackend`` uses PyTorch's own parallel primitives
(``Scatter``, ``replicate``, threads per device, ``Gather``); ``CpuBackend`` runs the same split
path sequentially with one module on the CPU, so every piece of the split logic is testable on a
machine without a GPU. The emulated-GPU backend (``drbalance.client.emulated``) extends the CPU
one. ``BalancedDataParallel`` picks CUDA when it is available, else emulated GPUs when
``DRBALANCE_EMULATED_GPUS`` is set, else the CPU (:func:`default_backend`).

Backends also answer what the out-of-memory protection and the manager need: whether an error
is an out-of-memory error and on which DR slot (:meth:`DeviceBackend.out_of_memory`), each
slot's GPU UUID, and each slot's peak device memory.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.parallel.replicate import replicate

from drbalance.client.buffers import BufferMerge, any_training, tracked_buffers
from drbalance.client.cuda_timing import BACKWARD_EVERY, BackwardShares, CudaReplicaTimer
from drbalance.client.scatter_gather import (
    check_gatherable,
    cpu_splitter,
    cuda_broadcaster,
    cuda_concat,
    cuda_splitter,
    gather_outputs,
    scatter_by_sizes,
)
from drbalance.client.timing import ReplicaTiming
from drbalance.manager.nvml import Nvml, NvmlUnavailable

logger = logging.getLogger(__name__)

CUDA_OOM_DEVICE = re.compile(r"GPU (\d+) has a total capacity")
"""Where torch's CUDA out-of-memory message names the device (``... GPU 2 has a total capacity ...``)."""


@dataclass(frozen=True)
class ChunkPlan:
    """One forward's split: DR slot indices with a non-empty chunk, and their chunk sizes.

    ``whole`` marks a call with no batch to split (no tensor argument, or 0 samples): the whole
    call goes to ``slots[0]`` unchanged.
    """

    slots: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int
    scalar_mode: str
    whole: bool = False


@dataclass(frozen=True)
class OutOfMemory:
    """An out-of-memory error seen by a backend: the DR slot it happened on (None = unknown)."""

    slot: int | None
    error: BaseException


def reraise_in_replica(error: BaseException, where: str, slot: int | None = None, only_device: bool = False) -> None:
    """Re-raise ``error`` with ``where`` (replica and device) added to its message.

    Keeps the exception type when it can be built from a message (as torch's ExceptionWrapper
    does), else raises a RuntimeError; the original is chained as the cause either way. The DR
    slot is kept on the new exception as ``drbalance_slot``. With ``only_device`` (the model
    has one device, where ``nn.DataParallel`` calls the module itself) the original is raised
    unchanged, only tagged with its slot where it takes attributes.
    """
    if only_device:
        try:
            error.drbalance_slot = slot  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # slots or read-only attributes: one device is slot 0 anyway
            pass
        raise error
    message = f"Caught {type(error).__name__} {where}: {error}"
    try:
        wrapped = type(error)(message)
        if message not in str(wrapped):  # a constructor that takes one argument but not as the message
            raise TypeError(message)  # (``def __init__(self, code): super().__init__()``): it would be lost
    except Exception:  # exception types whose constructor wants other arguments
        wrapped = RuntimeError(message)
    try:
        for name, value in vars(error).items():  # the original's attributes (an error code, say) come along
            setattr(wrapped, name, value)
    except (AttributeError, TypeError):  # an exception without a __dict__ (slots) or read-only attributes
        pass
    wrapped.drbalance_slot = slot  # type: ignore[attr-defined]
    raise wrapped from error


def error_chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and the exceptions it was raised from (``__cause__``), outermost first."""
    chain_: list[BaseException] = []
    while error is not None and error not in chain_:
        chain_.append(error)
        error = error.__cause__
    return chain_


class DeviceBackend(ABC):
    """Runs one forward's chunks. Subclasses own device naming and placement rules."""

    kind: str = "abstract"

    @abstractmethod
    def resolve_device_ids(self, device_ids: Sequence[Any] | None, ratio_length: int | None) -> list[int]:
        """Validated device ids (one per DR slot) from the user's ``device_ids`` argument."""

    def resolve_output_device(self, output_device: Any, device_ids: Sequence[int]) -> Any:
        return "cpu"

    def prepare(self, module: nn.Module, device_ids: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """Called once by the constructor (e.g. to move the module to a single GPU)."""

    def check_module(self, module: nn.Module, device_ids: Sequence[int]) -> None:  # noqa: B027
        """Raise if the module is not where this backend expects it."""

    def describe(self, device_ids: Sequence[int], slot: int) -> str:
        """The device of DR slot ``slot``, for messages and timings."""
        return "cpu"

    @abstractmethod
    def run(
        self,
        module: nn.Module,
        device_ids: Sequence[int],
        output_device: Any,
        plan: ChunkPlan,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, list[Callable[[], ReplicaTiming]]]:
        """The gathered output, and one (lazy) timing per replica."""

    def out_of_memory(self, error: BaseException, device_ids: Sequence[int]) -> OutOfMemory | None:
        """An ``OutOfMemory`` if ``error`` (or what it was raised from) is a device out-of-memory
        error, naming the DR slot when it can be told; None for any other error."""
        for item in error_chain(error):
            if isinstance(item, torch.cuda.OutOfMemoryError):
                return OutOfMemory(_slot_of(error, device_ids, self._oom_device(item)), item)
        return None

    def _oom_device(self, error: BaseException) -> int | None:
        """The device id an out-of-memory error names (None = not told)."""
        return None

    def release_memory(self, devices: Sequence[int] | None = None) -> None:  # noqa: B027 (optional hook)
        """Return cached device memory (CUDA: ``empty_cache``) of ``devices`` (None = all): after an
        out-of-memory error, and on devices a new DR no longer uses (so other jobs can have it)."""

    def device_uuids(self, device_ids: Sequence[int]) -> tuple[str, ...]:
        """The GPU UUID of each DR slot's device ("" = unknown), as NVML names it (``GPU-...``)."""
        return ("",) * len(device_ids)

    def slots_alone(self, device_ids: Sequence[int]) -> tuple[bool | None, ...]:
        """Per DR slot: whether no other process uses its device now (None = cannot tell). A job
        without a solo-run time takes the chunk times of slots it has alone as its solo device
        time (``drbalance.solo_estimate``)."""
        return (None,) * len(device_ids)

    def take_peak_memory(self, device_ids: Sequence[int]) -> tuple[int | None, ...]:
        """Peak device memory in bytes per DR slot since the last call (None = not measured)."""
        return (None,) * len(device_ids)

    def uncounted_seconds(self) -> float:
        """Seconds of the job's time so far that its SD leaves out (0 on real devices: everything
        counts; the emulated backend leaves out this machine's CPU time past the modelled host time)."""
        return 0.0

    def where(self, device_ids: Sequence[int], plan: ChunkPlan, position: int) -> str:
        slot = plan.slots[position]
        return (
            f"in replica {position} on device {self.describe(device_ids, slot)} "
            f"(DR slot {slot}, {plan.sizes[position]} samples)"
        )


def _slot_of(error: BaseException, device_ids: Sequence[int], device: int | None) -> int | None:
    for item in error_chain(error):
        slot = getattr(item, "drbalance_slot", None)
        if slot is not None:
            return slot
    if device is not None and device in device_ids:
        return list(device_ids).index(device)
    return None


def slot_label(device: Any, position: int) -> int:
    """Entry ``position`` of ``device_ids`` as an integer label: an integer as it is, a CUDA device
    (``torch.device("cuda:1")`` or its name ``"cuda:1"``) as its index, the CPU as ``position``.
    ValueError naming the entry for anything else, and for ``cuda`` without an index."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device_ids[{position}] is {device!r}; expected an integer, 'cuda:N' or a "
                             f"torch.device") from None
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return position
        if device.index is None:
            raise ValueError(f"device_ids[{position}] is {device} without an index; give {device.type}:N or the "
                             f"integer N")
        return device.index
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise ValueError(f"device_ids[{position}] is {device!r}; expected an integer, 'cuda:N' or a torch.device")
    return int(device)


def _distinct_device_ids(device_ids: list[int], device: str) -> list[int]:
    """``device_ids`` when they name at least one ``device`` and none twice; else ValueError."""
    if len(set(device_ids)) != len(device_ids):
        raise ValueError(f"device_ids {device_ids} contain duplicates")
    if not device_ids:
        raise ValueError(f"device_ids is empty; give at least one {device}")
    return device_ids


def _scatter_all(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    plan: ChunkPlan,
    split: Callable[[torch.Tensor], Sequence[Any]],
    broadcast: Callable[[torch.Tensor], Sequence[Any]] | None = None,
) -> tuple[list[Any], list[Any]]:
    count = len(plan.slots)
    chunk_inputs = (scatter_by_sizes(inputs, plan.sizes, plan.dim, split, "inputs", broadcast)
                    if inputs else [()] * count)
    chunk_kwargs = (scatter_by_sizes(kwargs, plan.sizes, plan.dim, split, "kwargs", broadcast)
                    if kwargs else [{}] * count)
    return chunk_inputs, chunk_kwargs


class CpuBackend(DeviceBackend):
    """The split path without a GPU: one module, chunk after chunk, on the CPU.

    ``device_ids`` are slot labels here (default: one per DR entry). Gradients match the bare
    module on the whole batch (to float tolerance) for models without batch-norm; batch-norm
    sees per-chunk statistics, as each replica of ``nn.DataParallel`` does. In training mode the
    module's buffers advance once per forward, not once per chunk (:mod:`.buffers`).
    """

    kind = "cpu"

    def resolve_device_ids(self, device_ids: Sequence[Any] | None, ratio_length: int | None) -> list[int]:
        """Slot labels: integers, or the devices a script written for GPUs passes, as
        ``nn.DataParallel`` takes them (``"cuda:1"``, ``torch.device("cuda", 1)``: label 1;
        ``"cpu"``: the entry's position)."""
        if device_ids is None:
            return list(range(ratio_length or 1))
        labels = [slot_label(device, position) for position, device in enumerate(device_ids)]
        return _distinct_device_ids(labels, "device")

    def describe(self, device_ids: Sequence[int], slot: int) -> str:
        return "cpu"

    def run(self, module, device_ids, output_device, plan, inputs, kwargs):
        if plan.whole:
            return self._run_whole(module, device_ids, plan, inputs, kwargs)
        chunk_inputs, chunk_kwargs = _scatter_all(inputs, kwargs, plan, cpu_splitter(plan.sizes, plan.dim))
        outputs, timings = self.apply(module, device_ids, plan, chunk_inputs, chunk_kwargs)
        if len(outputs) == 1:
            if len(device_ids) > 1:  # a DR change could make it several chunks: refuse what could not be gathered
                check_gatherable(outputs[0])
            return outputs[0], timings  # one chunk: the module's own output, as nn.DataParallel on one device
        output = gather_outputs(
            outputs, plan.sizes, plan.dim, plan.scalar_mode,
            concat=lambda tensors: torch.cat(list(tensors), plan.dim),
            move=lambda tensor: tensor,
        )
        return output, timings

    def _run_whole(self, module, device_ids, plan, inputs, kwargs):
        outputs, timings = self.apply(module, device_ids, plan, [inputs], [kwargs])
        return outputs[0], timings

    def apply(
        self,
        module: nn.Module,
        device_ids: Sequence[int],
        plan: ChunkPlan,
        chunk_inputs: Sequence[Any],
        chunk_kwargs: Sequence[dict[str, Any]],
    ) -> tuple[list[Any], list[Callable[[], ReplicaTiming]]]:
        """Run the module on each chunk in turn, timing each with the wall clock."""
        outputs, spans = self.forward_chunks(module, device_ids, plan, chunk_inputs, chunk_kwargs)
        return outputs, self.timings(device_ids, plan, spans)

    def forward_chunks(
        self,
        module: nn.Module,
        device_ids: Sequence[int],
        plan: ChunkPlan,
        chunk_inputs: Sequence[Any],
        chunk_kwargs: Sequence[dict[str, Any]],
    ) -> tuple[list[Any], list[float]]:
        """Each chunk's forward, one after another: (outputs, wall seconds of each).

        In training mode the module's buffers advance once for the whole forward (each chunk
        starts from the same values; see :mod:`drbalance.client.buffers`); on an error in a
        split forward they are put back to their values before it (a single chunk is the
        module's own forward, as in plain PyTorch: nothing is put back).
        """
        outputs, spans = [], []
        clock = time.perf_counter
        merge = BufferMerge.for_forward(module, len(chunk_inputs))
        batch = sum(plan.sizes) or 1
        try:
            for position, (args, kw) in enumerate(zip(chunk_inputs, chunk_kwargs)):
                if merge is not None:
                    merge.install_copies()  # every chunk starts from the same buffers, in copies of its own
                started = clock()
                try:
                    output = self.call_chunk(module, args, kw, plan, position)
                    self.after_chunk(device_ids, plan, position, output)
                    outputs.append(output)
                except Exception as error:
                    reraise_in_replica(error, self.where(device_ids, plan, position), plan.slots[position],
                                       only_device=len(device_ids) == 1)
                spans.append(clock() - started)
                if merge is not None:
                    merge.add_module_values(plan.sizes[position] / batch)
        finally:
            if merge is not None:
                merge.put_back()  # the originals, still holding the values before the forward
        if merge is not None:
            merge.finish()
        return outputs, spans

    def call_chunk(self, module: nn.Module, args: Any, kwargs: dict[str, Any], plan: ChunkPlan, position: int) -> Any:
        """One chunk's forward (the emulated backend measures the model's cost on its first one)."""
        return module(*args, **kwargs)

    def after_chunk(self, device_ids: Sequence[int], plan: ChunkPlan, position: int, output: Any) -> None:  # noqa: B027
        """Called after each chunk's forward (the emulated backend reserves its memory here)."""

    def timings(
        self, device_ids: Sequence[int], plan: ChunkPlan, seconds: Sequence[float]
    ) -> list[Callable[[], ReplicaTiming]]:
        """Lazy timing records: built only when someone reads them."""
        return [
            partial(ReplicaTiming, slot, self.describe(device_ids, slot), size, spent)
            for slot, size, spent in zip(plan.slots, plan.sizes, seconds)
        ]


class CudaBackend(DeviceBackend):
    """Replicas on CUDA GPUs through PyTorch's own parallel primitives.

    Chunks are copied with ``Scatter`` (per-device chunk sizes), the module is replicated only to
    the GPUs with a non-empty chunk, replicas run in one thread per GPU, and outputs are gathered
    with ``Gather`` in sample order. The module must live on ``device_ids[0]``, as for
    ``nn.DataParallel``.
    """

    kind = "cuda"

    def __init__(self, time_backward: bool = True, backward_every: int = BACKWARD_EVERY) -> None:
        """``time_backward``: count each replica's backward in its chunk time (the default; False
        times the forward alone, for comparison: ``benchmarks/cuda_chunk_time.py``), timing it on
        one training forward in ``backward_every`` (1: every one) and scaling the forward by the
        last measured share on the others (``drbalance.client.cuda_timing``)."""
        if backward_every < 1:
            raise ValueError(f"backward_every must be at least 1, not {backward_every}")
        self.time_backward = time_backward
        self.backward_every = backward_every
        self.backward_shares = BackwardShares()
        self.training_forwards = 0
        """Training forwards (gradients on) this backend has run."""
        self._warned_untimed = False

    def resolve_device_ids(self, device_ids, ratio_length):
        count = torch.cuda.device_count()
        if device_ids is None:
            device_ids = list(range(count))
        resolved = []
        for position, device in enumerate(device_ids):
            index = torch._utils._get_device_index(device, True)
            if not 0 <= index < count:
                raise ValueError(f"device_ids[{position}] = {device!r} is not one of the {count} CUDA devices")
            resolved.append(index)
        return _distinct_device_ids(resolved, "CUDA device")

    def resolve_output_device(self, output_device, device_ids):
        if output_device is None:
            return device_ids[0]
        return torch._utils._get_device_index(output_device, True)

    def prepare(self, module, device_ids):
        if len(device_ids) == 1:
            module.to(torch.device("cuda", device_ids[0]))

    def check_module(self, module, device_ids):
        source = torch.device("cuda", device_ids[0])
        for tensor in chain(module.parameters(), module.buffers()):
            if tensor.device != source:
                raise RuntimeError(
                    f"module must have its parameters and buffers on device {source} "
                    f"(device_ids[0]) but found one of them on device: {tensor.device}"
                )

    def describe(self, device_ids, slot):
        return f"cuda:{device_ids[slot]}"

    def _oom_device(self, error):
        match = CUDA_OOM_DEVICE.search(str(error))
        return int(match.group(1)) if match else None

    def release_memory(self, devices=None):
        if devices is None:
            torch.cuda.empty_cache()
            return
        for device in devices:
            with torch.cuda.device(device):
                torch.cuda.empty_cache()

    def device_uuids(self, device_ids):
        uuids = []
        for device in device_ids:
            try:
                raw = str(torch.cuda.get_device_properties(device).uuid)
            except (AttributeError, RuntimeError):  # an older torch without the property
                raw = ""
            uuids.append(raw if not raw or raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}")
        return tuple(uuids)

    def slots_alone(self, device_ids):
        """NVML's compute processes on each slot's GPU: alone when this process is the only one
        listed; None when NVML cannot tell or does not list this process (a container with a pid
        namespace of its own). Not run on a GPU in this repository's tests."""
        return tuple(_alone_on_gpu(uuid) for uuid in self.device_uuids(device_ids))

    def take_peak_memory(self, device_ids):
        peaks = []
        for device in device_ids:
            peaks.append(int(torch.cuda.max_memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
        return tuple(peaks)

    def run(self, module, device_ids, output_device, plan, inputs, kwargs):
        devices = [device_ids[slot] for slot in plan.slots]
        if plan.whole:
            inputs, kwargs = _to_device((inputs, kwargs), torch.device("cuda", devices[0]))
            chunk_inputs, chunk_kwargs = [inputs], [kwargs]
        else:
            chunk_inputs, chunk_kwargs = _scatter_all(
                inputs, kwargs, plan, cuda_splitter(devices, plan.sizes, plan.dim), cuda_broadcaster(devices)
            )
        source = device_ids[0]
        merge = None
        if devices == [source]:
            replicas = [module]  # as nn.DataParallel with one device: no replica, no gather
        else:
            # replicas hold copies of the buffers (the one on device_ids[0] shares them): merge
            # their changes so that the module's buffers advance once (see .buffers)
            merge = BufferMerge(tracked_buffers(module)) if any_training(module) else None
            targets = [source] + [d for d in devices if d != source]
            copies = dict(zip(targets, replicate(module, targets, not torch.is_grad_enabled())))
            replicas = [copies[d] for d in devices]
        try:
            outputs, timings = self.parallel_apply(replicas, devices, device_ids, plan, chunk_inputs, chunk_kwargs)
        except BaseException:
            if merge is not None:
                merge.restore()
            raise
        if merge is not None and merge.targets:
            self._merge_buffers(merge, replicas, plan, torch.device("cuda", source))
        target = output_target(output_device)
        if len(outputs) == 1 and devices == [source]:
            if len(device_ids) == 1:
                return outputs[0], timings  # nn.DataParallel on one device: the module's own output, whatever it is
            check_gatherable(outputs[0])  # a DR change could make it several chunks: as their gather would
            if target == torch.device("cuda", source):
                return outputs[0], timings  # as nn.DataParallel with one device: the module's own output
            # with several device ids nn.DataParallel always gathers to output_device: so must one chunk
            return _to_device(outputs[0], target), timings
        output = gather_outputs(
            outputs, plan.sizes, plan.dim, plan.scalar_mode,
            concat=cuda_concat(output_device, plan.dim),
            move=lambda tensor: tensor.to(target),
        )
        return output, timings

    @staticmethod
    def _merge_buffers(merge: BufferMerge, replicas: Sequence[nn.Module], plan: ChunkPlan,
                       source: torch.device) -> None:
        """Each replica's buffers (same order as the module's) into the module's, once per forward."""
        batch = sum(plan.sizes) or 1
        for replica, size in zip(replicas, plan.sizes):
            values = tracked_buffers(replica)
            floats = [v.to(source) for v in values if v.is_floating_point()]
            others = [v.to(source) for v in values if not v.is_floating_point()]
            merge.add(floats, others, size / batch)
        merge.finish()

    def count_training_forward(self) -> bool:
        """Count a training forward; True when its backward is to be timed: one training forward
        in ``backward_every``, not the very first (it pays for the GPU's warm-up)."""
        timed = self.training_forwards % self.backward_every == min(1, self.backward_every - 1)
        self.training_forwards += 1
        return timed

    def _watch_backward(self, timer: CudaReplicaTimer, output: Any) -> None:
        """Time the replica's backward; a failure to hook it leaves the forward alone timed (it
        must never fail a forward that ran), with one warning per backend."""
        try:
            timer.watch_backward(output, lambda: self.training_forwards)
        except Exception as error:  # any failure of the timing (not of the model, whose forward ran)
            if not self._warned_untimed:
                self._warned_untimed = True
                logger.warning("drbalance: cannot time the backward on %s (%s); its chunk times cover the "
                               "forward alone", timer.device, error)

    def parallel_apply(self, replicas, devices, device_ids, plan, chunk_inputs, chunk_kwargs):
        """Run each replica on its GPU (one thread per GPU when several), timed by CUDA events:
        the forward, and when gradients are on, the backward to come (``drbalance.client.cuda_timing``)."""
        results: dict[int, Any] = {}
        timers: dict[int, CudaReplicaTimer] = {}
        grad_enabled, autocast_enabled = torch.is_grad_enabled(), torch.is_autocast_enabled()
        shares = self.backward_shares if grad_enabled and self.time_backward else None
        time_backward = False
        if shares is not None:
            shares.collect()  # the shares of earlier timed backwards that have finished (no waiting)
            time_backward = self.count_training_forward()

        def worker(position: int) -> None:
            torch.set_grad_enabled(grad_enabled)
            device = devices[position]
            try:
                stream = torch.cuda.current_stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream), \
                        torch.amp.autocast("cuda", enabled=autocast_enabled):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    results[position] = output = replicas[position](*chunk_inputs[position], **chunk_kwargs[position])
                    end.record()
                timer = CudaReplicaTimer(plan.slots[position], f"cuda:{device}", plan.sizes[position], stream,
                                         start, end, shares)
                if time_backward:
                    self._watch_backward(timer, output)
                timers[position] = timer
            except Exception as error:  # re-raised in the caller's thread below
                results[position] = error

        if len(replicas) > 1:
            threads = [threading.Thread(target=worker, args=(p,)) for p in range(len(replicas))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            worker(0)
        outputs = []
        for position in range(len(replicas)):
            result = results[position]
            if isinstance(result, Exception):
                reraise_in_replica(result, self.where(device_ids, plan, position), plan.slots[position],
                                   only_device=len(device_ids) == 1)
            outputs.append(result)
        return outputs, [timers[p] for p in range(len(replicas))]


def output_target(output_device: int | torch.device | str) -> torch.device:
    """Where gathered outputs go: ``cuda:N`` for an index N, the CPU for -1 (as ``nn.DataParallel``
    reads it), else the device given."""
    if isinstance(output_device, int):
        return torch.device("cpu") if output_device == -1 else torch.device("cuda", output_device)
    return torch.device(output_device)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


@functools.cache
def _client_nvml() -> Nvml:
    """This process's NVML session for :func:`_alone_on_gpu` (initialised at its first call)."""
    return Nvml()


def _alone_on_gpu(uuid: str) -> bool | None:
    """Whether this process is the only compute process NVML lists on GPU ``uuid`` (None: cannot tell)."""
    if not uuid:
        return None
    nvml = _client_nvml()
    try:
        handle = nvml.call("nvmlDeviceGetHandleByUUID", uuid)
        pids = {process.pid for process in nvml.call("nvmlDeviceGetComputeRunningProcesses", handle)}
    except NvmlUnavailable:
        return None
    me = os.getpid()
    return None if me not in pids else pids == {me}


def default_backend() -> DeviceBackend:
    """CUDA when PyTorch sees a CUDA device; else emulated GPUs when ``DRBALANCE_EMULATED_GPUS``
    is set (their per-model cost estimated from the wrapped model, see ``drbalance.workload.models``);
    else the sequential CPU path."""
    if torch.cuda.is_available():
        return CudaBackend()
    from drbalance import env

    if env.emulated_gpus():
        from drbalance.client.emulated import EmulatedBackend

        return EmulatedBackend.from_environment()
    return CpuBackend()
