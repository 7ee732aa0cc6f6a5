"""``BalancedDistributedDataParallel``: ``DistributedDataParallel`` with uneven, DR-steered per-rank batches.

Each rank of the job trains on its share of every *global* batch (:mod:`drbalance.client.sampler`
hands it out); the shares follow the job's data ratio (DR), one integer share per rank. Plain DDP
averages the ranks' gradients, which is the wrong gradient when the ranks' batches differ in size:
the mean of unequal local means is not the mean over the global batch. This wrapper weights each
rank's gradient by its share of the samples *before* the all-reduce, through a DDP communication
hook, so every rank ends with the gradient of the mean loss over the whole global batch:

    grad = sum_r (n_r / B) * grad_r        (n_r samples on rank r, B = sum_r n_r)

where ``grad_r`` is the gradient of rank r's own mean loss (PyTorch's default ``reduction="mean"``).
The sample counts ``n_r`` are exchanged, not assumed: every synchronising forward starts a small
asynchronous all-reduce of this rank's sample count (over a gloo group of the job's ranks, so it
never touches the GPU stream), and the hook waits for it (long done by then) before it scales the
first bucket. With equal counts the factor is exactly the ``1 / world_size`` that DDP's own
reducer multiplies by, so equal shares give bit-for-bit the gradients of plain DDP.

The DR itself lives in a :class:`~drbalance.client.sampler.RatioSchedule` shared with the sampler.
``set_ratio`` changes it locally (call it on every rank alike); ``agree_ratio`` is the collective
that makes rank 0's choice (e.g. the manager's answer) everyone's, from the same global batch on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from drbalance.client.sampler import MIN_SHARE, RatioSchedule, check_rank_ratio, even_ratio
from drbalance.client.scatter_gather import batch_size_of
from drbalance.client.timing import ReplicaTiming
from drbalance.ratio import DataRatio

logger = logging.getLogger("drbalance.client")

LOSS_REDUCTIONS = ("mean", "sum")


class RatioSyncError(RuntimeError):
    """A collective of the job's control group failed (typically: another rank died)."""


class _BalanceState:
    """Per-step state of the weighting hook (a plain object: module attribute access is slow)."""

    __slots__ = ("rank", "world_size", "control", "gradients", "reduction", "pending", "counts_tensor", "work",
                 "counts", "previous_counts", "times", "forward_started", "compute_seconds", "lock", "warned")

    def __init__(self, rank: int, world_size: int, control: Any, gradients: Any, reduction: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.control = control  # gloo group of the job's ranks: counts, DR agreement
        self.gradients = gradients  # DDP's own process group: the gradient all-reduce
        self.reduction = reduction
        self.pending = 0  # samples of forwards since the last synchronising one
        self.counts_tensor: torch.Tensor | None = None
        self.work: Any = None
        self.counts: tuple[int, ...] | None = None  # every rank's samples in the current step
        self.previous_counts: tuple[int, ...] | None = None
        self.times: tuple[float, ...] | None = None  # every rank's compute seconds in the previous step
        self.forward_started: float | None = None
        self.compute_seconds = 0.0  # this rank's forward start -> last bucket ready, previous step
        self.lock = threading.Lock()
        self.warned = False

    def step_counts(self) -> tuple[int, ...] | None:
        """Every rank's sample count for the step being reduced (waits for the count all-reduce once)."""
        with self.lock:
            if self.work is not None:
                work, self.work = self.work, None
                try:
                    work.wait()
                except RuntimeError as error:
                    raise RatioSyncError(
                        f"drbalance: rank {self.rank} could not exchange per-rank sample counts with the other ranks "
                        f"({error}); another rank of the job probably died"
                    ) from error
                values = self.counts_tensor.tolist()
                world = self.world_size
                self.previous_counts = self.counts
                self.counts = tuple(int(round(v)) for v in values[:world])
                self.times = tuple(values[world:]) if self.previous_counts is not None else None
            return self.counts


def _weighted_allreduce_hook(state: _BalanceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale this rank's bucket by its share of the global batch's samples, then all-reduce (sum)."""
    buffer = bucket.buffer()
    counts = state.step_counts()
    world = state.world_size
    if counts is None or sum(counts) <= 0:
        if not state.warned:
            state.warned = True
            logger.warning("drbalance: no sample counts for this backward (no synchronising forward?); "
                           "averaging gradients evenly as plain DDP does")
        buffer.mul_(1.0 / world)
    else:
        mine, total = counts[state.rank], sum(counts)
        if state.reduction == "sum":
            buffer.mul_(1.0 / total)  # each rank's loss is a sum over its samples
        elif mine == 0:
            buffer.zero_()  # an empty rank contributes nothing (its mean loss would be NaN)
        else:
            # With equal counts mine / total rounds to exactly 1 / world: the very factor DDP's own
            # reducer multiplies by, so equal shares give plain DDP's gradients bit for bit.
            buffer.mul_(mine / total)
    if bucket.is_last() and state.forward_started is not None:
        state.compute_seconds = time.perf_counter() - state.forward_started
        state.forward_started = None
    future = dist.all_reduce(buffer, group=state.gradients, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations against the real objects; this module's are strings (PEP 563).
_weighted_allreduce_hook.__annotations__ = {
    "state": _BalanceState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def _local_device(ddp: DistributedDataParallel) -> tuple[str, str]:
    """(label, GPU UUID or "") of the device this rank trains on."""
    if ddp.device_type == "cuda":
        index = ddp.device_ids[0] if ddp.device_ids else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid and not uuid.startswith("GPU-"):
            uuid = f"GPU-{uuid}"  # NVML's spelling (nvidia-smi -L)
        return f"cuda:{index}", uuid
    return ddp.device_type, ""


class BalancedDistributedDataParallel(DistributedDataParallel):
    """A ``DistributedDataParallel`` whose ranks train on uneven, DR-steered shares of each global batch.

    Arguments are those of ``DistributedDataParallel`` (passed through) plus, by keyword:

    - ``ratio``: a :class:`~drbalance.DataRatio` or list of integer shares, one per rank of the
      job (the process group's ranks, in rank order), each at least ``MIN_SHARE`` (1) unit.
      Default: equal shares (an even split, as plain DDP). A total below 10 is raised to a
      multiple of itself (``[1, 1]/2`` is kept as ``[5, 5]/10``: same proportions, same splits).
      Every rank must be given the same DR; the constructor checks it.
    - ``loss_reduction``: ``"mean"`` (default) if each rank's loss is the mean over its own
      samples (PyTorch's default), ``"sum"`` if it is a sum over them. Either way every rank ends
      with the gradient of the *mean* loss over the global batch.
    - ``device_label`` / ``device_uuid``: name and GPU UUID of this rank's device, when the
      module's device does not say it (e.g. emulated GPUs); default: from CUDA, or ``"cpu"``.

    The constructor is a collective (as DDP's is): every rank of the group calls it. It makes a
    gloo group of the job's ranks for control traffic (sample counts, DR agreement) and registers
    the sample-weighting communication hook, so ``register_comm_hook`` cannot be used as well.
    Gradient accumulation with ``no_sync()`` counts the samples of every forward since the last
    synchronising one (each micro-batch's loss must then be the mean over the accumulated samples,
    i.e. scaled by its share of them, for the weighting to stay exact).
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        ratio: DataRatio | Sequence[int] | None = None,
        loss_reduction: str = "mean",
        device_label: str | None = None,
        device_uuid: str | None = None,
        **kwargs: Any,
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
        super().__init__(module, *args, **kwargs)
        group = self.process_group
        world_size, rank = group.size(), group.rank()
        initial = check_rank_ratio(even_ratio(world_size) if ratio is None else ratio, world_size, where="ratio")
        control = _control_group(group)
        label, uuid = _local_device(self)
        self._balance = _BalanceState(rank, world_size, control, group, loss_reduction)
        self.ratio_schedule = RatioSchedule(initial)
        peers = self._introduce(initial, device_label or label, uuid if device_uuid is None else device_uuid)
        self.device_labels: tuple[str, ...] = tuple(peer[0] for peer in peers)
        self._device_uuids: tuple[str, ...] = tuple(peer[1] for peer in peers)
        self.register_comm_hook(self._balance, _weighted_allreduce_hook)

    def _introduce(self, ratio: DataRatio, label: str, uuid: str) -> list[tuple[str, str, tuple[int, ...], int]]:
        """Exchange every rank's device and initial DR; raise on every rank if the DRs differ."""
        state = self._balance
        peers: list[Any] = [None] * state.world_size
        mine = (label, uuid, ratio.shares, ratio.total)
        try:
            dist.all_gather_object(peers, mine, group=state.control)
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {state.rank} could not reach the job's other ranks: {error}"
            ) from error
        for rank, (_, _, shares, total) in enumerate(peers):
            if (tuple(shares), total) != (ratio.shares, ratio.total):
                raise ValueError(
                    f"rank {rank} was given ratio {list(shares)}/{total} but rank {state.rank} {ratio}; give every "
                    f"rank of a BalancedDistributedDataParallel the same ratio"
                )
        return peers

    # --- the job ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job's process group."""
        return self._balance.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job's process group (= entries of the DR)."""
        return self._balance.world_size

    @property
    def min_share(self) -> int:
        """Units of the DR total every rank must keep (1: at least one sample per rank and step)."""
        return MIN_SHARE

    def device_uuids(self) -> tuple[str, ...]:
        """GPU UUID of every rank's device, in rank order ("" where unknown, e.g. on the CPU)."""
        return self._device_uuids

    # --- the data ratio -----------------------------------------------------------------------
    @property
    def ratio(self) -> DataRatio:
        """The DR of global batches from the next one the sampler produces on."""
        return self.ratio_schedule.latest

    def set_ratio(self, ratio: DataRatio | Sequence[int], from_batch: int | None = None) -> int:
        """Split global batches from ``from_batch`` (default: the next one) by ``ratio``; returns that index.

        A local call: make it on every rank with the same arguments at the same step (as every
        change to a DDP model), or use :meth:`agree_ratio`, which makes rank 0's choice everyone's.
        ``ValueError`` for a DR with the wrong number of shares or a rank below ``min_share``.
        """
        return self.ratio_schedule.set(check_rank_ratio(ratio, self.world_size), from_batch)

    def agree_ratio(self, proposal: DataRatio | None) -> tuple[DataRatio, int | None]:
        """Collective: every rank takes rank 0's ``proposal`` (None = keep) from the same global batch on.

        Every rank of the job must call it at the same step. Other ranks' proposals are ignored.
        The new DR starts at the largest "next global batch" of all ranks' samplers, so no rank
        has already produced a batch of the new DR's range with the old one. Returns the DR in
        force and the global batch index it starts at (None when nothing changed).
        ``RatioSyncError`` if another rank cannot be reached.
        """
        state = self._balance
        world = state.world_size
        message = torch.zeros(world + 3, dtype=torch.int64)
        if state.rank == 0 and proposal is not None and proposal != self.ratio:
            checked = check_rank_ratio(proposal, world)
            message[0], message[1] = 1, checked.total
            message[2:2 + world] = torch.tensor(checked.shares, dtype=torch.int64)
        message[2 + world] = self.ratio_schedule.next_batch
        try:
            dist.all_reduce(message, op=dist.ReduceOp.MAX, group=state.control)
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {state.rank} could not agree on the DR with the job's other ranks ({error}); "
                f"another rank of the job probably died"
            ) from error
        values = message.tolist()
        if not values[0]:
            return self.ratio, None
        ratio = check_rank_ratio(DataRatio(values[2:2 + world], values[1]), world, where="agreed DR")
        return ratio, self.ratio_schedule.set(ratio, values[2 + world])

    # --- what the last steps did --------------------------------------------------------------
    @property
    def last_chunk_sizes(self) -> tuple[int, ...]:
        """Samples every rank trained on in the last synchronised step (zeros before the first)."""
        counts = self._balance.counts
        return counts if counts is not None else (0,) * self.world_size

    def last_replica_timings(self) -> list[ReplicaTiming]:
        """Per rank: samples and compute seconds (forward start to last gradient bucket ready).

        These are the step before the last one: they travel with the next step's sample counts,
        so they cost no extra collective. Empty until two steps have run.
        """
        state = self._balance
        if state.times is None or state.previous_counts is None:
            return []
        return [
            ReplicaTiming(rank, self.device_labels[rank], state.previous_counts[rank], seconds)
            for rank, seconds in enumerate(state.times)
        ]

    # --- the forward pass ---------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            state = self._balance
            if state.forward_started is None:
                state.forward_started = time.perf_counter()
            state.pending += batch_size_of(inputs, kwargs, self.dim) or 0
            if self.require_backward_grad_sync:
                self._start_count_exchange(state)
        return super().forward(*inputs, **kwargs)

    def _start_count_exchange(self, state: _BalanceState) -> None:
        world = state.world_size
        vector = torch.zeros(2 * world, dtype=torch.float64)
        vector[state.rank] = state.pending
        vector[world + state.rank] = state.compute_seconds
        state.pending = 0
        with state.lock:
            if state.work is not None:  # a synchronising forward without a backward: drop its counts
                state.work.wait()
            state.counts_tensor = vector
            state.work = dist.all_reduce(vector, group=state.control, async_op=True)

    def extra_repr(self) -> str:
        return f"rank={self.rank}/{self.world_size}, ratio={self.ratio}"


class JobSync:
    """The DDP side of the manager link: what a ``Session`` steers when its model is a DDP job.

    Only rank 0 (the *leader*) talks to the manager. Its session hands the manager's DR to
    :meth:`set_ratio`, which only records it as a proposal; at every synchronisation point (the
    session's report and decision steps, which every rank reaches at the same iteration) every
    rank calls :meth:`synchronize`, a collective that makes the proposal every rank's DR from the
    same global batch on. A rank never trains a batch with a DR the others do not use for it.
    """

    def __init__(self, model: BalancedDistributedDataParallel) -> None:
        self.model = model
        self.proposal: DataRatio | None = None

    @classmethod
    def of(cls, model: object) -> JobSync | None:
        """A JobSync for a ``BalancedDistributedDataParallel``, None for anything else."""
        return cls(model) if isinstance(model, BalancedDistributedDataParallel) else None

    @property
    def leader(self) -> bool:
        """Whether this rank talks to the manager (rank 0 of the job)."""
        return self.model.rank == 0

    @property
    def ratio(self) -> DataRatio:
        """The proposed DR if there is one, else the DR in force."""
        return self.proposal if self.proposal is not None else self.model.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Propose ``ratio`` for the next synchronisation (``ValueError`` if the job cannot use it)."""
        self.proposal = check_rank_ratio(ratio, self.model.world_size)

    def synchronize(self) -> tuple[DataRatio, int | None]:
        """Collective: rank 0's proposal becomes every rank's DR. (DR in force, first global batch or None)."""
        proposal, self.proposal = self.proposal, None
        return self.model.agree_ratio(proposal)


def _control_group(group: Any) -> Any:
    """A gloo group of ``group``'s ranks (the group itself when it is gloo already).

    Sample counts and the DR are tiny CPU tensors: on gloo they cost no GPU synchronisation
    whatever the gradient backend is. Only the group's members call ``new_group``.
    """
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


__all__ = ["BalancedDistributedDataParallel", "JobSync", "RatioSyncError", "LOSS_REDUCTIONS"]
