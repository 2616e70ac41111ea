"""StreamPrefetcher on a real CUDA device: every batch intact under a slow consumer, proof that
the checksums would catch a missing event wait or a missing record_stream, flat reserved memory,
no host synchronization, and the copies on a stream other than the compute stream.

Skipped without an accelerator. Run on a GPU machine with:

    pytest -m gpu tests/test_prefetch_gpu.py

The tests use torch.cuda APIs (``_sleep``, ``memory_reserved``, ``set_sync_debug_mode``) that
have no device-agnostic equivalent; the library itself never names the device.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hfstream import streams
from hfstream.prefetch.prefetcher import StreamPrefetcher

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="uses torch.cuda test APIs")

NUMEL = 1 << 20                  # int64: 8 MiB per batch, a copy of a few hundred microseconds
CYCLES_PER_MS = 2_000_000        # torch.cuda._sleep spins clock cycles; H100/H200 run near 2 GHz


def device() -> torch.device:
    return streams.default_device()


def host_batches(n: int, numel: int = NUMEL, pinned: bool = False) -> list:
    """Batch i holds the value i + 1 everywhere, so its sum is (i + 1) * numel exactly."""
    out = []
    for i in range(n):
        x = torch.full((numel,), i + 1, dtype=torch.int64)
        out.append({"x": x.pin_memory() if pinned else x, "i": i})
    return out


def gpu_sleep(ms: float) -> None:
    torch.cuda._sleep(int(ms * CYCLES_PER_MS))      # on the current stream; the host goes on


def checksum_errors(prefetcher, n: int, consumer_ms: float, numel: int = NUMEL) -> int:
    """Consume every batch on the current stream (optionally slowly); count wrong sums.

    The sums stay on the device until the end: a .item() per step would synchronize the host
    and hide exactly the races these tests look for.
    """
    sums, order = [], []
    for batch in prefetcher:
        if consumer_ms:
            gpu_sleep(consumer_ms)
        sums.append(batch["x"].sum())
        order.append(batch["i"])
    torch.cuda.synchronize()
    assert order == list(range(n))
    return sum(int(s) != (i + 1) * numel for i, s in enumerate(sums))


@pytest.fixture
def late_copies(monkeypatch):
    """Hold the side stream 20 ms before each batch's copies, so they land long after hand-out."""
    real = streams.use_stream

    @contextlib.contextmanager
    def delayed(stream):
        with real(stream):
            gpu_sleep(20)                  # enqueued on the side stream, current inside `real`
            yield

    monkeypatch.setattr(streams, "use_stream", delayed)


# -- correctness -----------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_slow_consumer_sees_every_batch_intact(depth):
    # The consumer stream falls far behind while later batches copy and earlier ones are freed:
    # a batch overwritten before its sum ran, or read before its copy landed, shows up here.
    p = StreamPrefetcher(host_batches(40), device=device(), depth=depth)
    assert checksum_errors(p, 40, consumer_ms=10) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("late_copies")
@pytest.mark.parametrize("depth", [1, 2])
def test_late_copies_are_waited_for(depth):
    p = StreamPrefetcher(host_batches(12), device=device(), depth=depth)
    assert checksum_errors(p, 12, consumer_ms=0) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("late_copies")
def test_without_the_event_wait_the_checksums_catch_the_race(monkeypatch):
    # Proof that the test above can fail: skip the consumer-stream wait and it reads batches
    # whose copies have not landed yet.
    monkeypatch.setattr(streams, "wait_event", lambda event, stream: None)
    p = StreamPrefetcher(host_batches(12), device=device(), depth=2)
    assert checksum_errors(p, 12, consumer_ms=0) > 0


@pytest.mark.gpu
@needs_cuda
def test_without_record_stream_the_checksums_catch_early_reuse(monkeypatch):
    # Proof for the memory side: without record_stream the allocator hands a freed batch's block
    # to a later copy on the side stream while the slow consumer has not summed it yet.
    # Pre-pinned batches keep the host well ahead of the 20 ms consumer.
    monkeypatch.setattr(streams, "record_stream", lambda tensor, stream: None)
    p = StreamPrefetcher(host_batches(30, pinned=True), device=device(), depth=2)
    assert checksum_errors(p, 30, consumer_ms=20) > 0


@pytest.mark.gpu
@needs_cuda
def test_same_with_prepinned_batches_and_record_stream():
    p = StreamPrefetcher(host_batches(30, pinned=True), device=device(), depth=2)
    assert checksum_errors(p, 30, consumer_ms=20) == 0


class IntBatches(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": torch.full((NUMEL // 8,), i + 1, dtype=torch.int64), "i": i}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True)])
def test_pinned_dataloader_two_epochs(workers, persistent):
    loader = DataLoader(IntBatches(), batch_size=8, num_workers=workers, pin_memory=True,
                        persistent_workers=persistent)
    p = StreamPrefetcher(loader, device=device(), depth=2)
    for _ in range(2):
        sums = [b["x"].sum(dim=1) for b in p]
        torch.cuda.synchronize()
        got = torch.cat(sums).cpu()
        assert torch.equal(got, (torch.arange(64) + 1) * (NUMEL // 8))
    p.close()


# -- memory ----------------------------------------------------------------------------------

class Reiterable:
    """A source that can start many epochs; cycles through a few host batches."""

    def __init__(self, steps: int):
        self.steps = steps
        self.host = host_batches(4, numel=NUMEL // 2)

    def __iter__(self):
        return (self.host[i % 4] for i in range(self.steps))

    def __len__(self):
        return self.steps


@pytest.mark.gpu
@needs_cuda
def test_reserved_memory_is_flat_over_steps_and_epochs():
    batch_bytes = NUMEL // 2 * 8
    source = Reiterable(200)
    p = StreamPrefetcher(source, device=device(), depth=2)

    def run_epoch(prefetcher, break_at=None):
        for step, b in enumerate(prefetcher):
            (b["x"] * 2).sum()
            if step == break_at:
                break

    run_epoch(p)                                  # warm-up: the allocator's working set
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    samples = []
    for epoch in range(5):                        # 1,000 more steps, one epoch cut short
        run_epoch(p, break_at=50 if epoch == 2 else None)
        samples.append(torch.cuda.memory_reserved())
    for _ in range(3):                            # a fresh prefetcher per epoch, as a trainer may do
        run_epoch(StreamPrefetcher(source, device=device(), depth=2))
        samples.append(torch.cuda.memory_reserved())
    # A few blocks of slack for the host running ahead of the device; growth per step or per
    # epoch would be gigabytes.
    slack = max(4 * batch_bytes, 64 << 20)
    assert max(samples) - base <= slack, (base, samples)
    p.close()


# -- no host synchronization, copies on a side stream ----------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_no_host_synchronization():
    dev = device()
    list(StreamPrefetcher(host_batches(3), device=dev, depth=2, time_copies=True))   # warm-up
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = StreamPrefetcher(host_batches(30), device=dev, depth=2, time_copies=True)
        for b in p:
            acc += b["x"].sum()
        stats = p.stats                          # reading timings must not wait either
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert int(acc) == sum(range(1, 31)) * NUMEL
    assert stats.batches == 30


@pytest.mark.gpu
@needs_cuda
def test_copy_stats_on_device():
    p = StreamPrefetcher(host_batches(20), device=device(), depth=2, time_copies=True)
    for b in p:
        b["x"].sum()
    torch.cuda.synchronize()
    s = p.stats
    assert s.batches == 20 and s.bytes_copied == 20 * NUMEL * 8
    assert s.copies_timed == 20 and s.copy_ms > 0 and s.copy_gbps > 0
    assert s.copy_ms_total >= s.copy_ms


def _copy_and_kernel_streams(tmp_path, depth: int):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in StreamPrefetcher(host_batches(8), device=device(), depth=depth):
            b["x"].mul(2).sum()                  # kernels on the consumer (current) stream
        torch.cuda.synchronize()
    trace = tmp_path / f"trace_depth{depth}.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if isinstance(e.get("args"), dict)]
    copies = {e["args"].get("stream") for e in events if str(e.get("name", "")).startswith("Memcpy HtoD")}
    kernels = {e["args"].get("stream") for e in events if e.get("cat") == "kernel"}
    return copies, kernels


@pytest.mark.gpu
@needs_cuda
def test_profiler_shows_copies_on_a_side_stream(tmp_path):
    copies, kernels = _copy_and_kernel_streams(tmp_path, depth=2)
    assert copies and kernels
    assert copies.isdisjoint(kernels), (copies, kernels)
    # The baseline copies on the compute stream, so this check can tell the two apart.
    copies0, kernels0 = _copy_and_kernel_streams(tmp_path, depth=0)
    assert copies0 and copies0 <= kernels0, (copies0, kernels0)
