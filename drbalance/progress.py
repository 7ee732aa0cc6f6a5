"""Progress bars with an estimate of the time left (tqdm) for the long commands: ``drbalance
demo``, ``launch`` and ``simulate --compare``.

Bars go to stderr, and only when it is a terminal or when asked (``--progress``); ``--no-progress``
turns them off. Logs, pipes and tests stay clean by default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: bars when stderr is a terminal)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars with the estimated time left, on stderr (default: when stderr is a "
                        "terminal)")


def wanted(choice: bool | None, stream: TextIO | None = None) -> bool:
    """Whether to show bars: the user's ``choice``, else whether ``stream`` (stderr) is a terminal."""
    if choice is not None:
        return choice
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class NoBar:
    """What a bar does when progress is off: nothing (``write`` still prints, to stdout)."""

    n = 0

    def update(self, count: float = 1) -> None:
        self.n += count

    def set_postfix_str(self, text: str) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(enabled: bool, total: float, description: str, unit: str, **options: Any) -> Any:
    """A tqdm bar on stderr (``total`` steps of ``unit``), or a :class:`NoBar` when not ``enabled``.

    Its ``write`` prints a line to stdout without tearing the bar.
    """
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    progress = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} "
                    "[{elapsed} elapsed, {remaining} left{postfix}]", **options)
    progress.write = lambda text: tqdm.write(text, file=sys.stdout)  # type: ignore[method-assign]
    return progress
