"""A ``BalancedDataParallel`` backend that runs on emulated GPUs (for machines without CUDA).

Each forward: (1) every chunk's real forward runs on the CPU, one after another, exactly as on
the CPU backend; (2) a *host phase* lasts the model's host time for this batch plus
DataParallel's overhead for this many replicas; the real work done since the last device phase
(backward, optimizer step, data loading, this forward) counts towards it, and what overruns it is
this machine's time, left out of the job's SD (:meth:`EmulatedBackend.uncounted_seconds`); (3) the
*device phase*: each chunk occupies its emulated GPU (``drbalance.emu``) for the model's device
time of that chunk (forward + backward), all chunks at once on their own GPUs, each waiting while
another job holds its GPU. A replica's timing is its device phase alone as the GPU served it (the
waits, the turns given to others, the service), as CUDA events time a replica on a GPU: the real
CPU forward is host work. Every time is multiplied by ``time_scale``; each real sample counts as
``sample_scale`` samples of the modelled workload (so small real batches can stand for ImageNet
batches). See docs/emulation.md.

Memory: after each chunk's forward the replica reserves its modelled forward peak on its
emulated GPU, and when the backward reaches that chunk, its backward peak. A reservation that
does not fit raises :class:`EmulatedOutOfMemoryError`, a ``torch.cuda.OutOfMemoryError`` (the same
class as ``torch.OutOfMemoryError``), as a real GPU would. Reservations are kept, as PyTorch's
caching allocator keeps memory, until :meth:`EmulatedBackend.release_memory` (``empty_cache``).

Without a cost table (``DRBALANCE_EMULATED_GPUS`` with ``BalancedDataParallel(model)``), the model's
cost is estimated from its first chunk (``drbalance.client.costs`` and ``drbalance.workload.models``).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn

from drbalance.client.backends import ChunkPlan, CpuBackend
from drbalance.client.cuda_timing import tensors_needing_grad
from drbalance.client.scatter_gather import map_tensors
from drbalance.emu.gpus import (
    DEFAULT_MEMORY_BYTES,
    EmulatedGpu,
    EmulatedOutOfMemory,
    Occupancy,
    check_memory_size,
    emulated_spec,
    release_at_exit,
    release_emulated_gpus,
)
from drbalance.emu.view import emulated_view, open_view
from drbalance.workload.models import ModelCosts, estimate_costs


class EmulatedOutOfMemoryError(torch.cuda.OutOfMemoryError):
    """An emulated GPU ran out of memory: caught by ``except torch.cuda.OutOfMemoryError``.

    ``device_index`` is the emulated GPU's index (None when the message was re-wrapped).
    """

    def __init__(self, message: str, device_index: int | None = None) -> None:
        super().__init__(message)
        self.device_index = device_index


class EmulatedBackend(CpuBackend):
    """Chunks run on the CPU, then hold emulated GPUs for their modelled device time.

    ``gpu_count``: the emulated GPUs asked for; ``memory_bytes``: each one's memory (default
    24 GiB). Which GPUs the backend uses is ``drbalance.emu.view.emulated_view``'s: the machine's
    when a system manager emulates some (then their count and memory win, with a warning), else
    this user's own; of those, the ones ``CUDA_VISIBLE_DEVICES`` makes visible, as devices 0..n-1
    (``gpu_count`` is then n, ``view`` says which). ``costs``: the model's cost table, timing and
    memory (``drbalance.workload.models``); None = estimate it from the wrapped model's first
    chunk. The emulated GPUs are opened on first use, and the backend pickles as its settings,
    so a wrapper using it can be saved, deep-copied and averaged (``AveragedModel``).
    """

    kind = "emulated"

    def __init__(
        self,
        gpu_count: int,
        costs: ModelCosts | None = None,
        time_scale: float = 1.0,
        sample_scale: float = 1.0,
        namespace: str | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 1:
            raise ValueError(f"need at least one emulated GPU; got {gpu_count!r}")
        if not time_scale > 0 or not sample_scale > 0:
            raise ValueError(f"time_scale and sample_scale must be > 0; got {time_scale}, {sample_scale}")
        check_memory_size(memory_bytes)
        self.requested_count = gpu_count
        self.requested_memory = int(memory_bytes)
        self.costs = costs
        # costs estimated from a forward without gradients (a validation pass first) count no saved
        # activations, so memory would read 0: they stand until the first forward with gradients
        self.costs_provisional = False
        self.time_scale = float(time_scale)
        self.sample_scale = float(sample_scale)
        self.namespace = namespace
        self._resolve_view()
        # chosen by DRBALANCE_EMULATED_GPUS, not by code: a wrapper loaded in another process
        # follows that process's environment (BalancedDataParallel.__setstate__)
        self.chosen_by_environment = False
        self._uncounted = 0.0  # seconds of host phases left out of the job's time (uncounted_seconds)
        self._granted = 0.0  # of the host phase under way: what uncounted_seconds has left out so far
        self._included = 0.0  # ... and what it has counted so far
        self._credit: float | None = None  # the last host phase's modelled seconds: what the one under way counts
        self._open_state()

    @classmethod
    def from_environment(cls) -> EmulatedBackend:
        """Emulated GPUs as ``DRBALANCE_EMULATED_GPUS`` says (``N`` or ``N:MEMORY``), cost estimated."""
        spec = emulated_spec()
        backend = cls(spec.count, None, memory_bytes=spec.memory_bytes)
        backend.chosen_by_environment = True
        return backend

    def _resolve_view(self) -> None:
        """Which emulated GPUs this backend uses (``view``), how many (``gpu_count``) and their memory."""
        self.view = emulated_view(self.requested_count, self.requested_memory, self.namespace)
        self.gpu_count = self.view.count
        self.memory_bytes = self.view.memory_bytes

    def _open_state(self) -> None:
        self._gpus: list[EmulatedGpu] | None = None
        self._release_at_exit: Callable[[], None] | None = None  # registered with atexit while GPUs are open
        self._pool: ThreadPoolExecutor | None = None
        self._last_device_end: float | None = None  # monotonic seconds: the host phase under way began
        self._token = int.from_bytes(os.urandom(4), "little")  # this backend's entries in the memory tables
        self._reserved: dict[int, int] = {}  # bytes held per emulated GPU
        self._peak: dict[int, int] = {}  # peak bytes per emulated GPU since take_peak_memory
        self._finalizer: weakref.finalize | None = None  # what a backend freed without close() gives back

    def __getstate__(self) -> dict[str, Any]:
        return {"requested_count": self.requested_count, "costs": self.costs, "time_scale": self.time_scale,
                "sample_scale": self.sample_scale, "namespace": self.namespace,
                "requested_memory": self.requested_memory, "costs_provisional": self.costs_provisional,
                "chosen_by_environment": self.chosen_by_environment}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The settings; the GPUs seen where it is loaded (``emulated_view`` there)."""
        self.__dict__.update(state)
        self._resolve_view()
        self._uncounted = self._granted = self._included = 0.0
        self._credit = None
        self._open_state()

    def uncounted_seconds(self) -> float:
        """Seconds of the job's time that were this machine's, not the emulated server's: the
        session leaves them out of the job's SD and iteration times (``SlowdownTracker``). The
        job's emulated time is what the modelled server would take: each host phase's modelled
        host time, and each device phase's waits for the emulated GPUs (other jobs' turns) and
        service as modelled.

        Left out: (1) a host phase's time past its modelled host time. That is this machine's
        CPU work (each chunk's forward and backward on PyTorch's threads, the optimizer step, data
        loading), which stands for work the modelled server does on its GPU or its many cores, its
        waits for a core, and its waits for this machine's other processes (a data loader's
        workers, the manager's answer, which on a loaded machine waits for a core itself): on the
        modelled server all of that is the modelled host time. (2) A device phase's time past its
        waits and its service: threads of this machine waking late. A host phase the modelled time
        holds leaves nothing out (it sleeps the rest). docs/emulation.md.

        The first host phase begins at the first call (a ``Session`` makes it when it starts), so
        the set-up before the first forward (the first batch, the cost measurement) is host work
        like any other. The host phase under way is left out as it goes, past the last phase's
        modelled time: an iteration ends (``Session.step``) inside the next host phase, after the
        backward and the optimizer step, so the overrun is left out of the iteration whose time it
        took. The phase's own modelled time is known only when the forward that ends it comes
        (after a DR change, with other replicas); the phase then counts its own, or what was
        counted of it already if that is more: the job's time never runs backwards.
        """
        if self._last_device_end is None and self._credit is None:
            self._last_device_end = time.monotonic()  # the first host phase starts here
        return self._uncounted + self._overrun_so_far()

    def _overrun_so_far(self) -> float:
        """Of the host phase under way (since the last device phase ended): its time past the last
        phase's modelled time (``_credit``), never less than left out before. What it has counted
        so far (its time less that) is kept in ``_included``."""
        credit = self._credit
        if credit is not None and self._last_device_end is not None:
            elapsed = time.monotonic() - self._last_device_end
            self._granted = max(self._granted, elapsed - credit)
            self._included = max(self._included, elapsed - self._granted)
        return self._granted

    @property
    def gpus(self) -> list[EmulatedGpu]:
        """The emulated GPUs (opened on first use, and again in a forked child, where they are closed)."""
        if self._gpus is None or self._gpus[0].closed:
            gpus = open_view(self.view)
            self._gpus = gpus
            self._release_at_exit = release_at_exit(gpus)
            # a model deleted or replaced without close(): its memory and files go with it (at exit,
            # release_at_exit removes the GPUs nobody else uses)
            self._finalizer = weakref.finalize(self, _let_go, tuple(gpus), self._token, self._reserved, os.getpid())
            self._finalizer.atexit = False
        return self._gpus

    def resolve_device_ids(self, device_ids: Sequence[Any] | None, ratio_length: int | None) -> list[int]:
        """The emulated GPUs' indices; a CUDA device (``torch.device("cuda:1")``, ``"cuda:1"``, as a
        script written for GPUs passes them) stands for the emulated GPU of its index."""
        ids = super().resolve_device_ids(device_ids if device_ids is not None else range(self.gpu_count), None)
        bad = [d for d in ids if not 0 <= d < self.gpu_count]
        if bad:
            raise ValueError(f"device_ids {bad} are not among the {self.gpu_count} emulated GPUs")
        return ids

    def describe(self, device_ids: Sequence[int], slot: int) -> str:
        return f"emu:{device_ids[slot]}"

    def device_uuids(self, device_ids: Sequence[int]) -> tuple[str, ...]:
        return tuple(self.gpus[d].uuid for d in device_ids)

    def slots_alone(self, device_ids: Sequence[int]) -> tuple[bool | None, ...]:
        """Per slot: whether no other live process holds memory on its emulated GPU (a replica there)."""
        me = os.getpid()
        return tuple(self.gpus[d].holders() <= {me} for d in device_ids)

    def take_peak_memory(self, device_ids: Sequence[int]) -> tuple[int | None, ...]:
        peaks = tuple(self._peak.get(d, 0) if self.costs is not None else None for d in device_ids)
        self._peak.clear()
        return peaks

    def _oom_device(self, error: BaseException) -> int | None:
        return getattr(error, "device_index", None)

    def release_memory(self, devices: Sequence[int] | None = None) -> None:
        """Give back the reservations on ``devices`` (None = all): ``torch.cuda.empty_cache``."""
        for index in list(self._reserved) if devices is None else [d for d in devices if d in self._reserved]:
            self.gpus[index].reserve(self._token, 0)
            del self._reserved[index]

    # --- the forward -----------------------------------------------------------------------------
    def call_chunk(self, module: nn.Module, args: Any, kwargs: dict[str, Any], plan: ChunkPlan, position: int) -> Any:
        """Run one chunk; the first with samples (and, for memory, the first with gradients) is
        also measured to estimate the model's costs. An empty chunk, or a call with no batch
        tensor, just runs: there is nothing to measure on."""
        with_grad = torch.is_grad_enabled()
        wanted = self.costs is None or (self.costs_provisional and with_grad)
        if not wanted or plan.sizes[position] < 1:
            return module(*args, **kwargs)
        from drbalance.client.costs import measure_features, rough_features

        samples = plan.sizes[position]
        # what the forward gets, should it run a second time (a clone keeps the autograd graph)
        pristine = map_tensors(torch.Tensor.clone, (args, kwargs))
        try:
            features, output = measure_features(module, args, kwargs, samples)
        except Exception as error:  # the counting's, or the forward's own (run again below)
            # The counting does not support every forward (torch.func transforms, autograd.grad inside
            # it, ...): the forward alone decides, on its inputs as they were before the first try
            # (which may have changed them in place). Its own error is raised as it is, without the
            # counting's frames; if it runs, the model's costs are guessed (``rough_features``).
            args, kwargs = pristine
            output = module(*args, **kwargs)
            features = rough_features(module, args, output, samples)
            _warn_unmeasured(type(module).__name__, error)
        self.costs = estimate_costs(type(module).__name__, features)
        self.costs_provisional = not with_grad
        return output

    def after_chunk(self, device_ids: Sequence[int], plan: ChunkPlan, position: int, output: Any) -> None:
        """Reserve the chunk's forward memory now and its backward memory when the backward comes."""
        if self.costs is None or not self.costs.memory_per_sample:
            return
        gpu = device_ids[plan.slots[position]]
        samples = plan.sizes[position] * self.sample_scale
        self._reserve(gpu, self.costs.memory_peak(samples, backward=False))
        tensor = _tensor_requiring_grad(output) if torch.is_grad_enabled() else None
        if tensor is not None:
            backward_bytes = self.costs.memory_peak(samples, backward=True)
            slot = plan.slots[position]

            def on_backward(grad: torch.Tensor) -> None:
                try:
                    self._reserve(gpu, backward_bytes)
                except EmulatedOutOfMemoryError as error:
                    error.drbalance_slot = slot  # type: ignore[attr-defined]
                    raise

            tensor.register_hook(on_backward)

    def _reserve(self, gpu: int, nbytes: float) -> None:
        needed = int(nbytes)
        if needed > self._reserved.get(gpu, 0):
            try:
                self.gpus[gpu].reserve(self._token, needed)
            except EmulatedOutOfMemory as error:
                raise EmulatedOutOfMemoryError(str(error), gpu) from None
            self._reserved[gpu] = needed
        self._peak[gpu] = max(self._peak.get(gpu, 0), needed)  # what max_memory_allocated would show

    def apply(self, module: nn.Module, device_ids: Sequence[int], plan: ChunkPlan,
              chunk_inputs: Sequence[Any], chunk_kwargs: Sequence[dict[str, Any]]):
        outputs, cpu_seconds = self.forward_chunks(module, device_ids, plan, chunk_inputs, chunk_kwargs)
        if self.costs is None:  # no chunk had samples to measure on: no device time can be modelled yet
            return outputs, self.timings(device_ids, plan, [0.0] * len(plan.slots))
        self._host_phase(plan, sum(cpu_seconds))
        device = [self.time_scale * self.costs.device_seconds(size * self.sample_scale) for size in plan.sizes]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.gpu_count, thread_name_prefix="drbalance-emu")
        started = time.monotonic()
        cancel = threading.Event()
        try:  # the submissions too: an interrupt between the first and the wait must cancel what was queued
            futures = [self._pool.submit(self.gpus[device_ids[slot]].occupy_measured, seconds, cancel=cancel)
                       for slot, seconds in zip(plan.slots, device)]
            occupancies: list[Occupancy] = _results(futures)
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM's SessionTerminated): the replicas give their GPUs up
            # after the current slice, as a dead process's kernels stop. Otherwise their threads
            # would serve every chunk to its end, and the job would exit only then (minutes at a
            # large time scale; the interpreter waits for the pool's threads at exit).
            cancel.set()
            raise
        now = time.monotonic()
        # a replica's time is its device phase as its GPU served it: the waits (the turns given to
        # other jobs) and the service. The real CPU forward is host work here (the host phase counts
        # it): counted in the chunk, a starved CPU would look like a slow or crowded GPU. So is a
        # thread that wakes late: the phase's time past its longest chunk is left out.
        spans = [occupancy.waited + occupancy.served for occupancy in occupancies]
        self._uncounted += max(0.0, now - started - max(spans, default=0.0))
        self._last_device_end = now
        return outputs, self.timings(device_ids, plan, spans)

    def _host_phase(self, plan: ChunkPlan, forward_cpu: float) -> None:
        batch = sum(plan.sizes) * self.sample_scale
        target = self.time_scale * (self.costs.host_seconds(batch) + self.costs.overhead_seconds(len(plan.slots)))
        now = time.monotonic()
        spent = now - self._last_device_end if self._last_device_end is not None else forward_cpu
        if target > spent:
            time.sleep(target - spent)
            spent += time.monotonic() - now  # a sleep this machine ends late: left out like any overrun
        self._close_host_phase(spent, target)

    def _close_host_phase(self, spent: float, target: float) -> None:
        """The host phase ends after ``spent`` seconds, modelled as ``target``: it counts ``target``
        (or what it counted already, if more: see ``uncounted_seconds``), the rest is left out."""
        self._uncounted += spent - max(target, self._included)
        self._granted, self._included, self._credit = 0.0, 0.0, target

    def close(self) -> None:
        """Release memory reservations and close the emulated GPUs, removing those no other process
        uses (the backend reopens on use). Done at the process's exit if never called."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._gpus is not None:
            self.release_memory()
            if self._release_at_exit is not None:
                atexit.unregister(self._release_at_exit)
            release_emulated_gpus(self._gpus)
        self._open_state()


def _let_go(gpus: tuple[EmulatedGpu, ...], token: int, reserved: dict[int, int], owner: int) -> None:
    """What a backend freed without ``close()`` gives back: its memory reservations (``reserved``:
    bytes per GPU index, under ``token``) and its GPUs' files and mappings. Only in the process that
    opened them (``owner``): a forked data-loader worker's copy holds nothing of its own."""
    if os.getpid() != owner:
        return
    for index in list(reserved):
        try:
            gpus[index].reserve(token, 0)
        except OSError:  # the GPU's files are gone already: nothing is held there
            pass
        del reserved[index]
    for gpu in gpus:
        gpu.close()
    if gpus:
        gpus[0].home.close()  # the machine's: its hold on them (at exit, release_at_exit removes this user's)


# How often (seconds) the main thread wakes while it waits for the device phase: a signal whose
# C handler ran while it slept (in another thread, or just before its wait began) raises at the next
# wake. An untimed wait would sleep on until the chunks end (minutes at a large time scale).
SIGNAL_CHECK_INTERVAL = 0.05


def _results(futures: Sequence[Future]) -> list[Any]:
    """The futures' results, waited for in waits of ``SIGNAL_CHECK_INTERVAL`` seconds.

    Python runs signal handlers (KeyboardInterrupt, a session's SessionTerminated) in the main
    thread between bytecodes; an untimed lock wait is woken for them only when the signal itself
    interrupts that wait. Linux gives a process's SIGINT to any of its threads that does not block
    it, and one handled just before the wait began interrupts nothing: ``future.result()`` then
    sleeps until the chunks are served to the end. The timed waits return to Python often enough."""
    pending = set(futures)
    while pending:
        _done, pending = wait(pending, timeout=SIGNAL_CHECK_INTERVAL)
    return [future.result() for future in futures]


def _warn_unmeasured(name: str, error: BaseException) -> None:
    """Say that a model's emulated costs are a guess, and why (once: Python's warning filter
    shows a message once per place)."""
    warnings.warn(f"drbalance: the emulated GPUs could not measure {name}'s cost from its forward "
                  f"({type(error).__name__}: {error}); its timing and memory there are a rough guess from its "
                  f"parameter count (pass a cost table: EmulatedBackend(costs=...), docs/emulation.md)",
                  RuntimeWarning, stacklevel=3)


def _tensor_requiring_grad(obj: Any) -> torch.Tensor | None:
    """The first tensor in ``obj`` that this forward computed and that requires grad (0-dim
    included), depth first. A leaf (a parameter or an input the module returns as it is) is
    skipped: it outlives the forward, so a hook on it would run at every later backward."""
    return next(tensors_needing_grad(obj), None)
