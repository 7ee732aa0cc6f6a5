"""A test's code run as another local user: a forked child that drops to that user's uid and gid.

``UserProcess(uid, gid, function, *args)`` forks; the child sets its groups, gid and uid and calls
``function(channel, *args)``, where ``channel`` sends and receives JSON values to and from the
test (``send``, ``receive``); its return value (JSON) is the process's ``result()``, and an
exception it raises is one too, as ``"ErrorClass: text"``. No new program is started (the
interpreter may live where that user cannot read it), so the child runs the code the test process
has imported. Only root can drop to another user: tests that use it are marked ``second_user``
and skip with the reason when not root (``tests.helpers.neighbour.needs_second_user``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any


class Channel:
    """Lines of JSON over two pipes, each way one."""

    def __init__(self, reader: int, writer: int) -> None:
        self.reader, self.writer = reader, writer
        self._pending = b""

    def send(self, value: Any) -> None:
        data = json.dumps(value).encode() + b"\n"
        while data:
            data = data[os.write(self.writer, data):]

    def ready(self, timeout: float) -> bool:
        """Whether a value can be received within ``timeout`` seconds (one is buffered, or data came)."""
        if b"\n" in self._pending:
            return True
        readable, _, _ = select.select([self.reader], [], [], timeout)
        return bool(readable)

    def receive(self, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            if not self.ready(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"nothing received within {timeout} s")
            chunk = os.read(self.reader, 65536)
            if not chunk:
                raise EOFError("the other side closed its end")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


class UserProcess:
    """``function(channel, *args)`` running as ``uid``/``gid`` in a forked child (see the module)."""

    def __init__(self, uid: int, gid: int, function: Callable[..., Any], *args: Any) -> None:
        to_child_r, to_child_w = os.pipe()
        to_test_r, to_test_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into the test
            status = 1
            try:
                os.close(to_child_w)
                os.close(to_test_r)
                channel = Channel(to_child_r, to_test_w)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                try:
                    outcome = {"result": function(channel, *args)}
                except Exception as error:
                    outcome = {"error": f"{type(error).__name__}: {error}"}
                channel.send({"outcome": outcome})
                status = 0
            finally:
                os._exit(status)
        os.close(to_child_r)
        os.close(to_test_w)
        self.channel = Channel(to_test_r, to_child_w)

    def send(self, value: Any) -> None:
        self.channel.send(value)

    def receive(self, timeout: float = 60.0) -> Any:
        """The child's next value; ``AssertionError`` with its outcome if it ended instead."""
        message = self.channel.receive(timeout)
        if isinstance(message, dict) and "outcome" in message:
            raise AssertionError(f"the child ended early: {message['outcome']}")
        return message

    def result(self, timeout: float = 60.0) -> Any:
        """What ``function`` returned (or ``"ErrorClass: text"`` for what it raised), once it ended."""
        try:
            message = self.channel.receive(timeout)
            while not (isinstance(message, dict) and "outcome" in message):
                message = self.channel.receive(timeout)
        finally:
            self.close()
        outcome = message["outcome"]
        return outcome.get("result", outcome.get("error"))

    def close(self) -> None:
        """End the child (if it still runs) and reap it; close the pipes."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = 0
            os.close(self.channel.reader)
            os.close(self.channel.writer)
