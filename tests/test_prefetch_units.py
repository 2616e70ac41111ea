"""`StreamPrefetcher` itself (`prefetch.py`), where its epochs' tests do not reach: which epoch a setting builds
and what it tells, pinning's default, the stats reading timings that completed after the last batch,
and one epoch at a time.

The accelerator path runs on the fake streams of `test_prefetch.py` (meta device).
"""

from __future__ import annotations

import logging

import pytest
import torch

import hfstream.prefetch.prefetcher as prefetch
from hfstream.prefetch.prefetcher import StreamPrefetcher
from test_prefetch import FakeEvent, fake_accelerator  # noqa: F401 - the fixture is used by name


def batches(n):
    return [{"x": torch.ones(3), "i": i} for i in range(n)]


@pytest.mark.parametrize("non_blocking, pin_memory, pinned", [
    (True, None, True),     # the default follows non_blocking: a non-blocking copy needs pinned memory
    (False, None, False),
    (True, False, False),
    (False, True, True),
])
def test_pinning_follows_non_blocking_unless_asked(fake_accelerator, monkeypatch, non_blocking, pin_memory, pinned):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: calls.append(t.shape) or t.clone())
    out = list(StreamPrefetcher(batches(3), device="meta", depth=2, non_blocking=non_blocking, pin_memory=pin_memory))
    assert [b["i"] for b in out] == [0, 1, 2]
    assert len(calls) == (3 if pinned else 0)


def test_stats_read_the_copy_timings_that_completed_after_the_last_batch(fake_accelerator, monkeypatch):
    done = {"now": False}
    monkeypatch.setattr(FakeEvent, "query", lambda self: done["now"])
    p = StreamPrefetcher(batches(4), device="meta", depth=2, time_copies=True)
    assert [b["i"] for b in p] == [0, 1, 2, 3]
    assert p.stats.copies_timed == 0          # not readable yet: nothing waits for them
    done["now"] = True
    s = p.stats                               # reading the stats folds them, without a step
    assert s.copies_timed == 4 and s.copy_ms == 2.0


def test_a_second_epoch_closes_the_first_and_its_thread(monkeypatch):
    def endless():
        i = 0
        while True:
            yield {"i": i}
            i += 1

    p = StreamPrefetcher(endless(), device="cpu", depth=2)
    first = iter(p)
    assert next(first)["i"] == 0
    thread = p._thread
    assert thread is not None and thread.is_alive()
    second = iter(p)
    assert not thread.is_alive()               # joined: two threads never pull from one source
    with pytest.raises(StopIteration):
        next(first)                            # the first epoch is over
    assert next(second)["i"] > 0               # the same iterator goes on in the second
    p.close()


def test_a_source_that_communicates_is_read_on_the_training_thread_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger=prefetch.__name__):
        for _ in range(2):
            p = StreamPrefetcher(batches(3), device="cpu", depth=2, source_issues_collectives=True)
            assert [b["i"] for b in p] == [0, 1, 2]
            assert p._thread is None           # no background thread issues collectives
    said = [r.getMessage() for r in caplog.records if "communicates across ranks" in r.getMessage()]
    assert len(said) == 1 and "data preparation is not hidden" in said[0]
