"""The machine's emulated GPUs: made by its system manager, shared by every user's jobs.

Under a system manager (``drbalance.ipc.system``) emulated GPUs are the machine's, as real GPUs
are: every user's jobs on "GPU 0" take turns on one device and the manager reads one busy time
for it. The system manager (``EmulatedSource.for_machine``, through ``MachineHome.create``) makes
them in its folder ``<system dir>/<namespace>/``:

- ``emu.<i>.lock`` (mode 0666: a job locks the GPU's memory table with ``lockf``, which needs a
  descriptor open for writing; its exclusive ``flock`` is the GPU's turn) and ``emu.<i>.wait``
  (mode 0644: waiting jobs hold a shared ``flock``, which needs only an open descriptor);
- the segment ``/drb.machine.<namespace>.emu.<i>.<token>`` (mode 0666: the holder of a turn writes
  the busy time, and every job writes its own memory reservations);
- ``emulated.json`` (mode 0644, written last, replaced whole): the count, each GPU's memory size,
  the segments' tokens and the GPUs' UUIDs. The UUIDs come from the system dir's path, the
  namespace and the index, so two "nodes" with two system dirs on one machine have different GPUs.

Everything belongs to the system owner (``SystemPlace.owner``). A job never makes or removes
any of it: it opens each file relative to the checked folder's descriptor, never through a
link, and each file and segment must be a regular file of the system owner (or of root); a
missing or untrusted one is an error that names it. A job holds a shared ``flock`` on
``emulated.json`` while it has the machine's GPUs open, so the system manager, when it stops,
removes them only when no job does (an exclusive ``flock``, tried once): otherwise it leaves them,
and the next system manager adopts them. What another user can do to these GPUs (they are a
testing and demo device, not an isolation boundary) is in docs/emulation.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import posix_ipc

from drbalance.emu.home import UUID_NAMESPACE, GpuHome, flock_within
from drbalance.emu.layout import SPEC, SPEC_OFFSET, check_memory_size, size_text
from drbalance.ipc import objects
from drbalance.ipc.layout import RecordError, SegmentKind
from drbalance.ipc.names import TOKEN_PATTERN, new_token
from drbalance.ipc.private import UnsafePath, user_name
from drbalance.ipc.records import Segment
from drbalance.ipc.system import EMULATED_NAME, SystemPlace

if TYPE_CHECKING:
    from drbalance.emu.gpus import EmulatedGpu

SPEC_VERSION = 1  # emulated.json's layout
LOCK_MODE = 0o666  # lockf (the memory table's lock) needs a descriptor open for writing
WAIT_MODE = 0o644  # flock (waiting for a turn) needs only an open descriptor
SEGMENT_MODE = 0o666  # the holder of a turn writes the busy time; every job writes its reservations
SPEC_MODE = 0o644  # every job reads it; only the system owner writes it
MAX_SPEC_BYTES = 1 << 16  # emulated.json of 32 GPUs is about 3 KB
MAX_GPUS = 32  # as ``emulated_spec`` allows
LOCK_PATIENCE = 2.0  # seconds a job waits for its shared lock on emulated.json before going on without it
OPEN_ATTEMPTS = 5  # times a job opens emulated.json again when it was replaced under it
_GPU_FILE = re.compile(r"^emu\.[0-9]+\.(lock|wait)$")
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO put there cannot block us


class MachineGpuMissing(FileNotFoundError):
    """A file or segment of the machine's emulated GPUs is not there (the text names it)."""

    def __init__(self, shown: str | os.PathLike[str], reason: str) -> None:
        super().__init__(errno.ENOENT, reason, os.fspath(shown))
        self.message = f"{os.fspath(shown)}: {reason}"

    def __str__(self) -> str:
        return self.message


def machine_uuid(place: SystemPlace, index: int) -> str:
    """The UUID of the machine's emulated GPU ``index`` (``GPU-xxxxxxxx-...``), from the system
    dir's path, the namespace and the index."""
    return f"GPU-{uuidlib.uuid5(UUID_NAMESPACE, f'machine:{place.root}/{place.namespace}/{index}')}"


@dataclass(frozen=True)
class MachineSpec:
    """What ``emulated.json`` says: how many GPUs, each one's memory (bytes), their segments'
    tokens and their UUIDs."""

    count: int
    memory_bytes: int
    tokens: tuple[str, ...]
    uuids: tuple[str, ...]

    def encode(self) -> bytes:
        return (json.dumps({"version": SPEC_VERSION, "count": self.count, "memory_bytes": self.memory_bytes,
                            "tokens": list(self.tokens), "uuids": list(self.uuids)}, indent=1) + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes, shown: Path) -> MachineSpec:
        """The spec in ``raw`` (the file ``shown``); ``ValueError`` naming the file for anything else."""
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{shown}: not JSON ({error})") from None
        if not isinstance(data, dict) or data.get("version") != SPEC_VERSION:
            raise ValueError(f"{shown}: not an emulated GPU spec of version {SPEC_VERSION}")
        count, memory, tokens, uuids = (data.get(key) for key in ("count", "memory_bytes", "tokens", "uuids"))
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_GPUS:
            raise ValueError(f"{shown}: count {count!r} is not 1..{MAX_GPUS}")
        if isinstance(memory, bool) or not isinstance(memory, int):
            raise ValueError(f"{shown}: memory_bytes {memory!r} is not a whole number of bytes")
        check_memory_size(memory, f"{memory} in {shown}")
        for key, values, valid in (("tokens", tokens, TOKEN_PATTERN.match), ("uuids", uuids, _is_gpu_uuid)):
            if not isinstance(values, list) or len(values) != count or not all(
                    isinstance(value, str) and valid(value) for value in values):
                raise ValueError(f"{shown}: {key} must be {count} {'tokens' if key == 'tokens' else 'GPU UUIDs'}")
        return cls(count, memory, tuple(tokens), tuple(uuids))


def _is_gpu_uuid(text: str) -> bool:
    try:
        return text.startswith("GPU-") and str(uuidlib.UUID(text[4:])) == text[4:]
    except ValueError:
        return False


class MachineHome(GpuHome):
    """The machine's emulated GPUs of one system manager's folder (see the module).

    A job gets one from ``open`` (a shared ``flock`` on ``emulated.json`` held until ``close``),
    the system manager from ``create``; each holds the checked folder's descriptor and reads or
    makes the GPUs' files relative to it. A home opened for a set of GPUs is released with them
    (``release``).
    """

    def __init__(self, place: SystemPlace, folder_fd: int, spec_fd: int, spec: MachineSpec, makes: bool) -> None:
        self.place = place
        self.namespace = place.namespace
        self.owner = place.owner
        self.makes = makes
        self.spec = spec
        self._folder_fd: int | None = folder_fd
        self._spec_fd: int | None = spec_fd

    # --- a job's --------------------------------------------------------------------------------
    @classmethod
    def open(cls, place: SystemPlace) -> MachineHome | None:
        """The machine's emulated GPUs as ``emulated.json`` publishes them, for a job; None when the
        folder has no ``emulated.json`` (its system manager emulates no GPUs) or is gone.
        ``UnsafePath`` for a folder or file a job must not trust, ``ValueError`` for a spec it
        cannot read."""
        try:
            folder = place.open_folder()
        except FileNotFoundError:
            return None
        try:
            for _ in range(OPEN_ATTEMPTS):
                spec_fd = _open_spec(folder, place)
                if spec_fd is None:
                    os.close(folder)
                    return None
                try:
                    # a system manager holds it exclusively only while it removes the GPUs; after
                    # LOCK_PATIENCE (another user holding it) the job goes on without it
                    flock_within(spec_fd, fcntl.LOCK_SH, LOCK_PATIENCE)
                    if not _published(folder, spec_fd):  # removed or replaced meanwhile: read the folder again
                        os.close(spec_fd)
                        continue
                    spec = MachineSpec.decode(_read(spec_fd), place.emulated)
                except BaseException:
                    os.close(spec_fd)
                    raise
                return cls(place, folder, spec_fd, spec, makes=False)
        except BaseException:
            os.close(folder)
            raise
        os.close(folder)
        raise UnsafePath(place.emulated, f"was replaced each of {OPEN_ATTEMPTS} times it was opened")

    # --- the system manager's -----------------------------------------------------------------
    @classmethod
    def create(cls, place: SystemPlace, count: int, memory_bytes: int) -> MachineHome:
        """The machine's ``count`` emulated GPUs of ``memory_bytes`` each, for the system manager:
        made afresh, or, where a previous system manager left GPUs that jobs still use, those
        (``ValueError`` when they are not ``count`` GPUs of ``memory_bytes``). ``UnsafePath`` unless
        this process is the system owner."""
        me = os.geteuid()
        if place.owner != me:
            raise UnsafePath(place.folder, f"belongs to {user_name(place.owner)}: only the system owner makes the "
                             f"machine's emulated GPUs ({user_name(me)} is not)")
        if not 1 <= count <= MAX_GPUS:
            raise ValueError(f"emulated GPU count must be 1..{MAX_GPUS}; got {count}")
        check_memory_size(memory_bytes)
        folder = place.open_folder()
        try:
            adopted = cls._adopt_or_clear(place, folder, count, memory_bytes)
            return adopted if adopted is not None else cls._make(place, folder, count, memory_bytes)
        except BaseException:
            os.close(folder)
            raise

    @classmethod
    def _adopt_or_clear(cls, place: SystemPlace, folder: int, count: int, memory_bytes: int) -> MachineHome | None:
        """The GPUs a previous system manager left that jobs still use (held ``emulated.json``), or
        None once what it left unused is removed."""
        spec_fd = _open_spec(folder, place)
        if spec_fd is None:
            _remove_files(folder)  # a manager killed while it made them: its files, no spec
            return None
        try:
            fcntl.flock(spec_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # jobs hold it: they use those GPUs
            try:
                spec = MachineSpec.decode(_read(spec_fd), place.emulated)
                if (spec.count, spec.memory_bytes) != (count, memory_bytes):
                    raise ValueError(
                        f"{place.emulated}: jobs use the {spec.count} emulated GPUs of {size_text(spec.memory_bytes)} "
                        f"({spec.memory_bytes} bytes) that a previous system manager made; this one asks for {count} "
                        f"of {size_text(memory_bytes)} ({memory_bytes} bytes): give the same spec, or start it again "
                        f"once those jobs ended")
            except BaseException:
                os.close(spec_fd)
                raise
            return cls(place, folder, spec_fd, spec, makes=True)
        try:
            try:
                left: MachineSpec | None = MachineSpec.decode(_read(spec_fd), place.emulated)
            except ValueError:  # unreadable: its files go; its segments' names are unknown
                left = None
            _remove_published(folder, place, left)
        finally:
            os.close(spec_fd)  # releases the lock
        return None

    @classmethod
    def _make(cls, place: SystemPlace, folder: int, count: int, memory_bytes: int) -> MachineHome:
        """Make ``count`` GPUs (files, segments) and publish them in ``emulated.json`` last."""
        spec = MachineSpec(count, memory_bytes, tuple(new_token() for _ in range(count)),
                           tuple(machine_uuid(place, index) for index in range(count)))
        try:
            for index in range(count):
                _make_file(folder, _lock_name(index), LOCK_MODE)
                _make_file(folder, _wait_name(index), WAIT_MODE)
                segment = Segment.create(_segment_name(place, spec, index), SegmentKind.EMULATED_GPU,
                                         mode=SEGMENT_MODE)
                try:
                    segment.area(SPEC_OFFSET, SPEC.size, f"emulated GPU {index} memory size").write(
                        SPEC.pack(memory_bytes))
                finally:
                    segment.close()
            spec_fd = _publish(folder, spec)
        except BaseException:
            _remove_published(folder, place, spec)
            raise
        return cls(place, folder, spec_fd, spec, makes=True)

    # --- GpuHome ------------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return self.spec.memory_bytes

    def describe(self) -> str:
        return f"the machine's {self.spec.count} emulated GPUs ({self.place.emulated})"

    def uuid(self, index: int) -> str:
        return self.spec.uuids[self._checked(index)]

    def lock_path(self, index: int) -> Path:
        return self.place.emulated_lock(index)

    def wait_path(self, index: int) -> Path:
        return self.place.emulated_wait_lock(index)

    def segment_name(self, index: int) -> str:
        return _segment_name(self.place, self.spec, self._checked(index))

    def open_files(self, index: int) -> tuple[int, int]:
        self._checked(index)
        lock_fd = self._open_file(_lock_name(index), os.O_RDWR)
        try:
            wait_fd = self._open_file(_wait_name(index), os.O_RDONLY)
        except BaseException:
            os.close(lock_fd)
            raise
        return lock_fd, wait_fd

    def open_segment(self, index: int, lock_fd: int, memory_bytes: int) -> Segment:
        """The segment, the system owner's (the memory size is the spec's: ``memory_bytes`` is not asked)."""
        name = self.segment_name(index)
        try:
            return Segment.open(name, SegmentKind.EMULATED_GPU, owner=self.owner)
        except posix_ipc.ExistentialError:
            raise MachineGpuMissing(f"/dev/shm{name}", f"missing: the machine's emulated GPU {index} named in "
                                    f"{self.place.emulated} is not there (was its system manager's /dev/shm "
                                    f"cleared?); start the system manager again") from None
        except RecordError as error:  # truncated or overwritten: anyone may write it
            raise MachineGpuMissing(f"/dev/shm{name}", f"not a usable emulated GPU ({error}); start the system "
                                    f"manager again to make the machine's emulated GPUs afresh") from None

    def release(self, gpus: Sequence[EmulatedGpu]) -> dict[int, list[int]]:
        """Close ``gpus`` and the home. The system manager's (``makes``) also removes every GPU,
        with ``emulated.json``, when no job holds ``emulated.json``; else it returns the GPUs it
        sees mapped, with the pids (every GPU, with none, when it sees no job's mapping)."""
        for gpu in gpus:
            gpu.close()
        try:
            return self._remove_unless_used() if self.makes and self._spec_fd is not None else {}
        finally:
            self.close()

    def close(self) -> None:
        """Close the home's descriptors (a job's shared lock goes with the last of its copies: a
        forked child's copy stays its parent's); a second call does nothing."""
        for attribute in ("_spec_fd", "_folder_fd"):
            fd = getattr(self, attribute)
            setattr(self, attribute, None)
            if fd is not None:
                os.close(fd)

    # --- inside -------------------------------------------------------------------------------
    def _checked(self, index: int) -> int:
        if not 0 <= index < self.spec.count:
            raise ValueError(f"emulated GPU {index} is not one of {self.describe()}")
        return index

    def _open_file(self, name: str, flags: int) -> int:
        """The folder's file ``name`` (no link followed), checked to be the system owner's."""
        if self._folder_fd is None:
            raise ValueError(f"{self.place.folder}: the machine's emulated GPUs were released")
        shown = self.place.folder / name
        try:
            fd = os.open(name, flags | _FILE_FLAGS, dir_fd=self._folder_fd)
        except FileNotFoundError:
            raise MachineGpuMissing(shown, f"missing: {EMULATED_NAME} names a GPU whose file is not there; start "
                                    f"the system manager again") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePath(shown, "is a symbolic link: not followed") from None
            if error.errno == errno.EACCES:
                wanted = "writing (jobs lock its memory table)" if flags & os.O_RDWR else "reading"
                raise UnsafePath(shown, f"cannot be opened for {wanted}") from None
            raise
        try:
            _check_trusted(os.fstat(fd), shown, self.owner, shared=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _remove_unless_used(self) -> dict[int, list[int]]:
        try:
            fcntl.flock(self._spec_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            names = [self.segment_name(index) for index in range(self.spec.count)]
            users = objects.shm_users_of(names)  # the pids this user may see: all of them for root
            seen = {index: users[name] for index, name in enumerate(names) if users[name]}
            return seen or {index: [] for index in range(self.spec.count)}  # in use by jobs it cannot see
        if _published(self._folder_fd, self._spec_fd):  # not replaced by another manager's meanwhile
            _remove_published(self._folder_fd, self.place, self.spec)
        return {}


def _lock_name(index: int) -> str:
    return f"emu.{index}.lock"


def _wait_name(index: int) -> str:
    return f"emu.{index}.wait"


def _segment_name(place: SystemPlace, spec: MachineSpec, index: int) -> str:
    return place.shm_prefix() + f"emu.{index}.{spec.tokens[index]}"


def _check_trusted(info: os.stat_result, shown: Path, owner: int, shared: bool) -> None:
    """``UnsafePath`` unless ``info`` is a regular file of ``owner`` (or root) with one name, and,
    unless ``shared`` (a lock file others must write), not writable by group or others."""
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePath(shown, "is not a regular file")
    if info.st_uid not in (owner, 0):
        raise UnsafePath(shown, f"belongs to {user_name(info.st_uid)}, not to the system manager's "
                         f"{user_name(owner)}")
    if info.st_nlink != 1:
        raise UnsafePath(shown, f"has {info.st_nlink} names (a hard link to another file?)")
    if not shared and stat.S_IMODE(info.st_mode) & 0o022:
        raise UnsafePath(shown, f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")


def _open_spec(folder: int, place: SystemPlace) -> int | None:
    """A read descriptor of the folder's ``emulated.json``, checked; None when there is none."""
    try:
        fd = os.open(EMULATED_NAME, os.O_RDONLY | _FILE_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafePath(place.emulated, "is a symbolic link: not followed") from None
        raise
    try:
        _check_trusted(os.fstat(fd), place.emulated, place.owner, shared=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _published(folder: int, spec_fd: int) -> bool:
    """Whether ``spec_fd`` is still the folder's ``emulated.json`` (not removed or replaced)."""
    held = os.fstat(spec_fd)
    try:
        entry = os.stat(EMULATED_NAME, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return held.st_nlink > 0 and (entry.st_dev, entry.st_ino) == (held.st_dev, held.st_ino)


def _read(fd: int) -> bytes:
    data = os.pread(fd, MAX_SPEC_BYTES + 1, 0)
    if len(data) > MAX_SPEC_BYTES:
        raise ValueError(f"{EMULATED_NAME}: more than {MAX_SPEC_BYTES} bytes")
    return data


def _make_file(folder: int, name: str, mode: int) -> None:
    """A new empty file ``name`` in the folder, mode ``mode`` exactly (one left there is replaced)."""
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _FILE_FLAGS, mode, dir_fd=folder)
    try:
        os.fchmod(fd, mode)  # the umask cut the mode open gave
    finally:
        os.close(fd)


def _publish(folder: int, spec: MachineSpec) -> int:
    """Write ``emulated.json`` whole (a new file renamed over the name, in the folder), mode 0644;
    a descriptor of it, open for writing (a system manager's exclusive ``flock`` at its stop)."""
    temporary = f".{EMULATED_NAME}.{new_token()}"
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_RDWR | _FILE_FLAGS, 0o600, dir_fd=folder)
    try:
        data = spec.encode()
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.fchmod(fd, SPEC_MODE)
        os.fsync(fd)
        os.rename(temporary, EMULATED_NAME, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(temporary, dir_fd=folder)
        except FileNotFoundError:
            pass
        raise
    return fd


def _remove_published(folder: int, place: SystemPlace, spec: MachineSpec | None) -> None:
    """Remove ``emulated.json`` (first, so no job opens what follows), the segments ``spec`` names
    and every GPU's files in the folder."""
    try:
        os.unlink(EMULATED_NAME, dir_fd=folder)
    except FileNotFoundError:
        pass
    if spec is not None:
        for index in range(spec.count):
            objects.unlink_shared_memory(_segment_name(place, spec, index))
    _remove_files(folder)


def _remove_files(folder: int) -> None:
    """Remove every GPU's lock and wait file in the folder, and unpublished specs."""
    for entry in os.listdir(folder):
        if _GPU_FILE.match(entry) or entry.startswith(f".{EMULATED_NAME}."):
            try:
                os.unlink(entry, dir_fd=folder)
            except FileNotFoundError:
                pass
