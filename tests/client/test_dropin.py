"""Emulated GPUs for an unchanged script from the environment alone, a
per-model cost for any model, and the one-line swap in an ImageNet-style script."""

import os
import subprocess
import sys
import warnings
from contextlib import contextmanager

import pytest
import torch
import torchvision
from torch import nn

from drbalance.client import BalancedDataParallel, CpuBackend
from drbalance.client.costs import measure_features
from drbalance.client.emulated import EmulatedBackend
from drbalance.emu.gpus import EmulatedGpu, emulated_spec, remove_emulated_gpus
from drbalance.workload.models import MODEL_COSTS, TABLE_FEATURES, estimate_costs, model_costs
from tests.conftest import HELPERS, ROOT

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def emu(ipc_env):
    yield ipc_env
    remove_emulated_gpus(ipc_env, 4)


def test_item7_the_environment_variable_alone_gives_emulated_gpus(emu, monkeypatch):
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "3:8GiB")
    model = BalancedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    assert isinstance(model.backend, EmulatedBackend) and model.device_ids == [0, 1, 2]
    assert model.backend.memory_bytes == 8 * 2**30 and model.backend.costs is None
    out = model(torch.randn(9, 8))
    assert out.shape == (9, 2) and model.last_chunk_sizes == (3, 3, 3)
    costs = model.backend.costs  # estimated from the first chunk
    assert costs is not None and costs.fixed > 0 and costs.per_sample > 0 and costs.memory_fixed > 0
    assert [t.device for t in model.last_replica_timings()] == ["emu:0", "emu:1", "emu:2"]
    assert all(EmulatedGpu(emu, i).read().acquisitions >= 1 for i in range(3))
    model.backend.close()
    monkeypatch.delenv("DRBALANCE_EMULATED_GPUS")
    assert isinstance(BalancedDataParallel(nn.Linear(2, 2)).backend, CpuBackend)
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "3:lots")
    with pytest.raises(ValueError, match="'lots' is not a size"):
        BalancedDataParallel(nn.Linear(2, 2))


def test_item7_the_estimate_reproduces_the_published_timings_of_the_six_models():
    for name, features in TABLE_FEATURES.items():
        table, estimate = MODEL_COSTS[name], estimate_costs(name, features)
        ratio = estimate.device_seconds(12) / table.device_seconds(12)
        assert 0.8 < ratio < 1.2, (name, ratio)  # the fit's documented accuracy: 0.85x to 1.13x
    assert emulated_spec("4").count == 4 and emulated_spec("2:512MiB").memory_bytes == 512 * 2**20


def test_item7_model_profile_measures_any_torchvision_model():
    costs = model_costs("resnet18")
    # ResNet-18 has fewer FLOPs and operators than ResNet-50: it must come out cheaper on both counts
    resnet50 = estimate_costs("resnet50", TABLE_FEATURES["resnet50"])
    assert 0 < costs.per_sample < resnet50.per_sample and 0 < costs.fixed < resnet50.fixed
    parameters = sum(p.numel() for p in torchvision.models.resnet18().parameters())
    assert costs.memory_fixed == pytest.approx(3 * 4 * parameters)  # weights, gradients, one optimizer state
    with pytest.raises(ValueError, match="no cost table for model 'no_such_net'.*cannot be measured"):
        model_costs("no_such_net")


def test_measured_features_count_flops_saved_activations_and_operators():
    module = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    features, output = measure_features(module, (torch.randn(4, 100),), None, 4)
    assert output.shape == (4, 10)
    assert features.flops_per_sample == 2 * (100 * 50 + 50 * 10)  # a matmul's multiply-adds, counted twice
    # saved for the backward per sample: the input (100 floats), the ReLU's output (50) — not the weights
    assert 50 * 4 <= features.saved_bytes_per_sample <= (100 + 50 + 50) * 4
    assert features.parameter_bytes == 4 * (100 * 50 + 50 + 50 * 10 + 10) and features.modules == 4
    assert features.operators >= 5


def documented_edit() -> dict[str, str]:
    """The edit docs/client.md shows for an ImageNet-style script: each ``-`` line of its ``diff``
    block (without its comment) and the ``+`` line after it; the import line under ``"import"``;
    its context lines (but ``...``) under ``"context"``, joined by newlines."""
    text = (ROOT / "docs" / "client.md").read_text()
    block = text.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    context = [line[1:] for line in block if line.startswith(" ") and line.strip() != "..."]
    edit, removed = {"context": "\n".join(context)}, None
    for line in block:
        if line.startswith("-"):
            removed = line[1:].split("  #")[0].rstrip()
        elif line.startswith("+"):
            edit[removed if removed is not None else "import"] = line[1:].split("  #")[0].rstrip()
            removed = None
    return edit


def swapped_script(tmp_path) -> str:
    """The ImageNet-style script with the edit docs/client.md shows applied."""
    source = (HELPERS / "imagenet_like.py").read_text()
    edit = documented_edit()
    assert edit["import"].strip() == "from drbalance.client import BalancedDataParallel", edit
    lines = source.splitlines()
    for context in edit["context"].splitlines():  # the branches the edit names are the script's own
        assert context in lines, f"docs/client.md's edit names {context.strip()!r}, not in the script"
    for marker in ("# drop-in: CPU line", "# drop-in: CUDA line"):
        original = next(line for line in source.splitlines() if line.endswith(marker))
        code = original.split("  #")[0]
        assert code in edit, f"docs/client.md's edit does not show the script's line {code.strip()!r}"
        source = source.replace(original, edit[code])
    source = source.replace("import torch\n", f"import torch\n{edit['import']}\n", 1)
    path = tmp_path / "imagenet_swapped.py"
    path.write_text(source)
    return str(path)


def run_script(path, tmp_path, *args, emulated="2"):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DRBALANCE_EMULATED_GPUS=emulated)
    return subprocess.run([sys.executable, path, "--checkpoint", str(tmp_path / "ck.pth"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_item8_a_one_line_swap_runs_an_imagenet_style_script_on_emulated_gpus(emu, tmp_path):
    """The edit docs/client.md shows, applied to a script in today's ``torch.accelerator`` wording
    (``if not use_accel:``: the script skips DataParallel without an accelerator)."""
    path = swapped_script(tmp_path)
    watched = [EmulatedGpu(emu, i) for i in range(2)]  # held open as a manager would: the job leaves them at exit
    result = run_script(path, tmp_path, "--epochs", "2")
    assert result.returncode == 0, result.stderr
    assert "epoch 1 acc1" in result.stdout
    assert "model BalancedDataParallel keys module.conv1.weight" in result.stdout  # DataParallel's state dict keys
    assert all(gpu.read().acquisitions >= 6 for gpu in watched)  # both emulated GPUs ran chunks
    for gpu in watched:
        gpu.close()
    # resume and evaluate from the checkpoint the wrapper saved
    resumed = run_script(path, tmp_path, "--epochs", "3", "--resume", str(tmp_path / "ck.pth"))
    assert resumed.returncode == 0, resumed.stderr
    assert "=> resumed from" in resumed.stdout and "epoch 2 acc1" in resumed.stdout
    assert "epoch 1 acc1" not in resumed.stdout
    evaluated = run_script(path, tmp_path, "--evaluate", "--resume", str(tmp_path / "ck.pth"))
    assert evaluated.returncode == 0 and "eval acc1" in evaluated.stdout
    # the checkpoint loads into a bare model after stripping "module." as with nn.DataParallel
    state = torch.load(tmp_path / "ck.pth", weights_only=False)["state_dict"]
    bare = torchvision.models.resnet18(num_classes=10)
    bare.load_state_dict({key.removeprefix("module."): value for key, value in state.items()})


@pytest.mark.slow
def test_item8_without_the_swap_the_script_never_wraps_on_a_cpu_machine(emu, tmp_path):
    source = (HELPERS / "imagenet_like.py").read_text()
    path = tmp_path / "unchanged.py"
    path.write_text(source)
    result = run_script(str(path), tmp_path, "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "using CPU" in result.stdout and "model ResNet keys conv1.weight" in result.stdout


class _PhysicsInformed(nn.Module):
    """``torch.autograd.grad`` inside the forward, on an input that arrives without gradients."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        x = x.requires_grad_(True)
        u = self.net(x)
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u, du


class _Jacobian(nn.Module):
    """A ``torch.func`` transform in the forward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return torch.func.vmap(torch.func.jacrev(self.net))(x)


class _ScalesItsInputThenJacobian(_Jacobian):
    """Changes its input in place before the part the counting cannot run: run a second time on
    the same tensor, it would scale it twice."""

    def forward(self, x):
        x.mul_(2)
        return super().forward(x)


class _SparseInput(nn.Module):
    """A sparse tensor saved for the backward (it has no storage of its own)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        return torch.sparse.mm(x.to_sparse(), self.weight)


@pytest.mark.parametrize("make, inputs, guessed", [(_PhysicsInformed, (8, 2), True), (_Jacobian, (8, 2), True),
                                                   (_ScalesItsInputThenJacobian, (8, 2), True),
                                                   (_SparseInput, (8, 4), False)])
def test_a_forward_the_cost_counting_cannot_run_still_runs_on_emulated_gpus(emu, monkeypatch, make, inputs, guessed):
    # (_ScalesItsInputThenJacobian's backward is not compared: a forward that changes its input in
    # place breaks the backward of any split on the CPU path, counted or not; docs/client.md)
    """On emulated GPUs the first chunk's forward runs under the cost counting, whose error must not
    stop these models' first step (replica 0 on emu:0) where the bare module runs. Their outputs
    and gradients equal the bare module's; where the counting cannot run, the costs are guessed
    and a warning says so."""
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "4")
    torch.manual_seed(0)
    bare = make()
    wrapped = BalancedDataParallel(make())
    wrapped.module.load_state_dict(bare.state_dict())
    batch = torch.randn(*inputs)
    with pytest.warns(RuntimeWarning, match="could not measure") if guessed else _no_warning():
        got = wrapped(batch.clone())
    expected = bare(batch.clone())
    got, expected = (torch.cat([t.flatten() for t in value]) if isinstance(value, tuple) else value
                     for value in (got, expected))
    assert torch.allclose(got, expected, atol=1e-6)
    if make is _ScalesItsInputThenJacobian:
        wrapped.backend.close()
        return
    got.sum().backward()
    expected.sum().backward()
    for mine, theirs in zip(wrapped.module.parameters(), bare.parameters()):
        assert (mine.grad is None) == (theirs.grad is None)  # a Jacobian's last bias has none
        assert mine.grad is None or torch.allclose(mine.grad, theirs.grad, atol=1e-5)
    costs = wrapped.backend.costs  # sparse.mm's FLOPs are not counted: per sample it may cost 0
    assert costs is not None and costs.per_sample >= 0 and costs.fixed > 0
    wrapped.backend.close()


def test_a_forward_that_fails_by_itself_raises_its_own_error_on_emulated_gpus(emu, monkeypatch):
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "2")
    model = BalancedDataParallel(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
        model(torch.randn(6, 3))  # the wrong width: the model's own error, not the counting's
    assert "replica 0 on device emu:0" in str(raised.value)
    model.backend.close()


@contextmanager
def _no_warning():
    """A RuntimeWarning inside is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def test_cuda_device_ids_of_a_gpu_script_name_the_emulated_gpus_of_their_index(emu, monkeypatch):
    """A script written for GPUs passes torch.device("cuda:1") or "cuda:1", as nn.DataParallel takes
    them; on emulated GPUs they name the emulated GPU of that index, not "CUDA is not available here"."""
    monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "4")
    for ids, expected in (([torch.device("cuda:1"), torch.device("cuda:2")], [1, 2]), (["cuda:0", "cuda:3"], [0, 3]),
                          ([2, "cuda:1"], [2, 1])):
        model = BalancedDataParallel(nn.Linear(2, 2), device_ids=ids)
        assert model.device_ids == expected
        assert model(torch.randn(4, 2)).shape == (4, 2) and model.last_chunk_sizes == (2, 2)
        model.backend.close()
    with pytest.raises(ValueError, match=r"device_ids\[0\] is cuda without an index"):
        BalancedDataParallel(nn.Linear(2, 2), device_ids=["cuda"])
    with pytest.raises(ValueError, match=r"device_ids \[7\] are not among the 4 emulated GPUs"):
        BalancedDataParallel(nn.Linear(2, 2), device_ids=["cuda:7"])


SAVE_ON_EMULATED = """
import sys, torch
from torch import nn
from drbalance.client import BalancedDataParallel
model = BalancedDataParallel(nn.Linear(4, 2))
model(torch.randn(6, 4))
assert model.backend.kind == "emulated", model.backend.kind
torch.save(model, sys.argv[1])
model.backend.close()
"""

LOAD_ELSEWHERE = """
import os, sys, torch
from drbalance.ipc.names import IpcNames
from tests.conftest import leftovers
model = torch.load(sys.argv[1], weights_only=False)
out = model(torch.randn(6, 4))
print(model.backend.kind, tuple(out.shape), model.last_chunk_sizes, len(leftovers(IpcNames.current())))
"""


@pytest.mark.slow
def test_a_model_saved_whole_on_emulated_gpus_loads_without_them(emu, tmp_path):
    """A wrapper saved with ``torch.save`` on emulated GPUs loads on the CPU path, with its DR, in a
    process without ``DRBALANCE_EMULATED_GPUS`` (it opens no emulated GPUs there: no segments in
    /dev/shm, no device time), and on emulated GPUs where the variable is set."""
    saved = tmp_path / "model.pt"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "DRBALANCE_EMULATED_GPUS": "3"}
    subprocess.run([sys.executable, "-c", SAVE_ON_EMULATED, str(saved)], env=environment, cwd=ROOT, check=True,
                   timeout=120)
    remove_emulated_gpus(emu, 3)
    del environment["DRBALANCE_EMULATED_GPUS"]
    loaded = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(saved)], env=environment, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split("\n")[0] == "cpu (6, 2) (2, 2, 2) 0", loaded.stdout
    environment["DRBALANCE_EMULATED_GPUS"] = "3"
    loaded = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(saved)], env=environment, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.startswith("emulated (6, 2) (2, 2, 2) "), loaded.stderr
