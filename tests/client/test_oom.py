"""A DR change can never kill a job. Out-of-memory errors on emulated GPUs (which raise
torch's OutOfMemoryError) after a DR change are reverted, the batch re-run, the limit reported."""

import gc
import logging
import os

import pytest
import torch
from torch import nn

from drbalance import DataRatio
from drbalance.client import BalancedDataParallel, Session
from drbalance.client.emulated import EmulatedBackend, EmulatedOutOfMemoryError
from drbalance.emu.gpus import EmulatedGpu, EmulatedOutOfMemory, remove_emulated_gpus
from drbalance.ipc.records import AppRecord
from drbalance.jsonlog import read_json_lines
from drbalance.workload.models import ModelCosts
from tests.conftest import python_process

pytestmark = pytest.mark.timeout(120)

# A replica holds 1000 bytes plus, per sample, 100 at the backward's peak and 100 / 1.5 in the
# forward. On a 2000-byte GPU: the backward fits up to 10 samples, the forward up to 15.
PROFILE = ModelCosts("tiny", fixed=0.0, per_sample=0.0, dp_overhead=0.0, host_ratio=0.0,
                       memory_fixed=1000, memory_per_sample=100)
MEMORY = 2000


@pytest.fixture
def emu(ipc_env):
    yield ipc_env
    remove_emulated_gpus(ipc_env, 4)


def network(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def wrapped(module, ratio, gpus=2):
    return BalancedDataParallel(module, ratio=ratio, backend=EmulatedBackend(gpus, PROFILE, memory_bytes=MEMORY))


def data(step, batch=20):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(batch, 4, generator=generator), torch.randint(0, 2, (batch,), generator=generator)


def test_emulated_gpus_raise_torchs_out_of_memory_error_and_share_memory_across_processes(emu):
    gpu = EmulatedGpu(emu, 0, memory_bytes=1000)
    holder = python_process("tests.helpers.emu_memory_holder", "0", "600", "1000")
    try:
        assert holder.stdout.readline().strip() == "holding"
        info = gpu.memory_info()
        assert (info.total, info.used, info.free) == (1000, 600, 400)
        gpu.reserve(1, 400)  # fits next to the other process's 600
        with pytest.raises(EmulatedOutOfMemory, match="Tried to allocate 1 bytes. GPU 0 has a total capacity of 1000 "):
            gpu.reserve(1, 401)
        assert gpu.memory_info().used == 1000
        holder.kill()
        holder.wait()
        gpu.reserve(1, 1000)  # a dead process's memory is free again
    finally:
        holder.kill()
    backend = EmulatedBackend(1, PROFILE, memory_bytes=MEMORY)
    model = BalancedDataParallel(nn.Linear(4, 2), ratio=[10], backend=backend)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^Emulated GPU out of memory.*GPU 0 has a total"):
        model(torch.randn(16, 4))  # the forward needs 1000 + 16 x 100 / 1.5 > 2000 bytes; no DR to go back to
    # (one device: torch's error as the module raised it, as nn.DataParallel on one device lets it through)
    gpu.reserve(1, 0)
    gpu.close()
    backend.close()


def test_an_oom_in_the_forward_reverts_to_the_last_dr_that_worked_and_reruns_the_forward(emu, caplog):
    plain, balanced = network(), network()
    model = wrapped(balanced, [5, 5])
    x, _ = data(0)
    model(x).sum().backward()  # [5, 5]: 10 samples per GPU fit; the next forward proves it
    model.set_ratio([8, 2])  # 16 samples on GPU 0: the forward needs 2066 bytes
    with caplog.at_level(logging.WARNING, logger="drbalance.client"):
        out = model(x)  # no exception: reverted and re-run
    assert model.ratio == DataRatio([5, 5]) and model.last_chunk_sizes == (10, 10)
    plain(x)
    plain.eval(), balanced.eval()
    assert balanced[1].num_batches_tracked.item() == 2  # the failed forward's buffer update was undone
    (revert,) = model.take_reverts()
    assert revert.failed_ratio == DataRatio([8, 2]) and revert.slot == 0 and revert.phase == "forward"
    assert revert.failed_sizes == (16, 4) and model.max_samples == (10, None)  # 10 fitted on GPU 0
    assert "out of memory with DR [8, 2]/10" in caplog.text
    assert out.shape == (20, 2)
    # the same DR again is refused without trying (its chunk exceeds what fits)
    model.set_ratio([8, 2])
    model.train()
    model(x)
    assert model.last_chunk_sizes == (10, 10) and model.take_reverts() == []
    model.set_ratio([4, 6])  # within the limit: taken
    model(x)
    assert model.last_chunk_sizes == (8, 12)
    model.backend.close()


def reference_run(steps, micro_batches=1):
    """The same training on the CPU path with DR [5, 5] throughout (every failed DR was reverted to
    it): the parameters and buffers a run with no lost step and no half-applied update ends with.
    (The network has batch-norm, whose per-chunk statistics make the split part of the maths.)"""
    module = network()
    model = BalancedDataParallel(module, ratio=[5, 5])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            x, y = data(10 * step + micro)
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return module


def test_an_oom_in_the_backward_is_undone_and_the_step_rerun_with_train_step(emu):
    module = network()
    model = wrapped(module, [5, 5])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ratios = {1: [6, 4], 2: [7, 3]}  # step 1: 12 samples on GPU 0, the backward needs 2200 bytes
    for step in range(4):
        if step in ratios:
            model.set_ratio(ratios[step])
        x, y = data(10 * step)
        optimizer.zero_grad()

        def closure(x=x, y=y):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = model.train_step(closure)
        assert torch.isfinite(loss)
        optimizer.step()
    reverts = model.take_reverts()
    assert [(r.failed_ratio.to_list(), r.phase, r.slot) for r in reverts] == [([6, 4], "step", 0)]
    assert model.max_samples == (10, None) and model.ratio == DataRatio([5, 5])  # [7, 3] was refused
    expected = reference_run(4)
    for got, want in zip(module.state_dict().values(), expected.state_dict().values()):
        torch.testing.assert_close(got, want)  # no lost step, no half-applied update, buffers included
    assert module[1].num_batches_tracked.item() == 4
    model.backend.close()


def test_a_step_of_two_forwards_then_one_backward_is_undone_and_rerun_too(emu):
    # the second forward starts before the first one's backward: it must not prove the new DR
    module = network()
    model = wrapped(module, [5, 5])
    for step in range(3):
        if step == 1:
            model.set_ratio([6, 4])  # 12 samples of each forward's 20 on GPU 0: the backward does not fit
        halves = [data(10 * step + half, batch=20) for half in (0, 1)]

        def closure(halves=halves):
            loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in halves) / 2
            loss.backward()
            return loss

        module.zero_grad()
        assert torch.isfinite(model.train_step(closure))
    reverts = model.take_reverts()
    assert [(r.failed_ratio.to_list(), r.phase) for r in reverts] == [([6, 4], "step")]
    assert model.ratio == DataRatio([5, 5]) and model.max_samples[0] is not None
    model.backend.close()


def test_accumulated_gradients_survive_an_oom_in_a_later_micro_batch(emu):
    module = network()
    model = wrapped(module, [5, 5])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(2):
            if step == 1 and micro == 1:
                model.set_ratio([6, 4])  # the OOM hits after the first micro-batch's gradients are in
            x, y = data(10 * step + micro)

            def closure(x=x, y=y):
                nn.functional.cross_entropy(model(x), y).backward()

            model.train_step(closure)
        optimizer.step()
    assert len(model.take_reverts()) == 1
    expected = reference_run(2, micro_batches=2)
    for got, want in zip(module.state_dict().values(), expected.state_dict().values()):
        torch.testing.assert_close(got, want)
    model.backend.close()


def test_what_cannot_be_reverted_propagates_unchanged(emu):
    model = wrapped(network(), [5, 5])
    x, y = data(0)
    model(x).sum().backward()
    model.set_ratio([6, 4])
    loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="GPU 0 has a total capacity"):
        loss.backward()  # without train_step an OOM in the backward reaches the script (documented)
    model.backend.close()  # frees its memory on the small GPUs for the next model
    tight = wrapped(network(), [5, 5])
    tight.train_step(lambda: tight(x).sum().backward())
    with pytest.raises(ValueError, match="not an OOM"):
        tight.train_step(lambda: (_ for _ in ()).throw(ValueError("not an OOM")))  # other errors: unchanged
    tight.backend.close()


def test_the_session_reports_the_limit_and_memory_per_sample_and_logs_the_revert(emu, tmp_path):
    model = wrapped(network(), [5, 5])
    session = Session(model, "oomy", epochs=1, iterations_per_epoch=50, solo_time=10.0, report_every=2,
                      exchange_timeout=0.0)
    try:
        record = AppRecord.open(emu, "oomy")
        for step in range(6):
            if step == 2:
                model.set_ratio([8, 2])
            x, y = data(step)
            model.train_step(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y).backward())
            session.step()
        slots = record.read_status().slots
        assert [slot.max_samples for slot in slots] == [10, None]
        # peak bytes / chunk: (1000 + 100 x 10) / 10 at the backward's peak
        assert [slot.memory_per_sample for slot in slots] == [pytest.approx(200.0), pytest.approx(200.0)]
        assert [slot.uuid for slot in slots] == [EmulatedGpu(emu, i).uuid for i in range(2)]
        record.close()
    finally:
        session.close()
        model.backend.close()
    events = [e for e in read_json_lines(tmp_path / "logs" / "oomy.sd.jsonl") if e["event"] == "oom_revert"]
    assert len(events) == 1 and events[0]["failed_dr"] == [8, 2] and events[0]["max_samples"] == [10, None]


def test_a_revert_after_the_last_report_is_still_logged_when_the_session_closes(emu, tmp_path):
    """A revert in the last steps before close() (a short run, a job stopped) reaches the SD log too
    (docs/client.md: each is recorded), not only those before a report or boundary."""
    model = wrapped(network(), [5, 5])
    session = Session(model, "oomlate", epochs=1, iterations_per_epoch=50, solo_time=10.0, report_every=5,
                      exchange_timeout=0.0)
    try:
        for step in range(3):  # no report: they come at iteration 5
            if step == 1:
                model.set_ratio([8, 2])
            x, y = data(step)
            model.train_step(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y).backward())
            session.step()
    finally:
        session.close()
        model.backend.close()
    events = [e for e in read_json_lines(tmp_path / "logs" / "oomlate.sd.jsonl") if e["event"] == "oom_revert"]
    assert len(events) == 1 and events[0]["failed_dr"] == [8, 2] and events[0]["max_samples"] == [10, None]


def test_two_jobs_on_one_emulated_gpu_compete_for_its_memory(emu):
    holder = python_process("tests.helpers.emu_memory_holder", "1", "1500", str(MEMORY))
    try:
        assert holder.stdout.readline().strip() == "holding"
        model = wrapped(network(), [10, 0])
        x, _ = data(0, batch=10)
        model(x).sum().backward()  # all 10 samples on GPU 0: 2000 bytes at the backward's peak, fits
        model.set_ratio([5, 5])  # the other job holds 1500 of GPU 1's 2000 bytes; a replica needs 1333
        model(x)
        assert model.ratio == DataRatio([10, 0]) and model.max_samples == (None, 0)
        assert EmulatedGpu(emu, 1, memory_bytes=MEMORY).memory_info().used == 1500
    finally:
        holder.kill()
        holder.wait()
    assert not os.path.exists(f"/proc/{holder.pid}/stat") or holder.returncode is not None
    model.backend.close()


def test_item5_the_wrapper_with_emulated_gpus_pickles_copies_and_averages(emu):
    import copy
    import pickle

    model = BalancedDataParallel(network(), ratio=[5, 5], backend=EmulatedBackend(2, PROFILE))  # 24 GiB each
    x, _ = data(0)
    model.eval()
    expected = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(clone(x), expected)
        assert clone.device_uuids() == model.device_uuids()
        clone.backend.close()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    averaged.update_parameters(model)
    torch.testing.assert_close(averaged(x), expected)
    model.backend.close()


def test_an_emulated_oom_is_an_instance_of_torchs_error():
    error = EmulatedOutOfMemoryError("x", device_index=3)
    assert isinstance(error, torch.cuda.OutOfMemoryError) and isinstance(error, RuntimeError)
    assert error.device_index == 3


def test_a_gpu_the_new_dr_no_longer_uses_gets_its_memory_back(emu):
    model = wrapped(network(), [5, 5])
    x, _ = data(0, batch=10)
    model(x).sum().backward()
    gpu1 = EmulatedGpu(emu, 1, memory_bytes=MEMORY)
    assert gpu1.memory_info().used == 1000 + 5 * 100  # the replica's backward peak stays reserved (cached)
    model.set_ratio([10, 0])
    model(x).sum().backward()
    assert gpu1.memory_info().used == 0  # no replica there any more: released, as empty_cache would
    gpu1.close()
    model.backend.close()


def test_a_model_deleted_without_close_gives_its_memory_and_files_back(emu):
    # As on a GPU, where a deleted model's tensors go back to the allocator. Before, a backend freed
    # without close() kept its reservation (and its GPUs' files and mapping) until the process
    # ended: the second model of a sweep or a notebook ran out of memory on an idle GPU.
    gpu = EmulatedGpu(emu, 0, memory_bytes=MEMORY)
    gc.collect()  # earlier tests' garbage in this worker closes its files now, not while counting below
    files = len(os.listdir("/proc/self/fd"))

    def train_a_new_model() -> None:
        model = wrapped(network(), [10, 0])  # 8 samples on GPU 0: 1800 of its 2000 bytes at the backward
        x, y = data(0, batch=8)
        nn.functional.cross_entropy(model(x), y).backward()
        assert gpu.memory_info().used == 1800

    for _ in range(3):  # two models at once would not fit
        train_a_new_model()
        gc.collect()
        assert gpu.memory_info().used == 0
    assert len(os.listdir("/proc/self/fd")) == files
    gpu.close()
