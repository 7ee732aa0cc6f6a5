"""The machine's emulated GPUs: made by the system manager, shared by every user's jobs, trusted only
as the system owner's.

A system dir is trusted only where root owns every folder on the way (``drbalance.ipc.system``),
so these tests make one in a root-owned folder under /tmp and run as root, as CI does. Tests that
act as a second user (a forked child that drops to its uid) are marked ``second_user``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path

import posix_ipc
import pytest

from drbalance.emu.gpus import EmulatedGpu, EmulatedOutOfMemory, EmulatedSource, release_emulated_gpus
from drbalance.emu.home import emulated_uuid
from drbalance.emu.machine import MachineGpuMissing, MachineHome
from drbalance.emu.view import emulated_view, open_view
from drbalance.ipc import system
from drbalance.ipc.objects import SHM_DIR, ForeignObject
from drbalance.ipc.private import UnsafePath
from tests.conftest import needs_root, wait_for
from tests.helpers.as_user import UserProcess
from tests.helpers.neighbour import as_neighbour, needs_second_user, second_user

GIB = 2**30

pytestmark = [needs_root, pytest.mark.timeout(120)]


def machine_segments(place: system.SystemPlace) -> list[str]:
    return sorted(entry for entry in os.listdir(SHM_DIR) if entry.startswith(place.shm_prefix()[1:]))


def mode_and_owner(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return stat.S_IMODE(info.st_mode), info.st_uid


def job_gpus(count: int = 2, memory: int = GIB) -> list[EmulatedGpu]:
    """What a job opens: the emulated GPUs its view shows (the machine's, here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a spec other than the machine's: said, then ignored
        return open_view(emulated_view(count, memory))


# --- the system manager's side ---------------------------------------------------------------------
def test_the_system_manager_makes_the_machines_gpus_and_removes_them_when_no_job_uses_them(machine):
    source = EmulatedSource.for_machine(machine, "3:1GiB", None)
    spec = MachineHome.open(machine)
    spec.close()
    assert source.gpu_uuids() == spec.spec.uuids and len(set(spec.spec.uuids)) == 3
    assert (spec.spec.count, spec.spec.memory_bytes) == (3, GIB)
    assert mode_and_owner(machine.emulated) == (0o644, 0)
    for index in range(3):
        assert mode_and_owner(machine.emulated_lock(index)) == (0o666, 0)  # lockf needs it writable
        assert mode_and_owner(machine.emulated_wait_lock(index)) == (0o644, 0)  # flock needs it open
    segments = machine_segments(machine)
    assert len(segments) == 3 and all(mode_and_owner(SHM_DIR / entry) == (0o666, 0) for entry in segments)
    assert [memory.total for memory in source.memory()] == [GIB] * 3
    source.close()
    assert source.left_in_use == {}
    assert os.listdir(machine.folder) == [] and machine_segments(machine) == []


def test_gpus_a_job_still_uses_are_left_and_adopted_by_the_next_system_manager(machine):
    first = EmulatedSource.for_machine(machine, "2:1GiB", None)
    gpus = job_gpus()
    first.close()
    assert set(first.left_in_use) == {0, 1} and first.left_in_use[0] == [os.getpid()]
    assert machine.emulated.exists() and len(machine_segments(machine)) == 2
    with pytest.raises(ValueError, match=r"jobs use the 2 emulated GPUs of 1.00 GiB .* asks for 3 of 1.00 GiB"):
        EmulatedSource.for_machine(machine, "3:1GiB", None)
    second = EmulatedSource.for_machine(machine, "2:1GiB", [1])
    assert second.gpu_uuids() == (gpus[1].uuid,)
    gpus[1].occupy(0.01)
    assert second.gpus[0].read().acquisitions == 1  # the job's GPU 1 is the one the new manager reads
    release_emulated_gpus(gpus)
    second.close()
    assert second.left_in_use == {} and machine_segments(machine) == [] and os.listdir(machine.folder) == []


def test_a_system_manager_not_the_folders_owner_is_refused(machine):
    foreign = system.SystemPlace(machine.root, machine.namespace, owner=12345)
    with pytest.raises(UnsafePath, match="only the system owner makes the machine's emulated GPUs"):
        EmulatedSource.for_machine(foreign, "2", None)
    assert os.listdir(machine.folder) == []


def test_two_nodes_with_two_system_dirs_on_one_machine_have_different_gpus(machine, monkeypatch):
    first = EmulatedSource.for_machine(machine, "2:1GiB", None)
    other_root = Path(tempfile.mkdtemp(prefix="drbalance-system-"))
    try:
        os.chmod(other_root, 0o755)
        monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(other_root / "system"))
        second = EmulatedSource.for_machine(system.create(machine.namespace), "2:1GiB", None)
        assert not set(first.gpu_uuids()) & set(second.gpu_uuids())
        assert emulated_view(2, GIB).uuids == second.gpu_uuids()  # a job finds its own node's GPUs
        assert {gpu.segment.name for gpu in first.gpus}.isdisjoint(gpu.segment.name for gpu in second.gpus)
        second.close()
    finally:
        shutil.rmtree(other_root, ignore_errors=True)
    monkeypatch.setenv("DRBALANCE_SYSTEM_DIR", str(machine.root))
    assert emulated_view(2, GIB).uuids == first.gpu_uuids()
    first.close()


# --- a job's view ----------------------------------------------------------------------------------
def test_jobs_use_the_machines_gpus_whose_count_and_memory_win_with_a_warning(machine, ipc_env):
    source = EmulatedSource.for_machine(machine, "3:1GiB", None)
    with pytest.warns(RuntimeWarning, match=r"system manager emulates 3 GPUs of 1.00 GiB .* not the 4 of 24.00 GiB"):
        view = emulated_view(4, 24 * GIB)
    assert (view.place, view.count, view.memory_bytes, view.uuids) == (machine, 3, GIB, source.gpu_uuids())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the machine's own spec: no warning
        assert emulated_view(3, GIB).uuids == source.gpu_uuids()
    gpus = open_view(view)
    gpus[2].reserve(token=1, nbytes=1000)
    assert source.memory()[2].used == 1000 and source.gpus[2].holders() == {os.getpid()}
    assert not os.path.exists(ipc_env.runtime_dir())  # nothing of this user's own
    release_emulated_gpus(gpus)
    source.close()


def test_cuda_visible_devices_2_3_gives_two_devices_with_the_machines_gpu_2_and_3_uuids(machine, monkeypatch):
    source = EmulatedSource.for_machine(machine, "4:1GiB", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    view = emulated_view(4, GIB)
    assert (view.count, view.indices, view.uuids) == (2, (2, 3), source.gpu_uuids()[2:])
    gpus = open_view(view)
    assert [gpu.index for gpu in gpus] == [2, 3]
    gpus[0].occupy(0.01)
    assert [gpu.read().acquisitions if gpu.read() else 0 for gpu in source.gpus] == [0, 0, 1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", source.gpu_uuids()[3][:13] + "," + source.gpu_uuids()[0])
    assert emulated_view(4, GIB).indices == (3, 0)
    release_emulated_gpus(gpus)
    source.close()


def test_an_untrusted_system_folder_gives_one_warning_and_the_users_own_gpus(machine, ipc_env):
    EmulatedSource.for_machine(machine, "2:1GiB", None).close()
    os.chmod(machine.folder, 0o777)
    with pytest.warns(RuntimeWarning, match=r"not using this machine's emulated GPUs: .* is writable by group or "
                      r"others \(mode 0777\); this job uses root \(uid 0\)'s own"):
        view = emulated_view(2, GIB)
    assert view.place is None and view.uuids == (emulated_uuid(ipc_env, 0), emulated_uuid(ipc_env, 1))


def test_a_system_folder_without_emulated_gpus_leaves_jobs_on_their_users_own(machine, ipc_env):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        view = emulated_view(2, GIB)
    assert view.place is None and view.uuids[1] == emulated_uuid(ipc_env, 1)


def test_a_job_set_up_on_the_machines_gpus_gone_since_is_a_clear_error(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", None)
    view = emulated_view(2, GIB)
    source.close()
    with pytest.raises(MachineGpuMissing, match=r"emulated.json: is gone: the machine's emulated GPUs this job was set "
                       r"up on were removed"):
        open_view(view)


def test_a_forked_child_such_as_a_data_loader_worker_keeps_no_hold_on_the_machines_gpus(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", None)
    gpus = job_gpus()
    reader, writer = os.pipe()
    started_reader, started_writer = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that outlives its parent's GPUs: it closed its copies when it was forked
        os.close(writer)
        os.write(started_writer, b"s")
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    os.close(started_writer)
    try:
        assert os.read(started_reader, 1) == b"s"  # the child runs: its fork handlers ran
        release_emulated_gpus(gpus)
        source.close()
        assert source.left_in_use == {} and machine_segments(machine) == []
    finally:
        os.close(writer)
        os.close(started_reader)
        os.waitpid(child, 0)


# --- planted look-alikes -------------------------------------------------------------------------
def test_a_planted_lock_file_or_spec_is_refused_with_its_name(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", [0])
    lock = machine.emulated_lock(1)
    os.chown(lock, 65534, 65534)  # as if another user's file stood there
    with pytest.raises(UnsafePath, match=rf"{lock}: belongs to .*uid 65534.*, not to the system manager's"):
        job_gpus()
    os.unlink(lock)
    os.symlink(machine.emulated_lock(0), lock)
    with pytest.raises(UnsafePath, match=rf"{lock}: is a symbolic link: not followed"):
        job_gpus()
    os.unlink(lock)
    with pytest.raises(MachineGpuMissing, match=rf"{lock}: missing"):
        job_gpus()
    spec = machine.emulated.read_bytes()
    os.unlink(machine.emulated)
    os.symlink("/etc/hostname", machine.emulated)
    with pytest.raises(UnsafePath, match="emulated.json: is a symbolic link: not followed"):
        emulated_view(2, GIB)
    os.unlink(machine.emulated)
    machine.emulated.write_bytes(spec.replace(b'"count": 2', b'"count": 40'))
    with pytest.raises(ValueError, match=r"emulated.json: count 40 is not 1..32"):
        emulated_view(2, GIB)
    source.close()


def test_a_missing_or_truncated_segment_is_a_clear_error(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", [0])
    name = source.home.segment_name(1)
    posix_ipc.unlink_shared_memory(name)
    with pytest.raises(MachineGpuMissing, match=rf"/dev/shm{name}: missing: the machine's emulated GPU 1"):
        job_gpus()
    os.symlink("/etc/hostname", SHM_DIR / name[1:])  # a link planted under the name
    with pytest.raises(ForeignObject, match="is a symbolic link in /dev/shm"):
        job_gpus()
    os.unlink(SHM_DIR / name[1:])
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o666, size=64)  # not the layout's size
    segment.close_fd()
    with pytest.raises(MachineGpuMissing, match="not a usable emulated GPU"):
        job_gpus()
    posix_ipc.unlink_shared_memory(name)
    source.close()


@pytest.mark.second_user
@needs_second_user
def test_a_segment_another_user_planted_under_a_machine_gpus_name_is_refused(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", [0])
    name = source.home.segment_name(1)
    posix_ipc.unlink_shared_memory(name)  # gone (a /dev/shm cleared), and a neighbour takes the name
    assert as_neighbour([["shm", name, 0o666]]) == ["ok"]
    with pytest.raises(ForeignObject, match=rf"{name}: belongs to {second_user()[2]} .*, not to root"):
        job_gpus()
    source.close()


# --- two users' jobs on one machine GPU --------------------------------------------------------------
def _queue_for_gpu_0(channel) -> dict:
    """A second user's job: open the machine's GPUs, say their UUIDs, take a turn on GPU 0 (waiting
    while another job holds it), say what it saw, then hold memory on GPU 0 until told to end."""
    gpus = job_gpus()
    channel.send({"uuids": [gpu.uuid for gpu in gpus], "uid": os.getuid()})
    gpus[0].occupy(0.02)
    channel.send({"account": list(vars(gpus[0].read()).values())})
    gpus[0].reserve(token=9, nbytes=5 * 2**20)
    channel.send({"reserved": os.getpid()})
    channel.receive(timeout=60)
    release_emulated_gpus(gpus)
    return "released"


@pytest.mark.second_user
@needs_second_user
def test_a_machine_gpu_opened_by_two_users_is_one_device_they_contend_for(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", None)
    mine = job_gpus()  # root's job
    turn = os.open(machine.emulated_lock(0), os.O_RDONLY | os.O_CLOEXEC)
    waiters = os.open(machine.emulated_wait_lock(0), os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(turn, fcntl.LOCK_EX)  # root's job holds GPU 0's turn
    uid, gid, _ = second_user()
    other = UserProcess(uid, gid, _queue_for_gpu_0)
    try:
        seen = other.receive()
        assert seen["uid"] == uid and seen["uuids"] == [gpu.uuid for gpu in mine] == list(source.gpu_uuids())

        def queued() -> bool:  # the second user's job holds a shared lock on GPU 0's wait file
            try:
                fcntl.flock(waiters, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(waiters, fcntl.LOCK_UN)
            return False

        wait_for(queued)
        assert not other.channel.ready(0.3)  # its turn has not come: root's job holds GPU 0
        assert mine[0].read() is None  # and no turn has been served yet
        fcntl.flock(turn, fcntl.LOCK_UN)  # root's job lets go: the other user's turn comes
        busy, since, holder, acquisitions, _ticks = other.receive()["account"]
        assert acquisitions == 1 and holder == 0 and busy >= 0.02
        assert mine[0].read().acquisitions == 1 and source.gpus[0].busy_seconds(time.monotonic()) >= 0.02
        pid = other.receive()["reserved"]
        assert source.memory()[0].used == 5 * 2**20 and mine[0].holders() == {pid}
        mine[0].reserve(token=1, nbytes=GIB - 5 * 2**20)  # all that the other user's job leaves free
        with pytest.raises(EmulatedOutOfMemory, match="Tried to allocate 1.00 MiB.* of which 0 bytes is free"):
            mine[0].reserve(token=1, nbytes=GIB - 4 * 2**20)
        other.send("end")
        assert other.result() == "released"
    finally:
        other.close()
        os.close(turn)
        os.close(waiters)
    assert source.memory()[0].used == GIB - 5 * 2**20  # the other user's memory went with its job
    release_emulated_gpus(mine)
    source.close()
    assert machine_segments(machine) == []


def _try_to_make_or_remove(channel, place: system.SystemPlace) -> list[str]:
    """A second user's attempts on the machine's GPUs; one result per attempt."""
    results = []
    for attempt in (
        lambda: EmulatedSource.for_machine(place, "2:1GiB", None),
        lambda: MachineHome.create(system.SystemPlace(place.root, place.namespace, os.getuid()), 2, GIB),
        lambda: posix_ipc.unlink_shared_memory(MachineHome.open(place).segment_name(0)),
        lambda: os.unlink(place.emulated_lock(0)),
        lambda: os.unlink(place.emulated),
        lambda: release_emulated_gpus(job_gpus()),
    ):
        try:
            attempt()
            results.append("ok")
        except Exception as error:
            results.append(f"{type(error).__name__}: {error}")
    return results


@pytest.mark.second_user
@needs_second_user
def test_a_job_of_another_user_cannot_make_or_remove_the_machines_gpus(machine):
    source = EmulatedSource.for_machine(machine, "2:1GiB", None)
    before = sorted(os.listdir(machine.folder)), machine_segments(machine)
    uid, gid, who = second_user()
    made, faked, segment, lock, spec, released = UserProcess(uid, gid, _try_to_make_or_remove, machine).result()
    assert made.startswith("UnsafePath") and "only the system owner makes" in made, made
    assert faked.startswith(("UnsafePath", "PermissionError")), faked
    assert segment.startswith("PermissionsError"), segment  # /dev/shm is sticky: only the owner removes a name
    assert lock.startswith("PermissionError") and spec.startswith("PermissionError"), (lock, spec)
    assert released == "ok"  # a job's release closes the machine's GPUs and removes nothing
    assert (sorted(os.listdir(machine.folder)), machine_segments(machine)) == before
    source.close()
    assert machine_segments(machine) == []
