"""A replica's device time on CUDA: its forward and its backward, timed by CUDA events.

The manager's predictor reads a replica's chunk time as the GPU work of that chunk for one
iteration, forward and backward (docs/policy.md), as the emulated GPUs measure it. Events
around the replica's call time the forward only, and the backward is about two thirds of a
training step's device work, so on CUDA the backward is timed too:

- it starts when the gradient of the replica's output arrives (a hook on each output tensor
  records an event on the replica's stream);
- it ends when the gradient of the replica's last parameter is computed (an event from a
  hook on that parameter: a tensor hook on a replica's copy, a post-hook on the gradient
  accumulator of a module's own parameter, which dies with the graph and so never stays on
  the parameter, where it would stop ``torch.save`` or ``copy.deepcopy`` of the module).

Which parameter gets its gradient last is fixed by the model's graph. It is learned once per
wrapper from a *probe* backward with a hook on every trainable parameter (:class:`LastGradient`);
from then on each replica costs two hooks and a lookup by name, not one hook per parameter
(each hook is a Python call in the backward: a probe of ResNet-50's 161 parameters cost about
3 ms on a slow CPU) nor a walk over the model (about 0.3 ms for ResNet-18 on the same CPU).

Hooks and events cost host time in every step they are on (``benchmarks/bench_parallel.py``),
so the backward is timed on one training forward in ``backward_every`` (the backend's choice,
default :data:`BACKWARD_EVERY`); on the others a replica's chunk time is its forward times
(1 + the backward's share measured last on its slot, :class:`BackwardShares`).

Without a backward (evaluation, ``torch.no_grad``, a loss never backpropagated), or before one
was timed on the slot, a timing covers the forward alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from drbalance.client.timing import ReplicaTiming

BACKWARD_EVERY = 8
"""Time the backward on one training forward in this many (the others scale their forward)."""


class LastGradient:
    """Which of a model's trainable parameters gets its gradient last in a backward: the
    name of its module (as ``named_modules`` gives it) and its key there, learned by a probe.

    The name, not the tensor, is kept: a replica made by ``replicate`` has the module's tree
    with new tensors each forward, and finding one parameter by name costs far less than
    listing them all (the cost of a timed step, ``benchmarks/bench_parallel.py``).
    """

    def __init__(self) -> None:
        self.module: str | None = None
        self.key: str | None = None

    def learn(self, where: tuple[str, str]) -> None:
        """Record the parameter at ``where`` = (module name, key) as the last to get a gradient."""
        self.module, self.key = where

    def find(self, replica: nn.Module) -> torch.Tensor | None:
        """The learned parameter in ``replica`` (the module itself or a copy of it), or None when
        nothing is learned or the parameter is gone or no longer trained (a new probe then)."""
        if self.module is None:
            return None
        try:
            module = replica.get_submodule(self.module)
        except AttributeError:
            return None
        tensor = _parameters_of(module).get(self.key)
        return tensor if tensor is not None and tensor.requires_grad else None


def _parameters_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    # a replica keeps its parameter copies in _former_parameters; __dict__, not getattr: a
    # missing attribute costs nn.Module.__getattr__ an exception
    return module.__dict__.get("_former_parameters") or module._parameters


def trainable_parameters(replica: nn.Module) -> list[tuple[tuple[str, str], torch.Tensor]]:
    """The parameters of a module, or of a replica made by ``replicate``, that require a gradient,
    in module order, each with where it is: (module name, key)."""
    seen: set[int] = set()
    found = []
    for name, module in replica.named_modules():
        for key, tensor in _parameters_of(module).items():
            if tensor is not None and tensor.requires_grad and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(((name, key), tensor))
    return found


def tensors_needing_grad(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested in tuples, lists, dicts) that require a gradient."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from tensors_needing_grad(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors_needing_grad(item)


class BackwardShares:
    """Per DR slot: the replica's backward device time per second of its forward, from the last
    timed backward. An untimed training forward's chunk time is ``forward * (1 + share)``.

    Timed replicas are collected without waiting for the GPU (``Event.query``): at the next
    forward, whichever have finished their backward give their share.
    """

    KEEP = 8
    """Timed replicas kept waiting for their backward (a forward never backpropagated drops out)."""

    def __init__(self) -> None:
        self.share: dict[int, float] = {}
        self._timed: list[CudaReplicaTimer] = []

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
        self.watching = False
        self._arrivals: list[tuple[str, str] | None] = []
        self._probe: tuple[LastGradient, int] | None = None
        self._result: ReplicaTiming | None = None

    @property
    def pending(self) -> bool:
        """True while a watched backward has not finished: the timing would be the forward alone."""
        return self.watching and self.backward_end is None

    def watch_backward(self, output: Any, replica: nn.Module, last: LastGradient) -> None:
        """Hook the backward of this replica: ``output`` is what ``replica`` returned. Does nothing
        when no output tensor needs a gradient."""
        outputs = list(tensors_needing_grad(output))
        if not outputs:
            return
        known = last.find(replica)
        if known is not None:
            watched = [(None, known)]
        else:
            watched = trainable_parameters(replica)
            if not watched:
                return
            self._probe = (last, len(watched))
        for tensor in outputs:
            tensor.register_hook(self._on_output_gradient)
        for where, tensor in watched:
            _hook_gradient(tensor, where, self._on_parameter_gradient)
        self.watching = True
        if self.shares is not None:
            self.shares.expect(self)

    def _record(self) -> torch.cuda.Event:
        event = self._event(enable_timing=True)
        event.record(self.stream)
        return event

    def _on_output_gradient(self, grad: torch.Tensor) -> None:
        if self.backward_start is None:
            self.backward_start = self._record()

    def _on_parameter_gradient(self, where: tuple[str, str] | None) -> None:
        if self._probe is not None:  # every parameter: the last one recorded is the end
            self._arrivals.append(where)
            self.backward_end = self._record()
            last, count = self._probe
            if len(self._arrivals) == count:  # every parameter had its gradient: learned now
                last.learn(where)
        elif self.backward_end is None:  # the first backward through this forward
            self.backward_end = self._record()

    def split(self, wait: bool) -> tuple[float, float] | None:
        """(forward, backward) seconds of a timed replica whose backward has run; None before
        that, or with ``wait=False`` while the GPU has not reached the backward's end."""
        start, end = self.backward_start, self.backward_end
        if start is None or end is None:
            return None
        if wait:
            end.synchronize()
        elif not end.query():
            return None
        if self._probe is not None and self._arrivals:  # some parameters had none: the last that did
            self._probe[0].learn(self._arrivals[-1])
        forward = self.forward_start.elapsed_time(self.forward_end) / 1000.0
        return forward, max(0.0, start.elapsed_time(end) / 1000.0)

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


def _hook_gradient(tensor: torch.Tensor, where: tuple[str, str] | None, on_gradient: Any) -> None:
    """Call ``on_gradient(where)`` when ``tensor``'s gradient has been computed in a backward."""
    if tensor.is_leaf:
        # a module's own parameter: hook its gradient accumulator, which lives as long as this
        # forward's graph (a tensor hook would stay on the parameter)
        node = torch.autograd.graph.get_gradient_edge(tensor).node
        node.register_hook(lambda grad_inputs, grad_outputs: on_gradient(where))
    else:
        tensor.register_hook(lambda grad: on_gradient(where))
