"""A replica's device time on CUDA: its forward and its backward, timed by CUDA events.

The manager's predictor reads a replica's chunk time as the GPU work of that chunk for one
iteration, forward and backward (docs/policy.md), as the emulated GPUs measure it. Events
around the replica's call time the forward only, and the backward is about two thirds of a
training step's device work (0.325 of a ResNet-50 step is the forward on an H200), so on CUDA
the backward is timed too, by two events on the replica's stream:

- one when the gradient of the replica's output arrives (a hook on each output tensor that
  has a ``grad_fn``: never on a leaf, where a hook would stay on the user's tensor);
- one when that backward has finished, from a callback the hook queues on the autograd engine
  (``queue_callback``, as DistributedDataParallel's reducer uses): by then every kernel of the
  backward has been queued, so the event completes when the replica's stream has run its share
  of them. On ``device_ids[0]`` that includes the reduction of the replicas' gradients into the
  module's (DataParallel's own cost).

Nothing is hooked on the module's parameters, so nothing stays on them. When several forwards
share one backward (a Siamese step, say), a timed forward's backward time is divided among the
forwards made from it up to that backward (right when the timed forward is the first of them).

Hooks and events cost host time in every step they are on (``benchmarks/bench_parallel.py``: +3%
of a 7 ms ResNet-18 step when every step is timed), so the backward is timed on one training
forward in ``backward_every`` (the backend's choice, default :data:`BACKWARD_EVERY`; not the
first forward, which pays for the GPU's warm-up); on the others a replica's chunk time is its
forward times (1 + the backward's share measured last on its slot, :class:`BackwardShares`).

Without a backward (evaluation, ``torch.no_grad``, a loss never backpropagated), or before one
was timed on the slot, a timing covers the forward alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from drbalance.client.scatter_gather import tensors_in
from drbalance.client.timing import ReplicaTiming

BACKWARD_EVERY = 8
"""Time the backward on one training forward in this many (the others scale their forward)."""


def tensors_needing_grad(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested in tuples, lists, dicts) that a backward reaches
    through a ``grad_fn`` (a leaf, such as a parameter returned as it is, is left out)."""
    return (tensor for tensor in tensors_in(output) if tensor.requires_grad and tensor.grad_fn is not None)


class BackwardShares:
    """Per DR slot: the replica's backward device time per second of its forward, from the last
    timed backward. An untimed training forward's chunk time is ``forward * (1 + share)``.

    Timed replicas are collected without waiting for the GPU (``Event.query``): at the next
    forward, whichever have finished their backward give their share. Copies and pickles keep
    the shares, not the timers waiting (they hold CUDA events, which do not pickle).
    """

    KEEP = 8
    """Timed replicas kept waiting for their backward (a forward never backpropagated drops out)."""

    def __init__(self) -> None:
        self.share: dict[int, float] = {}
        self._timed: list[CudaReplicaTimer] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"share": dict(self.share), "_timed": []}

    def expect(self, timer: CudaReplicaTimer) -> None:
        """Collect ``timer``'s share once its backward has run."""
        self._timed.append(timer)
        del self._timed[:-self.KEEP]

    def collect(self) -> None:
        """Take the share of every expected replica whose backward has finished on the GPU."""
        waiting = []
        for timer in self._timed:
            split = timer.split(wait=False)
            if split is None:
                waiting.append(timer)
            else:
                self.learn(timer.slot, *split)
        self._timed = waiting

    def learn(self, slot: int, forward: float, backward: float) -> None:
        """Record a measured (forward, backward) pair of seconds for ``slot``."""
        if forward > 0:
            self.share[slot] = backward / forward


class CudaReplicaTimer:
    """One replica's timing in one forward: call it for the :class:`ReplicaTiming`.

    When its backward is timed (:meth:`watch_backward`), ``seconds`` is forward + backward once
    the backward has run, else the forward alone and not final (:attr:`pending`). When it is not,
    a training forward's ``seconds`` is the forward scaled by the slot's last measured backward
    share (``shares``), and the forward alone for an inference forward or before any share.
    """

    def __init__(self, slot: int, device: str, samples: int, stream: torch.cuda.Stream,
                 forward_start: torch.cuda.Event, forward_end: torch.cuda.Event,
                 shares: BackwardShares | None = None, event: Callable[..., Any] | None = None) -> None:
        """``event`` makes the backward's events (default ``torch.cuda.Event``; anything with
        ``record(stream)``, ``query()``, ``synchronize()``, ``elapsed_time(other)`` in ms)."""
        self.slot, self.device, self.samples, self.stream = slot, device, samples, stream
        self._event = event or torch.cuda.Event
        self.forward_start, self.forward_end = forward_start, forward_end
        self.shares = shares
        self.backward_start: torch.cuda.Event | None = None
        self.backward_end: torch.cuda.Event | None = None
        self.forwards_sharing = 1  # forwards whose backward ran with this one's (set at its end)
        self.watching = False
        self._count_forwards: Callable[[], int] | None = None
        self._forward_number = 0
        self._result: ReplicaTiming | None = None

    @property
    def pending(self) -> bool:
        """True while a watched backward has not finished: the timing would be the forward alone."""
        return self.watching and self.backward_end is None

    def watch_backward(self, output: Any, count_forwards: Callable[[], int] | None = None) -> None:
        """Time the backward that reaches ``output`` (what the replica returned). Does nothing
        when no output tensor has a ``grad_fn``. ``count_forwards`` gives the training forwards
        made so far (this one included): at the backward's end, those made since this one share it."""
        outputs = list(tensors_needing_grad(output))
        if not outputs:
            return
        for tensor in outputs:
            tensor.register_hook(self._on_output_gradient)
        if count_forwards is not None:
            self._count_forwards, self._forward_number = count_forwards, count_forwards()
        self.watching = True
        if self.shares is not None:
            self.shares.expect(self)

    def _record(self) -> torch.cuda.Event:
        event = self._event(enable_timing=True)
        event.record(self.stream)
        return event

    def _on_output_gradient(self, grad: torch.Tensor) -> None:
        if self.backward_start is None:  # the first backward through this forward (or output)
            self.backward_start = self._record()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        if self.backward_end is None:
            if self._count_forwards is not None:
                self.forwards_sharing = max(1, self._count_forwards() - self._forward_number + 1)
            self.backward_end = self._record()

    def split(self, wait: bool) -> tuple[float, float] | None:
        """(forward, backward) seconds of a timed replica whose backward has run (its share of a
        backward several forwards shared); None before that, or with ``wait=False`` while the
        GPU has not reached the backward's end."""
        start, end = self.backward_start, self.backward_end
        if start is None or end is None:
            return None
        if wait:
            end.synchronize()
        elif not end.query():
            return None
        forward = self.forward_start.elapsed_time(self.forward_end) / 1000.0
        backward = max(0.0, start.elapsed_time(end) / 1000.0) / self.forwards_sharing
        return forward, backward

    def __call__(self) -> ReplicaTiming:
        if self._result is not None:
            return self._result
        self.forward_end.synchronize()
        forward = self.forward_start.elapsed_time(self.forward_end) / 1000.0
        seconds, final = forward, True
        if self.watching:
            split = self.split(wait=True)
            if split is None:
                final = False  # the backward has not run yet: read again after it
            else:
                seconds = sum(split)
                if self.shares is not None:
                    self.shares.learn(self.slot, *split)
        elif self.shares is not None:  # a training forward whose backward is not timed
            seconds = forward * (1.0 + self.shares.share.get(self.slot, 0.0))
        timing = ReplicaTiming(self.slot, self.device, self.samples, seconds)
        if final:
            self._result = timing
        return timing
