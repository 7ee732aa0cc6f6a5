"""Keeps BYTES reserved on emulated GPU INDEX (of MEMORY bytes) until killed. Prints 'holding' first.

Usage: python -m tests.helpers.emu_memory_holder INDEX BYTES MEMORY
"""

from __future__ import annotations

import sys
import time

from drbalance.emu.gpus import EmulatedGpu
from drbalance.ipc.names import IpcNames


def main() -> None:
    index, nbytes, memory = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    gpu = EmulatedGpu(IpcNames.current(), index, memory_bytes=memory)
    gpu.reserve(token=7, nbytes=nbytes)
    print("holding", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
