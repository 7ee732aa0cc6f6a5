"""BalancedDistributedDataParallel in one process (a 1-rank gloo group): validation, and what its Session publishes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from drbalance.client import BalancedBatchSampler, BalancedDataParallel, BalancedDistributedDataParallel, Session
from drbalance.client.distributed import JobSync
from drbalance.ipc.endpoint import AppChannel
from drbalance.ipc.link import DetachedLink
from drbalance.ratio import DataRatio
from tests.conftest import leftovers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_model_validates_its_arguments_and_keeps_a_usable_ratio(one_rank):
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        BalancedDistributedDataParallel(nn.Linear(3, 1), loss_reduction="max")
    with pytest.raises(ValueError, match="has 2 entries but the job has 1 rank"):
        BalancedDistributedDataParallel(nn.Linear(3, 1), ratio=[5, 5])
    model = BalancedDistributedDataParallel(nn.Linear(3, 1))
    assert model.ratio == DataRatio([10]) and model.min_share == 1 and (model.rank, model.world_size) == (0, 1)
    with pytest.raises(ValueError, match="has 2 entries"):
        model.set_ratio([3, 7])
    assert model.ratio == DataRatio([10])  # unchanged
    assert model.set_ratio(DataRatio([1], 1)) == 0 and model.ratio == DataRatio([10])  # kept in tenths
    assert model.last_chunk_sizes == (0,) and model.last_replica_timings() == []
    model(torch.randn(4, 3)).sum().backward()
    model(torch.randn(6, 3)).sum().backward()
    assert model.last_chunk_sizes == (6,)
    (timing,) = model.last_replica_timings()  # the step before the last one
    assert (timing.slot, timing.device, timing.samples) == (0, "cpu", 4) and timing.seconds > 0
    with torch.no_grad():
        model(torch.randn(9, 3))  # an evaluation forward neither counts nor exchanges anything
    assert model.last_chunk_sizes == (6,)
    assert JobSync.of(model) is not None and JobSync.of(BalancedDataParallel(nn.Linear(3, 1))) is None


def test_a_ddp_session_publishes_one_app_with_its_minimum_share_batch_and_rank_slots(one_rank, ipc_env):
    model = BalancedDistributedDataParallel(nn.Linear(3, 1))
    sampler = BalancedBatchSampler(40, 8, model=model)
    data = torch.randn(40, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Session(model, "single", 2, len(sampler), 1.0, report_every=2) as session:
        channel = AppChannel(ipc_env, "single")
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for step, indices in enumerate(sampler):
                optimizer.zero_grad()
                model(data[indices]).pow(2).mean().backward()
                optimizer.step()
                if epoch == 1 and step == 3:
                    status = channel.read_status()  # written at the report after step 2 of epoch 1
                session.step()
        assert session.job is not None and session.job.leader
        channel.close()
    assert status.min_share == 1 and status.batch == 8 and status.ratio == DataRatio([10])
    (slot,) = status.slots
    assert slot.uuid == "" and slot.chunk_samples == 8 and slot.chunk_seconds is not None and slot.chunk_seconds > 0
    assert leftovers(ipc_env) == []


def test_a_one_rank_ddp_job_can_be_profiled(one_rank, ipc_env, tmp_path, monkeypatch):
    """``drbalance profile`` measures one process on one GPU: a one-rank job is that. Its session
    under profiling attaches to no manager and keeps the whole batch on its one rank."""
    monkeypatch.setenv("DRBALANCE_PROFILE_OUTPUT", str(tmp_path / "profile.json"))
    model = BalancedDistributedDataParallel(nn.Linear(3, 1))
    session = Session(model, "profiled", 1, 4, "unused")
    assert isinstance(session.link, DetachedLink) and model.ratio == DataRatio([10])
    session.close()


@pytest.mark.timeout(60)
def test_a_profiled_ddp_job_names_its_device(one_rank, ipc_env, tmp_path, monkeypatch):
    """The measurement of a DDP job said device "unknown" ("measured in 12 s on unknown", and the stored
    profile's ``device``), where a DataParallel job's says cpu or cuda:0 (docs/profiles.md)."""
    from drbalance.client.session import MeasurementComplete
    from drbalance.profiling.store import Measurement

    output = tmp_path / "profile.json"
    monkeypatch.setenv("DRBALANCE_PROFILE_OUTPUT", str(output))
    monkeypatch.setenv("DRBALANCE_PROFILE_ITERATIONS", "3")
    monkeypatch.setenv("DRBALANCE_PROFILE_WARMUP", "1")
    model = BalancedDistributedDataParallel(nn.Linear(3, 1))
    session = Session(model, "profiled", 1, 10, "unused")
    with pytest.raises(MeasurementComplete):
        for _ in range(3):
            model(torch.randn(4, 3)).sum().backward()
            session.step()
    assert Measurement.read(output).device == "cpu"


def test_counting_steps_between_exchanges_and_half_precision_exchanging_every_step(one_rank):
    with pytest.raises(ValueError, match="exchange_every must be None"):
        BalancedDistributedDataParallel(nn.Linear(3, 1), exchange_every=0)
    torch.manual_seed(0)
    model = BalancedDistributedDataParallel(nn.Linear(3, 2), exchange_every=4)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.module.state_dict())
    assert model.counts_ride and model.exchange_every == 4 and model.exchange_plan is None
    kinds = []
    for size in (4, 6, 5, 5, 7, 3):  # the global batch changes on counting steps: corrected by B_ref / B
        x = torch.randn(size, 3)
        model.zero_grad()
        reference.zero_grad()
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        kinds.append(model.last_step_exchanged)
        assert model.last_chunk_sizes == (size,)
        for mine, theirs in zip(model.module.parameters(), reference.parameters()):
            assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)
    assert kinds == [True, False, False, False, True, False]
    assert (model.exchange_plan.step, model.exchange_plan.interval, model.exchange_plan.next_step) == (4, 4, 8)
    half = BalancedDistributedDataParallel(nn.Linear(3, 2).to(torch.float16), exchange_every=4)
    assert not half.counts_ride  # fp16 cannot hold the counts exactly: a control exchange every step
    for size in (4, 6, 5):
        half(torch.randn(size, 3, dtype=torch.float16)).float().sum().backward()
        assert half.last_step_exchanged and half.last_chunk_sizes == (size,)


def test_a_job_on_one_node_is_one_app_whose_local_dr_is_the_jobs(one_rank):
    with pytest.raises(TypeError, match="balance_nodes must be True or False"):
        BalancedDistributedDataParallel(nn.Linear(3, 1), balance_nodes="no")
    model = BalancedDistributedDataParallel(nn.Linear(3, 1))
    assert not model.node_layout.spans and model.node_layout.node_of == (0,)
    assert model.node_split.locals == (model.ratio,) and type(JobSync.of(model)) is JobSync
    model.propose_local_ratio([1])  # one node: the job's DR (unchanged here: no proposal)
    assert model._balance.proposal is None and model._balance.local_proposal is None
    with pytest.raises(ValueError, match="has 2 entries but the job has 1 rank"):
        model.propose_local_ratio([5, 5])
