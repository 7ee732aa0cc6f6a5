"""DDP jobs spanning nodes, with real processes: gloo on the CPU, two "nodes" of two ranks.

The first test runs four ranks with ``torch.multiprocessing.spawn``, each told its node as
torchrun's agents tell it (``GROUP_RANK``). The others run two real torchrun agents
(``--nnodes 2``, a c10d rendezvous on localhost), each with its own environment: its own system
folder and system manager (``drbalance-manager --system``), or none.
"""

from __future__ import annotations

import pytest

from drbalance.client.nodes import NodeLayout, NodeSplit
from drbalance.ratio import DataRatio
from tests.helpers import ddp_nodes_workers
from tests.helpers.ddp import spawn

pytestmark = pytest.mark.timeout(300)

LAYOUT = NodeLayout((0, 0, 1, 1), ("n1", "n2"))


def composed(split: dict) -> DataRatio:
    """The rank-level DR a step's printed split composes."""
    return NodeSplit(DataRatio(split["shares"], split["total"]),
                     tuple(DataRatio(shares, total) for shares, total in split["locals"])).ratio(LAYOUT)


@pytest.mark.slow
def test_a_job_over_two_nodes_trains_with_the_whole_batch_gradient_and_a_node_dr_moves_only_its_node(tmp_path):
    ranks = spawn("spanning", 4, tmp_path, ddp_nodes_workers)
    steps = ranks[0]["steps"]
    assert ranks[0]["names"] == ["n1", "n2"] and ranks[0]["node_of"] == [0, 0, 1, 1]
    before = DataRatio([1, 2, 3, 4])
    after_local = DataRatio([5, 10, 7, 28], 50)  # n2 keeps 7/10 of each batch, now split 2:8; n1 as before
    whole = DataRatio([4, 3, 2, 1])
    # K pinned to 2: n2's proposal at step 1 rides on step 2's exchange, from batch 3 (batch 2 was produced);
    # rank 0's whole-job DR at step 5 on step 6's, from batch 7
    assert [DataRatio(*s["ratio"]) for s in steps] == [before] * 3 + [after_local] * 4 + [whole]
    assert [s["sizes"] for s in steps][2:4] == [[1, 2, 4, 5], [1, 3, 2, 8]]  # 12, then 14 samples (tail folded)
    for rank, found in enumerate(ranks):
        for step, mine in zip(steps, found["steps"]):
            assert mine == {**step, "error": mine["error"], "scale": mine["scale"]}  # the same DR and split everywhere
            assert mine["counts"] == mine["sizes"]
            assert mine["error"] <= 1e-6 * max(1.0, mine["scale"]), (rank, mine)
            assert composed(mine["split"]).shares == DataRatio(*mine["ratio"]).shares  # node share x local DR
        # n1's local DR stayed 1:2 until rank 0 set the whole job's; the non-leaders' proposals were ignored
        locals_ = [s["split"]["locals"] for s in found["steps"]]
        assert all(local[0] == [[4, 8], 12] for local in locals_[:7]) and locals_[3][1] == [[2, 8], 10]
        assert found["agreed"] == [[[2, 8], 3], [[8, 4], 7]]  # n2: the proposal, then rank 0's DR (2:1, in 12ths)
