"""``torch.compile`` and BalancedDataParallel: drbalance's bookkeeping stays out
of dynamo, and a compiled model's steps do not recompile when the DR changes."""

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from drbalance.client import BalancedDataParallel
from drbalance.emu.gpus import remove_emulated_gpus

RATIOS = ([5, 5], [7, 3], [3, 7], [6, 4], [10, 0], [5, 5], [8, 2], [2, 8])


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def train(model: nn.Module, wrapper: BalancedDataParallel, steps: int) -> list[torch.Tensor]:
    """``steps`` training steps with a new DR before each; the losses."""
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        wrapper.set_ratio(RATIOS[step % len(RATIOS)])
        loss = model(torch.randn(8, 3, 8, 8, generator=generator)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["cpu", "emulated"])
def backend_kind(request, ipc_env, monkeypatch):
    if request.param == "emulated":
        monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "2")
    else:
        monkeypatch.delenv("DRBALANCE_EMULATED_GPUS", raising=False)
    yield request.param
    remove_emulated_gpus(ipc_env, 2)


def test_compiling_the_wrapper_traces_none_of_drbalances_bookkeeping(fresh_dynamo, backend_kind):
    """``torch.compile(BalancedDataParallel(net))``: dynamo skips the wrapper's forward at its entry
    (the one break, with no graph on either side), and training is the eager wrapper's. Tracing the
    split, timings and (on emulated GPUs) the cost measurement would break the graph at each and
    recompile at every DR change until dynamo's recompile limit."""
    wrapper = BalancedDataParallel(network(), device_ids=[0, 1])
    assert wrapper.backend.kind == backend_kind
    eager = BalancedDataParallel(network(), device_ids=[0, 1], backend=wrapper.backend)
    compiled_losses = train(torch.compile(wrapper, backend="eager"), wrapper, 2 * len(RATIOS))
    breaks = counters["graph_break"]
    assert all("Skip inlining" in reason and "BalancedDataParallel.forward" in reason for reason in breaks), breaks
    assert sum(breaks.values()) <= 1 and counters["stats"]["unique_graphs"] == 0 and not counters["recompiles"]
    torch.testing.assert_close(compiled_losses, train(eager, eager, 2 * len(RATIOS)))
    getattr(wrapper.backend, "close", lambda: None)()


def test_a_compiled_wrapped_module_does_not_recompile_when_the_dr_changes(fresh_dynamo, backend_kind):
    """``model.compile(dynamic=True)`` compiles the wrapped module: its chunks run compiled. Once
    each kind of chunk has run (the first, at offset 0 in the batch, and later ones), steps with
    any DR compile nothing again."""
    wrapper = BalancedDataParallel(network(), device_ids=[0, 1])
    wrapper.compile(backend="eager", dynamic=True)
    train(wrapper, wrapper, len(RATIOS))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the wrapped module was compiled
    with torch._dynamo.config.patch(error_on_recompile=True):
        train(wrapper, wrapper, 2 * len(RATIOS))
    assert counters["stats"]["unique_graphs"] == graphs
    assert sorted(wrapper.state_dict()) == sorted(f"module.{key}" for key in network().state_dict())
    getattr(wrapper.backend, "close", lambda: None)()
