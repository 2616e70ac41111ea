"""The CPU prefetch thread's life (`hfstream.prefetch.thread.ThreadEpoch`): what a user relies on.

- at the end of its source (or at its error) the thread stops by itself and never pulls again;
- an epoch's ``close()`` joins the thread (gone on return, no waiting), warns only when the
  source does not return in time, and lets go of the batches it had prepared.

Waits here are on events and joins with a hang guard, never on a speed threshold.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import pytest
import torch

import hfstream.prefetch.thread as prefetch_thread
from hfstream.prefetch.prefetcher import StreamPrefetcher

GUARD_S = 30.0   # a hang guard, not a speed threshold


class Counting:
    """An iterator over ``n`` batches that counts every ``next()`` asked of it (then fails, if told)."""

    def __init__(self, n: int, fail: bool = False):
        self.n, self.fail, self.calls = n, fail, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        if self.calls > self.n:
            if self.fail:
                raise ValueError("the source broke")
            raise StopIteration
        return {"x": torch.full((2,), float(self.calls))}


@pytest.mark.parametrize("fail", [False, True])
def test_the_thread_stops_by_itself_at_the_end_of_its_source_and_never_pulls_again(fail):
    source = Counting(2, fail=fail)
    epoch = iter(StreamPrefetcher(source, device="cpu", depth=4))   # room for every item: it never blocks
    epoch.thread.join(GUARD_S)
    assert not epoch.thread.is_alive(), "the thread outlived its source's end"
    assert source.calls == 3          # two batches, then the end (or the error), asked once
    assert [float(b["x"][0]) for b in [next(epoch), next(epoch)]] == [1.0, 2.0]
    with pytest.raises(ValueError if fail else StopIteration):
        next(epoch)


def test_an_epochs_close_joins_its_thread_and_does_not_warn():
    epoch = iter(StreamPrefetcher(Counting(100), device="cpu", depth=2))
    next(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epoch.close()
    assert not epoch.thread.is_alive()   # joined: gone on return, without waiting for it


def test_close_warns_when_the_source_does_not_return_in_time(monkeypatch):
    monkeypatch.setattr(prefetch_thread, "JOIN_TIMEOUT_S", 0.01)
    inside, release = threading.Event(), threading.Event()

    def stuck():
        yield {"x": torch.zeros(1)}
        inside.set()
        release.wait(GUARD_S)          # a network read that hangs
        yield {"x": torch.ones(1)}

    epoch = iter(StreamPrefetcher(stuck(), device="cpu", depth=1))
    next(epoch)
    assert inside.wait(GUARD_S)
    with pytest.warns(UserWarning, match="did not return within"):
        epoch.close()
    release.set()
    epoch.thread.join(GUARD_S)
    assert not epoch.thread.is_alive()


def test_close_lets_go_of_the_batches_it_prepared():
    refs = []

    def make(i):
        t = torch.full((1000,), float(i))
        refs.append(weakref.ref(t))
        return {"x": t}

    def source():
        for i in range(10):
            yield make(i)

    depth = 3
    epoch = iter(StreamPrefetcher(source(), device="cpu", depth=depth))
    held = next(epoch)
    deadline = time.monotonic() + GUARD_S   # a hang guard: the thread fills the queue and holds one more
    while len(refs) < 1 + depth + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    epoch.close()
    gc.collect()
    # the queue held batches 1-3 and the thread one more: none of them is referenced after close()
    prepared = refs[1:]
    assert len(prepared) == depth + 1 and held["x"] is refs[0]()
    assert [r() for r in prepared] == [None] * len(prepared)


def blocked_after(n, release):
    """A source that hands out ``n`` batches, then waits (inside ``next()``) until ``release``."""
    for i in range(n):
        yield {"x": torch.full((2,), float(i))}
    release.wait(GUARD_S)
    yield {"x": torch.zeros(2)}


def filled_epoch(depth, release):
    epoch = iter(StreamPrefetcher(blocked_after(depth, release), device="cpu", depth=depth))
    deadline = time.monotonic() + GUARD_S   # a hang guard: wait until the queue holds every batch
    while epoch._queue.qsize() < depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert epoch._queue.qsize() == depth
    return epoch


def test_a_close_without_join_frees_the_queue_at_once_and_never_joins():
    # The garbage collector's close (join=False) must not wait for a thread stuck in its source,
    # and must still let go of the prepared batches then, not when the thread next wakes up.
    release = threading.Event()
    epoch = filled_epoch(3, release)
    joins = []
    real_join = epoch.thread.join
    epoch.thread.join = lambda *a, **k: joins.append(a)
    epoch.close(join=False)
    assert joins == [] and epoch._queue.qsize() == 0
    with pytest.raises(StopIteration):
        next(epoch)                     # at once: not after the stuck source returns
    assert epoch.thread.is_alive()      # (it is still inside the source)
    release.set()
    real_join(GUARD_S)
    assert not epoch.thread.is_alive()
    assert epoch._queue.qsize() == 0    # the batch it pulled after the stop is not queued


def test_the_thread_notes_each_batch_it_prepared():
    stats_source = Counting(5)
    p = StreamPrefetcher(stats_source, device="cpu", depth=2)
    assert len(list(p)) == 5
    produced = list(p.stats.produced)
    assert len(produced) == 5
    assert all(start <= end and cpu_ms >= 0.0 for start, end, cpu_ms in produced)
    assert [a[0] for a in produced] == sorted(a[0] for a in produced)


def test_a_source_slower_than_the_consumers_poll_still_yields_every_batch():
    # The consumer polls every _POLL_S; a producer that takes longer than that per batch is
    # alive and must be waited for, not taken for an ended epoch.
    def slow():
        for i in range(3):
            time.sleep(3 * prefetch_thread._POLL_S)
            yield {"i": i}

    assert [b["i"] for b in StreamPrefetcher(slow(), device="cpu", depth=2)] == [0, 1, 2]


def test_the_producers_cpu_time_is_its_own_and_in_milliseconds():
    def computes():
        for i in range(2):
            c = time.thread_time()
            while time.thread_time() - c < 0.02:   # 20 ms of this thread's CPU, by its own clock
                pass
            yield {"i": i}

    p = StreamPrefetcher(computes(), device="cpu", depth=1)
    assert len(list(p)) == 2
    for start, end, cpu_ms in p.stats.produced:
        assert 20.0 <= cpu_ms <= (end - start) * 1e3 + 1.0


@pytest.mark.parametrize("fail", [False, True])
def test_the_last_item_put_just_after_the_consumers_poll_timed_out_is_still_delivered(fail):
    # The race the liveness check covers: the consumer's timed get() gives up, the thread then puts
    # its last item (the end, or the source's error) and exits. Played deterministically: the
    # thread has finished, and the consumer's timed get() is made to miss what is queued.
    import queue

    epoch = iter(StreamPrefetcher(Counting(0, fail=fail), device="cpu", depth=2))
    epoch.thread.join(GUARD_S)
    assert not epoch.thread.is_alive() and epoch._queue.qsize() == 1

    real_get = epoch._queue.get

    def missed(block=True, timeout=None):
        if block:                      # the timed get() misses; get_nowait() (block=False) sees it
            raise queue.Empty
        return real_get(block=False)

    epoch._queue.get = missed
    with pytest.raises(ValueError if fail else StopIteration):
        next(epoch)


def test_a_batch_put_while_close_joins_is_let_go_of_too():
    # The other race: the producer was inside put() when close() drained, and its batch lands in
    # the queue while close() joins the thread. Played deterministically: the join puts it.
    release = threading.Event()
    epoch = filled_epoch(2, release)
    real_join = epoch.thread.join

    def join_after_a_late_put(timeout=None):
        epoch._queue.put_nowait({"x": torch.ones(2)})
        release.set()
        real_join(timeout)

    epoch.thread.join = join_after_a_late_put
    epoch.close()
    assert not epoch.thread.is_alive() and epoch._queue.qsize() == 0


def test_produce_notes_each_batchs_interval_and_cpu_time_exactly(monkeypatch):
    # Scripted clocks: the interval is perf_counter's, the CPU time thread_time's, in ms exactly
    # (the third pair is read before the source ends, and not noted).
    import collections
    import queue
    import types
    walls, cpus = iter([10.0, 10.5, 11.0, 11.25, 12.0]), iter([2.0, 2.125, 3.0, 3.0625, 4.0])
    monkeypatch.setattr(prefetch_thread, "time",
                        types.SimpleNamespace(perf_counter=lambda: next(walls), thread_time=lambda: next(cpus)))
    out, produced = queue.Queue(), collections.deque()
    prefetch_thread.produce(iter([1, 2]), lambda x: x * 10, out, threading.Event(), produced)
    assert [out.get_nowait() for _ in range(3)] == [10, 20, prefetch_thread.END]
    assert list(produced) == [(10.0, 10.5, 125.0), (11.0, 11.25, 62.5)]
