"""CUDA_VISIBLE_DEVICES read as CUDA reads it, over a home's emulated GPUs."""

import pytest

from drbalance.emu.visible import NoVisibleDevice, Visible, parse_visible, visible_devices

UUIDS = ("GPU-1a2b0000-0000-5000-8000-000000000000", "GPU-1a3c0000-0000-5000-8000-000000000001",
         "GPU-77770000-0000-5000-8000-000000000002", "GPU-88880000-0000-5000-8000-000000000003")


@pytest.mark.parametrize(("value", "indices"), [
    (None, (0, 1, 2, 3)),  # unset: every GPU
    ("2,3", (2, 3)),
    ("3,1", (3, 1)),  # numbered in the list's order
    (" 1, +2", (1, 2)),  # strtoul: blanks and a sign before the digits
    ("1gpu,2ampere", (1, 2)),  # strtoul: the rest of an entry is ignored
    ("0,2,-1,1", (0, 2)),  # CUDA's documented example: the list ends at the invalid entry
    ("0,7,1", (0,)),  # an index with no GPU ends it too
    ("1,abc,2", (1,)),
    ("-0", (0,)),
    ("GPU-7777", (2,)),  # a UUID prefix naming one GPU
    ("GPU-88880000-0000-5000-8000-000000000003,GPU-1a2b", (3, 0)),
    ("GPU-7777,GPU-1a,GPU-8888", (2,)),  # GPU-1a names two GPUs: ambiguous, the list ends there
    ("GPU-7777,2", (2,)),  # a UUID list ends at an entry that is no UUID
    ("2,GPU-7777", (2,)),  # and an index list at an entry that is no index
])
def test_the_devices_a_value_makes_visible_are_cudas(value, indices):
    assert parse_visible(value, UUIDS).indices == indices


@pytest.mark.parametrize("value", ["", "-1,0", "abc", "7", "GPU-ffff", "GPU-1a", "MIG-GPU-1a2b/0/0", ",0"])
def test_a_value_that_names_no_gpu_first_makes_none_visible(value):
    assert parse_visible(value, UUIDS).indices == ()


@pytest.mark.parametrize("value", ["0,0", "1,2,1", "0,5,0", "GPU-7777,GPU-7777", "GPU-7777,GPU-77770000"])
def test_a_gpu_named_twice_makes_none_visible(value):
    assert parse_visible(value, UUIDS) == Visible((), repeated=True)


def test_no_visible_device_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(NoVisibleDevice, match=r"CUDA_VISIBLE_DEVICES='' is empty, so no device is visible .* among "
                       r"the machine's 4 emulated GPUs: give indices 0\.\.3 or UUIDs"):
        visible_devices(UUIDS, "the machine's 4 emulated GPUs")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(NoVisibleDevice, match=r"starts with '4', which names none of them"):
        visible_devices(UUIDS, "the machine's 4 emulated GPUs")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,1")
    with pytest.raises(NoVisibleDevice, match="names a GPU twice"):
        visible_devices(UUIDS, "the machine's 4 emulated GPUs")


def test_an_entry_that_ends_the_list_early_is_named_in_a_warning(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,9,1")
    with pytest.warns(RuntimeWarning, match=r"'9' names none of .*the devices before it are visible: GPU\(s\) 0, 2"):
        assert visible_devices(UUIDS, "this user's 4 emulated GPUs") == (0, 2)
