"""BalancedDataParallel on CUDA. Skipped only where CUDA (or a second GPU) is missing.

On a one-GPU machine the single-device cases run on cuda:0; the multi-GPU cases need two GPUs.
Results from a GPU run are recorded in docs/gpu-results.md with the command.
"""

import pytest
import torch
from torch import nn

from drbalance.client import BalancedDataParallel, CudaBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (hardware)")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (hardware)"
)


def model_on(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def test_single_gpu_matches_the_bare_module_and_times_on_cuda():
    model = model_on("cuda:0")
    x = torch.randn(9, 16)  # on the CPU: scattered to the GPU as DataParallel does
    y = torch.randint(0, 4, (9,))
    reference = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    wrapped = BalancedDataParallel(model, device_ids=[0], ratio=[10])
    assert isinstance(wrapped.backend, CudaBackend)
    loss = nn.functional.cross_entropy(wrapped(x), y.cuda())
    loss.backward()
    torch.testing.assert_close(loss, reference)
    for grad, exp in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(grad, exp)
    timings = wrapped.last_replica_timings()
    assert [(t.slot, t.device, t.samples) for t in timings] == [(0, "cuda:0", 9)]
    assert timings[0].seconds > 0


def test_single_gpu_scalar_loss_and_state_dict_round_trip():
    class MeanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.linear(x).squeeze(1) - y) ** 2).mean()

    module = MeanLoss().cuda()
    x, y = torch.randn(7, 4, device="cuda"), torch.randn(7, device="cuda")
    wrapped = BalancedDataParallel(module, device_ids=[0])
    torch.testing.assert_close(wrapped(x, y), module(x, y))
    data_parallel = nn.DataParallel(MeanLoss().cuda(), device_ids=[0])
    data_parallel.load_state_dict(wrapped.state_dict())
    torch.testing.assert_close(data_parallel(x, y), module(x, y))


def test_module_on_the_wrong_device_is_reported():
    wrapped = BalancedDataParallel(model_on("cuda:0"), device_ids=[0])
    wrapped.module.to("cpu")
    with pytest.raises(RuntimeError, match="on device cuda:0"):
        wrapped(torch.randn(2, 16))


@needs_two_gpus
@pytest.mark.parametrize("shares", [[10, 0], [0, 10], [3, 7], [7, 3]])
def test_two_gpus_zero_shares_and_uneven_splits_match_the_bare_module(shares):
    model = model_on("cuda:0")
    x, y = torch.randn(10, 16, device="cuda:0"), torch.randint(0, 4, (10,), device="cuda:0")
    nn.functional.cross_entropy(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    wrapped = BalancedDataParallel(model, device_ids=[0, 1], ratio=shares)
    out = wrapped(x)
    assert out.device == torch.device("cuda:0")
    nn.functional.cross_entropy(out, y).backward()
    for grad, exp in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(grad, exp, rtol=1e-4, atol=1e-5)
    used = [slot for slot, share in enumerate(shares) if share]
    assert [t.slot for t in wrapped.last_replica_timings()] == used


@needs_two_gpus
def test_an_error_names_the_gpu():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            if x.device.index == 1:
                raise ValueError("bad chunk")
            return self.linear(x)

    wrapped = BalancedDataParallel(Fails().cuda(), device_ids=[0, 1], ratio=[5, 5])
    with pytest.raises(ValueError, match="on device cuda:1"):
        wrapped(torch.randn(4, 2))


# --- device UUIDs, memory per sample, out-of-memory errors, BatchNorm on CUDA -----------------

def test_device_uuids_are_nvmls_and_memory_per_sample_is_measured():
    wrapped = BalancedDataParallel(model_on("cuda:0"), device_ids=[0])
    (uuid,) = wrapped.device_uuids()
    assert uuid.startswith(("GPU-", "MIG-")) and len(uuid) >= 40
    import pynvml  # nvidia-ml-py is a dependency: a broken install fails here, it is not skipped

    pynvml.nvmlInit()
    # without CUDA_VISIBLE_DEVICES remapping, torch's device 0 is one of NVML's GPUs
    nvml_uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                  for i in range(pynvml.nvmlDeviceGetCount())]
    assert uuid.lower() in [str(u).lower() for u in nvml_uuids]
    wrapped.memory_per_sample()  # reset the peak
    wrapped(torch.randn(64, 16)).sum().backward()
    (per_sample,) = wrapped.memory_per_sample()
    assert per_sample is not None and per_sample > 0


def test_a_real_out_of_memory_error_under_the_proven_dr_propagates_unchanged():
    # one GPU: nothing to revert to; the revert itself is tested on emulated GPUs (tests/client/test_oom.py)
    class Hungry(nn.Module):
        """Allocates far more than the GPU has once a chunk exceeds 8 samples."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x):
            if x.shape[0] > 8:
                torch.empty(1 << 50, device=x.device)  # 1 PiB
            return self.linear(x)

    wrapped = BalancedDataParallel(Hungry().cuda(), device_ids=[0], ratio=[10])
    wrapped(torch.randn(8, 16)).sum().backward()
    wrapped(torch.randn(8, 16)).sum().backward()  # the DR [10] is proven
    wrapped.set_ratio([10])
    with pytest.raises(torch.cuda.OutOfMemoryError):
        wrapped(torch.randn(16, 16))  # the proven DR itself: nothing to revert to, the error propagates
    assert wrapped.backend.out_of_memory(torch.cuda.OutOfMemoryError("GPU 0 has a total capacity"), [0]).slot == 0


@needs_two_gpus
def test_two_gpus_batchnorm_buffers_advance_once_and_0_dim_arguments_are_broadcast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).cuda()
    reference = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).cuda()
    reference.load_state_dict(model.state_dict())
    wrapped = BalancedDataParallel(model, device_ids=[0, 1], ratio=[4, 6])
    x = torch.randn(10, 3, device="cuda:0")
    wrapped(x).sum().backward()
    reference(x)
    assert model[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    wrapped.set_ratio([0, 10])  # device_ids[0] holds no chunk: the buffers still advance (DataParallel: never)
    wrapped(x)
    assert model[1].num_batches_tracked.item() == 2

    class Scaled(nn.Module):
        def forward(self, x, scale):
            return x * scale

    out = BalancedDataParallel(Scaled().cuda(), device_ids=[0, 1], ratio=[5, 5])(x, torch.tensor(2.0, device="cuda:0"))
    torch.testing.assert_close(out, x * 2)


# --- a chunk time covers the forward and the backward -------------------------------------------

def heavy_model() -> nn.Module:
    """Matrix products big enough that device time dwarfs launches: a backward costs about twice
    the forward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10)).cuda()


def test_a_chunk_time_adds_the_backward_once_it_has_run():
    wrapped = BalancedDataParallel(heavy_model(), device_ids=[0], ratio=[10], backend=CudaBackend(backward_every=1))
    x = torch.randn(4096, 2048, device="cuda")
    for _ in range(3):  # warm-up
        wrapped(x).sum().backward()
    torch.cuda.synchronize()
    out = wrapped(x)
    (forward_only,) = wrapped.last_replica_timings()  # before the backward: the forward alone, not final
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out.sum().backward()
    end.record()
    torch.cuda.synchronize()
    backward = start.elapsed_time(end) / 1000.0
    (whole,) = wrapped.last_replica_timings()
    assert whole.seconds > 1.8 * forward_only.seconds  # 3 products of 2048 x 2048 in the backward, 2 forward
    assert 0.8 * (forward_only.seconds + backward) < whole.seconds < 1.2 * (forward_only.seconds + backward)
    assert wrapped.last_replica_timings()[0] == whole  # final now: read again, the same
    assert wrapped.module[0].weight._backward_hooks in (None, {})  # nothing stays on the module's parameters
    import copy
    import io

    copy.deepcopy(wrapped.module)
    torch.save(wrapped.module, io.BytesIO())
    wrapped(x)  # a timed forward whose backward never comes: the wrapper still copies and saves
    assert copy.deepcopy(wrapped).backend.backward_shares.share == wrapped.backend.backward_shares.share
    torch.save(wrapped, io.BytesIO())


def test_between_timed_backwards_a_chunk_time_is_the_forward_scaled_by_the_measured_share():
    wrapped = BalancedDataParallel(heavy_model(), device_ids=[0], ratio=[10], backend=CudaBackend(backward_every=4))
    x = torch.randn(4096, 2048, device="cuda")
    totals = []
    for _ in range(8):  # steps 1 and 5 time their backward; 2-4 and 6-7 scale their forward
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wrapped(x).sum().backward()
        end.record()
        torch.cuda.synchronize()
        totals.append((start.elapsed_time(end) / 1000.0, wrapped.last_replica_timings()[0].seconds))
    share = wrapped.backend.backward_shares.share[0]
    assert 1.2 < share < 2.5  # 3 products of 2048 x 2048 in the backward, 2 in the forward
    for step, (total, chunk) in enumerate(totals[1:], start=1):
        assert 0.8 * total < chunk < 1.2 * total, (step, total, chunk)


def test_without_a_backward_a_chunk_time_is_the_forward_and_is_final():
    wrapped = BalancedDataParallel(heavy_model(), device_ids=[0], ratio=[10])
    x = torch.randn(1024, 2048, device="cuda")
    with torch.no_grad():
        wrapped(x)
    (first,) = wrapped.last_replica_timings()
    assert first.seconds > 0 and wrapped.last_replica_timings()[0] == first
    assert wrapped.backend.backward_shares.share == {}  # no backward: nothing learned


@needs_two_gpus
def test_two_gpus_each_replica_times_its_own_backward():
    wrapped = BalancedDataParallel(heavy_model(), device_ids=[0, 1], ratio=[2, 8],
                                   backend=CudaBackend(backward_every=1))
    x = torch.randn(4096, 2048, device="cuda:0")
    for _ in range(3):
        wrapped(x).sum().backward()
    out = wrapped(x)
    forward = [t.seconds for t in wrapped.last_replica_timings()]
    out.sum().backward()
    small, large = wrapped.last_replica_timings()
    assert small.seconds > 1.8 * forward[0] and large.seconds > 1.8 * forward[1]
    assert large.seconds > 2 * small.seconds  # 8 shares against 2: the chunk times follow the samples
