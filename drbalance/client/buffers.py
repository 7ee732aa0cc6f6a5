"""One forward over several chunks advances a module's buffers once (BatchNorm's running stats).

Each replica starts from the buffers' values before the forward. Afterwards every buffer holds
one step's worth of change:

- a floating-point buffer becomes ``start + sum_i w_i * (value_i - start)``, where ``value_i`` is
  what replica ``i`` left in it and ``w_i`` its share of the batch's samples. For BatchNorm this
  moves ``running_mean`` towards the whole batch's mean, exactly as the bare module on the whole
  batch would; ``running_var`` moves towards the sample-weighted mean of the per-chunk (unbiased)
  variances, which leaves out the spread between the chunks' means.
- any other buffer (``num_batches_tracked``) takes the first replica's value: it advances once.

A buffer that no replica changed keeps its exact value. ``nn.DataParallel`` instead keeps only
the update made by the replica on ``device_ids[0]`` (its chunk's statistics) and none when that
device holds no chunk; running the chunks one after another on one module would advance them
once per chunk. Writes go through ``.data`` so that autograd's saved-tensor version checks do not
fire for the chunks' pending backward passes (BatchNorm does not use running statistics in its
training-mode backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def tracked_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The module's buffers, each once (a buffer shared by two submodules is merged once)."""
    seen: set[int] = set()
    buffers = []
    for buffer in module.buffers():
        if id(buffer) not in seen:
            seen.add(id(buffer))
            buffers.append(buffer)
    return buffers


def any_training(module: nn.Module) -> bool:
    """Whether ``module`` or any of its submodules is in training mode: a model put in eval mode
    with some layers back in training mode (test-time adaptation of batch norm, a head trained
    on a frozen backbone) still changes those layers' buffers in its forward."""
    return module.training or any(part.training for part in module.modules())


def buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (submodule, name, buffer) of ``module``: where a forward that reassigns a buffer
    (``self.steps = self.steps + 1``) puts the new tensor."""
    return [(owner, name, buffer) for owner in module.modules() for name, buffer in owner._buffers.items()
            if buffer is not None]


class BufferMerge:
    """Snapshot the buffers before a multi-chunk forward, collect each chunk's change, merge."""

    __slots__ = ("targets", "floats", "others", "float_data", "other_data", "start_floats", "start_others",
                 "delta", "first_others", "slots", "kept_replacements")

    def __init__(self, buffers: Sequence[torch.Tensor],
                 slots: Sequence[tuple[nn.Module, str, torch.Tensor]] = ()) -> None:
        self.slots = list(slots)  # the sequential path: buffers a chunk's forward may have replaced
        self.targets = list(buffers)
        self.floats = [b for b in self.targets if b.is_floating_point()]
        self.others = [b for b in self.targets if not b.is_floating_point()]
        # aliases that write without bumping autograd's version counters (see the module docstring)
        self.float_data = [b.data for b in self.floats]
        self.other_data = [b.data for b in self.others]
        with torch.no_grad():
            self.start_floats = [b.detach().clone() for b in self.floats]
            self.start_others = [b.detach().clone() for b in self.others]
        self.delta: list[torch.Tensor] | None = None
        self.first_others: list[torch.Tensor] | None = None
        self.kept_replacements: dict[tuple[int, str], torch.Tensor] = {}

    @classmethod
    def for_forward(cls, module: nn.Module, chunks: int) -> BufferMerge | None:
        """A merge for a forward over several chunks with a submodule in training mode; None when
        nothing to do."""
        if chunks < 2 or not any_training(module):
            return None
        buffers = tracked_buffers(module)
        return cls(buffers, buffer_slots(module)) if buffers else None

    def add(self, floats: Sequence[torch.Tensor], others: Sequence[torch.Tensor], weight: float) -> None:
        """Record one replica's buffer values (same order as ``self.floats`` / ``self.others``)."""
        with torch.no_grad():
            if self.floats:
                change = torch._foreach_sub(list(floats), self.start_floats)
                torch._foreach_mul_(change, weight)
                if self.delta is None:
                    self.delta = list(change)
                else:
                    torch._foreach_add_(self.delta, change)
            if self.first_others is None:
                self.first_others = [b.detach().clone() for b in others]

    # --- the sequential path: chunks run one after another on the module itself ------------------
    def install_copies(self) -> None:
        """Before a chunk's forward: give the module fresh copies of the buffers' values before the
        forward, as each replica of ``nn.DataParallel`` has its own. The chunk changes (or replaces)
        only its copies, so a tensor its forward saved for the backward (a buffer updated in place,
        then used) is never changed by a later chunk or by the merge; the originals keep the values
        before the forward until :meth:`put_back` and :meth:`finish`."""
        with torch.no_grad():
            copies: dict[int, torch.Tensor] = {}
            for owner, name, original in self.slots:
                copy = copies.get(id(original))
                if copy is None:  # a buffer shared by two submodules stays shared
                    copy = copies[id(original)] = original.detach().clone()
                owner._buffers[name] = copy

    def add_module_values(self, weight: float) -> None:
        """After a chunk's forward: record the values its copies hold now (or what its forward put in
        their place, e.g. ``self.ema = 0.9 * self.ema + ...``). A replacement of another shape or
        dtype contributes no change and is left in the module by :meth:`put_back`, as the last chunk
        made it."""
        values: dict[int, torch.Tensor] = {}
        for owner, name, original in self.slots:
            current = owner._buffers.get(name)
            if current is None or current.shape != original.shape or current.dtype != original.dtype:
                if current is not None:
                    self.kept_replacements[(id(owner), name)] = current
                continue
            self.kept_replacements.pop((id(owner), name), None)
            values.setdefault(id(original), current.detach())
        floats = [values.get(id(b), start) for b, start in zip(self.floats, self.start_floats)]
        others = [values.get(id(b), start) for b, start in zip(self.others, self.start_others)]
        self.add(floats, others, weight)

    def put_back(self) -> None:
        """Put the original buffers back in the module (after the chunks, or on an error)."""
        for owner, name, original in self.slots:
            owner._buffers[name] = self.kept_replacements.get((id(owner), name), original)

    def restore(self) -> None:
        """Put every buffer back to its value before the forward."""
        self._write(self.start_floats, self.start_others)

    def finish(self) -> None:
        """Write the merged values: start + weighted change; other buffers from the first replica."""
        with torch.no_grad():
            floats = torch._foreach_add(self.start_floats, self.delta) if self.delta is not None else self.start_floats
        self._write(list(floats), self.first_others if self.first_others is not None else self.start_others)

    def _write(self, floats: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.float_data:
                torch._foreach_copy_(self.float_data, list(floats))
            if self.other_data:
                torch._foreach_copy_(self.other_data, list(others))
