"""GPUs named by UUID. A job's DR slots are mapped to the manager's GPUs by UUID, DRs are
translated both ways, and memory (OOM limits, free memory) caps the shares a policy may give."""

import os
import sys
import time
import types

import pytest
import torch
from torch import nn

from drbalance import DataRatio
from drbalance.client import BalancedDataParallel, Session
from drbalance.client.emulated import EmulatedBackend
from drbalance.emu.gpus import EmulatedGpu, EmulatedSource, emulated_uuid, remove_emulated_gpus
from drbalance.ipc.layout import AppState, AppStatus, Notice, NoticeKind, SlotStatus
from drbalance.jsonlog import read_json_lines
from drbalance.manager.daemon import Manager, ManagerSettings
from drbalance.manager.nvml import MemoryInfo, Nvml, normalize_uuid
from drbalance.manager.table import AppEntry, ServerGpus, Unmapped, max_share_for
from drbalance.manager.utilization import NvmlSource, ScriptedSource, UtilizationUnavailable
from drbalance.policy import Decision, PolicyConfig, violations
from drbalance.workload.models import ModelCosts
from tests.conftest import needs_root

pytestmark = pytest.mark.timeout(120)

UUIDS = ("GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000",
         "GPU-cccccccc-0000-0000-0000-000000000000", "GPU-dddddddd-0000-0000-0000-000000000000")
GIB = 2**30


def status(ratio, slots=(), batch=0):
    ratio = ratio if isinstance(ratio, DataRatio) else DataRatio(ratio)
    return AppStatus(pid=os.getpid(), app="job", state=AppState.RUNNING, ratio=ratio, epoch=0, epochs=1,
                     iteration=3, iterations_total=10, iterations_per_epoch=10, notice_seq=1, slowdown=1.5,
                     iteration_time=0.2, solo_time=10.0, start_wall=0.0, updated_wall=0.0, updated_mono=0.0,
                     batch=batch, slots=tuple(slots))


def entry(ratio, slots=(), batch=0):
    return AppEntry("job", channel=None, status=status(ratio, slots, batch), added_mono=0.0)


def test_slots_map_to_the_servers_gpus_by_uuid_whatever_the_numbering():
    server = ServerGpus(4, UUIDS)
    # CUDA_VISIBLE_DEVICES=3,1 (or Slurm): the job's slot 0 is the server's GPU 3, slot 1 is GPU 1
    job = entry([7, 3], [SlotStatus(UUIDS[3], 0.4, 14.0), SlotStatus(UUIDS[1].upper(), 0.2, 6.0)])
    view = job.view(10, server)
    assert view.ratio == DataRatio([0, 3, 0, 7]) and view.allowed == (1, 3)
    assert view.chunk_seconds == (None, 0.2, None, 0.4) and view.chunk_samples == (0.0, 6.0, 0.0, 14.0)
    assert job.to_app_ratio(DataRatio([0, 6, 0, 4]), server) == DataRatio([4, 6])  # back in slot order
    with pytest.raises(ValueError, match="puts shares on GPUs that app 'job' has no device on"):
        job.to_app_ratio(DataRatio([5, 5, 0, 0]), server)
    config = PolicyConfig(4)
    assert violations(view, DataRatio([0, 0, 0, 10]), config) == []
    assert "cannot use" in violations(view, DataRatio([10, 0, 0, 0]), config)[0]


def test_torch_style_uuids_match_nvml_ones_and_unknown_devices_are_handled():
    assert normalize_uuid("cccccccc-0000-0000-0000-000000000000") == UUIDS[2].lower()
    assert normalize_uuid(b"GPU-ABC") == "gpu-abc" and normalize_uuid("MIG-x") == "mig-x"
    assert normalize_uuid(None) == normalize_uuid("") == ""
    server = ServerGpus(4, UUIDS)
    bare = entry([5, 5], [SlotStatus(UUIDS[2][4:]), SlotStatus(UUIDS[0][4:])])
    assert bare.view(10, server).ratio == DataRatio([5, 0, 5, 0])
    stranger = "GPU-eeeeeeee-0000-0000-0000-000000000000"
    # a device the manager does not see, with no share: the job is steered among the rest
    partial = entry([10, 0], [SlotStatus(UUIDS[1]), SlotStatus(stranger)])
    view = partial.view(10, server)
    assert view.ratio == DataRatio([0, 10, 0, 0]) and view.allowed == (1,)
    with pytest.raises(Unmapped, match=r"does not see: slot 1 \(gpu-eeeeeeee"):
        entry([5, 5], [SlotStatus(UUIDS[1]), SlotStatus(stranger)]).view(10, server)
    with pytest.raises(Unmapped, match="one GPU for two of its slots"):
        entry([5, 5], [SlotStatus(UUIDS[1]), SlotStatus(UUIDS[1])]).view(10, server)
    # no UUIDs anywhere: slot g is GPU g when the counts agree
    assert entry([1, 2, 3, 4]).view(10, ServerGpus(4)).ratio == DataRatio([1, 2, 3, 4])
    assert entry([1, 2, 3, 4]).view(10, server).allowed is None
    with pytest.raises(Unmapped, match="2 GPU slots without UUIDs; the manager has 4"):
        entry([5, 5]).view(10, server)


def test_memory_caps_come_from_oom_limits_and_free_memory():
    mb = 10**6
    server = ServerGpus(4, UUIDS, (MemoryInfo(24 * GIB, 0, 24 * GIB), MemoryInfo(16 * GIB, 15 * GIB, 1000 * mb),
                                   None, MemoryInfo(24 * GIB, 24 * GIB, 0)))
    slots = [SlotStatus(UUIDS[0], memory_per_sample=100 * mb, max_samples=10),  # OOM at more than 10
             SlotStatus(UUIDS[1], memory_per_sample=100 * mb),
             SlotStatus(UUIDS[2]),  # nothing known
             SlotStatus(UUIDS[3])]  # no replica yet: the largest known bytes/sample stands in
    view = entry([2, 3, 5, 0], slots, batch=40).view(10, server)
    # GPU 0: 10 samples of 40 -> 2.5 tenths -> 2; GPU 1: its 12 samples + 0.9 x 1000 MB / 100 MB = 21 -> 5;
    # GPU 2: no cap; GPU 3: no free memory and no replica -> 0
    assert view.max_share == (2, 5, None, 0)
    assert violations(view, DataRatio([2, 3, 5, 0]), PolicyConfig(4)) == []
    assert "exceeds its memory cap 2" in violations(view, DataRatio([3, 2, 5, 0]), PolicyConfig(4))[0]
    assert max_share_for(10, 40, 10) == 2 and max_share_for(10, 40, 100) == 25 and max_share_for(99, 10, 10) == 10
    assert max_share_for(2, 8, 10, keeps=3) == 3  # rounding never caps a share the app already holds within the limit
    assert entry([2, 3, 5, 0], slots, batch=0).view(10, server).max_share is None  # batch unknown: no caps


def test_a_held_share_rescaled_to_the_managers_total_is_kept_only_if_its_chunk_still_fits():
    # a job on its own total 7: [2, 5]/7 of 70 samples, slot 0 out of memory above 20 samples; the manager
    # counts in twentieths, where the held 2/7 rounds up to 6/20 = 21 samples: more than the limit
    server = ServerGpus(2, UUIDS[:2])
    slots = [SlotStatus(UUIDS[0], 0.1, 20.0, None, 20), SlotStatus(UUIDS[1], 0.1, 50.0)]
    view = entry(DataRatio([2, 5], 7), slots, batch=70).view(20, server)
    assert view.max_share[0] == 5  # floor(20 x 20 / 70): 20 samples at most
    assert violations(view, DataRatio([6, 14], 20), PolicyConfig(2, 20))  # 21 samples on slot 0: refused
    assert DataRatio([5, 15], 20).split(70)[0] <= 20 and not violations(view, DataRatio([5, 15], 20),
                                                                          PolicyConfig(2, 20))


def test_slots_with_and_without_uuids_are_mapped_by_uuid_never_by_position():
    # a DDP job with a CPU rank (no UUID) among GPU ranks started with CUDA_VISIBLE_DEVICES=3,2,_,0
    server = ServerGpus(4, UUIDS)
    job = entry([0, 10, 0, 0], [SlotStatus(UUIDS[3]), SlotStatus(UUIDS[2]), SlotStatus(""), SlotStatus(UUIDS[0])])
    view = job.view(10, server)
    assert view.ratio == DataRatio([0, 0, 10, 0]) and view.allowed == (0, 2, 3)  # slot 1 is server GPU 2
    assert job.to_app_ratio(DataRatio([0, 0, 0, 10]), server) == DataRatio([10, 0, 0, 0])  # GPU 3 is slot 0
    with pytest.raises(Unmapped, match="does not see: slot 2"):
        entry([5, 0, 5, 0], [SlotStatus(UUIDS[3]), SlotStatus(UUIDS[2]), SlotStatus(""),
                             SlotStatus(UUIDS[0])]).view(10, server)  # a share on the slot without a GPU


def test_a_tiny_memory_per_sample_caps_nothing_instead_of_overflowing():
    # a record that passes validation (finite, positive) must not raise OverflowError while the
    # manager builds the snapshot for every decision: no job would get an answer while it stood
    server = ServerGpus(2, UUIDS[:2], (MemoryInfo(16 * GIB, 8 * GIB, 8 * GIB), MemoryInfo(16 * GIB, 8 * GIB, 8 * GIB)))
    slots = [SlotStatus(UUIDS[0], memory_per_sample=1e-300), SlotStatus(UUIDS[1], memory_per_sample=1e-300)]
    view = entry([5, 5], slots, batch=32).view(10, server)
    assert view.max_share == (10, 10)  # the whole batch fits on either GPU


class ToOneGpu:
    """A test policy that ignores every constraint: the whole batch on one fixed server GPU."""

    name = "to-one"

    def __init__(self, gpu):
        self.gpu = gpu

    def decide(self, app, trigger, snapshot):
        return Decision(app, DataRatio.single(snapshot.config.gpu_count, self.gpu), "to-one")


PROFILE = ModelCosts("tiny", fixed=0.0, per_sample=0.0, dp_overhead=0.0, host_ratio=0.0,
                       memory_fixed=1000, memory_per_sample=100)


@pytest.fixture
def emu(ipc_env):
    yield ipc_env
    remove_emulated_gpus(ipc_env, 4)


def run_decision(names, tmp_path, policy, device_ids, source_gpus=None, memory=24 * GIB, ratio=None, prepare=None,
                 source=None, sample=None):
    """A job on emulated GPUs ``device_ids`` and an in-process manager over real IPC: one decision.
    ``sample(manager)`` replaces the manager's one reading of the GPUs before it.

    Returns the command the job received and the manager's decision log entry.
    """
    if source is None:
        source = EmulatedSource(names, source_gpus if source_gpus is not None else range(4), memory_bytes=memory)
    log = tmp_path / f"m{time.monotonic_ns()}.jsonl"
    manager = Manager(ManagerSettings(namespace=names.namespace, log_path=log), source, policy=policy)
    manager.start()
    backend = EmulatedBackend(4, PROFILE, memory_bytes=memory)
    model = BalancedDataParallel(nn.Linear(4, 2), device_ids=device_ids, ratio=ratio, backend=backend)
    session = Session(model, "mapped", epochs=1, iterations_per_epoch=50, solo_time=1.0, sd_log=False,
                      exchange_timeout=0.0, report_every=1)
    try:
        if prepare is not None:
            prepare(model, session)
        if sample is None:
            manager._sample(0.0)  # read the GPUs' memory now
        else:
            sample(manager)
        session.link.publish(session._status(session.clock.monotonic()))
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), 99, "mapped", 0.0))
        command = session.link.poll_command(99)
    finally:
        session.close()
        manager.stop()
        backend.close()
    decision = [e for e in read_json_lines(log) if e["event"] == "decision"][-1]
    return command, decision


def test_the_manager_steers_a_job_by_its_own_gpus_and_answers_in_its_slot_order(emu, tmp_path):
    # the job runs on emulated GPUs 2 and 3 as its slots 0 and 1; the policy moves everything to GPU 3
    command, decision = run_decision(emu, tmp_path, ToOneGpu(3), device_ids=[2, 3])
    assert command.ratio == DataRatio([0, 10]) and command.branch == "to-one"
    # the server's order, at the manager's DR total (the job's own [1, 1]/2 is [5, 5]/10 there)
    assert decision["old_dr"] == [0, 0, 5, 5] and decision["new_dr"] == [0, 0, 0, 10]
    assert decision["details"]["app_dr"] == [0, 10]
    # a DR on a GPU the job has no device on is never sent: the daemon keeps the job's DR, as it has it
    command, decision = run_decision(emu, tmp_path, ToOneGpu(0), device_ids=[2, 3])
    assert command.ratio == DataRatio([1, 1], total=2) and command.branch == "policy-error"
    assert "which the app cannot use" in decision["details"]["error"]
    # a manager that sees only GPUs 0 and 1 leaves a job on GPUs 2 and 3 alone
    command, decision = run_decision(emu, tmp_path, ToOneGpu(1), device_ids=[2, 3], source_gpus=[0, 1])
    assert command.ratio == DataRatio([1, 1], total=2) and command.branch == "unmapped"
    assert "does not see" in decision["details"]["error"]


def test_a_job_given_gpus_2_and_3_by_cuda_visible_devices_is_steered_on_the_servers_gpus_2_and_3(
        emu, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    backend = EmulatedBackend(4, PROFILE)
    assert backend.gpu_count == 2 and backend.device_uuids([0, 1]) == (emulated_uuid(emu, 2), emulated_uuid(emu, 3))
    backend.close()
    # the job's devices 0 and 1 are the user's emulated GPUs 2 and 3: the manager maps them by UUID
    command, decision = run_decision(emu, tmp_path, ToOneGpu(3), device_ids=None)
    assert decision["old_dr"] == [0, 0, 5, 5] and decision["new_dr"] == [0, 0, 0, 10]
    assert command.ratio == DataRatio([0, 10])


@needs_root
def test_a_job_on_the_machines_gpus_2_and_3_is_steered_there_by_uuid(machine, emu, tmp_path, monkeypatch):
    source = EmulatedSource.for_machine(machine, "4:24GiB", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", source.gpu_uuids()[3][:12] + ",2")  # a UUID prefix ends the list
    with pytest.warns(RuntimeWarning, match=r"'2' names none of the machine's 4 emulated GPUs"):
        backend = EmulatedBackend(4, PROFILE)
    assert backend.device_uuids([0]) == source.gpu_uuids()[3:]
    backend.close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    holders = []

    def step_then_look(model, session):
        train(1)(model, session)
        holders.extend(gpu.holders() for gpu in source.gpus)

    command, decision = run_decision(emu, tmp_path, ToOneGpu(3), device_ids=None, source=source,
                                     prepare=step_then_look)
    assert decision["old_dr"] == [0, 0, 5, 5] and command.ratio == DataRatio([0, 10])
    me = {os.getpid()}
    assert holders == [set(), set(), me, me]  # the job's step kept memory on the machine's GPUs 2 and 3 only
    assert emulated_uuid(emu, 2) not in source.gpu_uuids()  # the user's own GPUs are other devices


def test_no_visible_emulated_device_is_one_clear_error_when_the_model_is_wrapped(emu, monkeypatch):
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"^CUDA_VISIBLE_DEVICES='' is empty, so no device is visible \(as CUDA sees "
                       r"none\) among this user's 4 emulated GPUs"):
        BalancedDataParallel(nn.Linear(4, 2))


def train(steps, move_to=None):
    """Train 12-sample batches; before the last step, move the whole batch to slot ``move_to``."""

    def prepare(model, session):
        for step in range(steps):
            if move_to is not None and step == steps - 1:
                model.set_ratio(DataRatio.single(2, move_to))
            model.train_step(lambda: model(torch.randn(12, 4)).sum().backward())
            session.step()

    return prepare


def test_the_manager_never_gives_a_job_more_than_fits_in_memory(emu, tmp_path):
    # plenty of memory: moving the whole batch to GPU 1 is fine
    command, _ = run_decision(emu, tmp_path, ToOneGpu(1), device_ids=[0, 1], ratio=[5, 5], prepare=train(3))
    assert command.ratio == DataRatio([0, 10])
    # 2000-byte GPUs: 6 samples per GPU fit (1600 bytes at the backward's peak), 12 on one do not
    # (2200); the job tried, ran out of memory, reverted, and reported 6 as its limit on slot 1
    command, decision = run_decision(emu, tmp_path, ToOneGpu(1), device_ids=[0, 1], ratio=[5, 5], memory=2000,
                                     prepare=train(3, move_to=1))
    assert command.ratio == DataRatio([5, 5]) and command.branch == "policy-error"  # never the [0, 10] that failed
    assert "exceeds its memory cap 5" in decision["details"]["error"]  # 6 of 12 samples: 5 tenths fit
    # free memory alone caps too: the job never failed, but GPU 1 has no room for 12 samples
    command, decision = run_decision(emu, tmp_path, ToOneGpu(1), device_ids=[0, 1], ratio=[5, 5], memory=2000,
                                     prepare=train(3))
    assert command.branch == "policy-error" and "memory cap" in decision["details"]["error"]


def test_emulated_sources_report_uuids_and_memory_like_nvml(emu):
    gpu = EmulatedGpu(emu, 2, memory_bytes=5000)
    gpu.reserve(1, 1200)
    source = EmulatedSource(emu, [0, 2], memory_bytes=5000)
    assert source.gpu_uuids() == (emulated_uuid(emu, 0), emulated_uuid(emu, 2))
    assert source.gpu_uuids()[1] == gpu.uuid and gpu.uuid.startswith("GPU-") and len(gpu.uuid) == 40
    assert source.memory() == (MemoryInfo(5000, 0, 5000), MemoryInfo(5000, 1200, 3800))
    gpu.reserve(1, 0)
    gpu.close()
    source.close()


def test_scripted_sources_can_carry_uuids_and_free_memory(tmp_path):
    path = tmp_path / "util.json"
    path.write_text('{"gpus": 2, "uuids": ["GPU-a", null], "memory_total": [1000, null], '
                    '"steps": [{"at": 0, "util": [10, 20], "free": [400, null]}]}')
    source = ScriptedSource(path)
    assert source.gpu_uuids() == ("GPU-a", None)
    assert source.memory() == (MemoryInfo(1000, 600, 400), None)
    path.write_text('{"gpus": 2, "uuids": ["GPU-a"], "steps": [{"at": 0, "util": [10, 20]}]}')
    with pytest.raises(UtilizationUnavailable, match="'uuids' must be a list of 2"):
        ScriptedSource(path)


class StandInNvml(types.ModuleType):
    """An NVML stand-in with the real nvidia-ml-py function names, to exercise our adapter only."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        super().__init__("pynvml")
        self.memory = types.SimpleNamespace(total=8 * GIB, used=GIB, free=7 * GIB)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return b"GPU-1234"  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self.memory


def test_nvml_uuids_and_memory_go_through_the_one_nvml_function(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", StandInNvml())
    source = NvmlSource(nvml=Nvml())
    assert source.gpu_uuids() == ("GPU-1234", None)  # an NVML error is "unknown", not a crash
    assert source.memory() == (MemoryInfo(8 * GIB, GIB, 7 * GIB), MemoryInfo(8 * GIB, GIB, 7 * GIB))
    source.close()


@pytest.mark.timeout(60)
def test_a_gpu_nvml_counts_but_cannot_open_is_a_clear_error_not_a_traceback(ipc_env, monkeypatch, caplog):
    """nvmlDeviceGetHandleByIndex fails for a GPU that fell off the bus (GPU_IS_LOST) or whose device
    node this user may not open (NO_PERMISSION): the real nvidia-ml-py exception types, raised from
    the real module's functions (no driver here), must end in UtilizationUnavailable and exit 2."""
    import pynvml
    shutdowns = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)

    def handle_by_index(index: int) -> int:
        if index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return index

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle_by_index)
    with pytest.raises(UtilizationUnavailable, match="GPU 1: NVML nvmlDeviceGetHandleByIndex failed: GPU is lost"):
        NvmlSource(nvml=Nvml())
    assert shutdowns == [True]  # the NVML session is not left open
    assert NvmlSource([0], nvml=Nvml()).gpu_count() == 1  # --gpus can leave the lost one out
    from drbalance.manager.cli import main as manager_main

    assert manager_main(["--source", "nvml", "--duration", "0.1"]) == 2
    assert "GPU is lost" in caplog.text and "--gpus" in caplog.text


@pytest.mark.timeout(60)
def test_a_gpu_uuid_unknown_at_start_up_is_read_again_while_the_manager_runs(ipc_env, tmp_path):
    """A GPU whose UUID failed to read at start-up (None) is read again: read only once, it would
    leave every job on it unmapped (its DR kept) for the manager's whole life."""
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 2, "uuids": [null, "GPU-b"], "steps": [{"at": 0, "util": [10, 20]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script))
    manager.start()
    try:
        assert manager.server.uuids == (None, "GPU-b")
        script.write_text('{"gpus": 2, "uuids": ["GPU-a", "GPU-b"], "steps": [{"at": 0, "util": [10, 20]}]} ')
        now = time.monotonic()
        manager._sample(now)
        assert manager.server.uuids == ("GPU-a", "GPU-b")  # read again now that one is known
        assert sorted(manager.server.index().values()) == [0, 1]  # jobs on either GPU are mapped
        script.write_text('{"gpus": 2, "uuids": [null, null], "steps": [{"at": 0, "util": [10, 20]}]}  ')
        manager._sample(now + 60)
        assert manager.server.uuids == ("GPU-a", "GPU-b")  # all known: never read again, never lost
    finally:
        manager.stop()
    events = [e for e in read_json_lines(tmp_path / "m.jsonl") if e["event"] == "gpu_uuids"]
    assert [e["uuids"] for e in events] == [["GPU-a", "GPU-b"]]


def test_memory_caps_are_for_the_full_batch_after_a_records_short_last_batch():
    """At an epoch's end the record names the short last batch (8 of 32): caps computed from it
    allowed four times the share that fits, and the next full batch ran out of memory."""
    mb = 10**6
    server = ServerGpus(2, UUIDS[:2], (MemoryInfo(24 * GIB, 23 * GIB, 1000 * mb), MemoryInfo(24 * GIB, 0, 24 * GIB)))
    slots = [SlotStatus(UUIDS[0], memory_per_sample=100 * mb), SlotStatus(UUIDS[1], memory_per_sample=100 * mb)]
    job = entry([0, 10], slots, batch=32)
    full = job.view(10, server).max_share  # GPU 0: 0.9 x 1000 MB / 100 MB = 9 samples of 32 -> 2 tenths
    job.status = status([0, 10], slots, batch=8)  # the epoch's last, short batch
    job.note_batch()
    assert job.view(10, server).max_share == full == (2, 10)


class FlakyMemorySource(EmulatedSource):
    """Emulated GPUs whose memory reading of GPU 1 fails while ``failing`` is set: ``None``, what
    ``NvmlSource.memory`` gives when ``nvmlDeviceGetMemoryInfo`` raises an NVMLError."""

    failing = False

    def memory(self):
        readings = list(super().memory())
        if self.failing:
            readings[1] = None
        return tuple(readings)


def test_one_failed_memory_reading_does_not_lift_the_free_memory_cap(emu, tmp_path):
    """A memory reading that fails once (an NVML error on one call of many) keeps the GPU's last
    free-memory cap: with no cap until the next sample, a decision could send a job more than fits."""
    source = FlakyMemorySource(emu, range(4), memory_bytes=2000)

    def sample(manager):
        now = time.monotonic()
        manager._sample(now)  # GPU 1's memory is known: 12 samples there do not fit
        source.failing = True
        manager._sample(now + 0.5)  # the next reading of GPU 1 fails

    command, decision = run_decision(emu, tmp_path, ToOneGpu(1), [0, 1], memory=2000, ratio=[5, 5],
                                     prepare=train(3), source=source, sample=sample)
    assert command.ratio == DataRatio([5, 5]), decision  # never the whole batch on GPU 1
    assert command.branch == "policy-error" and "memory cap" in decision["details"]["error"]


def test_the_status_file_shows_each_dr_on_the_servers_gpus(emu, tmp_path):
    """The status file gives each app's DR by the manager's GPU index, as the manager log and the
    metrics do (docs/operations.md), not in the app's own slot order: a job on GPUs 2 and 3 (its
    slots 0 and 1) would show "1 1" under a four-GPU table, read as GPUs 0 and 1."""
    from drbalance.manager.status import format_table, read_status

    source = EmulatedSource(emu, range(4), memory_bytes=24 * GIB)
    manager = Manager(ManagerSettings(namespace=emu.namespace, log_path=tmp_path / "m.jsonl"), source,
                      policy=ToOneGpu(3))
    manager.start()
    backend = EmulatedBackend(4, PROFILE, memory_bytes=24 * GIB)
    model = BalancedDataParallel(nn.Linear(4, 2), device_ids=[3, 2], ratio=DataRatio([3, 1], 4), backend=backend)
    session = Session(model, "mapped", epochs=1, iterations_per_epoch=50, solo_time=1.0, sd_log=False,
                      exchange_timeout=0.0, report_every=1)
    try:
        manager._sample(time.monotonic())
        session.link.publish(session._status(session.clock.monotonic()))
        manager._rescan(time.monotonic())  # adopted as after a manager restart: its own DR
        manager._write_status(time.monotonic())
        before = read_status(emu)
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), 2, "mapped", 0.0))
        manager._write_status(time.monotonic())
        after = read_status(emu)
    finally:
        session.close()
        manager.stop()
        backend.close()
    assert [app["dr"] for app in before["apps"]] == [[0, 0, 1, 3]]  # slot 0 is GPU 3
    assert [app["dr"] for app in after["apps"]] == [[0, 0, 0, 10]]  # the DR sent ([10, 0]), on GPU 3
    assert "[0, 0, 0, 10]" in format_table(after)


def test_a_dr_sent_for_another_number_of_gpus_is_not_taken_for_the_apps():
    """A job whose record changed its GPU count before it published a newer status: the DR sent
    for the old count stood as its DR, and mapping it over the new slots failed for every app."""
    job = entry([2, 3, 5, 0], [SlotStatus(uuid) for uuid in UUIDS], batch=40)
    job.assigned, job.assigned_mono = DataRatio([0, 0, 0, 10]), 1.0  # sent after the status (updated at 0.0)
    assert job.effective_ratio() == DataRatio([0, 0, 0, 10])
    job.status = status([5, 5], [SlotStatus(UUIDS[0]), SlotStatus(UUIDS[1])], batch=40)  # two slots now
    assert job.effective_ratio() == DataRatio([5, 5])
    assert job.view(10, ServerGpus(4, UUIDS)).ratio == DataRatio([5, 5, 0, 0])
