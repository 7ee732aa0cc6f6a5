"""What an emulated GPU's shared-memory segment holds, and its memory sizes.

The segment (``drbalance.ipc.records.Segment`` of kind ``EMULATED_GPU``) has three areas, each a
seqlocked area of its own: the busy-time account (at ``STATUS_OFFSET``, written by the holder of
the GPU's turn), the memory reservation table (at ``MEMORY_OFFSET``, written under a ``lockf``
record lock on the GPU's lock file) and the memory size (at ``SPEC_OFFSET``, written by the GPU's
creator).
"""

from __future__ import annotations

import struct

# busy seconds so far, busy since (monotonic, 0 = idle), holder pid, the low 32 bits of its start time
# (clock ticks since boot, 0 = unknown: see gpus._same_process), count
ACCOUNT = struct.Struct("<ddiIQ")
DEFAULT_MEMORY_BYTES = 24 * 2**30  # the paper's Quadro RTX 6000 (24 GB)
MAX_MEMORY_BYTES = 2**50  # 1 PiB: what the segment records in 8 bytes, with room to spare
MEMORY_OFFSET = 256  # the reservation table's area in the segment (after the busy-time account)
MEMORY_ENTRIES = 32  # processes (backends) that can hold memory on one emulated GPU at once
# pid, token (one per backend object), reserved bytes, the process's start time (clock ticks since boot)
MEMORY_ENTRY = struct.Struct("<iIQQ")
MEMORY_TABLE_SIZE = MEMORY_ENTRIES * MEMORY_ENTRY.size
SPEC_OFFSET = 2048  # the memory size area (after the reservation table), written by the GPU's creator
SPEC = struct.Struct("<Q")  # the emulated GPU's memory size, bytes


def size_text(nbytes: float) -> str:
    """Bytes as CUDA's messages write them (GiB, MiB), or plain bytes below a MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{int(nbytes)} bytes"


def check_memory_size(nbytes: int, shown: str | None = None) -> None:
    """``ValueError`` unless ``nbytes`` is a possible emulated GPU memory size: 1 byte to 1 PiB."""
    if not 1 <= nbytes <= MAX_MEMORY_BYTES:
        raise ValueError(f"emulated GPU memory must be > 0 bytes and at most 1 PiB ({MAX_MEMORY_BYTES} bytes); "
                         f"got {shown or nbytes}")
