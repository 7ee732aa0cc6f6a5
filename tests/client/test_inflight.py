"""drbalance.client.inflight: a DDP job's collectives and callbacks are kept until the worker threads are done.

The whole-process behaviour (ranks that exit right after their last backward) is in tests/client/test_distributed.py;
these check the bookkeeping with real futures and a real 1-rank gloo group.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist

from drbalance.client import inflight as inflight_module
from drbalance.client.inflight import InFlight, settle_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def soon(seconds: float = 0.05) -> float:
    return time.monotonic() + seconds


def test_a_callback_counts_until_its_future_has_run_and_dropped_it():
    inflight = InFlight()
    future: torch.futures.Future[int] = torch.futures.Future()
    chained = future.then(inflight.callback(lambda done: done.value() + 1))
    assert inflight.callbacks == 1
    assert not inflight.settle(soon())  # the callback has not run: the wait ends at its deadline
    future.set_result(41)
    assert chained.wait() == 42
    assert inflight.callbacks == 0 and inflight.settle(soon())


def test_works_are_kept_for_their_step_and_the_next_then_let_go(group):
    inflight = InFlight()
    first = inflight.started(group.allreduce([torch.ones(3)]))
    first.wait()
    inflight.next_step()
    second = inflight.started(group.allreduce([torch.ones(3)]))
    assert inflight.kept.previous == [first] and inflight.kept.current == [second]
    second.wait()
    assert inflight.settle(soon(5.0))
    inflight.next_step()
    assert inflight.kept.previous == [second] and inflight.kept.current == []  # the first is let go


@pytest.mark.slow
def test_a_freed_jobs_last_works_are_kept_a_moment_and_waited_for_at_exit(group, monkeypatch):
    # long enough that a loaded machine's gc.collect() (the whole suite's heap) cannot outlast it
    monkeypatch.setattr(inflight_module, "RETIRE_SECONDS", 5.0)
    inflight = InFlight()
    work = inflight.started(group.allreduce([torch.ones(2)]))
    work.wait()
    kept = inflight.kept
    del inflight
    gc.collect()

    def retired() -> bool:
        return any(entry is kept for entry in inflight_module._shutdown.retired)

    assert retired()
    assert settle_all(timeout=5.0)
    deadline = time.monotonic() + 30
    while retired() and time.monotonic() < deadline:  # let go after RETIRE_SECONDS, by a timer thread
        time.sleep(0.05)
    assert not retired()


def test_the_exit_handler_gives_up_at_its_timeout_and_says_so(caplog):
    inflight = InFlight()
    future: torch.futures.Future[int] = torch.futures.Future()
    future.add_done_callback(inflight.callback(lambda done: None))
    with caplog.at_level("WARNING", logger="drbalance.client"):
        assert not settle_all(timeout=0.1)
    assert "still in flight at exit" in caplog.text
    future.set_result(1)
    assert settle_all(timeout=5.0)
