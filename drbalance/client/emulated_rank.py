"""One DDP rank on an emulated GPU: its module's forward also holds the emulated GPU for the modelled time.

The DataParallel backend (``drbalance.client.emulated``) runs every replica of one process; a DDP
job has one process per rank, each on its own GPU. ``EmulatedRankDevice.attach(module)`` adds a
forward hook to the rank's module that, after the real forward on the CPU, (1) waits out the
model's *host time* for this rank's chunk (the real CPU work since the last device phase counts
towards it) and (2) occupies the rank's emulated GPU for the model's *device time* of the chunk
(forward + backward), waiting while another job holds that GPU. There is no DataParallel
overhead (no scatter, replicate or gather); the gradient all-reduce is real (gloo), so a rank
slowed by a crowded emulated GPU holds up every rank of its job, as a straggler does on real GPUs.
Times are multiplied by ``time_scale``; each real sample counts as ``sample_scale`` modelled ones.
Without a cost table (``costs=None``, as the Lightning and Accelerate integrations use it) the
costs are estimated roughly from the first forward with samples (``drbalance.client.costs.rough_features``:
the module's parameters and the forward's input and output bytes; an order of magnitude, not a calibration).
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import torch
from torch import nn

from drbalance.client.costs import rough_features
from drbalance.client.scatter_gather import batch_size_of
from drbalance.emu.gpus import DEFAULT_MEMORY_BYTES, release_at_exit, release_emulated_gpu
from drbalance.emu.view import emulated_view, open_view
from drbalance.workload.models import ModelCosts, estimate_costs


class EmulatedRankDevice:
    """Emulated device ``index`` as one DDP rank's device: the index counts the emulated GPUs the
    process sees (``drbalance.emu.view.emulated_view``: the machine's when a system manager
    emulates some, else this user's; those ``CUDA_VISIBLE_DEVICES`` makes visible), as a CUDA
    device index does. ``count`` and ``memory_bytes``: the spec's ``N:MEMORY`` (defaults
    ``index + 1`` and 24 GiB); the machine's win where it has GPUs.
    """

    def __init__(self, index: int, costs: ModelCosts | None, time_scale: float = 1.0, sample_scale: float = 1.0,
                 namespace: str | None = None, memory_bytes: int | None = None, count: int | None = None) -> None:
        if not time_scale > 0 or not sample_scale > 0:
            raise ValueError(f"time_scale and sample_scale must be > 0; got {time_scale}, {sample_scale}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"emulated device index must be an integer >= 0; got {index!r}")
        self.index = index
        view = emulated_view(count if count is not None else index + 1,
                             memory_bytes if memory_bytes is not None else DEFAULT_MEMORY_BYTES, namespace)
        self.gpu = open_view(view, [index])[0]
        self._release_at_exit = release_at_exit([self.gpu])
        self.costs = costs
        self.time_scale = float(time_scale)
        self.sample_scale = float(sample_scale)
        self._last_device_end: float | None = None
        self.waited = 0.0  # seconds spent waiting for the emulated GPU, in total

    @property
    def label(self) -> str:
        """How timings name this device (``emu:<index>``)."""
        return f"emu:{self.index}"

    @property
    def uuid(self) -> str:
        """The emulated GPU's UUID when emulated GPUs have one, else ""."""
        return str(getattr(self.gpu, "uuid", "") or "")

    def attach(self, module: nn.Module) -> Any:
        """Add the emulated host and device time to every forward of ``module``; returns the hook handle."""
        return module.register_forward_hook(self._after_forward, with_kwargs=True)

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        batch = batch_size_of(args, kwargs, 0) or 0
        samples = batch * self.sample_scale
        if samples <= 0:
            return
        if self.costs is None:
            self.costs = estimate_costs(type(module).__name__, rough_features(module, args, output, batch))
        if self.gpu.closed:  # its lock descriptors are closed, and their numbers may be another file's now
            raise RuntimeError(f"drbalance: a forward on emulated GPU {self.label} after its EmulatedRankDevice was "
                               f"closed; close it after the rank's last forward")
        with torch.autograd.profiler.record_function("EmulatedRankDevice"):
            target = self.time_scale * self.costs.host_seconds(samples)
            now = time.monotonic()
            spent = now - self._last_device_end if self._last_device_end is not None else 0.0
            if target > spent:
                time.sleep(target - spent)
            self.waited += self.gpu.occupy(self.time_scale * self.costs.device_seconds(samples))
            self._last_device_end = time.monotonic()

    def close(self) -> None:
        """Close the emulated GPU, removing it if no other process uses it (done at exit if never called)."""
        atexit.unregister(self._release_at_exit)
        release_emulated_gpu(self.gpu)
