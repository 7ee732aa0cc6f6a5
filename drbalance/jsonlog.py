"""JSON Lines logs (SD logs, the manager log): one JSON object per line, appended.

Files are created with mode 0600 and missing folders with 0700, whatever the umask; a log is
never opened through a symbolic link nor appended to when it is another user's, and its folder
is reached one descriptor at a time and kept open: the log is opened, rotated and removed in that
folder, never by its path again (see ``drbalance.ipc.private``); a ``..`` in its path is the
parent of the folder the kernel reached, not a name dropped as text (``kernel_path``). A full
disk or a vanished folder does not raise from ``write``:
lines wait in memory (at most ``MAX_PENDING_LINES``, the oldest dropped beyond that, counted)
and are written when the fault goes away, after a ``log_gap`` record when any were lost.
With ``max_bytes`` the file is rotated by size: ``x.jsonl`` becomes ``x.jsonl.1``, the older
ones shift up, and at most ``keep`` old files are kept.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from drbalance.ipc.private import Folder, UnsafePath, open_folder

MAX_PENDING_LINES = 10_000
RETRY_SECONDS = 1.0  # after a failed write, wait this long before trying the file again


def _clean(value: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN, and readers must not see one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    return value


def encode_line(record: dict[str, Any]) -> bytes:
    try:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere: write null instead
        line = json.dumps(_clean(record), separators=(",", ":"))
    return (line + "\n").encode("utf-8")


def kernel_path(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute with each ``..`` taken as the kernel takes it: the parent of the
    folder reached so far, symbolic links on the way followed (``os.path.abspath`` drops the name
    before it as text, which means another folder when that name is a link: ``a/link/../x`` is
    then ``a/x``, where the kernel opens ``x`` beside the link's target). Other names, links
    included, are kept as given; a name that does not exist yet is taken as the folder it will be."""
    given = Path(os.getcwd(), path)  # the current folder is physical; Path keeps '..' (and drops '.')
    resolved = Path(given.anchor)
    for part in given.parts[1:]:
        resolved = Path(os.path.realpath(resolved)).parent if part == ".." else resolved / part
    return resolved


class JsonLinesWriter:
    """Append records to a file; ``flush_every`` lines are buffered at most, and with
    ``flush_seconds`` (None = no limit) the first ``write`` this many seconds or more after the
    last flush writes what is buffered (no timer: without writes, lines wait for ``close``).

    ``max_bytes`` (None = never) rotates the file when the next line would make it larger;
    ``keep`` old files are kept. The constructor raises ``OSError`` (``UnsafePath`` included)
    when the file cannot be opened at all; later faults only set ``error`` (the last one, or
    None once writing works again) and count ``dropped`` lines. With ``open_later``, only an
    ``UnsafePath`` raises: any other fault at opening (a full disk, a folder that cannot be made)
    sets ``error``, lines wait as for a failed write, and the file is opened when it can be.
    """

    def __init__(self, path: str | Path, flush_every: int = 1, max_bytes: int | None = None, keep: int = 5,
                 open_later: bool = False, flush_seconds: float | None = None) -> None:
        if flush_seconds is not None and not 0 <= flush_seconds < math.inf:  # also refuses NaN
            raise ValueError(f"flush_seconds must be a finite number of seconds >= 0 or None; got {flush_seconds!r}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be positive or None; got {max_bytes}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0; got {keep}")
        self.path = kernel_path(path)  # absolute: a later chdir must not move the log (reopen_if_replaced)
        self.max_bytes = max_bytes
        self.keep = keep
        self._flush_every = max(1, flush_every)
        self._flush_seconds = flush_seconds
        self._flushed_at = time.monotonic()  # the last flush (or the opening)
        self._pending: deque[bytes] = deque()
        self.dropped = 0  # lines lost since the last successful write (reported in a log_gap record)
        self.error: OSError | None = None
        self._retry_at = 0.0
        self._size = 0
        self._fd: int | None = None
        self._folder: Folder | None = None  # the log's folder, open while the log is
        self._closed = False
        try:
            self._open()
        except UnsafePath:
            raise
        except OSError as error:
            if not open_later:
                raise
            self.error, self._retry_at = error, time.monotonic() + RETRY_SECONDS

    def _open(self) -> None:
        """Walk to the log's folder (made if missing) and open the log in it."""
        folder = open_folder(self.path.parent, create=True)
        try:
            self._open_in(folder)
        except BaseException:
            folder.close()
            raise
        self._close_folder()
        self._folder = folder

    def _open_in(self, folder: Folder) -> None:
        fd, _ = folder.open(self.path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._fd, self._size = fd, os.fstat(fd).st_size

    def _close_folder(self) -> None:
        if self._folder is not None:
            self._folder.close()
            self._folder = None

    def write(self, record: dict[str, Any]) -> None:
        if self._closed:
            return
        self._pending.append(encode_line(record))
        if len(self._pending) > MAX_PENDING_LINES:
            self._pending.popleft()
            self.dropped += 1
        if len(self._pending) >= self._flush_every or (
                self._flush_seconds is not None and time.monotonic() - self._flushed_at >= self._flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Write what is pending; on a fault keep it for later and set ``error``."""
        if not self._pending or self._closed:
            return
        now = time.monotonic()
        if self.error is not None and now < self._retry_at:
            return
        self._flushed_at = now
        try:
            if self._fd is None:
                self._open()
            if self.dropped:
                self._pending.appendleft(encode_line({"t": time.time(), "event": "log_gap", "dropped": self.dropped}))
                self.dropped = 0
            while self._pending:
                batch = self._batch()
                if not batch:  # the next line does not fit: a new file first
                    self._rotate()
                    batch = self._batch() or 1
                self._write_lines(batch)
        except OSError as error:
            self.error, self._retry_at = error, now + RETRY_SECONDS
            return
        self.error = None

    def _batch(self) -> int:
        """How many pending lines fit in the current file (all of them when not rotating)."""
        if self.max_bytes is None:
            return len(self._pending)
        room, count = self.max_bytes - self._size, 0
        for line in self._pending:
            if len(line) > room and (count or self._size):
                break
            room -= len(line)
            count += 1
        return count

    def _write_lines(self, count: int) -> None:
        """Write the first ``count`` pending lines in one go; after a partial write, only the rest
        stays pending (a line cut by a full disk is completed, not repeated)."""
        data = b"".join(itertools.islice(self._pending, count)) if count > 1 else self._pending[0]
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        finally:
            self._size += done
            while done and self._pending:
                line = self._pending[0]
                if len(line) <= done:
                    done -= len(line)
                    self._pending.popleft()
                else:
                    self._pending[0] = line[done:]
                    done = 0

    def _rotate(self) -> None:
        """x.jsonl -> x.jsonl.1 -> ... -> x.jsonl.<keep>; the oldest beyond ``keep`` is removed.
        In the folder the log was opened in (its descriptor), as the new log is."""
        os.close(self._fd)
        self._fd = None
        folder = self._folder
        if self.keep == 0:
            folder.remove(self.path.name)
        else:
            for index in range(self._rotated_chain(folder), 0, -1):
                folder.rename(self._rotated(index), self._rotated(index + 1))
            folder.rename(self.path.name, self._rotated(1))
        self._open_in(folder)

    def _rotated(self, index: int) -> str:
        return f"{self.path.name}.{index}"

    def _rotated_chain(self, folder: Folder) -> int:
        """How many of x.jsonl.1, .2, ... exist in a row, at most ``keep - 1`` (the ones to shift
        up; a file at ``keep`` is replaced). Looks at existing files only, so a huge ``keep`` costs
        nothing."""
        count = 0
        while count < self.keep - 1 and folder.identity(self._rotated(count + 1)) is not None:
            count += 1
        return count

    def reopen_if_replaced(self) -> bool:
        """True if the file was removed or replaced under the open descriptor (an ``rm``, an
        outside rotation, its folder removed): the descriptor is closed and the next write opens
        the path anew, so lines stop going to a file nobody can read."""
        if self._fd is None or self._closed:
            return False
        held = os.fstat(self._fd)
        try:
            with open_folder(self.path.parent) as folder:  # a folder on the way swapped counts as replaced
                on_disk = folder.identity(self.path.name)
        except OSError:
            on_disk = None
        if on_disk == (held.st_dev, held.st_ino):
            return False
        os.close(self._fd)
        self._fd, self._size = None, 0
        self._close_folder()
        return True

    def close(self) -> int:
        """Write what is pending (one last try) and close; the number of lines lost (0 normally)."""
        if self._closed:
            return 0
        self.error = None  # one last try, whatever the retry delay
        self.flush()
        self._closed = True
        lost = len(self._pending) + self.dropped
        self._pending.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._close_folder()
        return lost


def rotated_files(path: str | Path) -> list[Path]:
    """``path`` and its rotated predecessors that exist, oldest first (``x.jsonl.3``, ..., ``x.jsonl``)."""
    path = Path(path)
    older = []
    index = 1
    while (candidate := path.with_name(f"{path.name}.{index}")).exists():
        older.append(candidate)
        index += 1
    return [*reversed(older), *([path] if path.exists() else [])]


def finite_number(value: object) -> bool:
    """Whether a decoded JSON value is a finite number: an int (not a bool) or a float that is
    not NaN or infinite. An integer too large for a float (JSON allows 400 digits) is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def read_json_lines(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file; a malformed line (e.g. cut off by a kill, or nested too deep
    to decode) is skipped."""
    with Path(path).open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue
            if isinstance(record, dict):
                yield record
