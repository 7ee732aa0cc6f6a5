"""``BalancedDataParallel``: ``nn.DataParallel`` whose scatter follows a data ratio.

Besides the split, the wrapper protects a job from the one way a DR change can kill it: a larger
share running a GPU out of memory. See :meth:`BalancedDataParallel.train_step` and
docs/client.md ("Out of memory after a DR change").
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from drbalance import env
from drbalance.client.backends import ChunkPlan, CpuBackend, DeviceBackend, default_backend
from drbalance.client.buffers import tracked_buffers
from drbalance.client.scatter_gather import SCALAR_MODES, batch_size_of
from drbalance.client.timing import ReplicaTiming
from drbalance.ratio import DataRatio, as_ratio

ModuleT = TypeVar("ModuleT", bound=nn.Module)
ResultT = TypeVar("ResultT")

logger = logging.getLogger("drbalance.client")


@dataclass(frozen=True)
class OomRevert:
    """One out-of-memory error survived: the DR that failed, the DR reverted to, what was learnt.

    ``slot``: the DR slot that ran out of memory (None = not told; every slot whose chunk grew
    is then limited). ``phase``: ``forward`` (caught inside the forward, which was re-run) or
    ``step`` (caught by :meth:`BalancedDataParallel.train_step`, e.g. in the backward; the step
    was re-run). ``max_samples``: per slot, the largest chunk known to fit afterwards (None = no
    known limit). ``failed_sizes``: the chunk sizes per slot that did not fit.
    """

    failed_ratio: DataRatio
    ratio: DataRatio
    slot: int | None
    phase: str
    failed_sizes: tuple[int, ...]
    max_samples: tuple[int | None, ...]
    message: str


class _ForwardState:
    """The DR in force, a pending DR, what the last forward did, and what is known about memory.

    ``proven``: the last DR with which a training step completed (the DR to revert to);
    ``unproven``: the last training forward's (DR, plan), proven when the next training forward
    starts (its backward has then run) or when ``train_step`` returns; ``fitted``: per slot, the
    largest chunk that completed a training step; ``limits``: per slot, the largest chunk known to
    fit after an out-of-memory error (None = no known limit); ``peak_chunk``: per slot, the
    largest chunk since memory was last read; ``in_step``: inside ``train_step``'s closure, where
    a second forward (gradient accumulation, a siamese net) starts before the first one's
    backward, so it proves nothing: the step proves its DR when the closure returns.
    """

    __slots__ = ("ratio", "pending", "plan", "timings", "proven", "unproven", "fitted", "limits",
                 "peak_chunk", "reverts", "rejected", "in_step")

    def __init__(self, ratio: DataRatio) -> None:
        count = len(ratio)
        self.ratio = ratio
        self.pending: DataRatio | None = None
        self.plan: ChunkPlan | None = None
        self.timings: list[Any] = []
        self.proven: DataRatio | None = None
        self.unproven: tuple[DataRatio, ChunkPlan] | None = None
        self.fitted = [0] * count
        self.limits: list[int | None] = [None] * count
        self.peak_chunk = [0] * count
        self.reverts: deque[OomRevert] = deque(maxlen=64)
        self.rejected: set[DataRatio] = set()
        self.in_step = False

    # Pickling (torch.save of the wrapper, deepcopy, AveragedModel): the DRs and what is known
    # about memory travel; per-call records (lazy timings holding CUDA events, plans) do not.
    def __getstate__(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "pending": self.pending, "proven": self.proven,
                "fitted": list(self.fitted), "limits": list(self.limits)}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(saved["ratio"])
        self.pending, self.proven = saved["pending"], saved["proven"]
        self.fitted, self.limits = list(saved["fitted"]), list(saved["limits"])


class _StepSnapshot:
    """Gradients and buffers of a module before a training step, to undo a failed step.

    Gradients are copied to host memory (a GPU that just ran out of memory has none to spare);
    buffers (small) stay on their device. Parameters whose gradient was None get None back.
    """

    def __init__(self, module: nn.Module) -> None:
        with torch.no_grad():
            self.grads = [(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True))
                          for p in module.parameters()]
            self.buffers = [(b, b.detach().clone()) for b in tracked_buffers(module)]

    def restore(self) -> None:
        with torch.no_grad():
            for parameter, grad in self.grads:
                if grad is None:
                    parameter.grad = None
                elif parameter.grad is not None and parameter.grad.shape == grad.shape:
                    parameter.grad.data.copy_(grad)
                else:
                    parameter.grad = grad.to(parameter.device)
            for buffer, value in self.buffers:
                buffer.data.copy_(value)


def _has_training_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` holds a batch-norm layer in training mode (which cannot train on one
    sample). The layer's own mode counts: a model in eval mode may have batch norm put back in
    training mode (test-time adaptation), and a training model may hold frozen batch norm."""
    return any(isinstance(part, nn.modules.batchnorm._BatchNorm) and part.training for part in module.modules())


def fold_single_samples(sizes: Sequence[int]) -> tuple[int, ...]:
    """Chunk sizes with every chunk of one sample moved onto the largest chunk (the first of
    equals), for a batch of two samples or more: a replica training batch norm on one sample
    raises "Expected more than 1 value per channel when training". A DR's small share meets a
    small batch (an epoch's last, partial one) this way, as an even split of 3 samples on 2 GPUs
    does (where ``nn.DataParallel`` fails)."""
    folded = list(sizes)
    if sum(folded) < 2:
        return tuple(folded)
    for slot, size in enumerate(folded):
        if size == 1:
            folded[slot] = 0
            largest = max(range(len(folded)), key=folded.__getitem__)
            folded[largest] += 1
    return tuple(folded)


def coerce_ratio(value: DataRatio | Sequence[float] | Any) -> DataRatio:
    """A DataRatio from a DataRatio, a sequence of weights, or a 1-D numpy array or tensor of them
    (``drbalance.ratio.as_ratio``: whole numbers keep their proportions, others are apportioned
    to the DR total of 10)."""
    if isinstance(value, DataRatio):
        return value
    dtype = None
    if hasattr(value, "tolist") and hasattr(value, "ndim") and hasattr(value, "shape"):  # numpy, torch
        if value.ndim != 1:
            raise ValueError(
                f"a DR given as an array or tensor must be 1-D (one share per device); got shape {tuple(value.shape)}"
            )
        dtype = value.dtype
        value = value.tolist()
    try:
        return as_ratio(value)
    except ValueError as error:
        if dtype is None:
            raise
        raise ValueError(f"{error} (the DR was an array of dtype {dtype})") from None


class outside_compile:  # noqa: N801 - a decorator, named like torch's
    """A method kept out of ``torch.compile``, as ``torch.compiler.disable`` keeps it, without
    importing ``torch._dynamo`` (seconds: as long as ``import torch`` itself) in every process that
    never compiles. While ``torch._dynamo`` is not loaded, nothing can compile, and a lookup gives
    the plain method. The first lookup once it is (``torch.compile`` loads it, and looks the
    method up when it wraps the module, before it traces anything) puts the method wrapped by
    ``torch.compiler.disable`` in this descriptor's place in its class, where dynamo then finds it
    as if the class had been written with the decorator."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.__doc__ = method.__doc__
        self.__wrapped__ = method
        self.owner: type | None = None
        self.name = method.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, instance: Any, owner: type | None = None) -> Callable[..., Any]:
        method = self.method
        if "torch._dynamo" in sys.modules and self.owner is not None:
            method = torch.compiler.disable(self.method)
            setattr(self.owner, self.name, method)  # from now on the class holds the disabled method
        return method.__get__(instance, owner)


class BalancedDataParallel(nn.DataParallel, Generic[ModuleT]):
    """A drop-in for ``torch.nn.DataParallel`` that splits each batch by a data ratio (DR).

    Arguments are those of ``nn.DataParallel`` plus:

    - ``ratio``: a :class:`~drbalance.DataRatio`, or one weight per entry of ``device_ids`` (a
      list, or a 1-D numpy array or tensor): whole numbers keep their proportions (``[3, 1]`` is
      ``[3, 1]/4``), other numbers are apportioned to the DR total of 10 by largest remainder
      (``[0.7, 0.3]`` is ``[7, 3]/10``). Default: an exactly even split (``[1] * len(device_ids)``
      with total ``len(device_ids)``), which chunks a batch as ``nn.DataParallel`` does up to
      rounding.
    - ``backend``: where chunks run (:mod:`drbalance.client.backends`); default CUDA when
      available, else emulated GPUs when ``DRBALANCE_EMULATED_GPUS`` is set, else the CPU, where
      the same split path runs sequentially with one module.
    - ``scalar_outputs``: what a module returning a 0-dim tensor (e.g. a mean loss) gives back.
      ``"weighted_mean"`` (default) weights each replica's value by its chunk size, so the
      result equals the bare module's on the whole batch for every DR; ``"stack"`` returns the
      per-replica vector as ``nn.DataParallel`` does (its ``.mean()`` is then mis-weighted when
      chunks are uneven).

    Replicas exist only on devices with a non-empty chunk. Outputs are gathered in the original
    sample order on ``output_device``. :meth:`set_ratio` takes effect at the next forward. In
    training mode, buffers (BatchNorm's running statistics) advance once per forward
    (:mod:`drbalance.client.buffers`). An out-of-memory error after a DR change reverts to the
    last DR that worked (:meth:`train_step`).
    """

    def __init__(
        self,
        module: ModuleT,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        ratio: DataRatio | Sequence[float] | None = None,
        *,
        backend: DeviceBackend | None = None,
        scalar_outputs: str = "weighted_mean",
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"BalancedDataParallel wraps an nn.Module; got {type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an integer; got {dim!r}")
        if scalar_outputs not in SCALAR_MODES:
            raise ValueError(f"scalar_outputs must be one of {SCALAR_MODES}; got {scalar_outputs!r}")
        self.module = module
        self.dim = dim
        self.scalar_outputs = scalar_outputs
        # training batch norm needs two samples or more in each replica's chunk
        self.backend = backend if backend is not None else default_backend()
        ratio_value = None if ratio is None else coerce_ratio(ratio)
        self.device_ids = self.backend.resolve_device_ids(
            device_ids, None if ratio_value is None else len(ratio_value)
        )
        self.output_device = self.backend.resolve_output_device(output_device, self.device_ids)
        if self.backend.kind == "cuda":
            self.src_device_obj = torch.device("cuda", self.device_ids[0])
        count = len(self.device_ids)
        initial = self._checked(ratio_value) if ratio_value is not None else DataRatio.even(count, count)
        # Per-call state lives on a plain object: nn.Module attribute access is slow on a hot path.
        self._state = _ForwardState(initial)
        self.backend.prepare(self.module, self.device_ids)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (``torch.load`` of a model saved whole, a copy): a wrapper whose emulated GPUs
        came from ``DRBALANCE_EMULATED_GPUS`` runs on the CPU path where that variable is not set
        (it reopened emulated GPUs there), and on emulated GPUs, as saved, where it is. A backend
        the script chose itself (``backend=``) stays as it was."""
        super().__setstate__(state)
        if getattr(self.backend, "chosen_by_environment", False) and not env.emulated_gpus():
            logger.info("drbalance: a model saved on emulated GPUs runs on the CPU path here "
                        "(DRBALANCE_EMULATED_GPUS is not set)")
            self.backend = CpuBackend()

    # --- the data ratio -----------------------------------------------------------------------
    def _checked(self, ratio: DataRatio) -> DataRatio:
        if len(ratio) != len(self.device_ids):
            raise ValueError(
                f"the DR {ratio} has {len(ratio)} entries but device_ids {self.device_ids} has "
                f"{len(self.device_ids)}; give one share per device"
            )
        return ratio

    @property
    def ratio(self) -> DataRatio:
        """The DR the next forward will use (a pending DR that does not fit memory is refused then)."""
        state = self._state
        return state.pending if state.pending is not None else state.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[float] | Any) -> None:
        """Use ``ratio`` from the next forward on (a forward in progress keeps its split).

        Accepts a DataRatio, or weights as the constructor's ``ratio`` does (``list(model.ratio.shares)``
        gives the same DR back).
        """
        self._state.pending = self._checked(coerce_ratio(ratio))

    # --- what the last forward did ------------------------------------------------------------
    @property
    def last_chunk_sizes(self) -> tuple[int, ...]:
        """Samples per DR slot in the last forward (0 for slots without a replica)."""
        plan = self._state.plan
        sizes = [0] * len(self.device_ids)
        if plan is not None:
            for slot, size in zip(plan.slots, plan.sizes):
                sizes[slot] = size
        return tuple(sizes)

    def last_replica_timings(self) -> list[ReplicaTiming]:
        """Device time of each replica in the last forward (waits for the GPU on first read).

        On CUDA and emulated GPUs: the forward and, once it has run, the backward (read before the
        backward, it is the forward alone); on the CPU: the forward's wall time.
        """
        state = self._state
        resolved = [t if isinstance(t, ReplicaTiming) else t() for t in state.timings]
        # keep a CUDA timer whose backward has not run yet: a later read adds the backward
        state.timings = [r if getattr(t, "pending", False) is False else t for t, r in zip(state.timings, resolved)]
        return resolved

    # --- devices and memory, for the manager --------------------------------------------------
    def device_uuids(self) -> tuple[str, ...]:
        """The GPU UUID of each DR slot's device (``GPU-...`` as NVML names it; "" = unknown).

        The manager maps them to its own GPUs, so DR slot g means the same GPU to both whatever
        ``CUDA_VISIBLE_DEVICES``, Slurm or a container did to device numbering.
        """
        return self.backend.device_uuids(self.device_ids)

    def memory_per_sample(self) -> tuple[float | None, ...]:
        """Per DR slot: peak device memory since the last call (bytes) / the largest chunk then.

        CUDA: ``torch.cuda.max_memory_allocated`` (then reset); emulated GPUs: their memory
        model; the CPU: None. A slot without a chunk since the last call gives None. The peak
        includes the replica's weights and gradients, so the value over-states the memory of one
        more sample: a conservative figure for the manager's memory cap.
        """
        state = self._state
        peaks = self.backend.take_peak_memory(self.device_ids)
        result = tuple(None if peak is None or chunk == 0 else peak / chunk
                       for peak, chunk in zip(peaks, state.peak_chunk))
        state.peak_chunk = [0] * len(self.device_ids)
        return result

    @property
    def max_samples(self) -> tuple[int | None, ...]:
        """Per DR slot, the largest chunk known to fit after an out-of-memory error (None = no limit)."""
        return tuple(self._state.limits)

    def take_reverts(self) -> list[OomRevert]:
        """The out-of-memory reverts since the last call (the session logs and reports them)."""
        reverts = list(self._state.reverts)
        self._state.reverts.clear()
        return reverts

    # --- the forward pass ---------------------------------------------------------------------
    def _take_ratio(self) -> DataRatio:
        state = self._state
        pending = state.pending
        if pending is not None:
            old, state.ratio, state.pending = state.ratio, pending, None
            emptied = [self.device_ids[slot] for slot in old.used if pending[slot] == 0]
            if emptied:  # no replica there any more: give its cached memory back for other jobs
                self.backend.release_memory(emptied)
        return state.ratio

    def plan(self, ratio: DataRatio, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> ChunkPlan:
        """Which slots get how many samples for this call's batch."""
        batch = batch_size_of(inputs, kwargs, self.dim)
        if not batch:
            return ChunkPlan((ratio.used[0],), (batch or 0,), self.dim, self.scalar_outputs, whole=True)
        sizes = ratio.split(batch)
        if 1 in sizes and _has_training_batch_norm(self.module):  # layers added after wrapping too
            sizes = fold_single_samples(sizes)
        slots = tuple(slot for slot, size in enumerate(sizes) if size > 0)
        return ChunkPlan(slots, tuple(sizes[s] for s in slots), self.dim, self.scalar_outputs)

    @outside_compile
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Split the batch by the DR, run the replicas, gather the outputs in sample order.

        Kept out of ``torch.compile`` (``torch.compiler.disable``, applied once dynamo is loaded:
        :class:`outside_compile`): the split and the bookkeeping (DR, timings, out-of-memory
        records, emulated costs) change with every DR and would make dynamo break its graphs and
        recompile at each change. ``model.compile()`` compiles the wrapped module instead
        (:meth:`compile`), whose chunks then run compiled.
        """
        with torch.autograd.profiler.record_function("BalancedDataParallel.forward"):
            state = self._state
            training = torch.is_grad_enabled()
            if training and state.unproven is not None and not state.in_step:
                self._prove()  # a new training forward: the last one's backward has run
            ratio = self._take_ratio()
            self.backend.check_module(self.module, self.device_ids)
            plan = self.plan(ratio, inputs, kwargs)
            if state.proven is not None and any(limit is not None for limit in state.limits):
                ratio, plan = self._within_limits(ratio, plan, inputs, kwargs)
            try:
                output, timings = self.backend.run(
                    self.module, self.device_ids, self.output_device, plan, inputs, kwargs
                )
            except Exception as error:
                failure = self._revertible(error, ratio)
                if failure is None:
                    raise
            else:
                self._forward_done(ratio, plan, timings, training)
                return output
            # Out of memory with a DR not yet proven: the failed forward's tensors are released
            # now (outside the except block); revert and run the same batch again.
            self._revert(ratio, plan, failure[0], "forward", failure[1])
            ratio = state.ratio
            plan = self.plan(ratio, inputs, kwargs)
            output, timings = self.backend.run(self.module, self.device_ids, self.output_device, plan, inputs, kwargs)
            self._forward_done(ratio, plan, timings, training)
            return output

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile the wrapped module in place (``self.module.compile(*args, **kwargs)``, as
        ``nn.Module.compile`` takes them); the split and drbalance's bookkeeping stay uncompiled
        (:meth:`forward`). Chunk sizes change with the DR: ``dynamic=True`` compiles once for all
        of them (by default dynamo recompiles once, at the first new size, then treats it as dynamic)."""
        self.module.compile(*args, **kwargs)

    def train_step(self, closure: Callable[[], ResultT]) -> ResultT:
        """Run one training step's ``closure`` (forward, loss, ``backward()``); return its result.

        If the closure runs out of device memory with a DR that has not yet completed a step
        (typically the first step after the manager moved a larger share onto a GPU), the step
        is undone and re-run with the last DR that worked: the module's gradients and buffers
        are put back to their values before the closure (gradients accumulated by earlier
        micro-batches survive), device memory is released, the DR reverts, the chunk size that
        failed becomes the slot's limit (reported to the manager by the session), and the
        closure runs once more. The optimizer step belongs after this call, so it runs exactly
        once, on complete gradients. An out-of-memory error with a proven DR, a second one, or
        any other error propagates unchanged. An error in the forward is handled there even
        without this method; only errors in the backward need it.

            def closure():
                loss = criterion(model(images), labels)
                loss.backward()
                return loss

            optimizer.zero_grad()
            loss = model.train_step(closure)
            optimizer.step()

        Gradients of parameters outside the wrapped module are not restored.
        """
        state = self._state
        if state.unproven is not None:
            self._prove()
        target = state.pending if state.pending is not None else state.ratio
        snapshot = _StepSnapshot(self.module) if state.proven is not None and target != state.proven else None
        try:
            state.in_step = True
            result = closure()
        except Exception as error:
            failure = self._revertible(error, state.ratio) if snapshot is not None else None
            failed = state.unproven if state.unproven is not None else (state.ratio, state.plan)
            if failure is None or failed[1] is None or failed[1].whole:
                raise
        else:
            if state.unproven is not None:
                self._prove()
            return result
        finally:
            state.in_step = False
        state.unproven = None
        snapshot.restore()
        self._revert(failed[0], failed[1], failure[0], "step", failure[1])
        try:
            state.in_step = True
            result = closure()
        finally:
            state.in_step = False
        if state.unproven is not None:
            self._prove()
        return result

    # --- out-of-memory bookkeeping ---------------------------------------------------------
    def _forward_done(self, ratio: DataRatio, plan: ChunkPlan, timings: list[Any], training: bool) -> None:
        state = self._state
        state.plan, state.timings = plan, timings
        if training and not plan.whole:
            state.unproven = (ratio, plan)
            peak = state.peak_chunk
            for slot, size in zip(plan.slots, plan.sizes):
                if size > peak[slot]:
                    peak[slot] = size

    def _prove(self) -> None:
        state = self._state
        ratio, plan = state.unproven
        state.unproven = None
        state.proven = ratio
        fitted = state.fitted
        for slot, size in zip(plan.slots, plan.sizes):
            if size > fitted[slot]:
                fitted[slot] = size

    def _revertible(self, error: BaseException, ratio: DataRatio) -> tuple[int | None, str] | None:
        """(slot, message) if ``error`` is out of memory and a proven, different DR exists."""
        state = self._state
        if state.proven is None or state.proven == ratio:
            return None
        oom = self.backend.out_of_memory(error, self.device_ids)
        if oom is None:
            return None
        return oom.slot, f"{type(oom.error).__name__}: {oom.error}"

    def _revert(self, failed_ratio: DataRatio, plan: ChunkPlan, slot: int | None, phase: str, message: str) -> None:
        state = self._state
        failed = [0] * len(self.device_ids)
        for s, size in zip(plan.slots, plan.sizes):
            failed[s] = size
        if slot is not None and failed[slot] > 0:
            suspects = [slot]
        else:  # not told where: every slot whose chunk grew beyond what has fitted there
            suspects = [s for s in plan.slots if failed[s] > state.fitted[s]] or list(plan.slots)
        for s in suspects:
            fits = state.fitted[s] if state.fitted[s] < failed[s] else failed[s] - 1
            current = state.limits[s]
            state.limits[s] = max(0, fits if current is None else min(current, fits))
        state.ratio = state.proven
        self.backend.release_memory()
        event = OomRevert(failed_ratio, state.proven, slot, phase, tuple(failed), tuple(state.limits), message)
        state.reverts.append(event)
        logger.warning(
            "drbalance: out of memory with DR %s (chunks %s, %s); reverted to DR %s and re-ran the %s; "
            "largest chunks known to fit per slot: %s", failed_ratio, list(failed), message.splitlines()[0][:200],
            state.proven, "forward" if phase == "forward" else "step", list(state.limits),
        )

    def _within_limits(self, ratio: DataRatio, plan: ChunkPlan, inputs: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[DataRatio, ChunkPlan]:
        """Refuse a new DR whose chunks exceed what is known to fit; keep the last DR that worked."""
        state = self._state
        if ratio == state.proven or plan.whole:
            return ratio, plan
        over = [(slot, size, state.limits[slot]) for slot, size in zip(plan.slots, plan.sizes)
                if state.limits[slot] is not None and size > state.limits[slot]]
        if not over:
            return ratio, plan
        if ratio not in state.rejected:
            state.rejected.add(ratio)
            where = ", ".join(f"{size} samples on slot {slot} (fits {limit})" for slot, size, limit in over)
            logger.warning("drbalance: DR %s would put %s; that did not fit in memory before, so DR %s stays",
                           ratio, where, state.proven)
        state.ratio = state.proven
        return state.proven, self.plan(state.proven, inputs, kwargs)

    def extra_repr(self) -> str:
        return f"backend={self.backend.kind}, device_ids={self.device_ids}, ratio={self.ratio}"

