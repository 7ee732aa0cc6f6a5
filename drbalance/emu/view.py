"""The emulated GPUs a job sees: the machine's or its user's, as ``CUDA_VISIBLE_DEVICES`` shows them.

A job's emulated GPUs are the machine's when a system manager publishes some
(``drbalance.ipc.system.find()`` gives a folder with ``emulated.json``): then every user's jobs
share them, and the machine's count and memory size win over what the job asked for
(``DRBALANCE_EMULATED_GPUS``, ``--devices emulated:N`` then only turn emulation on), with one
warning where they differ. Otherwise they are the user's own (``UserHome``), as many as asked
for. A system folder the job must not trust gives one warning, and the user's own GPUs.

Of those, the job sees the ones ``CUDA_VISIBLE_DEVICES`` makes visible (``drbalance.emu.visible``),
numbered from 0 in its order: device ``d`` is GPU ``indices[d]`` of its home, with that GPU's UUID.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from drbalance.clock import Clock
from drbalance.emu.gpus import EmulatedGpu, open_emulated_gpus
from drbalance.emu.home import GpuHome, UserHome, emulated_uuid
from drbalance.emu.layout import DEFAULT_MEMORY_BYTES, check_memory_size, size_text
from drbalance.emu.machine import MachineGpuMissing, MachineHome, MachineSpec
from drbalance.emu.visible import VARIABLE, visible_devices
from drbalance.ipc import system
from drbalance.ipc.names import IpcNames
from drbalance.ipc.private import user_name
from drbalance.ipc.system import SystemPlace


@dataclass(frozen=True)
class EmulatedView:
    """A job's emulated devices: device ``d`` is GPU ``indices[d]`` (UUID ``uuids[d]``) of the
    machine's GPUs in ``place``, or of this user's own in ``namespace`` (``place`` None);
    ``total``: the GPUs there are; ``memory_bytes``: each one's memory size; ``visible``: the
    ``CUDA_VISIBLE_DEVICES`` they were chosen by (None: unset)."""

    place: SystemPlace | None
    namespace: str
    indices: tuple[int, ...]
    uuids: tuple[str, ...]
    total: int
    memory_bytes: int
    visible: str | None = None

    @property
    def count(self) -> int:
        """How many devices the job sees."""
        return len(self.indices)

    def describe(self) -> str:
        """Which GPUs the job sees, for messages."""
        whose = (f"the machine's {self.total} emulated GPUs ({self.place.emulated})" if self.place is not None
                 else f"this user's {self.total} emulated GPUs")
        if self.visible is None:
            return whose
        return (f"{self.count} of {whose}, as {VARIABLE}={self.visible!r} gives: GPU(s) "
                f"{', '.join(map(str, self.indices))}")


def emulated_view(count: int, memory_bytes: int = DEFAULT_MEMORY_BYTES, namespace: str | None = None) -> EmulatedView:
    """The emulated devices a job asking for ``count`` GPUs of ``memory_bytes`` each sees (see the
    module). ``ValueError`` for a bad namespace or ``CUDA_VISIBLE_DEVICES`` that leaves no device
    (``NoVisibleDevice``), or the machine's ``emulated.json`` unreadable; ``UnsafePath`` for one
    of its files that a job must not trust."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"need at least one emulated GPU; got {count!r}")
    check_memory_size(memory_bytes)
    names = IpcNames.current(namespace)
    place = machine_place(names.namespace)
    spec = _machine_spec(place) if place is not None else None
    if place is not None and spec is not None:
        if (spec.count, spec.memory_bytes) != (count, memory_bytes):
            warnings.warn(f"drbalance: this machine's system manager emulates {spec.count} GPUs of "
                          f"{size_text(spec.memory_bytes)} ({place.emulated}); every job here uses those, not the "
                          f"{count} of {size_text(memory_bytes)} asked for (DRBALANCE_EMULATED_GPUS or --devices "
                          f"emulated then only turn emulation on)", RuntimeWarning, stacklevel=1)
        uuids, memory_bytes, where = spec.uuids, spec.memory_bytes, f"the machine's {spec.count} emulated GPUs"
    else:
        place = None
        uuids = tuple(emulated_uuid(names, index) for index in range(count))
        where = f"this user's {count} emulated GPUs"
    indices = visible_devices(uuids, where)
    return EmulatedView(place, names.namespace, indices, tuple(uuids[index] for index in indices), len(uuids),
                        memory_bytes, os.environ.get(VARIABLE))


def open_view(view: EmulatedView, devices: Sequence[int] | None = None,
              clock: Clock | None = None) -> list[EmulatedGpu]:
    """Open ``devices`` of ``view`` (default: all), all or none; each ``EmulatedGpu`` is its
    home's GPU (``gpu.index``: the machine's or the user's index). ``MachineGpuMissing`` when the
    machine's GPUs the view was made from are gone, ``ValueError`` when they changed."""
    chosen = list(range(view.count)) if devices is None else list(devices)
    bad = [device for device in chosen if not 0 <= device < view.count]
    if bad:
        raise ValueError(f"emulated device {bad[0]} does not exist: the job sees {view.describe()}")
    home = _open_home(view)
    try:
        return open_emulated_gpus(home, [view.indices[device] for device in chosen], clock, view.memory_bytes)
    except BaseException:
        home.close()
        raise


def _open_home(view: EmulatedView) -> GpuHome:
    if view.place is None:
        return UserHome(IpcNames(view.namespace, os.getuid()))
    home = MachineHome.open(view.place)
    if home is None:
        raise MachineGpuMissing(view.place.emulated, "is gone: the machine's emulated GPUs this job was set up on "
                                "were removed (its system manager stopped); start the job again")
    if (home.spec.count, home.spec.memory_bytes) != (view.total, view.memory_bytes) or any(
            home.spec.uuids[index] != uuid for index, uuid in zip(view.indices, view.uuids)):
        home.close()
        raise ValueError(f"{view.place.emulated}: the machine's emulated GPUs changed since this job was set up "
                         f"({home.spec.count} GPUs of {size_text(home.spec.memory_bytes)} now, {view.total} of "
                         f"{size_text(view.memory_bytes)} then); start the job again")
    return home


def machine_place(namespace: str) -> SystemPlace | None:
    """The system manager's folder of ``namespace``; None, with one warning, where a job must not
    trust it or ``DRBALANCE_SYSTEM_DIR`` is bad."""
    try:
        return system.find(namespace)
    except (OSError, ValueError) as error:  # UnsafePath is an OSError
        warnings.warn(f"drbalance: not using this machine's emulated GPUs: {error}; this job uses "
                      f"{user_name(os.getuid())}'s own emulated GPUs", RuntimeWarning, stacklevel=1)
        return None


def _machine_spec(place: SystemPlace) -> MachineSpec | None:
    """What the machine's ``emulated.json`` says, or None where there is none."""
    home = MachineHome.open(place)
    if home is None:
        return None
    home.close()
    return home.spec
