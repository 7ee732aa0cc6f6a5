"""A minimal manager for the protocol tests, on the real manager-side IPC primitives.

Answers every REGISTER/BOUNDARY notice with the DR given by --answer (after --delay seconds; with
--slow-notices N, only the first N, and --later-delay seconds after them) and
prints one JSON line per notice received. Exits after --notices notices or --seconds seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from drbalance import DataRatio
from drbalance.ipc import discovery
from drbalance.ipc.endpoint import AppChannel, ManagerEndpoint
from drbalance.ipc.layout import AppCommand, ManagerBeat, NoticeKind, RecordError
from drbalance.ipc.names import IpcNames


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", default="0,0,0,10")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--slow-notices", type=int, default=None, help="delay only the first N answers")
    parser.add_argument("--later-delay", type=float, default=0.0, help="seconds before each answer after those N")
    parser.add_argument("--notices", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--silent", action="store_true", help="heartbeat, but never read the inbox")
    args = parser.parse_args()
    # Stopped with Ctrl-C (SIGINT). A process started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then keeps it ignored: install the handler explicitly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    names = IpcNames.current()
    endpoint = ManagerEndpoint(names)
    answer = DataRatio([int(x) for x in args.answer.split(",")])
    channels: dict[str, AppChannel] = {}
    deadline = time.monotonic() + args.seconds
    received = 0
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        while time.monotonic() < deadline and received < args.notices:
            endpoint.beat(ManagerBeat(os.getpid(), len(answer), answer.total, time.time(), time.monotonic()))
            if args.silent:
                time.sleep(0.05)
                continue
            try:
                notice = endpoint.receive(0.05)
            except RecordError as error:
                print(json.dumps({"rejected": str(error)}), flush=True)
                continue
            if notice is None:
                continue
            received += 1
            if notice.app not in channels:
                claim = discovery.read_claim(names, notice.app)
                channels[notice.app] = AppChannel(names, notice.app, claim.token)
            channel = channels[notice.app]
            status = channel.read_status()
            print(json.dumps({"kind": notice.kind.name, "seq": notice.seq, "app": notice.app,
                              "sd": status.slowdown, "iteration": status.iteration}), flush=True)
            if notice.kind == NoticeKind.FINISH:
                channels.pop(notice.app).close()
                continue
            if args.slow_notices is None or received <= args.slow_notices:
                time.sleep(args.delay)
            else:
                time.sleep(args.later_delay)
            channel.answer(AppCommand(os.getpid(), notice.seq, answer, "toy", time.time()))
    finally:
        endpoint.close()


if __name__ == "__main__":
    main()
