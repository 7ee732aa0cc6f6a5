"""A torch-free app that takes its name, publishes one status and then sits still (until killed).

With ``--half`` it is "killed during its first status write": it sets the status seqlock counter
odd (a write in progress) instead of publishing. It prints ``ready TOKEN`` when its objects exist.

Usage: python -m tests.helpers.idle_app APP [--half] (namespace and runtime dir from the environment).
"""

from __future__ import annotations

import os
import sys
import time

from drbalance import DataRatio
from drbalance.ipc import objects
from drbalance.ipc.layout import AppState, AppStatus
from drbalance.ipc.link import PosixManagerLink
from drbalance.ipc.names import IpcNames


def status(app: str) -> AppStatus:
    pid = os.getpid()
    return AppStatus(pid, app, AppState.RUNNING, DataRatio([1, 1, 1, 1], 4), 0, 10, 1, 100, 10, 0, 1.5, 0.1, 10.0,
                     time.time(), time.time(), time.monotonic(), start_ticks=objects.process_start_ticks(pid) or 0)


def main() -> None:
    app = sys.argv[1]
    link = PosixManagerLink(IpcNames.current(), app)
    if "--half" in sys.argv:
        area = link.record.status_area
        area.words[area.counter_index] = 1  # the first write started and never finished
    else:
        link.publish(status(app))
    print(f"ready {link.token}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
