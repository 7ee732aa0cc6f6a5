"""DDP jobs spanning nodes, with real processes: gloo on the CPU, two "nodes" of two ranks.

The first test runs four ranks with ``torch.multiprocessing.spawn``, each told its node as
torchrun's agents tell it (``GROUP_RANK``). The others run two real torchrun agents
(``--nnodes 2``, a c10d rendezvous on localhost), each with its own environment: its own system
folder and system manager (``drbalance-manager --system``), or none.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from drbalance.client.nodes import NODE_SHARE_MIN_GAIN, NodeLayout, NodeSplit
from drbalance.ipc.system_link import read_system_status
from drbalance.jsonlog import read_json_lines
from drbalance.ratio import DataRatio
from tests.conftest import wait_for
from tests.helpers import ddp_nodes_workers
from tests.helpers.ddp import spawn
from tests.helpers.ddp_nodes import Node, ScriptedSystemManager, two_node_job, wait_for_lines
from tests.helpers.system import SystemManagerProcess, shared_tmp

pytestmark = pytest.mark.timeout(300)

LAYOUT = NodeLayout((0, 0, 1, 1), ("n1", "n2"))
UID = os.getuid()  # a system manager knows a job as <uid>:<app>


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


# --- two torchrun agents, each "node" with its own manager or none -------------------------------------------


@pytest.fixture
def two_nodes(tmp_path):
    """Nodes n1 and n2: each its own system folder (in a root-owned folder, as a system folder must be),
    runtime and log folders, and name; one namespace."""
    with shared_tmp() as shared:
        namespace = f"span{os.getpid()}x{time.monotonic_ns() % 10**6}"
        yield [Node(name, tmp_path / name, shared / f"system-{name}", namespace) for name in ("n1", "n2")]


def by_rank(lines: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in lines:
        if "step" in line:
            steps.setdefault(line["rank"], []).append(line)
    return steps


def check_steps(steps: dict[int, list[dict]], count: int) -> list[dict]:
    """Every rank trained ``count`` steps with the same DR and split, the whole batch's gradient, and the
    DR composed of the node shares and local DRs; rank 0's steps."""
    assert sorted(steps) == [0, 1, 2, 3] and {len(mine) for mine in steps.values()} == {count}
    shared = ("batch", "ratio", "sizes", "counts", "split")
    for rank, mine in steps.items():
        for step, theirs in zip(mine, steps[0]):
            assert {key: step[key] for key in shared} == {key: theirs[key] for key in shared}, (rank, step)
            assert step["counts"] == step["sizes"]
            assert step["error"] <= 1e-6 * max(1.0, step["scale"]), (rank, step)
    for step in steps[0]:
        split = step["split"]
        layout = NodeLayout(tuple(0 if rank in ranks_of(steps, split["nodes"][0]) else 1 for rank in range(4)),
                            tuple(split["nodes"]))
        ratio = NodeSplit(DataRatio(split["shares"], split["total"]),
                          tuple(DataRatio(shares, total) for shares, total in split["locals"])).ratio(layout)
        assert ratio == DataRatio(*step["ratio"])
    return steps[0]


def ranks_of(steps: dict[int, list[dict]], node: str) -> list[int]:
    return sorted(rank for rank, mine in steps.items() if mine[0]["node"] == node)


def started(lines: list[dict]) -> dict[int, dict]:
    return {line["rank"]: line for line in lines if "app" in line}


@pytest.mark.slow
def test_each_node_leader_registers_with_its_nodes_manager_which_steers_only_that_nodes_ranks(
        two_nodes, tmp_path, monkeypatch):
    n1, n2 = two_nodes
    observer = SystemManagerProcess(tmp_path, n1.system_dir, n1.namespace, (50, 50), policy="observe")
    scripted = ScriptedSystemManager(n2, [[1, 9]])  # n2's manager: [1, 9] at the job's first boundary there
    pause = tmp_path / "go-on"
    agents = two_node_job([n1, n2], 2, "--app", "spanjob", "--ratio", "1,3,2,6", "--epochs", "2", "--iterations", "8",
                          "--decide-every", "2", "--report-every", "1", "--exchange-every", "1",
                          "--exchange-timeout", "60", "--balance-nodes", "off", "--pause-at", "10",
                          "--pause-file", str(pause))
    try:
        # every rank waits at step 10 until the test says go on: both managers list the job meanwhile
        wait_for_lines(agents, lambda lines: len([line for line in lines if line.get("step") == 9]) == 4, 240)
        listed = {}
        for node in two_nodes:
            monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(node.system_dir))
            listed[node.name] = [app["name"] for app in read_system_status(node.namespace)["apps"]]
        assert listed == {"n1": ["spanjob@n1"], "n2": ["spanjob@n2"]}
        assert scripted.stop()[0] == 0  # n2's manager stops while the job runs: n2's part keeps its DR
        pause.touch()
        codes = [agent.wait(240) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
        scripted.stop()
        assert observer.stop()[0] == 0
    assert codes == [0, 0], [agent.stderr()[-3000:] for agent in agents]
    assert not [agent.node.name for agent in agents if "Traceback" in agent.stderr()]
    lines = [line for agent in agents for line in agent.lines()]
    steps = by_rank(lines)
    first = check_steps(steps, 16)
    leaders = {line["app"]: line["node"] for line in started(lines).values() if line["leader"]}
    assert leaders == {"spanjob@n1": "n1", "spanjob@n2": "n2"}  # one leader per node, each its node's app
    nodes = first[0]["split"]["nodes"]
    one, two = nodes.index("n1"), nodes.index("n2")
    locals_ = [step["split"]["locals"] for step in first]
    assert all(local[one] == [[3, 9], 12] for local in locals_)  # n1's ranks: 1:3 from start to end
    assert {(step["split"]["shares"][one], step["split"]["total"]) for step in first} == {(4 if one == 0 else 8, 12)}
    changed = [index for index, local in enumerate(locals_) if local[two] == [[1, 9], 10]]
    assert locals_[0][two] == [[3, 9], 12] and changed and changed == list(range(changed[0], 16))
    assert changed[0] <= 10  # n2's manager's DR, from its first boundary (after step 1), kept after it stopped
    assert [e["app"] for e in observer.events("app_added")] == [f"{UID}:spanjob@n1"]
    assert [e["app"] for e in scripted.events("app_added")] == [f"{UID}:spanjob@n2"]
    assert [(e["app"], e["new_dr"]) for e in scripted.events("decision") if e["branch"] == "script"] == [
        (f"{UID}:spanjob@n2", [1, 9])]
    n2_log = [e["event"] for e in read_json_lines(n2.sd_log("spanjob"))]
    assert "update" in n2_log and "applied" in n2_log and "detached" in n2_log
    assert "update" not in [e["event"] for e in read_json_lines(n1.sd_log("spanjob"))]


@pytest.mark.slow
def test_node_shares_move_toward_the_faster_node_and_a_node_without_a_manager_trains_on(two_nodes, tmp_path):
    n1, n2 = two_nodes
    observer = SystemManagerProcess(tmp_path, n1.system_dir, n1.namespace, (50, 50), policy="observe")  # n2: none
    agents = two_node_job([n1, n2], 2, "--app", "spanjob", "--epochs", "3", "--iterations", "12", "--batch", "32",
                          "--exchange-every", "2", "--slow-node", "n2", "--sleep-per-sample", "0.004")
    try:
        codes = [agent.wait(300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
        assert observer.stop()[0] == 0
    assert codes == [0, 0], [agent.stderr()[-3000:] for agent in agents]
    assert not [agent.node.name for agent in agents if "Traceback" in agent.stderr()]
    assert "no manager in namespace" in agents[1].stderr() and "no manager" not in agents[0].stderr()
    steps = by_rank([line for agent in agents for line in agent.lines()])
    first = check_steps(steps, 36)
    fast = ranks_of(steps, "n1")
    on_fast = [sum(step["sizes"][rank] for rank in fast) / sum(step["sizes"]) for step in first]
    assert on_fast[0] == 0.5
    moves = [share for before, share in zip(on_fast, on_fast[1:]) if share != before]
    assert moves and all(later > earlier for earlier, later in zip([0.5, *moves], moves)), on_fast
    # each move was rank 0's, from both nodes' measured speeds (n1's the faster), logged by rank 0's node leader
    leader_node = first[0]["split"]["nodes"][0]
    log = read_json_lines((n1 if leader_node == "n1" else n2).sd_log("spanjob"))
    made = [e["node_move"] for e in log if e["event"] == "applied" and "node_move" in e]
    one = first[0]["split"]["nodes"].index("n1")
    assert len(made) == len(moves) and all(move["speeds"][one] > move["speeds"][1 - one] for move in made)
    assert all(move["gain"] > NODE_SHARE_MIN_GAIN for move in made)
    assert [e["app"] for e in observer.events("app_added")] == [f"{UID}:spanjob@n1"]


@pytest.mark.slow
def test_a_rank_killed_on_one_node_ends_the_job_on_both_and_each_manager_collects_its_part(two_nodes, tmp_path):
    n1, n2 = two_nodes
    managers = [SystemManagerProcess(tmp_path, node.system_dir, node.namespace, (50, 50), policy="observe")
                for node in two_nodes]
    agents = two_node_job([n1, n2], 2, "--app", "spanjob", "--epochs", "50", "--iterations", "10",
                          "--decide-every", "2", "--slow-node", "n2", "--sleep-per-sample", "0.002")
    try:
        wait_for_lines(agents, lambda lines: len(by_rank(lines)) == 4, 240)
        wait_for(lambda: [[e["app"] for e in manager.events("app_added")] for manager in managers] == [
            [f"{UID}:spanjob@n1"], [f"{UID}:spanjob@n2"]], 60)
        victim = next(line for line in started(agents[1].lines()).values() if line["leader"])
        os.kill(victim["pid"], signal.SIGKILL)  # n2's leader
        codes = [agent.wait(180) for agent in agents]  # no hang: both agents end
    finally:
        for agent in agents:
            agent.kill()
        stopped = [manager.stop()[0] for manager in managers]
    assert stopped == [0, 0] and all(code != 0 for code in codes)
    for manager, node in zip(managers, two_nodes):
        removed = [e for e in manager.events("app_removed") if e["app"] == f"{UID}:spanjob@{node.name}"]
        assert len(removed) == 1, manager.events()[-5:]
    assert [e["reason"] for e in managers[1].events("app_removed")][0] in ("disconnected", "process gone")
