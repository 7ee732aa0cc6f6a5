"""Which emulated GPUs a job sees: ``CUDA_VISIBLE_DEVICES``, read as CUDA reads it.

A scheduler (Slurm's ``--gres=gpu:2``, a container runtime) gives a job GPUs by setting
``CUDA_VISIBLE_DEVICES``; on emulated GPUs the job then sees those, as CUDA would show them: a
job given ``2,3`` has two devices, 0 and 1, that are GPUs 2 and 3 of its home, with their UUIDs.
The rules are CUDA's (its documentation of the variable, and PyTorch's reading of it in
``torch.cuda._parse_visible_devices``, which follows the driver):

- unset: every GPU, in order; set but empty: none;
- a comma-separated list of GPU indices, or, when the value starts with ``GPU-``, of UUIDs, each
  also as an unambiguous prefix (``GPU-8932f937``); the devices are numbered in the list's order;
- an index is read as C's ``strtoul`` reads it: leading blanks and a sign, then digits, the rest of
  the entry ignored (``1gpu`` is 1);
- the list ends at its first invalid entry (no digits, a negative number, an index with no GPU, a
  UUID prefix that names no GPU or more than one, an entry without ``GPU-`` in a UUID list): the
  devices before it are visible (``0,2,-1,1`` gives 0 and 2);
- a device named twice makes no device visible;
- ``MIG-`` names (MIG instances) name no emulated GPU, so none is visible.

No visible device is an error (``NoVisibleDevice``), as CUDA's "no CUDA-capable device is
detected"; an entry that ends the list early gives a warning naming it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

VARIABLE = "CUDA_VISIBLE_DEVICES"
_STRTOUL = re.compile(r"^\s*([+-]?)([0-9]+)")


class NoVisibleDevice(ValueError):
    """``CUDA_VISIBLE_DEVICES`` leaves no emulated GPU visible (the text says why)."""


@dataclass(frozen=True)
class Visible:
    """What ``CUDA_VISIBLE_DEVICES`` makes visible of a home's GPUs: their indices, in device
    order; the entry that ended the list early (None if none did); whether a GPU was named twice."""

    indices: tuple[int, ...]
    stopped_at: str | None = None
    repeated: bool = False


def parse_visible(value: str | None, uuids: Sequence[str]) -> Visible:
    """The GPUs (indices into ``uuids``, the home's GPUs in order) that ``value`` of
    ``CUDA_VISIBLE_DEVICES`` makes visible, by the module's rules: the list is read first (up to
    an entry that is no index, or no ``GPU-`` name), then matched to the GPUs (up to an index with
    no GPU, or a name that matches none or several); a repeat in either step makes none visible."""
    if value is None:
        return Visible(tuple(range(len(uuids))))
    if value.startswith(("GPU-", "MIG-")):
        return _by_uuid(value.split(","), uuids)
    numbers: list[int] = []
    stopped_at = None
    for entry in value.split(","):
        number = _strtoul(entry)
        if number is not None and number in numbers:
            return Visible((), repeated=True)
        if number is None:
            stopped_at = entry
            break
        numbers.append(number)
    for position, number in enumerate(numbers):
        if number >= len(uuids):
            return Visible(tuple(numbers[:position]), str(number))
    return Visible(tuple(numbers), stopped_at)


def _strtoul(entry: str) -> int | None:
    """The index ``entry`` starts with as ``strtoul`` reads it; None for none or a negative one."""
    match = _STRTOUL.match(entry)
    if match is None:
        return None
    number = int(match.group(2))
    return None if match.group(1) == "-" and number > 0 else number


def _by_uuid(entries: list[str], uuids: Sequence[str]) -> Visible:
    names: list[str] = []
    stopped_at = None
    for entry in entries:
        if entry in names:
            return Visible((), repeated=True)
        if not entry.startswith("GPU-"):  # a MIG- name, or an entry of another kind
            stopped_at = entry
            break
        names.append(entry)
    chosen: list[int] = []
    for name in names:
        matches = [index for index, uuid in enumerate(uuids) if uuid.startswith(name)]
        if len(matches) != 1:  # no GPU, or an ambiguous prefix
            return Visible(tuple(chosen), name)
        if matches[0] in chosen:
            return Visible((), repeated=True)
        chosen.append(matches[0])
    return Visible(tuple(chosen), stopped_at)


def visible_devices(uuids: Sequence[str], where: str) -> tuple[int, ...]:
    """The GPUs of a home (``uuids``, in order; ``where``: whose they are, for messages) that this
    process's ``CUDA_VISIBLE_DEVICES`` makes visible. ``NoVisibleDevice`` when none is; a warning
    when an entry ends the list early."""
    value = os.environ.get(VARIABLE)
    visible = parse_visible(value, uuids)
    shown = f"{VARIABLE}={value!r}"
    if visible.repeated:
        raise NoVisibleDevice(f"{shown} names a GPU twice, so no device is visible (as CUDA sees none) among "
                              f"{where}: name each GPU once")
    if not visible.indices:
        reason = "is empty" if not value else f"starts with {visible.stopped_at!r}, which names none of them"
        raise NoVisibleDevice(f"{shown} {reason}, so no device is visible (as CUDA sees none) among {where}: give "
                              f"indices 0..{len(uuids) - 1} or UUIDs (GPU-...), comma-separated, or unset it")
    if visible.stopped_at is not None:
        warnings.warn(f"drbalance: {shown}: {visible.stopped_at!r} names none of {where}; as CUDA does, the "
                      f"devices before it are visible: GPU(s) {', '.join(map(str, visible.indices))}",
                      RuntimeWarning, stacklevel=1)
    return visible.indices
