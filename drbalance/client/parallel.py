"""``BalancedDataParallel``: ``nn.DataParallel`` whose scatter follows a data ratio."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from drbalance.client.backends import ChunkPlan, DeviceBackend, default_backend
from drbalance.client.scatter_gather import SCALAR_MODES, batch_size_of
from drbalance.client.timing import ReplicaTiming
from drbalance.ratio import DataRatio, as_ratio

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class _ForwardState:
    """The DR in force, a pending DR, and what the last forward did."""

    __slots__ = ("ratio", "pending", "plan", "timings")

    def __init__(self, ratio: DataRatio) -> None:
        self.ratio = ratio
        self.pending: DataRatio | None = None
        self.plan: ChunkPlan | None = None
        self.timings: list[Any] = []


class BalancedDataParallel(nn.DataParallel, Generic[ModuleT]):
    """A drop-in for ``torch.nn.DataParallel`` that splits each batch by a data ratio (DR).

    Arguments are those of ``nn.DataParallel`` plus:

    - ``ratio``: a :class:`~drbalance.DataRatio` or a list of integer shares summing to 10, one
      per entry of ``device_ids``. Default: an exactly even split (``[1] * len(device_ids)`` with
      total ``len(device_ids)``), which chunks a batch as ``nn.DataParallel`` does up to rounding.
    - ``backend``: where chunks run (:mod:`drbalance.client.backends`); default CUDA when
      available, else the CPU, where the same split path runs sequentially with one module.
    - ``scalar_outputs``: what a module returning a 0-dim tensor (e.g. a mean loss) gives back.
      ``"weighted_mean"`` (default) weights each replica's value by its chunk size, so the
      result equals the bare module's on the whole batch for every DR; ``"stack"`` returns the
      per-replica vector as ``nn.DataParallel`` does (its ``.mean()`` is then mis-weighted when
      chunks are uneven).

    Replicas exist only on devices with a non-empty chunk. Outputs are gathered in the original
    sample order on ``output_device``. :meth:`set_ratio` takes effect at the next forward.
    """

    def __init__(
        self,
        module: ModuleT,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        ratio: DataRatio | Sequence[int] | None = None,
        *,
        backend: DeviceBackend | None = None,
        scalar_outputs: str = "weighted_mean",
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"BalancedDataParallel wraps an nn.Module; got {type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an integer; got {dim!r}")
        if scalar_outputs not in SCALAR_MODES:
            raise ValueError(f"scalar_outputs must be one of {SCALAR_MODES}; got {scalar_outputs!r}")
        self.module = module
        self.dim = dim
        self.scalar_outputs = scalar_outputs
        self.backend = backend if backend is not None else default_backend()
        ratio_value = None if ratio is None else as_ratio(ratio)
        self.device_ids = self.backend.resolve_device_ids(
            device_ids, None if ratio_value is None else len(ratio_value)
        )
        self.output_device = self.backend.resolve_output_device(output_device, self.device_ids)
        if self.backend.kind == "cuda":
            self.src_device_obj = torch.device("cuda", self.device_ids[0])
        count = len(self.device_ids)
        initial = self._checked(ratio_value) if ratio_value is not None else DataRatio.even(count, count)
        # Per-call state lives on a plain object: nn.Module attribute access is slow on a hot path.
        self._state = _ForwardState(initial)
        self.backend.prepare(self.module, self.device_ids)

    # --- the data ratio -----------------------------------------------------------------------
    def _checked(self, ratio: DataRatio) -> DataRatio:
        if len(ratio) != len(self.device_ids):
            raise ValueError(
                f"the DR {ratio} has {len(ratio)} entries but device_ids {self.device_ids} has "
                f"{len(self.device_ids)}; give one share per device"
            )
        return ratio

    @property
    def ratio(self) -> DataRatio:
        """The DR the next forward will use."""
        state = self._state
        return state.pending if state.pending is not None else state.ratio

    def set_ratio(self, ratio: DataRatio | Sequence[int]) -> None:
        """Use ``ratio`` from the next forward on (a forward in progress keeps its split)."""
        self._state.pending = self._checked(as_ratio(ratio))

    # --- what the last forward did ------------------------------------------------------------
    @property
    def last_chunk_sizes(self) -> tuple[int, ...]:
        """Samples per DR slot in the last forward (0 for slots without a replica)."""
        plan = self._state.plan
        sizes = [0] * len(self.device_ids)
        if plan is not None:
            for slot, size in zip(plan.slots, plan.sizes):
                sizes[slot] = size
        return tuple(sizes)

    def last_replica_timings(self) -> list[ReplicaTiming]:
        """Forward time of each replica in the last forward (waits for the GPU on first read)."""
        state = self._state
        resolved = [timing() for timing in state.timings]
        state.timings = [lambda t=t: t for t in resolved]
        return resolved

    # --- the forward pass ---------------------------------------------------------------------
    def _take_ratio(self) -> DataRatio:
        state = self._state
        pending = state.pending
        if pending is not None:
            state.ratio, state.pending = pending, None
        return state.ratio

    def plan(self, ratio: DataRatio, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> ChunkPlan:
        """Which slots get how many samples for this call's batch."""
        batch = batch_size_of(inputs, kwargs, self.dim)
        if not batch:
            return ChunkPlan((ratio.used[0],), (batch or 0,), self.dim, self.scalar_outputs, whole=True)
        sizes = ratio.split(batch)
        slots = tuple(slot for slot, size in enumerate(sizes) if size > 0)
        return ChunkPlan(slots, tuple(sizes[s] for s in slots), self.dim, self.scalar_outputs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("BalancedDataParallel.forward"):
            ratio = self._take_ratio()
            self.backend.check_module(self.module, self.device_ids)
            plan = self.plan(ratio, inputs, kwargs)
            output, timings = self.backend.run(
                self.module, self.device_ids, self.output_device, plan, inputs, kwargs
            )
            state = self._state
            state.plan, state.timings = plan, timings
            return output

    def extra_repr(self) -> str:
        return f"backend={self.backend.kind}, device_ids={self.device_ids}, ratio={self.ratio}"
