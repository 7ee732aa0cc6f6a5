"""Act as another local user (a "neighbour" on a shared server) for the hardening tests.

``as_neighbour(actions)`` runs the actions in a forked child process whose uid and gid are those
of an unprivileged second user, and returns one result per action. Only
root can do that, so tests that use it are marked ``second_user`` and skip with the reason when
the suite does not run as root (CI runs it as root).

Actions (JSON lists): ``["shm", NAME, MODE]`` create shared memory (4096 bytes, mode exactly
MODE); ``["sem", NAME, MODE]``; ``["mq", NAME, MODE]``; ``["open_shm", NAME]`` / ``["open_sem",
NAME]`` / ``["open_mq", NAME]`` try to open an existing object; ``["send_mq", NAME]`` try to send
a message; ``["symlink", TARGET, LINK]``; ``["mkdir", PATH, MODE]``; ``["write", PATH, TEXT]``;
``["swap", A, B, STOP, VICTIM, EVERY]``: exchange the names A and B (``renameat2``'s
RENAME_EXCHANGE) over and over until the file STOP exists, removing the file VICTIM every EVERY
seconds (its result: ``"ok N"``, N exchanges made).
Each result is ``"ok"`` or the exception's class name and text.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import posix_ipc
import pytest

FALLBACK_UID = 65534  # "nobody" on most systems


def second_user() -> tuple[int, int, str]:
    """(uid, gid, name) of the unprivileged user the tests act as."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid, "nobody"
    except KeyError:
        return FALLBACK_UID, FALLBACK_UID, f"uid {FALLBACK_UID}"


needs_second_user = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="acting as a second local user needs root (setuid in a child); CI runs the suite as root",
)


THIRD_UID = 65533  # a second neighbour (no passwd entry needed), where "nobody" plays the victim


def as_neighbour(actions: list[list], timeout: float = 60.0, user: tuple[int, int] | None = None) -> list[str]:
    """Run ``actions`` as the second user (or as ``user``, a (uid, gid)); one result string per action.

    A forked child drops to the second user's uid and gid (the interpreter itself may live where
    that user cannot read it, so no new program is started) and reports through a pipe.
    """
    uid, gid = user if user is not None else second_user()[:2]
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        status = 1
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            data = json.dumps([_run(action) for action in actions]).encode()
            while data:
                data = data[os.write(writer, data):]
            status = 0
        finally:
            os._exit(status)
    os.close(writer)
    chunks = []
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(reader)
            raise TimeoutError(f"the neighbour process did not finish within {timeout} s")
        chunk = os.read(reader, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(reader)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"the neighbour process failed (wait status {status})")
    return json.loads(b"".join(chunks))


def _run(action: list) -> str:
    kind, *args = action
    try:
        if kind == "shm":
            name, mode = args
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=4096)
            os.fchmod(shm.fd, mode)
            os.write(shm.fd, b"planted by a neighbour")
            shm.close_fd()
        elif kind == "sem":
            name, mode = args
            posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=mode, initial_value=0).close()
            path = "/dev/shm/sem." + name.lstrip("/")
            if os.path.exists(path):
                os.chmod(path, mode)
        elif kind == "mq":
            name, mode = args
            queue = posix_ipc.MessageQueue(name, posix_ipc.O_CREX, mode=mode, max_messages=10, max_message_size=128)
            os.fchmod(queue.mqd, mode)
            queue.close()
        elif kind == "empty_files":  # count empty files named stem0, stem1, ... (cheap: no shm segment)
            stem, count = args
            for index in range(count):
                os.close(os.open(f"{stem}{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        elif kind == "open_shm":
            posix_ipc.SharedMemory(args[0]).close_fd()
        elif kind == "open_sem":
            posix_ipc.Semaphore(args[0]).close()
        elif kind == "open_mq":
            posix_ipc.MessageQueue(args[0]).close()
        elif kind == "send_mq":
            queue = posix_ipc.MessageQueue(args[0])
            queue.send(b"x" * 76, timeout=0)
            queue.close()
        elif kind == "symlink":
            os.symlink(args[0], args[1])
        elif kind == "mkdir":
            os.mkdir(args[0], args[1])
            os.chmod(args[0], args[1])
        elif kind == "write":
            with open(args[0], "w") as out:
                out.write(args[1])
        elif kind == "swap":
            return f"ok {_swap(*args)}"
        else:
            return f"ValueError: unknown action {kind}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


RENAME_EXCHANGE = 2  # linux/fs.h


def _swap(first: str, second: str, stop: str, victim: str, every: float) -> int:
    """Exchange the names ``first`` and ``second`` until ``stop`` exists, removing ``victim`` every
    ``every`` seconds; the number of exchanges."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_cwd = -100  # AT_FDCWD
    names = (first.encode(), second.encode())
    swaps, removed_at = 0, time.monotonic()
    while not os.path.exists(stop):
        if libc.renameat2(at_cwd, names[0], at_cwd, names[1], RENAME_EXCHANGE) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), first)
        swaps += 1
        if time.monotonic() - removed_at >= every:
            removed_at = time.monotonic()
            try:
                os.unlink(victim)
            except OSError:  # not there, or reached through the link: not hers to remove
                pass
    return swaps


@contextlib.contextmanager
def swapped_folder(target: Path, victim: str, every: float = 0.5) -> Iterator[tuple[Path, list[str]]]:
    """The second user's group-writable (setgid) folder in /tmp holding ``logs`` (a real folder)
    and ``trap`` (her symbolic link to ``target``), and a thread in which she exchanges the two
    names in a loop, removing ``logs/<victim>`` every ``every`` seconds, until the block ends.
    Yields ``logs`` and a list that holds her result (``"ok N"``: N exchanges) once it ended."""
    uid, gid, _ = second_user()
    base = Path(tempfile.mkdtemp(prefix="drbalance-swap-"))  # in /tmp: she can reach it
    shared, stop = base / "shared", base / "stop"
    logs, trap = shared / "logs", shared / "trap"
    result: list[str] = []
    try:
        os.chmod(base, 0o755)
        shared.mkdir()
        os.chown(shared, uid, gid)  # her folder, which the group may write (as docs allow for logs)
        os.chmod(shared, 0o2775)
        made = as_neighbour([["mkdir", str(logs), 0o2775], ["symlink", str(target), str(trap)]])
        if made != ["ok", "ok"]:
            raise RuntimeError(f"the neighbour could not set up her folder: {made}")
        swapper = threading.Thread(target=lambda: result.extend(as_neighbour(
            [["swap", str(logs), str(trap), str(stop), str(logs / victim), every]], timeout=600)))
        swapper.start()
        try:
            yield logs, result
        finally:
            stop.touch()
            swapper.join(timeout=600)
    finally:
        stop.touch()
        shutil.rmtree(base, ignore_errors=True)
