"""What save_async does for an accelerator, held on CPU where the device can be played.

Each thread that talks to the device is bound to the rank's device first (a new thread starts on
device 0, and a CUDA call there opens a context on another rank's GPU); a failed pin is said, not
left as a pending CUDA error on the training thread; non-CUDA accelerators get no CUDA call; the
ranks' save flags travel over a host group (no device wait at a step boundary). The device path
itself runs in tests/test_save_async_gpu.py where a GPU is lent.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from hfstream.trainer import save_async
from hfstream.trainer.save_async import AsyncSave, SnapshotBuffers

CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def bound(monkeypatch):
    """[(thread name, device index)] for every thread that bound itself to a device."""
    seen = []
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda index: seen.append((threading.current_thread().name, index)))
    return seen


class FakeCudart:
    """torch.cuda.cudart() on a CPU build: records which thread registers what, answers ``result``."""

    def __init__(self, result: int):
        self.result, self.registered, self.unregistered = result, [], []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.registered.append((threading.current_thread().name, pointer, nbytes, flags))
        return self.result

    def cudaHostUnregister(self, pointer):
        self.unregistered.append(pointer)
        return 0


def test_the_thread_that_waits_for_a_saves_copies_is_bound_to_the_ranks_device(tmp_path, bound):
    save = AsyncSave([], str(tmp_path / "staging"), str(tmp_path / "final"), device=CUDA1).start()
    save.join()
    assert bound == [(save._thread.name, 1)] and save.error is None


def test_buffers_prepared_for_a_device_are_allocated_by_a_thread_bound_to_it(bound):
    buffers = SnapshotBuffers(device=CUDA1)
    buffers.prepare([64, 128])
    assert buffers.held_bytes == 192
    assert bound == [("hfstream-snapshot-buffers", 1)]
    # No pinned allocator in this CPU build: the buffers are ordinary memory, and why is kept for the note.
    assert "pin_memory" in buffers.unpinned


@pytest.mark.parametrize("result", [0, 2])
def test_a_shared_arena_is_pinned_by_a_thread_of_its_own_and_a_failure_is_said(monkeypatch, bound, result):
    cudart = FakeCudart(result)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffers = SnapshotBuffers(device=CUDA1, shared=True)
    buffer = buffers.take(4096)
    assert buffers.unshared is None, buffers.unshared
    ((name, pointer, nbytes, flags),) = cudart.registered
    assert name == "hfstream-pin" != threading.current_thread().name   # its CUDA error dies with that thread
    assert ("hfstream-pin", 1) in bound and nbytes >= 4096 and flags == 1
    assert buffers.unpinned == (None if result == 0 else "cudaHostRegister returned 2")
    buffers.drop_rest()
    del buffer
    import gc

    gc.collect()   # the arena goes: unpinned first, where it was pinned
    assert cudart.unregistered == ([pointer] if result == 0 else [])


def test_another_accelerators_shared_arena_gets_no_cuda_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("a CUDA call for an XPU run"))
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    buffers = SnapshotBuffers(device=torch.device("xpu", 0), shared=True)
    buffers.take(4096)
    assert buffers.unshared is None and buffers.unpinned.startswith("xpu")


def test_the_ranks_save_flags_travel_on_the_host_group_whatever_the_device(monkeypatch):
    from hfstream.gradsync import agreement
    from hfstream.trainer.trainer import StreamTrainerMixin

    calls = []
    monkeypatch.setattr(agreement, "any_rank", lambda flags, group, device: calls.append((group, device)) or flags)
    host = object()
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(world_size=2, device=torch.device("cuda", 0)),
                                    _save_group=host)
    assert StreamTrainerMixin._save_flags(trainer, [True, False]) == [True, False]
    assert calls == [(host, torch.device("cpu"))]
