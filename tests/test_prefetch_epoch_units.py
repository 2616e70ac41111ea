"""`prefetch_epoch`: what every epoch shares, on a scripted clock and the meta device.

The counters a step reads (`PrefetchStats`), `move_batch`'s count of what it moved and what it
found in place, the note an exception from the source carries to its step, and an epoch that
is closed (by hand, at its end, or by the garbage collector) staying closed.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hfstream.prefetch import epoch as prefetch_epoch
from hfstream.prefetch.epoch import PRODUCED_KEPT, Epoch, Failure, PrefetchStats, SyncEpoch, move_batch

META = torch.device("meta")


class Clock:
    """``time.perf_counter`` on a script: each call returns the next value."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_stats_of_each_batch_are_its_own_wait_and_the_totals_add_up(monkeypatch):
    # Two batches: the first waits 3 ms, the second 5 ms (enter, leave per __next__).
    monkeypatch.setattr(prefetch_epoch.time, "perf_counter", Clock(1.000, 1.003, 2.000, 2.005, 3.0))
    stats = PrefetchStats()
    src = [{"x": torch.ones(4)}, {"x": torch.ones(2, 3), "y": torch.ones(1, dtype=torch.float64)}]
    it = SyncEpoch(iter(src), META, frozenset(), 0, stats)
    next(it)
    assert stats.batches == 1 and stats.data_wait_ms == pytest.approx(3.0)
    assert stats.bytes_copied == 16
    next(it)
    assert stats.batches == 2 and stats.data_wait_ms == pytest.approx(5.0)
    assert stats.data_wait_ms_total == pytest.approx(8.0)
    assert stats.mean_data_wait_ms == pytest.approx(4.0)
    assert stats.bytes_copied == 16 + 24 + 8
    with pytest.raises(StopIteration):
        next(it)
    assert stats.batches == 2     # the end is not a batch


def test_a_new_prefetcher_has_counted_nothing():
    s = PrefetchStats()
    assert (s.batches, s.data_wait_ms, s.data_wait_ms_total, s.bytes_copied) == (0, 0.0, 0.0, 0)
    assert (s.copy_ms, s.copy_gbps, s.copy_ms_total, s.copies_timed) == (None, None, 0.0, 0)
    assert s.mean_data_wait_ms == 0.0
    assert len(s.produced) == 0 and s.produced.maxlen == PRODUCED_KEPT


def test_the_end_of_the_source_closes_the_epoch_and_lets_go_of_it():
    it = SyncEpoch(iter([{"x": torch.ones(1)}]), META, frozenset(), 0, PrefetchStats())
    next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert it._closed and it._source is None   # a DataLoader iterator can shut its workers down


def test_move_batch_counts_every_tensor_and_the_bytes_of_those_it_moved():
    on_device = torch.ones(5, device=META)
    host = {"a": torch.ones(3), "b": on_device, "c": [torch.ones(2, dtype=torch.int64)], "s": "text",
            "k": torch.ones(7)}
    item = move_batch(host, META, frozenset({"k"}), non_blocking=False)
    assert item.tensors == 3                    # a, b, c[0]; the skipped key is not looked at
    assert len(item.moved) == 2                 # b was already there
    assert item.nbytes == 3 * 4 + 2 * 8
    assert item.batch["b"] is on_device and item.batch["k"] is host["k"] and item.batch["s"] == "text"
    assert item.batch["a"].device == META and item.batch["c"][0].device == META


def test_an_exception_from_the_source_names_the_batch_it_surfaced_at():
    def source():
        yield {"x": torch.ones(1)}
        yield {"x": torch.ones(1)}
        raise KeyError("row 17")

    it = SyncEpoch(source(), META, frozenset(), 0, PrefetchStats())
    next(it), next(it)
    with pytest.raises(KeyError) as info:
        next(it)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and "surfaced at batch 2 of this epoch" in notes[0]
    with pytest.raises(StopIteration):     # the epoch is closed by the failure
        next(it)


class FailsOnce:
    """An iterator whose third item raises, and which would go on after it."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        if self.i == 3:
            raise KeyError("row 3")
        return {"i": self.i}


def test_a_failure_ends_the_epoch_even_where_the_source_could_go_on():
    it = SyncEpoch(FailsOnce(), META, frozenset(), 0, PrefetchStats())
    assert [next(it)["i"], next(it)["i"]] == [1, 2]
    with pytest.raises(KeyError):
        next(it)
    assert it._source is None
    with pytest.raises(StopIteration):
        next(it)


def test_a_failure_is_raised_as_the_same_object():
    exc = ValueError("bad")

    class One(Epoch):
        def _next_item(self):
            return Failure(exc)

    with pytest.raises(ValueError) as info:
        next(One(iter(()), META, frozenset(), 1, PrefetchStats()))
    assert info.value is exc


def test_close_stops_the_epoch_and_lets_go_of_the_source():
    src = iter([{"x": torch.ones(1)}] * 3)
    it = SyncEpoch(src, META, frozenset(), 0, PrefetchStats())
    next(it)
    it.close()
    assert it._source is None
    with pytest.raises(StopIteration):
        next(it)


def test_an_epoch_the_garbage_collector_takes_is_closed_without_joining():
    closed = []

    class Watched(SyncEpoch):
        def close(self, join=True):
            closed.append(join)
            super().close(join)

    it = Watched(iter([]), META, frozenset(), 0, PrefetchStats())
    del it
    gc.collect()
    assert closed == [False]
