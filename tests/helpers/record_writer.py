"""Rewrites one app record in a tight loop; every field is derived from one counter k.

Used by the torn-read test: a reader that ever sees fields from two different k has read a torn
record. Usage: python -m tests.helpers.record_writer APP SECONDS (namespace from the environment).
Prints ``ready TOKEN`` (the token of the record's name) once the record exists.
"""

from __future__ import annotations

import sys
import time

from drbalance import DataRatio
from drbalance.ipc.layout import AppState, AppStatus
from drbalance.ipc.names import IpcNames
from drbalance.ipc.records import AppRecord


def status_for(k: int, app: str) -> AppStatus:
    first = k % 11
    return AppStatus(
        pid=1 + k % 30000, app=app, state=AppState.RUNNING, ratio=DataRatio([first, 10 - first]),
        epoch=k % 1000, epochs=1000, iteration=k, iterations_total=1 << 40, iterations_per_epoch=1 << 30,
        notice_seq=k, slowdown=k * 0.5, iteration_time=k * 0.25, solo_time=1.0 + k,
        start_wall=float(k), updated_wall=float(k), updated_mono=float(k),
    )


def consistent(status: AppStatus) -> bool:
    k = status.iteration
    return status == status_for(k, status.app)


def main() -> None:
    app, seconds = sys.argv[1], float(sys.argv[2])
    record = AppRecord.create(IpcNames.current(), app)
    record.write_status(status_for(0, app))
    print(f"ready {record.token}", flush=True)
    deadline = time.monotonic() + seconds
    k = 0
    while time.monotonic() < deadline:
        k += 1
        record.write_status(status_for(k, app))
    print(k, flush=True)
    record.close()


if __name__ == "__main__":
    main()
