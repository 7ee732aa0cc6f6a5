"""DDP jobs spanning nodes: which ranks share a node, each node's share of the global batch, and the
rank-level DR composed of the node shares and each node's own DR (no torch, no communication).

A job of several nodes (``torchrun --nnodes N``, or ``srun`` with one task per rank) is steered in
two levels. Inside a node, that node's manager sets the shares of the job's *local* ranks (a
**local DR**, one share per local rank), as for a job of one machine. Across nodes, the job itself
sets how much of every global batch each node trains (the **node shares**, one per node), from the
ranks' measured speeds (:class:`NodeBalancer`), since no manager sees all the job's nodes. Rank r,
the i-th rank of node k, trains

    node_share[k] / sum(node_shares)  x  local_dr_k[i] / local_dr_k.total

of every global batch: :meth:`NodeSplit.ratio` composes these into one DR over the job's ranks,
exactly (integer shares, no rounding), which the sampler and the weighting hook use as any DR.

Where a rank is (:func:`this_node`): its node is told apart by torchrun's ``GROUP_RANK`` (the
agent's node rank), else Slurm's ``SLURM_NODEID``, else the node's name; the name is Slurm's
``SLURMD_NODENAME``, else this machine's short host name (``drbalance.env.slurm_node``). Nodes
are numbered by their lowest global rank (node 0 holds global rank 0); a node's *leader* is its
lowest global rank (local rank 0 under torchrun).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from drbalance import env
from drbalance.client.sampler import MIN_SHARE, job_ratio
from drbalance.ratio import DataRatio, apportion

NODE_SHARE_TOTAL = 1000
"""Node shares proposed by the job are kept in thousandths of the global batch: fine enough that
a move part of the way is not rounded away for global batches up to a thousand samples, while the
composed DR's total (this times the local DRs' common total) stays small."""

NODE_SHARE_MIN_GAIN = 0.05
"""A new split across nodes is applied only when it is predicted to shorten the job's step by more
than this fraction of it (5%). The compute times the prediction comes from vary by a few percent
from window to window on a busy machine, and each node's manager moves shares inside its node
meanwhile; a lower bar would make the split follow noise and the managers' moves."""

NODE_SHARE_STEP = 0.5
"""Share of the way from the current node shares to those the measured speeds ask for that one
move goes (a half). The speeds of a node change after a move (fixed costs per step weigh more on
a smaller share) and while its manager moves shares inside it; half-way moves converge without
overshooting, and the threshold above ends them."""

NODE_SHARE_WINDOW = 4
"""Timed steps (each rank's compute seconds and samples, carried by a control exchange, every K
steps) the ranks' speeds are summed over before a split is predicted; the window starts afresh
after each move, so a decision is made on speeds measured under the split in force."""


def this_node() -> tuple[str, str]:
    """(key, name) of the node this process runs on (see the module docstring).

    ``key`` tells the job's nodes apart: ``group:<GROUP_RANK>`` under torchrun (also for two
    agents of one machine), ``slurm:<SLURM_NODEID>`` in a Slurm task, else ``host:<name>``.
    """
    name = env.slurm_node()
    for variable, kind in (("GROUP_RANK", "group"), ("SLURM_NODEID", "slurm")):
        value = os.environ.get(variable, "").strip()
        if value.isdigit():
            return f"{kind}:{int(value)}", name
    return f"host:{name}", name


@dataclass(frozen=True)
class NodeLayout:
    """Which node each rank of a job is on (``node_of``, by global rank) and each node's name (``names``)."""

    node_of: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, places: Sequence[tuple[str, str]]) -> NodeLayout:
        """The layout from every rank's :func:`this_node`, in global rank order.

        Nodes are numbered by their lowest rank. Two nodes of one name (two torchrun agents on
        one machine) are told apart by their number: ``<name>-<node>``.
        """
        index: dict[str, int] = {}
        names: list[str] = []
        node_of = []
        for key, name in places:
            if key not in index:
                index[key] = len(names)
                names.append(name)
            node_of.append(index[key])
        if len(set(names)) < len(names):
            names = [f"{name}-{node}" if names.count(name) > 1 else name for node, name in enumerate(names)]
        return cls(tuple(node_of), tuple(names))

    @classmethod
    def single(cls, world_size: int, name: str = "") -> NodeLayout:
        """Every rank on one node."""
        return cls((0,) * world_size, (name,))

    @property
    def nodes(self) -> int:
        return len(self.names)

    @property
    def spans(self) -> bool:
        """Whether the job has ranks on more than one node."""
        return len(self.names) > 1

    def ranks(self, node: int) -> tuple[int, ...]:
        """The global ranks on ``node``, in order (the i-th is local rank i)."""
        return tuple(rank for rank, where in enumerate(self.node_of) if where == node)

    def leader(self, node: int) -> int:
        """The global rank that talks to ``node``'s manager: its lowest."""
        return self.node_of.index(node)

    def app_name(self, job: str, node: int) -> str:
        """The app a node's leader registers with its manager: ``<job>@<node name>``."""
        return f"{job}@{self.names[node]}"


def _reduced(shares: Sequence[int]) -> DataRatio:
    """``shares`` over their sum, in the smallest whole numbers, at a total of at least 10 (``job_ratio``)."""
    total = sum(shares)
    divisor = math.gcd(total, *shares)
    return job_ratio(DataRatio([share // divisor for share in shares], total // divisor))


@dataclass(frozen=True)
class NodeSplit:
    """The two levels of a spanning job's DR: ``node_shares`` (one per node) and ``locals`` (per node,
    one share per local rank). Every share is at least ``MIN_SHARE``."""

    node_shares: DataRatio
    locals: tuple[DataRatio, ...]

    @classmethod
    def of(cls, layout: NodeLayout, ratio: DataRatio) -> NodeSplit:
        """A rank-level DR taken apart: each node's share is the sum of its ranks' shares, its
        local DR those shares over that sum. ``ratio(layout)`` of the result splits every batch
        as ``ratio`` does (the same proportions)."""
        parts = [[ratio[rank] for rank in layout.ranks(node)] for node in range(layout.nodes)]
        return cls(_reduced([sum(part) for part in parts]), tuple(_reduced(part) for part in parts))

    def ratio(self, layout: NodeLayout) -> DataRatio:
        """The DR over the job's ranks: rank i of node k gets ``node_shares[k] x locals[k][i]``
        (each local DR brought to the locals' least common total first), in lowest terms."""
        common = math.lcm(*(local.total for local in self.locals))
        shares = [0] * len(layout.node_of)
        for node, local in enumerate(self.locals):
            scale = self.node_shares[node] * (common // local.total)
            for share, rank in zip(local, layout.ranks(node)):
                shares[rank] = share * scale
        total = self.node_shares.total * common
        divisor = math.gcd(total, *shares)
        return job_ratio(DataRatio([share // divisor for share in shares], total // divisor))

    def with_node_shares(self, shares: DataRatio) -> NodeSplit:
        return NodeSplit(shares, self.locals)

    def with_local(self, node: int, local: DataRatio) -> NodeSplit:
        return NodeSplit(self.node_shares, self.locals[:node] + (local,) + self.locals[node + 1:])


def check_split(layout: NodeLayout, split: NodeSplit) -> None:
    """``ValueError`` unless ``split`` has one share per node and one per local rank, each at least ``MIN_SHARE``."""
    if len(split.node_shares) != layout.nodes or len(split.locals) != layout.nodes:
        raise ValueError(f"node shares {split.node_shares} for a job of {layout.nodes} node(s)")
    for node, local in enumerate(split.locals):
        if len(local) != len(layout.ranks(node)):
            raise ValueError(f"node {layout.names[node]}'s DR {local} has {len(local)} entries for "
                             f"{len(layout.ranks(node))} rank(s)")
    if min(split.node_shares) < MIN_SHARE or min(min(local) for local in split.locals) < MIN_SHARE:
        raise ValueError(f"every node and rank must keep at least {MIN_SHARE} unit(s): {split}")


def predicted_step(layout: NodeLayout, fractions: Sequence[float], locals: Sequence[DataRatio],
                   speeds: Sequence[float]) -> float:
    """The slowest rank's compute seconds per sample of the global batch, when node k trains
    ``fractions[k]`` of it split by ``locals[k]`` and rank r computes ``speeds[r]`` samples a second.

    A synchronous step lasts as long as its slowest rank's compute plus the all-reduce, whose
    size does not depend on the split; so this orders splits as their step times do.
    """
    slowest = 0.0
    for node, local in enumerate(locals):
        for share, rank in zip(local, layout.ranks(node)):
            slowest = max(slowest, fractions[node] * share / local.total / speeds[rank])
    return slowest


@dataclass(frozen=True)
class NodeMove:
    """A decision of :class:`NodeBalancer`: the node shares proposed, and what they came from."""

    shares: DataRatio
    speeds: tuple[float, ...]  # per node: the sum of its ranks' samples per compute second
    gain: float  # the predicted step time's fall if the shares went all the way (a fraction of it)


class NodeBalancer:
    """Global rank 0's rule for the node shares (docs/scaling.md, "Shares across nodes").

    Each rank's speed is its samples per compute second over the last ``window`` timed steps,
    summed per node to ``V_k``; the shares the speeds ask for are ``V_k / sum V``. When they are
    predicted (:func:`predicted_step`, with the local DRs in force) to shorten the step by more
    than ``min_gain``, the shares move ``step`` of the way there, in ``total`` units, each node
    keeping at least ``MIN_SHARE``. Nothing is proposed until a full window is measured, and the
    window starts afresh when the shares change.
    """

    def __init__(self, layout: NodeLayout, min_gain: float = NODE_SHARE_MIN_GAIN, step: float = NODE_SHARE_STEP,
                 window: int = NODE_SHARE_WINDOW, total: int = NODE_SHARE_TOTAL) -> None:
        if not 0 < step <= 1 or min_gain < 0 or window < 1 or total < layout.nodes * MIN_SHARE:
            raise ValueError(f"NodeBalancer: step in (0, 1], min_gain >= 0, window >= 1 and total >= "
                             f"{layout.nodes * MIN_SHARE}; got {step}, {min_gain}, {window}, {total}")
        self.layout = layout
        self.min_gain, self.step, self.total = min_gain, step, total
        self.timed: deque[tuple[tuple[int, ...], tuple[float, ...]]] = deque(maxlen=window)

    def observe(self, counts: Sequence[int], seconds: Sequence[float]) -> None:
        """One step's samples and compute seconds of every rank (a step any rank did not time is skipped)."""
        world = len(self.layout.node_of)
        if len(counts) != world or len(seconds) != world:
            return
        if min(counts) <= 0 or not all(0 < value < math.inf for value in seconds):
            return
        self.timed.append((tuple(counts), tuple(seconds)))

    def restart(self) -> None:
        """Forget the speeds measured so far (the shares changed)."""
        self.timed.clear()

    def speeds(self) -> tuple[float, ...] | None:
        """Every rank's samples per compute second over the window; None until the window is full."""
        if len(self.timed) < (self.timed.maxlen or 1):
            return None
        world = len(self.layout.node_of)
        samples = [sum(counts[rank] for counts, _ in self.timed) for rank in range(world)]
        seconds = [sum(times[rank] for _, times in self.timed) for rank in range(world)]
        return tuple(n / s for n, s in zip(samples, seconds))

    def propose(self, split: NodeSplit) -> NodeMove | None:
        """New node shares for ``split`` (the shares and local DRs in force), or None to keep them."""
        speeds = self.speeds()
        if speeds is None:
            return None
        layout = self.layout
        node_speeds = tuple(sum(speeds[rank] for rank in layout.ranks(node)) for node in range(layout.nodes))
        wanted = [speed / sum(node_speeds) for speed in node_speeds]
        current = [share / split.node_shares.total for share in split.node_shares]
        now = predicted_step(layout, current, split.locals, speeds)
        gain = 1.0 - predicted_step(layout, wanted, split.locals, speeds) / now
        if gain <= self.min_gain:
            return None
        moved = [old + self.step * (new - old) for old, new in zip(current, wanted)]
        spare = self.total - MIN_SHARE * layout.nodes
        weights = [Fraction(value).limit_denominator(1_000_000) for value in moved]
        shares = DataRatio([MIN_SHARE + part for part in apportion(weights, spare)], self.total)
        if [share * split.node_shares.total for share in shares] == [share * self.total for share in
                                                                     split.node_shares]:
            return None  # the same proportions
        self.restart()
        return NodeMove(shares, node_speeds, gain)


__all__ = [
    "NODE_SHARE_MIN_GAIN", "NODE_SHARE_STEP", "NODE_SHARE_TOTAL", "NODE_SHARE_WINDOW", "NodeBalancer", "NodeLayout",
    "NodeMove", "NodeSplit", "check_split", "predicted_step", "this_node",
]
