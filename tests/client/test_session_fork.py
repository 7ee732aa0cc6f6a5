"""A process forked from a training job (``os.fork``: a checkpoint writer, a helper) holds a copy
of the job's session. Its exit must leave the job alone: it sends the manager no FINISH notice in
the job's name (the manager would drop the job), removes none of the job's record, semaphore and
name claim, and does not write the job's buffered SD-log lines a second time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import leftovers

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

FORKING_JOB = textwrap.dedent("""
    import contextlib, json, os, sys, time
    from drbalance.client.session import Session
    from drbalance.ipc import discovery
    from drbalance.ipc.endpoint import ManagerEndpoint
    from drbalance.ipc.layout import ManagerBeat
    from drbalance.ipc.names import IpcNames
    from tests.helpers.steered import SteeredModel

    def received():
        found = []
        while (notice := endpoint.receive(0.5)) is not None:
            found.append(f"{notice.kind.name}:{notice.pid}")
        return found

    log, how = sys.argv[1], sys.argv[2]
    names = IpcNames.current()
    endpoint = ManagerEndpoint(names)  # a manager's real inbox and heartbeat, in this process
    endpoint.beat(ManagerBeat(os.getpid(), 2, 10, time.time(), time.monotonic()))  # beats only when told
    session = Session(SteeredModel(), "forked", 1, 1000, 1.0, exchange_timeout=0.05, sd_log=log)
    before = received()  # its REGISTER (not answered: the job trains on)
    for _ in range(5):
        session.step()  # a report line waits in the SD log's buffer
    with session if how == "with" else contextlib.nullcontext():
        child = os.fork()
        if child == 0:
            sys.exit(0)  # the child ends normally: the with-block's __exit__ and atexit run in it
        os.waitpid(child, 0)
        after_child = received()
        claim = discovery.read_claim(names, "forked")
        kinds = sorted(listed.kind for listed in names.listed())
        endpoint.beat(ManagerBeat(os.getpid(), 2, 10, time.time(), time.monotonic()))  # a beat > 5 s old is none
    session.close()
    at_close = received()
    endpoint.close()
    print(json.dumps({"pid": os.getpid(), "before": before, "after_child": after_child, "at_close": at_close,
                      "claim_pid": claim.pid if claim else None, "kinds": kinds}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["with", "atexit"])
def test_a_forked_child_that_exits_leaves_the_jobs_session_alone(ipc_env, tmp_path, how):
    log = tmp_path / "forked.sd.jsonl"
    done = subprocess.run([sys.executable, "-c", FORKING_JOB, str(log), how], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    pid = result["pid"]
    assert result["before"] == [f"REGISTER:{pid}"]
    assert result["after_child"] == []  # the child sent nothing in the job's name
    assert result["claim_pid"] == pid  # the job still holds its name
    assert result["kinds"] == ["app", "manager", "sig"]  # its record and semaphore are still there
    assert result["at_close"] == [f"FINISH:{pid}"]  # one FINISH: the job's own, when it closes
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    # the job's lines once each, none written by the child (its copy of the buffered report line)
    assert events == ["start", "attached", "no_answer", "report", "closed"], events
    assert "was removed from /dev/shm" not in done.stderr
    assert leftovers(ipc_env) == []


SIGTERM_IN_A_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from drbalance.client.session import Session
    from tests.helpers.steered import SteeredModel

    session = Session(SteeredModel(), "worker-parent", 1, 1000, 1.0, sd_log=False)  # its SIGTERM handler is set
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # like a DataLoader worker: forked, it inherits the handler
        os.close(reader)
        os.write(writer, b"r")
        try:
            time.sleep(60)
        finally:  # reached only if SIGTERM unwinds the child instead of ending it
            os.write(writer, b"u")
        os._exit(0)
    os.close(writer)
    os.read(reader, 1)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    unwound = os.read(reader, 1) == b"u"
    alive = session.attached is False and not session._closed  # the job's own session is untouched
    session.close()
    print(json.dumps({"signalled": os.WIFSIGNALED(status), "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status)
                      else None, "unwound": unwound, "parent_fine": alive}))
""")


def test_a_forked_child_dies_of_sigterm_at_once_and_the_job_trains_on(ipc_env, tmp_path):
    """A DataLoader worker inherits the job's SIGTERM handler; it dies of SIGTERM at once, as it
    would without drbalance, instead of raising SessionTerminated in the worker (which would then
    run its cleanup code and the job's exit hooks)."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_A_CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=100, env={**os.environ, "PYTHONPATH": str(ROOT), "DRBALANCE_NO_MANAGER": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"signalled": True, "signal": 15, "unwound": False, "parent_fine": True}, (result, done.stderr)
    assert "SessionTerminated" not in done.stderr and "Traceback" not in done.stderr, done.stderr
