"""The manager, the simulator and the core import without torch (torch is only for the client)."""

import subprocess
import sys

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
