"""Jobs spanning nodes, the parts without processes: where a rank is, the two levels of the DR
composed and taken apart, and global rank 0's rule for the node shares (drbalance/client/nodes.py)."""

from __future__ import annotations

import pytest

from drbalance.client.nodes import (
    NODE_SHARE_TOTAL,
    NodeBalancer,
    NodeLayout,
    NodeSplit,
    check_split,
    predicted_step,
    this_node,
)
from drbalance.ratio import DataRatio

pytestmark = pytest.mark.timeout(30)

TWO_BY_TWO = NodeLayout((0, 0, 1, 1), ("n1", "n2"))


def test_a_rank_knows_its_node_from_torchrun_then_slurm_then_its_host(monkeypatch):
    for variable in ("GROUP_RANK", "SLURM_NODEID", "SLURMD_NODENAME"):
        monkeypatch.delenv(variable, raising=False)
    key, name = this_node()
    assert key == f"host:{name}" and name  # the short host name
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert this_node() == ("slurm:3", "n7")
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's node rank wins (srun starting torchrun sets both)
    assert this_node() == ("group:1", "n7")
    monkeypatch.setenv("GROUP_RANK", "x")  # not a node rank: the next source
    assert this_node() == ("slurm:3", "n7")


def test_nodes_are_numbered_by_their_lowest_rank_and_same_named_nodes_told_apart():
    layout = NodeLayout.of([("group:1", "b"), ("group:0", "a"), ("group:1", "b"), ("group:0", "a")])
    assert layout.node_of == (0, 1, 0, 1) and layout.names == ("b", "a")
    assert layout.ranks(0) == (0, 2) and layout.ranks(1) == (1, 3)
    assert (layout.leader(0), layout.leader(1)) == (0, 1) and layout.spans
    assert layout.app_name("job", 1) == "job@a"
    # two torchrun agents on one machine: one host name, two nodes
    twins = NodeLayout.of([("group:0", "host"), ("group:0", "host"), ("group:1", "host")])
    assert twins.names == ("host-0", "host-1") and twins.node_of == (0, 0, 1)
    single = NodeLayout.of([("host:h", "h")] * 3)
    assert not single.spans and single.nodes == 1 and single.ranks(0) == (0, 1, 2)


def test_a_dr_taken_apart_and_composed_again_splits_alike_and_a_local_dr_moves_only_its_node():
    split = NodeSplit.of(TWO_BY_TWO, DataRatio([1, 2, 3, 4]))
    assert split.node_shares == DataRatio([3, 7]) and split.locals == (DataRatio([4, 8], 12), DataRatio([6, 8], 14))
    assert split.ratio(TWO_BY_TWO) == DataRatio([1, 2, 3, 4])
    moved = split.with_local(1, DataRatio([2, 8]))
    composed = moved.ratio(TWO_BY_TWO)
    assert composed == DataRatio([5, 10, 7, 28], 50)  # node 2 keeps 7/10, split 2:8; node 1 untouched
    assert NodeSplit.of(TWO_BY_TWO, composed).locals == (split.locals[0], DataRatio([2, 8]))
    shares = moved.with_node_shares(DataRatio([600, 400], NODE_SHARE_TOTAL)).ratio(TWO_BY_TWO)
    assert [share / shares.total for share in shares] == pytest.approx([0.2, 0.4, 0.08, 0.32])
    # interleaved ranks (node of rank r: r % 2) compose to the same proportions per node
    layout = NodeLayout((0, 1, 0, 1), ("a", "b"))
    interleaved = NodeSplit(DataRatio([1, 1], 2), (DataRatio([1, 3], 4), DataRatio([1, 1], 2))).ratio(layout)
    assert interleaved == DataRatio([2, 4, 6, 4], 16)  # [1, 2, 3, 2]/8 at a total of at least 10
    check_split(TWO_BY_TWO, moved)
    with pytest.raises(ValueError, match="has 3 entries for 2 rank"):
        check_split(TWO_BY_TWO, split.with_local(0, DataRatio([3, 3, 4])))


def observed(balancer: NodeBalancer, speeds: list[float], counts: list[int], steps: int) -> None:
    for _ in range(steps):
        balancer.observe(counts, [n / v for n, v in zip(counts, speeds)])


def test_node_shares_move_half_way_toward_the_speeds_only_past_the_threshold():
    balancer = NodeBalancer(TWO_BY_TWO, window=3)
    even = NodeSplit(DataRatio([5, 5]), (DataRatio([5, 5]), DataRatio([5, 5])))
    observed(balancer, [100, 100, 25, 25], [10, 10, 10, 10], 2)
    assert balancer.propose(even) is None  # two timed steps of three: no decision yet
    observed(balancer, [100, 100, 25, 25], [10, 10, 10, 10], 1)
    move = balancer.propose(even)
    # speeds ask for 0.8 / 0.2 (step time 0.6 shorter); half-way from 0.5 / 0.5
    assert move.shares == DataRatio([650, 350], NODE_SHARE_TOTAL) and move.speeds == pytest.approx((200, 50))
    assert move.gain == pytest.approx(0.6)
    assert balancer.propose(even.with_node_shares(move.shares)) is None  # the window starts afresh
    observed(balancer, [100, 100, 25, 25], [13, 13, 7, 7], 3)
    again = balancer.propose(even.with_node_shares(move.shares))
    assert again.shares == DataRatio([725, 275], NODE_SHARE_TOTAL)
    # speeds 100 vs 96 per rank: the best split is about 2% faster, below the 5% bar
    close = NodeBalancer(TWO_BY_TWO, window=1)
    observed(close, [100, 100, 96, 96], [10, 10, 10, 10], 1)
    assert close.propose(even) is None


def test_node_shares_weigh_the_local_drs_in_force_and_keep_every_node_a_share():
    layout = NodeLayout((0, 0, 1), ("a", "b"))
    split = NodeSplit(DataRatio([5, 5]), (DataRatio([9, 1]), DataRatio([10])))
    # node a's rank 0 holds 90% of its part: its step, not the node's summed speed, sets the time
    assert predicted_step(layout, [0.5, 0.5], split.locals, [100, 100, 200]) == pytest.approx(0.5 * 0.9 / 100)
    balancer = NodeBalancer(layout, window=1)
    observed(balancer, [1e6, 1e6, 1e-3], [5, 5, 5], 1)
    move = balancer.propose(split)
    assert move is not None and min(move.shares) >= 1 and move.shares.total == NODE_SHARE_TOTAL
    balancer.observe([5, 0, 5], [0.1, 0.0, 0.1])  # a rank with no samples or time: not a timed step
    assert len(balancer.timed) == 0
    with pytest.raises(ValueError, match="step in"):
        NodeBalancer(layout, step=0.0)
