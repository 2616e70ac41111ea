"""One pass of a `StreamPrefetcher` over its source: what every way of prefetching shares.

An epoch hands out batches in order and carries two things to the consumer's step: an exception
from the source (raised at the step that would have consumed that batch) and the counters of
`PrefetchStats`. How the next batch is obtained is the subclass's job:

    SyncEpoch      depth 0, or a source that must be read on the training thread: pull and move
                   each batch when it is asked for (the stock baseline)
    ThreadEpoch    CPU: a background thread prepares the next batches (`thread`)
    StagedEpoch    accelerator: copies on a side stream, one event per batch (`stream`)
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Iterator, Optional

import torch

from hfstream.prefetch.batches import map_tensors

END = object()           # the source is exhausted
PRODUCED_KEPT = 256      # producer intervals kept in `PrefetchStats.produced`


@dataclasses.dataclass
class PrefetchStats:
    """What the consumer saw, over all epochs of one prefetcher.

    Attributes:
        batches: batches handed out so far.
        data_wait_ms: host time (``time.perf_counter``) the consumer spent inside ``__next__``
            for the last batch: waiting for the source or the thread, pinning, issuing copies.
            The timeline reads this as the step's data span.
        data_wait_ms_total: the sum of ``data_wait_ms`` over all batches.
        bytes_copied: bytes of the tensors moved to ``device`` in the batches handed out.
        copy_ms: device time of the most recent prefetched copy that has completed, measured
            between two events on the side stream; ``None`` on CPU, at ``depth=0`` and without
            ``time_copies=True``. It can lag a batch or two: reading a pending event would stall.
        copy_gbps: bytes / time of that same copy, in GB/s (1e9 bytes per second).
        copy_ms_total: the sum of all completed ``copy_ms``.
        copies_timed: how many copies ``copy_ms_total`` covers.
        produced: the background thread's last batches (CPU prefetching), each ``(start, end,
            cpu_ms)``: its ``perf_counter`` interval preparing the batch and the CPU time it spent in
            it (``time.thread_time``), so a producer that waits (I/O, sleep) tells itself from one
            that computes (`hfstream.report.advice`).
    """

    batches: int = 0
    data_wait_ms: float = 0.0
    data_wait_ms_total: float = 0.0
    bytes_copied: int = 0
    copy_ms: Optional[float] = None
    copy_gbps: Optional[float] = None
    copy_ms_total: float = 0.0
    copies_timed: int = 0
    produced: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=PRODUCED_KEPT), repr=False)

    @property
    def mean_data_wait_ms(self) -> float:
        return self.data_wait_ms_total / self.batches if self.batches else 0.0


@dataclasses.dataclass
class InFlight:
    """A batch on its way: the rebuilt structure, the device tensors it created, its events."""

    batch: Any
    moved: list
    nbytes: int
    tensors: int          # tensors in the batch, moved or not (skipped keys aside)
    done: Any = None      # event recorded on the side stream after this batch's copies
    start: Any = None     # timing event recorded before them (time_copies=True only)


class Failure:
    """An exception from the source, carried to the step that would have consumed the batch."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def move_batch(host: Any, device: torch.device, skip: frozenset, non_blocking: bool) -> InFlight:
    """Move every tensor of ``host`` that is not on ``device`` yet; remember the new ones."""
    moved: list = []
    seen = [0]

    def to_device(t: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        if t.device == device:
            return t
        moved.append(t.to(device, non_blocking=non_blocking))
        return moved[-1]

    batch = map_tensors(host, to_device, skip)
    return InFlight(batch, moved, sum(t.numel() * t.element_size() for t in moved), seen[0])


class Epoch:
    """One pass over the source. Subclasses say how the next `InFlight` is obtained.

    Args:
        source: ``iter()`` of the prefetcher's iterable.
        device, skip, depth: the prefetcher's settings (copies: an epoch must not keep the
            prefetcher alive, so that dropping it closes the epoch).
        stats: the prefetcher's counters, updated at each batch handed out.
    """

    def __init__(self, source: Iterator, device: torch.device, skip: frozenset, depth: int, stats: PrefetchStats):
        self._source = source
        self._device = device
        self._skip = skip
        self._depth = depth
        self._stats = stats
        self._index = 0           # batches handed out in this epoch
        self._closed = False

    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        item = self._next_item()
        if item is END:
            self.close()
            raise StopIteration
        if isinstance(item, Failure):
            self.close()
            exc = item.exc
            if hasattr(exc, "add_note"):   # Python 3.11+
                exc.add_note(f"(raised by the source of StreamPrefetcher; surfaced at batch "
                             f"{self._index} of this epoch, the step that would have consumed it)")
            raise exc                      # the same object: its traceback still starts in the source
        self._index += 1
        stats = self._stats
        stats.batches += 1
        stats.data_wait_ms = (time.perf_counter() - t0) * 1e3
        stats.data_wait_ms_total += stats.data_wait_ms
        stats.bytes_copied += item.nbytes
        return item.batch

    def _next_item(self):
        raise NotImplementedError

    def close(self, join: bool = True) -> None:
        """Stop this epoch and drop what it holds; later ``next()`` calls raise StopIteration."""
        self._closed = True
        self._source = None     # lets a DataLoader iterator shut its workers down

    def __del__(self):
        try:
            self.close(join=False)      # never block inside the garbage collector
        except Exception:               # noqa: BLE001 - interpreter shutdown
            pass


class SyncEpoch(Epoch):
    """``depth=0``: pull and move each batch when it is asked for, on the current stream."""

    def _next_item(self):
        try:
            host = next(self._source)
        except StopIteration:
            return END
        except Exception as exc:       # noqa: BLE001
            return Failure(exc)
        # The stock, synchronous baseline: what Trainer/Accelerate do without prefetching.
        return move_batch(host, self._device, self._skip, non_blocking=False)
