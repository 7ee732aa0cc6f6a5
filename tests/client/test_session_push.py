"""A pushed DR is applied once, whatever the wall clock does. A push is not judged by its write
time: after the manager's wall clock steps back (NTP correcting a clock that ran ahead, a VM
resumed with a wrong clock), a session that took only pushes written later than the last one
would ignore every push until the clock caught up again, while the manager took them as applied."""

from __future__ import annotations

import os
import time

import pytest

from drbalance.client.session import Session
from drbalance.ipc.endpoint import AppChannel, ManagerEndpoint
from drbalance.ipc.layout import AppCommand, ManagerBeat, NoticeKind
from drbalance.ratio import DataRatio
from tests.helpers.steered import SteeredModel

pytestmark = pytest.mark.timeout(60)


def test_a_push_written_after_the_managers_clock_stepped_back_is_applied_once(ipc_env):
    endpoint = ManagerEndpoint(ipc_env)  # a manager's real inbox and heartbeat, in this process
    model = SteeredModel()
    session = None
    try:
        endpoint.beat(ManagerBeat(os.getpid(), 2, 10, time.time(), time.monotonic()))
        session = Session(model, "pushed", 1, 1000, 1.0, sd_log=False, report_every=1000, exchange_timeout=0.0,
                          handle_sigterm=False)
        notice = endpoint.receive(5.0)
        assert notice.kind == NoticeKind.REGISTER and session.attached
        channel = AppChannel(ipc_env, "pushed")
        pid, generation, wall = os.getpid(), session.notice_seq, time.time()
        channel.answer(AppCommand(pid, generation, DataRatio([5, 5], 10), "keep", wall))
        session.step()  # the (late) answer: nothing awaited any more
        channel.answer(AppCommand(pid, generation, DataRatio([10, 0], 10), "swap", wall + 1.0, pushed=True))
        session.step()
        assert model.ratio == DataRatio([10, 0], 10)
        # the manager's wall clock is stepped back an hour; its next push is written "earlier"
        channel.answer(AppCommand(pid, generation, DataRatio([0, 10], 10), "swap", wall - 3600.0, pushed=True))
        session.step()
        assert model.ratio == DataRatio([0, 10], 10)  # applied, not lost to the earlier write time
        model.set_ratio(DataRatio([3, 7], 10))  # e.g. an out-of-memory revert
        channel.signal.release()  # a stray post: the push still in the record is not applied twice
        session.step()
        assert model.ratio == DataRatio([3, 7], 10)
        channel.close()
    finally:
        if session is not None:
            session.close()
        endpoint.close()
