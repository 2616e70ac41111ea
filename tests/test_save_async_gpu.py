"""save_async on a real accelerator: pinned host buffers, the copies on a side stream, and the
training stream waiting for them (the device, not the host) before the optimizer step changes what
they read; the checkpoint byte for byte the blocking save's. Skipped without CUDA; run on a GPU
machine (part 1 of ``make gpu-check``) with:

    pytest -m gpu tests/test_save_async_gpu.py

The side stream is held up on purpose (``torch.cuda._sleep`` queued on it before the snapshot's
copies, about 50 ms): without the wait the next optimizer step changes every element of the
weight before it is copied, and the checkpoint holds the next step's values. The other way round,
the training stream is held up before a save step's optimizer step: a side stream that did not
wait for it would copy the weight before that step lands, and the checkpoint would hold the step
before's.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch
import torch.nn as nn

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.trainer import save_async

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="uses torch.cuda test APIs")

CYCLES_PER_MS = 2_000_000   # torch.cuda._sleep spins clock cycles; H100/H200 run near 2 GHz


class Big(nn.Module):
    """One 128 MiB weight that every step changes everywhere (the loss reaches every element)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 1 << 25))

    def forward(self, x, **kwargs):
        return {"loss": (self.w * x.float().mean()).sum()}


def _run(out, save_async_on: bool, callbacks=None) -> StreamTrainer:
    data = [{"x": torch.full((4,), float(i + 1))} for i in range(64)]
    args = StreamTrainingArguments(output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=2,
                                   per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], seed=0,
                                   save_async=save_async_on, prefetch_depth=0, logging_steps=100,
                                   disable_tqdm=True, lr_scheduler_type="constant")
    trainer = StreamTrainer(model=Big(), args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


@needs_cuda
def test_the_snapshot_copies_on_a_side_stream_into_pinned_buffers_and_equals_the_blocking_save(tmp_path, monkeypatch):
    take = save_async.SnapshotBuffers.take
    held, pinned = [], []

    def slow_first_copy(self, nbytes):   # the side stream held up before the snapshot's first copy
        if not self.taken and self.stream is not None:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(50 * CYCLES_PER_MS)
            held.append(self.stream)
        buffer = take(self, nbytes)
        pinned.append(buffer.is_pinned())
        return buffer

    monkeypatch.setattr(save_async.SnapshotBuffers, "take", slow_first_copy)
    trainer = _run(tmp_path / "async", True)
    monkeypatch.setattr(save_async.SnapshotBuffers, "take", take)
    _run(tmp_path / "blocking", False)
    assert len(held) == 3 and all(s != torch.cuda.current_stream() for s in held)
    assert trainer.stream_report()["save"]["held_bytes"] > 0
    assert pinned and all(pinned)   # in /dev/shm, registered with CUDA (or pinned by torch where /dev/shm is short)
    _same_checkpoints(tmp_path)


def _same_checkpoints(tmp_path) -> None:
    for step in (2, 4, 6):
        a, b = tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}"
        names = [n for n in sorted(os.listdir(b)) if n not in ("training_args.bin", "stream_report.json")]
        assert names == [n for n in sorted(os.listdir(a)) if n not in ("training_args.bin", "stream_report.json")]
        same, differ, errors = filecmp.cmpfiles(a, b, names, shallow=False)   # optimizer.pt says cuda:0 in both
        assert (differ, errors) == ([], []), (step, differ)


@needs_cuda
def test_the_side_stream_copies_a_save_steps_weights_after_its_optimizer_step_lands(tmp_path):
    from transformers import TrainerCallback

    class HoldTheTrainingStream(TrainerCallback):   # the optimizer step of a save step queued 50 ms late
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if (state.global_step + 1) % 2 == 0:
                torch.cuda._sleep(50 * CYCLES_PER_MS)

    _run(tmp_path / "async", True, callbacks=[HoldTheTrainingStream()])
    _run(tmp_path / "blocking", False, callbacks=[HoldTheTrainingStream()])
    _same_checkpoints(tmp_path)


@needs_cuda
def test_a_shared_arena_is_pinned_in_place_and_a_side_stream_copies_into_it():
    from hfstream import streams

    device = torch.device("cuda", torch.cuda.current_device())
    stream = streams.new_stream(device)
    buffers = save_async.SnapshotBuffers(device=device, shared=True, stream=stream)
    host = buffers.take(1 << 20)
    assert (buffers.unshared, buffers.unpinned) == (None, None) and host.is_pinned()
    source = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)
    event = streams.new_event(device)
    event.record(stream)
    event.synchronize()
    assert torch.equal(host, source.cpu())
