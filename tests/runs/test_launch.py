"""The launcher stops a run's processes together: SIGTERM to all, then SIGKILL to what is left
after one grace period (stopped one by one, a grace period each, N apps that are slow to exit
would hold Ctrl-C or a ``--timeout`` up for N times the grace)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drbalance.runs.launch import stop_all

pytestmark = pytest.mark.timeout(120)

# On SIGTERM a child leaves a mark, then exits only once every child has left one: stopped one at
# a time, the first would wait for marks that never come and be killed after the grace period.
WAITS_FOR_ITS_SIBLINGS = """
import os, signal, sys, time
folder, me, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
def stop(*_):
    open(os.path.join(folder, me), "w").close()
    while len(os.listdir(folder)) < count:
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def started(code: str, *args: str) -> subprocess.Popen:
    """A Python child running ``code`` that has printed "ready" (its signal handlers are set)."""
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.stdout.close()
    return child


def test_every_process_gets_sigterm_before_any_is_killed(tmp_path: Path):
    count = 3
    children = [started(WAITS_FOR_ITS_SIBLINGS, str(tmp_path), str(index), str(count)) for index in range(count)]
    stop_all(children, grace=60.0)
    assert [child.returncode for child in children] == [0] * count  # none needed SIGKILL
    assert sorted(path.name for path in tmp_path.iterdir()) == [str(index) for index in range(count)]


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_and_the_others_still_stop():
    ignores = started("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('ready', flush=True)\ntime.sleep(600)")
    plain = started("import time\nprint('ready', flush=True)\ntime.sleep(600)")
    done = started("print('ready', flush=True)")
    done.wait(timeout=60)
    stop_all([ignores, plain, done], grace=2.0)
    assert (ignores.returncode, plain.returncode, done.returncode) == (-9, -15, 0)
