"""``DRBALANCE_NO_MANAGER`` as users write it, in any case: ``True`` or ``ON`` is "yes", so the job
does not quietly register with the manager it was meant to stay away from. A value that is neither
yes nor no is a clear error before anything is created."""

from __future__ import annotations

import os
import time

import pytest

from drbalance.client.session import Session
from drbalance.ipc.endpoint import ManagerEndpoint
from drbalance.ipc.layout import ManagerBeat
from tests.helpers.steered import SteeredModel

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value, detached", [("True", True), ("ON", True), (" yes ", True), ("1", True),
                                             ("False", False), ("0", False), ("", False)])
def test_no_manager_is_read_whatever_its_case(ipc_env, monkeypatch, value, detached):
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", value)
    endpoint = ManagerEndpoint(ipc_env)  # a live manager's real inbox and heartbeat, in this process
    try:
        endpoint.beat(ManagerBeat(os.getpid(), 2, 10, time.time(), time.monotonic()))
        with Session(SteeredModel(), "optout", 1, 10, 1.0, sd_log=False, exchange_timeout=0.0,
                     handle_sigterm=False) as session:
            assert session.attached is not detached
            notice = endpoint.receive(0.2 if detached else 5.0)
            assert (notice is None) is detached  # an opted-out job sends the manager nothing
    finally:
        endpoint.close()


@pytest.mark.parametrize("value", ["maybe", "2", "nope"])
def test_a_no_manager_value_that_is_neither_is_a_clear_error_before_anything_is_created(ipc_env, monkeypatch,
                                                                                          tmp_path, value):
    monkeypatch.setenv("DRBALANCE_NO_MANAGER", value)
    log = tmp_path / "optout.sd.jsonl"
    with pytest.raises(ValueError, match="DRBALANCE_NO_MANAGER"):
        Session(SteeredModel(), "optout", 1, 10, 1.0, sd_log=log, handle_sigterm=False)
    assert not log.exists() and not ipc_env.claims_dir().exists() and ipc_env.listed() == []
