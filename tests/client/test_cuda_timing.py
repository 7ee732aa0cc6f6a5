"""The backward timing of CUDA chunks (drbalance.client.cuda_timing), its autograd side on the CPU.

The CUDA events are replaced by a wall-clock event of the same interface, so what is tested
here is the real autograd plumbing: which hooks and callbacks fire, what a timing adds up to,
what stays behind on the module, what copies and pickles. The CUDA path itself is tested on a
GPU in tests/client/test_parallel_cuda.py (results in docs/gpu-results.md).
"""

from __future__ import annotations

import copy
import io
import pickle
import time

import pytest
import torch
from torch import nn

from drbalance.client import CudaBackend
from drbalance.client.cuda_timing import BackwardShares, CudaReplicaTimer

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


class Counter:
    """Training forwards made so far, as CudaBackend counts them."""

    def __init__(self) -> None:
        self.forwards = 0

    def __call__(self) -> int:
        return self.forwards


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def timed_forward(module: nn.Module, shares: BackwardShares | None = None, watch: bool = True,
                  counter: Counter | None = None,
                  x: torch.Tensor | None = None) -> tuple[torch.Tensor, CudaReplicaTimer]:
    if counter is not None:
        counter.forwards += 1
    start, end = WallClockEvent(), WallClockEvent()
    start.record()
    out = module(torch.randn(64, 32) if x is None else x)
    end.record()
    timer = CudaReplicaTimer(0, "cuda:0", 64, None, start, end, shares, event=WallClockEvent)
    if watch:
        timer.watch_backward(out, counter)
    return out, timer


def forward_seconds(timer: CudaReplicaTimer) -> float:
    return timer.forward_start.elapsed_time(timer.forward_end) / 1000.0


def test_the_backward_is_added_once_it_ran_and_a_read_before_it_is_not_final():
    out, timer = timed_forward(model())
    before = timer()
    assert timer.pending and before.seconds == pytest.approx(forward_seconds(timer))
    time.sleep(0.05)  # host time between the forward and the backward: not the chunk's
    slept_until = time.perf_counter()
    out.sum().backward()
    after = timer()
    backward = timer.backward_start.elapsed_time(timer.backward_end) / 1000.0
    assert not timer.pending and after.seconds == pytest.approx(before.seconds + backward)
    # the backward's timing starts after the host time, whatever the machine's load (no upper bound on
    # its seconds: a two-worker suite run on a 2-core machine can take 0.104 s for this backward)
    assert timer.backward_start.at >= slept_until and 0 < backward
    assert timer() is after  # final now


def test_the_end_is_taken_after_the_whole_backward():
    """The end event comes from the engine's callback at the end of the backward: after every
    parameter's gradient, the first layer's included, has been accumulated."""
    module = model()
    out, timer = timed_forward(module)
    seen_at = []
    module[0].weight.register_post_accumulate_grad_hook(lambda p: seen_at.append(time.perf_counter()))
    out.sum().backward()
    assert len(seen_at) == 1 and timer.backward_start.at < seen_at[0] < timer.backward_end.at


class ReturnsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x), self.linear.weight  # a leaf among the outputs: never hooked


def test_nothing_stays_on_the_module_nor_on_a_parameter_it_returns():
    module = ReturnsItsWeight()
    for _ in range(3):
        start, end = WallClockEvent(), WallClockEvent()
        out = module(torch.randn(8, 4))
        timer = CudaReplicaTimer(0, "cuda:0", 8, None, start, end, None, event=WallClockEvent)
        timer.watch_backward(out)
        (out[0].sum() + out[1].sum()).backward()
        assert timer.backward_end is not None
    assert all(not p._backward_hooks for p in module.parameters())
    copy.deepcopy(module)
    torch.save(module, io.BytesIO())


def test_an_untimed_forward_is_scaled_by_the_last_measured_share_of_its_slot():
    module, shares = model(), BackwardShares()
    out, timed = timed_forward(module, shares)
    out.sum().backward()
    shares.collect()  # without waiting: the wall-clock events are done
    forward, backward = timed.split(wait=True)
    assert shares.share[0] == pytest.approx(backward / forward)
    _, untimed = timed_forward(module, shares, watch=False)
    assert untimed().seconds == pytest.approx(forward_seconds(untimed) * (1 + shares.share[0]))
    assert not untimed.pending
    _, other_slot = timed_forward(module, shares, watch=False)
    other_slot.slot = 1  # no share measured on slot 1 yet: the forward alone
    assert other_slot().seconds == pytest.approx(forward_seconds(other_slot))


def test_forwards_sharing_one_backward_share_its_time():
    module, counter = model(), Counter()
    x = torch.randn(64, 32)
    first, timer = timed_forward(module, counter=counter, x=x)
    second, _ = timed_forward(module, watch=False, counter=counter, x=x)  # a Siamese step: two forwards, one loss
    (first.sum() + second.sum()).backward()
    assert timer.forwards_sharing == 2
    whole = timer.backward_start.elapsed_time(timer.backward_end) / 1000.0
    assert timer.split(wait=True)[1] == pytest.approx(whole / 2)
    alone, timer = timed_forward(module, counter=counter, x=x)
    alone.sum().backward()
    assert timer.forwards_sharing == 1


def test_a_second_backward_through_the_same_graph_does_not_move_the_end():
    out, timer = timed_forward(model())
    loss = out.sum()
    loss.backward(retain_graph=True)
    end = timer.backward_end.at
    time.sleep(0.02)
    loss.backward()
    assert timer.backward_end.at == end


def test_a_forward_without_gradients_watches_nothing():
    with torch.no_grad():
        _, timer = timed_forward(model(), BackwardShares())
    assert not timer.watching and not timer.pending and timer().seconds == pytest.approx(forward_seconds(timer))


def test_a_backend_with_timers_waiting_copies_and_pickles_with_its_shares():
    backend = CudaBackend()  # its constructor touches no GPU
    backend.backward_shares.learn(0, 0.010, 0.020)
    _, waiting = timed_forward(model(), backend.backward_shares)  # a timer whose backward never comes
    assert waiting in backend.backward_shares._timed
    for clone in (copy.deepcopy(backend), pickle.loads(pickle.dumps(backend))):
        assert clone.backward_shares.share == {0: pytest.approx(2.0)} and clone.backward_shares._timed == []
    assert backend.backward_shares._timed == [waiting]  # the original keeps waiting for it


def test_the_backend_times_one_training_forward_in_backward_every_and_not_the_first():
    backend = CudaBackend(backward_every=4)
    assert [i for i in range(9) if backend.count_training_forward()] == [1, 5]
    assert backend.training_forwards == 9
    every_one = CudaBackend(backward_every=1)
    assert all(every_one.count_training_forward() for _ in range(3))
    with pytest.raises(ValueError, match="backward_every"):
        CudaBackend(backward_every=0)
