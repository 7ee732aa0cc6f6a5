"""What a command printed reaches its standard output, or the command says it did not.

Python buffers standard output when it is not a terminal, so a write to a full disk (or to
``/dev/full``, a quota, a dead NFS mount) fails at some later write, where the error names no
file; argparse drops such an error of ``--help`` without a word, and one at the interpreter's
exit flush leaves a traceback. The entry points run inside :func:`watched`, which remembers the
first failed write, and flush before they return (:meth:`Watched.lost`), so the error says
"standard output" and the exit status is not 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class Watched:
    """Standard output passed through, remembering the first ``OSError`` of a write or flush but a
    broken pipe (``| head``: the reader has what it wanted, nothing is lost); every other
    attribute is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.error: OSError | None = None
        self.reported = False  # the error was told to the user already

    def write(self, text: str) -> int:
        return self._recorded(self.stream.write, text)

    def flush(self) -> None:
        self._recorded(self.stream.flush)

    def _recorded(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, its ``OSError`` (but a broken pipe) remembered before it goes on."""
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def caused(self, error: BaseException) -> bool:
        """Whether ``error`` is a failed write to standard output (one that names no file, while
        standard output had not failed before, and it now fails to flush)."""
        if error is self.error:
            return True
        if self.error is not None:
            return False  # standard output failed before: this one is another error
        return isinstance(error, OSError) and error.filename is None and self.lost() is not None

    def lost(self) -> OSError | None:
        """Flush; the first error of writing standard output, or None if all of it was written (or
        its reader left: a broken pipe).

        After an error, the descriptor is pointed at ``/dev/null``: the interpreter's own flush at
        exit then has nothing left to fail on (no second, unexplained error)."""
        failed = False
        try:
            self.flush()
        except OSError:  # recorded by ``flush``, or a broken pipe
            failed = True
        except ValueError:  # closed already: what it held was written or reported then
            return self.error
        if failed or self.error is not None:
            point_at_devnull(self.stream)
        return self.error

    def report(self, program: str) -> bool:
        """Flush; whether what the command printed was lost, which is then said on stderr (once)."""
        error = self.lost()
        if error is not None and not self.reported and sys.stderr is not None:
            print(f"{program}: error: {message(error)}", file=sys.stderr)
        self.reported = self.reported or error is not None
        return error is not None


def point_at_devnull(stream: TextIO) -> None:
    """``stream``'s descriptor made a copy of ``/dev/null``'s (if it has one: not a stream in memory)."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)


def message(error: OSError) -> str:
    """A failed write to standard output, for a person."""
    return f"cannot write standard output: {error.strerror or error}"


@contextmanager
def watched() -> Iterator[Watched | None]:
    """``sys.stdout`` replaced by a :class:`Watched` of it for the block (None if there is none)."""
    original = sys.stdout
    if original is None:
        yield None
        return
    watch = Watched(original)
    sys.stdout = watch  # type: ignore[assignment]
    try:
        yield watch
    finally:
        if sys.stdout is watch:
            sys.stdout = original
