"""The manager's /dev/shm listing (drbalance.manager.listing): counted, bounded, in a thread, paced."""

import os

import pytest

from drbalance.ipc.objects import SHM_DIR
from drbalance.manager.listing import ShmLister, list_namespace
from tests.conftest import wait_for

TOKEN = "0123456789abcdef"


def plant(names, count: int) -> list:
    paths = [SHM_DIR / f"{names.prefix.lstrip('/')}app.x{index}.{TOKEN}" for index in range(count)]
    for path in paths:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    return paths


def test_own_entries_come_back_parsed_and_others_are_counted_with_the_first_kept(ipc_env):
    paths = plant(ipc_env, 50)
    mine = list_namespace(ipc_env, keep=5)
    assert [o.app for o in mine.own] == sorted(f"x{i}" for i in range(50))  # by name
    assert all(o.kind == "app" and o.token == TOKEN for o in mine.own)
    assert sum(mine.foreign_counts.values()) == 0 and mine.foreign_first == ()
    theirs = list_namespace(ipc_env, keep=5, me=os.geteuid() + 1)  # seen as another user would
    assert theirs.own == () and theirs.foreign_counts == {os.geteuid(): 50}
    assert [entry for entry, _ in theirs.foreign_first] == sorted(path.name for path in paths)[:5]


def test_a_listing_runs_in_a_thread_is_taken_once_and_the_next_waits_twice_its_duration(ipc_env):
    plant(ipc_env, 3)
    now = [100.0]
    lister = ShmLister(ipc_env, keep=10, clock=lambda: now[0])
    assert lister.take() is None and not lister.ready()
    assert lister.start()
    wait_for(lister.ready)
    assert not lister.start()  # one not taken yet
    listing = lister.take()
    assert len(listing.own) == 3 and lister.take() is None
    lister._not_before = now[0] + 5.0  # as if the last listing had taken 2.5 s
    assert not lister.start()
    now[0] += 5.0
    assert lister.start()
    wait_for(lister.ready)
    assert len(lister.take().own) == 3


def test_a_failing_listing_hands_its_error_to_the_taker(ipc_env, monkeypatch):
    def broken():
        raise PermissionError("no /dev/shm for you")
        yield  # a generator, as ``entries`` is

    monkeypatch.setattr(type(ipc_env), "entries", lambda self: broken())
    lister = ShmLister(ipc_env, keep=10)
    assert lister.start()
    wait_for(lister.ready)
    with pytest.raises(PermissionError, match="no /dev/shm"):
        lister.take()
    assert lister.start()  # and the next one may begin
    lister.join(10)
