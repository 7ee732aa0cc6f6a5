"""Cost of the training side of the protocol, on this machine.

1. One SD report (every ``report_every`` iterations): write the status record (seqlock + CRC)
   and the SD-log line. Target: <= 50 us median. Shown beside a step() that does not report.
2. The epoch-end exchange, from the notice to the new DR being set on the model, against a real
   ``drbalance-manager`` process (paper policy, scripted utilisation). Target: <= 5 ms p99.

Usage: python -m benchmarks.bench_protocol [--reports 20000] [--exchanges 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.timing import add_no_write, save, scratch_namespace, summary
from drbalance import DataRatio
from drbalance.argtypes import positive_int
from drbalance.ipc.layout import NoticeKind
from drbalance.ipc.names import IpcNames


class RatioHolder:
    """Stands in for BalancedDataParallel: the session only reads and sets the DR."""

    def __init__(self) -> None:
        self.ratio = DataRatio([1, 1, 1, 1], 4)

    def set_ratio(self, ratio: DataRatio) -> None:
        self.ratio = ratio


def bench_report(count: int, scratch: Path) -> dict:
    from drbalance.client.session import Session

    os.environ["DRBALANCE_NO_MANAGER"] = ""
    session = Session(RatioHolder(), "bench-report", 1, count * 4, solo_time=100.0,
                      sd_log=scratch / "report.sd.jsonl", handle_sigterm=False)
    report, plain = [], []
    for _ in range(count):
        session.step()  # not a report iteration unless count aligns
        now = session.clock.monotonic()
        started = time.perf_counter()
        session._report(now)
        report.append(time.perf_counter() - started)
        started = time.perf_counter()
        session.tracker.iteration_finished(session.clock.monotonic())
        plain.append(time.perf_counter() - started)
    session.close()
    return {"report_seconds": summary(report), "tracker_update_seconds": summary(plain)}


def bench_exchange(count: int, scratch: Path) -> dict:
    from drbalance.client.session import Session

    util = scratch / "util.json"
    util.write_text(json.dumps({"gpus": 4, "steps": [{"at": 0, "util": [40, 50, 60, 70]}]}))
    names = IpcNames.current()
    manager = subprocess.Popen(
        [sys.executable, "-m", "drbalance.manager.cli", "--source", f"scripted:{util}", "--policy", "paper",
         "--log", str(scratch / "manager.jsonl")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not names.manager_status().exists():
            if manager.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the manager did not start: {manager.stderr.read()}")
            time.sleep(0.05)
        model = RatioHolder()
        session = Session(model, "bench-exchange", 1, count * 4, solo_time=100.0, sd_log=False,
                          handle_sigterm=False)
        if not session.attached:
            raise RuntimeError("the session did not attach to the manager")
        samples = []
        for _ in range(count):
            session.tracker.iteration_finished(session.clock.monotonic())
            started = time.perf_counter()
            session._exchange(NoticeKind.BOUNDARY, session.clock.monotonic())
            samples.append(time.perf_counter() - started)
            if session.applied_generation != session.notice_seq:
                raise RuntimeError(f"exchange {session.notice_seq} was not answered in time")
        looks = []  # what every step() adds with a manager: a look at the app's signal for pushed DRs
        for _ in range(count * 10):
            started = time.perf_counter()
            session.link.command_signalled()
            looks.append(time.perf_counter() - started)
        session.close()
    finally:
        manager.send_signal(signal.SIGTERM)
        manager.wait(timeout=30)
    return {"exchange_seconds": summary(samples), "placement": model.ratio.to_list(),
            "signal_look_seconds": summary(looks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=positive_int, default=20000, help="timed SD reports (default 20000)")
    parser.add_argument("--exchanges", type=positive_int, default=2000, help="timed exchanges (default 2000)")
    add_no_write(parser)
    args = parser.parse_args(argv)
    with scratch_namespace("bench") as scratch:
        payload = {"args": vars(args), "report": bench_report(args.reports, scratch),
                   "exchange": bench_exchange(args.exchanges, scratch)}
    report = payload["report"]["report_seconds"]
    exchange = payload["exchange"]["exchange_seconds"]
    print(f"SD report: median {report['median'] * 1e6:.1f} us, p99 {report['p99'] * 1e6:.1f} us "
          f"(target <= 50 us median); a step() without report: "
          f"{payload['report']['tracker_update_seconds']['median'] * 1e6:.2f} us")
    print(f"epoch-end exchange with a real manager: median {exchange['median'] * 1e3:.3f} ms, "
          f"p99 {exchange['p99'] * 1e3:.3f} ms (target <= 5 ms p99)")
    look = payload["exchange"]["signal_look_seconds"]
    print(f"a step()'s look for a pushed DR (sem_trywait on the app's signal): median {look['median'] * 1e6:.2f} us")
    save("protocol", "benchmarks.bench_protocol", argv, payload, args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
