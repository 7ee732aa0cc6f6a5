"""A torch-free app speaking the real protocol through PosixManagerLink, for the flood test.

Waits until wall-clock time START, then sends NOTICES boundary notices back to back, each
answered (or not) before the next. Prints {"app", "sent", "answered", "generations"} as JSON.
Usage: python -m tests.helpers.flood_app NAME START NOTICES [SEND_TIMEOUT [ANSWER_TIMEOUT]]
(seconds; default: what a Session uses, and four times its exchange timeout).
"""

from __future__ import annotations

import json
import os
import sys
import time

from drbalance import DataRatio
from drbalance.ipc.layout import AppState, AppStatus, Notice, NoticeKind
from drbalance.ipc.link import DEFAULT_EXCHANGE_TIMEOUT, DEFAULT_SEND_TIMEOUT, PosixManagerLink
from drbalance.ipc.names import IpcNames


def main() -> None:
    name, start, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    send_timeout = float(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_SEND_TIMEOUT
    answer_timeout = float(sys.argv[5]) if len(sys.argv) > 5 else DEFAULT_EXCHANGE_TIMEOUT * 4
    link = PosixManagerLink(IpcNames.current(), name)
    ratio = DataRatio([1, 1, 1, 1], 4)
    status = AppStatus(os.getpid(), name, AppState.RUNNING, ratio, 0, 10, 1, 100, 10, 0, 1.5, 0.1, 10.0,
                       time.time(), time.time(), time.monotonic())
    link.publish(status)
    time.sleep(max(0.0, start - time.time()))
    sent, answered, generations, problems = 0, 0, [], []
    for seq in range(1, count + 1):
        link.publish(status.__class__(**{**status.__dict__, "notice_seq": seq, "updated_mono": time.monotonic()}))
        started = time.monotonic()
        link.manager()  # the protocol: look for the live manager, then notify it
        if link.notify(Notice(NoticeKind.BOUNDARY, os.getpid(), seq, name, time.time()), send_timeout):
            sent += 1
            command = link.await_command(seq, answer_timeout)
            if command is not None:
                answered += 1
                generations.append(command.generation)
            else:
                problems.append(f"seq {seq}: no answer within {time.monotonic() - started:.2f} s")
        else:
            problems.append(f"seq {seq}: not delivered ({'no manager' if link.manager() is None else 'inbox full'}"
                            f" for {time.monotonic() - started:.2f} s)")
    link.manager()
    link.notify(Notice(NoticeKind.FINISH, os.getpid(), count + 1, name, time.time()), DEFAULT_SEND_TIMEOUT)
    link.close()
    print(json.dumps({"app": name, "sent": sent, "answered": answered, "generations": generations,
                      "problems": problems}), flush=True)


if __name__ == "__main__":
    main()
