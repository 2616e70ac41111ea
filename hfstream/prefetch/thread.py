"""CPU prefetching: a background thread prepares the next batches, as ``DataLoader`` workers do.

On CPU there is no copy to hide, so the thread hides the data preparation (collate,
tokenisation) behind the step instead. A bounded queue keeps the look-ahead at ``depth``.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
import warnings
from typing import Callable, Iterator

import torch

from hfstream.prefetch.epoch import END, Epoch, Failure, PrefetchStats, move_batch

THREAD_PREFIX = "hfstream-prefetch"
_POLL_S = 0.05            # how often a blocked producer/consumer re-checks the stop flag
JOIN_TIMEOUT_S = 30.0     # close() waits this long for a producer stuck inside the source
_thread_ids = itertools.count()


def produce(source: Iterator, prepare: Callable, out: queue.Queue, stop: threading.Event,
            produced=None) -> None:
    """Body of the background thread: pull, prepare, put, until the end, an error, or stop.

    ``produced`` (a bounded deque, `PrefetchStats.produced`) gets ``(start, end, cpu_ms)`` per
    batch: the wall interval of pulling and preparing it and this thread's CPU time in it.

    It holds no reference to the epoch or the prefetcher, so dropping those lets the garbage
    collector close them (which sets ``stop``) while this thread is still running.
    """
    while not stop.is_set():
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            item = prepare(next(source))
            if produced is not None:
                produced.append((t0, time.perf_counter(), (time.thread_time() - c0) * 1e3))
        except StopIteration:
            item = END
        except BaseException as exc:   # noqa: BLE001 - re-raised in the consumer, at its step
            item = Failure(exc)
        # Never a bare put(): once the consumer stops reading (break, error, GC) a blocking put
        # on the full queue would keep this thread, and the batches it holds, alive forever.
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if item is END or isinstance(item, Failure):
            return


class ThreadEpoch(Epoch):
    """CPU: a background thread keeps up to ``depth`` prepared batches in a bounded queue.

    At most ``depth`` batches wait in the queue and one more is being prepared by the thread.
    """

    def __init__(self, source: Iterator, device: torch.device, skip: frozenset, depth: int, stats: PrefetchStats):
        super().__init__(source, device, skip, depth, stats)
        self._queue: queue.Queue = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        prepare = functools.partial(move_batch, device=self._device, skip=self._skip, non_blocking=False)
        self.thread = threading.Thread(
            target=produce, args=(source, prepare, self._queue, self._stop, stats.produced),
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
                        return END

    def close(self, join: bool = True) -> None:
        super().close(join)
        self._stop.set()
        self._drain()
        if join and self.thread is not threading.current_thread():
            self.thread.join(JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                warnings.warn(f"{self.thread.name}: the source did not return within "
                              f"{JOIN_TIMEOUT_S:.0f} s; the thread exits as soon as it does")
            self._drain()      # a put that was already under way during the first drain

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
