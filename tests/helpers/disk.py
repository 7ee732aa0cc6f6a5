"""A full disk for the hardening tests and ``benchmarks/fault_campaign.py``: a real small tmpfs,
filled up."""

from __future__ import annotations

import subprocess
from pathlib import Path


def mount_small_tmpfs(path: Path) -> bool:
    """Make the folder ``path`` and mount a 512 KiB tmpfs (mode 0700) on it; whether the mount
    worked (it needs root with CAP_SYS_ADMIN)."""
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(path)],
                            capture_output=True, text=True)
    return result.returncode == 0


def fill_up(path: Path) -> None:
    """Write zeros to a new file ``path`` until its file system (or a file-size limit) refuses more."""
    with open(path, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
