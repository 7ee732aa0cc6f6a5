"""Emulated GPUs: exclusive slots across processes, kill -9 safety, NVML-like utilisation, the backend."""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.emulated import EmulatedBackend
from drbalance.emu.gpus import (
    EmulatedGpu,
    EmulatedSource,
    emulated_spec,
    emulated_uuid,
    release_emulated_gpu,
    remove_emulated_gpus,
)
from drbalance.manager.utilization import open_source
from drbalance.workload.models import ModelCosts
from tests.conftest import ROOT, python_process, wait_for


@pytest.fixture
def emu(ipc_env):
    yield ipc_env
    remove_emulated_gpus(ipc_env, 4)


def test_a_free_gpu_serves_the_device_time_and_reports_it_busy(emu):
    gpu = EmulatedGpu(emu, 0)
    source = EmulatedSource(emu, [0, 1])
    source.sample()
    started = time.monotonic()
    assert gpu.occupy(0.3) < 0.25  # no wait on a free GPU (a busy CI machine may deschedule us briefly)
    elapsed = time.monotonic() - started
    time.sleep(0.3)
    busy, idle = source.sample()
    assert 0.29 <= elapsed < 0.8  # loose upper bound: a busy CI machine may oversleep
    # the GPU counts the time it was really held (oversleeping included), so compare with that
    assert busy == pytest.approx(100 * elapsed / (time.monotonic() - started), abs=8) and idle == 0.0
    assert gpu.read().acquisitions >= 1 and gpu.read().busy_since == 0.0
    gpu.close()
    source.close()


def test_jobs_in_two_processes_take_turns_and_different_gpus_run_concurrently(emu):
    holder = python_process("tests.helpers.emu_holder", "0", "1.5")
    try:
        assert holder.stdout.readline().strip() == "holding"
        mine = EmulatedGpu(emu, 0)
        other = EmulatedGpu(emu, 1)
        started = time.monotonic()
        assert other.occupy(0.2) < 0.25  # another GPU: no waiting for GPU 0's holder (1.5 s)
        waited = mine.occupy(0.3)  # GPU 0 is shared: we take turns with the other process
        elapsed = time.monotonic() - started
        holder.communicate(timeout=30)
    finally:
        holder.kill()
    # GPU 0 is still held (1.5 s, of which at most about 0.2 s passed): we waited for our turn
    assert waited > 0.05 and elapsed > 0.45
    mine.close()
    other.close()


def test_a_killed_holder_does_not_wedge_the_gpu(emu):
    holder = python_process("tests.helpers.emu_holder", "2", "30")
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
    gpu = EmulatedGpu(emu, 2)
    assert gpu.busy_seconds(time.monotonic()) < 5  # a dead holder's open occupation is not counted on
    started = time.monotonic()
    assert gpu.occupy(0.1) < 0.5  # the kernel released the dead holder's lock
    assert time.monotonic() - started < 1.0
    gpu.close()


def test_the_manager_source_reads_emulated_gpus_like_nvml(emu, monkeypatch):
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "3")
    source = open_source("emulated")
    assert source.gpu_count() == 3 and source.sample() == (None, None, None)  # no period yet
    threading.Thread(target=EmulatedGpu(emu, 1).occupy, args=(0.25,)).start()
    time.sleep(0.5)
    reading = source.sample()
    assert reading[0] == 0.0 and 25 <= reading[1] <= 70 and reading[2] == 0.0
    with pytest.raises(ValueError, match="emulated GPU count must be 1..32"):
        open_source("emulated:0")
    source.close()


def test_the_emulated_backend_splits_like_the_cpu_path_and_times_replicas(emu):
    costs = ModelCosts("test", fixed=0.01, per_sample=0.005, dp_overhead=0.02, host_ratio=0.0)
    backend = EmulatedBackend(4, costs, time_scale=1.0, sample_scale=1.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    nn.functional.cross_entropy(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    wrapped = BalancedDataParallel(model, ratio=[2, 0, 5, 3], backend=backend)
    started = time.monotonic()
    nn.functional.cross_entropy(wrapped(x), y).backward()
    elapsed = time.monotonic() - started
    for grad, exp in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(grad, exp)
    timings = wrapped.last_replica_timings()
    assert [(t.slot, t.device, t.samples) for t in timings] == [(0, "emu:0", 2), (2, "emu:2", 5), (3, "emu:3", 3)]
    assert all(t.seconds >= 0.01 + 0.005 * t.samples - 1e-3 for t in timings)
    # host phase: 2 extra replicas x 0.02 s; device phase: chunks in parallel, the longest 0.035 s
    assert 0.07 <= elapsed < 5.0  # the lower bound is the point; the upper one only catches a hang
    with pytest.raises(ValueError, match=r"device_ids \[7\] are not among the 4 emulated GPUs"):
        BalancedDataParallel(nn.Linear(2, 2), device_ids=[0, 7], backend=backend)
    backend.close()


def test_jobs_killed_while_waiting_for_a_gpu_leave_it_unshared(emu):
    """A waiter killed (kill -9) while waiting leaves no count behind: a waiter counted in a
    semaphore that outlived it would make the GPU look shared for good (a lone job would take
    turns and serve about 1.2x its time)."""
    holder = python_process("tests.helpers.emu_holder", "0", "120")
    waiters = []
    try:
        assert holder.stdout.readline().strip() == "holding"
        for index in range(6):  # each spends about half its time waiting for its turn, then is killed
            waiter = python_process("tests.helpers.emu_holder", "0", "120")
            waiters.append(waiter)
            time.sleep(0.3 + 0.037 * index)
            waiter.send_signal(signal.SIGKILL)
            waiter.wait(timeout=30)
    finally:
        for process in (holder, *waiters):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
    gpu = EmulatedGpu(emu, 0)  # a later job of the namespace
    try:
        assert not gpu._others_waiting()
        started = time.monotonic()
        gpu.occupy(0.5)
        assert time.monotonic() - started >= 0.49  # served alone: no co-location discount
    finally:
        gpu.close()


class _Optional(nn.Module):
    """A module that may be called without a batch tensor (``n`` only), as DataParallel allows."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor | None = None, n: int = 3) -> torch.Tensor:
        return self.layer(x) if x is not None else torch.zeros(n)


def test_an_empty_batch_or_no_batch_tensor_as_the_first_call_runs_as_on_the_cpu(emu):
    for first in (lambda model: model(torch.randn(0, 4)), lambda model: model(n=5)):
        model = BalancedDataParallel(_Optional(), backend=EmulatedBackend(2, None, namespace=emu.namespace))
        cpu = BalancedDataParallel(_Optional(), device_ids=[0, 1])
        assert first(model).shape == first(cpu).shape  # (0, 3) and (5,)
        assert model.backend.costs is None  # nothing to measure on yet
        model(torch.randn(6, 4)).sum().backward()  # the first batch with samples is measured
        assert model.backend.costs is not None and model.backend.costs.memory_per_sample > 0
        model.backend.close()


def test_costs_first_estimated_without_gradients_are_measured_again_with_them(emu):
    x = torch.randn(8, 6)

    def build() -> BalancedDataParallel:
        torch.manual_seed(0)
        network = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3))
        return BalancedDataParallel(network, backend=EmulatedBackend(2, None, namespace=emu.namespace))

    trained = build()
    trained(x)
    validated = build()
    with torch.no_grad():  # a validation pass first: no activations saved, memory would read 0
        validated(x)
    assert validated.backend.costs_provisional and validated.backend.costs.memory_per_sample == 0
    validated(x)
    assert not validated.backend.costs_provisional
    assert validated.backend.costs.memory_per_sample == trained.backend.costs.memory_per_sample > 0
    for model in (trained, validated):
        model.backend.close()


def test_a_manager_stopping_while_a_job_maps_its_emulated_gpus_says_so_and_leaves_them(emu, tmp_path):
    from tests.helpers.processes import ManagerProcess

    manager = ManagerProcess(tmp_path, emu, (0, 0), "--source", "emulated:2")
    held = EmulatedGpu(emu, 1)  # this process uses GPU 1, as a training job would
    try:
        code, err = manager.stop()
        assert code == 0, err
        stop = manager.events("stop")[0]
        assert stop["gpus_left_in_use"] == {"1": [os.getpid()]}, stop
        assert "emulated GPU(s) [1] are still used by pid(s)" in err
        assert os.path.exists(f"/dev/shm/{emu.emulated_gpu(1).lstrip('/')}")  # not pulled from under the job
        assert not os.path.exists(f"/dev/shm/{emu.emulated_gpu(0).lstrip('/')}")  # unused: removed
    finally:
        held.close()


JOB_THAT_NEVER_CLOSES = """
import torch
from torch import nn
from drbalance.client import BalancedDataParallel
from drbalance.client.emulated import EmulatedBackend
model = BalancedDataParallel(nn.Linear(4, 2), backend=EmulatedBackend(2, None))
model(torch.randn(6, 4)).sum().backward()
print("trained")
"""


def _emulated_objects(names) -> dict[str, bool]:
    """Which of emulated GPUs 0 and 1's segments and lock files exist."""
    found = {}
    for index in (0, 1):
        found[f"segment {index}"] = os.path.exists(f"/dev/shm/{names.emulated_gpu(index).lstrip('/')}")
        found[f"lock {index}"] = names.emulated_lock(index).exists()
        found[f"wait {index}"] = names.emulated_wait_lock(index).exists()
    return found


def _run_job(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr


def test_a_job_without_a_manager_removes_its_emulated_gpus_at_exit(emu):
    _run_job(JOB_THAT_NEVER_CLOSES)  # no manager, backend never closed: the exit releases the GPUs
    assert not any(_emulated_objects(emu).values()), _emulated_objects(emu)


def test_a_forked_child_such_as_a_data_loader_worker_does_not_keep_the_gpu_from_removal(emu):
    # A data-loader worker forked after the GPU was opened inherits its mapping. Before, it counted
    # as a user, so the job's exit release left the GPU to it, and the worker never removes anything:
    # every job with data-loader workers left its emulated GPUs in /dev/shm.
    gpu = EmulatedGpu(emu, 0)
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: it never touches the GPU
        os.write(ready_write, b"x")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(ready_write)
        assert os.read(ready_read, 1) == b"x"  # the child runs (its fork hooks have run)
        assert release_emulated_gpu(gpu) == []  # nobody else uses it
        assert not os.path.exists(f"/dev/shm/{emu.emulated_gpu(0).lstrip('/')}")
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready_read)


def test_an_emulated_gpu_another_process_still_maps_stays_until_its_last_user_leaves(emu):
    held = EmulatedGpu(emu, 1)  # this process trains on GPU 1 too
    _run_job(JOB_THAT_NEVER_CLOSES)
    left = _emulated_objects(emu)
    assert left == {"segment 0": False, "lock 0": False, "wait 0": False,
                    "segment 1": True, "lock 1": True, "wait 1": True}, left
    assert release_emulated_gpu(held) == []  # the last user: it removes what is left
    assert not any(_emulated_objects(emu).values()), _emulated_objects(emu)


def test_closing_one_model_leaves_the_gpu_another_model_of_the_process_still_uses(emu):
    # Two models of one process on emulated GPU 0: closing one must not remove the GPU under the
    # other. Before, the process's own mappings were never counted as users: GPU 0 was unlinked,
    # and the next job to open it got a fresh GPU that did not see the model still training there.
    costs = ModelCosts("toy", fixed=0.0, per_sample=0.0, dp_overhead=0.0, host_ratio=0.0,
                       memory_fixed=3000, memory_per_sample=1)
    done_with, training = (BalancedDataParallel(nn.Linear(4, 2), device_ids=[0],
                                                backend=EmulatedBackend(1, costs, memory_bytes=4000)) for _ in range(2))
    done_with(torch.randn(2, 4)).sum().backward()
    done_with.backend.release_memory()
    training(torch.randn(2, 4)).sum().backward()  # holds about 3000 of the GPU's 4000 bytes
    done_with.backend.close()
    newcomer = EmulatedGpu(emu, 0, memory_bytes=4000)  # another job (or the manager) opens GPU 0
    try:
        assert newcomer.memory_info().used == training.backend._reserved[0]  # the same GPU: it sees the model
        training.backend.close()
        assert os.path.exists(f"/dev/shm/{emu.emulated_gpu(0).lstrip('/')}")  # the newcomer still maps it
    finally:
        release_emulated_gpu(newcomer)
    assert not os.path.exists(f"/dev/shm/{emu.emulated_gpu(0).lstrip('/')}")  # its last user removed it


def test_a_gpu_is_not_removed_while_another_process_may_be_opening_it(emu):
    gpu = EmulatedGpu(emu, 0)
    opening = os.open(emu.runtime_dir(), os.O_RDONLY | os.O_DIRECTORY)  # as a job stopped in the middle of opening
    try:
        fcntl.flock(opening, fcntl.LOCK_SH)
        started = time.monotonic()
        assert release_emulated_gpu(gpu) == []
        assert time.monotonic() - started < 60  # gave up on the guard instead of hanging
        assert all(_emulated_objects(emu)[name] for name in ("segment 0", "lock 0", "wait 0"))  # left, not pulled
    finally:
        os.close(opening)
    again = EmulatedGpu(emu, 0)
    assert release_emulated_gpu(again) == [] and not any(_emulated_objects(emu).values())


def test_a_job_taking_its_turn_sees_the_gpu_shared_from_its_first_slice(emu):
    # docs/emulation.md: while another job waits, a slice serves 1.216 times its length. A holder
    # that steps aside still has work: it must count as waiting before it lets go. Before, it
    # registered only after its 2 ms pause, so every turn's first slice ran at 1.0 and two jobs
    # sharing a GPU served 1.10 seconds of work per second, not 1.216.
    holder = python_process("tests.helpers.emu_holder", "0", "60")  # far more work than ours
    try:
        assert holder.stdout.readline().strip() == "holding"
        mine = EmulatedGpu(emu, 0)
        seen = []
        probe = mine._others_waiting

        def recording_probe():
            shared = probe()
            seen.append(shared)
            return shared

        mine._others_waiting = recording_probe
        mine.occupy(0.4)
        mine.close()
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    assert len(seen) >= 2  # we took several turns with the holder
    assert all(seen), f"slices served as if alone while the holder waited: {seen}"


@pytest.mark.timeout(60)
def test_a_forward_after_a_ranks_emulated_gpu_was_closed_is_a_clear_error(ipc_env):
    """The hook stayed and used the closed lock descriptors: a bare 'Bad file descriptor', or
    flocks on whatever file had reused those numbers."""
    from torch import nn

    from drbalance.client.emulated_rank import EmulatedRankDevice
    from drbalance.workload.models import model_costs

    device = EmulatedRankDevice(0, model_costs("alexnet"), time_scale=0.001, namespace=ipc_env.namespace)
    module = nn.Linear(4, 2)
    device.attach(module)
    module(torch.randn(3, 4)).sum().backward()  # held the GPU for its modelled time
    device.close()
    with pytest.raises(RuntimeError, match="emulated GPU emu:0 after its EmulatedRankDevice was closed"):
        module(torch.randn(3, 4))


@pytest.mark.timeout(60)
def test_a_ranks_emulated_gpu_without_a_cost_table_estimates_one_from_its_first_forward(ipc_env):
    """What the Lightning and Accelerate integrations use: they know no model name to look up."""
    from torch import nn

    from drbalance.client.costs import rough_features
    from drbalance.client.emulated_rank import EmulatedRankDevice
    from drbalance.workload.models import estimate_costs

    device = EmulatedRankDevice(0, None, time_scale=0.001, namespace=ipc_env.namespace)
    module = nn.Linear(4, 2)
    device.attach(module)
    module(torch.randn(0, 4))  # no samples: nothing to estimate from yet
    assert device.costs is None
    inputs = torch.randn(3, 4)
    output = module(inputs)
    assert device.costs == estimate_costs("Linear", rough_features(module, (inputs,), output, 3))
    assert device.costs.per_sample > 0
    first = device.costs
    module(torch.randn(5, 4)).sum().backward()
    assert device.costs is first  # estimated once
    device.close()


@pytest.mark.timeout(60)
def test_a_ranks_emulated_device_counts_the_gpus_cuda_visible_devices_shows(emu, monkeypatch):
    """Local rank i holds visible device i, as on CUDA: with CUDA_VISIBLE_DEVICES=3,1 rank 0 is on
    the user's GPU 3 and rank 1 on GPU 1, and a third rank has no device."""
    import argparse

    from drbalance.client.emulated_rank import EmulatedRankDevice
    from drbalance.integrations.job import emulated_rank_device
    from drbalance.runs.train_ddp import rank_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    spec = emulated_spec("4")
    assert [rank_device(argparse.Namespace(gpus=None), "emulated", rank, spec) for rank in (0, 1)] == [0, 1]
    with pytest.raises(SystemExit, match="local rank 2 has no device: --gpus gives 2"):
        rank_device(argparse.Namespace(gpus=None), "emulated", 2, spec)
    devices = [EmulatedRankDevice(rank, None, namespace=emu.namespace, count=4) for rank in (0, 1)]
    assert [(d.label, d.gpu.index, d.uuid) for d in devices] == [
        ("emu:0", 3, emulated_uuid(emu, 3)), ("emu:1", 1, emulated_uuid(emu, 1))]
    for device in devices:
        device.close()
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "4")
    device = emulated_rank_device(torch.device("cpu"), 0)
    assert device.uuid == emulated_uuid(emu, 3)
    device.close()
    with pytest.raises(ValueError, match=r"local rank 2 has no emulated GPU: DRBALANCE_EMULATED_GPUS=4 gives 2 of "
                       r"this user's 4 emulated GPUs, as CUDA_VISIBLE_DEVICES='3,1' gives: GPU\(s\) 3, 1"):
        emulated_rank_device(torch.device("cpu"), 2)


class ReturnsItsScale(nn.Module):
    """Returns a parameter of its own (a learned temperature) before the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.linear = nn.Linear(3, 1)

    def forward(self, x):
        return self.scale, self.linear(x)


@pytest.mark.timeout(120)
def test_a_parameter_the_module_returns_gets_no_memory_hook_that_outlives_the_forward(emu):
    """The backward's memory is reserved by a hook on the chunk's output. A parameter in the output
    lives on: a hook on it would stay for every later backward (one more per forward) and keep
    reserving memory on the GPU of a chunk long gone, after a DR change too."""
    costs = ModelCosts("test", fixed=0.0, per_sample=0.0, dp_overhead=0.0, host_ratio=0.0,
                       memory_fixed=1000, memory_per_sample=100)
    backend = EmulatedBackend(2, costs)
    try:
        model = ReturnsItsScale()
        wrapped = BalancedDataParallel(model, ratio=[5, 5], backend=backend)
        x = torch.randn(10, 3)
        for _ in range(3):
            scale, out = wrapped(x)
            (out.mean() * scale.mean()).backward()
        assert backend.gpus[1].memory_info().used > 0
        wrapped.set_ratio([10, 0])  # GPU 1 unused from now on: its memory is given back
        for _ in range(2):
            scale, out = wrapped(x)
            (out.mean() * scale).backward()
        assert backend.gpus[1].memory_info().used == 0
        assert not model.scale._backward_hooks
    finally:
        backend.close()


@pytest.mark.timeout(120)
def test_processes_giving_one_emulated_gpu_different_memory_sizes_are_refused(emu):
    """Every process uses one N:MEMORY for the same emulated GPUs; one that gives another size is
    refused. Otherwise a manager started with emulated:4:8GiB would cap shares by 8 GiB while its
    jobs (DRBALANCE_EMULATED_GPUS=4) reserved up to 24 GiB on the same GPUs, without a word."""
    holder = python_process("tests.helpers.emu_memory_holder", "0", "1000", str(16 * 2**30))
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(ValueError, match=r"emulated GPU 0 .* 16\.00 GiB .* 24\.00 GiB"):
            EmulatedGpu(emu, 0)  # the default size, 24 GiB
        same = EmulatedGpu(emu, 0, memory_bytes=16 * 2**30)  # the same spec as the holder's
        assert same.memory_info().total == 16 * 2**30 and same.memory_info().used == 1000
        same.close()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # its only user was killed: the GPU it left behind takes the next process's size
    gpu = EmulatedGpu(emu, 0, memory_bytes=8 * 2**30)
    assert gpu.memory_info().total == 8 * 2**30
    other = EmulatedGpu(emu, 0, memory_bytes=8 * 2**30)  # a second user with the same spec
    gpu.close()
    other.close()


def test_an_emulated_gpu_memory_size_beyond_a_pebibyte_is_refused_in_plain_words(emu):
    """A size that its segment cannot record (8 bytes) ended in 'struct.error: argument out of range'."""
    with pytest.raises(ValueError, match=r"at most 1 PiB"):
        emulated_spec("2:99999999999999999999999TiB")
    with pytest.raises(ValueError, match=r"at most 1 PiB"):
        EmulatedGpu(emu, 0, memory_bytes=2**70)
    assert emulated_spec("2:1024TiB").memory_bytes == 2**50  # the largest size still taken
    with pytest.raises(ValueError, match=r"at most 1 PiB"):
        EmulatedBackend(2, None, memory_bytes=2**50 + 1)


@pytest.mark.timeout(120)
def test_a_killed_jobs_memory_and_busy_turn_do_not_come_back_with_a_process_that_reuses_its_pid(emu):
    """Entries were checked by pid alone: once a killed job's pid named another process (pids wrap
    at 32768 on many machines), its reservation counted again and a job beside it ran out of
    memory on an idle GPU (reproduced as root with /proc/sys/kernel/ns_last_pid: 5 GiB of a
    killed job came back with a 'sleep'); its open turn counted the GPU busy as well. Here the
    reuse is written into the segment: the dead job's entries then name a live process."""
    from drbalance.emu import gpus as emu_gpus
    from drbalance.ipc.objects import process_start_ticks

    memory = 8 * 2**30
    holder = python_process("tests.helpers.emu_memory_holder", "0", str(5 * 2**30), str(memory))
    other = None
    gpu = EmulatedGpu(emu, 0, memory_bytes=memory)  # another job keeps the GPU mapped meanwhile
    try:
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(0.05)  # a few clock ticks: the pid's next owner starts later, as a reuse does
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        assert process_start_ticks(other.pid) != process_start_ticks(holder.pid)
        assert gpu.memory_info().used == 5 * 2**30
        # the holder is in its turn, as it writes it (busy since now, its pid and start time)
        account = [1.5, time.monotonic(), holder.pid, process_start_ticks(holder.pid) & 0xFFFFFFFF, 1]
        gpu.area.write(emu_gpus.ACCOUNT.pack(*account))
        holder.kill()
        holder.wait(timeout=30)
        assert gpu.memory_info().used == 0
        table = bytearray(gpu.memory_area.read())
        entry = list(emu_gpus.MEMORY_ENTRY.unpack_from(table, 0))
        assert entry[0] == holder.pid
        entry[0] = other.pid  # the killed job's pid now names a live process
        emu_gpus.MEMORY_ENTRY.pack_into(table, 0, *entry)
        gpu.memory_area.write(bytes(table))
        account[2] = other.pid
        gpu.area.write(emu_gpus.ACCOUNT.pack(*account))
        assert gpu.memory_info().used == 0  # not the dead job's 5 GiB
        gpu.reserve(1, 6 * 2**30)  # fits: the GPU is idle
        now = time.monotonic()
        assert gpu.busy_seconds(now) == pytest.approx(account[0])  # no open turn of a dead job
    finally:
        for process in (holder, other):
            if process is not None:
                process.kill()
                process.wait(timeout=30)
        gpu.close()


@pytest.mark.timeout(120)
def test_a_source_or_job_refused_at_one_gpu_leaves_none_of_the_gpus_it_opened_before_it(emu):
    """A memory size refused at emulated GPU 1 (another process uses it with another size) used to
    leave GPU 0, opened (and created) just before, in /dev/shm with its lock files open: the
    manager exited 2 ('drbalance-manager --source emulated:2' beside a job of 16 GiB GPUs on
    GPU 1 only, as a train_ddp rank with --gpus 1) and nothing removed it."""
    segment = f"/dev/shm/{emu.emulated_gpu(0).lstrip('/')}"
    holder = python_process("tests.helpers.emu_memory_holder", "1", "1000", str(16 * 2**30))
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert not os.path.exists(segment)
        files = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ValueError, match=r"emulated GPU 1 .* 16\.00 GiB .* 24\.00 GiB"):
            EmulatedSource(emu, [0, 1])  # the default size, 24 GiB
        assert not os.path.exists(segment)  # GPU 0, which it created, is removed again
        with pytest.raises(ValueError, match=r"emulated GPU 1 .* 16\.00 GiB .* 24\.00 GiB"):
            assert not EmulatedBackend(2, None).gpus  # a job's backend opens its GPUs on first use
        assert not os.path.exists(segment)
        assert len(os.listdir("/proc/self/fd")) == files  # no lock file of GPU 0 left open
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_an_emulated_gpu_memory_size_of_hundreds_of_digits_is_refused_in_plain_words():
    """A size past a float's range (309 digits or more) is a one-line ValueError, as any other size
    beyond 1 PiB is, from 'drbalance-manager --source emulated:2:999...' and the training scripts,
    not an 'OverflowError: cannot convert float infinity to integer' traceback."""
    for text in ("9" * 400, "9" * 400 + "GiB", "1" + "0" * 320 + ".5MiB"):
        with pytest.raises(ValueError, match=r"at most 1 PiB"):
            emulated_spec(f"2:{text}")
    assert emulated_spec("2:0.5GiB").memory_bytes == 2**29  # fractions of a unit still taken


@pytest.mark.timeout(180)
def test_ctrl_c_during_the_device_phase_stops_the_job_without_serving_its_chunks_to_the_end(emu):
    """Ctrl-C (or SIGTERM's exit) in a forward stops the replicas' threads too: serving their
    chunks' whole device time first would hold the job's exit up (minutes at a large time scale)."""
    _interrupt_in_the_device_phase(emu, lambda job: job.send_signal(signal.SIGINT))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_handled_by_another_thread_of_the_job_still_stops_it_in_the_device_phase(emu):
    """A SIGINT whose handler runs in another of the job's threads (Linux gives a process's signal
    to any thread that does not block it, and one that arrives while the main thread is on its way
    into the wait is as late) only marks KeyboardInterrupt pending: a main thread waiting for its
    chunks in an untimed ``future.result()`` would sleep on until they ended (1000 s here). Here
    the signal goes to one of the job's other threads (kill(2) on a thread id prefers that thread)."""
    def to_another_thread(job: subprocess.Popen) -> None:
        others = sorted(int(tid) for tid in os.listdir(f"/proc/{job.pid}/task") if int(tid) != job.pid)
        assert others  # the replicas' threads at least
        os.kill(others[-1], signal.SIGINT)  # the thread of the last chunk submitted (GPU 1)

    _interrupt_in_the_device_phase(emu, to_another_thread)


def _sigint_by_default() -> None:
    """In a child before it runs Python: SIGINT at its default action, whatever the parent had."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_in_the_device_phase(emu, interrupt) -> None:
    """Start a job whose chunks each hold an emulated GPU for 1000 s, ``interrupt(job)`` once its
    chunk occupies GPU 1, and check that it exits with KeyboardInterrupt within 60 s, its turn
    ended and accounted and the GPU free.

    The job starts with SIGINT at its default action, as a job started from a terminal does: a
    process inherits an ignored SIGINT (a background job of a non-interactive shell has it, and so
    does every process such a job starts: pytest and its children), and Python then installs no
    KeyboardInterrupt handler at all, so without this the Ctrl-C tests would hang when the suite
    runs in the background and pass only in the foreground."""
    job = python_process("tests.helpers.emu_long_chunk", "1000", env={"DRBALANCE_NO_MANAGER": "1"},
                         preexec_fn=_sigint_by_default)
    gpu = EmulatedGpu(emu, 1)
    try:
        assert job.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        while gpu.read() is None or gpu.read().busy_since == 0:  # the job's chunk occupies emulated GPU 1
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        interrupt(job)
        _out, err = job.communicate(timeout=60)  # not the 1000 s of its chunks
        assert job.returncode != 0 and "KeyboardInterrupt" in err
        assert gpu.read().busy_since == 0.0  # its turn ended and was accounted
        assert gpu.occupy(0.05) < 1.0  # nobody holds the GPU any more
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)
        gpu.close()


def _signal_a_training_job(app: str, signum: int, tmp_path, while_training=lambda: None,
                           **popen) -> tuple[subprocess.Popen, str, str]:
    """Start train.py on one emulated GPU without a manager; once it trains (its SD log has a
    report) call ``while_training()`` and send ``signum``; return the ended process, its stderr
    and its SD log's text."""
    job = python_process("drbalance.runs.train", "--model", "alexnet", "--devices", "emulated:1", "--solo-time", "auto",
                         "--time-scale", "10", "--epochs", "1", "--iterations", "400", "--image-size", "64",
                         "--report-every", "1", "--no-progress", "--app", app,
                         env={"DRBALANCE_NO_MANAGER": "1"}, **popen)
    log = tmp_path / "logs" / f"{app}.sd.jsonl"
    try:
        wait_for(lambda: log.exists() and '"report"' in log.read_text(), timeout=180)  # training
        while_training()
        job.send_signal(signum)
        _out, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    return job, err, log.read_text()


def _emulated_gpus_left(emu) -> list[str]:
    return [entry for entry in os.listdir("/dev/shm") if f".{emu.namespace}.emu." in entry]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_training_job_stopped_with_sigterm_dies_of_it_and_leaves_no_emulated_gpu(emu, tmp_path):
    """train.py builds its model (and opens its emulated GPU) before its session; the session's
    exit hook, which re-raises SIGTERM, was registered after the GPU's release and ran first (exit
    hooks run last first): the job died of SIGTERM with its GPU left in /dev/shm."""
    def gpu_is_open() -> None:
        assert [entry for entry in os.listdir("/dev/shm") if entry.startswith(emu.emulated_gpu(0).lstrip("/"))]

    job, _err, log = _signal_a_training_job("stopped", signal.SIGTERM, tmp_path, while_training=gpu_is_open)
    assert job.returncode == -signal.SIGTERM  # it still dies of SIGTERM, as without drbalance
    assert '"closed"' in log  # its session closed in normal flow first
    assert not _emulated_gpus_left(emu)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_on_a_training_job_is_one_line_and_leaves_no_emulated_gpu(emu, tmp_path):
    """Ctrl-C is one line and exit status 130, not a torch traceback of some twenty lines."""
    job, err, _log = _signal_a_training_job("interrupted", signal.SIGINT, tmp_path, preexec_fn=_sigint_by_default)
    assert job.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "train.py: interrupted (Ctrl-C)", err
    assert not _emulated_gpus_left(emu)
