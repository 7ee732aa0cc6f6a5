"""JSON Lines logs (SD logs, the manager log): one JSON object per line, appended."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


def _clean(value: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN, and readers must not see one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    return value


class JsonLinesWriter:
    """Append records to a file; ``flush_every`` lines are buffered at most."""

    def __init__(self, path: str | Path, flush_every: int = 1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._flush_every = max(1, flush_every)
        self._pending = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            line = json.dumps(record, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a NaN or infinity somewhere: write null instead
            line = json.dumps(_clean(record), separators=(",", ":"))
        self._file.write(line + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._pending:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None


def read_json_lines(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file; a malformed line (e.g. cut off by a kill) is skipped."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record
