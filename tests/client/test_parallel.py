"""BalancedDataParallel on the CPU path: split, order, gradients, state dicts, errors."""

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from drbalance import DataRatio
from drbalance.client import BalancedDataParallel, CpuBackend
from drbalance.client.parallel import fold_single_samples

RATIOS = [[10, 0, 0, 0], [1, 2, 7, 0], [3, 3, 3, 1], [0, 0, 0, 10], [0, 5, 0, 5]]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """These tests are about the CPU path: a DRBALANCE_EMULATED_GPUS in the caller's environment
    would put every default-constructed wrapper on emulated GPUs."""
    monkeypatch.delenv("DRBALANCE_EMULATED_GPUS", raising=False)


def small_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
    )


def batch(size: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, 5, (size,), generator=generator)


def loss_and_grads(model: nn.Module, wrapped: nn.Module, images, labels):
    model.zero_grad()
    loss = nn.functional.cross_entropy(wrapped(images), labels)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("shares", RATIOS)
@pytest.mark.parametrize("size", [1, 3, 16])
def test_loss_and_gradients_match_the_bare_module(shares, size):
    model = small_cnn()
    images, labels = batch(size)
    reference_loss, reference_grads = loss_and_grads(model, model, images, labels)
    wrapped = BalancedDataParallel(model, ratio=shares)
    loss, grads = loss_and_grads(model, wrapped, images, labels)
    torch.testing.assert_close(loss, reference_loss)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert sum(wrapped.last_chunk_sizes) == size


def test_optimizer_steps_with_ratio_changes_end_at_the_same_parameters():
    plain, balanced = small_cnn(seed=3), small_cnn(seed=3)
    wrapped = BalancedDataParallel(balanced, ratio=[10, 0, 0, 0])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, balanced)]
    for step, shares in enumerate([[10, 0, 0, 0], [1, 2, 7, 0], [3, 3, 3, 1], [0, 0, 5, 5], [4, 0, 6, 0]]):
        wrapped.set_ratio(shares)
        images, labels = batch(12, seed=step)
        for runner, optimizer in ((plain, optimizers[0]), (wrapped, optimizers[1])):
            optimizer.zero_grad()
            nn.functional.cross_entropy(runner(images), labels).backward()
            optimizer.step()
        assert wrapped.last_chunk_sizes == DataRatio(shares).split(12)
    for a, b in zip(plain.parameters(), balanced.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dicts_interchange_with_data_parallel_and_the_bare_module():
    source = small_cnn(seed=5)
    balanced = BalancedDataParallel(source, ratio=[1, 2, 7, 0])
    data_parallel = nn.DataParallel(small_cnn(seed=6))
    assert list(balanced.state_dict()) == list(data_parallel.state_dict())
    data_parallel.load_state_dict(balanced.state_dict())
    bare = small_cnn(seed=7)
    bare.load_state_dict(balanced.module.state_dict())
    images, _ = batch(6)
    torch.testing.assert_close(bare(images), balanced(images))
    other = BalancedDataParallel(small_cnn(seed=8), ratio=[0, 0, 0, 10])
    other.load_state_dict(data_parallel.state_dict())
    torch.testing.assert_close(other(images), balanced(images))
    assert isinstance(balanced, nn.DataParallel)


class Echo(nn.Module):
    """Returns its tensor inputs, so gathering order and pass-through can be checked exactly."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.non_tensors = []

    def forward(self, x, pair=None, *, extra=None, flag="default", table=None):
        self.calls.append(x.shape[0])
        if pair is not None:
            self.non_tensors.append((pair.right[1], flag))
            pair = Pair(pair.left, [pair.right[0], None])
        return {"x": x, "pair": pair, "extra": extra, "table": table}


Pair = namedtuple("Pair", "left right")


def test_nested_inputs_kwargs_and_non_tensors_are_split_and_gathered_in_order():
    echo = Echo()
    wrapped = BalancedDataParallel(echo, ratio=[2, 0, 5, 3])
    x = torch.arange(10.0).unsqueeze(1)
    pair = Pair(torch.arange(10), [torch.arange(10) * 2, "label"])
    out = wrapped(x, pair, extra=(torch.arange(10) + 100,), flag="kept", table={"ids": torch.arange(10) - 5})
    assert echo.calls == [2, 5, 3]  # one call per non-empty chunk, in slot order; none for slot 1
    assert echo.non_tensors == [("label", "kept")] * 3  # non-tensor inputs reach every replica
    torch.testing.assert_close(out["x"], x)
    assert isinstance(out["pair"], Pair)
    torch.testing.assert_close(out["pair"].left, torch.arange(10))
    torch.testing.assert_close(out["pair"].right[0], torch.arange(10) * 2)
    assert out["pair"].right[1] is None
    torch.testing.assert_close(out["extra"][0], torch.arange(10) + 100)
    torch.testing.assert_close(out["table"]["ids"], torch.arange(10) - 5)
    assert [t.slot for t in wrapped.last_replica_timings()] == [0, 2, 3]
    assert all(t.seconds >= 0 and t.device == "cpu" for t in wrapped.last_replica_timings())


def test_batch_smaller_than_used_gpus_runs_fewer_replicas():
    echo = Echo()
    wrapped = BalancedDataParallel(echo, ratio=[3, 3, 3, 1])
    out = wrapped(torch.ones(2, 1))
    assert echo.calls == [1, 1]
    assert wrapped.last_chunk_sizes == (1, 1, 0, 0)
    assert out["x"].shape == (2, 1)


def test_call_without_tensors_or_with_an_empty_batch_runs_once_on_the_first_used_slot():
    calls = []

    class NoTensor(nn.Module):
        def forward(self, value):
            calls.append(value)
            return value * 2

    wrapped = BalancedDataParallel(NoTensor(), ratio=[0, 4, 6, 0])
    assert wrapped(21) == 42 and calls == [21]
    assert wrapped.last_chunk_sizes == (0, 0, 0, 0)
    out = BalancedDataParallel(nn.Linear(3, 2), ratio=[5, 5])(torch.ones(0, 3))
    assert out.shape == (0, 2)


class MeanLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.linear(x).squeeze(1) - y) ** 2).mean()


def test_scalar_outputs_are_weighted_by_chunk_size_by_default():
    torch.manual_seed(0)
    module = MeanLoss()
    x, y = torch.randn(10, 4), torch.randn(10)
    expected = module(x, y)
    expected.backward()
    expected_grad = module.linear.weight.grad.clone()
    module.zero_grad()
    wrapped = BalancedDataParallel(module, ratio=[1, 2, 7, 0])
    loss = wrapped(x, y)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, expected)
    loss.mean().backward()  # the usual DataParallel idiom stays correct
    torch.testing.assert_close(module.linear.weight.grad, expected_grad)


def test_scalar_outputs_can_be_stacked_like_data_parallel():
    torch.manual_seed(0)
    module = MeanLoss()
    x, y = torch.randn(10, 4), torch.randn(10)
    stacked = BalancedDataParallel(module, ratio=[1, 2, 7, 0], scalar_outputs="stack")(x, y)
    assert stacked.shape == (3,)
    torch.testing.assert_close(stacked[2], module(x[3:], y[3:]))


def test_set_ratio_applies_at_the_next_forward_never_mid_forward():
    wrapped = None

    class ChangesRatio(nn.Module):
        def forward(self, x):
            wrapped.set_ratio([0, 0, 0, 10])
            return x

    wrapped = BalancedDataParallel(ChangesRatio(), ratio=[5, 5, 0, 0])
    wrapped(torch.ones(4, 1))
    assert wrapped.last_chunk_sizes == (2, 2, 0, 0)  # every chunk of this forward kept the old DR
    assert wrapped.ratio == DataRatio([0, 0, 0, 10])
    wrapped(torch.ones(4, 1))
    assert wrapped.last_chunk_sizes == (0, 0, 0, 4)


def test_batchnorm_in_eval_mode_matches_and_train_mode_uses_per_chunk_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 3)
    wrapped = BalancedDataParallel(model, ratio=[5, 0, 5, 0])
    model.eval()
    torch.testing.assert_close(wrapped(x), model(x))
    model.train()
    per_chunk = torch.cat([model(x[:4]), model(x[4:])])
    torch.testing.assert_close(wrapped(x), per_chunk)


def test_batchnorm_in_training_never_gets_a_chunk_of_one_sample():
    # an epoch's last, partial batch of 11 under DR [1, 9] splits 1 + 10: one sample cannot train batch norm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    wrapped = BalancedDataParallel(model, device_ids=[0, 1])
    wrapped.set_ratio([1, 9])
    x = torch.randn(11, 3)
    torch.testing.assert_close(wrapped(x), model(x))  # folded onto one replica: its statistics are the batch's
    assert wrapped.last_chunk_sizes == (0, 11)
    wrapped.set_ratio([5, 5])
    wrapped(torch.randn(3, 3))  # even 2 + 1: nn.DataParallel fails here; folded to 3 + 0
    assert wrapped.last_chunk_sizes == (3, 0)
    model.eval()  # running statistics: one sample is fine, the DR's split stands
    wrapped(torch.randn(3, 3))
    assert wrapped.last_chunk_sizes == (2, 1)
    plain = BalancedDataParallel(nn.Linear(3, 4), device_ids=[0, 1], ratio=[1, 9])
    plain(torch.randn(11, 3))  # no batch norm: nothing folded
    assert plain.last_chunk_sizes == (1, 10)
    assert fold_single_samples((1, 1, 1)) == (0, 3, 0) and fold_single_samples((1, 0)) == (1, 0)


def test_default_ratio_is_an_exactly_even_split():
    wrapped = BalancedDataParallel(Echo(), device_ids=[0, 1, 2, 3])
    assert wrapped.ratio == DataRatio([1, 1, 1, 1], total=4)
    wrapped(torch.ones(16, 1))
    assert wrapped.last_chunk_sizes == (4, 4, 4, 4)
    assert isinstance(wrapped.backend, CpuBackend)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ratio": [5, 5, 0], "device_ids": [0, 1]}, ValueError, "has 3 entries but device_ids"),
        ({"ratio": [5, 5], "device_ids": [0, 1, 2]}, ValueError, "has 2 entries but device_ids"),
        ({"ratio": [6, -5]}, ValueError, "entry 1 of \\[6, -5\\] is -5"),
        ({"ratio": [0, 0]}, ValueError, "are all zero"),
        ({"dim": "0"}, ValueError, "dim must be an integer"),
        ({"scalar_outputs": "sum"}, ValueError, "scalar_outputs must be one of"),
        ({"device_ids": [0, 0]}, ValueError, "duplicates"),
        ({"device_ids": ["cuda"]}, ValueError, r"device_ids\[0\] is cuda without an index"),
        ({"device_ids": ["gpu0"]}, ValueError, r"device_ids\[0\] is 'gpu0'; expected an integer, 'cuda:N'"),
        ({"device_ids": [0, 1.5]}, ValueError, r"device_ids\[1\] is 1.5; expected an integer"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        BalancedDataParallel(nn.Linear(2, 2), **kwargs)


def test_not_a_module_and_bad_set_ratio():
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        BalancedDataParallel(lambda x: x)
    wrapped = BalancedDataParallel(nn.Linear(2, 2), ratio=[5, 5])
    with pytest.raises(ValueError, match="entry 0 of \\[nan, 2\\] is nan"):
        wrapped.set_ratio([float("nan"), 2])
    with pytest.raises(ValueError, match="has 3 entries"):
        wrapped.set_ratio([5, 5, 0])
    assert wrapped.ratio == DataRatio([5, 5])  # a rejected ratio changes nothing


def test_mismatched_tensor_lengths_are_rejected_with_the_offending_argument():
    wrapped = BalancedDataParallel(Echo(), ratio=[5, 5])
    with pytest.raises(ValueError, match=r"tensor inputs\[1\] has shape \(3,\).*4 samples"):
        wrapped(torch.ones(4, 1), torch.ones(3))


def test_an_error_in_a_replica_names_the_replica_and_device():
    class FailsOnSmallChunks(nn.Module):
        def forward(self, x):
            if x.shape[0] < 3:
                raise KeyError("boom")
            return x

    wrapped = BalancedDataParallel(FailsOnSmallChunks(), ratio=[0, 7, 0, 3])
    with pytest.raises(KeyError, match=r"in replica 1 on device cpu \(DR slot 3, 3 samples\)|DR slot 3"):
        wrapped(torch.ones(5, 1))


# --- drop-in behaviour: BatchNorm buffers, 0-dim arguments, outputs, copies, array DRs ----------

def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


@pytest.mark.parametrize("shares", [[3, 3, 4], [2, 3, 5], [10, 0, 0]])
def test_item1_batchnorm_buffers_advance_once_per_step(shares):
    bare, model = bn_model(), bn_model()
    wrapped = BalancedDataParallel(model, ratio=shares)
    batches = [torch.randn(12, 3, generator=torch.Generator().manual_seed(step)) for step in range(8)]
    for x in batches:
        wrapped(x).sum().backward()
        bare(x)
    bn, reference = model[1], bare[1]
    assert bn.num_batches_tracked.item() == 8  # once per step, not once per chunk (was 24 with 3 chunks)
    # running_mean moves towards the whole batch's mean exactly as the bare module's does
    torch.testing.assert_close(bn.running_mean, reference.running_mean)


def test_item1_running_var_is_the_sample_weighted_mean_of_the_chunk_variances():
    model = bn_model()
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(4))
    sizes = DataRatio([2, 3, 5]).split(10)
    with torch.no_grad():
        features = model[0](x)
    BalancedDataParallel(model, ratio=[2, 3, 5])(x)
    chunk_vars = [chunk.var(dim=0, unbiased=True) for chunk in features.split(list(sizes))]
    weighted = sum(v * (n / 10) for v, n in zip(chunk_vars, sizes))
    momentum = model[1].momentum
    torch.testing.assert_close(model[1].running_var, (1 - momentum) * torch.ones(4) + momentum * weighted)


def test_item1_eval_mode_leaves_buffers_alone_and_a_failed_forward_restores_them():
    model = bn_model()
    wrapped = BalancedDataParallel(model, ratio=[5, 5])
    before = [b.clone() for b in model.buffers()]
    model.eval()
    wrapped(torch.randn(6, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    model.train()

    class FailsSecondChunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = bn_model()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            out = self.inner(x)
            if self.calls == 2:
                raise ValueError("second chunk fails")
            return out

    failing = FailsSecondChunk()
    before = [b.clone() for b in failing.buffers()]
    with pytest.raises(ValueError, match="second chunk fails"):
        BalancedDataParallel(failing, ratio=[5, 5])(torch.randn(6, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, failing.buffers()))  # the first chunk's update undone


class Scaled(nn.Module):
    def forward(self, x, scale, *, shift=None):
        return x * scale + (0 if shift is None else shift)


def test_item3_a_0_dim_tensor_argument_is_broadcast_to_every_chunk():
    wrapped = BalancedDataParallel(Scaled(), ratio=[5, 0, 5])
    scale = torch.tensor(3.0, requires_grad=True)
    x = torch.arange(6.0).unsqueeze(1)
    out = wrapped(x, scale, shift=torch.tensor(1.0))
    assert wrapped.last_chunk_sizes == (3, 0, 3)  # split, not run whole on one slot with sizes (0, 0)
    torch.testing.assert_close(out, x * 3 + 1)
    out.sum().backward()
    torch.testing.assert_close(scale.grad, x.sum())  # the gradient reaches the scalar through every chunk
    # a scalar first: the batch size comes from the first tensor with a dimension
    flipped = BalancedDataParallel(Scaled(), ratio=[5, 5])(torch.ones(4, 1), scale=torch.tensor(2.0))
    torch.testing.assert_close(flipped, torch.full((4, 1), 2.0))


class ReturnsCount(nn.Module):
    def forward(self, x):
        return x, x.shape[0]


class ReturnsNestedString(nn.Module):
    def forward(self, x):
        return {"logits": x, "meta": {"names": ["a"]}}


@pytest.mark.parametrize("shares", [[5, 5], [10, 0], [0, 10]])
def test_item4_a_non_tensor_output_raises_a_clear_type_error_for_every_dr(shares):
    wrapped = BalancedDataParallel(ReturnsCount(), ratio=shares)
    with pytest.raises(TypeError, match=r"returned int 2 as output\[1\]|returned int 4 as output\[1\]"):
        wrapped(torch.ones(4, 1))
    nested = BalancedDataParallel(ReturnsNestedString(), ratio=shares)
    with pytest.raises(TypeError, match=r"str 'a' as output\['meta'\]\['names'\]\[0\]"):
        nested(torch.ones(4, 1))
    # the model is still usable afterwards
    assert BalancedDataParallel(Echo(), ratio=shares)(torch.ones(4, 1))["x"].shape == (4, 1)


def test_item5_the_wrapper_saves_copies_and_pickles_after_reading_timings():
    import copy
    import io
    import pickle

    wrapped = BalancedDataParallel(small_cnn(seed=2), ratio=[1, 2, 7, 0])
    images, _ = batch(6)
    expected = wrapped(images)
    assert len(wrapped.last_replica_timings()) == 3
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.ratio == wrapped.ratio and isinstance(loaded, BalancedDataParallel)
    torch.testing.assert_close(loaded(images), expected)
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        torch.testing.assert_close(clone(images), expected)
        assert clone.ratio == DataRatio([1, 2, 7, 0]) and clone.last_chunk_sizes == (1, 1, 4, 0)
    averaged = torch.optim.swa_utils.AveragedModel(wrapped)
    averaged.update_parameters(wrapped)
    torch.testing.assert_close(averaged(images), expected)


@pytest.mark.parametrize(
    "given",
    [lambda: __import__("numpy").array([1, 2, 7, 0]), lambda: torch.tensor([1, 2, 7, 0]),
     lambda: __import__("numpy").array([1, 2, 7, 0], dtype="int32"), lambda: (1, 2, 7, 0)],
)
def test_item6_numpy_arrays_and_tensors_are_accepted_as_drs(given):
    wrapped = BalancedDataParallel(Echo(), ratio=given())
    assert wrapped.ratio == DataRatio([1, 2, 7, 0])
    wrapped.set_ratio(given()[[3, 2, 1, 0]] if not isinstance(given(), tuple) else (0, 7, 2, 1))
    assert wrapped.ratio == DataRatio([0, 7, 2, 1])
    wrapped(torch.ones(10, 1))
    assert wrapped.last_chunk_sizes == (0, 7, 2, 1)


def test_item6_arrays_that_are_not_drs_get_clear_errors():
    import numpy

    wrapped = BalancedDataParallel(Echo(), ratio=[5, 5])
    with pytest.raises(ValueError, match=r"entry 0 of \[-5.0, 5.0\] is -5.0 .*dtype torch.float32"):
        wrapped.set_ratio(torch.tensor([-5.0, 5.0]))
    with pytest.raises(ValueError, match=r"must be 1-D .*shape \(1, 2\)"):
        wrapped.set_ratio(numpy.array([[5, 5]]))
    with pytest.raises(ValueError, match=r"\[0, 0\] are all zero.*dtype int64"):
        wrapped.set_ratio(numpy.array([0, 0]))
    assert wrapped.ratio == DataRatio([5, 5])  # a rejected DR changes nothing


# --- outputs, buffers, exceptions and devices as nn.DataParallel treats them -------------------

class ReassignedBuffers(nn.Module):
    """Buffers updated by assignment, not in place (an EMA and a step count)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.ema = 0.5 * self.ema + 0.5 * x.mean(0)
            self.steps = self.steps + 1
        return x + self.ema


@pytest.mark.parametrize("shares", [[5, 5], [3, 7], [10, 0]])
def test_buffers_a_forward_reassigns_advance_once_per_step(shares):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    bare, module = ReassignedBuffers(), ReassignedBuffers()
    wrapped = BalancedDataParallel(module, device_ids=[0, 1], ratio=shares)
    for _ in range(2):
        bare(x)
        wrapped(x)
    assert int(module.steps) == int(bare.steps) == 2  # once per step, not once per chunk
    torch.testing.assert_close(module.ema, bare.ema)  # the chunks' means weighted by size: the batch's mean
    torch.testing.assert_close(wrapped.state_dict()["module.ema"], bare.ema)  # what a checkpoint saves


def test_per_sample_lists_of_different_lengths_are_refused_not_cut_short():
    class PerSample(nn.Module):
        def forward(self, x):
            return [row for row in x]  # one tensor per sample

    with pytest.raises(ValueError, match=r"lists of different lengths \[3, 2\] as output"):
        BalancedDataParallel(PerSample(), device_ids=[0, 1], ratio=[6, 4])(torch.ones(5, 3))
    same = BalancedDataParallel(PerSample(), device_ids=[0, 1], ratio=[5, 5])(torch.ones(4, 3))
    assert len(same) == 2  # equal lengths are gathered entry by entry, as nn.DataParallel does


def test_integer_and_bool_scalar_outputs_keep_their_type():
    class Counts(nn.Module):
        def forward(self, x):
            return (x > 0).sum(), (x > 100).any(), x.mean()

    x = torch.tensor([[1.0], [-1.0], [2.0], [3.0], [-4.0]])
    count, flag, mean = BalancedDataParallel(Counts(), device_ids=[0, 1], ratio=[4, 6])(x)
    assert count.dtype == torch.int64 and count.tolist() == [1, 2] and int(count.sum()) == 3  # one per replica
    assert flag.dtype == torch.bool and not bool(flag.any())
    torch.testing.assert_close(mean, x.mean())  # a float scalar is still the weighted mean
    alone, _, _ = BalancedDataParallel(Counts(), device_ids=[0, 1], ratio=[10, 0])(x)
    assert alone.dtype == torch.int64 and int(alone) == 3  # one chunk: the module's own output


def test_a_batch_norm_layer_added_after_wrapping_still_never_gets_one_sample():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    wrapped = BalancedDataParallel(model, device_ids=[0, 1])
    model.append(nn.BatchNorm1d(4))  # e.g. a new head for fine-tuning
    wrapped(torch.randn(3, 4))  # 2 + 1 would fail in batch norm: folded
    assert wrapped.last_chunk_sizes == (3, 0)


def test_a_split_along_a_dim_a_tensor_does_not_have_is_named():
    wrapped = BalancedDataParallel(Echo(), device_ids=[0, 1], dim=1)
    with pytest.raises(ValueError, match=r"tensor inputs\[1\] has shape \(4,\), which has no dim 1"):
        wrapped(torch.ones(2, 4), torch.ones(4))


def test_a_replica_error_keeps_the_original_exceptions_attributes():
    class CodedError(Exception):
        def __init__(self, message: str, code: int = 0) -> None:
            super().__init__(message)
            self.code = code

    class Fails(nn.Module):
        def forward(self, x):
            raise CodedError("boom", code=7)

    with pytest.raises(CodedError, match="in replica 0") as caught:
        BalancedDataParallel(Fails(), device_ids=[0, 1])(torch.ones(4, 1))
    assert caught.value.code == 7 and caught.value.__cause__.code == 7


@pytest.mark.timeout(60)
def test_a_replica_error_whose_constructor_drops_the_message_still_names_the_replica():
    """An exception whose one argument is not its message (``__init__(self, code)``) still names the
    replica, device and slot (docs/client.md names them); rebuilding it from the message would lose them."""
    class CodeOnly(Exception):
        def __init__(self, code: int) -> None:
            super().__init__()
            self.code = code

    class Fails(nn.Module):
        def forward(self, x):
            raise CodeOnly(7)

    with pytest.raises(RuntimeError, match=r"Caught CodeOnly in replica 0 on device cpu \(DR slot 0") as caught:
        BalancedDataParallel(Fails(), device_ids=[0, 1])(torch.ones(4, 1))
    assert caught.value.code == 7 and isinstance(caught.value.__cause__, CodeOnly)


def test_output_devices_are_read_as_data_parallel_reads_them():
    from drbalance.client.backends import output_target

    assert output_target(-1) == torch.device("cpu") and output_target(2) == torch.device("cuda", 2)
    assert output_target(torch.device("cuda", 1)) == torch.device("cuda", 1) and output_target("cpu").type == "cpu"


class InPlaceOnInput(nn.Module):
    """Changes its input in place first (``nn.ReLU(inplace=True)``), then views it as one row per sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 2)

    def forward(self, x):
        return self.linear(torch.relu_(x).reshape(x.shape[0], -1).view(x.shape[0], -1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shares", [[10, 0], [5, 5], [3, 7]])
def test_in_place_ops_on_an_input_that_requires_grad_work_and_give_the_bare_gradients(shares):
    """A wrapped part of a larger model (an encoder after an embedding) gets an input with autograd
    history; an in-place op on it works for the bare module and nn.DataParallel, so it must on
    every chunk, with the same gradients."""
    model = InPlaceOnInput()
    torch.manual_seed(1)
    source = torch.randn(8, 6, requires_grad=True)
    model(source * 2).sum().backward()
    expected = [source.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    source.grad = None
    model.zero_grad()
    BalancedDataParallel(model, ratio=shares)(source * 2).sum().backward()
    for grad, wanted in zip([source.grad] + [p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(grad, wanted)


class FlattensItsInput(nn.Module):
    def forward(self, x):
        return x.view(-1).view(x.shape) * 2


@pytest.mark.timeout(60)
def test_chunks_of_a_split_along_dim_1_are_contiguous_like_the_whole_input():
    """``x.view`` works on the bare module's contiguous input (and on the copies nn.DataParallel's
    scatter hands each GPU); a split along dim 1 must not hand a replica a non-contiguous view."""
    x = torch.arange(24.0).reshape(3, 8)
    out = BalancedDataParallel(FlattensItsInput(), ratio=[5, 5], dim=1)(x)
    torch.testing.assert_close(out, x * 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shares", [[5, 5], [2, 3, 5]])
def test_batch_norm_put_back_in_training_in_an_eval_model_advances_once_per_forward(shares):
    """Test-time adaptation: ``model.eval()``, then batch norm alone back in training mode. Its
    running statistics advance once per forward, as for the bare module, not once per chunk."""
    bare, balanced = bn_model(seed=4), bn_model(seed=4)
    for model in (bare, balanced):
        model.eval()
        model[1].train()
    wrapped = BalancedDataParallel(balanced, ratio=shares)
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        bare(x)
        wrapped(x)
    assert balanced[1].num_batches_tracked.item() == bare[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(balanced[1].running_mean, bare[1].running_mean)
    with torch.no_grad():
        wrapped(x[:3])  # a split that would leave a training batch norm one sample is folded
    assert balanced[1].num_batches_tracked.item() == 2


@pytest.mark.timeout(60)
def test_with_one_device_any_output_comes_back_as_from_data_parallel_on_one_device():
    """nn.DataParallel with one device returns the module's output without a gather, so a count
    or a name beside the logits works; with one slot no DR change can split the batch either."""
    wrapped = BalancedDataParallel(ReturnsCount())  # the CPU path's default: one slot
    logits, count = wrapped(torch.ones(4, 1))
    assert count == 4 and logits.shape == (4, 1)
    nested = BalancedDataParallel(ReturnsNestedString(), device_ids=[0])
    assert nested(torch.ones(4, 1))["meta"] == {"names": ["a"]}
    with pytest.raises(TypeError, match=r"returned int 4 as output\[1\]"):
        BalancedDataParallel(ReturnsCount(), ratio=[10, 0])(torch.ones(4, 1))  # two slots: still refused


class RunningScale(nn.Module):
    """Updates a buffer in place, then divides by it: the division saves the buffer for the backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        h = self.linear(x)
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * h.abs().mean(0))
        return h / self.scale


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shares", [[5, 5], [2, 3, 5]])
def test_a_buffer_updated_in_place_and_saved_for_the_backward_keeps_each_chunks_value(shares):
    """Each chunk's backward uses the buffer value its own forward used, as each replica of
    nn.DataParallel uses its own copy: a later chunk, or the merge, must not change it under it."""
    model = RunningScale()
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(3))
    wrapped = BalancedDataParallel(model, ratio=shares)
    buffer = model.scale
    wrapped(x).sum().backward()
    sizes = [size for size in wrapped.last_chunk_sizes if size]
    start = torch.ones(3)
    expected_grad = torch.zeros_like(model.linear.weight)
    expected_scale = start.clone()
    for chunk in torch.split(x, sizes):
        reference = RunningScale()
        reference(chunk).sum().backward()  # the chunk alone, from the same buffer values
        expected_grad += reference.linear.weight.grad
        expected_scale += (reference.scale - start) * chunk.shape[0] / x.shape[0]
    torch.testing.assert_close(model.linear.weight.grad, expected_grad)
    torch.testing.assert_close(model.scale, expected_scale)  # advanced once, by the chunks' weighted change
    assert model.scale is buffer  # the module keeps its own buffer object


@pytest.mark.timeout(60)
def test_with_one_device_the_modules_own_exception_passes_through_as_data_parallel_lets_it():
    """nn.DataParallel on one device calls the module itself, so the module's exception reaches
    the caller as it was raised, not rebuilt with 'Caught ... in replica 0' in its message (a
    changed ``args`` would break code that reads it)."""
    raised = KeyError("missing-key")

    class Fails(nn.Module):
        def forward(self, x):
            raise raised

    for wrapper in (nn.DataParallel(Fails()), BalancedDataParallel(Fails(), device_ids=[0])):
        with pytest.raises(KeyError) as caught:
            wrapper(torch.ones(4, 1))
        assert caught.value is raised and caught.value.args == ("missing-key",)
    with pytest.raises(KeyError, match="in replica 0") as caught:  # two devices: named, as before
        BalancedDataParallel(Fails(), device_ids=[0, 1], ratio=[10, 0])(torch.ones(4, 1))
    assert caught.value is not raised and caught.value.__cause__ is raised


# --- ratios as weights -------------------------------------------------------------------------------

def test_the_dr_a_wrapper_shows_can_be_given_back_and_weights_are_accepted():
    """``m.set_ratio(list(m.ratio.shares))`` is accepted whatever the DR total (no "DR shares
    [1, 1, 1, 1] sum to 4, but the DR total is 10"), and so are weights such as ``ratio=[3, 1]``
    and ``[1, 1]``."""
    model = BalancedDataParallel(nn.Linear(4, 2), device_ids=[0, 1, 2, 3])
    model.set_ratio(list(model.ratio.shares))
    model(torch.randn(8, 4))
    assert model.ratio == DataRatio([1, 1, 1, 1], 4) and model.last_chunk_sizes == (2, 2, 2, 2)
    weighted = BalancedDataParallel(nn.Linear(4, 2), ratio=[3, 1])
    weighted(torch.randn(8, 4))
    assert weighted.last_chunk_sizes == (6, 2)
    weighted.set_ratio([1, 1])
    weighted(torch.randn(8, 4))
    assert weighted.last_chunk_sizes == (4, 4)
    weighted.set_ratio(torch.tensor([0.3, 0.7]))  # a float tensor of weights: apportioned to 10
    weighted(torch.randn(10, 4))
    assert weighted.ratio == DataRatio([3, 7]) and weighted.last_chunk_sizes == (3, 7)


def test_device_ids_of_a_gpu_script_are_slot_labels_without_cuda():
    """``device_ids=["cuda:0", "cuda:1"]`` and ``torch.device`` entries, as ``nn.DataParallel`` takes
    them, are slot labels on the CPU path, not errors ("expected an integer", "CUDA is not available
    here")."""
    for ids, labels in ((["cuda:0", "cuda:1"], [0, 1]), ([torch.device("cuda", 2), torch.device("cuda:3")], [2, 3]),
                        ([torch.device("cpu"), 5], [0, 5]), ([np.int64(1), "cuda:0"], [1, 0])):
        model = BalancedDataParallel(nn.Linear(4, 2), device_ids=ids)
        model(torch.randn(6, 4))
        assert model.device_ids == labels and model.last_chunk_sizes == (3, 3)
