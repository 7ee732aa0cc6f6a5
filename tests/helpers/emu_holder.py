"""Occupies emulated GPU INDEX for SECONDS (then exits, or hangs if --hang). Prints 'holding' first.

Usage: python -m tests.helpers.emu_holder INDEX SECONDS [--hang]
"""

from __future__ import annotations

import sys
import threading
import time

from drbalance.emu.gpus import EmulatedGpu
from drbalance.ipc.names import IpcNames


def main() -> None:
    index, seconds = int(sys.argv[1]), float(sys.argv[2])
    gpu = EmulatedGpu(IpcNames.current(), index)
    worker = threading.Thread(target=gpu.occupy, args=(seconds,))
    worker.start()
    while gpu.read() is None or gpu.read().busy_since == 0:
        time.sleep(0.005)
    print("holding", flush=True)
    worker.join()
    print("done", flush=True)
    if "--hang" in sys.argv:
        time.sleep(3600)


if __name__ == "__main__":
    main()
