"""`streams.py`'s choices on faked accelerators: which device index a rank takes, priorities, CPU's answers.

The CUDA paths themselves run in `make gpu-check`; these hold the logic a CPU can reach: a process
a launcher started with ``LOCAL_RANK`` and left on device 0 takes ``LOCAL_RANK`` modulo the device
count (as Accelerate's ``PartialState``), a device the script set is kept, and "high" asks for
the backend's high-priority pool.
"""

from __future__ import annotations

import types

import pytest
import torch

from hfstream import streams


@pytest.fixture
def accelerator(monkeypatch):
    """torch.accelerator with 4 devices, the current one settable."""
    fake = types.SimpleNamespace(index=0)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: fake.index)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    return fake


@pytest.mark.parametrize("index, local_rank, expected", [(0, "6", 2), (0, "3", 3), (0, None, 0), (0, "x", 0),
                                                         (1, "6", 1), (3, None, 3)])
def test_a_rank_left_on_device_0_takes_its_local_rank_modulo_the_device_count(accelerator, monkeypatch, index,
                                                                             local_rank, expected):
    accelerator.index = index
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert streams._rank_index("cuda") == expected


def test_the_current_index_is_asked_of_torch_accelerator_first(accelerator):
    accelerator.index = 2
    assert streams._current_index("cpu") == 2   # the device module is not asked (torch.cpu has no index)


def test_cpu_and_meta_have_no_streams_and_an_accelerator_does():
    assert streams.is_accelerator("cpu") is False and streams.is_accelerator(torch.device("meta")) is False
    assert streams.is_accelerator("cuda") is True


def test_high_asks_for_the_backends_most_urgent_pool_and_normal_for_the_default():
    assert (streams.stream_priority("high"), streams.stream_priority("normal"), streams.stream_priority(-3)) == (-1, 0, -3)


def test_record_stream_tells_the_allocator_through_the_tensor():
    seen = []
    streams.record_stream(types.SimpleNamespace(record_stream=seen.append), "side")
    assert seen == ["side"]


@pytest.mark.parametrize("count", [1, 0])
def test_every_rank_on_a_one_device_host_shares_device_0(accelerator, monkeypatch, count):
    # Several ranks on one device (a laptop GPU, or a count a broken driver reports as 0): never an
    # index past the devices there are, never a division by zero.
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert streams._rank_index("cuda") == 0
