"""Malformed discovery files (``manager.json``, an app's claim) are a clear ``DiscoveryError``.

Not only undecodable bytes and bad JSON syntax: a claim nested thousands of levels deep (which
would raise ``RecursionError`` at every rescan, and the manager would stop collecting every claim
sorted after it), a 400-digit ``claimed`` or ``started`` (``OverflowError``), a pid beyond
``pid_t`` (``OverflowError`` in ``os.kill``). A job whose ``Session`` reads such a
``manager.json`` trains on alone instead of crashing at start.
"""

import json
import os
import signal
import time

import pytest

from drbalance.ipc import discovery
from drbalance.ipc.discovery import ClaimInfo, DiscoveryError, ManagerInfo
from drbalance.ipc.objects import pid_alive
from tests.conftest import wait_for
from tests.helpers.processes import ManagerProcess, stop_all, toy_app

TOKEN = "0123456789abcdef"
GOOD_CLAIM = {"version": 1, "app": "job", "pid": 1, "start_ticks": 0, "token": TOKEN, "claimed": 1.0}
GOOD_MANAGER = {"version": 1, "pid": 1, "start_ticks": 0, "token": TOKEN, "started": 1.0}

BAD_CONTENTS = {
    "nested too deep": b"[" * 5000,
    "a 400-digit time": None,  # built per file kind below
    "a 5000-digit time": None,
    "a pid beyond pid_t": None,
    "ticks beyond 64 bits": None,
    "an infinite time": None,
    "a time that is true": None,
}


def _bad(kind: str, good: dict, time_key: str) -> bytes:
    if kind == "nested too deep":
        return BAD_CONTENTS[kind]
    text = json.dumps(good)
    if kind == "a 400-digit time":
        return text.replace(f'"{time_key}": 1.0', f'"{time_key}": ' + "9" * 400).encode()
    if kind == "a 5000-digit time":  # past Python's limit on converting long digit strings
        return text.replace(f'"{time_key}": 1.0', f'"{time_key}": ' + "9" * 5000).encode()
    if kind == "a pid beyond pid_t":
        return json.dumps({**good, "pid": 2**40}).encode()
    if kind == "ticks beyond 64 bits":
        return json.dumps({**good, "start_ticks": 2**70}).encode()
    if kind == "an infinite time":
        return text.replace(f'"{time_key}": 1.0', f'"{time_key}": Infinity').encode()
    return json.dumps({**good, time_key: True}).encode()


def test_the_good_files_decode():  # the tests below fail on what they change, not on a bad base
    assert ClaimInfo.decode(json.dumps(GOOD_CLAIM).encode(), "claim").token == TOKEN
    assert ManagerInfo.decode(json.dumps(GOOD_MANAGER).encode(), "manager.json").started == 1.0


@pytest.mark.parametrize("kind", list(BAD_CONTENTS))
def test_a_malformed_claim_is_a_discovery_error(kind):
    with pytest.raises(DiscoveryError, match="claim"):
        ClaimInfo.decode(_bad(kind, GOOD_CLAIM, "claimed"), "claim")


@pytest.mark.parametrize("kind", list(BAD_CONTENTS))
def test_a_malformed_manager_file_is_a_discovery_error(kind):
    with pytest.raises(DiscoveryError, match="manager.json"):
        ManagerInfo.decode(_bad(kind, GOOD_MANAGER, "started"), "manager.json")


def test_a_pid_beyond_pid_t_is_no_live_process():
    assert pid_alive(2**40) is False and pid_alive(2**31) is False


@pytest.mark.slow
def test_a_job_trains_on_alone_when_manager_json_holds_a_400_digit_time(ipc_env):
    ipc_env.private_runtime_dir()
    ipc_env.manager_info().write_bytes(_bad("a 400-digit time", GOOD_MANAGER, "started"))
    os.chmod(ipc_env.manager_info(), 0o600)
    app = toy_app("alone", "--epochs", "1", "--iterations", "3")
    out, err = app.communicate(timeout=120)
    assert app.returncode == 0 and "Traceback" not in err, err
    assert json.loads(out.splitlines()[-1])["done"] is True


@pytest.mark.slow
def test_a_claim_nested_too_deep_stops_neither_the_rescan_nor_the_collection_of_a_dead_job(ipc_env, tmp_path):
    victim = toy_app("zzz", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
    claim = wait_for(lambda: discovery.read_claim(ipc_env, "zzz"))
    os.kill(victim.pid, signal.SIGKILL)  # no manager runs: its claim and objects stay
    victim.wait(timeout=30)
    bad = ipc_env.app_claim("aaa")  # sorted before zzz's
    bad.write_bytes(b"[" * 5000)
    os.chmod(bad, 0o600)
    old = time.time() - 3600  # past the grace period a starting job gets
    os.utime(bad, (old, old))
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        removed = wait_for(lambda: [e for e in manager.events("app_removed") if e["app"] == "zzz"], timeout=60)
        assert removed[0]["pid"] == claim.pid
        assert not [e for e in manager.events("fault") if e["task"] == "rescan"], manager.events("fault")
        assert manager.alive()
    finally:
        code, err = stop_all(manager)
    assert code == 0 and "Traceback" not in err and "RecursionError" not in err, err
