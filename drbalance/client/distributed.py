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
``set_ratio`` changes it locally (call it on every rank alike). Rank 0's ``propose_ratio`` (what
the manager link uses) rides on the next step's count exchange and becomes every rank's DR from
the same global batch on, at no extra communication; ``agree_ratio`` does the same at once, as a
collective of its own.
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


class _StepExchange:
    """The one small all-reduce every synchronising step adds: float64, ``4 * world + 2`` entries.

    Each rank fills its own slots, so a sum gives everyone every rank's values:
    ``counts`` (samples of this step), ``times`` (compute seconds of the previous step),
    ``next_batch`` (the rank's sampler's next global batch index), then rank 0's DR proposal
    (``flag``, ``total``, ``shares``; zeros from every other rank). Integers are exact in float64.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.size = 4 * world + 2

    def message(self, rank: int, samples: int, seconds: float, next_batch: int,
                proposal: DataRatio | None) -> torch.Tensor:
        world = self.world
        vector = torch.zeros(self.size, dtype=torch.float64)
        vector[rank] = samples
        vector[world + rank] = seconds
        vector[2 * world + rank] = next_batch
        if proposal is not None:
            vector[3 * world] = 1.0
            vector[3 * world + 1] = proposal.total
            vector[3 * world + 2:] = torch.tensor(proposal.shares, dtype=torch.float64)
        return vector

    def read(self, vector: torch.Tensor) -> tuple[tuple[int, ...], tuple[float, ...], int, DataRatio | None]:
        """(counts, previous times, largest next batch, proposal or None) from the summed vector."""
        world = self.world
        values = vector.tolist()
        counts = tuple(int(round(v)) for v in values[:world])
        times = tuple(values[world:2 * world])
        next_batch = int(round(max(values[2 * world:3 * world])))
        proposal = None
        if values[3 * world] >= 0.5:
            shares = [int(round(v)) for v in values[3 * world + 2:]]
            proposal = DataRatio(shares, int(round(values[3 * world + 1])))
        return counts, times, next_batch, proposal


class _BalanceState:
    """Per-step state of the weighting hook (a plain object: module attribute access is slow)."""

    __slots__ = ("rank", "world_size", "control", "gradients", "reduction", "schedule", "exchange", "pending",
                 "vector", "work", "carried", "proposal", "agreed", "counts", "previous_counts", "times",
                 "forward_started", "compute_seconds", "lock", "warned")

    def __init__(self, rank: int, world_size: int, control: Any, gradients: Any, reduction: str,
                 schedule: RatioSchedule) -> None:
        self.rank = rank
        self.world_size = world_size
        self.control = control  # gloo group of the job's ranks: the step exchange, DR agreement
        self.gradients = gradients  # DDP's own process group: the gradient all-reduce
        self.reduction = reduction
        self.schedule = schedule
        self.exchange = _StepExchange(world_size)
        self.pending = 0  # samples of forwards since the last synchronising one
        self.vector: torch.Tensor | None = None
        self.work: Any = None
        self.carried: DataRatio | None = None  # the proposal the exchange in flight carries
        self.proposal: DataRatio | None = None  # rank 0: a DR for the next exchange to carry
        self.agreed: list[tuple[DataRatio, int]] = []  # (DR, first global batch) agreed, not yet collected
        self.counts: tuple[int, ...] | None = None  # every rank's samples in the current step
        self.previous_counts: tuple[int, ...] | None = None
        self.times: tuple[float, ...] | None = None  # every rank's compute seconds in the previous step
        self.forward_started: float | None = None
        self.compute_seconds = 0.0  # this rank's forward start -> last bucket ready, previous step
        self.lock = threading.Lock()
        self.warned = False

    def start(self, samples: int) -> None:
        """Start this step's exchange (at a synchronising forward); finish one that no backward consumed."""
        with self.lock:
            self._finish()
            carried = self.proposal if self.rank == 0 else None
            self.vector = self.exchange.message(self.rank, samples, self.compute_seconds,
                                                self.schedule.next_batch, carried)
            self.carried = carried
            self.work = dist.all_reduce(self.vector, group=self.control, async_op=True)

    def step_counts(self) -> tuple[int, ...] | None:
        """Every rank's sample count for the step being reduced (waits for the exchange, once per step)."""
        with self.lock:
            self._finish()
            return self.counts

    def _finish(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            work.wait()
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {self.rank} could not exchange per-rank sample counts with the other ranks "
                f"({error}); another rank of the job probably died"
            ) from error
        counts, times, next_batch, proposal = self.exchange.read(self.vector)
        self.previous_counts, self.counts = self.counts, counts
        self.times = times if self.previous_counts is not None else None
        if self.carried is not None and self.proposal is self.carried:
            self.proposal = None  # delivered
        if proposal is not None:
            # Every rank reads the same sum, so every rank makes the same entry: the DR splits
            # global batches from the furthest any rank's sampler had got at this forward.
            self.agreed.append((proposal, self.schedule.set(proposal, next_batch)))


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
        try:  # checked here, but raised only after the exchange below, on every rank alike
            initial, problem = check_rank_ratio(even_ratio(world_size) if ratio is None else ratio, world_size,
                                                where="ratio"), ""
        except ValueError as error:
            initial, problem = even_ratio(world_size), str(error)
        control = _control_group(group)
        label, uuid = _local_device(self)
        self.ratio_schedule = RatioSchedule(initial)
        self._balance = _BalanceState(rank, world_size, control, group, loss_reduction, self.ratio_schedule)
        peers = self._introduce(initial, problem, device_label or label, uuid if device_uuid is None else device_uuid)
        self.device_labels: tuple[str, ...] = tuple(peer[0] for peer in peers)
        self._device_uuids: tuple[str, ...] = tuple(peer[1] for peer in peers)
        self.register_comm_hook(self._balance, _weighted_allreduce_hook)

    def _introduce(self, ratio: DataRatio, problem: str, label: str, uuid: str) -> list[tuple[Any, ...]]:
        """Exchange every rank's device and initial DR; raise on every rank if a DR is bad or they differ."""
        state = self._balance
        peers: list[Any] = [None] * state.world_size
        mine = (label, uuid, ratio.shares, ratio.total, problem)
        try:
            dist.all_gather_object(peers, mine, group=state.control)
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {state.rank} could not reach the job's other ranks: {error}"
            ) from error
        for rank, (_, _, _, _, trouble) in enumerate(peers):
            if trouble:
                raise ValueError(f"rank {rank} of the job: {trouble}")
        for rank, (_, _, shares, total, _) in enumerate(peers):
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

    def propose_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Rank 0: have every rank use ``ratio`` soon, at no extra communication (other ranks: ignored).

        The proposal rides on the next synchronising step's sample-count exchange; while that
        step's gradients are reduced, every rank makes ``ratio`` its DR from the furthest global
        batch any rank's sampler had produced at that forward. :meth:`take_agreed` lists the
        changes made. ``ValueError`` for a DR this job cannot use.
        """
        checked = check_rank_ratio(ratio, self.world_size)
        if self.rank == 0:
            self._balance.proposal = None if checked == self.ratio else checked

    def take_agreed(self) -> list[tuple[DataRatio, int]]:
        """The (DR, first global batch) changes agreed through step exchanges since the last call."""
        state = self._balance
        with state.lock:
            agreed, state.agreed = state.agreed, []
        return agreed

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
                samples, state.pending = state.pending, 0
                state.start(samples)
        return super().forward(*inputs, **kwargs)

    def extra_repr(self) -> str:
        return f"rank={self.rank}/{self.world_size}, ratio={self.ratio}"


class JobSync:
    """The DDP side of the manager link: what a ``Session`` steers when its model is a DDP job.

    Only rank 0 (the *leader*) talks to the manager. Its session hands the manager's DR to
    :meth:`set_ratio`, which proposes it to the job (``propose_ratio``): the next training step's
    sample-count exchange carries it to every rank, and every rank makes it its DR from the same
    global batch on. No extra collective, no rank waits for rank 0's talk with the manager, and a
    rank never trains a batch with a DR the others do not use for it. :meth:`synchronize` reports
    the changes made since it was last called.
    """

    def __init__(self, model: BalancedDistributedDataParallel) -> None:
        self.model = model

    @classmethod
    def of(cls, model: object) -> JobSync | None:
        """A JobSync for a ``BalancedDistributedDataParallel`` (also under ``torch.compile``), else None."""
        target = getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the module here
        return cls(target) if isinstance(target, BalancedDistributedDataParallel) else None

    @property
    def leader(self) -> bool:
        """Whether this rank talks to the manager (rank 0 of the job)."""
        return self.model.rank == 0

    @property
    def ratio(self) -> DataRatio:
        """The proposed DR if one is on its way, else the DR in force."""
        proposal = self.model._balance.proposal
        return proposal if proposal is not None else self.model.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Propose ``ratio`` to the job (``ValueError`` if the job cannot use it)."""
        self.model.propose_ratio(ratio)

    def synchronize(self) -> list[tuple[DataRatio, int]]:
        """The (DR, first global batch) changes every rank has made since the last call (no communication)."""
        return self.model.take_agreed()


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
