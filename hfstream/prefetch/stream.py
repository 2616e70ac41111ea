"""Accelerator prefetching: the next batches copied on a side stream, one event per batch.

The idea is NVIDIA Apex's ``data_prefetcher`` (apex/examples/imagenet/main_amp.py): keep the
host-to-device copies of the next batches in flight on a second stream and make the compute
stream wait for a batch only when that batch is handed out. The ordering rules (streams,
events, ``Tensor.record_stream``, pinned memory for ``non_blocking`` copies) are those of
PyTorch's "CUDA semantics" notes.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

import torch

from hfstream import streams
from hfstream.prefetch.batches import map_tensors
from hfstream.prefetch.epoch import END, Epoch, Failure, InFlight, PrefetchStats, move_batch

MAX_PENDING_TIMINGS = 64   # copy timings not yet readable; older ones are dropped, never waited on


class StagedEpoch(Epoch):
    """Accelerator: ``depth`` batches are copied ahead on a side stream, one event per batch.

    Args:
        source, device, skip, depth, stats: as `epoch.Epoch`.
        side: the side stream the copies are issued on (shared by the prefetchers of a device).
        non_blocking: issue the copies with ``non_blocking=True``.
        pin: pin host tensors first; ``auto_pin``: stop trying, without an error, where the
            backend cannot pin.
        timings: where ``(start, done, nbytes)`` of timed copies wait until they can be read;
            None: copies are not timed.
        note: says a note once (the prefetcher's log).
    """

    def __init__(self, source: Iterator, device: torch.device, skip: frozenset, depth: int, stats: PrefetchStats,
                 side, non_blocking: bool, pin: bool, auto_pin: bool, timings: collections.deque | None,
                 note: Callable[[str], None]):
        super().__init__(source, device, skip, depth, stats)
        self._side = side
        self._non_blocking = non_blocking
        self._pin = pin
        self._auto_pin = auto_pin
        self._time = timings is not None
        self._timings = timings
        self._note = note
        self._staged: collections.deque = collections.deque()
        self._fill()     # start copying at iter(), like DataLoader workers start at iter()

    def _next_item(self):
        if not self._staged:
            return END
        item = self._staged.popleft()
        if isinstance(item, Failure):
            return item
        consumer = streams.current_stream(self._device)
        # The consumer's stream, not the host, waits for exactly this batch's copies. Without the
        # wait its kernels may read the buffers before the copy lands (garbage, no error); a full
        # synchronize instead would stall the host and leave nothing to overlap.
        streams.wait_event(item.done, consumer)
        # Memory release: record_stream. These tensors were allocated on the side stream, so when
        # the user drops them the caching allocator would hand their blocks to the next copy on
        # the side stream at once, while the consumer's queued kernels may still read them.
        # record_stream makes the allocator wait for the consumer stream's work queued up to the
        # free. Chosen over a deferred-free ring because it stays correct however long the user
        # keeps a batch (gradient accumulation, logging), which a ring cannot know; memory stays
        # bounded because each block comes back as soon as the consumer stream passes its free.
        for t in item.moved:
            streams.record_stream(t, consumer)
        if item.start is not None:
            self._timings.append((item.start, item.done, item.nbytes))
            read_timings(self._timings, self._stats)
        self._fill()     # copy batch k+depth now: it runs on the side stream while batch k computes
        return item

    def _fill(self) -> None:
        while self._source is not None and len(self._staged) < self._depth:
            try:
                host = next(self._source)
            except StopIteration:
                self._source = None
                return
            except Exception as exc:   # noqa: BLE001 - delivered after the batches before it
                self._source = None
                self._staged.append(Failure(exc))
                return
            try:
                self._staged.append(self._stage(host))
            except Exception as exc:   # noqa: BLE001 - e.g. out of memory: surfaces at its step
                self._source = None
                self._staged.append(Failure(exc))
                return

    def _stage(self, host: Any) -> InFlight:
        # Pin first, on the host: a non_blocking copy from pageable memory is not asynchronous,
        # and pinning inside the timed span would count host time as copy time.
        if self._pin:
            host = map_tensors(host, self._pinned, self._skip)
        with streams.use_stream(self._side):
            start = None
            if self._time:
                start = streams.new_event(self._device, enable_timing=True)
                start.record(self._side)
            item = move_batch(host, self._device, self._skip, self._non_blocking)
            item.done = streams.new_event(self._device, enable_timing=self._time)
            item.done.record(self._side)
            item.start = start
        if item.tensors and not item.moved:
            # Accelerate's DataLoaderDispatcher does this (accelerate/data_loader.py: it sends each
            # batch to the device before broadcasting it from rank 0), as does a loader with a device.
            self._note(f"StreamPrefetcher: the batches arrive already on {self._device}, so the side stream has "
                       f"nothing left to copy; only the source's own time is measured as data wait")
        return item

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        if not self._pin or t.device.type != "cpu" or t.is_pinned():
            return t
        try:
            return t.pin_memory()
        except RuntimeError:
            if not self._auto_pin:
                raise
            self._pin = False          # pin_memory=None: this backend cannot pin, copy from pageable
            return t

    def close(self, join: bool = True) -> None:
        # Staged batches never handed out were only touched by the side stream; freeing them is
        # safe by stream order (their blocks are reused only by later work on that stream).
        super().close(join)
        self._staged.clear()


def read_timings(timings: collections.deque, stats: PrefetchStats) -> None:
    """Fold the copy timings that have completed into ``stats``, oldest first; never blocks."""
    # query() never waits; elapsed_time() on an event still pending would raise (or stall).
    while timings and timings[0][1].query():
        start, end, nbytes = timings.popleft()
        ms = start.elapsed_time(end)
        stats.copy_ms = ms
        stats.copy_ms_total += ms
        stats.copies_timed += 1
        stats.copy_gbps = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None
