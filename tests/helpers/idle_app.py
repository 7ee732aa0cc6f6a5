"""A torch-free app that takes its name, publishes one status and then sits still (until killed).

With ``--half`` it is "killed during its first status write": it sets the status seqlock counter
odd (a write in progress) instead of publishing. With ``--empty-claim`` it is "killed right after
creating its name claim": it creates and locks its claim file, writes nothing in it and makes no
object (it prints ``ready -``). Otherwise it prints ``ready TOKEN`` when its objects exist.

Usage: python -m tests.helpers.idle_app APP [--half | --empty-claim] (namespace and runtime dir from
the environment).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

from drbalance import DataRatio
from drbalance.ipc import objects
from drbalance.ipc.layout import AppState, AppStatus
from drbalance.ipc.link import PosixManagerLink
from drbalance.ipc.names import IpcNames
from drbalance.ipc.private import open_private, private_dir


def status(app: str) -> AppStatus:
    pid = os.getpid()
    return AppStatus(pid, app, AppState.RUNNING, DataRatio([1, 1, 1, 1], 4), 0, 10, 1, 100, 10, 0, 1.5, 0.1, 10.0,
                     time.time(), time.time(), time.monotonic(), start_ticks=objects.process_start_ticks(pid) or 0)


def main() -> None:
    app = sys.argv[1]
    names = IpcNames.current()
    if "--empty-claim" in sys.argv:
        names.private_runtime_dir()
        private_dir(names.claims_dir())
        claim, _ = open_private(names.app_claim(app), os.O_RDWR | os.O_CREAT, private=True)
        fcntl.flock(claim, fcntl.LOCK_EX)  # held until the process dies, as AppClaim.take holds it
        print("ready -", flush=True)
        time.sleep(3600)
    link = PosixManagerLink(names, app)
    if "--half" in sys.argv:
        area = link.record.status_area
        area.words[area.counter_index] = 1  # the first write started and never finished
    else:
        link.publish(status(app))
    print(f"ready {link.token}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
