"""The manager, the simulator and the core import without torch (torch is only for the client)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TORCH_FREE = ["drbalance", "drbalance.ratio", "drbalance.slowdown", "drbalance.policy", "drbalance.ipc.link",
              "drbalance.ipc.endpoint", "drbalance.manager.daemon", "drbalance.manager.cli", "drbalance.manager.status",
              "drbalance.emu.gpus", "drbalance.sim", "drbalance.sim.command", "drbalance.sim.reproduce",
              "drbalance.report.command", "drbalance.runs.launch", "drbalance.runs.demo", "drbalance.cli",
              "drbalance.profiling.command", "drbalance.profiling.store", "drbalance.workload.scenarios",
              "drbalance.workload.models", "drbalance.defaults"]


def test_core_manager_and_simulator_import_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    __import__(name)\n"
        "try:\n"
        "    import drbalance.client\n"
        "except ImportError:\n"
        "    print('client needs torch')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["client", "needs", "torch", "ok"]


@pytest.mark.slow
def test_the_client_does_not_load_dynamo_until_something_compiles():
    """``torch._dynamo`` takes as long to import as ``torch`` itself (seconds): every job, rank and
    test process would pay it for ``BalancedDataParallel.forward``'s ``torch.compiler.disable``.
    It is loaded only by what compiles; a wrapper made and used before then is still kept out of
    the compiled graph afterwards (one break at its entry, nothing of it traced, nothing
    recompiled when the DR changes)."""
    code = (
        "import sys\n"
        "import torch\n"
        "from torch import nn\n"
        "import drbalance.client, drbalance.integrations.job\n"
        "from drbalance.client import BalancedDataParallel\n"
        "wrapper = BalancedDataParallel(nn.Linear(4, 2), device_ids=[0, 1])\n"
        "wrapper(torch.randn(6, 4)).sum().backward()  # used eagerly first\n"
        "print('dynamo before compile', 'torch._dynamo' in sys.modules)\n"
        "from torch._dynamo.utils import counters\n"
        "compiled = torch.compile(wrapper, backend='eager')\n"
        "for ratio in ([5, 5], [7, 3], [2, 8], [10, 0], [4, 6]):\n"
        "    wrapper.set_ratio(ratio)\n"
        "    compiled(torch.randn(6, 4)).sum().backward()\n"
        "breaks = counters['graph_break']\n"
        "print('only the entry', all('Skip inlining' in reason and 'BalancedDataParallel.forward' in reason\n"
        "                            for reason in breaks) and sum(breaks.values()) <= 1)\n"
        "print('nothing traced', counters['stats']['unique_graphs'] == 0 and not counters['recompiles'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DRBALANCE_EMULATED_GPUS": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["dynamo before compile False", "only the entry True",
                                          "nothing traced True"], result.stdout + result.stderr
