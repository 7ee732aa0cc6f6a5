"""The backward timing of CUDA chunks (drbalance.client.cuda_timing), its autograd side on the CPU.

The CUDA events are replaced by a wall-clock event of the same interface, so what is tested
here is the real autograd plumbing: which hooks fire, what is learned, what stays behind on the
module. The CUDA path itself is tested on a GPU in tests/test_parallel_cuda.py (results in
docs/gpu-results.md).
"""

from __future__ import annotations

import copy
import io
import time
from collections import OrderedDict

import pytest
import torch
from torch import nn

from drbalance.client.cuda_timing import BackwardShares, CudaReplicaTimer, LastGradient, trainable_parameters

pytestmark = pytest.mark.timeout(60)


class WallClockEvent:
    """A CPU event with the interface of torch.cuda.Event: the wall clock when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: WallClockEvent) -> float:
        return (other.at - self.at) * 1000.0


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def timed_forward(module: nn.Module, replica: nn.Module, last: LastGradient, shares: BackwardShares | None,
                  watch: bool = True) -> tuple[torch.Tensor, CudaReplicaTimer]:
    start, end = WallClockEvent(), WallClockEvent()
    start.record()
    out = replica(torch.randn(8, 32))
    end.record()
    timer = CudaReplicaTimer(0, "cuda:0", 8, None, start, end, shares, event=WallClockEvent)
    if watch:
        timer.watch_backward(out, replica, last)
    return out, timer


def copy_like_replicate(module: nn.Module) -> nn.Module:
    """A replica as torch's ``replicate`` makes one: the module's tree, each parameter a non-leaf
    copy kept in ``_former_parameters`` (``replicate`` itself needs CUDA devices)."""
    copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for original, replica in copies.items():
        replica._former_parameters = OrderedDict()
        for key, child in original._modules.items():
            setattr(replica, key, copies[child])
        for key, param in original._parameters.items():
            if param is not None:
                clone = param.clone()
                setattr(replica, key, clone)
                replica._former_parameters[key] = clone
    return copies[module]


@pytest.mark.parametrize("replicated", [False, True], ids=["module", "replica"])
def test_the_probe_learns_the_first_layer_and_later_forwards_hook_one_parameter(replicated):
    module, last = model(), LastGradient()
    replica = copy_like_replicate(module) if replicated else module
    out, timer = timed_forward(module, replica, last, None)
    assert timer.pending and len(timer._arrivals) == 0
    out.sum().backward()
    assert (last.module, last.key) in (("0", "weight"), ("0", "bias"))  # the first layer's gradient comes last
    assert len(timer._arrivals) == 6 and not timer.pending
    assert last.find(replica) is trainable_parameters(replica)[[w for w, _ in trainable_parameters(replica)].index(
        (last.module, last.key))][1]
    replica = copy_like_replicate(module) if replicated else module
    out, timer = timed_forward(module, replica, last, None)
    assert timer._probe is None  # no probe: one parameter watched
    out.sum().backward()
    assert timer.backward_end is not None and timer.backward_start is not None


def test_the_backward_is_added_once_it_ran_and_a_read_before_it_is_not_final():
    module, last = model(), LastGradient()
    out, timer = timed_forward(module, module, last, None)
    before = timer()
    assert before.seconds == pytest.approx(timer.forward_start.elapsed_time(timer.forward_end) / 1000.0)
    time.sleep(0.05)  # host time between the forward and the backward: not the chunk's
    out.sum().backward()
    after = timer()
    backward = timer.backward_start.elapsed_time(timer.backward_end) / 1000.0
    assert after.seconds == pytest.approx(before.seconds + backward)
    assert backward < 0.05 and timer() is after  # final now


def test_nothing_stays_on_the_modules_parameters():
    module, last = model(), LastGradient()
    for _ in range(2):  # the probe, then one hooked parameter
        out, _ = timed_forward(module, module, last, None)
        out.sum().backward()
    assert all(not p._backward_hooks for p in module.parameters())
    copy.deepcopy(module)
    torch.save(module, io.BytesIO())


def test_an_untimed_forward_is_scaled_by_the_last_measured_share_of_its_slot():
    module, last, shares = model(), LastGradient(), BackwardShares()
    out, timed = timed_forward(module, module, last, shares)
    out.sum().backward()
    shares.collect()  # without waiting: the wall-clock events are done
    forward, backward = timed.split(wait=True)
    assert shares.share[0] == pytest.approx(backward / forward)
    out, untimed = timed_forward(module, module, last, shares, watch=False)
    untimed_forward = untimed.forward_start.elapsed_time(untimed.forward_end) / 1000.0
    assert untimed().seconds == pytest.approx(untimed_forward * (1 + shares.share[0]))
    assert not untimed.pending
    out, other_slot = timed_forward(module, module, last, shares, watch=False)
    other_slot.slot = 1  # no share measured on slot 1 yet: the forward alone
    assert other_slot().seconds == pytest.approx(other_slot.forward_start.elapsed_time(other_slot.forward_end) / 1000)


def test_frozen_parameters_are_not_watched_and_a_frozen_last_parameter_starts_a_new_probe():
    module, last = model(), LastGradient()
    out, _ = timed_forward(module, module, last, None)
    out.sum().backward()
    learned = (last.module, last.key)
    module[0].requires_grad_(False)
    assert last.find(module) is None
    assert all(where[0] != "0" for where, _ in trainable_parameters(module))
    out, timer = timed_forward(module, module, last, None)
    assert timer._probe is not None
    out.sum().backward()
    assert (last.module, last.key) != learned and last.module == "2"


def test_a_forward_without_gradients_watches_nothing():
    module, last = model(), LastGradient()
    with torch.no_grad():
        _, timer = timed_forward(module, module, last, BackwardShares())
    assert not timer.watching and not timer.pending and last.module is None
