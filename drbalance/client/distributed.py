"""``BalancedDistributedDataParallel``: ``DistributedDataParallel`` with uneven, DR-steered per-rank batches.

Each rank of the job trains on its share of every *global* batch (:mod:`drbalance.client.sampler`
hands it out); the shares follow the job's data ratio (DR), one integer share per rank. Plain DDP
averages the ranks' gradients, which is the wrong gradient when the ranks' batches differ in size:
the mean of unequal local means is not the mean over the global batch. This wrapper weights each
rank's gradient by its share of the samples through a DDP communication hook, so every rank ends
with the gradient of the mean loss over the whole global batch:

    grad = sum_r (n_r / B) * grad_r        (n_r samples on rank r, B = sum_r n_r)

where ``grad_r`` is the gradient of rank r's own mean loss (PyTorch's default ``reduction="mean"``).

The sample counts ``n_r`` are exchanged, not assumed, and in most steps they cost no collective
of their own. There are two kinds of synchronising step (a forward with gradient sync, and its
backward):

- **Counting steps** (most steps). Every rank already knows ``B_ref``, the global batch of the
  last reduced step (every rank read the same sum). The hook scales this rank's bucket by
  ``n_r / B_ref`` and appends ``W`` count slots (this rank's ``n_r`` in slot r, zeros elsewhere) to
  the *first* gradient bucket (``bucket.index() == 0``, which DDP always reduces first), so one
  all-reduce yields the gradient sum and every rank's count. With ``B = sum`` of the slots, every
  bucket is then corrected by ``B_ref / B`` (skipped when they are equal), giving exactly the
  weights ``n_r / B``. On CPU buckets (gloo) the other buckets' futures are combined with the first
  one's (gloo may complete them out of order); on CUDA buckets (NCCL) the correction factor stays a
  device tensor, stream-ordered after the first bucket's reduction, and the host reads the counts
  at the next synchronising forward (the NCCL path has not been run on a GPU).
- **Control exchanges** (step 0, then every K-th synchronising step, the same steps on every
  rank): a small float64 all-reduce over a gloo group of the job's ranks (:class:`_StepExchange`),
  started at the forward and awaited by the hook before the first bucket. It carries every rank's
  count, every rank's compute seconds of the step before, every rank's sampler position
  (``next_batch``) and rank 0's DR proposal, and rank 0's measured step time and exchange latency,
  from which every rank derives the same next K (:func:`exchange_interval`: the exchange may cost
  about ``EXCHANGE_BUDGET`` of the step time, K at most ``MAX_EXCHANGE_INTERVAL``;
  ``exchange_every=`` pins K instead).

Counts ride only in float32/float64 buckets: half-precision buckets (fp16/bf16 parameters or
DDP's ``mixed_precision``) cannot hold them exactly, and such a model exchanges at every step.
With equal counts every factor is exactly the ``1 / world_size`` that DDP's own reducer
multiplies by and the correction is skipped, so equal shares give plain DDP's gradients (bit for
bit, tested on 2 ranks).

The DR itself lives in a :class:`~drbalance.client.sampler.RatioSchedule` shared with the sampler.
``set_ratio`` changes it locally (call it on every rank alike). Rank 0's ``propose_ratio`` (what
the manager link uses) rides on the next control exchange and becomes every rank's DR from the
same global batch on (at most K steps later, no extra communication); ``agree_ratio`` does the
same at once, as a collective of its own.

A job whose ranks are on several nodes (``node_layout``, found when the model is wrapped) composes
its DR of the node shares and each node's local DR (:mod:`drbalance.client.nodes`): each node's
leader proposes its node's local DR (``propose_local_ratio``: what its node's manager sent), global
rank 0 the node shares (from the ranks' speeds), both riding on the control exchange, and every
rank composes the same DR from the same global batch on. A ``Session`` steers such a job through
:class:`NodeSync`: one app per node, ``<app>@<node>``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from drbalance.client.inflight import InFlight
from drbalance.client.nodes import NodeBalancer, NodeLayout, NodeMove, NodeSplit, this_node
from drbalance.client.sampler import MIN_SHARE, RatioSchedule, check_rank_ratio, even_ratio, rank_sizes
from drbalance.client.scatter_gather import batch_size_of
from drbalance.client.timing import ReplicaTiming
from drbalance.ipc.names import check_app_name
from drbalance.ratio import DataRatio

logger = logging.getLogger("drbalance.client")

LOSS_REDUCTIONS = ("mean", "sum")

EXCHANGE_BUDGET = 0.005
"""Share of the step time the control exchange may cost on average (0.5%): sets the adaptive K."""

MAX_EXCHANGE_INTERVAL = 256
"""The most synchronising steps between two control exchanges (bounds the delay of a DR change).

At 64, the exchange alone still costs about 2% of a 4 ms step on a loaded 2-core machine (an
exchange there takes 2-5 ms); 256 steps of 4 ms are about a second, the delay a DR change then
waits at most."""

COUNT_DTYPES = (torch.float32, torch.float64)
"""Gradient bucket dtypes that hold sample counts exactly (half precision does not)."""

FLOAT32_COUNT_LIMIT = 2**22
"""Counts ride in float32 buckets only while the last global batch is below this (exact up to 2**24)."""


REFUSED_PROPOSAL = 2
"""``agree_ratio``'s flag (reduced by MAX) for a proposal rank 0 found invalid: every rank raises."""


MAX_EXCHANGE_DELAY = 1.0
"""Seconds of rank 0's steps that K may span at most: how long a manager's DR change waits at most
(about), even when a slow rank makes the measured exchange cost large."""


class RatioSyncError(RuntimeError):
    """A collective of the job failed: the control exchange, the DR agreement, or a gradient
    all-reduce whose result the hook waits for (typically: another rank died)."""


def exchange_interval(step_seconds: float, cost_seconds: float, wall_seconds: float = 0.0,
                      budget: float = EXCHANGE_BUDGET, most: int = MAX_EXCHANGE_INTERVAL,
                      delay: float = MAX_EXCHANGE_DELAY) -> int:
    """Synchronising steps until the next control exchange: ``clamp(ceil(cost / (budget * step)), 1, most)``,
    and at most ``floor(delay / wall)`` (at least 1).

    ``step_seconds``: rank 0's mean compute seconds per synchronising step (forward start to
    the last gradient bucket ready) since the exchange before; ``cost_seconds``: rank 0's latency
    of that exchange (start to completion, which includes waiting for the slowest rank: an upper
    bound of what it costs the step); ``wall_seconds``: rank 0's mean seconds from one
    synchronising forward to the next over the same steps (waits for other ranks included), so
    that K steps last at most about ``delay`` seconds even when a slow rank inflates the measured
    cost (0: unknown, no such bound). 1 when the step or the cost is unknown (0). Every rank
    computes it from the same float64 values read from the same all-reduce, so every rank gets
    the same K.
    """
    if step_seconds <= 0 or cost_seconds <= 0:
        return 1
    interval = max(1, min(most, math.ceil(cost_seconds / (budget * step_seconds))))
    if wall_seconds > 0:
        interval = max(1, min(interval, math.floor(delay / wall_seconds)))
    return interval


@dataclass(frozen=True)
class ExchangePlan:
    """What the last control exchange agreed (the same on every rank).

    ``step``: index of its synchronising step (0 = the first); ``interval``: K, synchronising
    steps until the next exchange; ``step_seconds``, ``cost_seconds`` and ``wall_seconds``: rank
    0's measurements K was derived from (see :func:`exchange_interval`; 0 when unknown, or when
    ``exchange_every`` pinned K).
    """

    step: int
    interval: int
    step_seconds: float
    cost_seconds: float
    wall_seconds: float = 0.0

    @property
    def next_step(self) -> int:
        """Index of the synchronising step of the next control exchange."""
        return self.step + self.interval


class _Exchanged(NamedTuple):
    counts: tuple[int, ...]
    times: tuple[float, ...]
    next_batch: int
    step_seconds: float
    cost_seconds: float
    wall_seconds: float
    proposal: DataRatio | None
    locals: dict[int, DataRatio]  # a job spanning nodes: node -> the local DR its leader proposed
    node_shares: DataRatio | None  # ... and global rank 0's node shares


class _StepExchange:
    """The control exchange: one float64 all-reduce of ``4 * world + 5`` entries (a job spanning
    nodes: ``world + 2 * nodes + 1`` more).

    Each rank fills its own slots, so a sum gives everyone every rank's values:
    ``counts`` (samples of this step), ``times`` (compute seconds of the previous step),
    ``next_batch`` (the rank's sampler's next global batch index), then rank 0's step seconds,
    exchange latency and wall seconds per step (for K), and rank 0's DR proposal (``flag``,
    ``total``, ``shares``; zeros from every other rank). A job spanning nodes adds each node
    leader's proposed local DR (its shares in its node's ranks' slots, its total in the node's
    slot) and rank 0's node shares (``total``, one share per node). Integers are exact in
    float64, and a value plus zeros is the value.
    """

    def __init__(self, world: int, layout: NodeLayout | None = None) -> None:
        self.world = world
        self.layout = layout if layout is not None and layout.spans else None
        nodes = self.layout.nodes if self.layout is not None else 0
        self.local_shares = 4 * world + 5  # the first slot of the spanning job's part
        self.local_totals = self.local_shares + world
        self.node_total = self.local_totals + nodes
        self.size = self.node_total + 1 + nodes if self.layout is not None else 4 * world + 5

    def message(self, rank: int, samples: int, seconds: float, next_batch: int,
                measured: tuple[float, float, float], proposal: DataRatio | None,
                local: DataRatio | None = None, node_shares: DataRatio | None = None) -> torch.Tensor:
        """This rank's slots; ``measured`` is rank 0's (step, cost, wall) seconds for K (ignored elsewhere).

        ``local``: a node leader's proposed DR over its node's ranks; ``node_shares``: rank 0's
        (both only for a job spanning nodes)."""
        world = self.world
        vector = torch.zeros(self.size, dtype=torch.float64)
        vector[rank] = samples
        vector[world + rank] = seconds
        vector[2 * world + rank] = next_batch
        if rank == 0:
            vector[3 * world:3 * world + 3] = torch.tensor(measured, dtype=torch.float64)
            if proposal is not None:
                vector[3 * world + 3] = 1.0
                vector[3 * world + 4] = proposal.total
                vector[3 * world + 5:4 * world + 5] = torch.tensor(proposal.shares, dtype=torch.float64)
        layout = self.layout
        if layout is None:
            return vector
        if local is not None:
            node = layout.node_of[rank]
            for share, member in zip(local, layout.ranks(node)):
                vector[self.local_shares + member] = share
            vector[self.local_totals + node] = local.total
        if rank == 0 and node_shares is not None:
            vector[self.node_total] = node_shares.total
            vector[self.node_total + 1:] = torch.tensor(node_shares.shares, dtype=torch.float64)
        return vector

    def read(self, vector: torch.Tensor) -> _Exchanged:
        """Every rank's counts and previous times, the largest next batch, rank 0's K inputs and
        proposal; for a job spanning nodes the leaders' local DRs and rank 0's node shares."""
        world = self.world
        values = vector.tolist()
        counts = tuple(int(round(v)) for v in values[:world])
        times = tuple(values[world:2 * world])
        next_batch = int(round(max(values[2 * world:3 * world])))
        proposal = None
        if values[3 * world + 3] >= 0.5:
            shares = [int(round(v)) for v in values[3 * world + 5:4 * world + 5]]
            proposal = DataRatio(shares, int(round(values[3 * world + 4])))
        step_seconds, cost_seconds, wall_seconds = values[3 * world:3 * world + 3]
        locals_: dict[int, DataRatio] = {}
        node_shares = None
        layout = self.layout
        if layout is not None:
            for node in range(layout.nodes):
                total = int(round(values[self.local_totals + node]))
                if total > 0:
                    shares = [int(round(values[self.local_shares + rank])) for rank in layout.ranks(node)]
                    locals_[node] = DataRatio(shares, total)
            if values[self.node_total] >= 0.5:
                node_shares = DataRatio([int(round(v)) for v in values[self.node_total + 1:]],
                                        int(round(values[self.node_total])))
        return _Exchanged(counts, times, next_batch, step_seconds, cost_seconds, wall_seconds, proposal,
                          locals_, node_shares)


class _Step:
    """One synchronising step as the hook sees it (set at its forward)."""

    __slots__ = ("index", "samples", "ref", "exchange", "now", "factor", "first")

    def __init__(self, index: int, samples: int, ref: int, exchange: bool) -> None:
        self.index = index  # synchronising steps before this one
        self.samples = samples  # this rank's samples (all forwards since the last synchronising one)
        self.ref = ref  # B_ref: the global batch of the last reduced step, the same on every rank (0: unknown)
        self.exchange = exchange  # a control-exchange step (else: a counting step)
        self.now: int | None = None  # counting step, CPU buckets: this step's global batch, once reduced
        self.factor: Any = None  # counting step: B_ref / B (float on CPU, None if 1; a tensor on CUDA)
        self.first: Any = None  # counting step: the future of the first bucket's reduction


class _DeviceCounts:
    """A counting step's count slots on a CUDA device, copied to pinned host memory without a sync.

    The host reads them (waiting for the copy) at the next synchronising forward, or when asked
    (``last_chunk_sizes``). Not run on a GPU.
    """

    def __init__(self, slots: torch.Tensor) -> None:
        self.host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
        self.host.copy_(slots, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(slots.device))

    def read(self) -> tuple[int, ...]:
        self.event.synchronize()
        return tuple(int(round(v)) for v in self.host.tolist())


def _allreduce(inflight: InFlight, group: Any, tensor: torch.Tensor) -> Any:
    """Start a sum all-reduce of ``tensor`` over ``group``; the Work, kept by ``inflight``.

    The process group's own method: ``dist.all_reduce``'s Python wrapper (argument checks, logging
    decorators) cost about 2% of a 4 ms step on the loaded test machine, once per bucket.
    """
    return inflight.started(group.allreduce([tensor]))


class _Staging:
    """The first bucket's gradients followed by ``world`` count slots, reused from step to step.

    ``whole`` is what is all-reduced and handed back to DDP; ``gradients`` and ``slots`` are views
    of it; ``mine`` is 1 in this rank's slot and 0 elsewhere (scaled by the count into ``slots``).
    """

    __slots__ = ("size", "dtype", "device", "whole", "gradients", "slots", "mine")

    def __init__(self, buffer: torch.Tensor, rank: int, world: int) -> None:
        self.size, self.dtype, self.device = buffer.numel(), buffer.dtype, buffer.device
        self.whole = torch.empty(self.size + world, dtype=buffer.dtype, device=buffer.device)
        self.gradients = self.whole[:self.size]
        self.slots = self.whole[self.size:]
        self.mine = torch.zeros(world, dtype=buffer.dtype, device=buffer.device)
        self.mine[rank] = 1

    def fits(self, buffer: torch.Tensor) -> bool:
        return buffer.numel() == self.size and buffer.dtype == self.dtype and buffer.device == self.device


class _BalanceState:
    """Per-step state of the weighting hook (a plain object: module attribute access is slow)."""

    __slots__ = ("rank", "world_size", "control", "gradients", "reduction", "schedule", "exchange", "pinned",
                 "counts_ride", "count_limit", "step", "steps", "plan", "pending", "vector", "work",
                 "exchange_index", "exchange_forward_at", "exchange_latency", "carried", "proposal", "agreed",
                 "counts", "ref", "timed_counts", "times", "device_counts", "staging", "forward_started",
                 "compute_seconds", "compute_total", "compute_steps", "lock", "warned", "inflight", "layout",
                 "split", "split_ratio", "local_proposal", "carried_local", "node_proposal", "carried_node",
                 "balancer", "moves", "node_agreed")

    def __init__(self, rank: int, world_size: int, control: Any, gradients: Any, reduction: str,
                 schedule: RatioSchedule, pinned: int | None, counts_ride: bool, count_limit: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.control = control  # gloo group of the job's ranks: the control exchange, DR agreement
        self.gradients = gradients  # DDP's own process group: the gradient all-reduce (and counting steps' counts)
        self.reduction = reduction
        self.schedule = schedule
        self.exchange = _StepExchange(world_size)
        self.pinned = pinned  # exchange_every: a fixed K, or None (agreed at every exchange)
        self.counts_ride = counts_ride  # False: half-precision buckets, a control exchange every step
        self.count_limit = count_limit  # counting steps only while B_ref is below this
        self.step: _Step | None = None  # the synchronising step being run
        self.steps = 0  # synchronising forwards so far
        self.plan: ExchangePlan | None = None  # what the last control exchange agreed
        self.pending = 0  # samples of forwards since the last synchronising one
        self.vector: torch.Tensor | None = None
        self.work: Any = None  # the control exchange in flight
        self.exchange_index = 0  # its step index
        self.exchange_forward_at = 0.0  # perf_counter() at its forward
        self.exchange_latency = 0.0  # seconds from its start to its completion (rank 0 reports it)
        self.carried: DataRatio | None = None  # the proposal the exchange in flight carries
        self.proposal: DataRatio | None = None  # rank 0: a DR for the next exchange to carry
        self.agreed: list[tuple[DataRatio, int]] = []  # (DR, first global batch) agreed, not yet collected
        self.counts: tuple[int, ...] | None = None  # every rank's samples in the last reduced step
        self.ref: int | None = None  # their sum: B_ref for the next counting step
        self.timed_counts: tuple[int, ...] | None = None  # every rank's samples in the step `times` measured
        self.times: tuple[float, ...] | None = None  # every rank's compute seconds in that step
        self.device_counts: _DeviceCounts | None = None  # CUDA: a counting step's counts, not read yet
        self.staging: _Staging | None = None  # the first bucket plus its count slots
        self.forward_started: float | None = None
        self.compute_seconds = 0.0  # this rank's forward start -> last bucket ready, previous step
        self.compute_total = 0.0  # the sum of compute_seconds since the last exchange
        self.compute_steps = 0  # and how many steps it sums
        self.lock = threading.Lock()
        self.warned = False
        self.inflight = InFlight()  # Works and callbacks the process groups' threads may still hold
        # a job spanning nodes (span()): the two levels of its DR and their proposals
        self.layout = NodeLayout.single(world_size)
        self.split: NodeSplit | None = None  # the node shares and local DRs of split_ratio
        self.split_ratio: DataRatio | None = None  # the rank-level DR they compose
        self.local_proposal: DataRatio | None = None  # a node leader: its node's DR for the next exchange
        self.carried_local: DataRatio | None = None
        self.node_proposal: NodeMove | None = None  # rank 0: node shares for the next exchange
        self.carried_node: NodeMove | None = None
        self.balancer: NodeBalancer | None = None  # rank 0 of a job spanning nodes, balance_nodes=True
        self.moves: list[NodeMove] = []  # rank 0: the node share moves agreed, not yet collected
        self.node_agreed: list[tuple[NodeSplit, int]] = []  # (split, first global batch) agreed, not yet collected

    def span(self, layout: NodeLayout, balance_nodes: bool) -> None:
        """The job's ranks are on the nodes of ``layout`` (set once, before the first step)."""
        self.layout = layout
        self.exchange = _StepExchange(self.world_size, layout)
        if layout.spans and balance_nodes and self.rank == 0:
            self.balancer = NodeBalancer(layout)

    @property
    def leads_node(self) -> bool:
        """Whether this rank is its node's leader (the lowest rank there)."""
        return self.layout.leader(self.layout.node_of[self.rank]) == self.rank

    def current_split(self) -> NodeSplit:
        """The node shares and local DRs of the DR in force: kept as agreed, or taken apart from a
        DR set another way (``set_ratio``, ``agree_ratio``, rank 0's ``propose_ratio``)."""
        latest = self.schedule.latest
        if self.split is None or self.split_ratio != latest:
            self.split, self.split_ratio = NodeSplit.of(self.layout, latest), latest
        return self.split

    def begin(self, samples: int) -> None:
        """A synchronising forward: settle the last step, then make this one a counting or an exchange step.

        Every rank decides alike from values they share (the step index, the agreed plan, B_ref):
        no communication unless this is an exchange step.
        """
        with self.lock:
            self._finish()  # an exchange whose backward never ran
            self._read_device_counts()
            self.inflight.next_step()
            index, self.steps = self.steps, self.steps + 1
            ref = self.ref or 0
            exchange = (not self.counts_ride or not 0 < ref < self.count_limit
                        or self.plan is None or index >= self.plan.next_step)
            self.step = _Step(index, samples, ref, exchange)
            if exchange:
                self._start_exchange(index, samples)

    def _start_exchange(self, index: int, samples: int) -> None:
        now = time.perf_counter()
        step_seconds = cost_seconds = wall_seconds = 0.0
        if self.rank == 0 and self.pinned is None and self.compute_steps:
            step_seconds = self.compute_total / self.compute_steps
            cost_seconds = self.exchange_latency
            wall_seconds = (now - self.exchange_forward_at) / (index - self.exchange_index)  # steps since the last
        self.compute_total, self.compute_steps = 0.0, 0
        carried = self.proposal if self.rank == 0 else None
        self.carried_local = self.local_proposal if self.layout.spans and self.leads_node else None
        self.carried_node = self.node_proposal if self.rank == 0 else None
        self.vector = self.exchange.message(self.rank, samples, self.compute_seconds, self.schedule.next_batch,
                                            (step_seconds, cost_seconds, wall_seconds), carried, self.carried_local,
                                            None if self.carried_node is None else self.carried_node.shares)
        self.carried = carried
        self.exchange_index = index
        self.exchange_forward_at = now
        self.work = _allreduce(self.inflight, self.control, self.vector)
        self.work.get_future().add_done_callback(self.inflight.callback(self._exchange_done))

    def _exchange_done(self, _future: Any) -> None:
        self.exchange_latency = time.perf_counter() - self.exchange_forward_at

    def exchanged_counts(self) -> tuple[int, ...] | None:
        """Every rank's sample count for an exchange step being reduced (waits for the exchange, once per step)."""
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
        found = self.exchange.read(self.vector)
        if self.counts is not None:  # the times are of the step before, whose counts are self.counts
            self.timed_counts, self.times = self.counts, found.times
        self.counts, self.ref = found.counts, sum(found.counts)
        if self.exchange_index == 0 and self.rank == 0:  # the job's first step: does the loader follow the DR?
            warn_if_loader_ignores(self.schedule.ratio_for(0), found.counts)
        if self.carried is not None and self.proposal is self.carried:
            self.proposal = None  # delivered
        if self.layout.spans:
            self._settle_nodes(found)
        elif found.proposal is not None:
            # Every rank reads the same sum, so every rank makes the same entry: the DR splits
            # global batches from the furthest any rank's sampler had got at this forward.
            self.agreed.append((found.proposal, self.schedule.set(found.proposal, found.next_batch)))
        if self.pinned is not None:
            self.plan = ExchangePlan(self.exchange_index, self.pinned, 0.0, 0.0)
        else:
            interval = exchange_interval(found.step_seconds, found.cost_seconds, found.wall_seconds)
            self.plan = ExchangePlan(self.exchange_index, interval, found.step_seconds, found.cost_seconds,
                                     found.wall_seconds)

    def _settle_nodes(self, found: _Exchanged) -> None:
        """A job spanning nodes: every rank composes the same DR from what this exchange carried
        (rank 0's whole-job DR, then its node shares, then each node leader's local DR) and uses
        it from the same global batch on; rank 0 then looks whether the node shares should move."""
        if self.carried_local is not None and self.local_proposal is self.carried_local:
            self.local_proposal = None  # delivered
        if self.carried_node is not None and self.node_proposal is self.carried_node:
            self.node_proposal = None
        if self.balancer is not None and self.times is not None and self.timed_counts is not None:
            self.balancer.observe(self.timed_counts, self.times)
        split = self.current_split()
        if found.proposal is not None:
            split = NodeSplit.of(self.layout, found.proposal)
        if found.node_shares is not None:
            split = split.with_node_shares(found.node_shares)
            if self.balancer is not None:
                self.balancer.restart()  # speeds from now on are the new shares'
                if self.carried_node is not None and self.carried_node.shares == found.node_shares:
                    self.moves.append(self.carried_node)
        for node, local in sorted(found.locals.items()):
            split = split.with_local(node, local)
        if split != self.split:
            ratio = split.ratio(self.layout)
            if not _same_split(ratio, self.schedule.latest):
                start = self.schedule.set(ratio, found.next_batch)
                self.agreed.append((ratio, start))
                self.node_agreed.append((split, start))
                self.split_ratio = ratio
            self.split = split
        if self.balancer is not None and self.node_proposal is None:
            self.node_proposal = self.balancer.propose(self.current_split())

    def _read_device_counts(self) -> None:
        pending, self.device_counts = self.device_counts, None
        if pending is not None:
            self.counts = pending.read()
            self.ref = sum(self.counts)

    def last_counts(self) -> tuple[int, ...] | None:
        """Every rank's samples in the last reduced step (on CUDA: waits for its count slots)."""
        with self.lock:
            self._read_device_counts()
            return self.counts

    def counted(self, counts: tuple[int, ...]) -> None:
        """A counting step's counts, read from the first bucket's reduction (CPU buckets)."""
        with self.lock:
            self.counts, self.ref = counts, sum(counts)

    def staging_for(self, buffer: torch.Tensor) -> _Staging:
        """A reused vector of the first bucket's size plus ``world_size`` count slots, like ``buffer``."""
        staging = self.staging
        if staging is None or not staging.fits(buffer):
            staging = self.staging = _Staging(buffer, self.rank, self.world_size)
        return staging

    def warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(message)


def _same_split(one: DataRatio, other: DataRatio) -> bool:
    """Whether two DRs have the same proportions (so split every batch alike)."""
    return len(one) == len(other) and all(a * other.total == b * one.total for a, b in zip(one, other))


def _local_weight(mine: int, total: int, reduction: str) -> float:
    """This rank's weight: ``mine / total`` for mean losses, ``1 / total`` for summed ones (0 for an empty rank)."""
    if reduction == "sum":
        return 1.0 / total  # each rank's loss is a sum over its samples
    # With equal counts mine / total rounds to exactly 1 / world: the very factor DDP's own
    # reducer multiplies by, so equal shares give plain DDP's gradients bit for bit.
    return mine / total


def _weigh(source: torch.Tensor, weight: float, out: torch.Tensor) -> None:
    """``out = source * weight``; zeros for weight 0 (an empty rank's mean loss is NaN: nothing to scale)."""
    if weight == 0.0:
        out.zero_()
    else:
        torch.mul(source, weight, out=out)


def _waited(state: _BalanceState, pending: Any) -> None:
    """Wait for a gradient all-reduce in the hook; ``RatioSyncError`` naming this rank if it fails.

    A dead peer is then reported as it is in a control exchange, whichever kind of step found it.
    """
    try:
        pending.wait()
    except RuntimeError as error:
        raise RatioSyncError(
            f"drbalance: rank {state.rank} could not all-reduce its gradients with the job's other ranks ({error}); "
            f"another rank of the job probably died"
        ) from error


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _weighted_allreduce_hook(state: _BalanceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Weight this rank's bucket by its share of the global batch's samples, then all-reduce (sum).

    On CPU buckets the last bucket's all-reduce is awaited here, on the backward's own thread, and
    its result returned as a completed future: DDP waits for the last bucket right after its hook
    anyway, and a callback on a gloo thread (a Python callback needs the GIL) costs a thread
    hand-off that shows in steps of a few milliseconds. Earlier buckets stay asynchronous.
    """
    last = bucket.is_last()
    if last and state.forward_started is not None:
        state.compute_seconds = time.perf_counter() - state.forward_started
        state.compute_total += state.compute_seconds
        state.compute_steps += 1
        state.forward_started = None
    step = state.step
    if step is None or step.exchange:
        return _exchange_step_allreduce(state, bucket, last)
    return _counting_step_allreduce(state, step, bucket, last)


def _exchange_step_allreduce(state: _BalanceState, bucket: dist.GradBucket,
                             last: bool) -> torch.futures.Future[torch.Tensor]:
    """A control-exchange step: every count is known (the exchange) before the bucket is weighted."""
    buffer = bucket.buffer()
    counts = state.exchanged_counts() if state.step is not None else None
    if counts is None or sum(counts) <= 0:
        state.warn_once("drbalance: no sample counts for this backward (no synchronising forward, or no tensor "
                        "input to count?); averaging gradients evenly as plain DDP does")
        buffer.mul_(1.0 / state.world_size)
    else:
        _weigh(buffer, _local_weight(counts[state.rank], sum(counts), state.reduction), buffer)
    work = _allreduce(state.inflight, state.gradients, buffer)
    if last and not buffer.is_cuda:
        _waited(state, work)
        return _completed(buffer)
    return work.get_future().then(state.inflight.callback(lambda fut: fut.value()[0]))


def _counting_step_allreduce(state: _BalanceState, step: _Step, bucket: dist.GradBucket,
                             last: bool) -> torch.futures.Future[torch.Tensor]:
    """A counting step: weight by ``n_r / B_ref`` now, correct by ``B_ref / B`` once the first bucket says B."""
    buffer = bucket.buffer()
    if buffer.dtype not in COUNT_DTYPES:
        raise RuntimeError(
            f"drbalance: gradient bucket {bucket.index()} is {buffer.dtype}, which cannot carry sample counts "
            f"exactly; the model's parameters changed dtype after it was wrapped (wrap it after .half()/.to())"
        )
    weight = _local_weight(step.samples, step.ref, state.reduction)
    if bucket.index() == 0:
        return _reduce_first_bucket(state, step, buffer, weight, last)
    if step.first is None:
        raise RuntimeError(f"drbalance: gradient bucket {bucket.index()} was reduced before bucket 0, whose "
                           f"reduction carries the sample counts (DDP reduces buckets in index order)")
    _weigh(buffer, weight, buffer)
    work = _allreduce(state.inflight, state.gradients, buffer)
    if buffer.is_cuda:
        # NCCL: collectives of one group run in order on one stream, and the first bucket's callback
        # (which made step.factor) ran when its collective was queued. Not run on a GPU.
        return work.get_future().then(state.inflight.callback(lambda fut: _corrected_on_device(fut, step)))
    if last:
        _waited(state, work)
        _waited(state, step.first)  # done before this one on gloo, normally; raises if it failed
        return _completed(_corrected_on_host(step, buffer))
    # gloo may complete collectives out of order: wait for the first bucket's counts without blocking.
    return torch.futures.collect_all([work.get_future(), step.first]).then(
        state.inflight.callback(lambda both: _corrected_on_host(step, buffer, both)))


def _reduce_first_bucket(state: _BalanceState, step: _Step, buffer: torch.Tensor, weight: float,
                         last: bool) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the first bucket with ``world_size`` count slots appended: the gradient sum and every count.

    The result handed back to DDP is the longer vector: DDP reads each gradient from it by offset
    (its views of a hook's result) and copies them out, so the count slots are never copied back.
    """
    staging = state.staging_for(buffer)
    _weigh(buffer, weight, staging.gradients)
    torch.mul(staging.mine, float(step.samples), out=staging.slots)  # this rank's count in its slot, zeros elsewhere
    work = _allreduce(state.inflight, state.gradients, staging.whole)
    if buffer.is_cuda:
        step.first = work.get_future().then(
            state.inflight.callback(lambda fut: _first_bucket_on_device(state, step, staging, fut)))
    elif last:
        _waited(state, work)
        step.first = _completed(_first_bucket_on_host(state, step, staging))
    else:
        step.first = work.get_future().then(
            state.inflight.callback(lambda fut: _first_bucket_on_host(state, step, staging, fut)))
    return step.first


def _first_bucket_on_host(state: _BalanceState, step: _Step, staging: _Staging, future: Any = None) -> torch.Tensor:
    """Read every rank's count from the reduced slots; correct the bucket by ``B_ref / B`` unless they are equal."""
    if future is not None:
        future.value()  # raises if the reduction failed
    counts = tuple(int(v) for v in staging.slots.tolist())  # whole numbers, exact in the bucket's dtype
    now = sum(counts)
    if now != step.ref:
        if now <= 0:
            state.warn_once("drbalance: no rank counted a sample in this step (no tensor input to count?); "
                            "the gradient is the plain DDP average of what the ranks computed")
        step.factor = step.ref / now if now > 0 else step.ref / state.world_size
        staging.gradients.mul_(step.factor)
    step.now = now
    state.counted(counts)
    return staging.whole


def _corrected_on_host(step: _Step, buffer: torch.Tensor, both: Any = None) -> torch.Tensor:
    if both is not None:
        for future in both.value():
            future.wait()  # raises if either reduction failed
    if step.factor is not None:
        buffer.mul_(step.factor)
    return buffer


def _first_bucket_on_device(state: _BalanceState, step: _Step, staging: _Staging, future: Any) -> torch.Tensor:
    """CUDA: the correction as a device tensor, no host sync; the host reads the counts later. Not run on a GPU."""
    future.value()  # raises if the reduction failed
    now = staging.slots.sum()
    ref = torch.full_like(now, float(step.ref))
    # B_ref / B is exactly 1.0 when they are equal, so equal shares stay bit for bit.
    factor = torch.where(now > 0, ref / now, ref / state.world_size)
    staging.gradients.mul_(factor)
    step.factor = factor
    state.device_counts = _DeviceCounts(staging.slots)
    return staging.whole


def _corrected_on_device(future: Any, step: _Step) -> torch.Tensor:
    if step.factor is None:
        raise RuntimeError("drbalance: a gradient bucket's reduction finished before the first bucket's callback "
                           "made the correction factor (expected NCCL to run them in order)")
    return future.value()[0].mul_(step.factor)


# DDP checks a hook's annotations against the real objects; this module's are strings (PEP 563).
_weighted_allreduce_hook.__annotations__ = {
    "state": _BalanceState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def warn_if_loader_ignores(ratio: DataRatio, counts: tuple[int, ...]) -> bool:
    """Warn (and return True) when ``ratio`` is uneven but every rank trained on the same number of
    samples (``counts``) where it would split them unevenly: the job's loader does not follow its DR
    (a ``DistributedSampler`` kept from a plain DDP script), so the manager's shares change nothing."""
    if len(counts) < 2 or len(set(counts)) != 1 or sum(counts) < len(counts):
        return False
    if len(set(rank_sizes(ratio, sum(counts)))) == 1:
        return False  # this DR splits such a batch evenly too
    logger.warning(
        "drbalance: the job's DR %s is uneven, but every rank trained on %d samples in its first step: its "
        "loader does not follow the DR, so the manager's shares change nothing. Make the loader with "
        "drbalance.client.balanced_loader(loader, model) (docs/ddp.md)", ratio, counts[0])
    return True


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

    - ``ratio``: a :class:`~drbalance.DataRatio` or one weight per rank of the job (the process
      group's ranks, in rank order; ``drbalance.ratio.as_ratio``: ``[3, 7]``, ``[1, 1]``, ``[0.3, 0.7]``),
      each rank at least ``MIN_SHARE`` (1) unit. Default: equal shares (an even split, as plain
      DDP). A total below 10 is raised to a multiple of itself (``[1, 1]`` is kept as ``[5, 5]/10``:
      same proportions, same splits).
      Every rank must be given the same DR; the constructor checks it.
    - ``loss_reduction``: ``"mean"`` (default) if each rank's loss is the mean over its own
      samples (PyTorch's default), ``"sum"`` if it is a sum over them. Either way every rank ends
      with the gradient of the *mean* loss over the global batch.
    - ``device_label`` / ``device_uuid``: name and GPU UUID of this rank's device, when the
      module's device does not say it (e.g. emulated GPUs); default: from CUDA, or ``"cpu"``.
    - ``exchange_every``: K, synchronising steps from one control exchange to the next (1 = every
      step). Default None: agreed at every exchange from rank 0's
      measured step time and exchange latency (:func:`exchange_interval`; 1 for steps of a second,
      up to ``MAX_EXCHANGE_INTERVAL`` for steps of a few milliseconds). The same on every rank
      (checked). Half-precision gradient buckets exchange at every step whatever it says.
    - ``balance_nodes``: for a job whose ranks are on several nodes (:attr:`node_layout`), whether
      global rank 0 moves the nodes' shares of the global batch toward the ranks' measured speeds
      (default True; :class:`~drbalance.client.nodes.NodeBalancer`). False keeps them where the
      DR puts them (each node's manager still steers its local ranks). The same on every rank.

    Sample counts ride in the first gradient bucket's all-reduce on most steps; a rank-0 DR
    proposal, every rank's compute times and sampler positions travel with the control exchange,
    every K steps (see the module docstring). The constructor is a collective (as DDP's is): every
    rank of the group calls it. It makes a gloo group of the job's ranks for the control exchange
    and DR agreement, and registers the sample-weighting communication hook, so
    ``register_comm_hook`` cannot be used as well.
    Gradient accumulation with ``no_sync()`` counts the samples of every forward since the last
    synchronising one (each micro-batch's loss must then be the mean over the accumulated samples,
    i.e. scaled by its share of them, for the weighting to stay exact).
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        ratio: DataRatio | Sequence[float] | None = None,
        loss_reduction: str = "mean",
        device_label: str | None = None,
        device_uuid: str | None = None,
        exchange_every: int | None = None,
        balance_nodes: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(balance_nodes, bool):
            raise TypeError(f"balance_nodes must be True or False; got {balance_nodes!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
        if exchange_every is not None and (isinstance(exchange_every, bool) or not isinstance(exchange_every, int)
                                           or exchange_every < 1):
            raise ValueError(f"exchange_every must be None (agreed from measured times) or a whole number of "
                             f"steps >= 1; got {exchange_every!r}")
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
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
        counts_ride = dtypes <= set(COUNT_DTYPES) and kwargs.get("mixed_precision") is None
        limit = FLOAT32_COUNT_LIMIT if torch.float32 in dtypes else 2**50
        self._balance = _BalanceState(rank, world_size, control, group, loss_reduction, self.ratio_schedule,
                                      exchange_every, counts_ride, limit)
        peers = self._introduce(initial, problem, device_label or label, uuid if device_uuid is None else device_uuid,
                                balance_nodes)
        self.device_labels: tuple[str, ...] = tuple(peer[0] for peer in peers)
        self._device_uuids: tuple[str, ...] = tuple(peer[1] for peer in peers)
        self._balance.span(NodeLayout.of([peer[8] for peer in peers]), balance_nodes)
        self.register_comm_hook(self._balance, _weighted_allreduce_hook)

    def _introduce(self, ratio: DataRatio, problem: str, label: str, uuid: str,
                   balance_nodes: bool) -> list[tuple[Any, ...]]:
        """Exchange every rank's device, node and initial DR; raise on every rank if a DR is bad or they differ."""
        state = self._balance
        peers: list[Any] = [None] * state.world_size
        mine = (label, uuid, ratio.shares, ratio.total, problem, state.pinned, state.counts_ride, state.reduction,
                this_node(), balance_nodes)
        try:
            dist.all_gather_object(peers, mine, group=state.control)
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {state.rank} could not reach the job's other ranks: {error}"
            ) from error
        troubles = [peer[4] for peer in peers]
        if troubles[0] and all(trouble == troubles[0] for trouble in troubles):
            raise ValueError(f"every rank of the job: {troubles[0]}")
        for rank, trouble in enumerate(troubles):
            if trouble:
                raise ValueError(f"rank {rank} of the job: {trouble}")
        for rank, (_, _, shares, total, _, pinned, ride, reduction, _, balance) in enumerate(peers):
            if (tuple(shares), total) != (ratio.shares, ratio.total):
                raise ValueError(
                    f"rank {rank} was given ratio {list(shares)}/{total} but rank {state.rank} {ratio}; give every "
                    f"rank of a BalancedDistributedDataParallel the same ratio"
                )
            if pinned != state.pinned:
                raise ValueError(
                    f"rank {rank} was given exchange_every={pinned} but rank {state.rank} {state.pinned}; give every "
                    f"rank of a BalancedDistributedDataParallel the same exchange_every"
                )
            if reduction != state.reduction:
                raise ValueError(
                    f"rank {rank} was given loss_reduction={reduction!r} but rank {state.rank} {state.reduction!r}; "
                    f"give every rank the same loss_reduction (the gradient weights would not add up)"
                )
            if balance != balance_nodes:
                raise ValueError(
                    f"rank {rank} was given balance_nodes={balance} but rank {state.rank} {balance_nodes}; give every "
                    f"rank of a BalancedDistributedDataParallel the same balance_nodes"
                )
            if ride != state.counts_ride:
                raise ValueError(
                    f"rank {rank}'s gradients are {'' if ride else 'not '}float32/float64 but rank {state.rank}'s "
                    f"are{'' if state.counts_ride else ' not'}; give every rank the same parameter dtypes and "
                    f"mixed_precision"
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

    def set_ratio(self, ratio: DataRatio | Sequence[float], from_batch: int | None = None) -> int:
        """Split global batches from ``from_batch`` (default: the next one) by ``ratio``; returns that index.

        A local call: make it on every rank with the same arguments at the same step (as every
        change to a DDP model), or use :meth:`agree_ratio`, which makes rank 0's choice everyone's.
        ``ValueError`` for a DR with the wrong number of shares or a rank below ``min_share``.
        """
        return self.ratio_schedule.set(check_rank_ratio(ratio, self.world_size), from_batch)

    def propose_ratio(self, ratio: DataRatio | Sequence[float]) -> None:
        """Rank 0: have every rank use ``ratio`` soon, at no extra communication (other ranks: ignored).

        The proposal rides on the next control exchange (within K synchronising steps, see
        :attr:`exchange_plan`); while that step's gradients are reduced, every rank makes
        ``ratio`` its DR from the furthest global batch any rank's sampler had produced at that
        step's forward. :meth:`take_agreed` lists the changes made. ``ValueError`` for a DR this
        job cannot use.
        """
        checked = check_rank_ratio(ratio, self.world_size)
        if self.rank == 0:
            self._balance.proposal = None if checked == self.ratio else checked

    # --- jobs spanning nodes --------------------------------------------------------------------
    @property
    def node_layout(self) -> NodeLayout:
        """Which node each rank is on, and the nodes' names (one node: a job of one machine)."""
        return self._balance.layout

    @property
    def node_split(self) -> NodeSplit:
        """The node shares and each node's local DR of the DR in force (:class:`~drbalance.client.nodes.NodeSplit`)."""
        state = self._balance
        with state.lock:
            return state.current_split()

    def propose_local_ratio(self, ratio: DataRatio | Sequence[float]) -> None:
        """A node's leader: have the job use ``ratio`` (one share per rank of this node) as its
        node's local DR soon (other ranks: ignored).

        As :meth:`propose_ratio`, the proposal rides on the next control exchange and every rank
        composes the same DR from it (the node shares times each node's local DR), used from the
        same global batch on; the other nodes' shares and local DRs stay as they are. On a job of
        one node this is :meth:`propose_ratio`. ``ValueError`` for a DR this node cannot use.
        """
        state = self._balance
        if not state.layout.spans:
            self.propose_ratio(ratio)
            return
        node = state.layout.node_of[state.rank]
        name = state.layout.names[node]
        checked = check_rank_ratio(ratio, len(state.layout.ranks(node)), where=f"node {name}'s DR")
        if state.leads_node:
            with state.lock:
                current = state.current_split().locals[node]
                state.local_proposal = None if _same_split(checked, current) else checked

    def take_node_moves(self) -> list[NodeMove]:
        """Global rank 0: the node share moves its :class:`~drbalance.client.nodes.NodeBalancer` made
        that every rank has taken since the last call (empty elsewhere)."""
        state = self._balance
        with state.lock:
            moves, state.moves = state.moves, []
        return moves

    def take_node_agreed(self) -> list[tuple[NodeSplit, int]]:
        """A job spanning nodes: the (split, first global batch) changes agreed since the last call."""
        state = self._balance
        with state.lock:
            agreed, state.node_agreed = state.node_agreed, []
        return agreed

    def take_agreed(self) -> list[tuple[DataRatio, int]]:
        """The (DR, first global batch) changes agreed through control exchanges since the last call."""
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
        problem = ""
        if state.rank == 0 and proposal is not None and proposal != self.ratio:
            try:  # a bad proposal is raised on every rank after the collective, not on rank 0 alone before it
                checked = check_rank_ratio(proposal, world, where="agree_ratio's proposal")
                message[0], message[1] = 1, checked.total
                message[2:2 + world] = torch.tensor(checked.shares, dtype=torch.int64)
            except (ValueError, TypeError) as error:
                message[0], problem = REFUSED_PROPOSAL, str(error)
        message[2 + world] = self.ratio_schedule.next_batch
        try:
            dist.all_reduce(message, op=dist.ReduceOp.MAX, group=state.control)
        except RuntimeError as error:
            raise RatioSyncError(
                f"drbalance: rank {state.rank} could not agree on the DR with the job's other ranks ({error}); "
                f"another rank of the job probably died"
            ) from error
        values = message.tolist()
        if values[0] == REFUSED_PROPOSAL:
            raise ValueError(problem or f"rank 0's proposal to agree_ratio was refused on rank 0 (its error says why); "
                                        f"every rank keeps {self.ratio}")
        if not values[0]:
            return self.ratio, None
        ratio = check_rank_ratio(DataRatio(values[2:2 + world], values[1]), world, where="agreed DR")
        return ratio, self.ratio_schedule.set(ratio, values[2 + world])

    # --- what the last steps did --------------------------------------------------------------
    @property
    def last_chunk_sizes(self) -> tuple[int, ...]:
        """Samples every rank trained on in the last synchronised step (zeros before the first).

        Every step's counts are known to every rank (from the control exchange or the first
        gradient bucket). On CUDA buckets this waits for the last step's count slots.
        """
        counts = self._balance.last_counts()
        return counts if counts is not None else (0,) * self.world_size

    @property
    def exchange_every(self) -> int | None:
        """K as pinned by the constructor's ``exchange_every`` (None: agreed at every exchange)."""
        return self._balance.pinned

    @property
    def exchange_plan(self) -> ExchangePlan | None:
        """What the last control exchange agreed: its step, K, and rank 0's measurements (None before one)."""
        return self._balance.plan

    @property
    def last_step_exchanged(self) -> bool:
        """Whether the last synchronising step ran a control exchange (else its counts rode in the gradients)."""
        step = self._balance.step
        return step is not None and step.exchange

    @property
    def counts_ride(self) -> bool:
        """Whether sample counts can ride in the gradient all-reduce (False: half-precision buckets)."""
        return self._balance.counts_ride

    def last_replica_timings(self) -> list[ReplicaTiming]:
        """Per rank: samples and compute seconds (forward start to last gradient bucket ready).

        These are of the step before the last control exchange, which carried them (so they cost
        no collective of their own): with K > 1 they can be up to K steps old. Empty until a
        second exchange has run.
        """
        state = self._balance
        if state.times is None or state.timed_counts is None:
            return []
        return [
            ReplicaTiming(rank, self.device_labels[rank], state.timed_counts[rank], seconds)
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
                state.begin(samples)
        return super().forward(*inputs, **kwargs)

    def extra_repr(self) -> str:
        return f"rank={self.rank}/{self.world_size}, ratio={self.ratio}"


class JobSync:
    """The DDP side of the manager link: what a ``Session`` steers when its model is a DDP job.

    Only rank 0 (the *leader*) talks to the manager. Its session hands the manager's DR to
    :meth:`set_ratio`, which proposes it to the job (``propose_ratio``): the next control exchange
    (within K synchronising steps) carries it to every rank, and every rank makes it its DR from
    the same global batch on. No extra collective, no rank waits for rank 0's talk with the
    manager, and a rank never trains a batch with a DR the others do not use for it.
    :meth:`synchronize` reports the changes made since it was last called.

    A job whose ranks are on several nodes gets a :class:`NodeSync` instead: one leader per node.
    """

    def __init__(self, model: BalancedDistributedDataParallel) -> None:
        self.model = model

    @classmethod
    def of(cls, model: object) -> JobSync | NodeSync | None:
        """A JobSync for a ``BalancedDistributedDataParallel`` (also under ``torch.compile``), a
        NodeSync for one spanning nodes, else None."""
        target = getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the module here
        if not isinstance(target, BalancedDistributedDataParallel):
            return None
        return NodeSync(target) if target.node_layout.spans else cls(target)

    @property
    def leader(self) -> bool:
        """Whether this rank talks to the manager (rank 0 of the job)."""
        return self.model.rank == 0

    @property
    def steered(self) -> BalancedDistributedDataParallel:
        """What the session publishes (DR, slots, timings): the whole job."""
        return self.model

    def app_name(self, app: str) -> str:
        """The app this job is to its manager: ``app``."""
        return app

    @property
    def ratio(self) -> DataRatio:
        """The proposed DR if one is on its way, else the DR in force."""
        proposal = self.model._balance.proposal
        return proposal if proposal is not None else self.model.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Propose ``ratio`` to the job (``ValueError`` if the job cannot use it)."""
        self.model.propose_ratio(ratio)

    def synchronize(self) -> list[tuple[DataRatio, int, dict[str, Any]]]:
        """The (DR, first global batch, nothing more) changes every rank has made since the last
        call (no communication)."""
        return [(ratio, start, {}) for ratio, start in self.model.take_agreed()]


class NodePart:
    """One node's part of a job spanning nodes, as its leader's ``Session`` publishes it: the
    local DR, and the local ranks' devices, samples and compute times, in local rank order."""

    def __init__(self, model: BalancedDistributedDataParallel, node: int) -> None:
        self.job = model
        self.node = node
        self.ranks = model.node_layout.ranks(node)
        self.device_labels: tuple[str, ...] = tuple(model.device_labels[rank] for rank in self.ranks)

    @property
    def ratio(self) -> DataRatio:
        """This node's local DR in force."""
        return self.job.node_split.locals[self.node]

    def set_ratio(self, ratio: DataRatio | Sequence[float]) -> None:
        """Propose ``ratio`` as this node's local DR (``propose_local_ratio``)."""
        self.job.propose_local_ratio(ratio)

    @property
    def min_share(self) -> int:
        return self.job.min_share

    def device_uuids(self) -> tuple[str, ...]:
        uuids = self.job.device_uuids()
        return tuple(uuids[rank] for rank in self.ranks)

    @property
    def last_chunk_sizes(self) -> tuple[int, ...]:
        sizes = self.job.last_chunk_sizes
        return tuple(sizes[rank] for rank in self.ranks)

    def last_replica_timings(self) -> list[ReplicaTiming]:
        timings = {timing.slot: timing for timing in self.job.last_replica_timings()}
        return [ReplicaTiming(slot, timings[rank].device, timings[rank].samples, timings[rank].seconds)
                for slot, rank in enumerate(self.ranks) if rank in timings]


class NodeSync:
    """What a ``Session`` steers on a job spanning nodes: each node's leader (its lowest rank)
    talks to its own node's manager, as the app ``<app>@<node>``, about its node's part
    (:class:`NodePart`): the manager's DR becomes this node's local DR (``propose_local_ratio``),
    and every rank composes the same job DR from the node shares and every node's local DR at
    the same global batch (docs/ddp.md, "Jobs spanning nodes")."""

    def __init__(self, model: BalancedDistributedDataParallel) -> None:
        self.model = model
        layout = model.node_layout
        self.node = layout.node_of[model.rank]
        self.steered = NodePart(model, self.node)

    @property
    def leader(self) -> bool:
        """Whether this rank talks to its node's manager (the node's lowest rank)."""
        return self.model.node_layout.leader(self.node) == self.model.rank

    def app_name(self, app: str) -> str:
        """The app this node's part is to its manager: ``<app>@<node name>``. ``ValueError`` on
        every rank if any node's app name is not one (too long: at most 48 characters)."""
        layout = self.model.node_layout
        for node in range(layout.nodes):
            name = layout.app_name(app, node)
            try:
                check_app_name(name)
            except ValueError as error:
                raise ValueError(f"the job spans {layout.nodes} nodes and node {layout.names[node]!r}'s part would be "
                                 f"the app {name!r}: {error}; give a shorter app name") from None
        return layout.app_name(app, self.node)

    @property
    def ratio(self) -> DataRatio:
        """This node's proposed local DR if one is on its way, else the one in force."""
        proposal = self.model._balance.local_proposal
        return proposal if proposal is not None else self.steered.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Propose ``ratio`` as this node's local DR (``ValueError`` if the node cannot use it)."""
        self.model.propose_local_ratio(ratio)

    def synchronize(self) -> list[tuple[DataRatio, int, dict[str, Any]]]:
        """(this node's local DR, first global batch, the job's side of it) for every change every
        rank has made since the last call: ``job_dr`` (the composed DR over every rank),
        ``node_shares``, and on global rank 0 the node share moves made (``node_move``: the nodes'
        measured speeds in samples per second and the predicted gain)."""
        self.model.take_agreed()
        moves = self.model.take_node_moves()
        changes = []
        for split, start in self.model.take_node_agreed():
            extra: dict[str, Any] = {"job_dr": split.ratio(self.model.node_layout).to_list(),
                                     "node_shares": split.node_shares.to_list(),
                                     "node_share_total": split.node_shares.total}
            move = next((move for move in moves if move.shares == split.node_shares), None)
            if move is not None:
                moves.remove(move)
                extra["node_move"] = {"speeds": list(move.speeds), "gain": move.gain}
            changes.append((split.locals[self.node], start, extra))
        return changes


def _control_group(group: Any) -> Any:
    """A gloo group of ``group``'s ranks (the group itself when it is gloo already).

    The control exchange and the DR are tiny CPU tensors: on gloo they cost no GPU synchronisation
    whatever the gradient backend is. Only the group's members call ``new_group``. The new group
    waits for a stuck rank as long as ``group`` does (``init_process_group``'s ``timeout``, e.g.
    train_ddp.py's ``--timeout``), not ``new_group``'s default of 30 minutes. One such group
    per ``group``, made by the first model wrapped over it and reused by later ones (as a gloo
    ``group`` itself is): a new one per model would keep a gloo group, its threads and its
    connections until ``destroy_process_group``, for every model ever wrapped.
    """
    if dist.get_backend(group) == "gloo":
        return group
    live = _live_groups()
    for key in [key for key, (parent, control) in _CONTROL_GROUPS.items()
                if live is not None and (parent not in live or control not in live)]:
        del _CONTROL_GROUPS[key]  # destroyed (destroy_process_group): never reused
    known = _CONTROL_GROUPS.get(id(group))
    if known is not None and known[0] is group and live is not None:
        return known[1]
    ranks = dist.get_process_group_ranks(group)
    control = dist.new_group(ranks=ranks, backend="gloo", timeout=_group_timeout(group),
                             use_local_synchronization=True)
    _CONTROL_GROUPS[id(group)] = (group, control)
    return control


_CONTROL_GROUPS: dict[int, tuple[Any, Any]] = {}
"""id(process group) -> (that group, its gloo control group); the group is held so its id stays its own."""


def _live_groups() -> Any:
    """The process groups not destroyed yet (None if torch does not say: no control group is then reused)."""
    try:
        return dist.distributed_c10d._world.pg_map
    except AttributeError:
        return None


def _group_timeout(group: Any) -> timedelta | None:
    """How long ``group``'s collectives wait for another rank (None if torch does not say: the default)."""
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


__all__ = [
    "EXCHANGE_BUDGET", "LOSS_REDUCTIONS", "MAX_EXCHANGE_INTERVAL", "BalancedDistributedDataParallel", "ExchangePlan",
    "JobSync", "NodePart", "NodeSync", "RatioSyncError", "exchange_interval",
]
