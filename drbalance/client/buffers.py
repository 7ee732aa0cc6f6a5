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


def buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (submodule, name, buffer) of ``module``: where a forward that reassigns a buffer
    (``self.steps = self.steps + 1``) puts the new tensor."""
    return [(owner, name, buffer) for owner in module.modules() for name, buffer in owner._buffers.items()
            if buffer is not None]


class BufferMerge:
    """Snapshot the buffers before a multi-chunk forward, collect each chunk's change, merge."""

    __slots__ = ("targets", "floats", "others", "float_data", "other_data", "start_floats", "start_others",
                 "delta", "first_others", "slots")

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

    @classmethod
    def for_forward(cls, module: nn.Module, chunks: int) -> BufferMerge | None:
        """A merge for a training-mode forward over several chunks; None when nothing to do."""
        if chunks < 2 or not module.training:
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

    def add_module_values(self, weight: float) -> None:
        """Record the values the module itself holds now (the sequential CPU path)."""
        self._take_back_replaced()
        self.add(self.floats, self.others, weight)

    def _take_back_replaced(self) -> None:
        """A forward that assigned a new tensor to a buffer (``self.ema = 0.9 * self.ema + ...``)
        left it in the module, where the next chunk would start from it: copy its value into the
        original buffer and put the original back, so that every chunk starts from the same values
        and the merge sees each chunk's change. A replacement of another shape or dtype is left as is."""
        with torch.no_grad():
            for owner, name, original in self.slots:
                current = owner._buffers.get(name)
                if current is None or current is original:
                    continue
                if current.shape == original.shape and current.dtype == original.dtype:
                    original.data.copy_(current.detach())
                    owner._buffers[name] = original

    def restore(self) -> None:
        """Put every buffer back to its value before the forward."""
        self._take_back_replaced()
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
