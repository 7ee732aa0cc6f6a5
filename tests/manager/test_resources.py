"""Resources a neighbour can exhaust: /dev/shm and the disk under the SD log.

A full /dev/shm must not kill a job (or the manager) with SIGBUS, as a segment sized with a
sparse ``ftruncate`` and mapped would at the first write to a page tmpfs cannot supply. A full
disk (or a log folder that cannot be made) where the SD log goes must not end the training job
at ``Session()``. Both are errors that are reported and survived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from drbalance.client.session import Session
from drbalance.ipc import discovery, objects
from drbalance.ipc.layout import SegmentKind
from drbalance.ipc.names import new_token
from drbalance.ipc.private import UnsafePath
from drbalance.ipc.records import SEGMENT_SIZE, Segment
from drbalance.jsonlog import JsonLinesWriter, read_json_lines
from tests.conftest import wait_for
from tests.helpers.processes import ManagerProcess, decisions_for, first_line, long_app, stop_all
from tests.helpers.steered import SteeredModel

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def backed_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_new_segment_has_every_page_backed_and_a_repaired_one_too(ipc_env):
    segment = Segment.create(ipc_env.app_record("backed", new_token()), SegmentKind.APP)
    try:
        assert backed_bytes(segment.memory.fd) >= SEGMENT_SIZE  # not sparse: no page left to fault in later
        os.ftruncate(segment.memory.fd, 0)  # a truncation under the creator (a hostile or careless rm)
        assert segment.repair()
        assert os.fstat(segment.memory.fd).st_size == SEGMENT_SIZE
        assert backed_bytes(segment.memory.fd) >= SEGMENT_SIZE
    finally:
        segment.close()
        segment.unlink()


def test_backing_pages_keeps_what_was_written_and_grows_the_file_with_zeros(tmp_path):
    # the repair case (not fresh): whatever the file system, what is there stays
    path = tmp_path / "segment"
    path.write_bytes(b"header")
    fd = os.open(path, os.O_RDWR)
    try:
        objects.back_pages(fd, 8192)
        assert os.fstat(fd).st_size == 8192 and os.pread(fd, 8, 0) == b"header\0\0"
    finally:
        os.close(fd)


FULL_SHM_SCRIPT = r"""
set -e
mount -t tmpfs -o size=64k tmpfs /dev/shm
dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null || true
cd "$ROOT"
"$PY" -c "$JOB" > "$OUT/job.out" 2>&1 && echo "job rc 0" >> "$OUT/job.out" || echo "job rc $?" >> "$OUT/job.out"
"$PY" -m drbalance.manager.cli --source scripted:"$OUT/util.json" --duration 1 > "$OUT/manager.out" 2>&1 \
  && echo "manager rc 0" >> "$OUT/manager.out" || echo "manager rc $?" >> "$OUT/manager.out"
"""

JOB = textwrap.dedent("""
    import time
    from drbalance.client.session import Session
    from tests.helpers.steered import SteeredModel
    session = Session(SteeredModel(), "victim", 1, 100000, solo_time=10.0, sd_log=False, handle_sigterm=False)
    print("link", type(session.link.current).__name__, flush=True)  # the AutoLink's choice
    deadline = time.monotonic() + 12  # its reports look for a manager (and try the objects again) every 5 s
    while time.monotonic() < deadline:
        session.step()
        time.sleep(0.01)
    session.close()
    print("trained")
""")


def private_mounts(covered: str) -> str:
    """The path of ``unshare`` for a private mount namespace (a private /dev/shm); skips, saying
    so and what ``covered`` the case otherwise, where that needs root with CAP_SYS_ADMIN."""
    if os.geteuid() != 0:
        pytest.skip(f"a private /dev/shm needs root with CAP_SYS_ADMIN (unshare -m); {covered}")
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is missing (an install problem, not a reason to skip)"
    if subprocess.run([unshare, "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip(f"a private /dev/shm needs CAP_SYS_ADMIN (unshare -m was refused); {covered}")
    return unshare

def run_with_private_mounts(tmp_path: Path, script: str, job: str, covered: str) -> tuple[str, str]:
    """Run the shell ``script`` in a private mount namespace (``private_mounts``: skips where that
    is not allowed, saying ``covered``) with ``$JOB`` = ``job`` and ``$OUT`` = ``tmp_path`` (which
    holds a scripted utilisation file for 2 GPUs); what ``job.out`` and ``manager.out`` hold."""
    unshare = private_mounts(covered)
    (tmp_path / "util.json").write_text('{"gpus": 2, "steps": [{"at": 0, "util": [50, 50]}]}')
    env = dict(os.environ, ROOT=str(ROOT), PY=sys.executable, JOB=job, OUT=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([unshare, "-m", "sh", "-c", script], env=env, timeout=110, check=True)
    return (tmp_path / "job.out").read_text(), (tmp_path / "manager.out").read_text()


def test_a_full_dev_shm_leaves_jobs_training_and_the_manager_saying_why(ipc_env, tmp_path):
    """In a private mount namespace (root only): /dev/shm is a 64 KiB tmpfs, filled up. The job
    says so in one warning, not again at its later tries (whose error is posix_ipc's, not the
    first one's ENOSPC), nor as "no manager" besides."""
    job, manager = run_with_private_mounts(tmp_path, FULL_SHM_SCRIPT, JOB, "the backed-pages test covers it")
    assert "job rc 0" in job and "link PosixManagerLink" in job and "trained" in job, job
    assert "No space left on device" in job and "tries again at its later reports" in job  # why, and what next
    assert [line for line in job.splitlines() if line.startswith("drbalance:")] == [
        next(line for line in job.splitlines() if "POSIX IPC unavailable" in line)], job  # one warning
    assert "manager rc 1" in manager and "cannot create the manager's inbox queue and heartbeat" in manager, manager
    assert "Traceback" not in job + manager


# /dev/shm where the job's user may not create anything (a tmpfs of mode 0755 owned by root): the
# job imports as root, then a forked child drops to "nobody" and starts its session there.
REFUSED_SHM_SCRIPT = r"""
set -e
mount -t tmpfs -o size=64k,mode=0755 tmpfs /dev/shm
cd "$ROOT"
"$PY" -c "$JOB" > "$OUT/job.out" 2>&1 && echo "job rc 0" >> "$OUT/job.out" || echo "job rc $?" >> "$OUT/job.out"
"""

REFUSED_JOB = textwrap.dedent("""
    import os, sys, traceback
    from drbalance.client.session import Session
    from tests.helpers.neighbour import second_user
    from tests.helpers.steered import SteeredModel
    uid, gid, _ = second_user()
    runtime = os.environ["RUNTIME"]
    os.chown(runtime, uid, gid)
    os.environ["DRBALANCE_RUNTIME_DIR"] = runtime
    os.environ["DRBALANCE_SYSTEM_DIR"] = os.path.join(runtime, "system")  # none: where the job's user may look
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            session = Session(SteeredModel(), "victim", 1, 10, solo_time=10.0, sd_log=False, handle_sigterm=False)
            print("link", type(session.link.current).__name__, flush=True)  # the AutoLink's choice
            for _ in range(10):
                session.step()
            session.close()
            print("trained", flush=True)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_dev_shm_that_refuses_the_jobs_user_leaves_it_training_with_its_own_dr(ipc_env, tmp_path):
    """posix_ipc's PermissionsError is not an OSError: the session let it out of ``Session()``,
    where a missing or full /dev/shm (OSError) already left the job training detached."""
    unshare = private_mounts("the job's own user is root elsewhere")
    runtime = tempfile.mkdtemp(prefix="drbalance-refused-")  # in /tmp: the job's user can reach it
    env = dict(os.environ, ROOT=str(ROOT), PY=sys.executable, JOB=REFUSED_JOB, OUT=str(tmp_path), RUNTIME=runtime,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        subprocess.run([unshare, "-m", "sh", "-c", REFUSED_SHM_SCRIPT], env=env, timeout=100, check=True)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    job = (tmp_path / "job.out").read_text()
    assert "job rc 0" in job and "link PosixManagerLink" in job and "trained" in job, job
    assert "POSIX IPC unavailable" in job and "Traceback" not in job, job


# A manager runs; a neighbour fills /dev/shm while a job starts, and frees it again 2.6 s later in
# the campaign that found it (here: as soon as the job's Session() has returned).
LATE_SHM_SCRIPT = r"""
set -e
mount -t tmpfs -o size=1m tmpfs /dev/shm
cd "$ROOT"
"$PY" -m drbalance.manager.cli --source scripted:"$OUT/util.json" --log "$OUT/m.jsonl" > "$OUT/manager.out" 2>&1 &
manager=$!
"$PY" -c "$JOB" > "$OUT/job.out" 2>&1 && echo "job rc 0" >> "$OUT/job.out" || echo "job rc $?" >> "$OUT/job.out"
kill -TERM $manager
wait $manager && echo "manager rc 0" >> "$OUT/manager.out" || echo "manager rc $?" >> "$OUT/manager.out"
"""

LATE_JOB = textwrap.dedent("""
    import os, time
    from drbalance.client.session import Session
    from drbalance.ipc import discovery
    from drbalance.ipc.names import IpcNames
    from tests.conftest import wait_for
    from tests.helpers.disk import fill_up
    from tests.helpers.steered import SteeredModel
    names = IpcNames.current()
    wait_for(lambda: names.manager_status().exists(), timeout=60)  # the manager's heartbeat is made
    fill_up("/dev/shm/filler")
    session = Session(SteeredModel(), "late", 1, 100000, solo_time=10.0, sd_log=False, handle_sigterm=False)
    claim = discovery.read_claim(names, "late")
    print("claimed while full", claim is not None and claim.pid == os.getpid(), flush=True)
    print("attached while full", session.attached, flush=True)
    os.unlink("/dev/shm/filler")
    deadline = time.monotonic() + 40
    while not session.attached and time.monotonic() < deadline:
        session.step()
        time.sleep(0.02)
    print("attached after", session.attached, flush=True)
    session.close()
""")


@pytest.mark.slow
def test_a_job_started_while_dev_shm_is_full_claims_its_name_and_is_managed_once_it_has_room(ipc_env, tmp_path):
    """A job that starts while a neighbour keeps /dev/shm full keeps its name claim and makes its
    record and semaphore at a later report, as it looks for an absent manager; giving the claim
    back and never trying again would leave it without a manager its whole life."""
    job, manager = run_with_private_mounts(tmp_path, LATE_SHM_SCRIPT, LATE_JOB, "no other case fills /dev/shm")
    assert "job rc 0" in job and "Traceback" not in job, job
    assert "claimed while full True" in job and "attached while full False" in job, job
    assert "tries again at its later reports" in job, job  # it said why, and what it does
    assert "attached after True" in job, job
    assert "manager rc 0" in manager and "Traceback" not in manager, manager
    events = list(read_json_lines(tmp_path / "m.jsonl"))
    assert [e["trigger"] for e in events if e["event"] == "decision" and e["app"] == "late"][:1] == ["register"]

def test_an_sd_log_that_cannot_be_opened_keeps_its_lines_until_it_can(ipc_env, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the log folder should be")  # making the folder fails (an OSError)
    log = blocker / "job.sd.jsonl"
    session = Session(SteeredModel(), "logged", 2, 10, solo_time=10.0, sd_log=log, handle_sigterm=False)
    try:
        assert "cannot open the SD log" in caplog.text  # reported, and training goes on
        for _ in range(5):
            session.step()
        blocker.unlink()  # the fault goes away
        for _ in range(15):
            session.step()
    finally:
        session.close()
    records = list(read_json_lines(log))
    assert records and records[0]["event"] == "start"  # the lines from before the folder existed are there
    assert sum(1 for r in records if r["event"] == "report") >= 2 and records[-1]["event"] == "closed"


def test_open_later_still_refuses_a_path_that_is_not_ours(tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    link = tmp_path / "log.jsonl"
    link.symlink_to(target)
    with pytest.raises(UnsafePath):
        JsonLinesWriter(link, open_later=True)
    writer = JsonLinesWriter(tmp_path / "missing" / "deeper" / "x.jsonl", open_later=True)  # fine: folders made
    writer.write({"event": "one"})
    assert writer.close() == 0


@pytest.mark.slow
def test_objects_removed_from_dev_shm_while_open_are_made_again(ipc_env, tmp_path):
    """As systemd-logind's RemoveIPC=yes does when the user's last session ends: the manager's
    inbox and heartbeat and a running job's record and semaphore are unlinked. The manager used
    to run on deaf (jobs started later trained detached) and the job was never managed again."""
    manager = ManagerProcess(tmp_path, ipc_env)
    early = later = None
    try:
        early = long_app("early")
        assert first_line(early)["attached"]
        wait_for(lambda: decisions_for(manager, "early") >= 2)
        info = discovery.read_manager(ipc_env)
        token = info.token
        objects.unlink_queue(ipc_env.inbox(info.inbox))
        objects.unlink_shared_memory(ipc_env.manager_record(token))
        claim = discovery.read_claim(ipc_env, "early")
        assert discovery.remove_app_objects(ipc_env, "early", claim.token, claim.signal)
        wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "inbox and heartbeat"])
        assert discovery.read_manager(ipc_env).token != token  # new objects, published in manager.json
        later = long_app("later")
        assert first_line(later)["attached"]  # found the new inbox and heartbeat
        wait_for(lambda: decisions_for(manager, "later") >= 2)
        wait_for(lambda: [e for e in manager.events("repaired") if e["what"] == "record of early"])
        served = decisions_for(manager, "early")
        wait_for(lambda: decisions_for(manager, "early") >= served + 2)  # the job that lost its record is served
        # its semaphore alone goes: the job makes both again (a manager could not tell a new
        # semaphore from the one it holds), and the manager reopens the pair
        objects.unlink_semaphore(ipc_env.app_signal("early", claim.signal))
        wait_for(lambda: len([e for e in manager.events("repaired") if e["what"] == "record of early"]) >= 2)
        served = decisions_for(manager, "early")
        wait_for(lambda: decisions_for(manager, "early") >= served + 2)
    finally:
        code, err = stop_all(manager, early, later)
    assert code == 0 and "Traceback" not in err, err
    said = early.stderr.read()  # what happened, not a guess at who did it
    assert "the record and semaphore of 'early' were removed from /dev/shm while the job ran" in said, said
    assert "the semaphore of 'early' was removed from /dev/shm while the job ran" in said, said


def test_a_replacing_endpoint_leaves_the_one_in_use_alone_until_it_exists(ipc_env):
    from drbalance.ipc.endpoint import ManagerEndpoint

    first = ManagerEndpoint(ipc_env)
    second = None
    try:
        second = ManagerEndpoint(ipc_env, replacing=True)
        assert not first.unlinked()  # a new manager would have removed them: ours are the caller's to close
        assert discovery.read_manager(ipc_env).token == second.token
        first.close()
        assert discovery.read_manager(ipc_env).token == second.token  # the old one's close leaves the new alone
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.slow
def test_a_failed_endpoint_replacement_keeps_manager_json_naming_the_objects_in_use(ipc_env, tmp_path):
    """The inbox is removed while the manager cannot create a new one: here its message-queue
    limit is lowered to 0 bytes (``prlimit``), so ``mq_open`` fails as it would on a user out of
    queue space. ``manager.json`` must keep naming the heartbeat that still exists (the failed
    replacement does not withdraw it), and once queues can be made the replacement goes through."""
    import resource

    manager = ManagerProcess(tmp_path, ipc_env)
    pid = manager.process.pid
    limit = resource.prlimit(pid, resource.RLIMIT_MSGQUEUE)
    app = None
    try:
        info = discovery.read_manager(ipc_env)
        token = info.token
        resource.prlimit(pid, resource.RLIMIT_MSGQUEUE, (0, limit[1]))
        objects.unlink_queue(ipc_env.inbox(info.inbox))
        wait_for(lambda: [e for e in manager.events("fault") if e["task"] == "endpoint"])
        published = discovery.read_manager(ipc_env)
        assert published is not None and published.token == token and published.pid == pid
        assert (objects.SHM_DIR / ipc_env.manager_record(token).lstrip("/")).exists()  # the heartbeat in use stays
        resource.prlimit(pid, resource.RLIMIT_MSGQUEUE, limit)
        wait_for(lambda: manager.events("repaired"))
        assert discovery.read_manager(ipc_env).token != token
        app = long_app("after")
        assert first_line(app)["attached"]  # it found the new inbox through manager.json
        wait_for(lambda: decisions_for(manager, "after") >= 1)
    finally:
        code, err = stop_all(manager, app)
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("how", ["rotated", "removed"])
def test_an_sd_log_moved_or_removed_while_its_job_runs_is_written_again_at_its_path(ipc_env, tmp_path, caplog,
                                                                                     monkeypatch, how):
    """logrotate (which renames the file) or an 'rm' of the logs folder while a job trains: the job
    writes its SD log at its path again, as the manager's log does, instead of writing on to the
    renamed or deleted file and leaving its path empty until the job ends."""
    from drbalance.client import session as session_module

    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    monkeypatch.setattr(session_module, "LOG_CHECK_SECONDS", 0.0)
    log = tmp_path / "logs" / "job.sd.jsonl"
    session = Session(SteeredModel(), "moved", 3, 10, solo_time=10.0, sd_log=log, report_every=1,
                      handle_sigterm=False)
    try:
        for _ in range(10):
            session.step()
        if how == "rotated":
            log.rename(log.with_name("job.sd.jsonl.1"))
        else:
            shutil.rmtree(log.parent)
        for _ in range(20):
            session.step()
    finally:
        session.close()
    records = list(read_json_lines(log))
    assert records and [r["event"] for r in records][-2:] == ["finish", "closed"]
    assert sum(1 for r in records if r["event"] == "report") >= 15  # the iterations after the move
    assert f"the SD log {log} was removed or replaced" in caplog.text
    if how == "rotated":
        assert list(read_json_lines(log.with_name("job.sd.jsonl.1")))[0]["event"] == "start"


def test_a_relative_sd_log_path_stays_the_same_file_when_the_job_changes_folder(ipc_env, tmp_path, monkeypatch):
    """The check for a removed log must not take a change of working folder for one: the lines
    would go on in a second file under the new folder."""
    from drbalance.client import session as session_module

    monkeypatch.setenv("DRBALANCE_NO_MANAGER", "1")
    monkeypatch.setattr(session_module, "LOG_CHECK_SECONDS", 0.0)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    session = Session(SteeredModel(), "wanders", 2, 10, solo_time=10.0, sd_log="logs/job.sd.jsonl", report_every=1,
                      handle_sigterm=False)
    try:
        for _ in range(5):
            session.step()
        os.chdir(tmp_path / "second")
        for _ in range(15):
            session.step()
    finally:
        session.close()
    records = list(read_json_lines(tmp_path / "first" / "logs" / "job.sd.jsonl"))
    assert records[0]["event"] == "start" and records[-1]["event"] == "closed"
    assert not (tmp_path / "second" / "logs").exists()
