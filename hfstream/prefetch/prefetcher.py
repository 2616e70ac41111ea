"""Copy the next batches to the device on a side stream, so that data movement hides behind compute.

The idea is NVIDIA Apex's ``data_prefetcher`` (apex/examples/imagenet/main_amp.py): keep the
host-to-device copies of the next batches in flight on a second stream and make the compute
stream wait for a batch only when that batch is used. The ordering rules (streams, events,
``Tensor.record_stream``, pinned memory for ``non_blocking`` copies) are those of PyTorch's
"CUDA semantics" notes. On CPU there is no copy to hide, so a background thread hides the data
preparation (collate, tokenisation) instead, as ``DataLoader`` workers do.

    >>> prefetcher = StreamPrefetcher(loader, device=device, depth=2)
    >>> for batch in prefetcher:              # batch k+1 and k+2 copy while batch k computes
    ...     loss = model(**batch).loss
    >>> prefetcher.stats.data_wait_ms         # how long the last step waited for its batch

This module is the facade; each way of prefetching is an epoch (one pass over the source):
`epoch` (what they share; depth 0), `thread` (CPU), `stream` (accelerator side stream).
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Iterable, Iterator, Optional, Union

import torch

from hfstream import streams
from hfstream.prefetch.epoch import Epoch, PrefetchStats, SyncEpoch
from hfstream.prefetch.stream import MAX_PENDING_TIMINGS, StagedEpoch, read_timings
from hfstream.prefetch.thread import JOIN_TIMEOUT_S, THREAD_PREFIX, ThreadEpoch

__all__ = ["StreamPrefetcher", "PrefetchStats", "THREAD_PREFIX", "depth_for_step"]

logger = logging.getLogger(__name__)


def depth_for_step(depth: int, batches_per_step: int) -> int:
    """The look-ahead to use when the consumer pulls ``batches_per_step`` batches before computing on the first.

    The Trainer's ``get_batch_samples`` pulls all ``gradient_accumulation_steps`` micro-batches
    of a step at once, and the consumer's stream waits for each batch's copy as it is handed
    out. With a look-ahead below that, the last micro-batches are first copied at that pull, so
    the step's first forward waits for copies issued just then. At least ``batches_per_step``
    batches in flight means every batch a step pulls was copied during the step before.
    ``depth=0`` (no prefetching) stays 0.

    >>> depth_for_step(2, 8)
    8
    """
    return depth if depth == 0 else max(depth, batches_per_step)


class StreamPrefetcher:
    """Yield the batches of ``iterable`` already on ``device``, with the next ones copied ahead.

    Args:
        iterable: the source of batches, e.g. a ``DataLoader`` (``pin_memory=True`` there saves
            the pinning step here). Each ``iter()`` on the prefetcher starts a fresh epoch from
            ``iter(iterable)`` and closes the previous epoch.
        device: where the tensors go. ``None``: this rank's accelerator (the current one, or
            ``LOCAL_RANK``'s where the script never set one: `streams.default_device`), else CPU.
        depth: batches in flight ahead of the one being consumed. On an accelerator, copies
            on a side stream; on CPU, batches prepared by a background thread. ``0``: no
            prefetching, a plain synchronous move on the current stream (the stock baseline).
        non_blocking: issue the side-stream copies with ``non_blocking=True`` (needs pinned
            host memory to be asynchronous).
        skip_keys: mapping keys whose values stay on the host, unchanged.
        stream_priority: ``"normal"``, ``"high"`` or a backend integer for the side stream.
        pin_memory: pin host tensors before copying (accelerator, ``depth >= 1`` only; tensors
            already pinned are left alone). ``None`` (auto): pin when ``non_blocking``, and stop
            trying if the backend cannot pin.
        time_copies: measure ``stats.copy_ms``/``copy_gbps`` with timing events (costs a little).
        batches_per_step: batches the consumer pulls before it computes on the first (the
            Trainer's ``gradient_accumulation_steps``): the look-ahead is raised to at least this
            (`depth_for_step` says why), logged once.
        source_issues_collectives: the source itself communicates across ranks (Accelerate's
            ``DataLoaderDispatcher`` broadcasts every batch from rank 0). It is then pulled only on
            the consumer's thread, in step order, so its collectives never interleave with the
            training step's: on an accelerator the copies still run ahead on the side stream; on
            CPU no background thread prepares batches (said once in the log). Accelerate's
            dispatcher moves each batch to the device itself before the broadcast, so the side
            stream finds nothing left to copy (also said once).

    Stopping early (``break``, an exception, garbage collection, ``close()``, leaving a ``with``
    block) stops the thread and frees the batches in flight. An exception from ``iterable``
    surfaces at the step that would have consumed that batch, after the batches before it;
    that epoch then ends.

    >>> for batch in StreamPrefetcher(loader, device=device, depth=2, skip_keys=("ids",)):
    ...     loss = model(**batch).loss
    """

    def __init__(
        self,
        iterable: Iterable,
        device: streams.DeviceLike = None,
        depth: int = 2,
        non_blocking: bool = True,
        skip_keys: Union[str, Iterable[str]] = (),
        stream_priority: Union[str, int] = "normal",
        pin_memory: Optional[bool] = None,
        time_copies: bool = False,
        source_issues_collectives: bool = False,
        batches_per_step: int = 1,
    ):
        if not (hasattr(type(iterable), "__iter__") or hasattr(type(iterable), "__getitem__")):
            raise TypeError(f"iterable must be iterable (a DataLoader, a list of batches, a "
                            f"generator), got {type(iterable).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"depth must be an int >= 0 (batches in flight; 0 = no prefetching), "
                            f"got {depth!r}")
        if depth < 0:
            raise ValueError(f"depth={depth} is negative; pass 0 (no prefetching) or a positive "
                             f"number of batches to keep in flight, e.g. 2")
        for name, value in (("non_blocking", non_blocking), ("time_copies", time_copies),
                            ("source_issues_collectives", source_issues_collectives)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if isinstance(batches_per_step, bool) or not isinstance(batches_per_step, int) or batches_per_step < 1:
            raise ValueError(f"batches_per_step={batches_per_step!r} is not valid; pass the number of batches "
                             f"pulled before the first is used (>= 1, e.g. gradient_accumulation_steps)")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be None (auto), True or False, got {pin_memory!r}")
        if isinstance(skip_keys, str):
            skip_keys = (skip_keys,)
        try:
            skip_keys = frozenset(skip_keys)
        except TypeError:
            raise TypeError(f"skip_keys must be a key or a collection of keys, e.g. "
                            f"('labels',), got {skip_keys!r}") from None
        self.iterable = iterable
        self.device = streams.resolve_device(device, arg="device")
        self.depth = depth_for_step(depth, batches_per_step)
        if self.depth != depth:
            _say_once(f"StreamPrefetcher: depth {depth} raised to {self.depth}, the batches a step pulls at once "
                      f"(gradient accumulation): with fewer in flight the step's first forward would wait for "
                      f"the copies of its last micro-batches, issued at that pull", logging.INFO)
        self.non_blocking = non_blocking
        self.skip_keys = skip_keys
        self.stream_priority = streams.stream_priority(stream_priority, arg="stream_priority")
        self.pin_memory = pin_memory
        self.time_copies = time_copies
        self.source_issues_collectives = source_issues_collectives
        self._pin = non_blocking if pin_memory is None else pin_memory
        self._stats = PrefetchStats()
        self._timings: collections.deque = collections.deque(maxlen=MAX_PENDING_TIMINGS)
        self._epoch: Optional[weakref.ref] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def stats(self) -> PrefetchStats:
        """Counters and the last step's timings (see ``PrefetchStats``); never blocks."""
        read_timings(self._timings, self._stats)
        return self._stats

    def __len__(self) -> int:
        try:
            return len(self.iterable)
        except TypeError:
            raise TypeError(f"StreamPrefetcher has no len() because its source "
                            f"({type(self.iterable).__name__}) has none") from None

    def __iter__(self) -> Iterator:
        self.close()     # one epoch at a time: two threads must never pull from one DataLoader
        source = iter(self.iterable)
        settings = (source, self.device, self.skip_keys, self.depth, self._stats)
        if self.depth == 0:
            epoch: Epoch = SyncEpoch(*settings)
        elif streams.is_accelerator(self.device):
            if streams.has_side_streams(self.device):
                epoch = StagedEpoch(*settings, side=_side_stream(self.device, self.stream_priority),
                                    non_blocking=self.non_blocking, pin=self._pin, auto_pin=self.pin_memory is None,
                                    timings=self._timings if self.time_copies else None, note=_say_once)
            else:
                _say_once(f"StreamPrefetcher: {self.device.type} has no side streams in this torch; batches are "
                          f"copied on the current stream when they are used (no copy overlaps compute)")
                epoch = SyncEpoch(*settings)
        elif self.source_issues_collectives:
            # A background thread would issue the source's collectives concurrently with the
            # training step's, in a different order on each rank: a hang or a mismatch.
            _say_once("StreamPrefetcher: the data loader communicates across ranks (batches dispatched from "
                      "rank 0), so on CPU it is read on the training thread: data preparation is not hidden")
            epoch = SyncEpoch(*settings)
        else:
            epoch = ThreadEpoch(*settings)
            self._thread = epoch.thread
        self._epoch = weakref.ref(epoch)
        return epoch

    def close(self) -> None:
        """Stop the current epoch: end its thread and free the batches in flight."""
        epoch = self._epoch() if self._epoch is not None else None
        if epoch is not None:
            epoch.close()
        # An epoch already collected (e.g. after `break`) was closed without a join; its thread
        # may still be inside next(source). Wait for it before anyone calls iter(iterable) again:
        # a persistent-workers DataLoader hands out the same iterator again.
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_S)
        self._thread = None
        self._epoch = None

    def __enter__(self) -> "StreamPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# One side stream per (device, priority), shared by all prefetchers. The caching allocator
# keeps freed blocks per stream, so a new stream per prefetcher (say, one per epoch) would
# strand each old stream's cached blocks: reserved memory would grow with every new one.
_SIDE_STREAMS: dict = {}


_SAID: set = set()


def _say_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.log(level, message)


def _side_stream(device: torch.device, priority: int):
    key = (device, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = streams.new_stream(device, priority)
    return _SIDE_STREAMS[key]
