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
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from hfstream import streams
from hfstream.batches import map_tensors

logger = logging.getLogger(__name__)

THREAD_PREFIX = "hfstream-prefetch"
_POLL_S = 0.05            # how often a blocked producer/consumer re-checks the stop flag
_JOIN_TIMEOUT_S = 30.0    # close() waits this long for a producer stuck inside the source
_MAX_PENDING_TIMINGS = 64 # copy timings not yet readable; older ones are dropped, never waited on
_thread_ids = itertools.count()
_END = object()           # the source is exhausted


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
    """

    batches: int = 0
    data_wait_ms: float = 0.0
    data_wait_ms_total: float = 0.0
    bytes_copied: int = 0
    copy_ms: Optional[float] = None
    copy_gbps: Optional[float] = None
    copy_ms_total: float = 0.0
    copies_timed: int = 0

    @property
    def mean_data_wait_ms(self) -> float:
        return self.data_wait_ms_total / self.batches if self.batches else 0.0


@dataclasses.dataclass
class _Batch:
    """A batch on its way: the rebuilt structure, the device tensors it created, its events."""

    batch: Any
    moved: list
    nbytes: int
    done: Any = None      # event recorded on the side stream after this batch's copies
    start: Any = None     # timing event recorded before them (time_copies=True only)


class _Failure:
    """An exception from the source, carried to the step that would have consumed the batch."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def _move_batch(host: Any, device: torch.device, skip: frozenset, non_blocking: bool) -> _Batch:
    """Move every tensor of ``host`` that is not on ``device`` yet; remember the new ones."""
    moved: list = []

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        moved.append(t.to(device, non_blocking=non_blocking))
        return moved[-1]

    batch = map_tensors(host, to_device, skip)
    return _Batch(batch, moved, sum(t.numel() * t.element_size() for t in moved))


def _produce(source: Iterator, prepare: Callable, out: queue.Queue, stop: threading.Event) -> None:
    """Body of the background thread: pull, prepare, put, until the end, an error, or stop.

    It holds no reference to the epoch or the prefetcher, so dropping those lets the garbage
    collector close them (which sets ``stop``) while this thread is still running.
    """
    while not stop.is_set():
        try:
            item = prepare(next(source))
        except StopIteration:
            item = _END
        except BaseException as exc:   # noqa: BLE001 - re-raised in the consumer, at its step
            item = _Failure(exc)
        # Never a bare put(): once the consumer stops reading (break, error, GC) a blocking put
        # on the full queue would keep this thread, and the batches it holds, alive forever.
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if item is _END or isinstance(item, _Failure):
            return


class _Epoch:
    """One pass over the source. Subclasses say how the next ``_Batch`` is obtained."""

    def __init__(self, source: Iterator, prefetcher: "StreamPrefetcher"):
        # Copies of the prefetcher's settings, not the prefetcher: an epoch must not keep it alive.
        self._source = source
        self._device = prefetcher.device
        self._skip = prefetcher.skip_keys
        self._depth = prefetcher.depth
        self._stats = prefetcher._stats
        self._index = 0           # batches handed out in this epoch
        self._closed = False

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        item = self._next_item()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
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


class _SyncEpoch(_Epoch):
    """``depth=0``: pull and move each batch when it is asked for, on the current stream."""

    def _next_item(self):
        try:
            host = next(self._source)
        except StopIteration:
            return _END
        except Exception as exc:       # noqa: BLE001
            return _Failure(exc)
        # The stock, synchronous baseline: what Trainer/Accelerate do without prefetching.
        return _move_batch(host, self._device, self._skip, non_blocking=False)


class _ThreadEpoch(_Epoch):
    """CPU: a background thread keeps up to ``depth`` prepared batches in a bounded queue.

    At most ``depth`` batches wait in the queue and one more is being prepared by the thread.
    """

    def __init__(self, source: Iterator, prefetcher: "StreamPrefetcher"):
        super().__init__(source, prefetcher)
        self._queue: queue.Queue = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        prepare = functools.partial(_move_batch, device=self._device, skip=self._skip,
                                    non_blocking=False)
        self.thread = threading.Thread(
            target=_produce, args=(source, prepare, self._queue, self._stop),
            name=f"{THREAD_PREFIX}-{next(_thread_ids)}", daemon=True)
        self.thread.start()
        self._source = None    # the thread owns the iterator now; two threads must never share it

    def _next_item(self):
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive():      # it put its last item before it exited
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _END

    def close(self, join: bool = True) -> None:
        super().close(join)
        self._stop.set()
        self._drain()
        if join and self.thread is not threading.current_thread():
            self.thread.join(_JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                warnings.warn(f"{self.thread.name}: the source did not return within "
                              f"{_JOIN_TIMEOUT_S:.0f} s; the thread exits as soon as it does")
            self._drain()      # a put that was already under way during the first drain

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


class _StagedEpoch(_Epoch):
    """Accelerator: ``depth`` batches are copied ahead on a side stream, one event per batch."""

    def __init__(self, source: Iterator, prefetcher: "StreamPrefetcher"):
        super().__init__(source, prefetcher)
        self._side = _side_stream(prefetcher.device, prefetcher.stream_priority)
        self._non_blocking = prefetcher.non_blocking
        self._pin = prefetcher._pin
        self._auto_pin = prefetcher.pin_memory is None
        self._time = prefetcher.time_copies
        self._timings = prefetcher._timings
        self._staged: collections.deque = collections.deque()
        self._fill()     # start copying at iter(), like DataLoader workers start at iter()

    def _next_item(self):
        if not self._staged:
            return _END
        item = self._staged.popleft()
        if isinstance(item, _Failure):
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
            _read_timings(self._timings, self._stats)
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
                self._staged.append(_Failure(exc))
                return
            try:
                self._staged.append(self._stage(host))
            except Exception as exc:   # noqa: BLE001 - e.g. out of memory: surfaces at its step
                self._source = None
                self._staged.append(_Failure(exc))
                return

    def _stage(self, host: Any) -> _Batch:
        # Pin first, on the host: a non_blocking copy from pageable memory is not asynchronous,
        # and pinning inside the timed span would count host time as copy time.
        if self._pin:
            host = map_tensors(host, self._pinned, self._skip)
        with streams.use_stream(self._side):
            start = None
            if self._time:
                start = streams.new_event(self._device, enable_timing=True)
                start.record(self._side)
            item = _move_batch(host, self._device, self._skip, self._non_blocking)
            item.done = streams.new_event(self._device, enable_timing=self._time)
            item.done.record(self._side)
            item.start = start
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


class StreamPrefetcher:
    """Yield the batches of ``iterable`` already on ``device``, with the next ones copied ahead.

    Args:
        iterable: the source of batches, e.g. a ``DataLoader`` (``pin_memory=True`` there saves
            the pinning step here). Each ``iter()`` on the prefetcher starts a fresh epoch from
            ``iter(iterable)`` and closes the previous epoch.
        device: where the tensors go. ``None``: the current accelerator
            (``torch.accelerator.current_accelerator()``), else CPU.
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
        source_issues_collectives: the source itself communicates across ranks (Accelerate's
            ``DataLoaderDispatcher`` broadcasts every batch from rank 0). It is then pulled only on
            the consumer's thread, in step order, so its collectives never interleave with the
            training step's: on an accelerator the copies still run ahead on the side stream; on
            CPU no background thread prepares batches (said once in the log).

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
        self.depth = depth
        self.non_blocking = non_blocking
        self.skip_keys = skip_keys
        self.stream_priority = streams.stream_priority(stream_priority, arg="stream_priority")
        self.pin_memory = pin_memory
        self.time_copies = time_copies
        self.source_issues_collectives = source_issues_collectives
        self._pin = non_blocking if pin_memory is None else pin_memory
        self._stats = PrefetchStats()
        self._timings: collections.deque = collections.deque(maxlen=_MAX_PENDING_TIMINGS)
        self._epoch: Optional[weakref.ref] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def stats(self) -> PrefetchStats:
        """Counters and the last step's timings (see ``PrefetchStats``); never blocks."""
        _read_timings(self._timings, self._stats)
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
        if self.depth == 0:
            epoch: _Epoch = _SyncEpoch(source, self)
        elif streams.is_accelerator(self.device):
            if streams.has_side_streams(self.device):
                epoch = _StagedEpoch(source, self)
            else:
                _say_once(f"StreamPrefetcher: {self.device.type} has no side streams in this torch; batches are "
                          f"copied on the current stream when they are used (no copy overlaps compute)")
                epoch = _SyncEpoch(source, self)
        elif self.source_issues_collectives:
            # A background thread would issue the source's collectives concurrently with the
            # training step's, in a different order on each rank: a hang or a mismatch.
            _say_once("StreamPrefetcher: the data loader communicates across ranks (batches dispatched from "
                      "rank 0), so on CPU it is read on the training thread: data preparation is not hidden")
            epoch = _SyncEpoch(source, self)
        else:
            epoch = _ThreadEpoch(source, self)
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
            self._thread.join(_JOIN_TIMEOUT_S)
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


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)


def _side_stream(device: torch.device, priority: int):
    key = (device, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = streams.new_stream(device, priority)
    return _SIDE_STREAMS[key]


def _read_timings(timings: collections.deque, stats: PrefetchStats) -> None:
    """Fold the copy timings that have completed into ``stats``, oldest first; never blocks."""
    # query() never waits; elapsed_time() on an event still pending would raise (or stall).
    while timings and timings[0][1].query():
        start, end, nbytes = timings.popleft()
        ms = start.elapsed_time(end)
        stats.copy_ms = ms
        stats.copy_ms_total += ms
        stats.copies_timed += 1
        stats.copy_gbps = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None
